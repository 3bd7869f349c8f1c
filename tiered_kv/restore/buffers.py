"""Landing buffers of `both`: evaluated MLX arrays that the restore I/O thread reads bytes into.

`both` reads tokens ``[m, n)`` of every layer tensor while the engine thread computes ``[0, m)``.
To copy the read bytes once (kernel → final array) instead of three times (a numpy buffer,
``mx.array`` of it, ``mx.concatenate``), the engine thread allocates each layer's final array up
front, token-major like the file (``(1, n, heads, ...)``: tokens ``[m, n)`` of it are one
contiguous run, as in the file), and the I/O thread ``preadv``-s the tokens straight into its
memory. What is served is ``mx.swapaxes`` of it, ``(1, heads, n, ...)``: a view.

The arrays are made unwritten by :func:`tiered_kv.cold.landing.allocate`, so that their pages are
first touched by the reader, on the I/O thread, overlapped with the compute.

Two landings (:func:`landing`): ``full`` — the arrays hold all ``n`` tokens and the join writes the
computed head (swapped to token-major) into them in place (no copy of the tail at all: right where
CPU and GPU share memory, and on the CPU, whose ``mx.concatenate`` is slow); ``tail`` — the arrays
hold only ``[m, n)`` and the join is one ``mx.concatenate`` of the head and the swapped tail on the
GPU (right on CUDA: the reader never writes the landing from the CPU there; it stages each verified
piece in pinned memory and the GPU's copy engine moves it into the landing (:mod:`tiered_kv.cold.gpu`)
while the head computes, and the concatenation copies it within the GPU).

Threads and the one exception to "only the engine thread touches MLX": :func:`byte_views` runs on
the engine thread (the views are numpy arrays over the evaluated arrays' memory, made by
``np.frombuffer``). The I/O thread writes bytes through those views (on CUDA: has the GPU copy
into their addresses) — it never creates, reads or evaluates an MLX array — and the engine thread
queues no MLX operation on these arrays until the read has returned (``Future.result()``), after
which it drops the views. Until then the arrays hold bytes that are not verified (or not
written): they are served only after the read returned without error, and dropped otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import numpy as np

from tiered_kv.cold.landing import Layout, host_arrays


def landing() -> str:
    """The landing that suits this machine: ``full`` where arrays are host memory, ``tail`` on
    CUDA (module doc)."""
    return "full" if host_arrays() else "tail"


def shapes(layout: Layout, m: int, n: int, way: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``layout`` (token-major shapes of the first ``n`` tokens, ``(1, n, heads, ...)``) as
    landing arrays of ``way``: all ``n`` tokens (``full``) or ``[m, n)`` (``tail``)."""
    if way == "full":
        return dict(layout)
    return {k: (d, (s[0], n - m, *s[2:])) for k, (d, s) in layout.items()}


def byte_views(arrays: Mapping[str, mx.array], m: int, n: int) -> dict[str, np.ndarray]:
    """Writable contiguous uint8 views ``(1, n - m, heads, row bytes)`` of tokens ``[m, n)`` of
    each evaluated token-major array — ``(1, n, heads, ...)`` (landing ``full``) or
    ``(1, n - m, heads, ...)`` (``tail``): the destinations of ``ranged.read_range(..., into=)``.
    Engine thread; the arrays must not be used by MLX while the views are being written."""
    out = {}
    for name, a in arrays.items():
        if a.ndim < 4 or a.shape[0] != 1 or a.shape[1] not in (n, n - m):
            raise ValueError(f"landing array {name} of shape {a.shape} for [{m}, {n})")
        raw = np.frombuffer(a, dtype=np.uint8)  # type: ignore[call-overload]
        if not raw.flags.writeable or raw.nbytes != a.nbytes:
            raise ValueError(f"landing array {name} is not writable memory")
        toks = raw.reshape(1, a.shape[1], a.shape[2], -1)
        out[name] = toks[:, m:n] if a.shape[1] == n else toks
    return out
