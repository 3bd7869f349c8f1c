"""Fixtures of the server tests (helpers in ``tests/serving.py``)."""

from __future__ import annotations

import pytest

from engine.generate import Engine
from tests.serving import hot_config, serve
from tiered_kv.config import Config


@pytest.fixture(scope="module")
def guarded(tiny_model_dir, tmp_path_factory):
    """A server that wants the API key ``sekret`` (:data:`tests.serving.AUTH`), takes bodies up to
    4000 bytes and prompts up to 64 tokens; no cache."""
    config = Config(
        cache_dir=tmp_path_factory.mktemp("kv"), tiers=(), api_key="sekret", max_body_bytes=4000
    )

    def make() -> Engine:
        engine = Engine(tiny_model_dir, config)
        engine.context_length = 64  # so a "too long" prompt is small
        return engine

    with serve(make, config) as s:
        yield s


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    """A server with the hot tier alone (:func:`tests.serving.hot_config`), one per test module."""
    config = hot_config(tmp_path_factory.mktemp("kv"))
    with serve(lambda: Engine(tiny_model_dir, config), config) as s:
        yield s
