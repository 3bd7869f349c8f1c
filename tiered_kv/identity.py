"""model_identity: what names an mlx-lm model directory for the cache fingerprint (files only, no MLX).

Owner of the model half of the fingerprint; :func:`tiered_kv.opening.open_cache` adds the cache half
(stored-KV quantisation, layer layout, salt). Reads the directory's small files and weight-file stats;
never loads weights, never writes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "-"


def model_identity(model_dir: str | Path) -> dict[str, str]:
    """``{"model", "tokenizer", "dtype"}`` of an mlx-lm model directory.

    Model identity is cheap: config.json's bytes plus each weight file's name, size and mtime
    (content-based, not path-based: a hub snapshot and its source directory agree). Tokenizer and
    chat template by content hash.
    """
    model_dir = Path(model_dir)
    weights = sorted(model_dir.glob("*.safetensors"))
    ident = hashlib.sha256((model_dir / "config.json").read_bytes())
    for w in weights:
        st = w.stat()
        ident.update(f"{w.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    tok = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        tok.update(_file_digest(model_dir / name).encode())
    config = json.loads((model_dir / "config.json").read_text())
    return {
        "model": ident.hexdigest(),
        "tokenizer": tok.hexdigest(),
        "dtype": str(config.get("torch_dtype", config.get("dtype", "?"))),
    }
