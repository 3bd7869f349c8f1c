"""bench/dd.py: the one page-cache drop and dd yardstick of the reload benchmarks (micro, sizes,
shared_reload, cold_lookup): "cold" means the file's pages are gone, "warm" that they are all resident."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from bench import dd

pytestmark = pytest.mark.skipif(
    shutil.which("fincore") is None or not hasattr(os, "posix_fadvise"),
    reason="needs util-linux fincore and posix_fadvise (Linux)",
)


def _resident(path: Path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         check=True, capture_output=True, text=True)  # fmt: skip
    return int(out.stdout.strip())


def _files(tmp_path: Path) -> list[Path]:
    paths = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for i, p in enumerate(paths):
        p.write_bytes(os.urandom(1 << 20) * (i + 1))  # dirty pages: the drop must sync first
    return paths


def test_drop_page_cache_evicts_every_file_even_freshly_written(tmp_path: Path) -> None:
    paths = _files(tmp_path)
    dd.drop_page_cache(*paths)
    assert [_resident(p) for p in paths] == [0, 0]


def test_a_cold_read_starts_from_a_dropped_cache_and_leaves_the_files_read(tmp_path: Path) -> None:
    paths = _files(tmp_path)
    assert dd.read(*paths, cold=True) > 0
    assert [_resident(p) for p in paths] == [p.stat().st_size for p in paths]


def test_a_warm_read_has_every_page_resident(tmp_path: Path) -> None:
    paths = _files(tmp_path)
    dd.drop_page_cache(*paths)
    assert dd.read(*paths, cold=False) > 0
    assert [_resident(p) for p in paths] == [p.stat().st_size for p in paths]


def test_write_times_the_requested_bytes(tmp_path: Path) -> None:
    assert dd.write(tmp_path / "w.bin", 1000) > 0
    assert (tmp_path / "w.bin").stat().st_size == dd.BLOCK  # whole blocks written, time scaled


def test_a_read_into_fresh_memory_reads_the_whole_file_cold(tmp_path: Path) -> None:
    (path, _) = _files(tmp_path)
    assert dd.read_fresh(path, cold=True) > 0
    assert _resident(path) == path.stat().st_size  # every byte was read, from a dropped cache
