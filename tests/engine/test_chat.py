# mypy: disable-error-code="arg-type,union-attr,operator,index,dict-item"
# (the openai client types messages/tools as TypedDicts and usage as Optional; tests pass plain dicts)
"""engine/chat.py: OpenCode message normalisation, template rendering (+ Hermes injection), and prefix stability of the rendered prompt across turns."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from engine import chat
from engine.output import ChatOutput, OutputFormat
from tests.serving import TOOLS


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
    assert chat.content_text([{"type": "refusal", "refusal": "no"}]) == "no"


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


# --- prefix stability ---------------------------------------------------------------------------


def _split(text):
    """Hermes model text → (content, OpenAI tool calls), as the server answers it."""
    out = ChatOutput(OutputFormat(), TOOLS)
    out.feed(text)
    out.finish("stop")
    calls = [{k: v for k, v in c.items() if k != "index"} for c in out.result.tool_calls]
    return out.result.content, calls


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
    _, calls = _split(emitted)
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
    _, calls = _split(emitted)
    msg = {"role": "assistant", "content": "", "tool_calls": calls}
    expect, second = _turn_prefix(tok, msgs, emitted, msg, TOOLS)
    assert second[: len(expect)] == expect


# --- template arguments ---------------------------------------------------------------------------


def test_template_arguments_reach_the_template(family_dirs):
    """Qwen3's template closes an empty think block when ``enable_thinking`` is false (what clients
    send as ``chat_template_kwargs`` to turn reasoning off); it was never passed before."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(family_dirs["qwen3"])
    msgs = [{"role": "user", "content": "hi"}]
    on = chat.render_chat(tok, msgs)
    off = chat.render_chat(tok, msgs, None, {"enable_thinking": False})
    assert off == on + "<think>\n\n</think>\n\n"
    fmt = OutputFormat.of(tok)
    assert not fmt.opens_reasoning(off)


@pytest.mark.parametrize("args", [[1], {"messages": []}, {"add_generation_prompt": False},
                                  {"tokenize": True}, {"not an identifier": 1}, {"tools": []},
                                  {"sanitize_control_tokens": True}])  # fmt: skip
def test_template_arguments_never_replace_the_templates_own(args):
    with pytest.raises(ValueError):
        chat.template_args(args)
    assert chat.template_args({"enable_thinking": False}) == {"enable_thinking": False}


def test_template_arguments_are_a_handful_not_a_million():
    """A body whose ``chat_template_kwargs`` held 1M names took 4 s of rendering and got a 200."""
    many = {f"a{i}": i for i in range(chat.MAX_TEMPLATE_ARGS + 1)}
    with pytest.raises(ValueError, match="at most"):
        chat.template_args(many)
    many.popitem()
    assert chat.template_args(many) == many


