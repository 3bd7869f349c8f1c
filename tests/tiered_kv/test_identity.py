"""tiered_kv/identity.py: a model directory's identity is its content (config bytes, weight files'
names / sizes / a sample of every tensor, tokenizer and template by hash), not its path or time."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from tiered_kv.identity import model_identity


def model_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}))
    (path / "model.safetensors").write_bytes(b"w" * 100)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_a_copy_with_the_same_files_is_the_same_model(tmp_path):
    a = model_dir(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b, copy_function=shutil.copy2)  # copy2 keeps mtimes
    assert model_identity(a) == model_identity(b)
    assert model_identity(str(a))["dtype"] == "bfloat16"


def test_weights_tokenizer_and_template_each_change_it(tmp_path):
    a = model_dir(tmp_path / "a")
    before = model_identity(a)
    (a / "model.safetensors").write_bytes(b"w" * 101)
    after_weights = model_identity(a)
    assert after_weights["model"] != before["model"]
    (a / "chat_template.jinja").write_text("{{ messages }}")
    after_template = model_identity(a)
    assert after_template["tokenizer"] != after_weights["tokenizer"]
    assert after_template["model"] == after_weights["model"]


def _weights(path: Path, values: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(values, str(path))


def test_two_fine_tunes_of_one_size_and_time_are_two_models(tmp_path):
    """Same tensor shapes, same mtime (reproducible images, ``cp -p``, a Nix store): one fingerprint
    by name, size and mtime, so one model was served the other's KV. Only one tensor differs."""
    base = {f"layers.{i}.w": np.full((64, 64), i, np.float16) for i in range(4)}
    tuned = {**base, "layers.2.w": base["layers.2.w"] + 1}
    a, b = model_dir(tmp_path / "a"), model_dir(tmp_path / "b")
    _weights(a / "model.safetensors", base)
    _weights(b / "model.safetensors", tuned)
    for d in (a, b):
        os.utime(d / "model.safetensors", ns=(10**18, 10**18))
    assert (a / "model.safetensors").stat().st_size == (b / "model.safetensors").stat().st_size
    assert model_identity(a)["model"] != model_identity(b)["model"]


def test_a_plain_copy_of_the_weights_keeps_the_identity(tmp_path):
    """A copy with new mtimes (``cp`` without ``-p``, a fresh download of one revision) is the same
    model: its cache stays (it had another fingerprint, every entry a miss)."""
    a = model_dir(tmp_path / "a")
    _weights(a / "model.safetensors", {"w": np.arange(4096, dtype=np.float32)})
    b = tmp_path / "b"
    shutil.copytree(a, b, copy_function=shutil.copy)
    os.utime(b / "model.safetensors", ns=(10**18, 10**18))
    assert model_identity(a) == model_identity(b)


def test_an_edit_of_a_tensors_first_or_last_rows_is_another_model(tmp_path):
    """Only a sample of each tensor is read: one from its middle missed an edit of its first rows
    (a hit on the old model's KV gave other tokens). Samples run from its first bytes to its last."""
    base = {"embed": np.arange(512 * 64, dtype=np.float32).reshape(512, 64)}
    a = model_dir(tmp_path / "a")
    _weights(a / "model.safetensors", base)
    seen = {model_identity(a)["model"]}
    for rows in (slice(0, 4), slice(508, 512), slice(200, 240)):
        edited = base["embed"].copy()
        edited[rows] += 1
        d = model_dir(tmp_path / f"e{rows.start}")
        _weights(d / "model.safetensors", {"embed": edited})
        seen.add(model_identity(d)["model"])
    assert len(seen) == 4
