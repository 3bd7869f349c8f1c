"""tiered_kv/cold/writes.py: the write path counts a full disk and recovers."""

from __future__ import annotations

import errno

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

from tests.fixtures import cold_tier, kv_cache
from tiered_kv.cold import store


def test_enospc_during_spill_is_counted_not_raised(tmp_path, monkeypatch):
    tier = cold_tier(tmp_path)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.os, "replace", full)
    tier.spill(np.arange(8), [kv_cache(8)])
    tier.persist(np.arange(9), [kv_cache(9)])
    tier.flush()
    st = tier.stats()
    assert st["write_errors"] == 2 and st["entries"] == 0
    assert not list(tier.dir.glob("*.safetensors")) and not list(tier.dir.glob(".*.tmp"))
    monkeypatch.undo()
    tier.persist(np.arange(8), [kv_cache(8)])
    assert tier.stats()["entries"] == 1
    tier.close()


def test_an_entry_whose_whole_prompt_a_new_one_resent_is_superseded_on_disk(tmp_path):
    """The disk twin of the hot tier's rule: an agent's next turn resends the last prompt and a
    re-rendering of its answer, so the new entry diverges inside the old one's generated ids.
    Its file replaces the old file (one file per session, not one per restart); an entry that
    diverges inside its prompt (a branch) stays, and so does one the new entry could not be cut
    back to serve (a checkpointed, untrimmable new entry)."""
    tier = cold_tier(tmp_path)
    prompt = np.arange(100, 120)  # 20 prompt ids (5 blocks)
    answer = np.arange(500, 508)  # 8 generated ids (2 more blocks)
    tier.persist(np.concatenate([prompt, answer]), [kv_cache(28)], prompt_tokens=20)
    rerendered = np.concatenate([prompt, answer[:3], [9, 9, 9, 9, 9], np.arange(700, 710)])
    tier.persist(rerendered, [kv_cache(len(rerendered))], prompt_tokens=len(rerendered) - 2)
    st = tier.stats()
    assert st["entries"] == 1 and st["superseded"] == 1
    assert len(list(tier.dir.glob("*.safetensors"))) == 1
    hit = tier.lookup(np.concatenate([prompt, answer[:3], [1, 2]]))
    assert hit is not None and hit.tokens == 23 and hit.entry_tokens == len(rerendered)

    branch = np.concatenate([prompt[:12], np.arange(900, 916)])  # diverges inside the prompt
    tier.persist(branch, [kv_cache(len(branch))], prompt_tokens=len(branch) - 4)
    assert tier.stats()["entries"] == 2 and tier.stats()["superseded"] == 1
    tier.close()


def recurrent(n: int) -> C.ArraysCache:
    """A recurrent layer's state after ``n`` tokens: it cannot be cut back to fewer."""
    c = C.ArraysCache(size=2)
    c[0], c[1] = mx.random.normal((1, 3, 8)), mx.random.normal((1, 2, 8, 8))
    return c


def test_a_new_entry_that_cannot_be_cut_back_supersedes_only_its_exact_prefixes(tmp_path):
    tier = cold_tier(tmp_path)
    prompt = np.arange(100, 120)
    tier.persist(np.concatenate([prompt, np.arange(500, 508)]), [recurrent(28)], prompt_tokens=20)
    rerendered = np.concatenate([prompt, [9] * 12])
    tier.persist(rerendered, [recurrent(32)], prompt_tokens=30)
    st = tier.stats()
    assert st["entries"] == 2 and st["superseded"] == 0  # the old state is not at 20 in the new
    tier.persist(np.concatenate([rerendered, [7] * 4]), [recurrent(36)], prompt_tokens=34)
    assert tier.stats()["superseded"] == 0  # no checkpoint at 32: cannot serve the old length
    tier.close()


def test_an_index_rebuilt_from_the_files_knows_each_prompt(tmp_path):
    """After a restart whose index was lost (rebuilt from the files' headers), the next turn's
    file still replaces the last one's."""
    import shutil

    tier = cold_tier(tmp_path)
    prompt = np.arange(100, 120)
    tier.persist(np.concatenate([prompt, np.arange(500, 508)]), [kv_cache(28)], prompt_tokens=20)
    tier.close()
    shutil.rmtree(tier.dir / "index")
    tier = cold_tier(tmp_path)
    (rec,) = tier.site.ensure().records()
    assert rec.prompt_tokens == 20
    tier.persist(np.concatenate([prompt, [9] * 12]), [kv_cache(32)], prompt_tokens=30)
    assert tier.stats()["entries"] == 1 and len(list(tier.dir.glob("*.safetensors"))) == 1
    tier.close()