def test_every_parameter_of_apply_chat_template_is_reserved():
    """transformers 5 added ``sanitize_control_tokens``: as a request's template argument it
    reached ``apply_chat_template`` itself, which refused it (a ValueError around the template)."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    own = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    assert set(own) - {"self", "kwargs"} <= chat.RESERVED_TEMPLATE_ARGS


# --- system turns mid-conversation ----------------------------------------------------------------

#: Claude Code's second turn (2.1.332): its environment as a system turn after the first user turn
CLAUDE_CODE_TURN_2 = [
    {"role": "system", "content": "You are Claude Code."},
    {"role": "user", "content": "list the files"},
    {"role": "system", "content": "# Environment\n - Platform: linux"},
    {"role": "assistant", "content": "There are two."},
    {"role": "user", "content": "and their sizes?"},
]


def test_a_midway_system_turn_joins_the_user_turn_beside_it():
    s, u, a = "system", "user", "assistant"

    def msgs(*roles: str) -> list[dict]:
        return [{"role": r, "content": f"{r}{i}"} for i, r in enumerate(roles)]

    assert chat.fold_midway_system(msgs(s, u, s, a)) == [
        {"role": s, "content": "system0"}, {"role": u, "content": "user1\n\nsystem2"},
        {"role": a, "content": "assistant3"},
    ]  # fmt: skip
    assert chat.fold_midway_system(msgs(s, a, s, u)) == [
        {"role": s, "content": "system0"}, {"role": a, "content": "assistant1"},
        {"role": u, "content": "system2\n\nuser3"},
    ]  # fmt: skip
    assert chat.fold_midway_system(msgs(s, a, s, a)) == msgs(s, a, s, a)  # no user beside it
    assert chat.fold_midway_system(msgs(s, s, u)) == [
        {"role": s, "content": "system0"}, {"role": u, "content": "system1\n\nuser2"},
    ]  # fmt: skip


def test_claude_codes_environment_turn_renders_in_every_family(family_dirs):
    """Mistral Small 3.2's template raised on Claude Code's second turn (roles must alternate: a
    400 on every turn after the first) and MiniMax-M2's dropped the environment. Those two now get
    it joined to the first user turn; the templates that render it where it is are unchanged, and
    each turn's prompt starts with the one before it (the cache's prefix)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    folded = set()
    for family, path in family_dirs.items():
        tok = load_tokenizer(path)
        text = chat.render_chat(tok, CLAUDE_CODE_TURN_2)
        assert "Platform: linux" in text, family
        turn_1 = chat.render_chat(tok, CLAUDE_CODE_TURN_2[:3])
        head = turn_1[: turn_1.rindex("list the files")]
        # (Mistral Nemo's template writes the system prompt into the last user turn: a new user turn moves it)
        assert text.startswith(head) != (family == "mistral-nemo"), family
        if not chat.template_keeps_midway_system(tok):
            folded.add(family)
        else:
            assert text == chat._apply(tok, chat.normalise_messages(CLAUDE_CODE_TURN_2), None)
    # gpt-oss's drops it too, as Apertus's, Nemotron Nano v2's and MiniMax-M3's; Gemma 2 takes no system
    # turn at all; Mistral Nemo's raises on one (roles must alternate), as Mistral Small 3.2's
    assert folded == {"mistral-small-3.2", "minimax-m2", "gpt-oss", "gemma-2", "apertus", "nemotron-nano-v2",
                      "minimax-m3", "mistral-nemo"}  # fmt: skip


def test_a_system_prompt_stays_after_the_calls_of_its_turn(family_dirs):
    """Mistral Nemo's template writes the system prompt into the last message only where that is a
    user's: an agent's every turn after a call lost its system prompt (and its prompt parted from
    the turn before's at the first user turn: the cache served none of it). The system turn now
    goes where that template writes it, into the last user turn, and stays there after the turn's
    calls; a conversation ending with a user turn renders as the template renders it. Every other
    family's template keeps the system turn itself."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(family_dirs["mistral-nemo"])
    assert not chat.template_keeps_system_after_calls(tok)
    call = {"id": "abcDEF120", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn_1 = [{"role": "system", "content": "You are opencode."}, {"role": "user", "content": "Weather?"}]
    turn_2 = [*turn_1, {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "abcDEF120", "content": "sunny"}]  # fmt: skip
    first, second = chat.render_chat(tok, turn_1, TOOLS), chat.render_chat(tok, turn_2, TOOLS)
    assert "You are opencode." in second and second.startswith(first)
    assert first == chat._apply(tok, chat.normalise_messages(turn_1), TOOLS)
    assert "You are opencode." not in chat._apply(tok, chat.normalise_messages(turn_2), TOOLS)  # (the template's own)
    for family, path in family_dirs.items():
        if family != "mistral-nemo":
            assert chat.template_keeps_system_after_calls(load_tokenizer(path)), family


@pytest.mark.parametrize("family", ["llama-3.3", "gpt-oss", "gigachat-3.1"])
def test_an_assistant_turn_of_several_calls_renders_each_call_with_its_result(family_dirs, family):
    """Llama 3.x's template raises on an assistant turn of two calls ("This model only supports single
    tool-calls at once!": a 400 on every later turn of such a conversation); gpt-oss's and GigaChat
    3.1's rendered the first call alone, both results after it (gpt-oss's named both by the first
    call's function). Such a turn now goes to them as one turn per call, each followed by its
    result, as harmony writes calls; every other family's template renders both calls itself."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}} for n in ("get_weather", "get_time")]  # fmt: skip
    calls = [{"id": f"abcDEF12{i}", "type": "function", "function": {"name": n, "arguments": '{"city": "Oslo"}'}}
             for i, n in enumerate(("get_weather", "get_time"))]  # fmt: skip
    msgs = [{"role": "user", "content": "Weather and time?"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "abcDEF120", "content": "sunny"},
            {"role": "tool", "tool_call_id": "abcDEF121", "content": "noon"}]  # fmt: skip
    tok = load_tokenizer(family_dirs[family])
    assert not chat.template_renders_calls_after_first(tok)
    text = chat.render_chat(tok, msgs, tools)
    turn = text[text.index("Weather and time?") :]
    at = [turn.index(t) for t in ("get_weather", "sunny", "get_time", "noon")]
    assert at == sorted(at), (family, turn)
    assert chat.one_call_a_turn(msgs)[1:] == [
        {**msgs[1], "tool_calls": calls[:1]}, msgs[2], {"role": "assistant", "content": "", "tool_calls": calls[1:]}, msgs[3],
    ]  # fmt: skip
    for other, path in family_dirs.items():
        t = load_tokenizer(path)
        if other not in ("llama-3.3", "gpt-oss", "gigachat-3.1") and chat.template_supports_tools(t) and not chat.call_writer(t):
            assert chat.template_renders_calls_after_first(t), other


