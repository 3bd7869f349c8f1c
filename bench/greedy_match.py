"""Greedy tokens of the engine against mlx-lm's ``generate_step``, next to ``generate_step`` against
itself with other prefill steps: is a difference the engine's, or rounding of differently cut steps?

``python -m bench.greedy_match --model DIR [--context 600,3000] [--tokens 16] [--dtype float32]``
prefills a ``--context``-token prompt and decodes ``--tokens`` greedy tokens (end-of-sequence
ignored) four ways: ``generate_step`` with mlx-lm's default prefill step (the reference), the
engine (``Engine.generate``, a miss: its own prefill steps and checkpoint cuts, then the batch
loop), and ``generate_step`` with prefill steps of 1024 and 512. Each row says how many tokens
equal the reference's, where the first differs, and the largest log-probability difference from
the reference over the way's own top-:data:`TOP` tokens at each position up to that one (the
histories are the same until then). ``--dtype`` casts the model's weights after loading (a bf16
model's float32 twin: the same weights with 2^16 times finer rounding).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from bench import step_shapes
from engine.events import SamplingParams
from engine.generate import Engine
from tiered_kv import Config

TOP = 20  # the most log-probabilities a request gets (``top_logprobs``)
REFERENCE = "generate_step"
Steps = list[tuple[int, dict[int, float]]]  # per token: (token, {id: log-probability} of its top)


def _generate_step(step: int | None) -> Callable[[Engine, list[int], int], Steps]:
    def run(engine: Engine, prompt: list[int], tokens: int) -> Steps:
        cache = make_prompt_cache(engine.model)
        kw = {} if step is None else {"prefill_step_size": step}
        out = []
        for t, lp in generate_step(mx.array(prompt), engine.model, max_tokens=tokens,
                                   prompt_cache=cache, **kw):  # fmt: skip
            top: list[int] = mx.argsort(-lp)[:TOP].tolist()  # type: ignore[assignment]
            out.append((int(t), {i: float(lp[i]) for i in top}))
        return out

    return run


def _engine(engine: Engine, prompt: list[int], tokens: int) -> Steps:
    out = []
    for c in engine.generate(prompt, SamplingParams(max_tokens=tokens, logprobs=TOP)):
        if c.token is not None:
            assert c.logprob is not None
            out.append((c.token, dict(c.logprob.top)))
    return out


WAYS: dict[str, Callable[[Engine, list[int], int], Steps]] = {
    REFERENCE: _generate_step(None),
    "engine": _engine,
    "generate_step, prefill step 1024": _generate_step(1024),
    "generate_step, prefill step 512": _generate_step(512),
}


def compare(ref: Steps, got: Steps) -> dict[str, Any]:
    """Tokens equal to ``ref``'s, the first that differs (None), and the largest |log-probability
    difference| over ``got``'s top tokens at the positions up to it (ids outside the reference's
    top at that position are skipped)."""
    first = next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a[0] != b[0]), None)
    upto = len(got) if first is None else first + 1
    diffs = [abs(lp - ref[i][1][t]) for i in range(upto) for t, lp in got[i][1].items() if t in ref[i][1]]
    return {"equal": sum(a[0] == b[0] for a, b in zip(ref, got, strict=True)), "first": first,
            "max_diff": max(diffs, default=0.0)}  # fmt: skip


def measure(model_dir: Path, contexts: list[int], tokens: int, dtype: str | None) -> list[dict[str, Any]]:
    engine = Engine(model_dir, Config(tiers=(), warmup="off"))
    engine.tokenizer.eos_token_ids = []  # random weights: decode the whole length
    if dtype is not None:
        engine.model.set_dtype(getattr(mx, dtype))
    rows = []
    try:
        for ctx in contexts:
            prompt = step_shapes.prompt(ctx, 7)
            runs = {way: run(engine, prompt, tokens) for way, run in WAYS.items()}
            first = sorted(runs[REFERENCE][0][1].values(), reverse=True)
            gap = first[0] - first[1] if len(first) > 1 else float("inf")
            for way, got in runs.items():
                rows.append({"context": ctx, "way": way, "gap": gap, **compare(runs[REFERENCE], got)})
    finally:
        engine.close()
    return rows


def table(rows: list[dict[str, Any]], tokens: int) -> str:
    out = [
        f"device {mx.default_device()}, {tokens} greedy tokens, against {REFERENCE} (mlx-lm's prefill step)",
        "",
        "| context | way | equal tokens | first different | max abs log-prob diff | reference's first top-2 gap |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        first = "-" if r["first"] is None else r["first"]
        out.append(f"| {r['context']} | {r['way']} | {r['equal']}/{tokens} | {first} | {r['max_diff']:.2e} "
                   f"| {r['gap']:.4f} |")  # fmt: skip
    return "\n".join(out)


def main(argv: Any = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--context", default="600,3000", help="comma-separated prompt lengths")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="cast the model's weights to this dtype after loading")  # fmt: skip
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.context.split(",")]
    print(table(measure(a.model, contexts, a.tokens, a.dtype), a.tokens))


if __name__ == "__main__":
    main()
