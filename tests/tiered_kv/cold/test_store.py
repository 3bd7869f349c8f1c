"""tiered_kv/cold/store.py: entry format 3 — one safetensors file, chunked xxh3 per tensor,
splittable layer tensors stored token-major."""

from __future__ import annotations

import os
import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tests.fixtures import flip_byte
from tiered_kv.cold import codec, store
from tiered_kv.cold.backend import FileBackend
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config


def big_kv(tokens: int) -> C.KVCache:
    c = C.KVCache()
    x = mx.random.normal((1, 4, tokens, 128)).astype(mx.bfloat16)  # 1 KiB per token per array
    c.update_and_fetch(x, -x)
    mx.eval(c.keys, c.values)
    return c


def test_file_is_standard_safetensors_with_chunk_digests(tmp_path):
    caches = [big_kv(10_000), big_kv(10_000)]  # ~10 MB per tensor: 3 chunks each
    job = codec.prepare(np.arange(10_000, dtype=np.int32), caches, None, "fp")
    b = FileBackend(tmp_path)
    b.put("e1", store.encode(job.tokens, job.tensors, job.metadata).pieces)
    path = b.path("e1")
    arrays, meta = mx.load(str(path), return_metadata=True)  # any safetensors reader works
    stored = mx.swapaxes(caches[0].keys[..., :10_000, :], 1, 2)  # token-major on disk
    assert mx.array_equal(arrays["0.keys"], stored).item()  # type: ignore[index]
    assert meta["format_version"] == "3" and int(meta["chunk_bytes"]) == store.CHUNK_BYTES  # type: ignore[index]
    header = store.read_header(path, "fp")
    assert len(header.digests("0.keys")) == 16 * 3
    assert header.token_major == {"0.keys", "0.values", "1.keys", "1.values"}
    assert header.shape("0.keys") == (1, 4, 10_000, 128)
    store.check_data(path, header)


def test_splittable_tensors_are_token_major_on_disk(tmp_path):
    """The bytes of a layer tensor in the file, read with plain numpy at its header offsets, are
    ``swapaxes(1, 2)`` of the cache's array; written in several transposed blocks (small block),
    from a strided view (a cache buffer longer than its tokens)."""
    c = C.KVCache()
    c.update_and_fetch(mx.random.normal((1, 3, 200, 8)), mx.random.normal((1, 3, 200, 8)))
    c.update_and_fetch(mx.random.normal((1, 3, 100, 8)), mx.random.normal((1, 3, 100, 8)))
    job = codec.prepare(np.arange(300, dtype=np.int32), [c], None, "fp")
    b = FileBackend(tmp_path)
    b.put("e1", store.encode(job.tokens, job.tensors, job.metadata, chunk=1000, block=4096).pieces)
    raw = b.path("e1").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    import json

    head = json.loads(raw[8 : 8 + n])
    for name, arr in (("0.keys", c.keys), ("0.values", c.values)):
        a, z = head[name]["data_offsets"]
        disk = np.frombuffer(raw[8 + n + a : 8 + n + z], dtype=np.float32)
        want = np.swapaxes(np.array(arr[..., :300, :]), 1, 2)
        assert head[name]["shape"] == [1, 300, 3, 8]
        np.testing.assert_array_equal(disk.reshape(want.shape), want)
    assert json.loads(head["__metadata__"]["token_major"]) == ["0.keys", "0.values"]
    header = store.read_header(b.path("e1"), "fp")
    store.check_data(b.path("e1"), header)  # digests are over the bytes as written
    loaded = codec.load_file(b.path("e1"), header)
    assert loaded["0.keys"].shape == (1, 3, 300, 8)
    assert mx.array_equal(loaded["0.keys"], c.keys[..., :300, :]).item()


def test_tensors_without_token_rows_keep_their_order(tmp_path):
    """A rotating window that wrapped (fewer rows than tokens) is not token-major."""
    r = C.RotatingKVCache(max_size=16)
    for _ in range(40):
        r.update_and_fetch(mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8)))
    job = codec.prepare(np.arange(40, dtype=np.int32), [r], None, "fp")
    enc = store.encode(job.tokens, job.tensors, job.metadata)
    header = store.parse_buffer(memoryview(enc.join()), "fp")
    assert header.token_major == frozenset()
    assert all(header.shape(k) == tuple(t["shape"]) for k, t in header.tensors.items())


@pytest.mark.parametrize("bad", ['["tokens"]', '["nope"]', '"0.keys"', "[", '["0.keys", 3]'])
def test_a_bad_token_major_list_is_corrupt(bad):
    job = codec.prepare(np.arange(32, dtype=np.int32), [big_kv(32)], None, "fp")
    raw = store.encode(job.tokens, job.tensors, job.metadata).join()
    import json

    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    meta["token_major"] = bad
    new = store.header_bytes(head, meta)
    with pytest.raises(store.CorruptEntry, match="token_major"):
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


