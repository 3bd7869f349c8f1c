"""bench/concurrency.py: the title + main pattern compares a main request alone and one sent with
its title on prompts of one length."""

from __future__ import annotations

from bench.concurrency import _session, twin
from engine.generate import Engine
from tiered_kv import Config


def test_twins_are_new_prompts_of_one_length(tiny_model_dir):
    """Alone and together, the main request has the same suffix to prefill after the cached system
    prompt (sessions of different seeds differ in length: on a CPU the ratio measured them)."""
    engine = Engine(tiny_model_dir, Config(tiers=()))
    try:
        main = _session(0, 8000, 1, 8, 0.05).turns[0]
        a, b = (engine.encode_chat(twin(main, t).body["messages"], main.body["tools"])
                for t in ("[a0]", "[b0]"))  # fmt: skip
        assert len(a) == len(b) and a != b
        assert main.body["messages"][-1]["content"] in engine.tokenizer.decode(a)  # untouched
    finally:
        engine.close()
