"""Chunk checksums of entry bytes: the one xxh3 rule the writer and every reader share, and the
hashing pool they run on.

A tensor's bytes as stored, cut into ``chunk_bytes`` pieces, each piece's xxh3_64 as 16 hex
digits, concatenated: its entry in the header's ``xxh3`` table (:mod:`tiered_kv.cold.store` has
the format). :class:`Digests` computes them for the writer (:mod:`tiered_kv.cold.encode`) as its
blocks go by; :func:`chunk_digests` for a reader of whole chunks (:mod:`tiered_kv.cold.ranged`,
:mod:`tiered_kv.cold.scan`, :func:`tiered_kv.cold.store.check_buffer`).

Threads: bytes only, any thread; :func:`pool` is the process's small pool of byte-only hashing
threads (xxhash, numpy copies and ``write`` release the GIL), never an ``mx`` call.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

#: checksum granularity: a reader of part of a tensor checks (and so reads) whole chunks. 1 MiB:
#: a `both`'s tail of an 8B 8k entry is ~2 MiB per tensor, and with 4 MiB chunks it read up to
#: 2-4x what it served (a cold tail of 1k tokens was served at 0.85-0.95 GB/s where the whole
#: file read at 1.8; with 1 MiB chunks 1.5-1.7). Each chunk costs 16 hex digits of header (16 KB
#: per GB). Files of other chunk sizes read as they were written (their header says).
CHUNK_BYTES = 1 << 20
#: hex digits of one chunk's digest
HEX = 16

_POOL: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """Byte-only hashing threads (xxhash releases the GIL on large buffers)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(min(8, os.cpu_count() or 2), thread_name_prefix="tkv-xxh3")
    return _POOL


class Digests:
    """Concatenated xxh3_64 hex digests of a byte stream cut into ``chunk`` pieces, fed block by
    block (:meth:`update`; a block is read only during the call), finished by :meth:`hexdigests`."""

    def __init__(self, chunk: int = CHUNK_BYTES) -> None:
        self._chunk = chunk
        self._out: list[str] = []
        self._h: Any = None
        self._left = chunk

    def update(self, b: memoryview) -> None:
        chunk = self._chunk
        pos, n = 0, len(b)
        while pos < n:
            if self._h is None and n - pos >= chunk:  # a whole chunk inside this block: one call
                self._out.append(xxhash.xxh3_64_hexdigest(b[pos : pos + chunk]))
                pos += chunk
                continue
            take = min(self._left, n - pos)
            self._h = self._h or xxhash.xxh3_64()
            self._h.update(b[pos : pos + take])
            pos += take
            self._left -= take
            if self._left == 0:
                self._out.append(self._h.hexdigest())
                self._h, self._left = None, chunk

    def hexdigests(self) -> str:
        if self._h is not None:
            self._out.append(self._h.hexdigest())
            self._h, self._left = None, self._chunk
        return "".join(self._out)


def chunk_digests(blocks: Iterable[memoryview], chunk: int = CHUNK_BYTES) -> str:
    """Concatenated xxh3_64 hex digests of the byte stream ``blocks`` cut into ``chunk`` pieces
    (``blocks`` read once, in order, each only until the next is asked for)."""
    d = Digests(chunk)
    for b in blocks:
        d.update(b)
    return d.hexdigests()


def n_digest_chars(nbytes: int, chunk: int) -> int:
    """The length of a tensor's digest string: 16 hex digits per (possibly short) chunk."""
    return HEX * -(-nbytes // chunk)
