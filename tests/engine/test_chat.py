# mypy: disable-error-code="arg-type,union-attr,operator,index,dict-item"
# (the openai client types messages/tools as TypedDicts and usage as Optional; tests pass plain dicts)
"""engine/chat.py: OpenCode message normalisation, template rendering (+ Hermes injection), tool-call parsing,
and prefix stability of the rendered prompt across turns."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from engine import chat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


class PlainChatML:
    """A tokenizer stand-in whose template ignores tools, like SmolLM2's (plain ChatML)."""

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, messages, tools=None, **kw):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if kw.get("add_generation_prompt") else "")


def ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


# --- normalisation ------------------------------------------------------------------------------


def test_content_parts_become_text():
    assert (
        chat.content_text(
            [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
        )
        == "ab"
    )
    assert chat.content_text(None) == ""


def test_opencode_messages_normalised():
    msgs = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
    ]
    out = chat.normalise_messages(msgs)
    assert out[0] == {"role": "system", "content": "be brief"}
    assert out[2]["content"] == "" and out[2]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }
    assert out[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


# --- rendering ----------------------------------------------------------------------------------


def test_tiny_template_renders_tools_natively(tiny_tok):
    assert chat.template_supports_tools(tiny_tok)
    text = chat.render_chat(tiny_tok, [{"role": "user", "content": "hi"}], TOOLS)
    assert "get_weather" in text and text.endswith("<|im_start|>assistant\n")


def test_plain_template_gets_hermes_tools_injected(tiny_tok):
    plain = PlainChatML(tiny_tok)
    assert not chat.template_supports_tools(plain)
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
        {"role": "tool", "tool_call_id": "d", "content": "windy"},
    ]
    text = chat.render_chat(plain, msgs, TOOLS)
    assert text.startswith("<|im_start|>system\nsys\n\n# Tools") and '"name": "get_weather"' in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
        in text
    )
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nwindy\n</tool_response><|im_end|>"
        in text
    )


def test_forced_prefix():
    assert chat.forced_prefix("auto") == "" and chat.forced_prefix("required") == "<tool_call>\n"
    named = chat.forced_prefix({"type": "function", "function": {"name": "get_weather"}})
    assert named.endswith('"name": "get_weather", "arguments": ')


# --- parsing ------------------------------------------------------------------------------------


def test_parse_single_call_with_text():
    content, calls = chat.split_tool_calls(
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert content == "Let me check."
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_parse_parallel_calls():
    one = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    two = '<tool_call>\n{"name": "b", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    content, calls = chat.split_tool_calls(one + "\n" + two + "\n")
    assert content == "" and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": 1}


def test_invalid_block_stays_text():
    text = "<tool_call>\nnot json\n</tool_call> done"
    assert chat.split_tool_calls(text) == (text, [])


def test_streaming_holds_text_from_opener():
    p = chat.ToolCallParser()
    pieces = [
        "Sure",
        " <tool",
        '_call>\n{"name": ',
        '"a", "arguments": {}}',
        "\n</tool_",
        "call>",
        " bye",
    ]
    shown, calls = [], []
    for piece in pieces:
        s, c = p.feed(piece)
        shown.append(s)
        calls += c
    tail, more = p.finish()
    assert "".join(shown) + tail == "Sure bye"
    assert shown[1] == "" and shown[2] == "" and len(calls + more) == 1


def test_unclosed_complete_json_is_a_call():
    p = chat.ToolCallParser()
    p.feed('<tool_call>\n{"name": "get_weather", "arguments": ')
    p.feed('{"city": "Oslo"}}')
    assert p.finish()[1][0]["function"]["name"] == "get_weather"


def test_disabled_parser_passes_text():
    p = chat.ToolCallParser(enabled=False)
    assert p.feed("<tool_call>{}</tool_call>") == ("<tool_call>{}</tool_call>", [])


# --- prefix stability ---------------------------------------------------------------------------


def _turn_prefix(tok, msgs, reply_text, reply_msg, tools=None):
    """ids(turn n) + ids(reply as generated) must prefix ids(turn n+1)."""
    first = ids(tok, chat.render_chat(tok, msgs, tools))
    generated = ids(tok, reply_text)
    nxt = msgs + [reply_msg, {"role": "user", "content": "and then?"}]
    second = ids(tok, chat.render_chat(tok, nxt, tools))
    return first + generated, second


def test_prefix_stable_plain_turn(tiny_tok):
    reply = "Paris is sunny today."
    msgs = [{"role": "user", "content": "weather in paris?"}]
    expect, second = _turn_prefix(tiny_tok, msgs, reply, {"role": "assistant", "content": reply})
    assert second[: len(expect)] == expect


def test_prefix_stable_tool_call_turn(tiny_tok):
    """The model emits Hermes text; the client resends it as tool_calls with empty content."""
    emitted = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _, calls = chat.split_tool_calls(emitted)
    msg = {"role": "assistant", "content": "", "tool_calls": calls}
    msgs = [{"role": "user", "content": "weather in paris?"}]
    expect, second = _turn_prefix(tiny_tok, msgs, emitted, msg, TOOLS)
    assert second[: len(expect)] == expect


@pytest.mark.slow
@pytest.mark.smollm2
def test_prefix_stable_smollm2(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    reply = "Paris is sunny today."
    msgs = [{"role": "user", "content": "weather in paris?"}]
    expect, second = _turn_prefix(tok, msgs, reply, {"role": "assistant", "content": reply})
    assert second[: len(expect)] == expect
    emitted = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    _, calls = chat.split_tool_calls(emitted)
    msg = {"role": "assistant", "content": "", "tool_calls": calls}
    expect, second = _turn_prefix(tok, msgs, emitted, msg, TOOLS)
    assert second[: len(expect)] == expect
