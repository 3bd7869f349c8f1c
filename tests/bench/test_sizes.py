"""bench/sizes.py: the size sweep runs end to end on a tiny shape (figures not asserted)."""

from __future__ import annotations

from bench import sizes


def test_sweep_rows_and_table(tmp_path):
    rows = sizes.run("test", [512], tmp_path)
    (row,) = rows
    assert row["drops"] == 0 and row["spills"] == 1 and row["bytes"] > 512 * 256
    for key in ("write_s", "load_cold_s", "load_warm_s", "mlx_load_cold_s", "dd_read_cold_s",
                "dd_write_s", "mlx_save_s"):  # fmt: skip
        assert row[key] > 0, key
    text = sizes.table(rows)
    assert "reload cold" in text and "| 512 |" in text
    assert not list(tmp_path.iterdir())  # every scratch file removed
