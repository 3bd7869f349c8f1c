"""Entry files: the byte format of one cold entry (a standard safetensors file), no I/O policy.

Layout (readable by ``mx.load`` / ``safetensors``)::

    u64 LE header length N | N bytes JSON header (space padded to 8) | data section

The header maps every tensor name to ``{dtype, shape, data_offsets}``; tensors are ``tokens``
(int32 ids, first) then the ``layers.encode`` arrays, contiguous in that order; a name that the
``layers`` / ``checkpoints`` metadata does not declare makes the header corrupt
(:mod:`tiered_kv.declared`). ``__metadata__``
holds ``format_version`` (:data:`FORMAT`), ``fingerprint``, ``n_tokens``, ``layout``, ``layers``
(the encode tree), ``checkpoints`` (optional), ``created``, ``chunk_bytes``, ``token_major`` and
``xxh3``: a JSON object mapping each tensor name to the concatenated 16-hex-digit xxh3_64 digests
of its bytes as stored, cut into ``chunk_bytes`` pieces (the last one shorter; none for an empty
tensor). So a reader of any byte range of a tensor can check just the chunks it covers.
``header_xxh`` is the xxh3_64 of the canonical header (sorted keys, without ``header_xxh``).

Token-major tensors (format 3). A layer tensor with one row per token — :func:`splittable`: 4-D,
batch 1, ``T`` on axis 2, logically ``(1, heads, T, row)`` — is stored as its ``swapaxes(1, 2)``,
``(1, T, heads, row)``, and its header ``shape`` is that stored shape (what ``mx.load`` /
``safetensors`` build). Tokens ``[m, n)`` of it are then one contiguous run of bytes, which a
disk reads at its sequential speed (head-major, they were ``heads`` runs with gaps between them).
``token_major`` is the JSON list of the tensors stored so, and a reader swaps exactly those back
(``Header.token_major``, ``Header.shape``). It is an explicit list, not a rule a reader re-derives
from shapes: the rule (which shapes count as splittable) may change while files stay, a checkpoint
or window tensor can match it by accident of its length, and a tool reading the file sees what it
holds.
Covered by the header checksum; a name that is not a 4-D batch-1 tensor of ``n_tokens`` rows on
axis 1 makes the header corrupt. Every other tensor (rotating windows, recurrent state,
checkpoints of another length, ``tokens``) keeps its own C order.

Written in one pass (:func:`encode`): the header's length does not depend on the digests' values
(16 hex digits per chunk, a fixed-length ``header_xxh``), so its bytes are reserved first (zeros),
the data is made, hashed and written block by block, and the real header is written last over the
reserved bytes (:attr:`Encoded.head`), before the file is published.

Threads: :func:`encode` runs on the writer thread and reads only buffers (numpy views of
evaluated arrays; token-major tensors are transposed by numpy, block by block, and every block
hashed, on the hashing pool one block ahead of the writer); :func:`check_buffer` checks bytes already in memory (request thread,
hashing on a small pool of byte-only threads); :func:`read_header` /
:func:`read_tokens` are plain file reads usable from any thread (verify, CLI). A load reads the data
section with :func:`tiered_kv.cold.ranged.read_tensors`; ``cache verify`` with :mod:`tiered_kv.cold.scan`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiered_kv import declared
from tiered_kv.cold import fsafe
from tiered_kv.keys import FORMAT_VERSION

SUFFIX = ".safetensors"
FILE_MODE = 0o600
DIR_MODE = 0o700
FORMAT = FORMAT_VERSION
#: checksum granularity: a reader of part of a tensor checks (and so reads) whole chunks. 1 MiB:
#: a `both`'s tail of an 8B 8k entry is ~2 MiB per tensor, and with 4 MiB chunks it read up to
#: 2-4x what it served (a cold tail of 1k tokens was served at 0.85-0.95 GB/s where the whole
#: file read at 1.8; with 1 MiB chunks 1.5-1.7). Each chunk costs 16 hex digits of header (16 KB
#: per GB). Files of other chunk sizes read as they were written (their header says).
CHUNK_BYTES = 1 << 20
READ_BYTES = 64 << 20  # bytes per read() when streaming a file
_MAX_HEADER = 64 << 20
_MAX_CHUNK = READ_BYTES  # a larger claimed chunk is refused (and would not fit the read buffer)
_HEX = 16
#: bytes of one block of tokens transposed at a time on the write path (token-major tensors)
BLOCK_BYTES = 32 << 20

DTYPES: dict[str, str] = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16",
    "uint32": "U32", "int32": "I32", "uint64": "U64", "int64": "I64",
    "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
}  # fmt: skip
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8,
            "I64": 8, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # fmt: skip


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of safetensors ``dtype`` and ``shape``."""
    return math.prod(int(d) for d in shape) * ITEMSIZE[dtype]


