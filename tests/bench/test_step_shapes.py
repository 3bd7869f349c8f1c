"""bench/step_shapes.py: each row's three forwards start where the module doc says (the context,
the context again, one token further) on the tiny model; the figures are not asserted."""

from __future__ import annotations

from bench import step_shapes


def test_rows_start_at_their_context_and_print(tiny_model_dir):
    rows = step_shapes.measure(tiny_model_dir, [0, 300], [7, 64])
    assert [(r["context"], r["tokens"]) for r in rows] == [(0, 7), (0, 64), (300, 7), (300, 64)]
    for r in rows:
        c = r["context"]
        assert r["starts"] == [c, c, c + 1]
        assert r["first"] > 0 and r["again"] > 0 and r["shifted"] > 0
    text = step_shapes.table(rows)
    assert "| 300 | 64 |" in text and "MLX_CUDA_USE_CUDNN_SDPA=" in text
