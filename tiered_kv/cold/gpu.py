"""Verified file bytes into GPU memory on CUDA: pinned staging buffers and DMA copies.

On CUDA every MLX array is managed memory (``cudaPointerGetAttributes`` says so for each array
of mlx-cuda 0.32.4). A reader that writes file bytes into such an array from the CPU first
touches its pages in host memory, at 2-3 GB/s, and the GPU then migrates them back. Here a
reader thread reads a piece of the file into a pinned host buffer (a *slot*), checks its chunk
digests there, and the GPU's copy engine moves it into the array (``cuMemcpyHtoDAsync``) while
the thread reads the next piece into another slot. Measured on the H200 (1 GiB, xxh3 of every
4 MiB chunk, 4 readers): page cache warm, 13.2 GB/s where the CPU-written array plus a
``cuMemPrefetchAsync`` ran at 5.3 GB/s and ``mx.load`` at 4.1 GB/s; cold, all of them at the
disk's 1.5-1.8 GB/s.

It calls the CUDA driver library that MLX links (``libcuda.so.1``) through ctypes, in the
context MLX uses (its device's primary context). :func:`shared` opens one :class:`Upload` per
process (its slots are pinned once and reused: ``SLOTS`` x ``SLOT_BYTES``, 128 MiB); it is None
where there is no CUDA, no driver or no context, and after a driver call failed (logged once):
loads and `both`'s readers then write the (managed) arrays from the CPU. A failed call raises :class:`DeviceError`: the bytes did not reach the GPU, the file is
not to blame.

Population: an array the reader lands in is fresh managed memory (MLX allocates every load's arrays
anew after a restart) that no page backs yet, and a copy into it faults its pages in one by one.
:meth:`Batch.populate` asks the driver (``cuMemPrefetchAsync``) to back the destinations on the GPU
in bulk first, on a stream of its own, and every copy of the batch waits for that (an event)
without blocking a reader. It is a hint: a failing call turns it off (logged once), never the
upload. :data:`POPULATE` off leaves it out (an A/B switch for measurements).

Slots: made at the open (those made before a failing one are freed), taken by a reader for one
piece and given back. Once the upload is off they are never used again, so they are freed (pinned
memory is page-locked: out of the page cache's reach) as soon as no batch is open — the last one
freeing them after its wait — each stream synchronised first, so no copy still reads its slot; a
slot whose stream does not synchronise stays allocated. A batch asks for slots only before its
wait, and none once the upload is off.

Threads: :func:`shared`, :meth:`Upload.batch` and the :class:`Batch` methods run on any thread
and touch bytes and device addresses only, never an MLX array; the caller waits for its batch
(:meth:`Batch.wait`) before MLX uses (or frees) the arrays it was copying into.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import mlx.core as mx

log = logging.getLogger(__name__)

#: bytes of one pinned staging buffer: whole checksum chunks of one read (checksums.CHUNK_BYTES is 1 MiB)
SLOT_BYTES = 16 << 20
#: staging buffers: two per reader thread of a ranged read (one filling, one being copied)
SLOTS = 8
#: back a batch's destinations on the GPU before its copies (:meth:`Batch.populate`); read at the open
POPULATE = True
#: destinations closer than this are one range to populate (arrays of one allocation sit a page apart)
EXTENT_GAP = 4096
_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit ordering with MLX's streams
_NO_TIMING = 2  # CU_EVENT_DISABLE_TIMING


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class DeviceError(RuntimeError):
    """A CUDA driver call failed: what was being copied did not reach the GPU."""


class Staging:
    """A slot being filled by one reader thread: ``buf`` to read into, :meth:`copy` to send."""

    def __init__(self, up: Upload, slot: _Slot, after: ctypes.c_void_p | None = None) -> None:
        self._up, self._slot, self._after = up, slot, after
        self.buf = slot.buf

    def copy(self, start: int, nbytes: int, dst: int) -> None:
        """Start copying ``buf[start:start + nbytes]`` to device address ``dst``; returns at once
        (the copy runs once the batch's destinations are populated)."""
        up, s = self._up, self._slot
        if self._after is not None:
            up._call("cuStreamWaitEvent", s.stream, self._after, ctypes.c_uint(0))
        up._call("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(dst),
                 ctypes.c_void_p(s.base + start), ctypes.c_size_t(nbytes), s.stream)  # fmt: skip
        up._call("cuEventRecord", s.event, s.stream)
        with up._lock:
            up.bytes += nbytes


class _Slot:
    """One pinned buffer with the stream its copies run on and an event after the last one."""

    def __init__(self, up: Upload) -> None:
        self.addr, self.stream, self.event = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        try:
            up._call("cuMemAllocHost_v2", ctypes.byref(self.addr), ctypes.c_size_t(SLOT_BYTES))
            up._call("cuStreamCreate", ctypes.byref(self.stream), _NON_BLOCKING)
            up._call("cuEventCreate", ctypes.byref(self.event), _NO_TIMING)
        except DeviceError:
            self.free(up)  # what was made (nothing was copied yet)
            raise
        self.base = int(self.addr.value or 0)
        self.buf = memoryview((ctypes.c_uint8 * SLOT_BYTES).from_address(self.base)).cast("B")

    def free(self, up: Upload) -> bool:
        """Destroy the event and stream and free the buffer, once the stream synchronised (no copy
        reads the buffer any more); False, all kept, when it does not. The context is current."""
        if self.stream.value and up._try("cuStreamSynchronize", self.stream):
            return False
        for name, handle in (("cuEventDestroy_v2", self.event), ("cuStreamDestroy_v2", self.stream),
                             ("cuMemFreeHost", self.addr)):  # fmt: skip
            if handle.value and up._try(name, handle):
                log.info("GPU upload: %s failed while freeing a slot", name)
        return True


class Upload:
    """Pinned slots and their copies to one GPU; shared by every reader thread of a process."""

    def __init__(self, lib: ctypes.CDLL, context: int, slots: int = SLOTS) -> None:
        self._lib, self._context = lib, ctypes.c_void_p(context)
        self._lock = threading.Lock()
        self.ok = True
        self.bytes = 0  # bytes copied to the GPU
        self.populated = 0  # bytes of destinations populated on the GPU before their copies
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        self._open = 0  # batches not yet waited for
        self._released = False
        #: whether batches populate their destinations (a driver without the call: never)
        self.populating = POPULATE and hasattr(lib, "cuMemPrefetchAsync_v2")
        self._device, self._populate = ctypes.c_int(), ctypes.c_void_p()  # made at the first use
        self._call("cuCtxSetCurrent", self._context)
        try:
            for _ in range(slots):
                self._free.put(_Slot(self))
        except DeviceError:
            self._release()
            raise

    def _populate_stream(self) -> ctypes.c_void_p | None:
        """The stream populations run on (made at the first; None: off, or it cannot be made)."""
        with self._lock:
            if self.populating and not self._populate.value:
                err = self._try("cuCtxGetDevice", ctypes.byref(self._device)) or self._try(
                    "cuStreamCreate", ctypes.byref(self._populate), _NON_BLOCKING)  # fmt: skip
                if err:
                    self._populate = ctypes.c_void_p()
                    self.populating = False
                    log.info("GPU upload: destinations not populated ahead: CUDA error %s", err)
            return self._populate if self.populating else None

    def _populate_off(self, why: str) -> None:
        with self._lock:
            if self.populating:
                log.info("GPU upload: destinations no longer populated ahead: %s", why)
            self.populating = False

    def batch(self) -> Batch:
        """The copies of one read, waited for together (:meth:`Batch.wait` closes it)."""
        with self._lock:
            self._open += 1
        return Batch(self)

    def _closed(self) -> None:
        """A batch was waited for: when the upload is off and it was the last open one, nothing
        will use the slots again — free them (module doc)."""
        with self._lock:
            self._open -= 1
            last = not self.ok and self._open == 0 and not self._released
            self._released = self._released or last
        if last:
            self._release()

    def _release(self) -> None:
        """Free every slot at home (all of them: no batch is open) that can be freed."""
        slots: list[_Slot] = []
        while not self._free.empty():
            slots.append(self._free.get())
        if self._try("cuCtxSetCurrent", self._context):
            kept = len(slots)
        else:
            kept = sum(not s.free(self) for s in slots)
            p = self._populate
            if p.value and not self._try("cuStreamSynchronize", p):
                self._try("cuStreamDestroy_v2", p)
                self._populate = ctypes.c_void_p()
        log.info("GPU upload: %d pinned slots freed, %d kept", len(slots) - kept, kept)

    def _try(self, name: str, *args: object) -> int:
        """A driver call's error code (0: done), changing nothing here (freeing, after a failure)."""
        return int(getattr(self._lib, name)(*args))

    def _call(self, name: str, *args: object) -> None:
        err = self._try(name, *args)
        if err:
            with self._lock:
                if self.ok:
                    log.warning("GPU upload of cold KV turned off: %s returned %s", name, err)
                self.ok = False
            raise DeviceError(f"{name} returned CUDA error {err}")


class Batch:
    """Copies issued by one read (any of its threads); :meth:`wait` until all of them ran."""

    slot_bytes = SLOT_BYTES

    def __init__(self, up: Upload) -> None:
        self._up = up
        self._used: set[_Slot] = set()
        self._lock = threading.Lock()
        self._waited = False
        self._after: ctypes.c_void_p | None = None  # recorded once the destinations are populated

    def populate(self, extents: Sequence[tuple[int, int]]) -> None:
        """Back the destinations (device address, bytes) with GPU memory before this batch's
        copies land in them (module doc); returns at once. Before any :meth:`slot`, by the thread
        that made the batch."""
        up = self._up
        if (not up.ok or not extents or self._after is not None
                or up._try("cuCtxSetCurrent", up._context)):  # fmt: skip
            return
        stream = up._populate_stream()
        if stream is None:
            return
        event = ctypes.c_void_p()
        err = up._try("cuEventCreate", ctypes.byref(event), _NO_TIMING)
        for addr, nbytes in extents:
            err = err or up._try("cuMemPrefetchAsync_v2", ctypes.c_uint64(addr),
                                 ctypes.c_size_t(nbytes), _Location(_DEVICE, up._device.value),
                                 ctypes.c_uint(0), stream)  # fmt: skip
        err = err or up._try("cuEventRecord", event, stream)
        if err:  # the copies need not wait: they fault their pages in, as without it
            if event.value:
                up._try("cuEventDestroy_v2", event)
            up._populate_off(f"CUDA error {err}")
            return
        self._after = event
        with up._lock:
            up.populated += sum(n for _, n in extents)

    @contextlib.contextmanager
    def slot(self) -> Iterator[Staging]:
        """A pinned buffer of ``SLOT_BYTES`` free to fill (its previous copy has finished);
        :meth:`Staging.copy` from it before the block ends. Blocks while every slot is in use.
        Only before :meth:`wait`. Raises DeviceError once the upload is off."""
        up = self._up
        assert not self._waited, "a batch takes slots only before its wait"
        if not up.ok:  # its slots may be freed: never waited for, never touched
            raise DeviceError("GPU upload is off")
        s = up._free.get()
        try:
            if not up.ok:  # turned off while this waited for a slot
                raise DeviceError("GPU upload is off")
            up._call("cuCtxSetCurrent", up._context)  # per thread: readers are pool threads
            up._call("cuEventSynchronize", s.event)
            with self._lock:
                self._used.add(s)
            yield Staging(up, s, self._after)
        finally:
            up._free.put(s)

    def wait(self) -> None:
        """Until every copy of this batch has finished (with copies of later users of the same
        slots: they only wait longer), once all its slots were given back; the batch is done
        then (an upload that is off frees its slots after the last one). Raises DeviceError."""
        up = self._up
        with self._lock:
            used = list(self._used)
            first, self._waited = not self._waited, True
        try:
            if used:
                up._call("cuCtxSetCurrent", up._context)
            failed: DeviceError | None = None
            for s in used:  # every stream, whatever one of them says: no copy may land after this
                try:
                    up._call("cuStreamSynchronize", s.stream)
                except DeviceError as e:
                    failed = failed or e
            if failed is not None:
                raise failed
        finally:
            if first:
                if self._after is not None:  # the population is done too before the caller may
                    # free the destinations (a failure only says the hint was not taken)
                    if up._try("cuCtxSetCurrent", up._context) or up._try(
                            "cuEventSynchronize", self._after):  # fmt: skip
                        up._populate_off("its event did not synchronise")
                    up._try("cuEventDestroy_v2", self._after)
                up._closed()


_SHARED: list[Upload | None] = []
_SHARED_LOCK = threading.Lock()


def shared() -> Upload | None:
    """The process's upload to the GPU of MLX's CUDA context (opened at the first call, from any
    thread), or None: no CUDA, driver or context, or turned off by a failed call."""
    with _SHARED_LOCK:
        if not _SHARED:
            _SHARED.append(_open())
        up = _SHARED[0]
    return up if up is not None and up.ok else None


def extents(views: Iterable[Any], gap: int = EXTENT_GAP) -> list[tuple[int, int]]:
    """The (address, bytes) ranges that ``views`` (C-contiguous arrays, e.g. byte views of the
    arrays a read lands in) cover, by address, those less than ``gap`` apart merged into one."""
    spans = sorted((int(v.ctypes.data), int(v.nbytes)) for v in views if v.nbytes)
    out: list[tuple[int, int]] = []
    for addr, nbytes in spans:
        if out and addr - (out[-1][0] + out[-1][1]) < gap:
            lo = out[-1][0]
            out[-1] = (lo, max(out[-1][0] + out[-1][1], addr + nbytes) - lo)
        else:
            out.append((addr, nbytes))
    return out


def uploaded_bytes() -> int:
    """Bytes the process's upload has copied to the GPU (0 where there is none)."""
    up = _SHARED[0] if _SHARED else None
    return up.bytes if up is not None else 0


def _open() -> Upload | None:
    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name, args in _SIGNATURES.items():
            getattr(lib, name).argtypes = args
        for name, args in _POPULATE_SIGNATURES.items():
            if hasattr(lib, name):
                getattr(lib, name).argtypes = args
    except (OSError, AttributeError) as e:
        log.info("no GPU upload of cold KV: %s", e)
        return None
    context = _context(lib)
    if context is None:
        return None
    try:
        return Upload(lib, context)
    except DeviceError:
        return None


def _context(lib: ctypes.CDLL) -> int | None:
    """MLX's CUDA context: the one current on this thread, else the primary context of MLX's
    default device (MLX uses the runtime API, whose context is the device's primary one; a
    thread that has not run MLX work yet has none current — the first load may come before)."""
    context = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(context)) == 0 and context.value:
        return int(context.value)
    device = ctypes.c_int()
    ordinal = getattr(mx.default_device(), "index", 0)  # MLX 0.32's Device does not expose it
    if (lib.cuInit(0) or lib.cuDeviceGet(ctypes.byref(device), ordinal)
            or lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) or not context.value):  # fmt: skip
        return None
    return int(context.value)


_P = ctypes.c_void_p
_SIGNATURES = {
    "cuCtxGetCurrent": [ctypes.POINTER(_P)],
    "cuCtxSetCurrent": [_P],
    "cuInit": [ctypes.c_uint],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_P), ctypes.c_int],
    "cuMemAllocHost_v2": [ctypes.POINTER(_P), ctypes.c_size_t],
    "cuStreamCreate": [ctypes.POINTER(_P), ctypes.c_uint],
    "cuEventCreate": [ctypes.POINTER(_P), ctypes.c_uint],
    "cuEventRecord": [_P, _P],
    "cuEventSynchronize": [_P],
    "cuStreamSynchronize": [_P],
    "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, _P, ctypes.c_size_t, _P],
    "cuMemFreeHost": [_P],
    "cuStreamDestroy_v2": [_P],
    "cuEventDestroy_v2": [_P],
    "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
    "cuStreamWaitEvent": [_P, _P, ctypes.c_uint],
}
#: what populating needs beyond the copies (a driver without it copies all the same)
_POPULATE_SIGNATURES = {
    "cuMemPrefetchAsync_v2": [ctypes.c_uint64, ctypes.c_size_t, _Location, ctypes.c_uint, _P],
}
