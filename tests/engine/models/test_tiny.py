"""engine/models/tiny.py: determinism, loading with the real mlx-lm loader, template, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load

from engine.models import tiny
from tests.serving import TOOLS

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def test_same_seed_gives_byte_identical_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = tiny.build(tmp_path / "again", size="test", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_other_seed_changes_weights_not_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> None:
    other = tiny.build(tmp_path / "other", size="test", seed=1)
    read = lambda d, n: (d / n).read_bytes()  # noqa: E731
    assert read(other, "model.safetensors") != read(tiny_model_dir, "model.safetensors")
    assert read(other, "tokenizer.json") == read(tiny_model_dir, "tokenizer.json")


def test_rebuild_replaces_existing_dir(tmp_path: Path) -> None:
    out = tmp_path / "m"
    tiny.build(out, seed=0)
    (out / "stale").write_text("x")
    tiny.build(out, seed=0)
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp dirs left behind


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(tiny.TinyModelError, match="unknown size"):
        tiny.build(tmp_path / "m", size="huge")
    assert list(tmp_path.iterdir()) == []


def test_mlx_lm_load_and_finite_logits(tiny_model_dir: Path) -> None:
    model, tokenizer = load(str(tiny_model_dir))
    ids = tokenizer.encode("Hello world, the cache is warm.")
    logits = model(mx.array([ids]))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert bool(mx.isfinite(logits).all())
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_tokenizer_round_trips_text(tiny_model_dir: Path) -> None:
    _, tokenizer = load(str(tiny_model_dir))
    text = 'def f(x):\n    return {"a": 1.5, "b": [1, 2]}  # héllo ☃ 日本\n\tTabs and  spaces.'
    assert tokenizer.decode(tokenizer.encode(text)) == text
    for special in tiny.SPECIAL_TOKENS:
        assert len(tokenizer.encode(special)) == 1, special
    assert 2000 <= len(tokenizer.get_vocab()) <= 4096


def test_chat_template_renders_tools_calls_and_results(tiny_model_dir: Path) -> None:
    _, tokenizer = load(str(tiny_model_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "21 °C."},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert "<|im_start|>assistant\n" + call + "<|im_end|>" in text
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n21 °C.<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_accepts_string_arguments_and_no_tools(tiny_model_dir: Path) -> None:
    _, tokenizer = load(str(tiny_model_dir))
    call = {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "tool_calls": [call]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert '<|im_start|>assistant\nok\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}' in text


def test_bench_size_shape(tiny_bench_dir: Path) -> None:
    config = json.loads((tiny_bench_dir / "config.json").read_text())
    assert config["num_hidden_layers"] >= 8 and config["head_dim"] == 64
    assert config["num_key_value_heads"] >= 2 and config["torch_dtype"] == "float32"


def test_gemma3_size_is_a_sliding_window_model_the_engine_decodes_as_mlx_lm(tmp_path: Path) -> None:
    """``gemma3-test``: mlx-lm's gemma3_text with sliding-window layers (one global in six),
    deterministic per seed; the engine's greedy tokens over a prompt longer than the window are
    mlx-lm's own ``generate_step``'s."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    from engine.events import SamplingParams
    from engine.generate import Engine
    from tiered_kv import Config

    out = tiny.build(tmp_path / "g", size="gemma3-test", seed=0)
    again = tiny.build(tmp_path / "g2", size="gemma3-test", seed=0)
    assert (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    engine = Engine(out, Config(tiers=(), warmup="off"))
    try:
        kinds = [type(c) for c in make_prompt_cache(engine.model)]
        assert kinds.count(KVCache) == 1 and kinds.count(RotatingKVCache) == 5
        ids = engine.tokenizer.encode("the cache holds the prompt of the world " * 6)
        assert len(ids) > 16  # past the window
        got = [
            c.token
            for c in engine.generate(ids, SamplingParams(max_tokens=12))
            if c.token is not None
        ]
        cache = make_prompt_cache(engine.model)
        want = [int(t) for t, _ in generate_step(mx.array(ids), engine.model, max_tokens=12,
                                                 prompt_cache=cache)]  # fmt: skip
        assert got == want[: len(got)] and got
    finally:
        engine.close()
