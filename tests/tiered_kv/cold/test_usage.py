"""tiered_kv/cold/usage.py: the disk usage scan lists a symlinked quarantine as a link and never
deletes through it (issue 12.3; the other symlink cases are in test_fsafe.py)."""

from __future__ import annotations

import os

from tests.fixtures import intact, precious
from tiered_kv.cold import usage

FP = "0123456789abcdef0123456789abcdef"


def test_usage_never_deletes_through_a_symlinked_quarantine(tmp_path):
    root, out = tmp_path / "kv", tmp_path / "elsewhere"
    victim = precious(out)
    root.mkdir()
    (root / usage.QUARANTINE).symlink_to(out, target_is_directory=True)
    items = usage.scan(root, FP, []).items
    assert [i.key for i in items] == [("path", root / usage.QUARANTINE)]  # the link, as a link
    assert not usage.remove_path(root / usage.QUARANTINE / victim.name)
    for item in items:
        usage.remove_path(item.key[1])  # type: ignore[index]
    assert intact(victim) and not os.path.lexists(root / usage.QUARANTINE)


def test_what_is_not_the_caches_is_never_counted_or_deleted(tmp_path):
    """``TIERED_KV_DIR`` set to a folder that also holds other things (``~/.cache/tiered-kv``, whose
    ``models/`` holds the weights, or a home directory): every child that was not a fingerprint
    dir or the quarantine was an evictable unit, so a write over the budget deleted the models."""
    root = tmp_path / "kv"
    models = root / "models" / "my-model"
    models.mkdir(parents=True)
    (models / "model.safetensors").write_bytes(os.urandom(20_000))
    (root / "notes.txt").write_text("mine")
    other = root / "fedcba9876543210fedcba9876543210"  # another model's entries: the cache's
    other.mkdir()
    (other / "x.safetensors").write_bytes(b"x" * 5000)
    found = usage.scan(root, FP, [])
    assert [i.key for i in found.items] == [("path", other)]
    assert found.used == usage.tree_size(other)[0]
