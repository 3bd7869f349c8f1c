"""tiered_kv/cold/ranged.py: ranged reads of format-3 (token-major) entries, verified by the
entry's own chunk checksums (one integrity scheme with the load path): exact rows, one contiguous
run per tensor, only the covering chunks read, a flipped byte in any chunk served is caught, one
outside the range is never read, no symlink is followed."""

from __future__ import annotations

import os
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from tests.fixtures import flip_byte
from tiered_kv.cold import codec, ranged, store
from tiered_kv.cold.backend import FileBackend

N, HEADS, DIM = 600, 2, 8
CHUNK = 1000  # bytes: a tensor of 600 tokens x 2 heads x 8 float32 is 38400 bytes, ~39 chunks
ROW = HEADS * DIM * 4  # bytes of one token of a tensor, token-major


def write(tmp_path, dtype=mx.float32, chunk=CHUNK):
    """An entry of N tokens written the cold tier's way (codec.prepare → store.encode → backend),
    with small checksum chunks; returns its path and the keys it holds (float32)."""
    c = KVCache()
    big = mx.arange(HEADS * 700 * DIM).reshape(1, HEADS, 700, DIM).astype(dtype)
    c.update_and_fetch(big[..., :N, :], (big * 2)[..., :N, :])
    job = codec.prepare(np.arange(N, dtype=np.int32), [c], None, "fp")
    b = FileBackend(tmp_path)
    b.put("e1", store.encode(job.tokens, job.tensors, job.metadata, chunk))
    return b.path("e1"), np.array(big[..., :N, :].astype(mx.float32))


def test_range_read_returns_exact_rows_and_reads_only_covering_chunks(tmp_path):
    path, keys = write(tmp_path)
    rr = ranged.read_range(path, "fp", 300, 590)
    assert (rr.start, rr.stop) == (300, 590) and rr.tokens.tolist() == list(range(590))
    dtype, u8 = rr.tensors["0.keys"]
    assert dtype == "F32" and set(rr.tensors) == {"0.keys", "0.values"}
    np.testing.assert_array_equal(u8.view(np.float32)[0].swapaxes(0, 1), keys[0, :, 300:590])
    assert rr.nbytes < path.stat().st_size * 0.6  # tokens [0, 300) of each tensor were not read


def test_bf16_rows_round_trip(tmp_path):
    path, keys = write(tmp_path, dtype=mx.bfloat16)
    rr = ranged.read_range(path, "fp", 1, N)
    dtype, u8 = rr.tensors["0.keys"]
    got = mx.array(u8.view(np.uint16)).view(mx.bfloat16).astype(mx.float32)
    assert dtype == "BF16"
    np.testing.assert_array_equal(np.array(got)[0].swapaxes(0, 1), keys[0, :, 1:N])


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_byte_in_any_chunk_served_is_caught(tmp_path, where):
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    start, stop = h.tensors["0.values"]["data_offsets"]
    tok1 = h.data_start + start + ROW  # token 1, the first served
    offset = {"first": tok1 + 5, "middle": tok1 + 300 * ROW, "last": h.data_start + stop - 1}
    flip_byte(path, offset[where])
    with pytest.raises(store.CorruptEntry, match="range checksum"):
        ranged.read_range(path, "fp", 1, N)


def test_corrupt_chunk_outside_the_range_is_not_read(tmp_path):
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    flip_byte(path, h.data_start + h.tensors["0.keys"]["data_offsets"][0] + 3)  # token 0
    assert ranged.read_range(path, "fp", 256, N).start == 256  # never served, never read
    with pytest.raises(store.CorruptEntry):
        ranged.read_range(path, "fp", 0, N)


def test_tokens_are_verified(tmp_path):
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    flip_byte(path, h.data_start + h.tensors["tokens"]["data_offsets"][0] + 8)
    with pytest.raises(store.CorruptEntry, match="tokens"):
        ranged.read_range(path, "fp", 300, N)


def test_a_planted_symlink_is_not_followed(tmp_path):
    path, _ = write(tmp_path)
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    with pytest.raises(store.CorruptEntry, match="symlink"):
        ranged.read_range(link, "fp", 300, N)
    assert ranged.resident_share(link) is None


def test_foreign_and_out_of_range(tmp_path):
    path, _ = write(tmp_path)
    with pytest.raises(store.ForeignEntry):
        ranged.read_range(path, "other", 300, N)
    with pytest.raises(ValueError):
        ranged.read_range(path, "fp", 300, N + 1)


