"""engine/models/publish.py: a model directory appears whole or not at all (tiny, smollm2, templates)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from engine.models.publish import publish


class BuildError(RuntimeError):
    pass


def _write(name: str):
    def build(tmp: Path) -> None:
        (tmp / "config.json").write_text(name)

    return build


def test_a_built_directory_replaces_the_old_one_and_is_shared(tmp_path: Path) -> None:
    out = tmp_path / "models" / "m"
    publish(out, _write("old"), BuildError)
    assert publish(out, _write("new"), BuildError) == out
    assert (out / "config.json").read_text() == "new"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert [p.name for p in out.parent.iterdir()] == ["m"]  # no temp dir left


def test_a_failed_build_leaves_the_old_directory_and_no_temp_dir(tmp_path: Path) -> None:
    out = tmp_path / "m"
    publish(out, _write("old"), BuildError)

    def broken(tmp: Path) -> None:
        (tmp / "config.json").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        publish(out, broken, BuildError)
    assert (out / "config.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_a_directory_published_meanwhile_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "m"
    publish(out, _write("first"), BuildError)
    publish(out, _write("second"), BuildError, published=lambda: True)
    assert (out / "config.json").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_an_unusable_parent_raises_the_callers_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(BuildError, match="cannot create"):
        publish(tmp_path / "file" / "m", _write("x"), BuildError)
