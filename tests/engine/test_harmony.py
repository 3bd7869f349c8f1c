"""engine/harmony.py: gpt-oss's harmony output read as reasoning, content and tool calls — on the tiny
model wearing gpt-oss's real chat template and its harmony tokens (``family_dirs["gpt-oss"]``:
llama.cpp's copy of openai/gpt-oss-120b's template), fed whole and in pieces; and over HTTP, where
a JSON Schema is enforced through the harmony messages."""

from __future__ import annotations

import json

import httpx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine import chat
from engine.generate import Engine
from engine.harmony import HarmonyOutput, header_of
from engine.output import Delta
from tests.engine.parsing import OSLO, PARIS, USER, fmt_and_prompt, in_pieces, named_calls
from tests.serving import TOOLS, hot_config, serve

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
CALL = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"


def _run(
    fmt, pieces: list[str], reason: str = "stop", **kw
) -> tuple[Delta, str | None, HarmonyOutput]:
    out = HarmonyOutput(fmt, TOOLS, **kw)
    got = Delta()
    for p in pieces:
        got.merge(out.feed(p))
    tail, finish = out.finish(reason)
    got.merge(tail)
    return got, finish, out


@pytest.fixture(scope="module")
def fmt(family_dirs):
    return fmt_and_prompt(family_dirs, "gpt-oss")[0]


def test_gpt_oss_is_read_as_harmony(family_dirs, fmt):
    """The vocabulary's harmony tokens pick the format (mlx-lm has no parser for it: its text came
    back whole, markers and reasoning in ``content``); the generation prompt opens a message."""
    _, prompt = fmt_and_prompt(family_dirs, "gpt-oss")
    assert fmt.harmony and fmt.parser_name == "harmony"
    assert prompt.endswith("<|start|>assistant") and not fmt.opens_reasoning(prompt)


@pytest.mark.parametrize(
    "text, reasoning, content, calls, finish",
    [
        (ANALYSIS + "<|channel|>final<|message|>Paris is sunny, 21°C.", "The user wants the weather.",
         "Paris is sunny, 21°C.", [], "stop"),
        (ANALYSIS + CALL + '{"city": "Paris", "days": 3}', "The user wants the weather.", "", [PARIS],
         "tool_calls"),  # the output stops at <|call|>, an end token
        (ANALYSIS + CALL + '{"city": "Paris", "days": 3}<|call|>', "The user wants the weather.", "",
         [PARIS], "tool_calls"),
        # the recipient before the channel, as the template writes a call back
        (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}', "", "", [OSLO],
         "tool_calls"),
        # a preamble to the user, then the call
        ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant" + CALL + '{"city": "Oslo"}',
         "", "Checking.", [OSLO], "tool_calls"),
        ("Paris is sunny.", "", "Paris is sunny.", [], "stop"),  # no header at all: content
        # two analysis messages: one separator between them
        ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two."
         "<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>", "One.\nTwo.", "Done.", [],
         "stop"),
        # a tool the request does not offer (gpt-oss's built-in browser): the text it was
        ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=browser.search"
         ' <|constrain|>json<|message|>{"query": "paris"}', "x",
         '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"query": "paris"}', [], "stop"),
    ],
)  # fmt: skip
def test_harmony_messages_whole_and_streamed(fmt, text, reasoning, content, calls, finish):
    for n in (len(text), 1, 2, 7):  # the markers split over pieces in every way
        got, reason, out = _run(fmt, in_pieces(text, n))
        assert (got.reasoning, got.content, named_calls(got), reason) == (
            reasoning,
            content,
            calls,
            finish,
        ), n
        assert out.result.content == got.content and out.result.reasoning == got.reasoning


def test_a_call_cut_short_is_text_and_length(fmt):
    got, finish, _ = _run(fmt, [ANALYSIS, CALL, '{"city": "Par'], reason="length")
    assert got.tool_calls == [] and finish == "length"
    assert got.content == CALL + '{"city": "Par'


def test_a_call_the_template_wrote_back_reads_as_the_same_call(family_dirs, fmt):
    """A turn's call, rendered back by gpt-oss's template into the next prompt, is read back as
    that call (the template writes the recipient before the channel; the model, after it)."""
    tok = load_tokenizer(family_dirs["gpt-oss"])
    history = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "days": 3}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    text = chat.render_chat(tok, history, TOOLS)
    written = text[text.index("<|start|>assistant to=") + len("<|start|>assistant") :]
    written = written[: written.index("<|call|>")]
    got, finish, _ = _run(fmt, [written])
    assert named_calls(got) == [PARIS] and finish == "tool_calls"


