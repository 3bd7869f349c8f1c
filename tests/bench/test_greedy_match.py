"""bench/greedy_match.py: the comparison (pure) and a run on the tiny model, where the engine's
greedy tokens equal generate_step's (float32 on the CPU)."""

from __future__ import annotations

from bench import greedy_match


def test_compare_counts_equal_tokens_and_stops_the_diff_at_the_first_difference():
    ref = [(5, {5: -0.1, 6: -2.0}), (7, {7: -0.2, 8: -1.0}), (9, {9: -0.3})]
    same = [(5, {5: -0.1, 6: -2.5}), (7, {7: -0.2, 4: -3.0}), (9, {9: -0.3})]
    assert greedy_match.compare(ref, same) == {"equal": 3, "first": None, "max_diff": 0.5}
    parted = [(5, {5: -0.1}), (8, {8: -0.25, 7: -0.3}), (9, {9: -9.0})]  # the third lies past it
    got = greedy_match.compare(ref, parted)
    assert got["equal"] == 2 and got["first"] == 1
    assert abs(got["max_diff"] - 0.75) < 1e-9  # id 8: -0.25 against -1.0; id 9 at 2 not counted


def test_every_way_equals_generate_step_on_the_tiny_model(tiny_model_dir, capsys):
    greedy_match.main(["--model", str(tiny_model_dir), "--context", "40,70", "--tokens", "6",
                       "--dtype", "float32"])  # fmt: skip
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 40 |")
            or line.startswith("| 70 |")]  # fmt: skip
    assert len(rows) == 2 * len(greedy_match.WAYS)
    for row in rows:
        cells = [c.strip() for c in row.split("|")]
        assert cells[3] == "6/6" and cells[4] == "-", row
        assert float(cells[5]) < 1e-3, row