class CorruptEntry(ValueError):
    """A short, truncated, bit-flipped or unparsable entry file."""


class ForeignEntry(CorruptEntry):
    """A well-formed file of another fingerprint or an unknown / older format version."""


@dataclass(frozen=True)
class Tensor:
    """One tensor to write: its safetensors dtype code, logical shape and bytes (any strides;
    a numpy array whose dtype has the same item size, e.g. uint16 for bfloat16)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass(frozen=True)
class Encoded:
    """An entry's bytes as pieces to write in order; ``nbytes`` in all.

    ``pieces`` is consumed once, in order, and a piece may be reused for a later one as soon as
    the next is asked for (token-major tensors are transposed into two alternating buffers): a
    consumer that keeps a piece copies it. ``head``, when set, is called once after the last
    piece was consumed and returns the entry's real first bytes, which replace the reserved
    bytes (zeros) the first piece held — the header, whose checksums are known only once every
    data byte went by (:func:`encode`). ``head`` is None for bytes that are whole already."""

    pieces: Iterable[memoryview]
    nbytes: int
    head: Callable[[], bytes] | None = None

    @staticmethod
    def whole(data: bytes | bytearray | memoryview) -> Encoded:
        """Bytes that are already a complete entry (e.g. fetched from the shared tier)."""
        view = memoryview(data).cast("B")
        return Encoded([view], len(view))

    def join(self) -> bytearray:
        """All the bytes in one buffer (consumes ``pieces``; tests, and a backend that needs it)."""
        out = bytearray()
        for p in self.pieces:
            out += p
        if self.head is not None:
            first = self.head()
            out[: len(first)] = first
        return out


@dataclass(frozen=True)
class Header:
    """A parsed, self-consistent entry header (data section not yet checked)."""

    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    data_start: int
    data_len: int
    #: the tensors stored token-major (``(1, T, heads, row)`` on disk; see the module doc)
    token_major: frozenset[str] = frozenset()

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape of tensor ``name``: as stored, token-major ones swapped back."""
        s = tuple(int(x) for x in self.tensors[name]["shape"])
        return swapped(s) if name in self.token_major else s

    @property
    def n_tokens(self) -> int:
        return int(self.metadata["n_tokens"])

    @property
    def fingerprint(self) -> str:
        return self.metadata["fingerprint"]

    def digests(self, name: str) -> str:
        return self._sums().get(name, "")

    def _sums(self) -> dict[str, str]:
        try:
            sums = json.loads(self.metadata["xxh3"])
        except (KeyError, ValueError) as e:
            raise CorruptEntry(f"bad checksum table: {e!r}") from None
        if not isinstance(sums, dict):
            raise CorruptEntry("bad checksum table")
        return sums

    @property
    def chunk_bytes(self) -> int:
        return int(self.metadata["chunk_bytes"])


_POOL: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """Byte-only hashing threads (xxhash releases the GIL on large buffers)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(min(8, os.cpu_count() or 2), thread_name_prefix="tkv-xxh3")
    return _POOL


def splittable(shape: Sequence[int], n_tokens: int) -> bool:
    """A tensor that holds one row per token on axis 2 of a batch of one (stored token-major)."""
    return len(shape) == 4 and int(shape[0]) == 1 and int(shape[2]) == n_tokens and n_tokens > 0


def swapped(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with axes 1 and 2 exchanged (head-major ⇄ token-major)."""
    s = tuple(int(x) for x in shape)
    return (s[0], s[2], s[1], *s[3:])


