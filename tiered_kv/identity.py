"""model_identity: what names an mlx-lm model directory for the cache fingerprint (files only, no MLX).

Owner of the model half of the fingerprint; :func:`tiered_kv.opening.open_cache` adds the cache half
(stored-KV quantisation, layer layout, salt). Reads the directory's small files, the weight files'
headers and 1 KiB of each tensor; never loads weights, never writes.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_PIECES = 16  # samples of each tensor, spread evenly from its first bytes to its last
_PIECE = 64  # bytes a sample
_MAX_HEADER = 100 << 20


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "-"


def _weights_digest(path: Path) -> str:
    """A weight file's header and :data:`_PIECES` samples of :data:`_PIECE` bytes spread over each
    tensor it holds, its first and last bytes included (a fine-tune or a merged adapter changes
    every tensor it touches; an edit of a tensor's first rows, or any run longer than 1/15 of it,
    is seen). Reads 1 KiB a tensor, never the weights: an edit of a few scattered rows can still
    go unseen (set ``TIERED_KV_CACHE_SALT`` per model version there). A file that is no
    safetensors gives its first and last 64 KiB."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        n = int.from_bytes(os.pread(fd, 8, 0), "little") if size >= 8 else -1
        if not 0 < n <= min(size - 8, _MAX_HEADER):
            digest.update(os.pread(fd, 1 << 16, 0) + os.pread(fd, 1 << 16, max(0, size - (1 << 16))))
            return digest.hexdigest()
        header = os.pread(fd, n, 8)
        digest.update(header)
        try:
            tensors = json.loads(header)
        except ValueError:
            tensors = {}
        for name in sorted(tensors) if isinstance(tensors, dict) else ():
            span = tensors[name].get("data_offsets") if isinstance(tensors[name], dict) else None
            if not (isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span)):
                continue
            a, b = span
            if 0 <= a < b:
                for start in _samples(a, b):
                    digest.update(os.pread(fd, min(_PIECE, b - start), 8 + n + start))
    finally:
        os.close(fd)
    return digest.hexdigest()


def _samples(a: int, b: int) -> list[int]:
    """Offsets of the samples of a tensor at bytes [a, b): the whole of it when it is short."""
    if b - a <= _PIECES * _PIECE:
        return list(range(a, b, _PIECE))
    last = b - _PIECE
    return [a + (last - a) * i // (_PIECES - 1) for i in range(_PIECES)]


def model_identity(model_dir: str | Path) -> dict[str, str]:
    """``{"model", "tokenizer", "dtype"}`` of an mlx-lm model directory.

    Model identity is cheap and by content, not path or time: config.json's bytes plus each
    weight file's name, size and :func:`_weights_digest` (its header and a sample of every tensor:
    two fine-tunes of one base have the same sizes, and mtimes can agree too — reproducible
    images, ``cp -p``, a Nix store — where they had one fingerprint and one model was served the
    other's KV; a copy of the same weights keeps its cache). Tokenizer and chat template by content
    hash.
    """
    model_dir = Path(model_dir)
    weights = sorted(model_dir.glob("*.safetensors"))
    ident = hashlib.sha256((model_dir / "config.json").read_bytes())
    for w in weights:
        ident.update(f"{w.name}:{w.stat().st_size}:{_weights_digest(w)}".encode())
    tok = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        tok.update(_file_digest(model_dir / name).encode())
    config = json.loads((model_dir / "config.json").read_text())
    return {
        "model": ident.hexdigest(),
        "tokenizer": tok.hexdigest(),
        "dtype": str(config.get("torch_dtype", config.get("dtype", "?"))),
    }