def test_strided_views_are_written_without_copy_and_read_back_equal(tmp_path):
    c = C.KVCache()  # 300 tokens in a 512-slot buffer: the encoded slices are strided views
    c.update_and_fetch(mx.random.normal((1, 2, 200, 8)), mx.random.normal((1, 2, 200, 8)))
    c.update_and_fetch(mx.random.normal((1, 2, 100, 8)), mx.random.normal((1, 2, 100, 8)))
    assert c.keys.shape[2] > c.offset
    job = codec.prepare(np.arange(300, dtype=np.int32), [c], None, "fp")
    assert any(not t.data.flags.c_contiguous for t in job.tensors)
    enc = store.encode(job.tokens, job.tensors, job.metadata)
    buf = memoryview(enc.join())
    header = store.parse_buffer(buf, "fp")
    arrays = codec.load_buffer(buf, header)
    assert mx.array_equal(arrays["0.keys"], c.keys[..., :300, :]).item()
    assert np.array_equal(codec.tokens_of(arrays), np.arange(300))


@pytest.mark.parametrize("tokens", [1, 7, 1000])
def test_chunk_digests_do_not_depend_on_how_the_bytes_are_cut(tokens):
    rng = np.random.default_rng(tokens)
    a = rng.integers(0, 255, (1, 3, tokens, 40), dtype=np.uint8)
    want = store.chunk_digests([memoryview(np.ascontiguousarray(a.swapaxes(1, 2)).reshape(-1))], 256)
    for block in (1, 100, 333, 1 << 20):
        assert store.chunk_digests(store._token_major_blocks(a, block), 256) == want


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
    enc = store.encode(job.tokens, job.tensors, job.metadata)
    raw = enc.join()
    import json

    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    meta["chunk_bytes"] = str(1 << 40)
    new = store.header_bytes(head, meta)
    with pytest.raises(store.CorruptEntry):
        store.parse_buffer(memoryview(struct.pack("<Q", len(new)) + new + raw[8 + n :]))


def _entry(tmp_path, tokens=6_000):
    caches = [big_kv(tokens), big_kv(tokens)]  # ~6 MB per tensor: 2 chunks each
    job = codec.prepare(np.arange(tokens, dtype=np.int32), caches, None, "fp")
    b = FileBackend(tmp_path)
    b.put("e1", store.encode(job.tokens, job.tensors, job.metadata).pieces)
    path = b.path("e1")
    return path, store.read_header(path, "fp")


def test_scan_reads_in_ring_buffers_and_verifies_every_piece(tmp_path):
    path, header = _entry(tmp_path)
    scan = store.Scan(path, header, step=store.CHUNK_BYTES, ring=2)  # many pieces, buffers reused
    scan.wait(store.data_end(header))
    scan.close()


@pytest.mark.parametrize("piece", [0, 1, -1])
def test_scan_verifies_the_prefix_before_a_corrupt_piece_and_refuses_past_it(tmp_path, piece):
    path, header = _entry(tmp_path)
    name = "1.values" if piece == -1 else "0.keys"
    start, stop = header.tensors[name]["data_offsets"]
    bad = start + piece * store.CHUNK_BYTES + 3 if piece >= 0 else stop - 1
    with open(path, "r+b") as f:
        f.seek(header.data_start + bad)
        b = f.read(1)
        f.seek(header.data_start + bad)
        f.write(bytes([b[0] ^ 0x80]))
    scan = store.Scan(path, header, step=store.CHUNK_BYTES, ring=2)
    try:
        piece_start = start + (bad - start) // store.CHUNK_BYTES * store.CHUNK_BYTES
        scan.wait(piece_start)  # everything before the bad piece is fine
        with pytest.raises(store.CorruptEntry, match=name):
            scan.wait(store.data_end(header))
    finally:
        scan.close()
    with pytest.raises(store.CorruptEntry):
        store.check_data(path, header)


def test_scan_of_a_truncated_file_is_corrupt(tmp_path):
    path, header = _entry(tmp_path)
    os.truncate(path, path.stat().st_size - 100)
    scan = store.Scan(path, header)
    with pytest.raises(store.CorruptEntry):
        scan.wait(store.data_end(header))
    scan.close()


def test_scan_closed_early_stops_its_thread(tmp_path):
    path, header = _entry(tmp_path)
    scan = store.Scan(path, header, step=store.CHUNK_BYTES, ring=1)
    scan.close()
    assert not scan._thread.is_alive()
