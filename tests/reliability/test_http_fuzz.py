"""Every HTTP endpoint fuzzed over real HTTP (hypothesis): no crash, no 5xx for a client error,
OpenAI-shaped error bodies (Anthropic-shaped on /v1/messages; /v1/responses included); oversize bodies and clients that
trickle their body are bounded."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.server import Server, soak
from tests.serving import clean_env

SETTINGS = settings(
    max_examples=soak(60, 600),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # seeded: CI runs the same cases every time
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", "", 3])
content = (
    st.text(max_size=60)
    | st.none()
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", "x"]), "text": st.text(max_size=20)}
        ),
        max_size=2,
    )
    | json_values
)
message = st.fixed_dictionaries(
    {"role": roles, "content": content},
    optional={"tool_calls": json_values, "tool_call_id": json_values, "name": json_values},
)
# never a huge valid max_tokens: a fuzz case must stay a short generation
small_int: st.SearchStrategy[Any] = st.integers(-3, 8) | st.sampled_from([None, "5", 1.5, [], {}, True])
common = {
    "model": json_values,
    "temperature": st.floats(-1, 3, allow_nan=False, allow_infinity=False) | json_values,
    "top_p": st.floats(-1, 2, allow_nan=False, allow_infinity=False) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | json_values,
    "seed": st.integers(-5, 2**70) | json_values,
    "n": st.integers(-1, 3) | json_values,
    "top_k": small_int | json_values,
    "min_p": st.floats(-1, 2, allow_nan=False, allow_infinity=False) | json_values,
    "xtc_probability": st.floats(-1, 2, allow_nan=False, allow_infinity=False) | json_values,
    "xtc_threshold": st.floats(-1, 1, allow_nan=False, allow_infinity=False) | json_values,
    "repetition_penalty": st.floats(-1, 3, allow_nan=False, allow_infinity=False) | json_values,
    "repetition_context_size": small_int | json_values,
    "presence_penalty": st.floats(-3, 3, allow_nan=False, allow_infinity=False) | json_values,
    "frequency_penalty": st.floats(-3, 3, allow_nan=False, allow_infinity=False) | json_values,
    # token ids in and past the vocabulary, and keys that are no ids
    "logit_bias": st.dictionaries(st.sampled_from(["0", "1", "7", "99999999", "-1", "x", "1e3"]),
                                  st.floats(-200, 200, allow_nan=False) | json_values,
                                  max_size=3) | json_values,  # fmt: skip
}
template_args = st.dictionaries(
    st.sampled_from(["enable_thinking", "reasoning_effort", "tokenize", "messages", "x y", ""]),
    json_values,
    max_size=2,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4) | json_values, "max_tokens": small_int},
    optional={**common, "tools": json_values, "tool_choice": json_values,
              "logprobs": st.booleans() | json_values, "top_logprobs": small_int | json_values,
              "chat_template_kwargs": template_args | json_values,
              "reasoning_effort": st.text(max_size=40) | json_values},  # fmt: skip
)
completion_bodies = st.fixed_dictionaries(
    {"prompt": st.text(max_size=80) | json_values, "max_tokens": small_int},
    optional={**common, "logprobs": small_int | json_values},
)

# Anthropic's Messages API: typed content blocks, tools with input_schema, its tool_choice and thinking
block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image", "x", 3])},
    optional={"text": json_values, "id": json_values, "name": st.sampled_from(["get_weather", ""]) | json_values,
              "input": json_values, "tool_use_id": json_values, "content": json_values,
              "is_error": json_values, "thinking": json_values},
)  # fmt: skip
anthropic_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", 3]),
     "content": st.text(max_size=40) | st.lists(block, max_size=3) | json_values}
)  # fmt: skip
messages_bodies = st.fixed_dictionaries(
    {"messages": st.lists(anthropic_message, max_size=4) | json_values, "max_tokens": small_int},
    optional={"model": json_values, "system": st.text(max_size=20) | st.lists(block, max_size=2) | json_values,
              "tools": st.lists(st.fixed_dictionaries({"name": json_values, "input_schema": json_values}),
                                max_size=2) | json_values,
              "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                                   optional={"name": json_values}) | json_values,
              "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"])})
              | json_values,
              "output_config": json_values, "stop_sequences": json_values, "stream": st.booleans() | json_values,
              "temperature": common["temperature"], "top_k": common["top_k"]},
)  # fmt: skip

# OpenAI's Responses API: typed input items, flat / namespaced / hosted tools
response_item = st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
    optional={"role": roles, "content": content | st.lists(block, max_size=2), "call_id": json_values,
              "name": st.sampled_from(["get_weather", ""]) | json_values, "arguments": json_values,
              "output": json_values, "summary": json_values},
)  # fmt: skip
responses_bodies = st.fixed_dictionaries(
    {"input": st.text(max_size=40) | st.lists(response_item, max_size=4) | json_values,
     "max_output_tokens": small_int},
    optional={"instructions": json_values, "model": json_values, "stream": st.booleans() | json_values,
              "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "namespace", "web_search"]),
                                                       "name": json_values}, optional={"tools": json_values,
                                                                                      "parameters": json_values}),
                                max_size=2) | json_values,
              "tool_choice": st.sampled_from(["auto", "none", "required", "x"]) | json_values,
              "reasoning": json_values, "previous_response_id": json_values,
              "temperature": common["temperature"], "top_p": common["top_p"]},
)  # fmt: skip


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("fuzz")
    env = clean_env(TIERED_KV_DIR=str(d / "kv"), TIERED_KV_MODELS_DIR=str(d / "m"),
                    TIERED_KV_MAX_BODY_BYTES="64KiB", TIERED_KV_BLOCK_TOKENS="16",
                    TIERED_KV_MAX_TOKENS="8")  # fmt: skip  (a case without max_tokens stays short)
    s = Server(tiny_model_dir, env, d / "log", args=("--body-timeout", "2")).start()
    yield s
    s.kill()


def check(r: httpx.Response, server: Server) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500], server.tail(2000))
    if r.status_code >= 400:
        body = r.json()
        if r.request.method == "POST" and r.request.url.path.startswith("/v1/messages") and r.status_code != 401:
            assert body["type"] == "error", body  # Anthropic's shape
        err = body["error"]
        assert isinstance(err["message"], str) and err["type"]
    assert server.proc is not None and server.proc.poll() is None, server.tail()


def post(server: Server, path: str, body: object) -> httpx.Response:
    with httpx.Client(timeout=60) as c:
        if isinstance(body, bytes):
            return c.post(
                server.url + path, content=body, headers={"content-type": "application/json"}
            )
        with c.stream("POST", server.url + path, json=body) as r:
            r.read()  # streams are read to the end: a 200 must finish cleanly too
            return r


@SETTINGS
@given(body=chat_bodies)
def test_fuzz_chat_completions(live, body):
    check(post(live, "/v1/chat/completions", body), live)


@SETTINGS
@given(body=completion_bodies)
def test_fuzz_completions(live, body):
    check(post(live, "/v1/completions", body), live)


@SETTINGS
@given(body=messages_bodies)
def test_fuzz_messages(live, body):
    check(post(live, "/v1/messages", body), live)
    if isinstance(body, dict):
        check(post(live, "/v1/messages/count_tokens", {**body, "stream": False}), live)


@SETTINGS
@given(body=responses_bodies)
def test_fuzz_responses(live, body):
    check(post(live, "/v1/responses", body), live)


@SETTINGS
@given(raw=st.binary(max_size=300) | st.text(max_size=200).map(str.encode))
def test_fuzz_raw_bodies(live, raw):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                 "/v1/messages/count_tokens"):
        check(post(live, path, raw), live)


@SETTINGS
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    path=st.sampled_from(
        ["/v1/models", "/health", "/metrics", "/v1/chat/completions", "/v1/messages", "/v1/x", "/"]
    )
    | st.text(alphabet="abcdefghij/._-%0123456789", max_size=30).map(lambda p: "/" + p),
)
def test_fuzz_methods_and_paths(live, method, path):
    r = httpx.request(method, live.url + path, timeout=30)
    check(r, live)


def test_oversize_body_is_413(live):
    big = {"messages": [{"role": "user", "content": "x" * 70_000}], "max_tokens": 1}
    r = post(live, "/v1/chat/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    check(r, live)


def test_client_trickling_its_body_gets_408_and_does_not_block_others(live):
    host, port = "127.0.0.1", live.port
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 500\r\n\r\n{\"messages\": [")  # fmt: skip
        t0 = time.monotonic()
        ok = httpx.post(
            f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
        )
        assert ok.status_code == 200  # the slow client holds no lock
        s.sendall(b"{")  # still trickling
        reply = _response(s)
        assert " 408 " in reply.splitlines()[0], reply
        assert time.monotonic() - t0 < 15
        assert json.loads(reply.split("\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def _response(sock: socket.socket) -> str:
    """One whole HTTP response (head and body may come in separate segments)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        part = sock.recv(4096)
        if not part:
            break
        data += part
    return data.decode(errors="replace")


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0
