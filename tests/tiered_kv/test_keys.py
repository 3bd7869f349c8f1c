"""tiered_kv/keys.py: pure prefix keys."""

from __future__ import annotations

import numpy as np

from tiered_kv import keys


def test_fingerprint_is_order_independent_and_versioned():
    a = keys.fingerprint({"model": "m", "kv": "bf16"})
    assert a == keys.fingerprint({"kv": "bf16", "model": "m"})
    assert len(a) == 32 and int(a, 16) >= 0
    assert a != keys.fingerprint({"model": "m", "kv": "q4"})
    assert a != keys.fingerprint({"model": "m", "kv": "bf16", "format_version": "0"})


def test_tier_fingerprint_mixes_salt_and_quantisation_only_when_set():
    assert keys.tier_fingerprint("fp") == "fp"
    salted = keys.tier_fingerprint("fp", salt="tenant-a")
    assert salted not in ("fp", keys.tier_fingerprint("fp", salt="tenant-b"))
    assert keys.tier_fingerprint("fp", kv_bits=4) != keys.tier_fingerprint("fp", kv_bits=8)


def test_only_full_blocks_are_hashed():
    assert keys.block_hashes(list(range(15)), 16, "s") == []
    assert len(keys.block_hashes(list(range(16)), 16, "s")) == 1
    assert len(keys.block_hashes(list(range(47)), 16, "s")) == 2


def test_keys_chain_on_the_parent_and_the_seed():
    a = list(range(32))
    b = [99] * 16 + list(range(16, 32))  # same second block, different first block
    ha, hb = keys.block_hashes(a, 16, "s"), keys.block_hashes(b, 16, "s")
    assert ha[0] != hb[0] and ha[1] != hb[1]
    assert keys.block_hashes(a + [7] * 16, 16, "s")[:2] == ha  # prefix-stable
    assert keys.block_hashes(a, 16, "other")[0] != ha[0]
    assert keys.block_hashes(np.array(a, dtype=np.int64), 16, "s") == ha
