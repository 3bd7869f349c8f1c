"""Token ranges of an entry file: ranged reads verified by the entry's own chunk checksums.

An entry file is standard safetensors (cold format 3, :mod:`store`); a layer's KV tensor, logically
``(1, heads, T, row)``, is stored token-major, ``(1, T, heads, row)``, so tokens ``[s, e)`` of it
are ONE contiguous run of bytes (head-major, as in format 2, they were ``heads`` runs with gaps
between them, which a virtio disk read at half its sequential speed). The header also holds, in
``__metadata__`` (covered by the header checksum), ``chunk_bytes`` and ``xxh3``: per tensor the
xxh3_64 of each ``chunk_bytes`` piece of its bytes as stored. :func:`read_range` reads the whole
chunks that cover tokens ``[m, n)`` of every layer tensor (one span each, a few adjacent chunks
per positioned read) plus the chunks of ``tokens[0, n)``, and checks every chunk before anything is
served: no unverified byte leaves this module. There is no second integrity scheme: what the load
path checks, the ranged path checks. The cost is read granularity: a range is read in whole chunks
(``checksums.CHUNK_BYTES``, 1 MiB), so it reads up to two chunks per tensor more than it serves.

Files are opened with :func:`store.open_entry` (a symlink or FIFO planted in the cache dir is a
corrupt entry, never followed or waited on) and the header is read from that same descriptor — or,
where the caller passes the header it already read (a `both`'s layout), compared with the file's
bytes there instead of parsed again (:func:`store.same_file`).

Threads: :func:`read_range` touches only files, bytes and numpy — it is what the restore I/O
thread runs, and never touches MLX. The kernel's side of a read (the page-cache probe, readahead per
open file, fresh memory faulted in) is :mod:`tiered_kv.cold.pages`'s.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiered_kv import background
from tiered_kv.cold import checksums, pages, store
from tiered_kv.cold.gpu import Batch, Upload, extents

_HEX = checksums.HEX


class Unsplittable(ValueError):
    """The entry cannot be read by token ranges (layers without one row per token)."""


class Cancelled(Exception):
    """The read was called off (``stop`` set: its request went away). Nobody waits for it; it is
    no fault of the file's."""


Stop = threading.Event | None


@dataclass
class RangeRead:
    """Verified bytes of ``[start, stop)`` of every layer tensor, and the entry's first tokens."""

    start: int  # the m asked for
    stop: int  # the n asked for
    tokens: np.ndarray  # int32 ids [0, stop)
    #: tensor name → (dtype name as in safetensors, uint8 array (1, stop - start, heads, row))
    tensors: dict[str, tuple[str, np.ndarray]]
    metadata: dict[str, str]
    nbytes: int  # bytes read (whole chunks: ≥ the bytes served)
    seconds: float
    #: the first token read and verified in every tensor: ``start``, or more where a
    #: :class:`Meet` let the read stop early (the rows before it hold unverified bytes)
    first: int = 0
    served: int = 0  # bytes of the tensors' rows read and verified ([first, stop) or more)


