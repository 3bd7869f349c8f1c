"""The cold tier's lookup: which indexed entry serves the most of a prompt (reader thread).

Candidates come from the index by block keys (:meth:`Index.candidates`); each one's ids are
compared exactly, and what it serves is :func:`tiered_kv.policy.servable` of that common prefix —
the same rule as the hot tier's — over what the index keeps of it (whether its layers can be cut
back, its checkpoint positions). A row an older version wrote lacks those until the next open for
writing fills them in (:func:`verify.backfill_serving`); until then (an index opened read-only),
its file's header says.
Index queries and header reads only; no MLX, no writes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiered_kv import declared, policy
from tiered_kv.cold import store
from tiered_kv.cold.index import Index
from tiered_kv.cold.rows import Stored
from tiered_kv.prefix import common_prefix


@dataclass(frozen=True)
class ColdHit:
    entry_id: str
    tokens: int  # exact common prefix length at token level (ids compared, not hashes)
    entry_tokens: int  # length of the stored entry
    #: prompt tokens the entry can serve (:func:`policy.servable`: an entry whose layers cannot
    #: be cut back serves its whole length or a checkpoint at or before ``tokens``)
    serves: int


@dataclass(frozen=True)
class Finder:
    """Looks prompts up in one tier's index (files under ``dir``, of ``fingerprint``)."""

    dir: Path
    fingerprint: str
    block_tokens: int

    def best(
        self, index: Index, tokens: np.ndarray, hashes: list, exclude: Collection[str] = ()
    ) -> ColdHit | None:
        """The entry serving the most of ``tokens`` (whose block keys are ``hashes``), none of
        ``exclude``; None when none serves any."""
        best: ColdHit | None = None
        for eid, depth in index.candidates(hashes, exclude):
            stored = index.stored(eid)
            if stored is None:  # removed meanwhile (by us or another process)
                continue
            n = common_prefix(stored.tokens, tokens)
            serves = self._servable(index, eid, stored, n, len(tokens))
            if serves > 0 and (best is None or serves > best.serves):
                best = ColdHit(eid, n, len(stored.tokens), serves)
            if n >= depth * self.block_tokens and serves == policy.servable_tokens(n, len(tokens)):
                # the hashes were right: nothing shallower can match further (an entry that
                # cannot be cut back to the match may leave a shallower one serving more)
                break
        return best

    def _servable(self, index: Index, eid: str, stored: Stored, n: int, prompt_len: int) -> int:
        """Prompt tokens ``stored`` serves with ``n`` in common."""
        trimmable, points = stored.trimmable, stored.checkpoints
        if trimmable is None and policy.servable_tokens(n, prompt_len) < len(stored.tokens):
            # a row an older version wrote, and the answer depends on it: the header says
            got = self._serving_of(index, eid)
            if got is None:  # gone or bad: named as before, the load finds it so (quarantined,
                return policy.servable_tokens(n, prompt_len)  # dropped) and the next is tried
            trimmable, points = got.trimmable, got.checkpoints
        return policy.servable(n, prompt_len, len(stored.tokens), bool(trimmable), points)

    def _serving_of(self, index: Index, eid: str) -> declared.Serving | None:
        """What an entry serves, from its file's header."""
        rec = index.get(eid)
        if rec is None:
            return None
        try:
            header = store.read_header(self.dir / Path(rec.file).name, self.fingerprint)
        except (OSError, store.CorruptEntry):
            return None
        return declared.serving(header.metadata)
