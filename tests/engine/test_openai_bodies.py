"""engine/openai_bodies.py: usage, finish reasons, chat bodies, log-probabilities (OpenAI shapes)."""

from __future__ import annotations

from engine import openai_bodies
from engine.generate import Usage
from engine.openai_bodies import Piece, TextOffsets

USAGE = Usage(10, 3, 8, "hot", 0.1)


def test_usage_has_cached_tokens_and_tier():
    u = openai_bodies.usage_dict(USAGE)
    assert (
        u["prompt_tokens_details"]["cached_tokens"] == 8
        and u["cache_tier"] == "hot"
        and u["total_tokens"] == 13
    )


def test_finish_reasons():
    assert openai_bodies.openai_finish("stop", True) == "tool_calls"
    assert openai_bodies.openai_finish("length", True) == "length"
    assert openai_bodies.openai_finish("cancelled", False) == "stop"
    assert openai_bodies.openai_finish(None, False) is None


def test_chat_response_tool_calls_null_content():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = openai_bodies.chat_response("id", "m", "", [call], "tool_calls", USAGE)
    msg = body["choices"][0]["message"]
    assert msg["content"] is None and msg["tool_calls"] == [call]


def test_completion_logprobs_offsets_count_characters_of_the_text():
    """text_offset counts characters of the completion's text: a token holding part of a
    character adds nothing until the character is whole (it was each token text's length, and
    a part's text is ``bytes:\\x..``)."""
    check = "✓".encode()
    pieces = [Piece(" a", b" a"), Piece("bytes:\\xe2\\x9c", check[:2]),
              Piece("bytes:\\x93", check[2:]), Piece("é!", "é!".encode())]  # fmt: skip
    entries = [(p, -0.5, [(p, -0.5)]) for p in pieces]
    offsets = TextOffsets()
    first = openai_bodies.completion_logprobs(entries[:2], offsets)  # streamed: 2 chunks, 1 offsets
    second = openai_bodies.completion_logprobs(entries[2:], offsets)
    assert first["text_offset"] + second["text_offset"] == [0, 2, 2, 3]
    assert first["tokens"] == [" a", "bytes:\\xe2\\x9c"]
    assert openai_bodies.chat_logprobs(entries[1:2])["content"][0]["bytes"] == [0xE2, 0x9C]
