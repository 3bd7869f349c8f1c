"""tiered_kv/cold/ranged.py: block checksums written with an entry; ranged reads verify every
block they serve (a flipped byte in the first, a middle or the last block is caught)."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from tiered_kv.cold import ranged, store

N, HEADS, DIM = 600, 2, 8


def write(path, with_sums=True, dtype=mx.bfloat16):
    tokens = np.arange(N, dtype="<i4")
    big = mx.arange(1 * HEADS * 700 * DIM).reshape(1, HEADS, 700, DIM).astype(dtype)
    arrays = {"0.keys": big[..., :N, :], "0.values": (big * 2)[..., :N, :]}  # strided slices
    mx.eval(list(arrays.values()))
    meta = {"fingerprint": "fp", "layers": "[]"}
    if with_sums:
        meta.update(ranged.block_checksums(tokens, arrays))
    store.write_entry(path, tokens, arrays, meta)
    return np.array(arrays["0.keys"].astype(mx.float32))


def test_range_read_returns_exact_rows(tmp_path):
    path = tmp_path / "e.safetensors"
    keys = write(path, dtype=mx.float32)
    rr = ranged.read_range(path, "fp", 300, 590)
    assert (rr.start, rr.stop) == (256, N)  # whole blocks, outwards
    assert rr.tokens.tolist() == list(range(N))
    dtype, u8 = rr.tensors["0.keys"]
    assert dtype == "F32"
    got = u8.view(np.float32)
    np.testing.assert_array_equal(got[0, :, : 590 - 256], keys[0, :, 256:590])
    assert rr.nbytes < path.stat().st_size  # the first block of every layer was not read


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_in_any_block_is_caught(tmp_path, where):
    path = tmp_path / "e.safetensors"
    write(path)
    h = store.read_header(path, "fp")
    start, stop = h.tensors["0.values"]["data_offsets"]
    row = DIM * 2
    head1 = h.data_start + start + N * row  # the second head's run
    offset = {"first": head1 + 5, "middle": head1 + 300 * row, "last": h.data_start + stop - 1}
    raw = bytearray(path.read_bytes())
    raw[offset[where]] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(store.CorruptEntry, match="range checksum"):
        ranged.read_range(path, "fp", 1, N)


def test_corrupt_block_outside_the_range_is_not_read(tmp_path):
    path = tmp_path / "e.safetensors"
    write(path)
    h = store.read_header(path, "fp")
    raw = bytearray(path.read_bytes())
    raw[h.data_start + h.tensors["0.keys"]["data_offsets"][0] + 3] ^= 0x01  # token 0, head 0
    path.write_bytes(bytes(raw))
    assert ranged.read_range(path, "fp", 256, N).start == 256  # never served, never read


def test_tokens_are_verified(tmp_path):
    path = tmp_path / "e.safetensors"
    write(path)
    h = store.read_header(path, "fp")
    raw = bytearray(path.read_bytes())
    raw[h.data_start + h.tensors["tokens"]["data_offsets"][0] + 8] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(store.CorruptEntry, match="tokens"):
        ranged.read_range(path, "fp", 300, N)


def test_older_files_cannot_be_split(tmp_path):
    path = tmp_path / "e.safetensors"
    write(path, with_sums=False)
    with pytest.raises(ranged.Unsplittable):
        ranged.read_range(path, "fp", 300, N)


def test_checksum_metadata_is_json_and_covers_every_block(tmp_path):
    tokens = np.arange(N, dtype="<i4")
    a = mx.zeros((1, HEADS, N, DIM))
    sums = ranged.block_checksums(tokens, {"x": a, "scalar": mx.zeros((3,))})
    table = json.loads(sums[ranged.META_XXH])
    assert set(table) == {"tokens", "x"} and len(table["x"]) == 16 * 3


def test_resident_share_is_a_share_or_unknown(tmp_path):
    path = tmp_path / "e.safetensors"
    write(path)
    share = ranged.resident_share(path)
    assert share is None or 0.0 <= share <= 1.0


def _chunk_table(tokens, arrays, chunk):
    """Format 2's (issue 11) per-tensor checksums: xxh3_64 of each ``chunk`` bytes, C order."""
    import xxhash

    table = {}
    for name, x in [("tokens", tokens), *arrays.items()]:
        raw = np.ascontiguousarray(np.array(x)).tobytes()  # float32 / int32 here
        table[name] = "".join(xxhash.xxh3_64_hexdigest(raw[i : i + chunk])
                              for i in range(0, len(raw), chunk))  # fmt: skip
    return table


def write_chunked(path, chunk=1000):
    tokens = np.arange(N, dtype="<i4")
    big = mx.arange(HEADS * 700 * DIM).reshape(1, HEADS, 700, DIM).astype(mx.float32)
    arrays = {"0.keys": big[..., :N, :], "0.values": (big * 2)[..., :N, :]}
    mx.eval(list(arrays.values()))
    meta = {"fingerprint": "fp", "layers": "[]", "chunk_bytes": str(chunk),
            "xxh3": json.dumps(_chunk_table(tokens, arrays, chunk))}  # fmt: skip
    store.write_entry(path, tokens, arrays, meta)
    return np.array(arrays["0.keys"])


def test_format2_chunk_checksums_serve_ranges(tmp_path):
    """Without block checksums, the per-tensor byte chunks of cold format 2 verify a range."""
    path = tmp_path / "e.safetensors"
    keys = write_chunked(path)
    rr = ranged.read_range(path, "fp", 300, 590)
    assert (rr.start, rr.stop) == (300, 590) and rr.tokens.tolist() == list(range(590))
    np.testing.assert_array_equal(rr.tensors["0.keys"][1].view(np.float32)[0], keys[0, :, 300:590])
    assert rr.nbytes < path.stat().st_size
    h = store.read_header(path, "fp")
    raw = bytearray(path.read_bytes())
    raw[h.data_start + h.tensors["0.values"]["data_offsets"][1] - 1] ^= 0x01  # last head, last row
    path.write_bytes(bytes(raw))
    with pytest.raises(store.CorruptEntry, match="range checksum"):
        ranged.read_range(path, "fp", 300, N)
