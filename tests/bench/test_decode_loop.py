"""bench/decode_loop.py: every way decodes the whole length on the tiny model, in alternating
rounds, and the table prints them against generate_step; the figures are not asserted."""

from __future__ import annotations

from bench import decode_loop
from engine import decoding


def test_every_way_decodes_every_round_and_prints(tiny_model_dir, capsys):
    merge = decoding.merge
    decode_loop.main(["--model", str(tiny_model_dir), "--context", "40", "--tokens", "9",
                      "--rounds", "2"])  # fmt: skip
    assert decoding.merge is merge  # the mlx-lm BatchKVCache way puts the engine's merge back
    text = capsys.readouterr().out
    for way in decode_loop.WAYS:
        row = next(line for line in text.splitlines() if line.startswith(f"| {way} |"))
        runs = row.split("|")[3].split()
        assert len(runs) == 2 and all(float(x) > 0 for x in runs)
    assert "40-token prompt, 9 tokens decoded" in text
