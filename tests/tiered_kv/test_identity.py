"""tiered_kv/identity.py: a model directory's identity is its content (config bytes, weight files'
names / sizes / mtimes, tokenizer and template by hash), not its path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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
