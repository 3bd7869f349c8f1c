"""tiered_kv/cold/gpu.py on CUDA: bytes staged in pinned slots by other threads are copied into
unwritten MLX arrays by the GPU and read back by MLX; a whole entry loads through it byte for byte
as ``mx.load`` builds it. Needs CUDA (the CI machine has none: skipped there; run on the H200 with
``pytest tests/tiered_kv/cold/test_gpu.py``)."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tests.fixtures import flip_byte
from tiered_kv.cold import codec, encode, gpu, ranged, store
from tiered_kv.cold.backend import FileBackend
from tiered_kv.cold.landing import allocate
from tiered_kv.steps import drain

_cuda = getattr(mx, "cuda", None)
needs_cuda = pytest.mark.skipif(_cuda is None or not _cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_slots_filled_on_other_threads_are_copied_into_mlx_arrays():
    mx.eval(mx.ones((4,)) + 1)  # MLX's context is current on this (the engine) thread
    up = gpu.shared()
    assert up is not None
    arrays = allocate({f"a{i}": ("U8", (3 * gpu.SLOT_BYTES + 5,)) for i in range(2)}, one_buffer=True)
    want = {k: (np.arange(a.size, dtype=np.int64) * (7 + i) % 251).astype(np.uint8)
            for i, (k, a) in enumerate(arrays.items())}  # fmt: skip
    before = gpu.uploaded_bytes()
    batch = up.batch()

    def send(name: str) -> None:  # what a reader thread does: bytes and addresses only
        dst = np.frombuffer(arrays[name], dtype=np.uint8).ctypes.data  # type: ignore[call-overload]
        src = want[name]
        for off in range(0, src.size, gpu.SLOT_BYTES - 3):
            part = src[off : off + gpu.SLOT_BYTES - 3]
            with batch.slot() as s:
                s.buf[3 : 3 + part.size] = part.data
                s.copy(3, part.size, dst + off)

    threads = [threading.Thread(target=send, args=(k,)) for k in arrays]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batch.wait()
    assert gpu.uploaded_bytes() - before == sum(a.size for a in arrays.values())
    for k, a in arrays.items():
        assert np.array_equal(np.array(a + 0), want[k]), k  # read on the GPU, then back


def entry(tmp_path, tokens=9000):
    caches = []
    for _ in range(3):
        c = C.KVCache()
        x = mx.random.normal((1, 8, tokens, 128)).astype(mx.bfloat16)
        c.update_and_fetch(x, -x)
        caches.append(c)
    mx.eval([a for c in caches for a in (c.keys, c.values)])
    job = codec.prepare(np.arange(tokens, dtype=np.int32), caches, None, "fp")
    backend = FileBackend(tmp_path)
    backend.put("e", encode.encode(job.tokens, job.tensors, job.metadata))
    path = backend.path("e")
    return path, store.read_header(path, "fp"), caches


@needs_cuda
def test_a_load_on_cuda_goes_through_the_upload_and_equals_the_caches(tmp_path):
    path, header, caches = entry(tmp_path)
    before = gpu.uploaded_bytes()
    for beside in (False, True):
        got = drain(codec.load_steps(path, header, beside))
        for i, c in enumerate(caches):
            assert mx.array_equal(got[f"{i}.keys"], c.keys[..., :9000, :]).item()
            assert mx.array_equal(got[f"{i}.values"], c.values[..., :9000, :]).item()
        assert codec.tokens_of(got).tolist() == list(range(9000))
    assert gpu.uploaded_bytes() - before == 2 * header.data_len
    up = gpu.shared()
    assert up is not None and up.populated >= 2 * header.data_len  # both loads populated theirs


@needs_cuda
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_fails_a_cuda_load(tmp_path, where):
    path, header, _ = entry(tmp_path)
    start, size = header.data_start, path.stat().st_size
    flip_byte(path, {"first": start + 5, "middle": (start + size) // 2, "last": size - 1}[where])
    with pytest.raises(store.CorruptEntry, match="checksum"):
        drain(codec.load_steps(path, header))


@needs_cuda
@pytest.mark.parametrize("populate", [True, False])
def test_a_ranged_read_through_the_upload_equals_the_host_read(tmp_path, monkeypatch, populate):
    """With its landing populated on the GPU before the copies (the default), and without."""
    path, _, caches = entry(tmp_path)
    m, n = 3000, 9000
    lay = ranged.layout(path, "fp", m, n)
    tail = allocate({k: (d, (1, n - m, *s[2:])) for k, (d, s) in lay.items()}, one_buffer=True)
    views = {k: np.frombuffer(a, dtype=np.uint8).reshape(1, n - m, a.shape[2], -1)  # type: ignore[call-overload]
             for k, a in tail.items()}  # fmt: skip
    up = gpu.shared()
    assert up is not None and up.populating
    monkeypatch.setattr(up, "populating", populate)
    before = up.populated
    ranged.read_range(path, "fp", m, n, into=views, gpu=up)
    landed = sum(v.nbytes for v in views.values())
    assert up.populated - before >= (landed if populate else 0)  # its extents: the views' gaps too
    assert up.populated - before < (landed + len(views) * gpu.EXTENT_GAP if populate else 1)
    del views
    for i, c in enumerate(caches):
        assert mx.array_equal(mx.swapaxes(tail[f"{i}.keys"], 1, 2), c.keys[..., m:n, :]).item()
        assert mx.array_equal(mx.swapaxes(tail[f"{i}.values"], 1, 2), c.values[..., m:n, :]).item()


@needs_cuda
def test_the_upload_opens_from_a_thread_that_never_ran_mlx():
    """The first disk hit may be loaded on a thread with no CUDA context current yet (the
    driver's contexts are per thread): the upload then takes MLX's device's primary context."""
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(gpu._open()))
    t.start()
    t.join()
    assert isinstance(got[0], gpu.Upload)


