"""tiered_kv/cold/store.py: entry format 3 — one safetensors file, chunked xxh3 per tensor,
splittable layer tensors stored token-major."""

from __future__ import annotations

import json
import os
import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tests.fixtures import big_kv, flip_byte, with_tensors
from tiered_kv.cold import checksums, codec, encode, scan, store
from tiered_kv.cold.backend import FileBackend
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config


def test_file_is_standard_safetensors_with_chunk_digests(tmp_path):
    caches = [big_kv(10_000), big_kv(10_000)]  # ~10 MB per tensor: several chunks each
    job = codec.prepare(np.arange(10_000, dtype=np.int32), caches, None, "fp")
    b = FileBackend(tmp_path)
    b.put("e1", encode.encode(job.tokens, job.tensors, job.metadata))
    path = b.path("e1")
    arrays, meta = mx.load(str(path), return_metadata=True)  # any safetensors reader works
    stored = mx.swapaxes(caches[0].keys[..., :10_000, :], 1, 2)  # token-major on disk
    assert mx.array_equal(arrays["0.keys"], stored).item()  # type: ignore[index]
    assert meta["format_version"] == "3" and int(meta["chunk_bytes"]) == checksums.CHUNK_BYTES  # type: ignore[index]
    header = store.read_header(path, "fp")
    nbytes = caches[0].keys[..., :10_000, :].nbytes
    assert len(header.digests("0.keys")) == 16 * -(-nbytes // checksums.CHUNK_BYTES) > 16
    assert header.token_major == {"0.keys", "0.values", "1.keys", "1.values"}
    assert header.shape("0.keys") == (1, 4, 10_000, 128)
    scan.check_data(path, header)


def test_tensors_without_token_rows_keep_their_order(tmp_path):
    """A rotating window that wrapped (fewer rows than tokens) is not token-major."""
    r = C.RotatingKVCache(max_size=16)
    for _ in range(40):
        r.update_and_fetch(mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8)))
    job = codec.prepare(np.arange(40, dtype=np.int32), [r], None, "fp")
    enc = encode.encode(job.tokens, job.tensors, job.metadata)
    header = store.parse_buffer(memoryview(enc.join()), "fp")
    assert header.token_major == frozenset()
    assert all(header.shape(k) == tuple(t["shape"]) for k, t in header.tensors.items())


@pytest.mark.parametrize("bad", ['["tokens"]', '["nope"]', '"0.keys"', "[", '["0.keys", 3]'])
def test_a_bad_token_major_list_is_corrupt(bad):
    job = codec.prepare(np.arange(32, dtype=np.int32), [big_kv(32)], None, "fp")
    raw = encode.encode(job.tokens, job.tensors, job.metadata).join()
    import json

    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    meta["token_major"] = bad
    new = store.header_bytes(head, meta)
    with pytest.raises(store.CorruptEntry, match="token_major"):
        store.parse_buffer(memoryview(struct.pack("<Q", len(new)) + new + raw[8 + n :]))


