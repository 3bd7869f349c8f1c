# mypy: disable-error-code="arg-type,union-attr,operator,index,dict-item"
# (the openai client types messages/tools as TypedDicts and usage as Optional; tests pass plain dicts)
"""`tiered-kv serve` as a subprocess: missing-model error; SIGTERM flushes the cache to disk and a restart on
the same TIERED_KV_DIR serves the next turn from the cold tier."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from tests.serving import clean_env, free_port, start, stop

USER = [
    {
        "role": "user",
        "content": "plan a trip to paris, tokyo and berlin with a budget and a packing list",
    }
]


def test_missing_default_model_says_how_to_fetch(tmp_path):
    env = clean_env(
        TIERED_KV_MODELS_DIR=str(tmp_path / "models"), TIERED_KV_DIR=str(tmp_path / "kv")
    )
    r = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert "tiered-kv model fetch smollm2" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_sigterm_then_restart_serves_from_disk(tiny_model_dir, tmp_path):
    env = clean_env(
        TIERED_KV_DIR=str(tmp_path / "kv"),
        TIERED_KV_MODELS_DIR=str(tmp_path / "models"),
        TIERED_KV_MIN_CONTINUATION_TOKENS="16",
        TIERED_KV_BLOCK_TOKENS="16",  # the tiny conversation spans a few blocks
    )
    log, port = tmp_path / "server.log", free_port()
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120
    )
    proc = start(tiny_model_dir, env, port, log)
    try:
        history = list(USER)
        for follow_up in ("and the second day?", "and the third day?"):
            r = client.chat.completions.create(
                model="tiny", messages=history, max_tokens=8, temperature=0
            )
            history += [
                {"role": "assistant", "content": r.choices[0].message.content},
                {"role": "user", "content": follow_up},
            ]
        assert r.usage.prompt_tokens_details.cached_tokens > 0  # turn two hit memory
    finally:
        stop(proc, log)

    proc = start(tiny_model_dir, env, port, log)
    try:
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=history, max_tokens=4, temperature=0
        )
        third = raw.parse()
        assert third.usage.prompt_tokens_details.cached_tokens > 0, log.read_text()
        assert third.usage.model_extra["cache_tier"] == "cold"
        assert raw.headers["x-tiered-kv-cache-tier"] == "cold"
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'tiered_kv_cached_tokens_total{tier="cold"}' in metrics
    finally:
        stop(proc, log)