def test_only_llamas_template_writes_calls_as_bare_json(family_dirs):
    """The probe behind Llama 3.x's output format (engine/output_format.py): of the 30 families,
    only Llama 3.3's template writes an assistant's call back as ``{"name": …, "parameters": …}``
    alone."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    bare = {f for f, path in family_dirs.items() if chat.template_writes_json_calls(load_tokenizer(path))}
    assert bare == {"llama-3.3"}


def test_call_blocks_found_by_rendering_a_call(family_dirs):
    """The probe behind the formats of templates mlx-lm has no parser for (engine/output_format.py):
    the tags around the call that a call adds, the end "" where it is the turn's own end (GigaChat
    3.1's); the call as JSON, or as Qwen3-Coder's XML (Seed-OSS's). None where the JSON follows a
    role's header (Llama's: its own format) or the call is neither (the other tag formats). A JSON
    call's spelling, up to its arguments and after them, and from one call's to the next's (the
    forced calls' grammar, :class:`chat.CallJson`)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    Block, Json, fn = chat.CallBlock, chat.CallJson, chat.NAME_SLOT
    found = {f: chat.template_call_block(load_tokenizer(path)) for f, path in family_dirs.items()}
    named = f'{{"name": "{fn}", "arguments": '
    cohere = Json(f'[\n    {{"tool_call_id": "0", "tool_name": "{fn}", "parameters": ', "}\n]")  # (its calls numbered)
    assert {f: b for f, b in found.items() if b} == {
        "qwen3": Block("<tool_call>", "</tool_call>", "json", Json("\n" + named, "}\n", "}\n</tool_call>\n<tool_call>\n" + named)),
        "qwen3-coder": Block("<tool_call>", "</tool_call>", "function"),
        "nemotron-nano-v2": Block("<TOOLCALL>", "</TOOLCALL>", "json", Json("[" + named, "}]", "}, " + named)),
        "command-r7b": Block("<|START_ACTION|>", "<|END_ACTION|>", "json", cohere),
        "cohere2-moe": Block("<|START_ACTION|>", "<|END_ACTION|>", "json", cohere),
        "apertus": Block("<|tools_prefix|>", "<|tools_suffix|>", "json", Json(f'[{{"{fn}": ', "}]", f'}}, {{"{fn}": ')),
        "apriel-1.6": Block("<tool_calls>", "</tool_calls>", "json"),  # (its JSON holds each call's id: free)
        "gigachat-3.1": Block("<|function_call|>", "", "json", Json(named, "}")),  # (one call: it renders no second)
        "seed-oss": Block("<seed:tool_call>", "</seed:tool_call>", "function"),
    }


