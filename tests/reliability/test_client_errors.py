"""Issues 12.5 and 12.6 over real HTTP: every client mistake is a 400 with an OpenAI-shaped body,
a failed turn keeps the cached conversation, and requests cut off by a shutdown get a 503 JSON."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine import cli_serve
from engine.generate import Engine
from engine.server import create_app
from tests.reliability.server import Server
from tests.serving import TOOLS, clean_env, free_port, started
from tiered_kv.config import Config

USER = {"role": "user", "content": "hi"}


def _call(function: object) -> bytes:
    call = {"id": "c1", "type": "function", "function": function}
    msgs = [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip
    return json.dumps({"messages": msgs, "max_tokens": 2}).encode()


CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
CASES = [
    (COMPLETIONS, b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}"),
    (CHAT, b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": ' + b"9" * 4301 + b"}"),
    (COMPLETIONS, b'{"prompt": "hi", "seed": ' + b"1" * 5000 + b"}"),
    (COMPLETIONS, b'{"prompt": "hi \\ud800", "max_tokens": 2}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi \\udc00"}], "max_tokens": 2}'),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": 2, "seed": -9223372036854775809}'),  # < int64
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": 2, "seed": 18446744073709551616}'),
    (CHAT, json.dumps({"messages": [USER], "max_tokens": 2, "seed": -(2**70)}).encode()),
    (CHAT, _call("get_weather")),
    (CHAT, _call(["get_weather"])),
    (CHAT, _call(7)),
    (CHAT, json.dumps({"messages": [USER], "max_tokens": 2,
                       "tool_choice": {"type": "function", "function": "f"}}).encode()),  # fmt: skip
    (CHAT, json.dumps({"messages": [USER], "max_tokens": 2, "tool_choice": "required"}).encode()),
    (CHAT, json.dumps({"messages": [USER], "max_tokens": 2, "tools": TOOLS,
                       "tool_choice": {"type": "function", "function": {"name": "nope"}}}).encode()),  # fmt: skip
]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("errors")
    env = clean_env(TIERED_KV_DIR=str(d / "kv"), TIERED_KV_MODELS_DIR=str(d / "m"),
                    TIERED_KV_BLOCK_TOKENS="16", TIERED_KV_MIN_CONTINUATION_TOKENS="16")  # fmt: skip
    s = Server(tiny_model_dir, env, d / "log").start()
    yield s
    s.kill()


@pytest.mark.parametrize("path, raw", CASES, ids=range(len(CASES)))
def test_client_mistake_is_openai_shaped_400(live, path, raw):
    r = httpx.post(live.url + path, content=raw, timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and "code" in err
    assert live.proc is not None and live.proc.poll() is None


def test_failed_turn_keeps_the_cached_conversation(live):
    """Issue 12.5: the turn with a bad seed is refused before the cache is touched; the next
    good turn still finds the conversation's entry (it was lost before: 0 cached tokens)."""
    history = [{"role": "user", "content": "tell me a long story about a cache " * 8}]
    first = httpx.post(live.url + CHAT, timeout=60,
                       json={"messages": history, "max_tokens": 8, "temperature": 0}).json()  # fmt: skip
    history += [first["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    bad = httpx.post(live.url + CHAT, timeout=60,
                     json={"messages": history, "max_tokens": 4, "seed": -(2**70)})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "seed"
    good = httpx.post(live.url + CHAT, timeout=60,
                      json={"messages": history, "max_tokens": 4, "seed": 1}).json()  # fmt: skip
    cached = good["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"], good["usage"]


class _SlowLookup:
    """The real tiered cache, each lookup held ``delay`` seconds first (as a slow disk read would).
    It yields to the batch loop every 20 ms, so the loop still sees cancellation and shutdown."""

    def __init__(self, cache, delay: float):
        self._cache, self.delay = cache, delay

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def fetch_steps(self, prompt_ids, background: bool = False):
        deadline = time.monotonic() + self.delay
        while time.monotonic() < deadline:
            time.sleep(0.02)
            yield
        return (yield from self._cache.fetch_steps(prompt_ids, background=background))


class _Slow:
    """The real engine whose requests each wait ``delay`` seconds for their cache lookup (queued
    requests pile up)."""

    def __init__(self, engine: Engine, delay: float):
        self._engine, self.cache = engine, _SlowLookup(engine.cache, delay)

    def __getattr__(self, name):
        return getattr(self._engine, name)


def test_requests_cut_by_shutdown_get_503_json(tiny_model_dir, tmp_path):
    config = Config(cache_dir=tmp_path, tiers=("hot",), max_batch=1)
    app = create_app(lambda: _Slow(Engine(tiny_model_dir, config), 30.0), config)
    port = free_port()
    server = cli_serve.http_server(app, "127.0.0.1", port, log_level="critical", graceful_seconds=1)
    thread = started(server)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    replies: list[httpx.Response] = []

    def send(path: str) -> None:
        body = {"prompt": "queued", "max_tokens": 2}
        if path == MESSAGES:
            body = {"messages": [USER], "max_tokens": 2}
        replies.append(httpx.post(url + path, timeout=60, json=body))

    senders = [threading.Thread(target=send, args=(p,)) for p in (COMPLETIONS, COMPLETIONS, MESSAGES)]
    for t in senders:
        t.start()
    while httpx.get(url + "/health").json()["queued"] < 2:  # one running, two queued
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.should_exit = True
    for t in senders:
        t.join(60)
    thread.join(60)
    assert len(replies) == 3
    for r in replies:
        assert r.status_code == 503, (r.status_code, r.text)
        if r.request.url.path == MESSAGES:  # Anthropic's error object on its route
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
        else:
            assert r.json()["error"]["code"] == "server_shutting_down"


def test_sigterm_ends_running_requests_whole_each_a_503(tiny_model_dir, tmp_path):
    """``tiered-kv serve``'s SIGTERM (``cli_serve.http_server``'s handle_exit) ends the worker's jobs
    before uvicorn waits on the open responses. Before, uvicorn's graceful timeout cut them: a
    non-streamed request could come back as a complete 200 (``finish_reason: "stop"``, a third of
    its tokens), a stream broke mid-body without its error or ``[DONE]``."""
    import signal

    from engine.server import batch_limits
    from engine.worker import Worker

    config = Config(cache_dir=tmp_path, tiers=("hot",), max_batch=2)

    def engine() -> Engine:
        e = Engine(tiny_model_dir, config)
        e.tokenizer.eos_token_ids = []  # random weights: run to max_tokens
        return e

    worker = Worker(engine, **batch_limits(config))
    app = create_app(worker, config)
    port = free_port()
    server = cli_serve.http_server(app, "127.0.0.1", port, log_level="critical")
    thread = started(server, timeout=60)
    url = f"http://127.0.0.1:{port}"
    body = {"messages": [USER], "max_tokens": 30000, "temperature": 0}
    whole: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: whole.append(httpx.post(url + CHAT, json=body, timeout=120)))
    sender.start()
    lines: list[str] = []
    with httpx.stream("POST", url + CHAT, json={**body, "stream": True}, timeout=120) as r:
        it = r.iter_lines()
        for line in it:  # generating: its first content
            lines.append(line)
            if '"content": "' in line and '"content": ""' not in line:
                break
        server.handle_exit(signal.SIGTERM, None)
        lines += list(it)  # the rest, to its end (it raised "incomplete chunked read" before)
    sender.join(120)
    thread.join(120)
    errors = [json.loads(x[6:]) for x in lines if x.startswith("data: {") and '"error"' in x]
    assert [e["error"]["code"] for e in errors] == ["server_shutting_down"]
    assert [x for x in lines if x][-1] == "data: [DONE]"
    [reply] = whole
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "server_shutting_down"
    assert reply.headers["retry-after"] == "1"
