"""The entry format's own integrity checks over an entry held in memory (bytes from Redis).

``checker(fingerprint)`` returns the ``Check`` the shared tier runs before it returns a fetched
entry: the header is parsed and checked exactly as for a local file (header checksum, format
version, fingerprint, sizes: ``store.parse_buffer``), then every tensor's chunk digests
(``store.check_buffer``, on the hashing pool); the token ids come from the verified bytes.
Raises ``store.CorruptEntry`` / ``store.ForeignEntry`` (ValueErrors). Bytes only: any thread.
"""

from __future__ import annotations

import numpy as np

from tiered_kv import declared
from tiered_kv.cold import checksums, store
from tiered_kv.shared.redis_tier import Check, Describe


def checker(fingerprint: str) -> Check:
    def check(view: memoryview) -> np.ndarray:
        return verify(view, fingerprint)

    return check


def describer(fingerprint: str) -> Describe:
    """What an entry to publish serves, from its header's metadata (``declared.serving``); None
    for bytes that are no entry of ``fingerprint``."""

    def describe(view: memoryview) -> declared.Serving | None:
        try:
            header = store.parse_buffer(view, fingerprint)
        except ValueError:  # store.CorruptEntry / ForeignEntry
            return None
        return declared.serving(header.metadata)

    return describe


def verify(view: memoryview, fingerprint: str) -> np.ndarray:
    """Check a whole entry's bytes; its token ids (int32)."""
    header = store.parse_buffer(view, fingerprint)
    futures = [checksums.pool().submit(store.check_buffer, name, store.tensor_bytes(view, header, name),
                                   header) for name in header.tensors]  # fmt: skip
    for f in futures:
        f.result()  # raises store.CorruptEntry
    return np.frombuffer(store.tensor_bytes(view, header, "tokens"), dtype="<i4").copy()
