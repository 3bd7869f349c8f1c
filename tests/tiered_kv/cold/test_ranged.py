"""tiered_kv/cold/ranged.py: ranged reads of format-3 (token-major) entries, verified by the
entry's own chunk checksums (one integrity scheme with the load path): exact rows, one contiguous
run per tensor, only the covering chunks read, a flipped byte in any chunk served is caught, one
outside the range is never read, no symlink is followed."""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from tests.cuda_driver import upload
from tests.fixtures import HostUpload, flip_byte, needs_populate_write, needs_proc_fd
from tiered_kv.cold import codec, encode, gpu, pages, ranged, store
from tiered_kv.cold.backend import FileBackend

N, HEADS, DIM = 600, 2, 8
CHUNK = 1000  # bytes: a tensor of 600 tokens x 2 heads x 8 float32 is 38400 bytes, ~39 chunks
ROW = HEADS * DIM * 4  # bytes of one token of a tensor, token-major


def write(tmp_path, dtype=mx.float32, chunk=CHUNK):
    """An entry of N tokens written the cold tier's way (codec.prepare → encode.encode → backend),
    with small checksum chunks; returns its path and the keys it holds (float32)."""
    c = KVCache()
    big = mx.arange(HEADS * 700 * DIM).reshape(1, HEADS, 700, DIM).astype(dtype)
    c.update_and_fetch(big[..., :N, :], (big * 2)[..., :N, :])
    job = codec.prepare(np.arange(N, dtype=np.int32), [c], None, "fp")
    b = FileBackend(tmp_path)
    b.put("e1", encode.encode(job.tokens, job.tensors, job.metadata, chunk))
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
    assert pages.resident_share(link) is None


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
    b.put("e2", encode.encode(job.tokens, job.tensors, job.metadata, CHUNK))
    with pytest.raises(ranged.Unsplittable):
        ranged.read_range(b.path("e2"), "fp", 10, 40)


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