class Meet:
    """Where a `both`'s read and its compute meet, shared by the engine thread and the readers.

    The engine thread raises :attr:`floor` (tokens of the hit it has computed) as it computes past
    the planned ``m`` while the read is still going; the readers go through each tensor's span
    from its end backwards and stop once all that is left of it lies below the floor. They count
    the bytes they served, so the engine thread can tell how much of the read is left
    (:meth:`left`), and record, per tensor, the first token they read (:attr:`reached`)."""

    def __init__(self, floor: int) -> None:
        self.floor = floor  # written by the engine thread only; read between a reader's pieces
        self.total = 0  # bytes the read serves if it never stops early (set before it starts)
        self.reached: dict[str, int] = {}  # tensor → its first whole token read and verified
        self._done = 0
        self._lock = threading.Lock()

    def served(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes

    @property
    def done(self) -> int:
        return self._done

    def left(self) -> float:
        """The share of :attr:`total` not read yet (1.0 before the read started)."""
        return 1.0 - self._done / self.total if self.total else 1.0


def plan_tensors(header: store.Header) -> dict[str, dict[str, Any]]:
    """The tensors a ranged read returns (every one but ``tokens``), each stored token-major;
    Unsplittable when some tensor has no per-token rows (checkpoints, wrapped windows, recurrent
    state: the file stores those in their own order)."""
    out = {}
    for name, t in header.tensors.items():
        if name == "tokens":
            continue
        if name not in header.token_major:
            raise Unsplittable(f"tensor {name} cannot be read by token range")
        out[name] = t
    return out


def layout(path: Path, fingerprint: str, m: int, n: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """:func:`layout_of` the header of the entry at ``path``. Raises as :func:`read_range` does."""
    return layout_of(store.read_header(path, fingerprint), m, n)


def layout_of(header: store.Header, m: int, n: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The layer tensors of an entry, from its checked header alone: name → (safetensors dtype,
    token-major shape of its first ``n`` tokens, ``(1, n, heads, ...)``). The caller allocates
    destinations from it for ``read_range(..., m, n, into=, header=)`` (see there). Raises
    Unsplittable, ValueError (range)."""
    _check_bounds(m, n, header.n_tokens)
    out = {}
    for name, t in plan_tensors(header).items():
        shape = [int(x) for x in t["shape"]]
        shape[1] = n
        out[name] = (str(t["dtype"]), tuple(shape))
    return out


def _check_bounds(m: int, n: int, total: int) -> None:
    if not 0 <= m < n <= total:
        raise ValueError(f"range [{m}, {n}) outside the entry's {total} tokens")


#: reader threads of a ranged read (a `both`'s tail: a short span of each of many tensors). On the
#: H100, 8B 8k, the last 1k-4k tokens with 1 MiB chunks, page cache dropped: 8 readers served
#: 2.07-2.25 GB/s where 4 served 1.86-2.09 (`bench.tails`), and through the pinned slots 1.29-1.43
#: against 1.09-1.33 on a slower disk of another H100; on the 2-core CPU VM it made no difference
#: beyond the noise (a `both` rarely pays there: loading wins)
RANGE_READERS = 8


def read_range(path: Path, fingerprint: str, m: int, n: int, workers: int = RANGE_READERS,
               into: dict[str, np.ndarray] | None = None, gpu: Upload | None = None,
               stop: Stop = None, header: store.Header | None = None,
               meet: Meet | None = None) -> RangeRead:  # fmt: skip
    """Verified tokens ``[0, n)`` and rows ``[m, n)`` of every layer tensor, token-major.

    ``meet`` (optional, a `both`'s): each tensor's rows are read from ``n`` backwards, and a
    tensor's read ends once what is left of it lies below ``meet.floor`` (the compute holds those
    tokens); the result's ``first`` is then the first row read in every tensor, and only rows
    ``[first, n)`` are verified.

    ``header`` (optional): the entry's header as the caller read and checked it (the one it took
    :func:`layout_of` from): not parsed again, but the file opened here must be the one it was
    read from (:func:`store.same_file`: a file replaced since raises CorruptEntry).

    ``into`` (optional): per tensor, a writable C-contiguous uint8 array ``(1, n - m, heads, row
    bytes)`` (e.g. tokens ``[m, n)`` of a byte view of a ``(1, n, heads, ...)`` array allocated
    from :func:`layout`); the rows are read straight into it (one copy: kernel to destination) and
    it is what the result holds. Without it, arrays are allocated here. On any error the
    destinations hold unverified bytes and must not be used.

    ``gpu`` (CUDA, with ``into``): the destinations are views of GPU (managed) memory that the
    CPU never writes; each verified piece is staged in pinned memory and copied to its address
    by the GPU (:mod:`gpu`), and the read returns once every copy has finished (on an error too).
    Raises gpu.DeviceError when a copy failed.

    Raises store.CorruptEntry (checksum, short file, a symlink), store.ForeignEntry,
    Unsplittable, FileNotFoundError, ValueError (range, or ``into`` of another layout),
    Cancelled (``stop`` set: no further read starts). Files and numpy only: safe on any thread
    (``workers`` daemon threads of its own read the tensors, and never touch MLX either).
    """
    t0 = time.perf_counter()
    with _reading(path, gpu, True, into) as (fd, batch):
        if header is None:
            header = store.read_header_fd(fd, fingerprint)
        else:
            header = store.same_file(fd, header, fingerprint)
        chunk, total = header.chunk_bytes, header.n_tokens
        _check_bounds(m, n, total)
        tensors = plan_tensors(header)
        if into is not None and set(into) != set(tensors):
            raise ValueError("destinations differ from the entry's tensors")

        def span(name: str, t: dict[str, Any], dst: np.ndarray, first: int,
                 to: Batch | None = None, meeting: Meet | None = None) -> int:  # fmt: skip
            """Tokens from ``first`` of tensor ``name`` into ``dst`` (one contiguous span)."""
            base = header.data_start + int(t["data_offsets"][0])
            size = int(t["data_offsets"][1]) - int(t["data_offsets"][0])
            per = dst[0].nbytes // max(1, dst.shape[1])  # bytes of one token
            return read_span(fd, base, size, first * per, dst, header.digests(name), chunk, name, to,
                             stop, meeting, per)  # fmt: skip

        def one(name: str, t: dict[str, Any]) -> tuple[str, tuple[str, np.ndarray], int]:
            shape = (1, n - m, int(t["shape"][2]), _row_bytes(t))
            if into is None:
                buf = np.empty(shape, dtype=np.uint8)
            else:
                buf = into[name]
                if (buf.shape != shape or buf.dtype != np.uint8 or not buf.flags.writeable
                        or not buf.flags.c_contiguous):  # fmt: skip
                    raise ValueError(f"destination of {name} is not contiguous writable uint8 {shape}")
            return name, (t["dtype"], buf), span(name, t, buf, m, batch, meet)

        if meet is not None:
            meet.total = sum((n - m) * int(t["shape"][2]) * _row_bytes(t) for t in tensors.values())
        tok = np.empty((1, n, 4), dtype=np.uint8)
        read = span("tokens", header.tensors["tokens"], tok, 0)
        # positioned reads release the GIL: a few in flight keep a fast disk (or the page cache) busy
        done = background.each(lambda kv: one(*kv), list(tensors.items()), workers, "tkv-range")
    out = {name: value for name, value, _ in done}
    read += sum(got for _, _, got in done)
    tokens = tok.reshape(-1).view("<i4").copy()
    first, served = m, sum(u8.nbytes for _, u8 in out.values())
    if meet is not None:  # the first token read in every tensor
        first, served = max([m, *meet.reached.values()]), meet.done
    return RangeRead(m, n, tokens, out, dict(header.metadata), read, time.perf_counter() - t0,
                     first, served)  # fmt: skip


#: bytes (whole chunks) read per positioned read, then verified while still in cache
_GROUP_BYTES = 16 << 20
_IOV_MAX = 512


def read_span(fd: int, base: int, size: int, first: int, dest: np.ndarray, digests: str,
              chunk: int, name: str, gpu: Batch | None = None, stop: Stop = None,
              meet: Meet | None = None, per: int = 0) -> int:  # fmt: skip
    """Fill ``dest`` (a writable contiguous uint8 array) with the bytes from ``first`` of the
    tensor of ``size`` bytes at file offset ``base``. The whole checksum chunks covering them are
    read, a few per ``preadv``, straight into ``dest`` (the chunk bytes before and after it land
    in scratch buffers), and each chunk is hashed over its pieces: a chunk that fails raises
    CorruptEntry. Returns the bytes read.

    With ``gpu`` (``dest`` is a view of GPU memory: its address is all that is used) the chunks
    are read into a pinned slot instead, hashed there, and the GPU copies the part that belongs
    to ``dest`` — only verified bytes are sent. Raises gpu.DeviceError when a copy failed, and
    Cancelled before a read once ``stop`` is set.

    With ``meet`` the pieces are read from the end backwards, and the read ends early once what is
    left lies below ``meet.floor`` tokens of ``per`` bytes (:class:`Meet`, which it tells what it
    served and the first whole token it reached)."""
    end = first + dest.nbytes
    if end > size:
        raise store.CorruptEntry(f"short tensor {name}")
    if not dest.nbytes:
        return 0
    if gpu is not None and chunk <= gpu.slot_bytes:
        return sum(_via(gpu, fd, base, first, end, dest.ctypes.data, digests, chunk, name, lo, hi)
                   for lo, hi in _groups(size, first, end, chunk, gpu.slot_bytes // chunk, name,
                                         stop, meet, per))  # fmt: skip
    d = dest.data.cast("B")
    read = 0
    for lo, hi in _groups(size, first, end, chunk, max(1, _GROUP_BYTES // chunk), name, stop, meet,
                          per):  # fmt: skip
        pieces = _pieces(lo, hi, first, d)
        for _, v in pieces:
            pages.prefault(v)
        _preadv_all(fd, [v for _, v in pieces], base + lo)
        read += hi - lo
        for c in range(lo // chunk, -(-hi // chunk)):
            a, b = c * chunk, min(size, (c + 1) * chunk)
            h = xxhash.xxh3_64()
            for off, v in pieces:
                s, e = max(a, off), min(b, off + len(v))
                if s < e:
                    h.update(v[s - off : e - off])
            if h.hexdigest() != digests[c * _HEX : (c + 1) * _HEX]:
                raise store.CorruptEntry(f"range checksum mismatch in {name}")
    return read


def _groups(size: int, first: int, end: int, chunk: int, group: int, name: str, stop: Stop,
            meet: Meet | None, per: int) -> Iterator[tuple[int, int]]:  # fmt: skip
    """The byte ranges ``[lo, hi)`` of a tensor that :func:`read_span` reads one at a time: the
    whole chunks covering ``[first, end)``, ``group`` chunks each, in order — or, with ``meet``,
    from the end backwards until what is left lies below its floor. Each is yielded once its
    caller may read it (``stop`` checked) and counted as served once the caller is through with
    it; with ``meet``, the first whole token reached is recorded at the end."""
    c0, c1 = first // chunk, -(-end // chunk)
    starts = range(c0, c1, group)
    low = end
    for g0 in reversed(starts) if meet is not None else starts:
        _check_stop(stop)
        lo, hi = g0 * chunk, min(size, min(c1, g0 + group) * chunk)
        if meet is not None and min(hi, end) <= meet.floor * per:
            break  # the compute holds all that is left
        yield lo, hi
        low = max(lo, first)
        if meet is not None:
            meet.served(min(hi, end) - low)
    if meet is not None:
        meet.reached[name] = -(-low // max(1, per))


def _via(gpu: Batch, fd: int, base: int, first: int, end: int, dst: int, digests: str,
         chunk: int, name: str, lo: int, hi: int) -> int:  # fmt: skip
    """:func:`read_span`'s whole chunks ``[lo, hi)`` of a tensor (at most a slot) to the device
    address ``dst`` of its byte ``first`` through a pinned slot: read, verified, then its part in
    ``[first, end)`` copied. Returns the bytes read."""
    g0, g1 = lo // chunk, -(-hi // chunk)
    with gpu.slot() as slot:
        buf = slot.buf[: hi - lo]
        _preadv_all(fd, [buf], base + lo)
        if checksums.chunk_digests([buf], chunk) != digests[g0 * _HEX : g1 * _HEX]:
            raise store.CorruptEntry(f"range checksum mismatch in {name}")
        a, b = max(lo, first), min(hi, end)
        slot.copy(a - lo, b - a, dst + (a - first))
    return hi - lo


def _check_stop(stop: Stop) -> None:
    if stop is not None and stop.is_set():
        raise Cancelled("read called off")


#: reader threads of a whole-entry read (one tensor each, one open file each: :func:`pages.reopen`). On
#: the H100 host (16 cores), ``ColdTier.load`` of 8k tokens, 6 interleaved rounds, medians: 8B warm
#: 86 ms with 4 readers, 75 ms with 8, 82 ms with 16; 1B warm 25.5 / 23.3 / 25.8 ms; cold 8B 526 /
#: 511 / 514 ms. A machine of fewer cores keeps 4 (the 2-core VM: no clear difference, its warm
#: reads are one core's copies and hashes at a time)
LOAD_READERS = 8 if (os.cpu_count() or 1) >= 8 else 4


def read_tensors(path: Path, header: store.Header, into: dict[str, np.ndarray],
                 gpu: Upload | None = None, workers: int = LOAD_READERS, stop: Stop = None) -> int:  # fmt: skip
    """Every tensor of the entry at ``path`` whole, verified chunk by chunk against ``header``
    (checked already, e.g. by the index lookup): ``into`` maps each name to a writable contiguous
    uint8 array of its bytes as stored; with ``gpu``, views of GPU memory the GPU copies into
    (:func:`read_span`), waited for before this returns, on an error too. ``workers`` daemon
    threads read a tensor each. Returns the bytes read. Raises store.CorruptEntry (a checksum, a
    file whose size changed since ``header``, a symlink), FileNotFoundError, OSError,
    gpu.DeviceError, Cancelled (``stop`` set: no further read starts). Files, bytes and numpy
    only: any thread."""
    if set(into) != set(header.tensors):
        raise ValueError("destinations differ from the entry's tensors")
    with _reading(path, gpu, False, into) as (fd, batch):
        if os.fstat(fd).st_size != header.data_start + header.data_len:
            raise store.CorruptEntry("file size changed since its header was read")

        def one(name: str) -> int:
            start, end = (int(x) for x in header.tensors[name]["data_offsets"])
            dst = into[name]
            if dst.nbytes != end - start or not dst.flags.c_contiguous:
                raise ValueError(f"destination of {name} does not hold its {end - start} bytes")
            own = pages.reopen(fd)  # its own readahead: one sequential stream per tensor
            try:
                return read_span(own, header.data_start + start, end - start, 0, dst,
                                 header.digests(name), header.chunk_bytes, name, batch, stop)  # fmt: skip
            finally:
                os.close(own)

        order = sorted(header.tensors, key=lambda k: header.tensors[k]["data_offsets"][0])
        done = threading.Event()
        ahead = None
        if batch is None and pages.faults_ahead(path):
            ahead = background.Call(lambda: pages.fault_in([into[k] for k in order], done, stop),
                                    "tkv-fault")  # fmt: skip
        try:
            return sum(background.each(one, order, workers, "tkv-read"))
        finally:
            done.set()  # the readers are through: what is left is faulted in as it is written
            if ahead is not None:
                ahead.result()


@contextlib.contextmanager
def _reading(
    path: Path, gpu: Upload | None, spans: bool, into: Mapping[str, np.ndarray] | None
) -> Iterator[tuple[int, Batch | None]]:
    """A descriptor of ``path`` for positioned reads (never through a symlink; readahead off for
    ``spans``, a range's spans, :func:`pages.no_readahead`) and the batch its GPU copies into ``into``
    go in (None without ``gpu`` or ``into``), those destinations populated on the GPU before any
    copy (:meth:`Batch.populate`). On leaving, every copy of the batch has finished — on an error
    too: nothing stays in flight into memory the caller may free — and the descriptor is closed.

    A whole file (``spans`` false) keeps the kernel's readahead: its readers each go through a
    tensor front to back, in file order, and a cold 1 GB reload of the bench shape ran at
    2.35 GB/s with it where it ran at 1.79 without (0.25 GB: 1.82 / 1.59, 4 GB: 1.47 / 1.28;
    medians of 4-8 on the 2-core VM, where mlx-lm's load read 2.28, 1.84, 1.62)."""
    fd = store.open_entry(path)
    batch: Batch | None = None
    try:
        if gpu is not None and into is not None:
            batch = gpu.batch()
            batch.populate(extents(into.values()))
        if spans:
            pages.no_readahead(fd)
        yield fd, batch
    finally:
        try:
            if batch is not None:
                batch.wait()
        finally:
            os.close(fd)


def _pieces(lo: int, hi: int, first: int, d: memoryview) -> list[tuple[int, memoryview]]:
    """Bytes ``[lo, hi)`` of a tensor as (offset, buffer) pieces in order: the part that falls in
    the destination ``d`` (at byte ``first``) a view of it, the parts before and after it a
    scratch buffer each."""
    a, b = min(max(lo, first), hi), max(lo, min(hi, first + len(d)))
    out: list[tuple[int, memoryview]] = []
    if lo < a:
        out.append((lo, np.empty(a - lo, dtype=np.uint8).data))
    if a < b:
        out.append((a, d[a - first : b - first]))
    if b < hi:
        out.append((b, np.empty(hi - b, dtype=np.uint8).data))
    return out


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill ``views`` in order from ``offset``; a short file is corrupt."""
    while views:
        batch = views[:_IOV_MAX]
        got = os.preadv(fd, batch, offset)
        if got <= 0:
            raise store.CorruptEntry("short read")
        offset += got
        j = 0
        while j < len(batch) and got >= len(batch[j]):
            got -= len(batch[j])
            j += 1
        views = views[j:]
        if got:  # a partial read stopped inside this one
            views[0] = views[0][got:]


def _row_bytes(t: dict[str, Any]) -> int:
    shape = t["shape"]
    return int(np.prod(shape[3:], dtype=np.int64)) * store.ITEMSIZE[t["dtype"]]
