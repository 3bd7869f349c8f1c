"""engine/metrics.py over real HTTP: /metrics counts requests, tokens and cache hits and shows the
cache's own stats (with /v1/models and /health, the other read-only endpoints)."""

from __future__ import annotations

import httpx

from tests.serving import USER


def test_models_health_metrics(live):
    assert live.client.models.list().data[0].id == "tiny-test"
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    for _ in range(2):
        live.client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    text = httpx.get(live.url + "/metrics").text
    hot = [
        line
        for line in text.splitlines()
        if line.startswith('tiered_kv_cached_tokens_total{tier="hot"}')
    ]
    assert float(hot[0].split()[-1]) > 0
    for name in (
        'tiered_kv_requests_total{endpoint="chat",status="200"}',
        "tiered_kv_prompt_tokens_total",
        'tiered_kv_cached_tokens_total{tier="hot"}',
        "tiered_kv_hot_entries",
        "tiered_kv_hot_bytes",
        "tiered_kv_hot_evictions",
        "tiered_kv_ttft_seconds_bucket",
        "tiered_kv_request_ttft_seconds_bucket",
        "tiered_kv_queue_wait_seconds_bucket",
        "tiered_kv_batch_size",
        "tiered_kv_queue_length",
    ):
        assert name in text, name