# --- the slots' lifecycle, through the real gpu.Upload over tests/cuda_driver.py (no CUDA) -----

SLOT = 4096


def _send(batch: Any, data: np.ndarray, dst: np.ndarray) -> None:
    """What a reader thread does: ``data`` staged in a slot, copied to ``dst``'s address."""
    with batch.slot() as s:
        s.buf[: data.size] = data.data
        s.copy(0, data.size, dst.ctypes.data)


@pytest.mark.parametrize("call", ["cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuEventSynchronize",
                                  "cuStreamSynchronize"])  # fmt: skip
def test_a_failed_upload_frees_its_pinned_slots_once_its_reads_are_done(monkeypatch, call):
    """After a failed driver call the upload is off for good (``shared()`` gives None), yet its
    slots (128 MiB pinned: page-locked, out of the page cache's reach) stayed allocated for the
    life of the process. They are freed once no read uses them — each stream synchronised
    first, so no copy still reads the memory — and the upload hands out none again."""
    from tests.cuda_driver import upload

    up, lib = upload(monkeypatch, SLOT, 3, fail={call: {3}})
    data, dst = np.arange(SLOT, dtype=np.uint8), np.zeros(SLOT, np.uint8)
    batch = up.batch()
    _send(batch, data, dst)  # calls 1 of each: fine
    batch.wait()
    assert lib.pinned_bytes == 3 * SLOT and lib.live == (3, 3, 3)  # a working upload keeps them
    batch = up.batch()
    with pytest.raises(gpu.DeviceError):
        for _ in range(3):
            _send(batch, data, dst)
        batch.wait()
    if call != "cuStreamSynchronize":
        assert lib.pinned_bytes == 3 * SLOT  # the read is not done yet: the caller waits first
        batch.wait()
    assert not up.ok and lib.pending == 0
    assert lib.pinned_bytes == 0 and lib.live == (0, 0, 0)
    with pytest.raises(gpu.DeviceError):  # a caller holding the upload from before: refused
        _send(up.batch(), data, dst)


def test_the_slots_stay_while_another_read_still_uses_them(monkeypatch):
    from tests.cuda_driver import upload

    up, lib = upload(monkeypatch, SLOT, 2, fail={"cuMemcpyHtoDAsync_v2": {2}})
    data, dst = np.arange(SLOT, dtype=np.uint8), np.zeros(SLOT, np.uint8)
    other = up.batch()
    _send(other, data, dst)
    failed = up.batch()
    with pytest.raises(gpu.DeviceError):
        _send(failed, data, dst)
    failed.wait()
    assert lib.pinned_bytes == 2 * SLOT  # `other` has not waited for its copies yet
    other.wait()
    assert np.array_equal(dst, data) and lib.pinned_bytes == 0 and lib.live == (0, 0, 0)


def test_a_slot_whose_stream_does_not_synchronise_stays_pinned(monkeypatch):
    """A copy on a stream that fails to synchronise may still read its slot: never freed."""
    from tests.cuda_driver import upload

    up, lib = upload(monkeypatch, SLOT, 2, fail={"cuStreamSynchronize": set(range(1, 100))})
    batch = up.batch()
    _send(batch, np.ones(8, np.uint8), np.zeros(8, np.uint8))
    with pytest.raises(gpu.DeviceError):
        batch.wait()
    assert not up.ok and lib.pinned_bytes == 2 * SLOT and lib.calls["cuStreamDestroy_v2"] == 0


def test_a_failed_stream_sync_still_waits_on_every_other_stream(monkeypatch):
    """``Batch.wait`` stopped at the first stream that failed to synchronise: copies on the
    others could still land in arrays the caller then freed and the fallback reused. (Through
    tests/cuda_driver.py: runs without CUDA.)"""
    from tests.cuda_driver import upload

    up, lib = upload(monkeypatch, SLOT, 3, fail={"cuStreamSynchronize": {1, 3}})  # two of three
    data, dst = np.arange(SLOT, dtype=np.uint8), np.zeros(SLOT, np.uint8)
    held = up.batch()  # open: no slot is freed (and synchronised again) after the wait below
    batch = up.batch()
    for _ in range(3):  # one slot each, in turn
        _send(batch, data, dst)
    with pytest.raises(gpu.DeviceError, match="cuStreamSynchronize"):
        batch.wait()
    # every stream was asked (a copy on one whose sync failed may still run: nothing is known)
    assert lib.calls["cuStreamSynchronize"] == 3 and not up.ok
    held.wait()  # the last batch: each stream synchronised again, then the slots freed
    assert lib.pinned_bytes == 0 and lib.pending == 0


