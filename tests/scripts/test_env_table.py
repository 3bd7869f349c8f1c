"""scripts/env_table.py: the README's env-var table is the one generated from Config's field docs."""

from __future__ import annotations

import pytest

from scripts import env_table
from tiered_kv.config import env_table as variables


def test_readme_env_table_is_generated_from_the_field_docs():
    readme = env_table.README.read_text(encoding="utf-8")
    assert env_table.in_readme(readme) == env_table.table(), (
        "README.md's env-var table differs from Config's field docs: "
        "run python scripts/env_table.py --write"
    )


def test_every_variable_is_documented_once():
    names = [r.variable for r in env_table.rows()]
    assert len(names) == len(set(names))
    assert set(names) == {name for name, _, _ in variables()}


def test_defaults_are_shown_as_the_readme_writes_them():
    assert env_table.shown_default(4 * 1024**3, is_size=True) == "`4GiB`"
    assert env_table.shown_default(1000) == "`1000`"
    assert env_table.shown_default(False) == "`0`"
    assert env_table.shown_default(("hot", "cold")) == "`hot,cold`"
    assert env_table.shown_default("") == "empty"
    assert env_table.shown_default(300.0) == "`300`"


def test_a_field_doc_must_name_its_variable():
    src = 'class Config:\n    #: cold-tier directory\n    cache_dir: int = 0\n'
    with pytest.raises(ValueError, match="cache_dir"):
        env_table.rows(src)