def test_layers_without_token_rows_cannot_be_split(tmp_path):
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, HEADS, 40, DIM)), mx.zeros((1, HEADS, 40, DIM)))
    at20 = KVCache()
    at20.update_and_fetch(mx.zeros((1, HEADS, 20, DIM)), mx.zeros((1, HEADS, 20, DIM)))
    job = codec.prepare(np.arange(40, dtype=np.int32), [c], {20: [at20]}, "fp")  # a checkpoint
    b = FileBackend(tmp_path)
    b.put("e2", store.encode(job.tokens, job.tensors, job.metadata, CHUNK))
    with pytest.raises(ranged.Unsplittable):
        ranged.read_range(b.path("e2"), "fp", 10, 40)


def test_resident_share_is_a_share_or_unknown(tmp_path):
    path, _ = write(tmp_path)
    share = ranged.resident_share(path)
    assert share is None or 0.0 <= share <= 1.0


def test_probing_a_cold_file_does_not_warm_it(tmp_path):
    """Issue 15 on the H200: a non-blocking read that misses starts readahead, so the plan's
    probe after the benchmark's found every sampled page resident ("warm=1.0" in every cold
    plan) and priced cold reads at warm rates. The probe reads nothing: a dropped file stays
    cold however often it is probed, and a file that was read is warm."""
    path = tmp_path / "entry.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 32 << 20, dtype=np.uint8))
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        first = ranged.resident_share(path)
        if first is None or first > 0.05:
            pytest.skip(f"the page cache of {tmp_path} cannot be dropped here ({first})")
        again = [ranged.resident_share(path) for _ in range(3)]
        time.sleep(0.2)  # readahead a probe started would have landed by now
        again.append(ranged.resident_share(path))
        assert again == [0.0] * 4
        while os.read(fd, 8 << 20):
            pass
    finally:
        os.close(fd)
    assert ranged.resident_share(path) == 1.0


def test_rows_land_straight_in_destinations(tmp_path):
    """``into``: tokens [m, n) go into the caller's buffer (here tokens [m, n) of a token-major
    (1, n, heads, row) buffer), nothing around them is written."""
    path, keys = write(tmp_path)
    m, n = 123, 590
    full = {
        name: np.full((1, n, HEADS, DIM * 4), 0xAB, dtype=np.uint8)
        for name in ("0.keys", "0.values")
    }
    into = {name: a[:, m:n] for name, a in full.items()}
    rr = ranged.read_range(path, "fp", m, n, into=into)
    assert rr.tensors["0.keys"][1] is into["0.keys"]
    got = full["0.keys"][:, m:n].view(np.float32)[0].swapaxes(0, 1)
    np.testing.assert_array_equal(got, keys[0, :, m:n])
    assert (full["0.keys"][:, :m] == 0xAB).all() and (full["0.values"][:, :m] == 0xAB).all()
    assert ranged.layout(path, "fp", m, n) == {"0.keys": ("F32", (1, n, HEADS, DIM)),
                                               "0.values": ("F32", (1, n, HEADS, DIM))}  # fmt: skip


def test_a_range_of_a_tensor_is_one_contiguous_read(tmp_path, monkeypatch):
    """Token-major: tokens [m, n) of each tensor are one run of the file, read by positioned reads
    that follow each other with no gap (head-major, format 2, they were one run per head)."""
    path, _ = write(tmp_path, chunk=256)
    h = store.read_header(path, "fp")
    real = ranged.os.preadv
    reads: list[tuple[int, int]] = []

    def count(fd, bufs, offset, *flags):
        got = real(fd, bufs, offset, *flags)
        reads.append((offset, offset + got))
        return got

    monkeypatch.setattr(ranged.os, "preadv", count)
    m, n = 200, 500
    ranged.read_range(path, "fp", m, n, workers=1)
    runs: list[list[int]] = []
    for a, b in sorted(reads):
        if runs and a == runs[-1][1]:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    assert len(runs) == 3  # tokens, 0.keys, 0.values
    for name, (a, b) in zip(["tokens", "0.keys", "0.values"], runs, strict=True):
        start = h.data_start + h.tensors[name]["data_offsets"][0]
        per = 4 if name == "tokens" else ROW
        first = 0 if name == "tokens" else m
        assert a <= start + first * per < start + n * per <= b  # the whole span, in one run
        assert b - a < (n - first) * per + 2 * 256  # and only its covering chunks


def test_the_ranged_read_turns_readahead_off_before_it_reads(tmp_path, monkeypatch):
    """Several readers of one descriptor, each reading megabyte spans: the kernel's readahead,
    shared by them, read a cold 8B 32k tail at half the disk's speed. Every data read comes
    after ``POSIX_FADV_RANDOM`` on its descriptor."""
    path, _ = write(tmp_path)
    events: list[tuple[str, int, int]] = []
    real_advise, real_read = ranged.os.posix_fadvise, ranged.os.preadv

    def advise(fd, offset, length, advice):
        events.append(("advise", fd, advice))
        return real_advise(fd, offset, length, advice)

    def read(fd, bufs, offset, *flags):
        events.append(("read", fd, offset))
        return real_read(fd, bufs, offset, *flags)

    monkeypatch.setattr(ranged.os, "posix_fadvise", advise)
    monkeypatch.setattr(ranged.os, "preadv", read)
    ranged.read_range(path, "fp", 300, N)
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    assert reads
    for i in reads:
        fd = events[i][1]
        assert ("advise", fd, os.POSIX_FADV_RANDOM) in events[:i]


