"""bench/join.py: the join benchmark runs every way on a small tail and prints its table."""

from __future__ import annotations

from bench import join


def test_join_bench_smoke(tmp_path, capsys):
    argv = ["--gib", "0.01", "--pages", "warm,cold", "--repeat", "1", "--dir", str(tmp_path)]
    assert join.main(argv) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 0.01 |")]
    assert len(rows) == 2 * 3  # 2 page states x 3 ways
    assert {r.split("|")[3].strip() for r in rows} == {"old", "full", "tail"}