@pytest.mark.parametrize("m", [0, 1, 100, 599])
def test_a_read_through_the_gpu_upload_lands_the_same_rows(tmp_path, m):
    """``gpu=`` (CUDA): whole chunks are read into a slot, verified there, and only the part that
    belongs to each destination is copied to its address, every copy before the one wait. Slots
    of 3 chunks (a slot holds ``slot_bytes // chunk`` chunks) cut each range into several groups."""
    path, keys = write(tmp_path)
    n = N
    host = {k: np.zeros((1, n - m, HEADS, DIM * 4), np.uint8) for k in ("0.keys", "0.values")}
    dev = {k: np.zeros_like(v) for k, v in host.items()}
    up = HostUpload(slot_bytes=3 * CHUNK + 17)
    rr = ranged.read_range(path, "fp", m, n, into=dev, gpu=up)
    ranged.read_range(path, "fp", m, n, into=host)
    for k in host:
        np.testing.assert_array_equal(dev[k], host[k])
    np.testing.assert_array_equal(dev["0.keys"].view(np.float32)[0].swapaxes(0, 1), keys[0, :, m:n])
    assert up.bytes == sum(v.nbytes for v in dev.values())  # each byte copied once
    assert up.waits == [len(up.copies)]
    assert len(up.copies) >= 2 * max(1, (n - m) * ROW // (3 * CHUNK))  # groups of 3 chunks
    spans = [(v.ctypes.data, v.ctypes.data + v.nbytes) for v in dev.values()]
    assert all(any(a <= d and d + b <= z for a, z in spans) for d, b in up.copies)
    assert rr.tokens.tolist() == list(range(n))
    [(extents, before)] = up.populated  # the destinations, populated before any copy
    assert before == 0 and sorted(extents) == gpu.extents(dev.values())
    assert all(any(a <= lo and hi <= a + k for a, k in extents) for lo, hi in spans)


def test_a_chunk_that_fails_is_never_copied_and_the_copies_are_waited_for(tmp_path):
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    flip_byte(path, h.data_start + h.tensors["0.values"]["data_offsets"][0] + 300 * ROW)
    dev = {k: np.zeros((1, N - 100, HEADS, DIM * 4), np.uint8) for k in ("0.keys", "0.values")}
    up = HostUpload(slot_bytes=CHUNK)  # one chunk per slot
    with pytest.raises(store.CorruptEntry, match="range checksum"):
        ranged.read_range(path, "fp", 100, N, into=dev, gpu=up)
    bad = dev["0.values"].ctypes.data + (300 - 100) * ROW  # the flipped byte's address
    assert not any(d <= bad < d + b for d, b in up.copies)
    assert up.waits == [len(up.copies)]  # waited for on the error path too


def test_a_failed_copy_is_a_device_error_not_corruption(tmp_path):
    path, _ = write(tmp_path)
    dev = {k: np.zeros((1, N, HEADS, DIM * 4), np.uint8) for k in ("0.keys", "0.values")}
    up = HostUpload(slot_bytes=CHUNK, fail_after=3)
    with pytest.raises(gpu.DeviceError):
        ranged.read_range(path, "fp", 0, N, into=dev, gpu=up)
    assert up.waits == [3]


def _tensor_bytes(h: store.Header) -> dict[str, np.ndarray]:
    return {k: np.zeros(t["data_offsets"][1] - t["data_offsets"][0], np.uint8)
            for k, t in h.tensors.items()}  # fmt: skip


@pytest.mark.parametrize("through", ["host", "upload"])
def test_read_tensors_reads_every_tensor_whole_and_verified(tmp_path, through):
    """The whole-entry read of a CUDA load: every tensor (``tokens`` too) byte for byte what
    ``mx.load`` builds from the same file, through the upload or straight into host memory."""
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    into = _tensor_bytes(h)
    up = HostUpload(slot_bytes=4 * CHUNK) if through == "upload" else None
    assert ranged.read_tensors(path, h, into, up) == h.data_len
    want = mx.load(str(path))
    assert isinstance(want, dict)
    for k, v in into.items():
        np.testing.assert_array_equal(v, np.array(want[k]).view(np.uint8).reshape(-1))
    if up is not None:
        assert up.bytes == h.data_len and up.waits == [len(up.copies)]


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise (macOS)")
def test_a_whole_file_read_keeps_the_kernels_readahead(tmp_path, monkeypatch):
    """Readers going through whole tensors in file order read a cold file faster with the
    kernel's readahead (1 GB: 2.35 GB/s against 1.79 without it): only a range's spans turn it
    off."""
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    advised: list[int] = []
    real = ranged.os.posix_fadvise

    def advise(fd, offset, length, advice):
        advised.append(advice)
        return real(fd, offset, length, advice)

    monkeypatch.setattr(ranged.os, "posix_fadvise", advise)
    ranged.read_tensors(path, h, _tensor_bytes(h))
    assert os.POSIX_FADV_RANDOM not in advised
    ranged.read_range(path, "fp", 300, N)
    assert os.POSIX_FADV_RANDOM in advised


@needs_proc_fd
@pytest.mark.parametrize("through", ["host", "upload"])
def test_each_tensor_of_a_whole_file_is_read_through_its_own_open_file(tmp_path, monkeypatch, through):
    """The kernel keeps readahead per open file description: readers that share one, each going
    through its own tensor front to back, look like one stream jumping about and get almost no
    readahead (a cold 1 GiB file read by 4 threads: 0.29-0.47 GB/s through one description,
    1.92-2.10 through one each, on the 2-core VM). Every positioned read of a whole-file read
    goes through a description opened for its tensor, none through the shared one."""
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    offsets: list[tuple[int, int]] = []  # (fd, its file offset after a probe seek) per read
    shared: list[int] = []
    real_preadv, real_open = ranged.os.preadv, store.open_entry

    def preadv(fd, views, offset):
        offsets.append((fd, os.lseek(fd, 0, os.SEEK_CUR)))
        return real_preadv(fd, views, offset)

    def open_entry(p):
        fd = real_open(p)
        shared.append(fd)
        os.lseek(fd, 12345, os.SEEK_SET)  # a description of its own keeps offset 0
        return fd

    monkeypatch.setattr(ranged.os, "preadv", preadv)
    monkeypatch.setattr(ranged.store, "open_entry", open_entry)
    up = HostUpload(slot_bytes=4 * CHUNK) if through == "upload" else None
    into = _tensor_bytes(h)
    assert ranged.read_tensors(path, h, into, up) == h.data_len
    assert len(shared) == 1 and offsets
    assert all(pos == 0 for _, pos in offsets), "a read went through the shared description"
    want = mx.load(str(path))
    assert isinstance(want, dict)
    for k, v in into.items():
        np.testing.assert_array_equal(v, np.array(want[k]).view(np.uint8).reshape(-1))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("through", ["host", "upload"])
def test_read_tensors_catches_a_flipped_byte_anywhere(tmp_path, where, through):
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    offset = {"first": h.data_start, "middle": h.data_start + h.data_len // 2,
              "last": h.data_start + h.data_len - 1}[where]  # fmt: skip
    flip_byte(path, offset)
    up = HostUpload(slot_bytes=2 * CHUNK) if through == "upload" else None
    with pytest.raises(store.CorruptEntry):
        ranged.read_tensors(path, h, _tensor_bytes(h), up)


def test_read_tensors_refuses_a_file_that_changed_size_and_a_wrong_layout(tmp_path):
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    into = _tensor_bytes(h)
    with pytest.raises(ValueError):
        ranged.read_tensors(path, h, {"tokens": into["tokens"]})
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(store.CorruptEntry, match="size"):
        ranged.read_tensors(path, h, into)



# --- through the real gpu.Upload, over a copy engine that runs later (tests/cuda_driver.py) ----


@pytest.mark.parametrize(
    "chunk, slot, slots, workers",
    [(1000, 1000, 1, 1), (1000, 1999, 2, 4), (1000, 3017, 3, 4), (64, 640, 8, 4), (5000, 5000, 2, 1)],
)  # fmt: skip
def test_reads_through_the_upload_land_exactly_and_wait_for_every_copy(
    tmp_path, monkeypatch, chunk, slot, slots, workers
):
    """HostUpload copies at once, so a slot reused before its copy ran, or a wait that missed a
    stream, passed every CPU test: here each copy runs later on its stream and reads its slot
    then. Ranges and whole tensors land byte for byte, and no copy is left when a read returns."""
    path, _ = write(tmp_path, chunk=chunk)
    up, lib = upload(monkeypatch, slot, slots)
    for m in (0, 1, 299, N - 1):
        lay = ranged.layout(path, "fp", m, N)
        dev = {k: np.zeros((1, N - m, s[2], s[3] * 4), np.uint8) for k, (_, s) in lay.items()}
        host = {k: np.zeros_like(v) for k, v in dev.items()}
        ranged.read_range(path, "fp", m, N, into=dev, gpu=up, workers=workers)
        assert lib.pending == 0
        ranged.read_range(path, "fp", m, N, into=host)
        assert all(np.array_equal(dev[k], host[k]) for k in host), m
    header = store.read_header(path, "fp")
    whole = {k: np.zeros(t["data_offsets"][1] - t["data_offsets"][0], np.uint8)
             for k, t in header.tensors.items()}  # fmt: skip
    ranged.read_tensors(path, header, whole, up)
    assert lib.pending == 0
    raw = path.read_bytes()
    for k, t in header.tensors.items():
        a, b = (header.data_start + x for x in t["data_offsets"])
        assert whole[k].tobytes() == raw[a:b], k


@pytest.mark.parametrize("call", ["cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuEventSynchronize"])
def test_a_failed_driver_call_fails_the_read_after_every_copy_ran(tmp_path, monkeypatch, call):
    """A failed call turns the upload off and fails the read (the caller falls back): never
    before the copies already issued ran, whose destinations the caller then lets go. (A stream
    whose synchronisation fails may still copy: the caller keeps those arrays, codec._STRANDED.)"""
    path, _ = write(tmp_path)
    # the read's first event is recorded after its destinations' population (a hint: its failure
    # is test_gpu's); the copies' come after it
    up, lib = upload(monkeypatch, 2000, 3, fail={call: {2 if call == "cuEventRecord" else 1}})
    lay = ranged.layout(path, "fp", 100, N)
    dev = {k: np.zeros((1, N - 100, s[2], s[3] * 4), np.uint8) for k, (_, s) in lay.items()}
    with pytest.raises(gpu.DeviceError):
        ranged.read_range(path, "fp", 100, N, into=dev, gpu=up, workers=4)
    assert lib.pending == 0 and not up.ok


def test_a_read_given_its_header_refuses_a_file_replaced_since(tmp_path):
    """The header a `both` took its layout from is passed to the read, not parsed again; the file
    the read opens must still be the one it came from: another entry published under the name
    since (same layout, other bytes) is a CorruptEntry, and the header of another fingerprint a
    ForeignEntry. The same file reads as without the header."""
    path, keys = write(tmp_path)
    header = store.read_header(path, "fp")
    lay = ranged.layout_of(header, 300, N)
    assert lay == ranged.layout(path, "fp", 300, N)
    rr = ranged.read_range(path, "fp", 300, N, header=header)
    np.testing.assert_array_equal(rr.tensors["0.keys"][1].view(np.float32)[0].swapaxes(0, 1),
                                  keys[0, :, 300:N])  # fmt: skip
    with pytest.raises(store.ForeignEntry):
        ranged.read_range(path, "other", 300, N, header=header)
    c = KVCache()
    x = mx.ones((1, HEADS, N, DIM))
    c.update_and_fetch(x, x)
    job = codec.prepare(np.arange(N, dtype=np.int32) + 1, [c], None, "fp")
    (tmp_path / "b").mkdir()
    other = FileBackend(tmp_path / "b")
    other.put("e1", encode.encode(job.tokens, job.tensors, job.metadata, CHUNK))
    os.replace(other.path("e1"), path)  # published over it between the layout and the read
    assert ranged.layout(path, "fp", 300, N) == lay
    with pytest.raises(store.CorruptEntry, match="replaced"):
        ranged.read_range(path, "fp", 300, N, header=header)


def _drop_pages(path) -> None:
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@needs_populate_write
@pytest.mark.parametrize("through, state", [("host", "cold"), ("host", "warm"), ("upload", "cold")])
def test_a_cold_read_into_host_memory_faults_it_in_ahead_and_ends_that_thread(tmp_path, monkeypatch,
                                                                             through, state):  # fmt: skip
    """A whole read of a file on disk into fresh host memory has one thread fault the
    destinations in, in file order, ahead of its readers (a cold 4 GB reload: 2.14 GB/s median
    with it, 1.83 without), and that thread has ended when the read returns. Not from the page
    cache (there it only competes with the copies: warm 1 GB 2.59 against 3.45 GB/s), and not
    for GPU destinations (the upload), which the CPU never touches."""
    path, _ = write(tmp_path)
    h = store.read_header(path, "fp")
    into = _tensor_bytes(h)
    calls: list[tuple[str, list[int]]] = []
    real = pages.fault_in

    def spy(arrays, done, stop=None):
        calls.append((threading.current_thread().name, [a.ctypes.data for a in arrays]))
        return real(arrays, done, stop)

    monkeypatch.setattr(pages, "fault_in", spy)
    if state == "cold":
        _drop_pages(path)
        if (pages.resident_share(path) or 0.0) >= pages.FAULT_AHEAD_BELOW:
            pytest.skip("this file system keeps the file's pages (tmpfs?): no cold read here")
    else:
        path.read_bytes()
    up = HostUpload(slot_bytes=4 * CHUNK) if through == "upload" else None
    assert ranged.read_tensors(path, h, into, up) == h.data_len
    if through == "upload" or state == "warm":
        assert calls == []
        return
    order = sorted(h.tensors, key=lambda k: h.tensors[k]["data_offsets"][0])
    assert calls == [("tkv-fault", [into[k].ctypes.data for k in order])]
    assert not [t for t in threading.enumerate() if t.name == "tkv-fault"]


@pytest.mark.parametrize("through", ["host", "upload"])
def test_a_meeting_read_goes_backwards_and_stops_below_the_computed_tokens(tmp_path, monkeypatch,
                                                                          through):  # fmt: skip
    """A `both`'s read (``meet``): each tensor's chunks from its end backwards, and none once all
    that is left lies below the tokens the compute holds (``meet.floor``, raised here after the
    first read of each tensor). ``first`` is the first row read in every tensor; rows from it on
    are exact, rows below were never written; the served bytes and the share left are counted."""
    path, keys = write(tmp_path)
    monkeypatch.setattr(ranged, "_GROUP_BYTES", 3 * CHUNK)  # host: 3 chunks per positioned read
    m, n, floor = 100, 590, 400
    meet = ranged.Meet(m)
    real, offsets = ranged._preadv_all, []

    def watch(fd, bufs, offset):
        offsets.append(offset)
        got = real(fd, bufs, offset)
        meet.floor = floor  # the compute got to 400 meanwhile
        return got

    monkeypatch.setattr(ranged, "_preadv_all", watch)
    into = {k: np.full((1, n - m, HEADS, DIM * 4), 0xAB, np.uint8) for k in ("0.keys", "0.values")}
    up = HostUpload(slot_bytes=3 * CHUNK) if through == "upload" else None
    rr = ranged.read_range(path, "fp", m, n, into=into, gpu=up, workers=1, meet=meet)
    h = store.read_header(path, "fp")
    for name in into:  # backwards within each tensor
        base = h.data_start + h.tensors[name]["data_offsets"][0]
        mine = [o for o in offsets if base <= o < base + N * ROW]
        assert mine == sorted(mine, reverse=True) and len(mine) >= 2
    assert m < rr.first <= floor  # stopped early, and only below what the compute holds
    got = into["0.keys"].view(np.float32)[0].swapaxes(0, 1)
    np.testing.assert_array_equal(got[:, rr.first - m :], keys[0, :, rr.first : n])
    assert (into["0.values"][:, : floor - 3 * CHUNK // ROW - m] == 0xAB).all()  # never read
    assert rr.served == meet.done < 2 * (n - m) * ROW and 0 < meet.left() < 1
    assert rr.served >= 2 * (n - rr.first) * ROW
