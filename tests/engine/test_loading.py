"""engine/loading.py: ``--model`` as a local directory or a hub id, resolved the way mlx-lm resolves it,
fully offline: a hand-made Hugging Face hub cache (``HF_HOME/hub/models--owner--name/{refs,snapshots,blobs}``)
holds the tiny model, and ``HF_HUB_OFFLINE=1`` keeps huggingface_hub off the network. huggingface_hub reads
its environment at import, so resolution runs in a fresh interpreter, as `tiered-kv serve` would."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from engine import loading
from engine.generate import Engine
from tests.serving import clean_env, free_port, start, stop
from tiered_kv.config import Config

REPO = "tiered-kv-test/tiny-test"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(home: Path, model_dir: Path) -> Path:
    """``model_dir`` laid out as huggingface_hub caches a download; returns the snapshot directory."""
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "blobs").mkdir()
    snap.mkdir(parents=True)
    for f in sorted(model_dir.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy2(f, repo / "blobs" / digest)  # same bytes, same mtime
        os.symlink(f"../../blobs/{digest}", snap / f.name)
    return snap


def resolve_offline(home: Path, spec: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from engine.loading import resolve_model; print(resolve_model(sys.argv[1]))"
    env = clean_env(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run(
        [sys.executable, "-c", code, spec], env=env, capture_output=True, text=True, timeout=120
    )


def test_hub_id_resolves_from_the_local_hub_cache(tiny_model_dir, tmp_path):
    snap = hub_cache(tmp_path / "hf", tiny_model_dir)
    r = resolve_offline(tmp_path / "hf", REPO)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == snap


def test_missing_hub_id_offline_is_one_line(tmp_path):
    (tmp_path / "hf").mkdir()
    r = resolve_offline(tmp_path / "hf", "nobody/nothing")
    assert r.returncode == 1 and "ModelDirError: nobody/nothing: not a local directory" in r.stderr


def test_fingerprint_is_content_based_not_path_based(tiny_model_dir, tmp_path):
    """The snapshot (symlinks into blobs) and the original directory are the same model to the cache."""
    snap = hub_cache(tmp_path / "hf", tiny_model_dir)
    config = Config(cache_dir=tmp_path / "kv", tiers=("hot",))
    a, b = Engine(tiny_model_dir, config), Engine(snap, config)
    assert a.fingerprint == b.fingerprint


def test_local_paths_stay_paths(tiny_model_dir, tmp_path):
    assert loading.resolve_model(str(tiny_model_dir)) == tiny_model_dir
    assert not loading.looks_like_hub_id(str(tiny_model_dir))
    assert loading.looks_like_hub_id("mlx-community/Qwen3-4B-4bit")
    assert not loading.looks_like_hub_id("./models/x") and not loading.looks_like_hub_id("a/b/c")
    with pytest.raises(loading.ModelDirError):
        loading.resolve_model(str(tmp_path))  # exists, but no config.json


def test_serve_hub_id_names_the_model_by_it(tiny_model_dir, tmp_path):
    """`tiered-kv serve --model owner/name` offline: loads the snapshot, /v1/models answers the hub id."""
    hub_cache(tmp_path / "hf", tiny_model_dir)
    port, log = free_port(), tmp_path / "serve.log"
    env = clean_env(
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_OFFLINE="1",
        TIERED_KV_DIR=str(tmp_path / "kv"),
        TIERED_KV_TIERS="hot",
    )
    proc = start(REPO, env, port, log)
    try:
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [REPO]
    finally:
        stop(proc, log)