@pytest.mark.parametrize("field", ["token_major", "xxh3"])
def test_a_metadata_list_nested_past_the_stack_is_corrupt(field):
    """A re-signed header (its checksum is public) whose ``token_major`` list or ``xxh3`` table
    is JSON nested 100 000 deep: json raised RecursionError, which the parse did not catch for
    these two (it did for the header itself) — out of every reader of the entry (a 500 on a
    load, a shared fetch). It is a corrupt entry."""
    import json

    job = codec.prepare(np.arange(32, dtype=np.int32), [big_kv(32)], None, "fp")
    raw = encode.encode(job.tokens, job.tensors, job.metadata).join()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    meta[field] = "[" * 100_000 + "]" * 100_000
    new = store.header_bytes(head, meta)
    with pytest.raises(store.CorruptEntry):
        store.parse_buffer(memoryview(struct.pack("<Q", len(new)) + new + raw[8 + n :]))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_any_chunk_of_a_large_file_is_a_miss(tmp_path, where):
    tier = ColdTier(tmp_path, "fp", Config(cache_dir=tmp_path, block_tokens=256))
    ids = np.arange(12_000)
    tier.persist(ids, [big_kv(12_000), big_kv(12_000)])  # ~48 MB, 12+ chunks
    (path,) = tier.dir.glob("*.safetensors")
    header = store.read_header(path)
    start, size = header.data_start, path.stat().st_size
    offset = {"first": start + 5, "middle": (start + size) // 2, "last": size - 1}[where]
    flip_byte(path, offset)
    hit = tier.lookup(ids)
    assert hit is not None
    assert tier.load(hit) is None  # detected before anything is served
    assert tier.stats()["quarantined"] == 1 and tier.lookup(ids) is None
    tier.close()


def test_symlinked_entry_file_is_never_followed(tmp_path):
    tier = ColdTier(tmp_path / "kv", "fp", Config(cache_dir=tmp_path / "kv", block_tokens=16))
    tier.persist(np.arange(32), [big_kv(32)])
    (path,) = tier.dir.glob("*.safetensors")
    outside = tmp_path / "outside.safetensors"
    os.replace(path, outside)
    os.symlink(outside, path)
    with pytest.raises(store.CorruptEntry):
        store.read_header(path)
    assert tier.load(tier.lookup(np.arange(32))) is None
    assert outside.exists()  # the link was quarantined, not its target
    tier.close()


def test_header_claiming_huge_chunks_is_refused(tmp_path):
    job = codec.prepare(np.arange(32, dtype=np.int32), [big_kv(32)], None, "fp")
    enc = encode.encode(job.tokens, job.tensors, job.metadata)
    raw = enc.join()
    import json

    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    meta["chunk_bytes"] = str(1 << 40)
    new = store.header_bytes(head, meta)
    with pytest.raises(store.CorruptEntry):
        store.parse_buffer(memoryview(struct.pack("<Q", len(new)) + new + raw[8 + n :]))



def test_a_header_whose_element_count_wraps_is_refused(tmp_path):
    """A re-signed header (its checksum is public) with a tensor of 2^22 x 2^22 x 2^20 elements
    and no bytes: the element count, a product of int64s, wrapped to 0 and matched its empty
    span, and the load served an array of 2^64 elements over an empty buffer (segfault)."""
    import json

    job = codec.prepare(np.arange(32, dtype=np.int32), [big_kv(32)], None, "fp")
    raw = encode.encode(job.tokens, job.tensors, job.metadata).join()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    end = max(t["data_offsets"][1] for t in head.values())
    head["zz.wrap"] = {"dtype": "U8", "shape": [1 << 22, 1 << 22, 1 << 20], "data_offsets": [end, end]}
    sums = json.loads(meta["xxh3"])
    sums["zz.wrap"] = ""
    meta["xxh3"] = json.dumps(sums, separators=(",", ":"))
    new = store.header_bytes(head, meta)
    with pytest.raises(store.CorruptEntry, match="offsets do not match shape"):
        store.parse_buffer(memoryview(struct.pack("<Q", len(new)) + new + raw[8 + n :]))

@pytest.mark.parametrize("name", ["zz.0", "0.x", "1.keys", "0.keys.0", "0.s0", "ckpt.4.0.keys",
                                  "tokens.x", ""])  # fmt: skip
def test_a_tensor_its_layers_do_not_declare_makes_the_header_corrupt(name):
    """A re-signed header (its checksum is public) may list any tensors: 200k one-byte ones kept
    the engine thread allocating for 14 s, then were read, checked and ignored by the decode. A
    name the ``layers`` / ``checkpoints`` metadata does not declare is refused with the header."""
    job = codec.prepare(np.arange(32, dtype=np.int32), [big_kv(32)], None, "fp")
    raw = bytes(encode.encode(job.tokens, job.tensors, job.metadata).join())
    store.parse_buffer(memoryview(raw), "fp")
    with pytest.raises(store.CorruptEntry, match="not declared"):
        store.parse_buffer(memoryview(with_tensors(raw, {name: b"\x01"})), "fp")


def test_tensors_its_metadata_declares_pass_the_header_check():
    job = codec.prepare(np.arange(32, dtype=np.int32), [big_kv(32)], None, "fp")
    raw = bytes(encode.encode(job.tokens, job.tensors, job.metadata).join())
    tree = [{"cls": "KVCache", "meta": {"offset": 32}}, {"cls": "ArraysCache", "meta": {"size": 2}}]
    ckpt = {"8": json.dumps([{"cls": None}, {"cls": "ArraysCache", "meta": {"size": 1}}])}
    planted = with_tensors(raw, {"1.s1": b"\x01", "ckpt.8.1.s0": b"\x02"},
                           layers=json.dumps(tree), checkpoints=json.dumps(ckpt))  # fmt: skip
    header = store.parse_buffer(memoryview(planted), "fp")
    assert {"1.s1", "ckpt.8.1.s0"} <= set(header.tensors)
    with pytest.raises(store.CorruptEntry, match="not declared"):  # s2 is past the size
        store.parse_buffer(memoryview(with_tensors(planted, {"1.s2": b"\x03"})), "fp")


def test_a_headers_checksum_table_is_parsed_once_for_all_its_tensors(tmp_path, monkeypatch):
    """A read asks the header for each tensor's digests (65 tensors for an 8B model): the table
    (~260 kB at 8B 128k tokens) was parsed again for each, on the readers' threads."""
    caches = [big_kv(3000) for _ in range(4)]
    job = codec.prepare(np.arange(3000, dtype=np.int32), caches, None, "fp")
    b = FileBackend(tmp_path)
    b.put("e1", encode.encode(job.tokens, job.tensors, job.metadata))
    header = store.read_header(b.path("e1"), "fp")
    table = header.metadata["xxh3"]
    parsed: list[int] = []
    real = json.loads

    def loads(s, *a, **k):
        if s == table:
            parsed.append(1)
        return real(s, *a, **k)

    monkeypatch.setattr(store.json, "loads", loads)
    got = {name: header.digests(name) for name in header.tensors}
    assert len(parsed) <= 1
    want = real(table)
    assert got == {name: want[name] for name in header.tensors} and all(got.values())