def test_tools_described_for_a_template_that_needs_it():
    """A template that loops over a tool's ``parameters.properties`` (Seed-OSS's, Apertus's) or writes
    its description (gpt-oss's) gets them: ``{}`` / "" where the tool had none, the same schema
    (other keys kept); a tool that has both is unchanged."""
    bare = {"type": "function", "function": {"name": "now", "parameters": {"additionalProperties": False}}}
    none = {"type": "function", "function": {"name": "now"}}
    got = chat.described([bare, none, TOOLS[0]])
    assert got[0]["function"] == {"name": "now", "description": "", "parameters": {
        "type": "object", "additionalProperties": False, "properties": {}}}  # fmt: skip
    assert got[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert got[2] == TOOLS[0]


def test_deepseek_v31_is_told_its_own_call_format(family_dirs):
    """DeepSeek V3.1's template renders no tools but writes calls and results back in its own
    markup: the server had told it Hermes calls (and rewrote its history so), a format its model
    was not taught. Now the tools are in the system turn as its model card writes them, and the
    history is the template's own."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(family_dirs["deepseek-v3.1"])
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    text = chat.render_chat(tok, msgs, TOOLS)
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\nYou have access to the following tools:\n")
    assert '\n### get_weather\nDescription: Weather of a city\n\nParameters: {"type": "object"' in text
    assert "<｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}" in text
    assert '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>' in text
    assert text.endswith("<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>") and "<tool_call>" not in text
    assert chat.template_writes_deepseek_calls(tok)
    others = {f for f, path in family_dirs.items() if chat.template_writes_deepseek_calls(load_tokenizer(path))}
    assert others == {"deepseek-v3.1"}  # the R1 distills' older markup is not it


def test_calls_go_back_into_the_content_where_the_template_writes_none(family_dirs):
    """Granite 3.3's and LFM2-8B-A1B's templates render each message's content alone (the calls of an
    assistant's turn vanished from the next prompt): its calls go into its content as its model
    writes them — Granite's opener and JSON list, LFM2's Python calls between its markers. No other
    family's template drops them."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    toks = {f: load_tokenizer(path) for f, path in family_dirs.items()}
    writers = {f: w for f, tok in toks.items() if (w := chat.call_writer(tok)) is not None}
    assert set(writers) == {"granite-3.3", "lfm2-8b"}
    # (Gemma 2's takes no tools: the server writes its calls as Hermes text, chat.hermes_messages)
    assert {f for f, tok in toks.items() if not chat.template_writes_calls(tok)} == {"granite-3.3", "lfm2-8b", "gemma-2"}
    calls = [{"name": "f", "arguments": {"a": "é", "n": [1, True]}}, {"name": "g", "arguments": {}}]
    assert writers["granite-3.3"](calls) == '<|tool_call|>[{"name": "f", "arguments": {"a": "é", "n": [1, true]}}, {"name": "g", "arguments": {}}]'
    assert writers["lfm2-8b"](calls) == '<|tool_call_start|>[f(a="é", n=[1, true]), g()]<|tool_call_end|>'
    call = {"id": "c", "type": "function", "function": {"name": "g", "arguments": {}}}
    msgs = [{"role": "assistant", "content": "On it.", "tool_calls": [call]}, {"role": "user", "content": "x"}]
    assert chat.calls_as_text(msgs, writers["granite-3.3"]) == [
        {"role": "assistant", "content": 'On it.<|tool_call|>[{"name": "g", "arguments": {}}]'},
        {"role": "user", "content": "x"},
    ]


def test_a_call_after_a_role_header_is_no_block():
    """A template that writes the call's JSON where a text turn's text goes (after the role's
    header, as Llama 3.x and GigaChat 3 do) has no call block of its own: the header opens every turn."""

    class Tok:
        def apply_chat_template(self, messages, tools=None, **kw):
            out = ""
            for m in messages:
                body = json.dumps(m["tool_calls"][0]["function"]) if m.get("tool_calls") else m["content"]
                out += f"<|role|>{m['role']}<|sep|>{body}<|end|>"
            return out

    assert chat.template_call_block(Tok()) is None


def test_continue_final_leaves_the_assistants_message_open(tiny_tok):
    """vLLM's ``continue_final_message`` (and Anthropic's prefill): the prompt ends inside the last
    message, the assistant's; asked of a conversation that ends with the user's, a 400."""
    from engine import respond
    from engine.api import ChatRequest
    from engine.errors import ApiError

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    assert chat.render_chat(tiny_tok, msgs, continue_final=True).endswith("The answer is")
    assert not chat.render_chat(tiny_tok, msgs).endswith("The answer is")
    req = ChatRequest.model_validate({"messages": msgs[:1], "continue_final_message": True})
    with pytest.raises(ApiError) as e:
        respond.chat_prompt(tiny_tok, tiny_tok.encode, req, "m", lambda n, p: None)
    assert e.value.param == "continue_final_message"


# a conversation another API began: its tool-call ids are Anthropic's / OpenAI's, not 9 alphanumerics
FOREIGN_IDS = [
    {"role": "user", "content": "weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "toolu_01A09q90qw90lq917835lq9", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_abc123", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
    ]},
    {"role": "tool", "tool_call_id": "toolu_01A09q90qw90lq917835lq9", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_abc123", "content": "rain"},
    {"role": "assistant", "content": "Paris is sunny, Oslo rainy."},
    {"role": "user", "content": "thanks"},
]  # fmt: skip


def test_ids_a_template_refuses_are_rendered_as_nine_alphanumerics(family_dirs):
    """Mistral Small 3.2's template raises on any tool-call id that is not 9 alphanumerics ("Tool call IDs
    should be alphanumeric strings with length 9!"): a conversation begun on another API (Claude's
    ``toolu_…`` ids, OpenAI's ``call_…``) was a 400 on every turn. Such templates get each id as 9
    alphanumerics derived from it (the same id always the same, so a call and its result still
    pair, and a turn renders its history as the turn before did); ids that are 9 alphanumerics
    already, and every other family's ids, are rendered as sent."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(family_dirs["mistral-small-3.2"])
    assert chat.template_wants_short_call_ids(tok)
    text = chat.render_chat(tok, FOREIGN_IDS, TOOLS)
    paris, oslo = chat.short_call_id(FOREIGN_IDS[1]["tool_calls"][0]["id"]), chat.short_call_id("call_abc123")
    assert len({paris, oslo}) == 2 and all(len(i) == 9 and i.isalnum() for i in (paris, oslo))
    assert text.count(paris) == 2 and text.count(oslo) == 2 and "toolu_" not in text  # call + result
    assert paris in chat.render_chat(tok, FOREIGN_IDS[:4], TOOLS)  # the next turn's: the same ids
    assert chat.short_call_id("a1B2c3D4e") == "a1B2c3D4e"
    for family, path in family_dirs.items():
        if family not in ("mistral-small-3.2", "mistral-nemo"):  # (Nemo's refuses them too)
            t = load_tokenizer(path)
            assert not chat.template_wants_short_call_ids(t), family


# --- templates that change a list in place --------------------------------------------------------

#: an assistant's two calls and their results (Kimi-K2-Thinking queues the calls' ids and pops one
#: per result)
TWO_CALLS = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "functions.get_weather:1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"},
    {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "rain"},
]  # fmt: skip


def _mutable_render(template: str, tok, **variables) -> str:
    """``template`` rendered in jinja's plain sandbox, which lets a template change its own lists
    (transformers' filters, tokens and options otherwise): what the template's authors ran."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import SandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    own = _compile_jinja_template(template).environment
    env.filters.update(own.filters)
    env.globals.update(own.globals)
    return env.from_string(template).render(**tok.special_tokens_map, **variables)


def test_kimi_k2_thinkings_call_history_renders(family_dirs):
    """Kimi-K2-Thinking's template queues its call ids in a namespace's list (``append``, then
    ``pop(0)`` per result), which transformers' immutable sandbox refuses: every request whose
    history held a call was a 400 ("access to attribute 'append' of 'list' object is unsafe"; so in
    mlx_lm.server). Rendered now as the template's own code does in a sandbox that allows it, each
    result under its call's id."""
    from jinja2.exceptions import SecurityError
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(family_dirs["kimi-k2-thinking"])
    with pytest.raises(SecurityError):  # what transformers does with the template as it is
        tok.apply_chat_template(TWO_CALLS, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    text = chat.render_chat(tok, TWO_CALLS, TOOLS)
    msgs = chat.normalise_messages(TWO_CALLS)
    assert text == _mutable_render(tok.chat_template, tok, messages=msgs, tools=TOOLS, add_generation_prompt=True)
    assert "## Return of functions.get_weather:0\nsunny" in text
    assert "## Return of functions.get_weather:1\nrain" in text


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(q=[]) %}{% for m in messages %}{%- set _ = ns.q.append(m.content) -%}{% endfor %}"
    "{% for m in messages %}{% set x = ns.q.pop(0) %}[{{ x }}|{{ ns.q | length }}]{% endfor %}",
    "{% set ns = namespace(q=[]) %}{% for m in messages %}{% set _ = ns.q.append(m.content ~ '!') %}{% endfor %}"
    "{% for m in messages %}{%- set x = ns.q.pop() -%} <{{ x }}>{% endfor %}{{ ns.q }}",
    "{% set ns = namespace(q=[1]) %}{{ ns.q }} no change",
])  # fmt: skip
def test_a_namespaces_list_changed_in_place_renders_as_it_would_in_place(tiny_tok, template):
    """:func:`chat.immutable_template`: ``append`` and ``pop(0)`` / ``pop()`` on a namespace's list,
    whitespace control kept, render what they render in place; a template without them is itself."""
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = [{"role": "user", "content": c} for c in ("a", "b", "c")]
    fixed = chat.immutable_template(template)
    assert (fixed == template) == ("append" not in template)
    got = render_jinja_template([msgs], chat_template=fixed)[0][0]  # (renders, generation indices)
    assert got == _mutable_render(template, tiny_tok, messages=msgs, tools=None, documents=None,
                                  add_generation_prompt=False)  # fmt: skip


