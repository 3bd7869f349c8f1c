"""bench/restore.py: the benchmark runs every mode on the tiny model and prints its tables."""

from __future__ import annotations

import re

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
    # fetch (lookup + plan + restore) beside the restore's own seconds: 0 for a compute
    assert "| fetch s (restore s) |" in out
    fetch = [r.split(" | ")[-2] for r in rows[:8]]
    assert all(re.fullmatch(r"\d+\.\d{3} \(\d+\.\d{3}\)", f) for f in fetch), fetch
    assert any(f.endswith("(0.000)") for f, r in zip(fetch, rows[:8], strict=True) if "| compute |" in r)
    # the setup's own prefill of the prompt, nothing cached: a compute's seconds without the mode
    setup = re.search(r"The setup's prefill of each prompt .*: 600 tokens (\d+\.\d{3}) s", out)
    assert setup is not None and float(setup.group(1)) > 0


def test_restore_bench_with_a_memory_held_prefix(tiny_model_dir, tmp_path, capsys):
    """``--held``: memory holds the first half of the hit at each restart; `both` computes from
    there (its split lies at it or past it: with no head it reads only what memory lacks) and
    the greedy token is the same whichever way."""
    argv = ["--model", str(tiny_model_dir), "--tokens", "600", "--dir", str(tmp_path),
            "--pages", "cold", "--chunk", "64", "--modes", "load,compute,both", "--held", "0.5"]  # fmt: skip
    assert restore.main(argv) == 0
    out = capsys.readouterr().out
    assert "memory holds the first 50% of each hit" in out
    rows = [line for line in out.splitlines() if line.startswith("| 600 | cold (")]
    assert len(rows) == 3 and all("DIFF" not in r for r in rows)
    (summary,) = [r for r in out.splitlines() if r.startswith("| 600 | cold |")]
    assert "auto" not in summary  # no goal is said of a mode that did not run
    (both,) = [r for r in rows if "| both |" in r]
    m = int(both.split("| both (")[1].split(")")[0])
    assert 300 <= m < 600 and "| cold |" in both


def test_rounds_rotate_so_no_mode_always_follows_the_same_other():
    modes = ["load", "compute", "both", "auto"]
    orders = [restore.rounds(modes, i) for i in range(4)]
    assert orders[0] == modes  # auto last in the first round: it knows what the forced ways measured
    assert all(sorted(o) == sorted(modes) for o in orders)
    before = {m: {o[o.index(m) - 1] for o in orders if o.index(m) > 0} for m in modes}
    assert before["auto"] == {"both", "compute", "load"}


def test_both_stops_at_its_m_and_extend_is_its_a_b(tiny_model_dir, tmp_path, capsys):
    """A forced both computes exactly its m tokens (Restorer.extend is off by default: no
    ``m→m'`` in its row); ``--modes extend`` is the A/B, a both with the extension on, its ratio
    to the better way in the summary."""
    argv = ["--model", str(tiny_model_dir), "--tokens", "600", "--dir", str(tmp_path),
            "--pages", "cold", "--chunk", "64", "--modes", "load,compute,both,extend"]  # fmt: skip
    assert restore.main(argv) == 0
    out = capsys.readouterr().out
    rows = [r for r in out.splitlines() if r.startswith("| 600 | cold (")]
    (both,) = [r for r in rows if "| both |" in r]
    (ext,) = [r for r in rows if "| extend |" in r]
    assert "| both (" in both and "→" not in both and "DIFF" not in both
    assert "| both (" in ext and "DIFF" not in ext
    (summary,) = [r for r in out.splitlines() if r.startswith("| 600 | cold |")]
    assert re.search(r"extend / min \d+\.\d\d", summary)


def test_with_the_same_costs_both_and_extend_plan_alike(tiny_model_dir, tmp_path, capsys):
    """``--same-costs``: each restart plans with the costs the setup learned, so the forced both and
    extend of every round plan the same m (without it the later run plans with what the earlier taught)."""
    argv = ["--model", str(tiny_model_dir), "--tokens", "600", "--dir", str(tmp_path), "--pages", "cold",
            "--chunk", "64", "--modes", "both,extend", "--repeats", "2", "--same-costs"]  # fmt: skip
    assert restore.main(argv) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| 600 | cold (")]
    m = {r.split(" | ")[2]: re.findall(r"\| both \((\d+)", r) for r in rows}
    assert set(m) == {"both", "extend"} and len(m["both"]) == 1 and m["both"] == m["extend"]
