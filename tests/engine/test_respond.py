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


def _chunks(tok: Any, text: str, stop: tuple[str, ...] = ()) -> list[Chunk]:
    """``text`` as the engine's chunks: one per token (its text as the engine's TextStream gives
    it, its log-probability made up) until a ``stop`` string ends it, then the finish."""
    ids = tok.encode(text, add_special_tokens=False)
    stream = TextStream(tok, SamplingParams(max_tokens=len(ids) + 1, stop=stop), eos=())
    out = []
    for i, t in enumerate(ids):
        piece, reason = stream.add(t)
        out.append(Chunk(piece, t, logprob=TokenLogprob(t, -0.01 * i, ((t, -0.01 * i),))))
        if reason is not None:
            break
    usage = Usage(prompt_tokens=9, completion_tokens=len(out), cached_tokens=0, cache_tier="none",
                  ttft_seconds=0.1)  # fmt: skip
    return out + [Chunk(stream.tail(), None, "stop", usage, stop_sequence=stream.stopped_by)]


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


#: a stop string over several whole tokens, and one that starts inside a token (the tiny model
#: writes " sunny" as " s", "un", "n", "y": "un" is listed, its "u" shown)
_STOPPED = [(" The end", "It is 42. The end of it.", "It is 42.", "It is 42."),
            ("nny", "Paris is sunny today.", "Paris is su", "Paris is sun")]  # fmt: skip


def _streamed(out: Any, chunks: list[Chunk]) -> list[dict[str, Any]]:
    """The ``logprobs`` objects the streamed chunks carry, in order."""
    return [ch["choices"][0]["logprobs"] for c in chunks for ch in out.feed(c)
            if ch["choices"] and ch["choices"][0].get("logprobs")]  # fmt: skip


@pytest.mark.parametrize("stop, text, shown, listed", _STOPPED, ids=["whole-tokens", "inside-a-token"])
def test_chat_logprobs_end_where_a_stop_string_cuts_the_content(tiny_model_dir, stop, text, shown, listed):
    """A ``stop`` string is not part of the content, yet the tokens that wrote it were listed in
    ``logprobs.content`` (OpenAI's field lists the content's tokens). They are not now; a token
    of which some text is shown (``"un"`` before ``"nny"``) is, as everywhere else; streamed
    chunks carry the same entries."""
    tok = load_tokenizer(tiny_model_dir)
    out = _output(tok, tools=False)
    for c in _chunks(tok, text, (stop,)):
        out.feed(c)
    body = out.body()
    assert body["choices"][0]["message"]["content"] == shown
    entries = body["choices"][0]["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == listed
    sent = [e for lp in _streamed(_output(tok, tools=False), _chunks(tok, text, (stop,))) for e in lp["content"]]
    assert sent == entries


@pytest.mark.parametrize("stop, text, shown, listed", _STOPPED, ids=["whole-tokens", "inside-a-token"])
def test_completion_logprobs_end_where_a_stop_string_cuts_the_text(tiny_model_dir, stop, text, shown, listed):
    """The legacy completions' ``logprobs.tokens`` listed the tokens of the stop string that the
    text leaves out, with ``text_offset``s past its end. They end with the text now (a token of
    which some text is in it, listed); streamed, no entry comes before some of its token's text
    did, and the chunks carry the body's entries and offsets."""
    from engine.api import CompletionRequest

    tok = load_tokenizer(tiny_model_dir)
    req = CompletionRequest.model_validate({"prompt": "Say it.", "logprobs": 1, "stop": [stop]})

    def output() -> respond.CompletionOutput:
        return respond.completion_prompt(tok.encode, req, "m", lambda n, p: None, tok)[1]

    out = output()
    for c in _chunks(tok, text, (stop,)):
        out.feed(c)
    body = out.body()["choices"][0]
    assert body["text"] == shown
    lp = body["logprobs"]
    assert "".join(lp["tokens"]) == listed
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert all(at < len(shown) for at in lp["text_offset"])
    streamed, sent_text = output(), ""
    merged: dict[str, list[Any]] = {k: [] for k in lp}
    for c in _chunks(tok, text, (stop,)):
        for ch in streamed.feed(c):
            if not ch["choices"]:
                continue
            sent_text += ch["choices"][0]["text"]
            got = ch["choices"][0].get("logprobs") or {k: [] for k in lp}
            assert all(at < len(sent_text) for at in got["text_offset"])  # its text came first
            for k in lp:
                merged[k] += got[k]
    assert merged == lp