def test_a_template_that_takes_no_system_turn_gets_it_at_the_start_of_the_first_user_turn(family_dirs):
    """Gemma 2's template raises "System role not supported": a client's system prompt (every
    agent sends one) was a 400 on every request. It is the first user turn's first paragraph now
    (llama.cpp's polyfill), the same text every turn, so the conversation's prompt keeps its prefix;
    the templates that take a system turn render it as before."""
    from jinja2 import TemplateError
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(family_dirs["gemma-2"])
    convo = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi."}]
    with pytest.raises(TemplateError, match="System role not supported"):
        tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert not chat.template_takes_system(tok)
    text = chat.render_chat(tok, convo)
    assert text == "<bos><start_of_turn>user\nYou are terse.\n\nHi.<end_of_turn>\n<start_of_turn>model\n"
    later = convo + [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye."}]
    assert chat.render_chat(tok, later).startswith(text[: text.rindex("<start_of_turn>model")])
    # with tools (injected, Hermes-style, into a system turn) and a system turn of its own
    tooled = chat.render_chat(tok, convo, TOOLS)
    assert tooled.startswith("<bos><start_of_turn>user\nYou are terse.") and "<tools>" in tooled
    assert chat.fold_system([{"role": "system", "content": "s"}]) == [{"role": "user", "content": "s"}]
    for family in ("qwen3", "llama-3.3", "gpt-oss"):  # they take it: nothing folded
        assert chat.template_takes_system(load_tokenizer(family_dirs[family])), family
