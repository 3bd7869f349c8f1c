"""Fixtures of the reliability tests (helpers in ``tests/reliability/server.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.server import Server
from tests.serving import clean_env


@pytest.fixture
def server_factory(tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    """``make(**env) -> Server`` (started); every server is killed at the end of the test."""
    made: list[Server] = []

    def make(name: str = "s", start: bool = True, **env: str) -> Server:
        s = Server(tiny_model_dir, clean_env(TIERED_KV_MODELS_DIR=str(tmp_path / "models"), **env),
                   tmp_path / f"{name}-{len(made)}.log")  # fmt: skip
        made.append(s)
        return s.start() if start else s

    yield make
    for s in made:
        s.kill()
