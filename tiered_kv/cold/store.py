"""Entry files: one safetensors file per cold entry, written from evaluated arrays' bytes.

Layout (standard safetensors, readable by ``mx.load`` / ``safetensors``)::

    u64 LE header length N | N bytes JSON header (space padded to 8) | data section

The header maps every tensor name to ``{dtype, shape, data_offsets}``; tensors are the
``layers.encode`` arrays plus ``tokens`` (int32 ids). ``__metadata__`` holds ``format_version``,
``fingerprint``, ``n_tokens``, ``layout``, ``layers`` (the encode tree), ``created``, ``data_xxh``
(xxh3_64 of the data section) and ``header_xxh`` (xxh3_64 of the canonical header without itself).

Threads: :func:`write_entry` runs on the writer thread and only reads buffers (``memoryview``);
:func:`load_entry` runs on the request thread (it calls ``mx.load``). Neither keeps state.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash

from tiered_kv.keys import FORMAT_VERSION

SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
FILE_MODE = 0o600
DIR_MODE = 0o700
_CHUNK = 8 << 20
_MAX_HEADER = 64 << 20

DTYPES: dict[str, str] = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16",
    "uint32": "U32", "int32": "I32", "uint64": "U64", "int64": "I64",
    "float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64",
}  # fmt: skip
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8,
             "I64": 8, "F16": 2, "BF16": 2, "F32": 4, "F64": 8}  # fmt: skip


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

    @property
    def n_tokens(self) -> int:
        return int(self.metadata["n_tokens"])

    @property
    def fingerprint(self) -> str:
        return self.metadata["fingerprint"]


def _canon(header: Mapping[str, Any]) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _buffer(x: Any) -> memoryview:
    """A C-contiguous byte view (copies only strided slices). Never builds an MLX graph."""
    m = memoryview(x)
    return m if m.c_contiguous else memoryview(m.tobytes())


def write_entry(
    path: Path, tokens: np.ndarray, arrays: Mapping[str, Any], metadata: Mapping[str, str]
) -> int:
    """Atomically publish ``path``: temp file in the same dir → fsync → ``os.replace`` → dir fsync.

    ``arrays`` are *evaluated* mx arrays (or numpy); ``tokens`` int32. Returns the file size.
    OSError (ENOSPC, EROFS, ENOENT) propagates after the temp file is removed.
    """
    assert "tokens" not in arrays and tokens.dtype == np.dtype("<i4")
    items: list[tuple[str, Any]] = [("tokens", tokens), *arrays.items()]
    tensors: dict[str, Any] = {}
    off = 0
    for name, x in items:
        dtype = DTYPES[str(x.dtype).removeprefix("mlx.core.")]
        n = int(x.nbytes)
        tensors[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [off, off + n]}
        off += n
    meta = {**metadata, "format_version": str(FORMAT_VERSION), "n_tokens": str(len(tokens))}
    meta["data_xxh"] = "0" * 16  # fixed width: the header length is known before the data
    header_len = len(_header_bytes(tensors, meta))
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            f.seek(8 + header_len)
            h = xxhash.xxh3_64()
            for _, x in items:
                buf = _buffer(x)
                h.update(buf)
                f.write(buf)
            meta["data_xxh"] = h.hexdigest()
            head = _header_bytes(tensors, meta)
            assert len(head) == header_len
            f.seek(0)
            f.write(struct.pack("<Q", header_len) + head)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return 8 + header_len + off


def write_bytes(path: Path, data: bytes | bytearray | memoryview) -> None:
    """[shared tier] Publish a whole entry's bytes at ``path`` like :func:`write_entry` does."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            view = memoryview(data)
            while view:
                view = view[f.write(view) :]
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _header_bytes(tensors: dict[str, Any], meta: dict[str, str]) -> bytes:
    meta = dict(meta)
    meta.pop("header_xxh", None)
    meta["header_xxh"] = xxhash.xxh3_64_hexdigest(_canon({**tensors, "__metadata__": meta}))
    raw = json.dumps({**tensors, "__metadata__": meta}, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(path: Path, fingerprint: str | None = None) -> Header:
    """Parse and check the header (checksum, offsets, file size, version, fingerprint).

    Raises CorruptEntry / ForeignEntry; FileNotFoundError when the file is gone.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw8 = f.read(8)
        if len(raw8) != 8:
            raise CorruptEntry("short file: no header length")
        (n,) = struct.unpack("<Q", raw8)
        if n > min(_MAX_HEADER, size - 8):
            raise CorruptEntry(f"header length {n} beyond file size {size}")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        meta = dict(header.pop("__metadata__"))
        claimed = meta.pop("header_xxh")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptEntry(f"unparsable header: {e!r}") from None
    if xxhash.xxh3_64_hexdigest(_canon({**header, "__metadata__": meta})) != claimed:
        raise CorruptEntry("header checksum mismatch")
    version = meta.get("format_version")
    if version != str(FORMAT_VERSION):
        raise ForeignEntry(f"format version {version!r} (this build reads {FORMAT_VERSION})")
    if fingerprint is not None and meta.get("fingerprint") != fingerprint:
        raise ForeignEntry(f"fingerprint {meta.get('fingerprint')!r} is not {fingerprint!r}")
    data_len = _check_tensors(header)
    if size != 8 + n + data_len:
        raise CorruptEntry(f"file size {size} != {8 + n + data_len} (truncated or padded)")
    if header.get("tokens", {}).get("shape") != [int(meta.get("n_tokens", -1))]:
        raise CorruptEntry("tokens tensor does not match n_tokens")
    return Header(header, meta, 8 + n, data_len)


def _check_tensors(tensors: dict[str, Any]) -> int:
    spans = []
    for name, t in tensors.items():
        try:
            count = int(np.prod(t["shape"], dtype=np.int64))
            start, stop = (int(v) for v in t["data_offsets"])
            width = _ITEMSIZE[t["dtype"]]
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptEntry(f"tensor {name!r}: {e!r}") from None
        if stop - start != count * width:
            raise CorruptEntry(f"tensor {name!r}: offsets do not match shape")
        spans.append((start, stop))
    spans.sort()
    end = 0
    for start, stop in spans:
        if start != end:
            raise CorruptEntry("tensor data is not contiguous")
        end = stop
    return end


def check_data(path: Path, header: Header) -> None:
    """Stream the data section through xxh3_64 and compare with ``data_xxh``."""
    h = xxhash.xxh3_64()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(header.data_start)
        left = header.data_len
        while left:
            got = f.readinto(view[: min(left, _CHUNK)])
            if not got:
                raise CorruptEntry("short read in data section")
            h.update(view[:got])
            left -= got
    if h.hexdigest() != header.metadata.get("data_xxh"):
        raise CorruptEntry("data checksum mismatch")


def read_tokens(path: Path, header: Header) -> np.ndarray:
    """The entry's token ids (int32) via one positioned read."""
    start, stop = header.tensors["tokens"]["data_offsets"]
    with open(path, "rb", buffering=0) as f:
        raw = os.pread(f.fileno(), stop - start, header.data_start + start)
    if len(raw) != stop - start:
        raise CorruptEntry("short read of tokens")
    return np.frombuffer(raw, dtype="<i4").copy()


def load_entry(path: Path, fingerprint: str) -> tuple[dict[str, mx.array], Header, np.ndarray]:
    """Verify (header + data checksum) and load: (encoded arrays, header, token ids).

    Request thread only (builds MLX arrays). Raises CorruptEntry / ForeignEntry / OSError.
    """
    header = read_header(path, fingerprint)
    check_data(path, header)
    try:
        loaded = mx.load(str(path), return_metadata=True)
        assert isinstance(loaded, tuple)
        arrays: dict[str, mx.array] = loaded[0]
        mx.eval(list(arrays.values()))
    except (RuntimeError, ValueError) as e:  # changed between the check and the load
        raise CorruptEntry(f"mx.load failed: {e}") from None
    tokens = np.array(arrays.pop("tokens"), dtype="<i4")
    return arrays, header, tokens
