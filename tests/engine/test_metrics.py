"""engine/metrics.py over real HTTP: /metrics counts requests, tokens and cache hits and shows the
cache's own stats (with /v1/models and /health, the other read-only endpoints)."""

from __future__ import annotations

import time

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


def _count(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_a_request_whose_client_went_away_is_a_499_not_a_200(live):
    """Streamed, the status was counted 200 when the stream started; collected, 200 for a body
    whose generation its client's leaving had cut. Both are 499 now."""
    before = httpx.get(live.url + "/metrics").text
    body = {"model": "tiny", "messages": USER, "max_tokens": 4000, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)  # a few events, then the client goes away
    body["stream"] = False
    del body["stream_options"]  # only allowed with stream: true
    try:
        httpx.post(live.url + "/v1/chat/completions", json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass
    name = 'tiered_kv_requests_total{endpoint="chat",status="499"}'
    for _ in range(100):  # the server notices at its next token
        after = httpx.get(live.url + "/metrics").text
        if _count(after, name) - _count(before, name) >= 2:
            break
        time.sleep(0.1)
    assert _count(after, name) - _count(before, name) == 2
    ok = 'tiered_kv_requests_total{endpoint="chat",status="200"}'
    assert _count(after, ok) == _count(before, ok)


def test_a_stream_whose_client_went_away_still_counts_its_tokens(live):
    """The tokens a request computed count whether or not its client read its last chunk: a cut
    stream's usage came in that chunk, which nobody read, so its prompt and completion tokens
    were never counted."""
    prompt = 'tiered_kv_prompt_tokens_total '
    done = 'tiered_kv_requests_total{endpoint="chat",status="499"}'
    before = httpx.get(live.url + "/metrics").text
    body = {"model": "tiny", "messages": USER, "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    for _ in range(100):  # the server notices at its next token
        after = httpx.get(live.url + "/metrics").text
        if _count(after, done) > _count(before, done) and _count(after, prompt) > _count(before, prompt):
            break
        time.sleep(0.1)
    assert _count(after, prompt) > _count(before, prompt)
    completion = "tiered_kv_completion_tokens_total "
    assert _count(after, completion) > _count(before, completion)


def test_a_generation_without_a_first_token_observes_no_ttft():
    """A request cancelled before its first token reported the time until it was cancelled as
    its TTFT (2.7 s in a reviewer's run, for a request that produced nothing)."""
    from engine.events import Usage
    from engine.metrics import Metrics

    m = Metrics()
    usage = Usage(prompt_tokens=4849, completion_tokens=0, cached_tokens=0, cache_tier="none",
                  ttft_seconds=None)  # fmt: skip
    m.generation(usage)
    text = m.render().decode()
    assert _count(text, "tiered_kv_ttft_seconds_count") == 0
    assert _count(text, "tiered_kv_prompt_tokens_total") == 4849


def test_tokens_memory_held_for_a_disk_restore_count_as_the_hot_tiers():
    """A `both` computed onto a hot prefix serves tokens from memory and from the disk: the
    request's tier is "cold", but its held tokens were counted as the disk's."""
    from engine.events import Usage
    from engine.metrics import Metrics

    m = Metrics()
    m.generation(Usage(prompt_tokens=1000, completion_tokens=1, cached_tokens=900, cache_tier="cold",
                       ttft_seconds=0.1, held_tokens=300))  # fmt: skip
    text = m.render().decode()
    assert _count(text, 'tiered_kv_cached_tokens_total{tier="hot"}') == 300
    assert _count(text, 'tiered_kv_cached_tokens_total{tier="cold"}') == 600
