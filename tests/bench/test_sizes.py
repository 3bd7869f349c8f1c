"""bench/sizes.py: the size sweep runs end to end on a tiny shape (figures not asserted)."""

from __future__ import annotations

from bench import sizes


def test_sweep_rows_and_table(tmp_path):
    rows = sizes.run("test", [512], tmp_path)
    (row,) = rows
    assert row["drops"] == 0 and row["spills"] == 1 and row["bytes"] > 512 * 256
    for key in ("write_s", "load_cold_s", "load_warm_s", "mlx_load_cold_s", "dd_read_cold_s", "fresh_read_cold_s",
                "dd_write_s", "mlx_save_s"):  # fmt: skip
        assert row[key] > 0, key
    text = sizes.table(rows)
    assert "reload cold" in text and "| 512 |" in text and "fresh memory" in text
    assert not list(tmp_path.iterdir())  # every scratch file removed


def test_rounds_give_medians_every_entry_written_each_round(tmp_path):
    (row,) = sizes.run("test", [512], tmp_path, reps=3)
    assert row["reps"] == 3 and row["spills"] == 3 and row["drops"] == 0
    assert len(row["load_warm_s_runs"]) == len(row["write_s_runs"]) == 3
    assert row["write_s"] == sorted(row["write_s_runs"])[1]
    assert "best of 3" in sizes.table([row])
