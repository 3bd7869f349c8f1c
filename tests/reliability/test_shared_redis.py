"""Two `tiered-kv serve` processes with their own TIERED_KV_DIR and one real redis-server.

A conversation computed on server A is a ``shared`` hit on server B with the cold run's greedy
answer; B's next restart hits its own disk; another salt shares nothing; a dead, flushed or
corrupted Redis is a miss, never a wrong answer or a 5xx."""

from __future__ import annotations

import signal
import time

SYSTEM = "you are a terse assistant. answer about cities, budgets and packing lists. " * 3
PROMPT = SYSTEM + "user: a week in lisbon by train, what to pack? assistant:"
OTHER = SYSTEM + "user: oslo in winter on a budget? assistant:"


def _env(tmp_path, name: str, url: str, **extra: str) -> dict[str, str]:
    return {"TIERED_KV_DIR": str(tmp_path / f"kv-{name}"), "TIERED_KV_SHARED": url,
            "TIERED_KV_BLOCK_TOKENS": "16", "TIERED_KV_SHARED_TIMEOUT": "0.5", **extra}  # fmt: skip


def _answer(server, prompt: str) -> tuple[str, str, int]:
    body = server.complete(prompt, max_tokens=8)
    usage = body["usage"]
    return body["choices"][0]["text"], usage["cache_tier"], usage["prompt_tokens_details"]["cached_tokens"]


def _published(server, n: int = 1, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while server.metrics().get("tiered_kv_shared_publishes", 0) < n:
        assert time.time() < deadline, server.tail()
        time.sleep(0.2)


def test_session_moves_from_a_to_b_then_stays_local(server_factory, tmp_path, redis_server):
    cold = server_factory("cold", TIERED_KV_TIERS="none", TIERED_KV_DIR=str(tmp_path / "kv-x"))
    want = {p: _answer(cold, p)[0] for p in (PROMPT, OTHER)}
    cold.kill()
    a = server_factory("a", **_env(tmp_path, "a", redis_server.url, TIERED_KV_WRITE_THROUGH="1"))
    text, tier, _ = _answer(a, PROMPT)
    assert text == want[PROMPT] and tier == "none"
    _published(a)  # write-through → local disk → publisher thread → Redis
    b = server_factory("b", **_env(tmp_path, "b", redis_server.url))
    text, tier, cached = _answer(b, PROMPT)
    assert tier == "shared" and cached > 0 and text == want[PROMPT]
    m = b.metrics()
    assert m["tiered_kv_shared_fetches"] == 1 and m["tiered_kv_shared_fetch_bytes"] > 0
    b.stop()  # graceful: the adopted entry is on B's disk already
    redis_server.client().flushall()
    b2 = server_factory("b", **_env(tmp_path, "b", redis_server.url))
    text, tier, cached = _answer(b2, PROMPT)
    assert tier == "cold" and cached > 0 and text == want[PROMPT]
    salted = server_factory("c", **_env(tmp_path, "c", redis_server.url, TIERED_KV_CACHE_SALT="t2"))
    _answer(a, OTHER)
    _published(a, 2)
    text, tier, _ = _answer(salted, OTHER)
    assert tier == "none" and text == want[OTHER]


def test_faulty_redis_is_a_miss_never_an_error(server_factory, tmp_path, redis_server):
    a = server_factory("a", **_env(tmp_path, "a", redis_server.url, TIERED_KV_WRITE_THROUGH="1"))
    want, _, _ = _answer(a, PROMPT)
    _published(a)
    r = redis_server.client()
    for k in r.keys("*:c:*"):  # every chunk corrupted
        r.setrange(k, r.strlen(k) - 5, b"\x00\x01")
    b = server_factory("b", **_env(tmp_path, "b", redis_server.url))
    text, tier, _ = _answer(b, PROMPT)
    assert tier == "none" and text == want
    assert b.metrics()["tiered_kv_cache_shared_corrupt"] == 1
    redis_server.stop_signal(signal.SIGSTOP)  # stalled: every call times out
    try:
        c = server_factory("c", **_env(tmp_path, "c", redis_server.url))
        text, tier, _ = _answer(c, PROMPT)
        assert tier == "none" and text == want
    finally:
        redis_server.stop_signal(signal.SIGCONT)
    redis_server.kill()  # dead: B keeps answering from its own tiers
    text, tier, _ = _answer(b, PROMPT + " more")
    assert tier == "hot"
    a.stop()  # shutdown with a dead Redis does not hang
    assert a.proc is not None and a.proc.returncode is not None
