# mypy: disable-error-code="arg-type,union-attr,operator,index,dict-item"
# (the openai client types messages/tools as TypedDicts and usage as Optional; tests pass plain dicts)
"""engine/server.py over real HTTP: uvicorn in a thread on a free 127.0.0.1 port, the official openai client
for the happy paths and httpx for errors and raw SSE."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from engine import chat
from engine.generate import Engine
from engine.http_edge import RETRY_AFTER_SECONDS
from tests.serving import AUTH, TOOLS, USER, Scripted, ScriptedTurns, hot_config, serve
from tiered_kv.config import Config

TOOL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture()
def fresh(tiny_model_dir, tmp_path):
    config = hot_config(tmp_path)
    with serve(lambda: Engine(tiny_model_dir, config), config) as s:
        yield s


# --- chat -----------------------------------------------------------------------------------------


def test_chat_non_stream(live):
    r = live.client.chat.completions.with_raw_response.create(
        model="tiny", messages=USER, max_tokens=8, temperature=0
    )
    body = r.parse()
    assert body.object == "chat.completion" and body.choices[0].message.role == "assistant"
    assert isinstance(body.choices[0].message.content, str)
    assert body.choices[0].finish_reason in ("stop", "length")
    assert body.usage.completion_tokens <= 8 and body.usage.prompt_tokens > 10
    assert r.headers["x-tiered-kv-cache-tier"] in ("hot", "none")
    assert (
        int(r.headers["x-tiered-kv-cached-tokens"])
        == body.usage.prompt_tokens_details.cached_tokens
    )


def test_cached_tokens_zero_then_cover_previous_turn(fresh):
    c = fresh.client
    first = c.chat.completions.create(model="tiny", messages=USER, max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert first.usage.model_extra["cache_tier"] == "none"
    history = USER + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "and tomorrow?"},
    ]
    r = c.chat.completions.with_raw_response.create(
        model="tiny", messages=history, max_tokens=4, temperature=0
    )
    second = r.parse()
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens
    assert (
        second.usage.model_extra["cache_tier"] == "hot"
        and r.headers["x-tiered-kv-cache-tier"] == "hot"
    )


def test_stream_chunks_like_openai(live):
    stream = live.client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert (
        chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    )
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = live.client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=6, temperature=0
    )
    assert again.choices[0].message.content == text


def test_greedy_same_with_and_without_cache(tiny_model_dir, tmp_path, live):
    none = Config(cache_dir=tmp_path, tiers=())
    turn = USER + [
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "and in tokyo?"},
    ]
    with serve(lambda: Engine(tiny_model_dir, none), none) as plain:
        for msgs in (USER, turn, turn):
            a = live.client.chat.completions.create(
                model="t", messages=msgs, max_tokens=10, temperature=0
            )
            b = plain.client.chat.completions.create(
                model="t", messages=msgs, max_tokens=10, temperature=0
            )
            assert a.choices[0].message.content == b.choices[0].message.content
            assert b.usage.prompt_tokens_details.cached_tokens == 0
        assert a.usage.prompt_tokens_details.cached_tokens > 0


def test_tool_history_round_trip(live):
    """OpenCode's shape: assistant tool_calls with null content, then the tool result; next turn works."""
    call = {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
    }
    msgs = USER + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "call_abc",
            "content": [{"type": "text", "text": "sunny, 21C"}],
        },
    ]
    r = live.client.chat.completions.create(
        model="tiny", messages=msgs, tools=TOOLS, tool_choice="auto", max_tokens=5, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    again = live.client.chat.completions.create(
        model="tiny", messages=msgs, tools=TOOLS, max_tokens=5, temperature=0
    )
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 1


@pytest.fixture()
def scripted(tiny_model_dir, tmp_path):
    config = hot_config(tmp_path)
    with serve(lambda: Scripted(Engine(tiny_model_dir, config), []), config) as s:
        yield s, s.app.state.server.engine


def test_emitted_tool_call_non_stream(scripted):
    live, engine = scripted
    engine.script = [TOOL_TEXT[:20], TOOL_TEXT[20:33], TOOL_TEXT[33:]]
    r = live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me look."
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    # tool_choice "none": the same text is plain content
    r = live.client.chat.completions.create(
        model="t", messages=USER, tools=TOOLS, tool_choice="none"
    )
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_emitted_parallel_tool_calls_stream(scripted):
    live, engine = scripted
    second = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    engine.script = [TOOL_TEXT[:25], TOOL_TEXT[25:], second]
    stream = live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS, stream=True)
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.index for tc in calls] == [0, 1]
    assert [json.loads(tc.function.arguments)["city"] for tc in calls] == ["Paris", "Oslo"]
    assert all(tc.id.startswith("call_") and tc.type == "function" for tc in calls)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Let me look." and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_forces_the_call(scripted):
    live, engine = scripted
    engine.script = ['{"city": "Rome"}}', "\n</tool_call>"]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = live.client.chat.completions.create(
        model="t", messages=USER, tools=TOOLS, tool_choice=choice
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Rome"
    }


def test_keepalive_while_waiting_for_first_token(scripted):
    live, engine = scripted
    engine.script, engine.delay = ["hi"], 0.7
    body = {"messages": USER, "stream": True}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=30) as r:
        raw = r.read().decode()
    assert ": keep-alive\n\n" in raw and raw.rstrip().endswith("data: [DONE]")


# --- completions, models, health, metrics ------------------------------------------------------