def test_extents_are_the_address_ranges_of_views_one_per_allocation():
    a, b = np.zeros(3 * 4096, np.uint8), np.zeros(100, np.uint8)
    views = [a[8192:], a[:4000], a[4096:8000], b[:0], b]  # gaps under a page: one allocation
    got = gpu.extents(views)
    lo = a.ctypes.data
    assert (lo, a.nbytes) in got and (b.ctypes.data, 100) in got and len(got) == 2
    assert got == sorted(got)
    assert gpu.extents([a[:4000], a[8192:]]) == [(lo, 4000), (lo + 8192, 4096)]  # a page apart
    assert gpu.extents([]) == []


def test_a_batch_populates_its_destinations_before_any_copy_lands(monkeypatch):
    """Fresh managed memory is faulted in page by page by the copies that land in it; a batch
    asks the driver to back its destinations first, and every copy waits for that on its own
    stream (the reader threads never block on it). (tests/cuda_driver.py: without CUDA.)"""
    from tests.cuda_driver import upload

    up, lib = upload(monkeypatch, SLOT, 2)
    data, dst = np.arange(3 * SLOT, dtype=np.uint8), np.zeros(3 * SLOT, np.uint8)
    batch = up.batch()
    batch.populate(gpu.extents([dst]))
    for i in range(3):
        _send(batch, data[i * SLOT : (i + 1) * SLOT], dst[i * SLOT :])
    batch.wait()
    assert lib.ran[0] == ("populate", dst.ctypes.data, dst.nbytes)
    assert [k for k, _, _ in lib.ran[1:]] == ["copy"] * 3
    assert np.array_equal(dst, data) and up.populated == dst.nbytes
    assert lib.live == (2, 3, 2)  # the slots' and the population's stream; its event destroyed


@pytest.mark.parametrize("call", ["cuMemPrefetchAsync_v2", "cuCtxGetDevice", "cuEventCreate"])
def test_a_failed_population_leaves_the_copies_as_they_were(monkeypatch, call):
    """Populating is a hint: a failing call turns it off for good, never the upload, and the
    copies land all the same, unordered behind it."""
    from tests.cuda_driver import upload

    up, lib = upload(monkeypatch, SLOT, 2, fail={call: {1 if call != "cuEventCreate" else 3}})
    data, dst = np.arange(SLOT, dtype=np.uint8), np.zeros(SLOT, np.uint8)
    for _ in range(2):
        batch = up.batch()
        batch.populate(gpu.extents([dst]))
        _send(batch, data, dst)
        batch.wait()
        assert np.array_equal(dst, data) and up.ok and not up.populating
    assert lib.calls["cuMemPrefetchAsync_v2"] == (call == "cuMemPrefetchAsync_v2")
    assert [k for k, _, _ in lib.ran] == ["copy", "copy"] and up.populated == 0
    assert lib.live[2] == 2  # no event of a population left behind


def test_an_upload_turned_off_destroys_its_population_stream(monkeypatch):
    from tests.cuda_driver import upload

    up, lib = upload(monkeypatch, SLOT, 2, fail={"cuMemcpyHtoDAsync_v2": {2}})
    data, dst = np.arange(SLOT, dtype=np.uint8), np.zeros(SLOT, np.uint8)
    batch = up.batch()
    batch.populate(gpu.extents([dst]))
    _send(batch, data, dst)
    with pytest.raises(gpu.DeviceError):
        _send(batch, data, dst)
    batch.wait()
    assert not up.ok and lib.pinned_bytes == 0 and lib.live == (0, 0, 0)
    batch = up.batch()
    batch.populate(gpu.extents([dst]))  # off: nothing asked of the driver
    batch.wait()
    assert lib.calls["cuMemPrefetchAsync_v2"] == 1


@pytest.mark.parametrize("call", ["cuMemAllocHost_v2", "cuStreamCreate", "cuEventCreate"])
def test_an_upload_that_fails_to_open_frees_what_it_made(monkeypatch, call):
    """``_open`` gives None when a slot cannot be made; the slots made before it stayed pinned."""
    from tests.cuda_driver import FakeDriver

    monkeypatch.setattr(gpu, "SLOT_BYTES", SLOT)
    lib = FakeDriver(fail={call: {3}})  # the third slot fails
    with pytest.raises(gpu.DeviceError):
        gpu.Upload(lib, 1, slots=4)
    assert lib.pinned_bytes == 0 and lib.live == (0, 0, 0)
