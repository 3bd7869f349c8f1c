"""The entry format's own integrity checks over an entry held in memory (bytes from Redis).

``checker(fingerprint)`` returns the ``Check`` the shared tier runs before it returns a fetched
entry: the header is parsed and its checksum, format version and fingerprint checked exactly as
for a local file (``tiered_kv.cold.store``), then the data checksum; the entry's token ids come
from the verified bytes. Raises ``store.CorruptEntry`` / ``store.ForeignEntry`` (ValueErrors).
Bytes only: any thread.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import xxhash

from tiered_kv.cold import store
from tiered_kv.shared.redis_tier import Check


def checker(fingerprint: str) -> Check:
    def check(view: memoryview) -> np.ndarray:
        return verify(view, fingerprint)

    return check


def verify(view: memoryview, fingerprint: str) -> np.ndarray:
    """Check a whole entry's bytes; its token ids (int32)."""
    header = _header(view, fingerprint)
    data = view[header.data_start :]
    if xxhash.xxh3_64_hexdigest(data) != header.metadata.get("data_xxh"):
        raise store.CorruptEntry("data checksum mismatch")
    start, stop = header.tensors["tokens"]["data_offsets"]
    return np.frombuffer(data[start:stop], dtype="<i4").copy()


def _header(view: memoryview, fingerprint: str) -> store.Header:
    if len(view) < 8:
        raise store.CorruptEntry("short entry: no header length")
    (n,) = struct.unpack("<Q", view[:8])
    if n > len(view) - 8:
        raise store.CorruptEntry(f"header length {n} beyond entry size {len(view)}")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
        meta = dict(header.pop("__metadata__"))
        claimed = meta.pop("header_xxh")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise store.CorruptEntry(f"unparsable header: {e!r}") from None
    if xxhash.xxh3_64_hexdigest(store._canon({**header, "__metadata__": meta})) != claimed:
        raise store.CorruptEntry("header checksum mismatch")
    if meta.get("format_version") != str(store.FORMAT_VERSION):
        raise store.ForeignEntry(f"format version {meta.get('format_version')!r}")
    if meta.get("fingerprint") != fingerprint:
        raise store.ForeignEntry(f"fingerprint {meta.get('fingerprint')!r} is not {fingerprint!r}")
    data_len = store._check_tensors(header)
    if len(view) != 8 + n + data_len:
        raise store.CorruptEntry(f"entry size {len(view)} != {8 + n + data_len}")
    if header.get("tokens", {}).get("shape") != [int(meta.get("n_tokens", -1))]:
        raise store.CorruptEntry("tokens tensor does not match n_tokens")
    return store.Header(header, meta, 8 + n, data_len)