def test_flipped_byte_is_caught_when_reading_into_destinations(tmp_path):
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    start, _ = h.tensors["0.values"]["data_offsets"]
    flip_byte(path, h.data_start + start + 400 * ROW + DIM * 4)  # token 400, head 1
    into = {k: np.empty((1, N - 300, HEADS, DIM * 4), np.uint8) for k in ("0.keys", "0.values")}
    with pytest.raises(store.CorruptEntry, match="range checksum"):
        ranged.read_range(path, "fp", 300, N, into=into)


def test_short_positioned_reads_are_continued(tmp_path, monkeypatch):
    """A preadv that returns fewer bytes than asked (allowed by POSIX) is resumed where it stopped."""
    path, keys = write(tmp_path)
    real = ranged.os.preadv

    def short(fd, bufs, offset, *flags):
        first = memoryview(bufs[0])
        cut = [first[: max(1, len(first) // 3)]]  # a third of the first buffer only
        return real(fd, cut, offset, *flags)

    monkeypatch.setattr(ranged.os, "preadv", short)
    rr = ranged.read_range(path, "fp", 7, N)
    got = rr.tensors["0.keys"][1].view(np.float32)[0].swapaxes(0, 1)
    np.testing.assert_array_equal(got, keys[0, :, 7:N])


def test_destinations_of_another_layout_are_refused(tmp_path):
    path, _ = write(tmp_path)
    with pytest.raises(ValueError):
        ranged.read_range(
            path, "fp", 300, N, into={"0.keys": np.empty((1, 300, HEADS, 32), np.uint8)}
        )
    bad = {k: np.empty((1, N - 300, HEADS, 16), np.uint8) for k in ("0.keys", "0.values")}
    with pytest.raises(ValueError):
        ranged.read_range(path, "fp", 300, N, into=bad)
    head_major = {k: np.empty((1, HEADS, N - 300, 32), np.uint8) for k in ("0.keys", "0.values")}
    with pytest.raises(ValueError):
        ranged.read_range(path, "fp", 300, N, into=head_major)
    strided = {k: np.empty((1, N - 300, HEADS, 64), np.uint8)[..., :32] for k in ("0.keys", "0.values")}
    with pytest.raises(ValueError):
        ranged.read_range(path, "fp", 300, N, into=strided)


def test_the_page_cache_probe_leaves_no_garbage(tmp_path):
    """One probe per restore plan: it makes no ctypes array type per file size (a type is a
    reference cycle, left for the cyclic collector)."""
    import ctypes
    import gc

    from tiered_kv.cold.ranged import resident_share

    p = tmp_path / "f"
    p.write_bytes(b"x" * 40_000)
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        assert resident_share(p) is not None
        gc.collect()
        ours = [o for o in gc.garbage if isinstance(o, ctypes._SimpleCData | ctypes.Array)
                or (isinstance(o, type) and issubclass(o, ctypes.Array))]  # fmt: skip
        assert ours == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def test_each_destination_is_handed_on_once_its_bytes_are_verified(tmp_path):
    """``landed``: called once per tensor with its destination, holding its verified rows (what a
    GPU prefetch may start moving while other tensors are still read); a tensor that fails its
    checksum is never handed on."""
    path, keys = write(tmp_path)
    m, n = 100, N
    into = {k: np.zeros((1, n - m, HEADS, DIM * 4), np.uint8) for k in ("0.keys", "0.values")}
    seen: list[tuple[int, np.ndarray]] = []
    ranged.read_range(path, "fp", m, n, into=into,
                      landed=lambda buf: seen.append((id(buf), buf.copy())))  # fmt: skip
    assert sorted(i for i, _ in seen) == sorted(id(b) for b in into.values())
    got = {i: b for i, b in seen}[id(into["0.keys"])]
    np.testing.assert_array_equal(got.view(np.float32)[0].swapaxes(0, 1), keys[0, :, m:n])

    h = store.read_header(path, "fp")
    flip_byte(path, h.data_start + h.tensors["0.values"]["data_offsets"][0] + 300 * ROW)
    seen.clear()
    with pytest.raises(store.CorruptEntry):
        ranged.read_range(path, "fp", m, n, into=into, landed=lambda b: seen.append((id(b), b)))
    assert id(into["0.values"]) not in [i for i, _ in seen]