def test_completions(live):
    r = live.client.completions.create(
        model="tiny", prompt="the cache holds the prompt", max_tokens=5, temperature=0
    )
    assert r.object == "text_completion" and r.usage.completion_tokens <= 5
    parts = live.client.completions.create(
        model="tiny",
        prompt="the cache holds the prompt",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(parts)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_a_completion_of_token_ids_is_the_completion_of_their_text(live, tiny_model_dir):
    """OpenAI's legacy completions take the prompt as token ids (vLLM and llama.cpp do too;
    lm-eval's ``local-completions`` sends ids by default): it was a 400 ("prompt: Input should be
    a valid string"). Ids, alone or as a list of one, complete as the text they encode does."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    text = "the cache holds the prompt"
    ids = list(load_tokenizer(tiny_model_dir).encode(text, add_special_tokens=False))
    want = live.client.completions.create(model="tiny", prompt=text, max_tokens=5, temperature=0)
    for prompt in (ids, [ids]):
        got = live.client.completions.create(model="tiny", prompt=prompt, max_tokens=5,
                                             temperature=0)  # fmt: skip
        assert got.choices[0].text == want.choices[0].text
        assert got.usage.prompt_tokens == want.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("prompt, says", [
    ([[1, 2], [3]], "one prompt"), (["a", "b"], "one prompt"), ([], "one prompt"),
    ([[]], "non-empty"), ([3, -1], ">= 0"), ([True, 2], "valid"), ([1.5], "valid"),
    ([10**9], "outside the model's vocabulary"),
])  # fmt: skip
def test_token_ids_a_model_cannot_read_are_a_400_naming_the_prompt(live, prompt, says):
    r = httpx.post(live.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith("prompt"), err
    assert says in err["message"], err


def test_every_endpoint_takes_null_fields_as_not_given(live):
    """A client sending each unset field as null (typed SDKs, proxies) got 400s
    (``temperature: Input should be a valid number``); each endpoint serves it with the defaults."""
    nulls = dict.fromkeys(("temperature", "top_p", "n", "stream", "presence_penalty", "seed", "stop"))
    for path, body in (
        ("/v1/chat/completions", {"messages": USER, "logprobs": None, "parallel_tool_calls": None}),
        ("/v1/completions", {"prompt": "the cache holds", "logprobs": None}),
        ("/v1/responses", {"input": "hi", "parallel_tool_calls": None, "instructions": None}),
    ):
        r = httpx.post(live.url + path, json={**body, **nulls, "max_tokens": 2,
                                              "max_output_tokens": 2}, timeout=60)  # fmt: skip
        assert r.status_code == 200, (path, r.text)


def test_sampling_fields_over_http(live, tiny_model_dir):
    """logit_bias (and the other mlx_lm.server sampling fields) reach the model: a +100 bias on
    one token makes every completion token that one; an id past the vocabulary is a 400."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    word = tok.encode(" cache", add_special_tokens=False)[0]
    r = live.client.completions.create(
        model="tiny", prompt="the cache holds the prompt", max_tokens=4, temperature=0,
        logit_bias={str(word): 100}, extra_body={"top_k": 5, "repetition_penalty": 1.2},
    )  # fmt: skip
    assert r.choices[0].text == tok.decode([word] * 4) and r.usage.completion_tokens == 4
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "logit_bias": {"10000000": 5}}
    bad = httpx.post(live.url + "/v1/completions", json=body, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias", bad.text


def test_a_top_k_past_the_vocabulary_leaves_sampling_working(fresh):
    """top_k >= the vocabulary is off: a 200, and the sampled requests after it still sample (it
    was a 500 that broke MLX's global random state: every later unseeded sampled request of the
    server failed with "Attempting to eval an array without a primitive")."""
    vocab = fresh.app.state.server.engine.vocab_size
    url = fresh.url + "/v1/chat/completions"
    for top_k in (vocab, vocab * 10, None):
        body = {"messages": USER, "max_tokens": 4, "temperature": 1.0, "top_k": top_k}
        r = httpx.post(url, json={k: v for k, v in body.items() if v is not None}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


def test_a_penalty_context_past_the_context_is_the_context(fresh):
    """A penalty's context size of 3e9 looks back over the whole context: a 200 (it was a 500
    from mlx-lm's 32-bit slice)."""
    for field in ("repetition", "presence", "frequency"):
        penalty = 1.1 if field == "repetition" else 0.5
        body = {"messages": USER, "max_tokens": 4, "temperature": 0,
                f"{field}_penalty": penalty, f"{field}_context_size": 3_000_000_000}  # fmt: skip
        r = httpx.post(fresh.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_no_max_tokens_runs_to_the_end_of_the_context(tiny_model_dir, tmp_path):
    """A request without max_tokens generates until the model stops or the context is full (it
    stopped at 256 tokens: a client that sends none got long answers and tool calls cut); the
    server's TIERED_KV_MAX_TOKENS bounds it where set."""

    def small_context(config):
        def make():
            engine = Engine(tiny_model_dir, config)
            engine.context_length = 400
            return engine

        return make

    for cap, want in ((0, None), (40, 40)):
        config = hot_config(tmp_path / str(cap), max_tokens=cap)
        with serve(small_context(config), config) as s:
            r = s.client.completions.create(model="tiny", prompt="the cache", temperature=0)
            room = 400 - r.usage.prompt_tokens
            assert r.choices[0].finish_reason == "length"
            assert r.usage.completion_tokens == (want or room) and room > 256


def test_logprobs_over_http(live):
    """OpenAI's logprobs shapes: chat (every token, with top_logprobs alternatives; streamed
    chunks carry the same entries, in order) and legacy completions (tokens whose text is the
    completion). Before, they were null whatever was asked."""
    ask = {"model": "tiny", "messages": USER, "max_tokens": 6, "temperature": 0}
    r = live.client.chat.completions.create(**ask, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
               for e in content)  # fmt: skip
    streamed = [e for c in live.client.chat.completions.create(**ask, logprobs=True, top_logprobs=2,
                                                                stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]  # fmt: skip
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content]
    assert live.client.chat.completions.create(**ask).choices[0].logprobs is None
    c = live.client.completions.create(model="tiny", prompt="the cache holds", max_tokens=5,
                                       temperature=0, logprobs=1)  # fmt: skip
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and all(len(t) == 1 for t in lp.top_logprobs)
    raw = b"".join(bytes(e.bytes) for e in content)  # what each token adds: the content's bytes
    assert raw.decode("utf-8", "replace") == r.choices[0].message.content
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(5)]



def test_logprobs_end_where_a_stop_string_cuts_the_text_over_http(live):
    """A completion cut by a ``stop`` string listed the stop string's tokens in ``logprobs``
    (their ``text_offset``s past the text's end); the tokens of which some text is in the text are
    listed now, and no other, streamed or not. The stop string is 3 characters of the same greedy
    completion without it: the first that starts past its start, is found there first, and ends in
    a token after the one it starts in (the model generates that one before the stop)."""
    ask = {"model": "tiny", "prompt": "the cache holds", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    whole = live.client.completions.create(**ask).choices[0]
    text, lp = whole.text, whole.logprobs
    ends = lp.text_offset[1:] + [len(text)]  # where each token's text ends

    def stops_later(c: int) -> bool:  # 3 characters first found at c that end in a later token
        return text.find(text[c : c + 3]) == c and c + 3 > min(e for e in ends if e > c)

    cut = next(c for c in range(1, len(text) - 3) if stops_later(c))
    kept = [t for t, at in zip(lp.tokens, lp.text_offset, strict=True) if at < cut]
    c = live.client.completions.create(**ask, stop=[text[cut : cut + 3]]).choices[0]
    assert c.text == text[:cut] and c.logprobs.tokens == kept
    assert c.logprobs.text_offset == lp.text_offset[: len(kept)]
    streamed = [t for ch in live.client.completions.create(**ask, stop=[text[cut : cut + 3]], stream=True)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]  # fmt: skip
    assert streamed == kept


SYSTEM = {"role": "system", "content": "You are a careful coding agent. " * 12}


def test_concurrent_sessions_share_the_system_prompt(fresh):
    """Requests sent together on one system prompt each hit it (all but the first to prefill), and
    the entries they store serve their conversations' next turns."""
    c = fresh.client
    firsts: dict[int, Any] = {}
    convs = [
        [SYSTEM, {"role": "user", "content": f"task number {i}: fix the bug"}] for i in range(4)
    ]

    def one(i: int) -> None:
        firsts[i] = c.chat.completions.create(
            model="t", messages=convs[i], max_tokens=6, temperature=0
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    system_tokens = len(fresh.app.state.server.engine.encode_text(SYSTEM["content"]))
    cached = sorted(r.usage.prompt_tokens_details.cached_tokens for r in firsts.values())
    assert cached[0] >= 0 and all(n >= system_tokens for n in cached[1:]), cached
    for i in range(4):
        history = convs[i] + [
            {"role": "assistant", "content": firsts[i].choices[0].message.content},
            {"role": "user", "content": "and now the tests"},
        ]
        r = c.chat.completions.create(model="t", messages=history, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens >= firsts[i].usage.prompt_tokens


def test_queue_full_is_a_429_with_retry_after_and_health_answers_meanwhile(tiny_model_dir, tmp_path):
    config = hot_config(tmp_path, max_batch=1, max_queue=0)
    with serve(lambda: Engine(tiny_model_dir, config), config) as s:
        # (the random tiny model goes on without an end-of-sequence token after this prompt)
        body = {
            "prompt": "hello there " * 10,
            "max_tokens": 20000,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()  # kept open: closing it would hang up (and cancel)
            while '"text"' not in next(lines):
                pass  # until the one place in the batch is taken
            health = httpx.get(s.url + "/health", timeout=5).json()
            assert health["busy"] and health["batch_size"] == 1 and health["in_flight"] == 1
            full = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
            assert full.status_code == 429
            # the SDKs wait as long as Retry-After says (it was missing: they guessed)
            assert full.headers["retry-after"] == str(RETRY_AFTER_SECONDS)
            err = full.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
            metrics = httpx.get(s.url + "/metrics", timeout=5).text
            assert "tiered_kv_batch_size 1.0" in metrics and "tiered_kv_queue_length 0.0" in metrics


def test_fifo_concurrent_requests(live):
    results: list[str] = []

    def one(i: int) -> None:
        r = live.client.chat.completions.create(
            model="t",
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=4,
            temperature=0,
        )
        results.append(r.choices[0].finish_reason)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 3


def test_disconnect_cancels_generation(fresh):
    """A client that goes away mid-stream stops the engine; the next request is not stuck behind it."""
    body = {"messages": USER, "max_tokens": 20000, "temperature": 0, "stream": True}
    with httpx.stream("POST", fresh.url + "/v1/chat/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if '"content"' in line and '"role"' not in line:
                break  # generation is under way: hang up
    worker = fresh.app.state.server.worker
    deadline = time.time() + 5
    while worker.busy() and time.time() < deadline:
        time.sleep(0.02)
    assert not worker.busy(), "the engine kept generating for a client that is gone"
    t0 = time.perf_counter()
    r = fresh.client.chat.completions.create(model="t", messages=USER, max_tokens=2, temperature=0)
    assert time.perf_counter() - t0 < 10 and r.usage.prompt_tokens_details.cached_tokens > 0


def _until(cond, seconds: float = 300.0) -> None:
    """Wait for ``cond()`` (a generous deadline: a condition, not a timing)."""
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "the condition never came"
        time.sleep(0.05)


def _completion_tokens(live) -> float:
    metrics = httpx.get(live.url + "/metrics", timeout=10).text
    return float(re.search(r"^tiered_kv_completion_tokens_total (\S+)$", metrics, re.M).group(1))


def _send(url: str, path: str, body: dict[str, Any]) -> socket.socket:
    """A POST of ``body`` on a socket of its own, its response left unread (close it: a hang-up)."""
    raw = json.dumps(body)
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n{raw}").encode())  # fmt: skip
    return sock


def test_a_non_streamed_request_stops_when_its_client_goes_away(fresh):
    """README: a client that disconnects stops its generation. A non-streamed one too, while
    tokens flow: it generated to its end before (its disconnect was looked for only after a
    keep-alive interval without a token)."""
    body = {"prompt": "hello there " * 10, "max_tokens": 10000, "temperature": 0}
    health = lambda: httpx.get(fresh.url + "/health", timeout=10).json()  # noqa: E731
    with _send(fresh.url, "/v1/completions", body):
        _until(lambda: health()["batch_size"] == 1)  # decoding: tokens flow
    _until(lambda: health()["in_flight"] == 0)
    assert 0 < _completion_tokens(fresh) < 10000


def test_a_queued_request_whose_client_went_away_frees_its_place(tiny_model_dir, tmp_path):
    """TIERED_KV_MAX_BATCH=1, TIERED_KV_MAX_QUEUE=1: a queued request (streamed or not) whose client
    hangs up leaves the queue at once, while the running one goes on, and the next request gets
    its place. Before, the dead request kept it until the engine took it (a 429 queue_full for
    every request meanwhile)."""
    config = hot_config(tmp_path, max_batch=1, max_queue=1)
    with serve(lambda: Engine(tiny_model_dir, config), config) as s:
        health = lambda: httpx.get(s.url + "/health", timeout=10).json()  # noqa: E731
        prompt = {"prompt": "hello there " * 10, "temperature": 0}
        body = {**prompt, "max_tokens": 30000, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as running:
            lines = running.iter_lines()  # kept open: closing it would hang up
            while '"text"' not in next(lines):
                pass  # it has the one place in the batch
            for stream in (False, True):
                with _send(s.url, "/v1/completions", {**prompt, "max_tokens": 4, "stream": stream}):
                    _until(lambda: health()["queued"] == 1)
                _until(lambda: health()["queued"] == 0)  # (else once the running one ended)
                assert health()["batch_size"] == 1, "the running request ended first"
            nxt = {**prompt, "max_tokens": 4, "stream": True}
            with httpx.stream("POST", s.url + "/v1/completions", json=nxt, timeout=60) as r:
                assert r.status_code == 200  # queued (keep-alives), not a 429
        metrics = httpx.get(s.url + "/metrics", timeout=10).text  # the non-streamed one: no 500
        assert 'endpoint="completions",status="499"' in metrics and 'status="500"' not in metrics


# --- errors -------------------------------------------------------------------------------------


def test_a_streamed_request_whose_client_went_away_while_queued_is_a_499(tiny_model_dir, tmp_path):
    """A streamed request whose client hangs up while it waits for a place (before any keep-alive)
    leaves the queue unserved. It was counted a 200 in /metrics (its empty stream was "sent",
    to nobody); a 499, as the same request not streamed."""
    config = hot_config(tmp_path, max_batch=1, max_queue=1)
    make = lambda: Engine(tiny_model_dir, config)  # noqa: E731
    with serve(make, config, keepalive=600) as s:  # no keep-alive comes before the hang-up
        health = lambda: httpx.get(s.url + "/health", timeout=10).json()  # noqa: E731
        never_ends = {"prompt": "hello", "max_tokens": 30000, "stream": True, "logit_bias": {"2": -100}}
        with httpx.stream("POST", s.url + "/v1/completions", json=never_ends, timeout=60) as running:
            lines = running.iter_lines()  # kept open: closing it would hang up
            while '"text"' not in next(lines):
                pass  # it has the one place in the batch
            queued = {"messages": USER, "max_tokens": 4, "stream": True}
            with _send(s.url, "/v1/chat/completions", queued):
                _until(lambda: health()["queued"] == 1)
            _until(lambda: health()["queued"] == 0)
            metrics = lambda: httpx.get(s.url + "/metrics", timeout=10).text  # noqa: E731
            _until(lambda: 'endpoint="chat"' in metrics())  # counted as its handler ends
            text = metrics()
        assert 'endpoint="chat",status="499"} 1.0' in text, text
        assert 'endpoint="chat",status="200"' not in text


def test_a_stream_ended_before_its_first_event_gets_the_errors_status(tiny_model_dir, tmp_path):
    """A streamed request still queued at shutdown (SIGTERM: ``Worker.begin_close``) has sent
    nothing: it gets a 503 with ``retry-after``, as the same request not streamed (the SDKs retry
    it), and Anthropic's error object on /v1/messages. It was a 200 whose stream held one error
    event: nothing to retry. The running stream ends with its error event, as before."""
    config = hot_config(tmp_path, max_batch=1, max_queue=2)
    make = lambda: Engine(tiny_model_dir, config)  # noqa: E731
    with serve(make, config, keepalive=600) as s:  # no keep-alive comes before the shutdown
        health = lambda: httpx.get(s.url + "/health", timeout=10).json()  # noqa: E731
        never_ends = {"prompt": "hello", "max_tokens": 30000, "stream": True, "logit_bias": {"2": -100}}
        replies: list[httpx.Response] = []

        def queued(path: str, body: dict[str, Any]) -> None:
            with httpx.stream("POST", s.url + path, json={**body, "stream": True}, timeout=60) as r:
                r.read()
                replies.append(r)

        with httpx.stream("POST", s.url + "/v1/completions", json=never_ends, timeout=60) as running:
            lines = running.iter_lines()
            while '"text"' not in next(lines):
                pass  # it has the one place in the batch
            waiting = [threading.Thread(target=queued, args=a) for a in (
                ("/v1/chat/completions", {"messages": USER, "max_tokens": 4}),
                ("/v1/messages", {"messages": USER, "max_tokens": 4}))]  # fmt: skip
            for t in waiting:
                t.start()
            _until(lambda: health()["queued"] == 2)
            s.app.state.server.worker.begin_close()
            rest = list(lines)
            for t in waiting:
                t.join(60)
    rest = [x for x in rest if x]  # (the blank lines between events)
    assert any('"server_shutting_down"' in x for x in rest) and rest[-1] == "data: [DONE]"
    by_path = {r.request.url.path: r for r in replies}
    chat, anthropic = by_path["/v1/chat/completions"], by_path["/v1/messages"]
    assert chat.status_code == 503 and chat.headers["retry-after"] == "1", chat.text
    assert chat.json()["error"]["code"] == "server_shutting_down"
    assert anthropic.status_code == 503 and anthropic.json()["error"]["type"] == "overloaded_error"


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b'"just a string"', None),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"model": "x"}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "messages.0.role"),
        (json.dumps({"messages": USER, "max_tokens": 0}).encode(), "max_tokens"),
        (json.dumps({"messages": USER, "max_tokens": "ten"}).encode(), "max_tokens"),
        (json.dumps({"messages": USER, "stream": "maybe"}).encode(), "stream"),
        (
            json.dumps({"messages": [{"role": "user", "content": "word " * 200}]}).encode(),
            "messages",
        ),
    ],
)
def test_client_errors_are_openai_shaped_400(guarded, body, param):
    r = httpx.post(guarded.url + "/v1/chat/completions", content=body, headers=AUTH)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_context_length_code(guarded):
    body = {"messages": [{"role": "user", "content": "word " * 200}]}
    r = httpx.post(guarded.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert r.json()["error"]["param"] == "messages"


def test_a_responses_input_past_the_character_bound_names_input(live):
    """The pre-render character bound named ``messages`` on ``/v1/responses`` too, whose prompt is
    ``input``; chat keeps ``messages``."""
    text = "x " * 2_000_000  # past any context this model has, in characters
    for path, body, param in (("/v1/responses", {"input": text}, "input"),
                              ("/v1/chat/completions",
                               {"messages": [{"role": "user", "content": text}]}, "messages")):  # fmt: skip
        r = httpx.post(live.url + path, json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_more_messages_than_the_context_has_tokens_is_refused_before_rendering(guarded):
    """Empty messages have no characters for the pre-render bound to count: 400k of them (13 MB)
    were rendered (5.5 s of a parse slot) before the prompt's length refused them. Each message
    takes at least a token, so their count alone is the bound."""
    body = {"messages": [{"role": "user", "content": ""}] * 65}
    r = httpx.post(guarded.url + "/v1/chat/completions", json=body, headers=AUTH)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["param"] == "messages" and "65 messages" in err["message"]


EMPTY = {"role": "user", "content": ""}
RESULT = {"type": "tool_result", "tool_use_id": "t", "content": ""}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/chat/completions", {"messages": [EMPTY] * 65}, "messages"),
        ("/v1/messages", {"max_tokens": 8, "messages": [EMPTY] * 65}, "messages"),
        ("/v1/messages/count_tokens", {"messages": [EMPTY] * 65}, "messages"),
        ("/v1/responses", {"input": [EMPTY] * 65}, "input"),
        # one Anthropic message of 65 tool results: 65 chat messages, counted before they are validated
        ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": [RESULT] * 65}]},
         "messages"),
    ],
)  # fmt: skip
def test_more_turns_than_the_context_has_tokens_are_refused_before_validation(
    guarded, monkeypatch, path, body, param
):
    """The count bound ran after pydantic had validated every message: 400k empty messages (13 MB)
    held a parse slot 3-4 s on each endpoint before their 400. Now no request model is validated
    with more turns than the context (64 tokens) has: spied on the real models' validation."""
    from engine import api

    validated: list[tuple[str, int]] = []
    real = api.RequestBody.model_validate.__func__  # type: ignore[attr-defined]

    def counting(cls, data, *a, **kw):
        turns = data.get("messages") or data.get("input") if isinstance(data, dict) else None
        validated.append((cls.__name__, len(turns) if isinstance(turns, list) else 0))
        return real(cls, data, *a, **kw)

    monkeypatch.setattr(api.RequestBody, "model_validate", classmethod(counting))
    r = httpx.post(guarded.url + path, json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    assert [v for v in validated if v[1] > 64] == []
    if not path.startswith("/v1/messages"):  # Anthropic's error body has no code or param
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert "65 messages" in r.json()["error"]["message"]


def test_a_completion_too_long_for_the_context_names_its_prompt():
    """/v1/completions named ``messages``, a field its body does not have."""
    from engine.api import CompletionRequest
    from engine.errors import ApiError
    from engine.respond import sampling

    req = CompletionRequest(prompt="word " * 200)
    with pytest.raises(ApiError) as e:
        sampling(req, list(range(300)), 256, 1000)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"


def test_unknown_path_and_method(guarded):
    r = httpx.get(guarded.url + "/v1/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(guarded.url + "/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()


def test_head_of_the_get_routes(guarded):
    """HEAD of /health, /v1/models and /metrics: a 200 without a body, as their GET (HTTP requires
    HEAD wherever GET is served; a health check by ``wget --spider`` sends it). It was a 405."""
    for path in ("/health", "/v1/models", "/metrics"):
        r = httpx.head(guarded.url + path, headers=AUTH)
        assert r.status_code == 200 and r.content == b"", (path, r.status_code)
        get = httpx.get(guarded.url + path, headers=AUTH)
        assert r.headers["content-type"] == get.headers["content-type"]
    r = httpx.request("OPTIONS", guarded.url + "/health")
    assert r.status_code == 405 and "error" in r.json()


def test_a_model_is_retrieved_by_its_id(guarded):
    """``GET /v1/models/{id}`` (the openai SDK's ``models.retrieve``; ids hold ``/``): the model, or
    an OpenAI-shaped 404 naming the id. It was a 404 for the served model too."""
    listed = httpx.get(guarded.url + "/v1/models", headers=AUTH).json()["data"][0]
    got = guarded.client.models.retrieve(listed["id"])
    assert got.id == listed["id"] and got.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        guarded.client.models.retrieve("mlx-community/no-such-model")
    assert e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.body["message"]


# --- SmolLM2 (plain ChatML: tools injected in Hermes format) -------------------------------------


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_turns_hit_the_cache(smollm2_dir, tmp_path):
    config = hot_config(tmp_path)
    with serve(lambda: Engine(smollm2_dir, config), config) as s:
        c = s.client
        first = c.chat.completions.create(
            model="s", messages=USER, tools=TOOLS, max_tokens=24, temperature=0
        )
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        msg = first.choices[0].message
        reply = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:  # whatever the model did, resend it the way OpenCode does
            reply = {
                "role": "assistant",
                "content": None,
                "tool_calls": [tc.model_dump() for tc in msg.tool_calls],
            }
        history = USER + [reply]
        if msg.tool_calls:
            history += [
                {"role": "tool", "tool_call_id": tc.id, "content": "sunny"} for tc in msg.tool_calls
            ]
        else:
            history += [{"role": "user", "content": "and tomorrow?"}]
        second = c.chat.completions.create(
            model="s", messages=history, tools=TOOLS, max_tokens=8, temperature=0
        )
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        assert second.usage.model_extra["cache_tier"] == "hot"


# --- model families: reasoning + their own tool-call format (engine/output.py) -------------------

QWEN3_OUT = [  # Qwen3's think block and Hermes-JSON call (template: Qwen/Qwen3-0.6B, see test_output.py)
    "<think>\nParis, so ",
    "the weather tool.\n</th",
    "ink>\n\n<tool_call>\n",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
]
CODER_OUT = [  # Qwen3-Coder's XML call (template: Qwen/Qwen3-Coder-30B-A3B-Instruct)
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n",
    "</parameter>\n</function>\n</tool_call>",
]


@pytest.fixture()
def family_server(family_dirs, tmp_path):
    """A server on a family's template (the tiny weights; generation scripted)."""
    started = []

    def start(family: str, script: list[str]):
        config = hot_config(tmp_path / family)
        ctx = serve(lambda: Scripted(Engine(family_dirs[family], config), script), config)
        started.append(ctx)
        return ctx.__enter__()

    yield start
    for ctx in started:
        ctx.__exit__(None, None, None)


def test_reasoning_and_tool_call_non_stream(family_server):
    live = family_server("qwen3", QWEN3_OUT)
    r = live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS)
    msg = r.choices[0].message
    assert msg.reasoning_content == "Paris, so the weather tool." == msg.reasoning
    assert msg.content is None and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    # the client sends the turn back with its reasoning: the template renders it, 200
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": msg.reasoning_content,
            "tool_calls": [msg.tool_calls[0].model_dump()],
        },
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"},
    ]
    again = live.client.chat.completions.create(model="t", messages=history, tools=TOOLS)
    assert again.choices[0].finish_reason == "tool_calls"


KIMI_THINKING_OUT = [
    "<think>Two cities.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0",
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
]


def test_kimi_k2_thinking_serves_a_conversation_that_holds_a_call(family_server):
    """Kimi-K2-Thinking's template changes a list in place, which transformers' sandbox refuses:
    the turn after a tool call (its result in the history) was a 400 on every API. It is served,
    and its prompt begins with the call turn's (the cache's prefix)."""
    live = family_server("kimi-k2-thinking", KIMI_THINKING_OUT)
    r = live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.reasoning_content == "Two cities."
    history = USER + [
        {"role": "assistant", "content": None, "reasoning_content": msg.reasoning_content,
         "tool_calls": [msg.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"},
    ]  # fmt: skip
    again = httpx.post(live.url + "/v1/chat/completions", json={"messages": history, "tools": TOOLS}, timeout=60)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def _call_round_trip(live) -> None:
    """A request whose scripted answer is a call of get_weather for Paris after the reasoning
    "Weather first.": a tool call, the reasoning apart, no content; then the conversation with the
    call and its result sent back: rendered (200) and served from the cache."""
    r = live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.reasoning_content == "Weather first.", msg
    assert not msg.content and json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [msg.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"},
    ]  # fmt: skip
    again = httpx.post(live.url + "/v1/chat/completions", json={"messages": history, "tools": TOOLS}, timeout=60)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


DEEPSEEK_V32_OUT = [
    "Weather first.</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n",
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
]


DEEPSEEK_V31_OUT = [
    "Weather first.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>",
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
]


MINIMAX_M3_OUT = [
    '<mm:think>Weather first.</mm:think>]<]minimax[>[<tool_call>\n]<]minimax[>[<invoke name="get_weather">',
    "]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>\n]<]minimax[>[</tool_call>",
]


HY3_OUT = [
    "<think:opensource>Weather first.</think:opensource><tool_calls:opensource>\n<tool_call:opensource>get_weather",
    "<tool_sep:opensource>\n<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Paris"
    "</arg_value:opensource>\n</tool_call:opensource>\n</tool_calls:opensource>",
]


@pytest.mark.parametrize(("family", "script"), [("deepseek-v3.2", DEEPSEEK_V32_OUT), ("deepseek-v3.1", DEEPSEEK_V31_OUT),
                                                ("minimax-m3", MINIMAX_M3_OUT), ("hy3", HY3_OUT)])  # fmt: skip
def test_calls_mlx_lm_cannot_read_come_back_as_tool_calls(family_server, family, script):
    """DeepSeek V3.2's template tells the model to call in its DSML markup, V3.1's writes calls
    back in its own (and lists no tools: the server had asked it for Hermes calls; now it is told
    its own format), MiniMax-M3's in tags after a namespace token (mlx-lm takes it for JSON), Hy3's
    in tags ending ``:opensource``;
    mlx-lm has a parser for none: the call came back as the message's text. Now a tool call (its
    reasoning apart), and the conversation sent back renders and is served from the cache."""
    _call_round_trip(family_server(family, script))


@pytest.mark.parametrize(
    ("family", "written"),
    [("granite-3.3", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
     ("lfm2-8b", '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>')],
)  # fmt: skip
def test_calls_come_back_and_go_back_as_the_model_wrote_them(family_dirs, tmp_path, family, written):
    """Granite 3.3 calls with ``<|tool_call|>`` and a JSON list (its instructions say so), which
    mlx-lm has no parser for: the call came back as the message's text. Its template and
    LFM2-8B-A1B's render each message's content alone, so a call sent back as ``tool_calls``
    vanished from the next prompt (the model saw a result of no call, and the prompt parted from
    the cached turn). Now a tool call comes back, and goes back into the assistant's content as the
    model wrote it."""
    config = hot_config(tmp_path / family)
    scripts = [[written[:20], written[20:]]]
    with serve(lambda: ScriptedTurns(Engine(family_dirs[family], config), scripts), config) as live:
        r = live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and not msg.content, msg
        assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
        history = USER + [{"role": "assistant", "content": None, "tool_calls": [msg.tool_calls[0].model_dump()]},
                          {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"}]  # fmt: skip
        again = httpx.post(live.url + "/v1/chat/completions", json={"messages": history, "tools": TOOLS}, timeout=60)
        assert again.status_code == 200, again.text
        prompts = live.app.state.server.engine.prompts
    assert prompts[-1].count(written) == 1, prompts[-1][-300:]


NEMOTRON_V2_OUT = [
    "Weather first.\n</think>\n<TOOLCALL>[{\"name\": \"get_weather\", ",
    '"arguments": {"city": "Paris"}}]</TOOLCALL>',
]


def test_nemotron_nano_v2s_calls_come_back_as_tool_calls(family_server):
    """Nemotron Nano v2's template tells the model to call as a JSON list in ``<TOOLCALL>``, which
    mlx-lm has no parser for: the call came back as the message's text (the markers found by
    rendering a call, as for Cohere's, Apertus's, GigaChat's, Apriel's, MiniMax-M1's). Now a tool
    call, streamed too, and the conversation sent back is served from the cache."""
    live = family_server("nemotron-nano-v2", NEMOTRON_V2_OUT)
    _call_round_trip(live)
    chunks = list(live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed] == ["get_weather"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


SEED_OUT = [
    "<seed:think>Weather first.</seed:think>\n<seed:tool_call>\n<function=get_weather>\n",
    "<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>",
]


def test_seed_oss_serves_its_own_tool_format(family_server, family_dirs):
    """Seed-OSS's template renders tools only where their parameters declare ``properties``: the
    server's probe declared none, so it took the template for one without tools and asked the
    model for Hermes calls its template never taught; its own calls (Qwen3-Coder's XML in
    ``<seed:tool_call>``) and its ``<seed:think>`` reasoning came back as text. Now the template's
    own tool list, the call and reasoning read, and a tool without parameters served (200)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    prompt = chat.render_chat(load_tokenizer(family_dirs["seed-oss"]), USER, TOOLS)
    assert "<seed:tool_call>\n<function=example_function_name>" in prompt and "<tool_call>" not in prompt
    live = family_server("seed-oss", SEED_OUT)
    no_args = {"type": "function", "function": {"name": "now", "description": "the time", "parameters": {}}}
    body = {"messages": USER, "tools": [*TOOLS, no_args]}
    r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls" and msg["reasoning_content"] == "Weather first."
    assert not msg["content"] and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    history = USER + [
        {"role": "assistant", "content": None, "reasoning_content": msg["reasoning_content"],
         "tool_calls": msg["tool_calls"]},
        {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "sunny"},
    ]  # fmt: skip
    again = httpx.post(live.url + "/v1/chat/completions", json={**body, "messages": history}, timeout=60)
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize(
    ("family", "script", "written"),
    [
        ("command-r7b", ["<|START_RESPONSE|>Sunny", " in Paris.<|END_RESPONSE|>"],
         "<|START_RESPONSE|>Sunny in Paris.<|END_RESPONSE|>"),
        ("kimi-k3", ["Easy.<|close|>think<|sep|><|open|>response<|sep|>Sunny", " in Paris.<|close|>response<|sep|>",
                     "<|close|>message<|sep|>"],
         "<|open|>response<|sep|>Sunny in Paris.<|close|>response<|sep|><|close|>message<|sep|>"),
    ],
)  # fmt: skip
def test_an_answer_comes_back_without_its_markers(family_dirs, tmp_path, family, script, written):
    """Command R7B writes its answer as ``<|START_RESPONSE|>…<|END_RESPONSE|>``, Kimi K3 as
    ``<|open|>response<|sep|>…<|close|>response<|sep|><|close|>message<|sep|>``: the markers were the
    message's content, and the client sending it back made the next prompt write them twice (the
    template wraps the content in them again), so it parted from the tokens the model wrote. Now
    the content is the text between them, and the next prompt holds the answer as written."""
    config = hot_config(tmp_path / family)
    scripts = [script]
    with serve(lambda: ScriptedTurns(Engine(family_dirs[family], config), scripts), config) as live:
        r = live.client.chat.completions.create(model="t", messages=USER)
        assert r.choices[0].message.content == "Sunny in Paris."
        again = USER + [{"role": "assistant", "content": r.choices[0].message.content},
                        {"role": "user", "content": "And tomorrow?"}]  # fmt: skip
        live.client.chat.completions.create(model="t", messages=again)
        prompts = live.app.state.server.engine.prompts
    assert prompts[-1].count(written) == 1 and prompts[-1].count("Sunny in Paris.") == 1


def test_gemma_2_serves_a_conversation_with_a_system_prompt(family_server):
    """Gemma 2's template refuses a system turn: every request that held one (OpenCode's, Claude
    Code's, any agent's) was a 400. Served now, the system prompt at the head of the first user turn,
    and the next turn a hot hit on it."""
    live = family_server("gemma-2", ["Hello."])
    convo = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "Hi."}]
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": convo, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200, r.text
    again = convo + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Bye."}]  # fmt: skip
    r2 = httpx.post(live.url + "/v1/chat/completions", json={"messages": again, "max_tokens": 8}, timeout=60)
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > r.json()["usage"]["prompt_tokens"] // 2


def test_reasoning_and_tool_call_stream(family_server):
    live = family_server("qwen3", QWEN3_OUT)
    chunks = list(
        live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert reasoning == "Paris, so the weather tool."
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


LLAMA_OUT = ['{"name": "get_weather", ', '"parameters": {"city": "Paris"}}']  # Llama 3.3: no markers


def test_llama_tool_call_and_the_next_turn_hot(family_server):
    """Llama 3.3 answers a call with its JSON alone: that was content (no mlx-lm parser), so an agent
    client never saw a call. Streamed and whole it is a call now, and the turn sent back renders after
    the first prompt unchanged: the next prompt's cache hit covers all of it."""
    live = family_server("llama-3.3", LLAMA_OUT)
    chunks = list(
        live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    r = live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS)
    msg = r.choices[0].message
    assert msg.content is None and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [msg.tool_calls[0].model_dump()]},
        {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny"},
    ]
    again = live.client.chat.completions.create(model="t", messages=history, tools=TOOLS)
    assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens
    assert again.usage.model_extra["cache_tier"] == "hot"


def test_chat_template_kwargs_reach_the_template(family_dirs, tmp_path):
    """Qwen3 with thinking off (the server's TIERED_KV_CHAT_TEMPLATE_ARGS, or a request's
    chat_template_kwargs, which wins): the prompt gains the closed think block's tokens. Both
    were ignored before; a name the template owns is a 400."""
    config = hot_config(tmp_path, chat_template_args='{"enable_thinking": false}')
    engine = lambda: Scripted(Engine(family_dirs["qwen3"], config), ["Hi."])  # noqa: E731
    with serve(engine, config) as live:

        def prompt_tokens(**extra) -> int:
            r = live.client.chat.completions.create(model="t", messages=USER, extra_body=extra)
            assert r.choices[0].message.content == "Hi."
            return r.usage.prompt_tokens

        off = prompt_tokens()
        on = prompt_tokens(chat_template_kwargs={"enable_thinking": True})
        assert off > on and prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == off
        body = {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}
        bad = httpx.post(live.url + "/v1/chat/completions", json=body, headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_server_template_args_naming_the_templates_own_are_refused(tmp_path):
    from engine.server import create_app
    from tiered_kv import ConfigError

    config = hot_config(tmp_path, chat_template_args='{"tokenize": true}')
    with pytest.raises(ConfigError, match="TIERED_KV_CHAT_TEMPLATE_ARGS"):
        create_app(lambda: None, config)


def test_qwen3_coder_xml_calls_both_ways(family_server):
    live = family_server("qwen3-coder", CODER_OUT)
    r = live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Oslo"
    }
    chunks = list(
        live.client.chat.completions.create(model="t", messages=USER, tools=TOOLS, stream=True)
    )
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [json.loads(tc.function.arguments) for tc in calls] == [{"city": "Oslo"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# --- one thread owns MLX (issue 19) ----------------------------------------------------------------


def test_engine_thread_owns_mlx_lazy_rope_model(tiny_llama3_dir, tmp_path):
    """A Llama 3 model keeps a lazy RoPE array made at load time. Loaded on one thread and run on
    another, every request failed ("There is no Stream(gpu, 0) in current thread" on CUDA; the same
    on the CPU with this model): the model must be loaded on the thread that runs it. Exercises
    completions, a streamed chat with tools, write-through to disk and a restart served from disk."""
    config = Config(
        cache_dir=tmp_path, tiers=("hot", "cold"), write_through=True, block_tokens=16,
        min_continuation_tokens=16, prefill_chunk=16,
    )  # fmt: skip
    prompt = "the cache holds the prompt and the disk holds the rest of it " * 6
    with serve(lambda: Engine(tiny_llama3_dir, config), config) as s:
        s.client.completions.create(model="t", prompt=prompt, max_tokens=4, temperature=0)
        b = s.client.completions.create(
            model="t", prompt=prompt + "again", max_tokens=4, temperature=0
        )
        assert b.usage.prompt_tokens_details.cached_tokens > 0
        stream = s.client.chat.completions.create(
            model="t", messages=USER, tools=TOOLS, max_tokens=4, temperature=0, stream=True
        )
        assert [c for c in stream][-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
    with serve(lambda: Engine(tiny_llama3_dir, config), config) as s:
        c = s.client.completions.create(
            model="t", prompt=prompt + "thrice", max_tokens=4, temperature=0
        )
    assert c.usage.prompt_tokens_details.cached_tokens > 0
    assert c.usage.model_extra["cache_tier"] == "cold"


# --- what a chat template cannot render ------------------------------------------------------------


def _call_turn(arguments: str) -> list[dict[str, Any]]:
    """USER, then an assistant turn calling get_weather with ``arguments`` and the tool's result."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return USER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip


def test_a_call_sent_back_with_no_arguments_renders_and_a_non_object_is_a_400(family_server):
    """Qwen3-Coder's template iterates a call's arguments as a mapping. A call sent back with
    ``"arguments": ""`` (a function without parameters) was a 500 (TypeError in the template); it
    is a call with no arguments now. Arguments that are no JSON object were a 500 too: a 400."""
    live = family_server("qwen3-coder", ["Done."])
    url = live.url + "/v1/chat/completions"
    ok = httpx.post(url, json={"messages": _call_turn(""), "tools": TOOLS}, timeout=60)
    assert ok.status_code == 200, ok.text
    for arguments in ("not json", "[1, 2]"):
        r = httpx.post(url, json={"messages": _call_turn(arguments), "tools": TOOLS}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    items = [{"type": "message", "role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "[1]"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]  # fmt: skip
    r = httpx.post(live.url + "/v1/responses", json={"input": items}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_a_tool_schema_the_template_cannot_read_is_a_400(family_server):
    """Gemma 4's template walks a tool's ``properties`` as a mapping and its ``required`` as a
    list: a schema with a string or list there (valid JSON, a client's mistake) was a 500
    (AttributeError / TypeError in the template) on every API; a 400 in each API's shape now."""
    live = family_server("gemma-4", ["Done."])
    bad = {"type": "object", "properties": "city"}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": bad}}]
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": USER, "tools": tools}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": 1}
    body = {"messages": USER, "max_tokens": 8, "tools": [{"name": "get_weather", "input_schema": schema}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(live.url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    metrics = httpx.get(live.url + "/metrics", timeout=10).text
    assert 'status="500"' not in metrics


def _tools(n: int, anthropic: bool = False) -> list[dict[str, Any]]:
    if anthropic:
        return [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(n)]
    return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
        ("/v1/messages", {"messages": USER, "max_tokens": 1}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ],
)
def test_more_tools_than_max_tools_are_refused_before_validation(live, path, body):
    """200k tools (10 MB) were validated and rendered for 4 s before the prompt's length refused
    them. More than MAX_TOOLS (4x the 128 OpenAI takes: agents with MCP servers send more) is a
    400 naming ``tools`` with OpenAI's code; as many are served."""
    from engine import api

    flat = [{"type": "function", "name": f"f{i}"} for i in range(api.MAX_TOOLS + 1)]
    tools = flat if path == "/v1/responses" else _tools(api.MAX_TOOLS + 1, path == "/v1/messages")
    r = httpx.post(live.url + path, json={**body, "tools": tools}, timeout=60)
    assert r.status_code == 400, r.text
    if path != "/v1/messages":  # Anthropic's error body has no code or param
        err = r.json()["error"]
        assert err["param"] == "tools" and err["code"] == "array_above_max_length", err
    assert str(api.MAX_TOOLS) in r.json()["error"]["message"]
    # served: 512 Anthropic tools render to ~18k tokens, 15-30 s of prefill on two busy CPU cores
    ok = httpx.post(live.url + path, json={**body, "tools": tools[:-1]}, timeout=300)
    assert ok.status_code == 200, ok.text  # (not "512 not in the text": a random response id held it)


def test_more_logit_bias_entries_than_max_logit_bias_are_refused(live):
    """1M logit_bias entries were validated for 1.6 s before an id past the vocabulary refused
    them. More than MAX_LOGIT_BIAS is a 400 naming ``logit_bias``; as many are served."""
    from engine import api

    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "hi"})):
        bias = {str(i): -1 for i in range(api.MAX_LOGIT_BIAS + 1)}
        r = httpx.post(live.url + path, json={**body, "max_tokens": 1, "logit_bias": bias}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        del bias[str(api.MAX_LOGIT_BIAS)]
        ok = httpx.post(live.url + path, json={**body, "max_tokens": 1, "logit_bias": bias}, timeout=60)
        assert ok.status_code == 200, ok.text


def test_more_tool_calls_than_the_context_has_tokens_are_refused_before_validation(
    guarded, monkeypatch
):
    """Each tool call renders a token at least, as each message does, but only messages were
    counted: 400k calls in one assistant message took 4.9 s to validate and render before the
    prompt's length refused them. Calls count with the messages now, before validation (the
    context: 64 tokens), on each endpoint."""
    from engine import api

    validated: list[int] = []
    real = api.RequestBody.model_validate.__func__  # type: ignore[attr-defined]

    def counting(cls, data, *a, **kw):
        msgs = data.get("messages") if isinstance(data, dict) else None
        validated.append(sum(len(m.get("tool_calls") or ()) for m in msgs if isinstance(m, dict))
                         if isinstance(msgs, list) else 0)  # fmt: skip
        return real(cls, data, *a, **kw)

    monkeypatch.setattr(api.RequestBody, "model_validate", classmethod(counting))
    call = {"function": {"name": "f"}}
    use = {"type": "tool_use", "name": "f"}
    item = {"type": "function_call", "name": "f"}
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [call] * 64}]}),
        ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "assistant", "content": [use] * 64}]}),
        ("/v1/responses", {"input": [item] * 65}),
    ):  # fmt: skip
        validated.clear()
        r = httpx.post(guarded.url + path, json=body, headers=AUTH)
        assert r.status_code == 400, r.text
        assert [v for v in validated if v > 63] == [], path
        assert "65 messages (tool calls included)" in r.json()["error"]["message"], r.text
