"""tiered_kv/cold/lookup.py: a lookup names the entry that serves the most of the prompt, by the
hot tier's rule (policy.servable), and skips the entries the caller could not load."""

from __future__ import annotations

import json
import sqlite3

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache

from tests.fixtures import TIER_FP, cold_tier, kv_cache
from tiered_kv import checkpoints
from tiered_kv.cold import store


def _windowed(n: int) -> list:
    """A gemma-3-style cache of ``n`` tokens: attention beside a sliding window of 8 (past it at
    ``n`` > 8: it cannot be cut back)."""
    window = RotatingKVCache(max_size=8)
    if n:
        x = mx.random.normal((1, 2, n, 8))
        window.update_and_fetch(x, x)
    return [kv_cache(n), window]


@pytest.mark.parametrize("how", ["written", "index-rebuilt", "older-row", "older-file"])
def test_a_lookup_says_what_an_entry_that_cannot_be_cut_back_serves(tmp_path, how):
    """A disk hit reported its common prefix with the prompt. An entry whose layers cannot be cut
    back (a sliding window past its window, recurrent state) serves only its whole length or a
    checkpoint at or before that prefix: the tiers preferred it to a hot hit serving more, and
    priced its restore for tokens it could not serve. The index keeps what it serves (rebuilt
    from the files; a row an older version wrote, without it, is answered from the header)."""
    tier = cold_tier(tmp_path)
    ckpts = {p: checkpoints.snapshot(_windowed(p)) for p in (8, 12)}
    tier.persist(np.arange(16), _windowed(16), ckpts)
    tier.persist(np.arange(16) + 100, [kv_cache(16)])  # plain attention: any prefix
    path = next(p for p in tier.dir.glob("*.safetensors") if store.read_tokens(
        p, store.read_header(p))[0] == 0)  # fmt: skip
    tier.close()
    db = tmp_path / TIER_FP / "index" / "cache.db"
    if how == "index-rebuilt":
        db.unlink()
    if how == "older-file":  # written before the file said whether it can be cut back
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        head = json.loads(raw[8 : 8 + n])
        meta = head.pop("__metadata__")
        del meta["trimmable"]
        new = store.header_bytes(head, meta)
        path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])
    if how in ("older-row", "older-file"):  # a row an older version wrote
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE entries SET trimmable=NULL, checkpoints=NULL")
        conn.close()
    tier = cold_tier(tmp_path)

    def served(prompt: list[int]) -> tuple[int, int] | None:
        hit = tier.lookup(prompt)
        return None if hit is None else (hit.tokens, hit.serves)

    assert served(list(range(14)) + [99] * 4) == (14, 12)  # the checkpoint at or before 14
    assert served(list(range(6)) + [99] * 4) is None  # before its first checkpoint: nothing
    assert served(list(range(16)) + [99]) == (16, 16)  # its whole length
    assert served(list(range(16))) == (16, 12)  # the last prompt token is recomputed
    assert served(list(range(100, 110)) + [99] * 4) == (10, 10)
    tier.close()


def test_a_lookup_skips_the_entries_it_is_told_to(tmp_path):
    """Two entries share the prompt's first blocks; the longer, newer one holds them in the index
    (the newest holder is the one a block names). Excluded, the lookup names the other one."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(12), [kv_cache(12)])
    tier.persist(np.concatenate([np.arange(8), np.arange(8) + 50]), [kv_cache(16)])
    prompt = list(range(8)) + list(range(50, 58)) + [1]
    first = tier.lookup(prompt)
    assert first is not None and first.serves == 16
    second = tier.lookup(prompt, exclude={first.entry_id})
    assert second is not None and second.entry_id != first.entry_id and second.serves == 8
    assert tier.lookup(prompt, exclude={first.entry_id, second.entry_id}) is None
    tier.close()


def test_an_entry_with_a_checkpoint_at_0_is_still_found(tmp_path):
    """The entry format takes a checkpoint at position 0 (the header check accepts it, ``persist``
    writes it) and the index recorded it, but read it back as a damaged row: every lookup that
    named the entry failed whole — a miss counted as an index error."""
    tier = cold_tier(tmp_path)
    ckpts = {p: checkpoints.snapshot(_windowed(p)) for p in (0, 8)}
    tier.persist(np.arange(16), _windowed(16), ckpts)
    hit = tier.lookup(list(range(14)) + [99] * 4)
    assert hit is not None and (hit.tokens, hit.serves) == (14, 8)
    assert tier.lookup(list(range(6)) + [99] * 4) is None  # a checkpoint at 0 serves nothing
    assert tier.stats()["index_errors"] == 0
    tier.close()
