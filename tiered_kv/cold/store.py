"""Entry files: the byte format of one cold entry (a standard safetensors file), no I/O policy.

Layout (readable by ``mx.load`` / ``safetensors``)::

    u64 LE header length N | N bytes JSON header (space padded to 8) | data section

The header maps every tensor name to ``{dtype, shape, data_offsets}``; tensors are ``tokens``
(int32 ids, first) then the ``layers.encode`` arrays, contiguous in that order; a name that the
``layers`` / ``checkpoints`` metadata does not declare makes the header corrupt
(:mod:`tiered_kv.declared`). ``__metadata__``
holds ``format_version`` (:data:`FORMAT`), ``fingerprint``, ``n_tokens``, ``layout``, ``layers``
(the encode tree), ``checkpoints`` (optional), ``created``, ``trimmable`` (``"1"`` / ``"0"``: every
layer can be cut back; read by ``codec.serving``), ``chunk_bytes``, ``token_major`` and
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

Written in one pass by :func:`tiered_kv.cold.encode.encode` (the header last, over bytes reserved
for it); the chunk digests are :mod:`tiered_kv.cold.checksums`'s, for the writer and every reader.

Threads: :func:`check_buffer` checks bytes already in memory (request thread, hashing on the
byte-only pool of :func:`tiered_kv.cold.checksums.pool`); :func:`read_header` /
:func:`read_tokens` are plain file reads usable from any thread (verify, CLI). A load reads the data
section with :func:`tiered_kv.cold.ranged.read_tensors`; ``cache verify`` with :mod:`tiered_kv.cold.scan`.
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tiered_kv import declared
from tiered_kv.cold import fsafe
from tiered_kv.cold.checksums import chunk_digests, n_digest_chars
from tiered_kv.keys import FORMAT_VERSION

SUFFIX = ".safetensors"
FILE_MODE = 0o600
DIR_MODE = 0o700
FORMAT = FORMAT_VERSION
READ_BYTES = 64 << 20  # bytes per read() when streaming a file
_MAX_HEADER = 64 << 20
_MAX_CHUNK = READ_BYTES  # a larger claimed chunk is refused (and would not fit the read buffer)

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
class Header:
    """A parsed, self-consistent entry header (data section not yet checked)."""

    tensors: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    data_start: int
    data_len: int
    #: the tensors stored token-major (``(1, T, heads, row)`` on disk; see the module doc)
    token_major: frozenset[str] = frozenset()
    #: the JSON header's bytes as read (:func:`same_file`: a later read of the file compares them)
    raw: bytes = field(default=b"", repr=False, compare=False)

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
        return self._table.get(name, "")

    @functools.cached_property
    def _table(self) -> dict[str, str]:
        """The checksum table, parsed once per header (by :func:`parse_header`, which checks it):
        a read asks it for every tensor, and an 8B entry of 128k tokens carries ~260 kB of it
        (16 hex digits per MiB of KV)."""
        try:
            sums = json.loads(self.metadata["xxh3"])
        except (KeyError, ValueError, RecursionError) as e:  # nested past Python's stack
            raise CorruptEntry(f"bad checksum table: {e!r}") from None
        if not isinstance(sums, dict):
            raise CorruptEntry("bad checksum table")
        return sums

    @property
    def chunk_bytes(self) -> int:
        return int(self.metadata["chunk_bytes"])


def splittable(shape: Sequence[int], n_tokens: int) -> bool:
    """A tensor that holds one row per token on axis 2 of a batch of one (stored token-major)."""
    return len(shape) == 4 and int(shape[0]) == 1 and int(shape[2]) == n_tokens and n_tokens > 0


def swapped(shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with axes 1 and 2 exchanged (head-major ⇄ token-major)."""
    s = tuple(int(x) for x in shape)
    return (s[0], s[2], s[1], *s[3:])


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
    try:  # RecursionError: JSON nested past Python's stack (no checksum is needed for that)
        header = json.loads(raw)
        meta = dict(header.pop("__metadata__"))
        claimed = meta.pop("header_xxh")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
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
    n_tokens = _count(meta.get("n_tokens", ""))
    if n_tokens is None or header.get("tokens", {}).get("shape") != [n_tokens]:
        raise CorruptEntry("tokens tensor does not match n_tokens")
    out = Header(header, meta, 8 + n, data_len, _token_major(header, meta), bytes(raw))
    chunk = _count(meta.get("chunk_bytes", "")) or 0
    if not 0 < chunk <= _MAX_CHUNK:
        raise CorruptEntry("bad chunk_bytes")
    sums = out._table
    for name, t in header.items():
        start, stop = t["data_offsets"]
        if len(sums.get(name, "")) != n_digest_chars(stop - start, chunk):
            raise CorruptEntry(f"tensor {name!r}: checksum table does not match its size")
    return out


def _count(text: str) -> int | None:
    """A count the metadata gives (a string): ASCII digits, at most 18 of them, else None. int()
    takes other digits ("²" raises, "١٢" is 12) and refuses past 4300 digits with a bare ValueError."""
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 18 else None


def _token_major(tensors: dict[str, Any], meta: dict[str, str]) -> frozenset[str]:
    """The ``token_major`` list of a checked header: names of 4-D batch-1 tensors whose axis 1
    holds ``n_tokens`` rows. Raises CorruptEntry."""
    try:
        names = json.loads(meta["token_major"])
        n_tokens = int(meta["n_tokens"])
    except (KeyError, ValueError, RecursionError) as e:  # nested past Python's stack
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
            dims, (start, stop) = list(t["shape"]), t["data_offsets"]
            width = ITEMSIZE[t["dtype"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptEntry(f"tensor {name!r}: {e!r}") from None
        # JSON integers only: readers slice and shape with them as they are (1.0, 1e400: no size)
        if not all(type(v) is int for v in (*dims, start, stop)):
            raise CorruptEntry(f"tensor {name!r}: shape and offsets must be integers")
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


def same_file(fd: int, header: Header, fingerprint: str | None = None) -> Header:
    """``header``, already checked, once the file open at ``fd`` is shown to be the one it was
    read from: the same size and the same header bytes (its data is then checked against the
    header's own digests as it is read), without parsing it again. A file replaced since (an
    entry superseded and another published under a name) raises CorruptEntry; a header of
    another fingerprint, ForeignEntry."""
    if fingerprint is not None and header.metadata.get("fingerprint") != fingerprint:
        raise ForeignEntry(f"fingerprint {header.metadata.get('fingerprint')!r} is not {fingerprint!r}")
    n = len(header.raw)
    size = os.fstat(fd).st_size
    if not n or size != header.data_start + header.data_len or os.pread(fd, 8 + n, 0) != (
        struct.pack("<Q", n) + header.raw
    ):
        raise CorruptEntry("the file is not the one its header was read from (replaced since)")
    return header


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