# -- bytes of (possibly strided) arrays --------------------------------------------------------
def flat_bytes(a: Any) -> memoryview:
    """A C-contiguous buffer's bytes as a flat ``B`` view (no copy)."""
    return memoryview(a).cast("B")


def byte_blocks(a: np.ndarray) -> list[memoryview]:
    """``a``'s bytes in C order as a few contiguous byte views (no copy for the strided slices
    a KV cache holds: one block per leading index)."""
    if a.size == 0:
        return []
    if a.flags.c_contiguous:
        return [flat_bytes(a.reshape(-1))]
    k = a.ndim  # the longest contiguous tail of dimensions
    expect = a.itemsize
    while k > 0 and (a.shape[k - 1] == 1 or a.strides[k - 1] == expect):
        expect *= a.shape[k - 1]
        k -= 1
    if k == a.ndim:  # not even the last axis is contiguous: copy (not a layout we produce)
        return [flat_bytes(np.ascontiguousarray(a).reshape(-1))]
    return [flat_bytes(np.ascontiguousarray(a[idx]).reshape(-1))
            for idx in np.ndindex(*a.shape[:k])]  # fmt: skip


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
    return _HEX * -(-nbytes // chunk)


# -- encode (writer thread) --------------------------------------------------------------------
def encode(tokens: np.ndarray, tensors: Sequence[Tensor], metadata: Mapping[str, str],
           chunk: int = CHUNK_BYTES, block: int = BLOCK_BYTES) -> Encoded:  # fmt: skip
    """The entry's bytes in one pass: each tensor's bytes are made once, as the writer consumes
    them, and its chunk checksums are computed over those same bytes as they go by. The header
    (which holds the checksums) has a length that does not depend on their values (16 hex digits
    per chunk, a fixed-length ``header_xxh``), so the first piece is ``8 + len(header)`` reserved
    zero bytes and :attr:`Encoded.head` gives the real first bytes once every piece was consumed.

    Splittable tensors are stored token-major (module doc): numpy transposes ``block`` bytes of
    tokens at a time into two reused buffers, each block made and hashed on the pool while the
    writer writes the one before, so an entry never needs a second copy of itself in memory.
    Every other tensor is written from the array's own buffer, no copy, hashed on the pool in
    blocks of the same size, one ahead of the writer too. ``chunk``: the checksum granularity (tests use small ones to exercise ranged
    reads). Writer thread: numpy and bytes only."""
    assert tokens.dtype == np.dtype("<i4") and all(t.name != "tokens" for t in tensors)
    n_tokens = len(tokens)
    items = [Tensor("tokens", "I32", (n_tokens,), tokens), *tensors]
    major = [t.name != "tokens" and splittable(t.shape, n_tokens) for t in items]
    table: dict[str, Any] = {}
    off = 0
    for t, tm in zip(items, major, strict=True):
        n = nbytes(t.dtype, t.shape)
        assert n == t.data.nbytes, t.name
        shape = list(swapped(t.shape)) if tm else list(t.shape)
        table[t.name] = {"dtype": t.dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n

    def meta(sums: Sequence[str]) -> dict[str, str]:
        return {**metadata, "format_version": str(FORMAT), "n_tokens": str(n_tokens),
                "chunk_bytes": str(chunk),
                "token_major": json.dumps([t.name for t, tm in zip(items, major, strict=True)
                                           if tm], separators=(",", ":")),
                "xxh3": json.dumps({t.name: s for t, s in zip(items, sums, strict=True)},
                                   separators=(",", ":"))}  # fmt: skip

    # digests are hex: the same length whatever their values, so the header's length is known now
    blank = [
        "0" * n_digest_chars(t["data_offsets"][1] - t["data_offsets"][0], chunk)
        for t in table.values()
    ]
    size = len(header_bytes(table, meta(blank)))
    stream = _Stream(items, major, chunk, block)

    def head() -> bytes:
        raw = header_bytes(table, meta(stream.digests()))
        if len(raw) != size:
            raise RuntimeError(f"header is {len(raw)} bytes, {size} were reserved")
        return struct.pack("<Q", size) + raw

    return Encoded(stream.pieces(memoryview(bytes(8 + size))), 8 + size + off, head)


class _Stream:
    """The data pieces of one entry as one stream of blocks, each made once (token-major ones
    transposed into a shared :class:`_Ring`), hashed as it is made, and made on the pool one
    block ahead of the writer — across tensor boundaries, so the writer never waits for a
    tensor's first block."""

    def __init__(self, items: list[Tensor], major: list[bool], chunk: int, block: int) -> None:
        self._items, self._major, self._chunk, self._block = items, major, chunk, block
        self._sums: list[Digests] = []
        self._done = False

    def pieces(self, first: memoryview) -> Iterator[memoryview]:
        yield first
        yield from _one_ahead(self._blocks())

    def _blocks(self) -> Iterator[memoryview]:
        ring = _Ring()
        for t, tm in zip(self._items, self._major, strict=True):
            d = Digests(self._chunk)
            self._sums.append(d)
            if tm:
                blocks = _token_major_blocks(t.data, self._block, ring)
            else:  # views of the array itself (valid throughout), cut to blocks to overlap
                blocks = (v[i : i + self._block] for v in byte_blocks(t.data)
                          for i in range(0, len(v), self._block))  # fmt: skip
            for b in blocks:
                d.update(b)
                yield b
        self._done = True

    def digests(self) -> list[str]:
        """Every tensor's digests; only after the last piece was consumed."""
        if not self._done:
            raise RuntimeError("entry header asked for before all its bytes were written")
        return [d.hexdigests() for d in self._sums]


class _Ring:
    """``count`` reused byte buffers taken in turn: a block is valid until ``count - 1`` more
    were taken. Grown (never shrunk) to the largest block asked for; not zero-filled."""

    def __init__(self, count: int = 2) -> None:
        self._bufs: list[np.ndarray] = []
        self._count = count
        self._taken = 0

    def take(self, nbytes: int) -> np.ndarray:
        slot = self._taken % self._count
        self._taken += 1
        if slot == len(self._bufs):
            self._bufs.append(np.empty(nbytes, dtype=np.uint8))
        elif self._bufs[slot].nbytes < nbytes:
            self._bufs[slot] = np.empty(nbytes, dtype=np.uint8)
        return self._bufs[slot][:nbytes]


def _token_major_blocks(a: np.ndarray, block: int = BLOCK_BYTES,
                        ring: _Ring | None = None) -> Iterator[memoryview]:  # fmt: skip
    """The bytes of ``a.swapaxes(1, 2)`` (``a``: ``(1, heads, T, ...)``, any strides) in C order,
    ``block`` bytes of whole tokens at a time, each copied by numpy into a buffer of ``ring``
    (a block is valid until the ring's next buffer after it is taken)."""
    ring = ring or _Ring()
    v = a.swapaxes(1, 2)[0]  # (T, heads, ...): a view
    t_all = v.shape[0]
    per = a.nbytes // max(1, t_all)
    step = max(1, min(t_all, block // max(1, per)))
    for t0 in range(0, t_all, step):
        k = min(step, t_all - t0)
        buf = ring.take(k * per).view(a.dtype).reshape(k, *v.shape[1:])
        np.copyto(buf, v[t0 : t0 + k])
        yield flat_bytes(buf.reshape(-1))


def _one_ahead(blocks: Iterator[memoryview]) -> Iterator[memoryview]:
    """``blocks``, each made on the pool while the consumer writes the one before (numpy's copy,
    xxhash and ``write`` all release the GIL). Two buffers alternate: see :class:`_Ring`."""
    nxt = pool().submit(next, blocks, None)
    try:
        while (cur := nxt.result()) is not None:
            nxt = pool().submit(next, blocks, None)
            yield cur
    finally:
        if not nxt.cancel():
            nxt.exception()  # wait: never leave the generator running on the pool


def header_bytes(tensors: Mapping[str, Any], meta: Mapping[str, str]) -> bytes:
    """The JSON header with ``header_xxh`` (re)computed, space padded to 8 bytes."""
    meta = {k: v for k, v in meta.items() if k != "header_xxh"}
    meta["header_xxh"] = xxhash.xxh3_64_hexdigest(_canon({**tensors, "__metadata__": meta}))
    raw = json.dumps({**tensors, "__metadata__": meta}, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _canon(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


# -- parse / check ------------------------------------------------------------------------------
def parse_header(raw: bytes, size: int, fingerprint: str | None = None) -> Header:
    """Check the JSON header ``raw`` of a file of ``size`` bytes (checksum, offsets, size,
    version, fingerprint, every tensor declared by the layers / checkpoints metadata:
    :mod:`tiered_kv.declared`). Raises CorruptEntry / ForeignEntry."""
    try:
        header = json.loads(raw)
        meta = dict(header.pop("__metadata__"))
        claimed = meta.pop("header_xxh")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptEntry(f"unparsable header: {e!r}") from None
    if not all(isinstance(v, str) for v in meta.values()):
        raise CorruptEntry("metadata values must be strings")
    if xxhash.xxh3_64_hexdigest(_canon({**header, "__metadata__": meta})) != claimed:
        raise CorruptEntry("header checksum mismatch")
    version = meta.get("format_version")
    if version != str(FORMAT):
        raise ForeignEntry(f"format version {version!r} (this build reads {FORMAT})")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise ForeignEntry(f"fingerprint {meta.get('fingerprint')!r} is not {fingerprint!r}")
    data_len = _check_tensors(header)
    try:  # before anything is allocated for them: the tensor count is the metadata's
        stray = declared.undeclared(header, meta)
    except ValueError as e:
        raise CorruptEntry(f"bad layer metadata: {e}") from None
    if stray is not None:
        raise CorruptEntry(f"tensor {stray!r} is not declared by the layer metadata")
    n = len(raw)
    if size != 8 + n + data_len:
        raise CorruptEntry(f"file size {size} != {8 + n + data_len} (truncated or padded)")
    if header.get("tokens", {}).get("shape") != [int(meta.get("n_tokens", -1))]:
        raise CorruptEntry("tokens tensor does not match n_tokens")
    out = Header(header, meta, 8 + n, data_len, _token_major(header, meta))
    chunk = out.chunk_bytes if meta.get("chunk_bytes", "").isdigit() else 0
    if not 0 < chunk <= _MAX_CHUNK:
        raise CorruptEntry("bad chunk_bytes")
    sums = out._sums()
    for name, t in header.items():
        start, stop = t["data_offsets"]
        if len(sums.get(name, "")) != n_digest_chars(stop - start, chunk):
            raise CorruptEntry(f"tensor {name!r}: checksum table does not match its size")
    return out


def _token_major(tensors: dict[str, Any], meta: dict[str, str]) -> frozenset[str]:
    """The ``token_major`` list of a checked header: names of 4-D batch-1 tensors whose axis 1
    holds ``n_tokens`` rows. Raises CorruptEntry."""
    try:
        names = json.loads(meta["token_major"])
        n_tokens = int(meta["n_tokens"])
    except (KeyError, ValueError) as e:
        raise CorruptEntry(f"bad token_major list: {e!r}") from None
    if not isinstance(names, list) or not all(isinstance(x, str) for x in names):
        raise CorruptEntry("bad token_major list")
    for name in names:
        shape = tensors.get(name, {}).get("shape") if name != "tokens" else None
        if not (isinstance(shape, list) and splittable(swapped(shape) if len(shape) == 4 else (),
                                                         n_tokens)):  # fmt: skip
            raise CorruptEntry(f"token_major names {name!r}, not a tensor of per-token rows")
    return frozenset(names)


def _check_tensors(tensors: dict[str, Any]) -> int:
    spans = []
    for name, t in tensors.items():
        try:
            dims = [int(d) for d in t["shape"]]
            start, stop = (int(v) for v in t["data_offsets"])
            width = ITEMSIZE[t["dtype"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptEntry(f"tensor {name!r}: {e!r}") from None
        # Python's ints: a product of int64s wraps (2^22 x 2^22 x 2^20 elements passed as 0 bytes)
        if any(d < 0 for d in dims) or stop - start != math.prod(dims) * width:
            raise CorruptEntry(f"tensor {name!r}: offsets do not match shape")
        spans.append((start, stop))
    spans.sort()
    end = 0
    for start, stop in spans:
        if start != end:
            raise CorruptEntry("tensor data is not contiguous")
        end = stop
    return end


def open_entry(path: Path) -> int:
    """An fd for reading ``path``, a regular file: a symlink or a FIFO planted in the cache dir
    is a CorruptEntry (never followed, never waited on)."""
    try:
        return fsafe.open_file(path, os.O_RDONLY)
    except fsafe.UnsafePath as e:
        raise CorruptEntry(f"{path.name}: {e.strerror}") from None


def read_header_fd(fd: int, fingerprint: str | None = None) -> Header:
    size = os.fstat(fd).st_size
    raw8 = os.pread(fd, 8, 0)
    if len(raw8) != 8:
        raise CorruptEntry("short file: no header length")
    (n,) = struct.unpack("<Q", raw8)
    if n > min(_MAX_HEADER, size - 8):
        raise CorruptEntry(f"header length {n} beyond file size {size}")
    raw = os.pread(fd, n, 8)
    if len(raw) != n:
        raise CorruptEntry("short header")
    return parse_header(raw, size, fingerprint)


def read_header(path: Path, fingerprint: str | None = None) -> Header:
    """Parse and check ``path``'s header. Raises CorruptEntry / ForeignEntry; FileNotFoundError
    when the file is gone."""
    fd = open_entry(path)
    try:
        return read_header_fd(fd, fingerprint)
    finally:
        os.close(fd)


def check_buffer(name: str, data: memoryview, header: Header) -> None:
    """``data`` (one tensor's bytes) against its chunk digests. Raises CorruptEntry."""
    if chunk_digests([data] if len(data) else [], header.chunk_bytes) != header.digests(name):
        raise CorruptEntry(f"checksum mismatch in tensor {name!r}")


def data_end(header: Header) -> int:
    """The end of the last tensor's bytes (data-section relative)."""
    return max((t["data_offsets"][1] for t in header.tensors.values()), default=0)


def read_tokens(path: Path, header: Header) -> np.ndarray:
    """The entry's token ids (int32), checked against their digests."""
    start, stop = header.tensors["tokens"]["data_offsets"]
    fd = open_entry(path)
    try:
        raw = os.pread(fd, stop - start, header.data_start + start)
    finally:
        os.close(fd)
    if len(raw) != stop - start:
        raise CorruptEntry("short read of tokens")
    check_buffer("tokens", memoryview(raw), header)
    return np.frombuffer(raw, dtype="<i4").copy()


def parse_buffer(buf: memoryview, fingerprint: str | None = None) -> Header:
    """The header of a whole entry held in memory (a backend without local files)."""
    if len(buf) < 8:
        raise CorruptEntry("short entry: no header length")
    (n,) = struct.unpack("<Q", buf[:8])
    if n > min(_MAX_HEADER, len(buf) - 8):
        raise CorruptEntry(f"header length {n} beyond entry size {len(buf)}")
    return parse_header(bytes(buf[8 : 8 + n]), len(buf), fingerprint)


def tensor_bytes(buf: memoryview, header: Header, name: str) -> memoryview:
    start, stop = header.tensors[name]["data_offsets"]
    return buf[header.data_start + start : header.data_start + stop]


def prompt_of(metadata: dict[str, str], n: int) -> int | None:
    """How many of an entry's ``n`` ids were its request's prompt; None: all of them, or not
    known (files written before the key, an entry adopted from elsewhere without it). The value
    is covered by the header's checks like the rest of the metadata; one that is not a length
    inside the entry is not believed (None)."""
    raw = metadata.get("prompt_tokens")
    if raw is None or not (raw.isascii() and raw.isdigit()) or len(raw) > 10:
        return None
    value = int(raw)
    return value if 0 < value < n else None
