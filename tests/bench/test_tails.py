"""bench/tails.py: the tail sweep runs end to end on a tiny shape (figures not asserted)."""

from __future__ import annotations

from bench import tails


def test_tail_rows_and_table(tmp_path):
    rows = tails.run("test", 2048, [0.001, 0.004], [1, 2], [0.25, 0.5], reps=2, root=tmp_path)
    cells = [r for r in rows if not r.get("dd")]
    assert len(cells) == 2 * 2 * 2 and all(len(r["runs"]) == 2 and r["gb_s"] > 0 for r in cells)
    assert rows[-1].get("dd") and rows[-1]["gb_s"] > 0
    text = tails.table(rows, 2048)
    assert "| 0.25 (512) | 0.001 MiB | 1 |" in text and "`dd`" in text
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # every file removed
