"""SharedLink: the shared tier as the rest of the cache sees it (issue 17).

* the request thread calls :meth:`lookup` / :meth:`fetch` (``TieredCache``, after memory and the
  local disk missed; beside a running batch the fetch runs on a thread of its own); a fetched entry
  is handed, on the request thread, to the local cold tier's ``adopt``, which decodes it and writes
  it locally, so the next restart finds it on the local disk;
* the local cold tier calls :meth:`published` for each entry it has written (writer thread): the
  entry is queued for the publisher thread, which reads its bytes back from the local store and
  publishes them (write-behind, bounded by ``TIERED_KV_SHARED_QUEUE_BYTES``).

Nothing here touches MLX; every Redis call is bounded by ``TIERED_KV_SHARED_TIMEOUT``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiered_kv.config import Config
from tiered_kv.shared.publisher import Publisher, Read
from tiered_kv.shared.redis_tier import Check, Fetched, SharedHit, SharedTier


class SharedLink:
    def __init__(self, tier: SharedTier, queue_bytes: int) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._drops = [0, 0]  # entries, bytes dropped from the publish queue
        self.publisher = Publisher(tier.publish, queue_bytes, self._dropped)

    @classmethod
    def open(cls, config: Config, fingerprint: str, check: Check | None = None) -> SharedLink:
        """``fingerprint``: the local cold tier's (salt and stored-KV format mixed in)."""
        from tiered_kv.shared import entry

        # an entry larger than the local disk budget could not be adopted: never fetched
        tier = SharedTier(config.shared_url, fingerprint, config.block_tokens,
                          check or entry.checker(fingerprint), config.shared_timeout,
                          max_bytes=config.disk_bytes,
                          describe=entry.describer(fingerprint))  # fmt: skip
        return cls(tier, config.shared_queue_bytes)

    # -- request thread --------------------------------------------------------------------
    def lookup(self, prompt_ids: Sequence[int] | np.ndarray) -> SharedHit | None:
        return self.tier.lookup(prompt_ids)

    def fetch(self, hit: SharedHit, stop: threading.Event | None = None) -> Fetched | None:
        """Any thread (bytes only): the request thread, or a fetch's own thread beside the batch."""
        return self.tier.fetch(hit, stop)

    # -- the local cold tier's writer thread -------------------------------------------------
    def published(self, read: Read, tokens: np.ndarray, nbytes: int) -> None:
        """A local entry was written: publish it too (never blocks)."""
        self.publisher.submit(read, tokens, nbytes)

    def _dropped(self, nbytes: int) -> None:
        with self._lock:
            self._drops[0] += 1
            self._drops[1] += nbytes

    # -- lifecycle -------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        return self.publisher.flush(timeout)

    def stats(self) -> dict[str, Any]:
        out = self.tier.stats()
        with self._lock:
            out["publish_drops"], out["publish_drop_bytes"] = self._drops
        out["publish_queue_bytes"] = self.publisher.pending_bytes
        return out

    def close(self, timeout: float | None = None) -> bool:
        """Publish what is queued within ``timeout`` seconds (the rest is dropped, counted)."""
        done = self.publisher.close(timeout)
        self.tier.close()
        return done