def test_a_call_with_text_and_reasoning_beside_it_renders(family_dirs):
    """A client sends a call back with its reasoning and a preamble's text: gpt-oss's template
    raised ("Cannot pass both content and thinking": a 400 on the next turn); it gets the reasoning
    alone, the analysis the model wrote before the call. Templates that take both get both."""
    tok = load_tokenizer(family_dirs["gpt-oss"])
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    turn = [*USER, {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the weather.",
                    "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    assert not chat.template_takes_text_beside_reasoning(tok)
    text = chat.render_chat(tok, turn, TOOLS)
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>" in text
    qwen = load_tokenizer(family_dirs["qwen3"])
    assert chat.template_takes_text_beside_reasoning(qwen)
    assert "Checking." in chat.render_chat(qwen, turn, TOOLS)


def test_forced_calls_open_the_call_message(fmt):
    named = fmt.forced_prefix({"type": "function", "function": {"name": "get_weather"}})
    got, finish, _ = _run(fmt, [named, '{"city": "Oslo"}'])
    assert named_calls(got) == [OSLO] and finish == "tool_calls"
    got, finish, _ = _run(
        fmt,
        [fmt.forced_prefix("required"), 'get_weather <|constrain|>json<|message|>{"city": "Oslo"}'],
    )
    assert named_calls(got) == [OSLO] and finish == "tool_calls"


def test_a_header_names_its_channel_and_recipient():
    assert header_of("<|channel|>analysis") == ("analysis", "")
    assert header_of("<|channel|>commentary to=functions.f <|constrain|>json") == (
        "commentary",
        "functions.f",
    )
    assert header_of(" to=functions.f<|channel|>commentary json") == ("commentary", "functions.f")
    assert header_of("<|start|>assistant<|channel|>final") == ("final", "")


def test_content_positions_are_the_final_messages_text(fmt):
    """``shown`` (whose tokens' log-probabilities a response lists) holds the final message's
    characters only, never the markers or the analysis."""
    text = ANALYSIS + "<|channel|>final<|message|>Sunny."
    _, _, out = _run(fmt, in_pieces(text, 3))
    at = text.index("Sunny.")
    assert out.shown.meets(at, at + 6) and not out.shown.meets(0, at)


def test_a_json_schema_is_enforced_through_the_harmony_messages(family_dirs, tmp_path):
    """Over HTTP on the tiny random model wearing gpt-oss's template: with a JSON Schema the output
    is an optional analysis message, then the value as the final message (the grammar names the
    harmony markers as the special tokens they are) — read back as that value in ``content``.
    Before, the grammar required the value from the first token (no channel) where gpt-oss writes
    ``<|channel|>`` first."""
    schema = {
        "type": "object",
        "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    }
    config = hot_config(tmp_path)
    live_end = load_tokenizer(family_dirs["gpt-oss"]).convert_tokens_to_ids("<|end|>")
    with serve(lambda: Engine(family_dirs["gpt-oss"], config), config) as live:
        body = {"model": "m", "messages": USER, "max_tokens": 160, "temperature": 0,
                "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}  # fmt: skip
        # the random model would reason to max_tokens: the end of the analysis made likely
        body["logit_bias"] = {str(live_end): 100}
        r = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]
        assert r.json()["choices"][0]["finish_reason"] == "stop", msg
        assert json.loads(msg["message"]["content"])["city"] in ("Paris", "Oslo")
        assert "<|" not in msg["message"]["content"] + (
            msg["message"].get("reasoning_content") or ""
        )


def test_each_api_reads_a_scripted_gpt_oss_turn(family_dirs, tmp_path):
    """The engine (scripted text: the random model writes no call) behind each API on the tiny model
    wearing gpt-oss's template: chat (streamed), Anthropic's Messages and the Responses API give the
    analysis as reasoning and the call as their call; the call and its reasoning sent back render
    into the next prompt as the template writes them."""
    from tests.serving import ScriptedTurns

    turn = [ANALYSIS, CALL, '{"city": "Paris", ', '"days": 3}']
    config = hot_config(tmp_path)
    with serve(
        lambda: ScriptedTurns(Engine(family_dirs["gpt-oss"], config), [turn] * 3), config
    ) as live:
        engine = live.app.state.server.engine
        chunks = live.client.chat.completions.create(
            model="m", messages=USER, tools=TOOLS, stream=True
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [tc for d in deltas for tc in d.tool_calls or ()]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
            ("get_weather", PARIS["arguments"])
        ]
        assert reasoning == "The user wants the weather." and not "".join(
            d.content or "" for d in deltas
        )

        tools = [{"name": "get_weather", "description": "Weather of a city",
                  "input_schema": TOOLS[0]["function"]["parameters"]}]  # fmt: skip
        r = httpx.post(live.url + "/v1/messages", headers={"anthropic-version": "2023-06-01"}, json={
            "model": "m", "max_tokens": 64, "messages": [USER[1]], "tools": tools})  # fmt: skip
        blocks = r.json()["content"]
        assert [b["type"] for b in blocks] == ["thinking", "tool_use"], blocks
        assert blocks[1]["input"] == PARIS["arguments"] and r.json()["stop_reason"] == "tool_use"

        fn = {
            "type": "function",
            "name": "get_weather",
            "parameters": TOOLS[0]["function"]["parameters"],
        }
        r = httpx.post(
            live.url + "/v1/responses", json={"model": "m", "input": "Weather?", "tools": [fn]}
        )
        assert r.status_code == 200, r.text
        items = r.json()["output"]
        assert [i["type"] for i in items] == ["reasoning", "function_call"], items
        assert json.loads(items[1]["arguments"]) == PARIS["arguments"]

        call = {"id": calls[0].id, "type": "function",
                "function": {"name": "get_weather", "arguments": calls[0].function.arguments}}  # fmt: skip
        back = [*USER, {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]  # fmt: skip
        live.client.chat.completions.create(model="m", messages=back, tools=TOOLS)
    assert engine.prompts[-1].endswith(
        "<|start|>assistant<|channel|>analysis<|message|>The user wants the weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "days": 3}'
        '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant"
    )


def test_a_tool_without_a_description_renders(family_dirs):
    """gpt-oss's template writes ``"// " + tool.description`` and raised on a tool without one (a
    400 for a Responses client whose function had none); such a template gets "" for it, the others
    the tools as sent."""
    bare = [
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]},
        }
    ]
    tok = load_tokenizer(family_dirs["gpt-oss"])
    assert not chat.template_takes_bare_tools(tok)
    assert "type get_weather = " in chat.render_chat(tok, USER, bare)
    qwen = load_tokenizer(family_dirs["qwen3"])
    assert chat.template_takes_bare_tools(qwen) and "description" not in chat.render_chat(
        qwen, USER, bare
    )
