"""engine/api.py: request validation → OpenAI-shaped errors; response shapes."""

from __future__ import annotations

import json

import pytest

from engine import api
from engine.api import ApiError, ChatRequest, CompletionRequest
from engine.generate import Usage

USAGE = Usage(10, 3, 8, "hot", 0.1, 0.1, 0.1, 0.0)


def parse(body: object, model=ChatRequest):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return api.parse_body(raw, model)


def error_of(body: object, model=ChatRequest) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, model)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


def test_minimal_chat_request():
    req = parse({"model": "x", "messages": [{"role": "user", "content": "hi"}]})
    assert req.stream is False and req.requested_max() is None and req.stop_tuple() == ()


def test_opencode_style_request_accepted():
    req = parse(
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ],
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
            "tool_choice": "auto",
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_completion_tokens": 32,
            "providerOptions": {"ignored": True},
        }
    )
    assert (
        req.include_usage
        and req.requested_max() == 32
        and req.tool_dicts()[0]["function"]["name"] == "f"
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, "max_tokens"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
            "tool_choice",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ],
)
def test_bad_chat_requests(body, param):
    assert error_of(body).param == param


def test_malformed_json_and_non_object():
    assert error_of(b"{nope").code == "invalid_json"
    assert error_of(b"[1, 2]").code == "invalid_json"
    assert error_of(b"\xff\xfe").code == "invalid_json"


def test_completion_prompt_forms():
    assert parse({"prompt": "abc"}, CompletionRequest).prompt_text() == "abc"
    assert parse({"prompt": ["abc"]}, CompletionRequest).prompt_text() == "abc"
    assert error_of({"prompt": ["a", "b"]}, CompletionRequest).param == "prompt"
    assert error_of({"prompt": 3}, CompletionRequest).param == "prompt"


def test_check_length():
    assert (
        api.check_length(10, None, 100) == api.DEFAULT_MAX_TOKENS
        if api.DEFAULT_MAX_TOKENS < 90
        else 90
    )
    assert api.check_length(10, 5, 100) == 5
    assert api.check_length(90, 50, 100) == 10
    with pytest.raises(ApiError) as e:
        api.check_length(100, None, 100)
    assert e.value.code == "context_length_exceeded" and e.value.status == 400


def test_error_body_shape():
    body = ApiError(400, "bad", "messages", "invalid_value").body()
    assert body == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "invalid_value",
        }
    }


def test_usage_has_cached_tokens_and_tier():
    u = api.usage_dict(USAGE)
    assert (
        u["prompt_tokens_details"]["cached_tokens"] == 8
        and u["cache_tier"] == "hot"
        and u["total_tokens"] == 13
    )


def test_finish_reasons():
    assert api.openai_finish("stop", True) == "tool_calls"
    assert api.openai_finish("length", True) == "length"
    assert api.openai_finish("cancelled", False) == "stop"
    assert api.openai_finish(None, False) is None


def test_chat_response_tool_calls_null_content():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = api.chat_response("id", "m", "", [call], "tool_calls", USAGE)
    msg = body["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"] == [call]
