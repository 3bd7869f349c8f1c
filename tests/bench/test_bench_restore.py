"""bench/restore.py: the benchmark runs every mode on the tiny model and prints its tables."""

from __future__ import annotations

from bench import restore


def test_restore_bench_smoke(tiny_model_dir, tmp_path, capsys):
    argv = ["--model", str(tiny_model_dir), "--tokens", "600", "--dir", str(tmp_path),
            "--pages", "cold,warm", "--chunk", "64"]  # fmt: skip
    assert restore.main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 600 |")]
    assert len(rows) == 8 + 2  # 2 page states x 4 modes, then the summary
    assert all("DIFF" not in r for r in rows)  # greedy token equal whichever way
    assert any("| both (" in r and "| cold |" in r for r in rows)
    assert any("| compute (600) | none |" in r for r in rows)
