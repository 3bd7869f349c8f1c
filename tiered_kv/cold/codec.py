"""Caches ⇄ entry tensors: the MLX side of the cold tier (request thread only).

* :func:`prepare` turns caches (+ checkpoints) into :class:`encode.Tensor` views of *evaluated*
  arrays — the only MLX work of a spill, done on the request thread before the job crosses to
  the writer, which then reads bytes only;
* :func:`load_steps` builds the arrays of an entry file: allocated unwritten, then every tensor
  read whole into their memory by :func:`ranged.read_tensors`, each chunk checked as it lands —
  by the readers themselves where the memory is host memory (the CPU, unified memory); on CUDA
  through pinned slots, each verified piece copied in by the GPU (:mod:`gpu`: 13 GB/s from the
  page cache on the H200, where ``mx.load`` builds managed arrays at ~4). Every way reads the
  disk once and copies nothing through Python;
* :func:`load_buffer` does the same from a whole entry in memory (a backend without files);
* every load hands back the token-major tensors of the file (``store`` module doc) as
  ``mx.swapaxes(a, 1, 2)``: a strided view of the loaded array, no copy (:func:`_logical`). The
  caches take it as it is: MLX ops read any strides, and a cache's first growth copies it anyway
  (``KVCache.update_and_fetch`` concatenates when it grows past the loaded length);
* :func:`decode` rebuilds the caches and checkpoints;
* :func:`serving` reads what an entry can serve from its metadata alone (no arrays): whether
  every layer can be cut back and its checkpoint positions (the index keeps them for lookups).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from tiered_kv import background, checkpoints, declared, layers
from tiered_kv.cold import checksums, encode, gpu, ranged, store
from tiered_kv.cold.landing import MX_DTYPES as _MX
from tiered_kv.cold.landing import allocate, host_arrays
from tiered_kv.steps import Steps

_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
_NP_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@dataclass
class Prepared:
    """An entry ready for the writer: token ids, tensor views of evaluated arrays, metadata."""

    tokens: np.ndarray
    tensors: list[encode.Tensor]
    metadata: dict[str, str]
    nbytes: int
    #: lengths of older entries this one may replace: any length when every layer can be cut
    #: back, else only its checkpoint positions
    serves: frozenset[int] | None = None


def prepare(
    tokens: np.ndarray,
    caches: list,
    ckpts: dict[int, list] | None,
    fingerprint: str,
    prompt_tokens: int | None = None,
) -> Prepared:
    """Encode and evaluate (request thread). ``prompt_tokens``: how many of ``tokens`` were the
    request's prompt (metadata ``prompt_tokens``, absent when all were: :func:`store.prompt_of`).
    Raises layers.UnsupportedCache."""
    arrays, meta = layers.encode(caches)
    ckpts = ckpts or {}
    ck_arrays, tree = checkpoints.encode(ckpts)
    arrays.update(ck_arrays)
    if tree is not None:
        meta["checkpoints"] = tree
    # every name is one the reader accepts (store refuses undeclared tensors as corrupt)
    assert declared.undeclared(arrays, meta) is None, declared.undeclared(arrays, meta)
    trimmable = layers.can_trim(caches)
    serves = checkpoints.exact_lengths(len(tokens), ckpts, trimmable)
    # same-width unsigned views: numpy has no bfloat16; a view shares the buffer (no copy)
    raw = {k: x.view(_UINT[x.itemsize]) if x.dtype == mx.bfloat16 else x for k, x in arrays.items()}
    mx.eval(list(raw.values()))
    tensors = [
        encode.Tensor(k, store.DTYPES[str(x.dtype).removeprefix("mlx.core.")], tuple(x.shape),
                     _numpy(raw[k]))
        for k, x in arrays.items()
    ]  # fmt: skip
    metadata = {**meta, "fingerprint": fingerprint, "layout": layers.layout(caches),
                "created": f"{time.time():.6f}", "trimmable": str(int(trimmable))}  # fmt: skip
    if prompt_tokens is not None and 0 < prompt_tokens < len(tokens):
        metadata["prompt_tokens"] = str(prompt_tokens)
    return Prepared(tokens, tensors, metadata, sum(t.data.nbytes for t in tensors), serves)


def _numpy(x: Any) -> np.ndarray:
    """A numpy view of an evaluated array's memory (strides kept), or a copy where the buffer
    cannot be exported."""
    try:
        return np.asarray(memoryview(x))
    except (TypeError, ValueError, BufferError):
        return np.array(x)


def load_steps(
    path: Path, header: store.Header, beside: bool = False, host: bool | None = None
) -> Steps[dict[str, mx.array]]:
    """Every tensor of ``path`` (whose checked header is ``header``), verified; ``beside`` (for a
    thread with other work to keep going, e.g. decode steps): the read runs on a thread of its own
    and each ``next()`` returns at once until it is done. Raises store.CorruptEntry (also when the
    file changed since ``header``), FileNotFoundError, OSError.

    The arrays are allocated unwritten (:func:`landing.allocate`, here: the engine thread) and
    :func:`ranged.read_tensors` reads every tensor whole into their memory, a few threads at once,
    each chunk's digest checked as soon as it lands: the disk is read once and the page cache's
    bytes are copied once, straight into the arrays (``mx.load`` copies as much, and hashing on
    the same threads cost 5 % beside it; hashing the loaded arrays afterwards cost 20 % on the
    2-core machine). Where the arrays are host memory (``host``; default :func:`host_arrays`) the
    readers write them; on CUDA each verified piece is staged in pinned memory and copied in by
    the GPU (:mod:`gpu`), or, without the driver, written by the CPU into the managed memory.
    Arrays that fail are never returned."""
    host = host_arrays() if host is None else host
    up = None if host else gpu.shared()
    if up is not None:
        try:
            return (yield from _load_into(path, header, up, beside))
        except gpu.DeviceError:  # logged, and the upload is off: the file is not to blame
            pass
    return (yield from _load_into(path, header, None, beside, one_buffer=not host))


def _load_into(path: Path, header: store.Header, up: gpu.Upload | None, beside: bool,
               one_buffer: bool = True) -> Steps[dict[str, mx.array]]:  # fmt: skip
    """The arrays of ``header`` allocated unwritten (``one_buffer``: views of few allocations,
    :func:`landing.allocate`, as on CUDA; host memory gets arrays of their own, which a cache may
    update in place), filled by :func:`ranged.read_tensors` (through ``up``'s pinned slots when
    given)."""
    layout = {n: (t["dtype"], tuple(int(x) for x in t["shape"])) for n, t in header.tensors.items()}
    try:
        arrays = allocate(layout, one_buffer=one_buffer)
    except ValueError as e:
        raise store.CorruptEntry(f"tensor layout: {e}") from None
    dests = {n: np.frombuffer(a, dtype=np.uint8) for n, a in arrays.items()}  # type: ignore[call-overload]
    try:
        yield from _read_into(path, header, dests, up, beside)
    except gpu.DeviceError:
        # a stream that failed to synchronise may still copy into them: never freed, never
        # reused (the upload is off after a failed call: at most once per process)
        _STRANDED.append(arrays)
        raise
    del dests
    return _logical(arrays, header)


#: arrays a failed GPU upload may still write into (kept, never reused)
_STRANDED: list[dict[str, mx.array]] = []


def _read_into(path: Path, header: store.Header, dests: dict[str, np.ndarray],
               up: gpu.Upload | None, beside: bool) -> Steps[None]:  # fmt: skip
    if not beside:
        ranged.read_tensors(path, header, dests, up)
        return
    stop = threading.Event()
    read = background.Call(lambda: ranged.read_tensors(path, header, dests, up, stop=stop),
                           "tkv-load")  # fmt: skip
    try:
        while not read.done():
            yield
        read.result()
    finally:
        # closed by a cancelled request: its readers stop before their next read (the engine
        # thread does not wait for them; they hold the arrays they write into, ``dests`` being
        # views of them, until they end)
        stop.set()


def _logical(arrays: dict[str, mx.array], header: store.Header) -> dict[str, mx.array]:
    """``arrays`` as loaded (verified, evaluated) with the token-major ones swapped back to
    ``(1, heads, T, row)``: views, evaluated here (a transpose shares its input's buffer)."""
    if not header.token_major:
        return arrays
    out = {k: mx.swapaxes(a, 1, 2) if k in header.token_major else a for k, a in arrays.items()}
    mx.eval([out[k] for k in header.token_major])
    return out


def load_buffer(buf: memoryview, header: store.Header) -> dict[str, mx.array]:
    """Tensors of a whole entry in memory, every chunk digest checked on the hashing pool first,
    then one copy into MLX memory (evaluated: the thread that owns MLX). Raises
    store.CorruptEntry."""
    futures = [checksums.pool().submit(store.check_buffer, n, store.tensor_bytes(buf, header, n), header)
               for n in header.tensors]  # fmt: skip
    for f in futures:
        f.result()
    out: dict[str, mx.array] = {}
    for name, t in header.tensors.items():
        width = store.ITEMSIZE[t["dtype"]]
        raw = np.frombuffer(store.tensor_bytes(buf, header, name), dtype=_NP_UINT[width])
        out[name] = mx.array(raw).view(_MX[t["dtype"]]).reshape(t["shape"])
    mx.eval(list(out.values()))
    return _logical(out, header)


def decode(arrays: dict[str, mx.array], metadata: dict[str, str]) -> tuple[list, dict[int, list]]:
    """The entry's caches and its checkpoints (arrays named ``ckpt.<pos>.<path>``).
    Raises layers.CorruptState / layers.UnsupportedCache."""
    main = {
        k: v for k, v in arrays.items() if not checkpoints.is_checkpoint_array(k) and k != "tokens"
    }
    caches = layers.decode(main, metadata)
    return caches, checkpoints.decode(arrays, metadata.get("checkpoints"))


def tokens_of(arrays: dict[str, Any]) -> np.ndarray:
    return np.array(arrays["tokens"], dtype="<i4")
