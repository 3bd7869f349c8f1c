"""engine/respond.py: what the chat route's log-probabilities list, with a real tokenizer and output parser.

The requests' HTTP path goes through test_server.py's routes; here the model's text is given, as the
engine emits it (real token ids, each turned into text by the engine's own ``TextStream``), because the
random tiny model never writes a think block or a call. The tokenizer is the tiny model's wearing a
family's template and marker tokens (``family_dirs``), as in test_output.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine import respond
from engine.api import ChatRequest
from engine.events import Chunk, SamplingParams, TokenLogprob, Usage
from engine.textout import TextStream
from tests.serving import TOOLS

KIMI = "<|tool_call_begin|>functions.%s:%d<|tool_call_argument_begin|>%s<|tool_call_end|>"


def _chunks(tok: Any, text: str) -> list[Chunk]:
    """``text`` as the engine's chunks: one per token (its text as the engine's TextStream gives
    it, its log-probability made up), then the finish."""
    ids = tok.encode(text, add_special_tokens=False)
    stream = TextStream(tok, SamplingParams(max_tokens=len(ids) + 1), eos=())
    out = [Chunk(stream.add(t)[0], t, logprob=TokenLogprob(t, -0.01 * i, ((t, -0.01 * i),)))
           for i, t in enumerate(ids)]  # fmt: skip
    usage = Usage(prompt_tokens=9, completion_tokens=len(ids), cached_tokens=0, cache_tier="none",
                  ttft_seconds=0.1)  # fmt: skip
    return out + [Chunk(stream.tail(), None, "stop", usage)]


def _output(tok: Any, tools: bool) -> respond.ChatOutput:
    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "Weather?"}], "logprobs": True,
                                      "top_logprobs": 1, **({"tools": TOOLS} if tools else {})})  # fmt: skip
    return respond.chat_prompt(tok, tok.encode, req, "m", lambda n, p: None)[1]


@pytest.mark.parametrize(
    "family, text, content",
    [("qwen3", "<think>\nPlan.\n</think>\n\nParis is sunny.", "Paris is sunny."),
     ("qwen3", "<think>a</think><think>b</think>It is 42.", "It is 42."),
     ("qwen3", "The answer is <think>Check.</think> 42.\n\nSure.", "The answer is 42.\n\nSure."),
     ("qwen3", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
      "Let me look."),
     ("qwen3", "<tool_call>I will look it up</tool_call>", "<tool_call>I will look it up</tool_call>"),
     ("kimi-k2", "Checking.<|tool_calls_section_begin|>" + KIMI % ("get_weather", 0, '{"city": "Oslo"}')
      + KIMI % ("rm_rf", 1, "{}") + "<|tool_calls_section_end|>", "Checking." + KIMI % ("rm_rf", 1, "{}")),
     ("qwen3", "Plain text,\n\nno markers.", "Plain text,\n\nno markers.")],
    ids=["reasoning", "think-blocks-back-to-back", "think-block-mid-answer", "call", "block-shown-as-text",
         "kimi-section-with-a-bad-call", "plain"],
)  # fmt: skip
def test_chat_logprobs_list_the_tokens_of_the_content(family_dirs, family, text, content):
    """``logprobs.content`` listed every generated token: the reasoning, the think markers and the
    call markup too, so its tokens did not make ``message.content`` (OpenAI's field lists the
    message content's tokens; a client scoring or showing the answer read the thoughts). It now
    lists the tokens of which some text is shown as content, and their bytes make the content;
    streamed, the chunks carry the same entries."""
    tok = load_tokenizer(family_dirs[family])
    out = _output(tok, tools=True)
    for c in _chunks(tok, text):
        out.feed(c)
    body = out.body()
    assert body["choices"][0]["message"]["content"] == content
    entries = body["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == content
    assert all(e["top_logprobs"][0]["logprob"] == e["logprob"] for e in entries)
    streamed = _output(tok, tools=True)
    sent = [e for c in _chunks(tok, text) for ch in streamed.feed(c)
            if ch["choices"] and ch["choices"][0]["logprobs"] for e in ch["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert sent == entries


def test_logprobs_of_reasoning_alone_list_nothing(family_dirs):
    """An output cut while thinking has no content: no token of it is listed."""
    tok = load_tokenizer(family_dirs["qwen3"])
    out = _output(tok, tools=False)
    for c in _chunks(tok, "<think>\nStill thinking about"):
        out.feed(c)
    body = out.body()
    assert body["choices"][0]["message"]["reasoning_content"] == "Still thinking about"
    assert body["choices"][0]["logprobs"]["content"] == []


#: a template that writes tools and reads each call's arguments as a mapping (as Qwen3-Coder's does)
_MAPPING_ARGS = ("{% if tools %}{{ tools[0].function.name }}{% endif %}{% for m in messages %}"
                 "{{ m.content }}{% for c in m.tool_calls or [] %}{{ c.function.arguments | dictsort }}"
                 "{% endfor %}{% endfor %}")  # fmt: skip


def test_only_a_failure_inside_the_template_is_the_requests_400(tiny_model_dir):
    """A template failing on the request's data (arguments that are no JSON object, read as a
    mapping) is the request's mistake: a 400. A failure around the template was one too — a model
    with no chat template answered every chat request with a 400 blaming its messages (or its
    template arguments). It is the server's: a 500 at the HTTP edge."""
    from engine.errors import ApiError

    tok = load_tokenizer(tiny_model_dir)
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[1, 2]"}}
    turns = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c", "content": "sunny"}]  # fmt: skip

    def prompt(template: str | None, **extra: Any) -> Any:
        tok._tokenizer.chat_template = template
        req = ChatRequest.model_validate({"messages": turns, "tools": TOOLS, **extra})
        return respond.chat_prompt(tok, tok.encode, req, "m", lambda n, p: None)

    with pytest.raises(ApiError) as refused:
        prompt(_MAPPING_ARGS)
    assert refused.value.status == 400 and refused.value.param == "messages"
    for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        with pytest.raises(ValueError, match="chat_template is not set"):
            prompt(None, **extra)
