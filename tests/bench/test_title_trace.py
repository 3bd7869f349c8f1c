"""bench/title_trace.py: the table of main-request TTFT alone / together / title first, on the tiny
model (the numbers are not asserted: timings on a shared machine are noise)."""

from __future__ import annotations

from bench.title_trace import trace


def test_trace_prints_its_table(tiny_model_dir):
    out = trace(tiny_model_dir, scale=0.05, repeats=1, max_tokens=2)
    for row in ("| alone |", "| together |", "| title first |", "render + tokenise"):
        assert row in out
