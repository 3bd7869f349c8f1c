"""engine/tool_calls.py: a call block's calls as the client gets them: ids its template takes back,
only the request's tools, arguments a JSON object, each call of a multi-call block judged alone, ids
made unique. Driven through :class:`ChatOutput` on the families' real templates, as in
test_output.py."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.output import ChatOutput
from tests.engine.parsing import USER, fmt_and_prompt, in_pieces, named_calls, run_output
from tests.serving import TOOLS


@pytest.mark.parametrize("prefix", ["call_", "toolu_"])
def test_mistral_call_ids_fit_its_template(family_dirs, prefix):
    """Mistral Small 3.2's template raises on history whose call ids are not 9 alphanumerics: so
    are its ids whatever the API's prefix (Anthropic's ``toolu_`` too)."""
    fmt, _ = fmt_and_prompt(family_dirs, "mistral-small-3.2")
    out = ChatOutput(fmt, TOOLS, call_id_prefix=prefix)
    got, _ = run_output(out, ['[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}'])
    cid = got.tool_calls[0]["id"]
    assert len(cid) == 9 and cid.isalnum()
    tok = load_tokenizer(family_dirs["mistral-small-3.2"])
    call = {k: got.tool_calls[0][k] for k in ("id", "type", "function")}
    history = USER + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": cid, "content": "sunny"},
    ]
    tok.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)


def test_a_mistral_call_with_its_own_id_is_a_call_with_that_id(family_dirs):
    """Mistral Small 3.2's template writes a call back as ``name[CALL_ID]id[ARGS]{…}``, and its
    model writes calls so: mlx-lm's parser read the id as the function's name, and the block was
    text. Each call keeps the id the model wrote (the template renders it back where it was)."""
    fmt, _ = fmt_and_prompt(family_dirs, "mistral-small-3.2")
    text = ('[TOOL_CALLS]get_weather[CALL_ID]abc123xyz[ARGS]{"city": "Oslo"}'
            '[TOOL_CALLS]get_weather[CALL_ID]Q9w8e7r6t[ARGS]{"city": "Paris"}')  # fmt: skip
    got, finish = run_output(ChatOutput(fmt, TOOLS, call_id_prefix="toolu_"), [text])
    assert finish == "tool_calls" and got.content == ""
    assert [c["id"] for c in got.tool_calls] == ["abc123xyz", "Q9w8e7r6t"]
    assert named_calls(got) == [{"name": "get_weather", "arguments": {"city": c}} for c in ("Oslo", "Paris")]
    tok = load_tokenizer(family_dirs["mistral-small-3.2"])
    calls = [{"id": c["id"], "type": "function", "function": {"name": "get_weather", "arguments": a}}
             for c, a in zip(got.tool_calls, ({"city": "Oslo"}, {"city": "Paris"}), strict=True)]  # fmt: skip
    history = USER + [{"role": "assistant", "content": "", "tool_calls": calls}]
    history += [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in calls]
    rendered = tok.apply_chat_template(history, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text in rendered  # what the model wrote, as the next turn's prompt holds it


@pytest.mark.parametrize(
    "text",
    ["Use the <tool_call></tool_call> tags like this.",
     "<tool_call>I will now look it up</tool_call>",
     "<tool_call>rm_rf\n<arg_key>path</arg_key><arg_value>/</arg_value></tool_call>"],
)  # fmt: skip
def test_a_block_naming_none_of_the_requests_tools_is_text(family_dirs, text):
    """GLM's parser makes a call of any text in a block (``unknown``, ``I``, a tool never offered)."""
    fmt, _ = fmt_and_prompt(family_dirs, "glm-4.6")
    got, finish = run_output(ChatOutput(fmt, TOOLS), [text])
    assert (got.tool_calls, finish) == ([], "stop")
    assert "tool_call>" in got.content
    real = "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    assert named_calls(run_output(ChatOutput(fmt, TOOLS), [real])[0]) == [{"name": "get_weather",
                                                                "arguments": {"city": "Paris"}}]


KIMI_CALL = "<|tool_call_begin|>functions.%s:%d<|tool_call_argument_begin|>%s<|tool_call_end|>"


MINIMAX_CALL = '\n<invoke name="%s">\n<parameter name="city">%s</parameter>\n</invoke>'


@pytest.mark.parametrize(
    "family, open_, bad, close",
    [("kimi-k2", "<|tool_calls_section_begin|>", KIMI_CALL % ("rm_rf", 1, '{"path": "/"}'),
      "<|tool_calls_section_end|>"),
     ("kimi-k2", "<|tool_calls_section_begin|>", KIMI_CALL % ("get_weather", 1, '"Oslo"'),
      "<|tool_calls_section_end|>"),
     ("kimi-k2", "<|tool_calls_section_begin|>", "<|tool_call_begin|>get_weather<|tool_call_end|>",
      "<|tool_calls_section_end|>"),
     ("minimax-m2", "<minimax:tool_call>", MINIMAX_CALL % ("rm_rf", "/"), "\n</minimax:tool_call>")],
    ids=["kimi-unknown-tool", "kimi-arguments-no-object", "kimi-no-parse", "minimax-unknown-tool"],
)  # fmt: skip
def test_a_block_of_several_calls_keeps_its_valid_ones(family_dirs, family, open_, bad, close):
    """Kimi's section (and MiniMax's block) holds several calls, each in markers of its own: one
    call naming no offered tool (or with no JSON object for arguments, or no parse) made the
    whole section text, so the valid calls beside it were lost. Each call is judged alone: the
    valid ones are calls, the bad one is the text it is (as a block naming no tool is)."""
    fmt, _ = fmt_and_prompt(family_dirs, family)
    good = (KIMI_CALL % ("get_weather", 0, '{"city": "Paris"}') if family == "kimi-k2"
            else MINIMAX_CALL % ("get_weather", "Paris"))  # fmt: skip
    oslo = good.replace(":0", ":2").replace("Paris", "Oslo")
    text = "Checking." + open_ + good + bad + oslo + close
    for n in (len(text), 1, 6):
        got, finish = run_output(ChatOutput(fmt, TOOLS), in_pieces(text, n))
        assert named_calls(got) == [{"name": "get_weather", "arguments": {"city": c}} for c in ("Paris", "Oslo")]
        assert (got.content, finish) == ("Checking." + bad.strip(), "tool_calls"), n
        assert [k for k, _ in got.parts] == ["content", "tool", "content", "tool"]  # in the order written
        assert [c["index"] for c in got.tool_calls] == [0, 1]
    got, _ = run_output(ChatOutput(fmt, TOOLS, parallel_tool_calls=False), [text])
    assert named_calls(got) == [{"name": "get_weather", "arguments": {"city": "Paris"}}]


LFM2_PARIS = 'get_weather(city="Paris", days=3)'


@pytest.mark.parametrize(
    "bad",
    ['get_weather("Oslo")', "get_weather(city=)", 'get_weather(city="Oslo", days=3)) + [x(y=1)',
     "rm_rf()"],
    ids=["positional-argument", "no-python", "no-python-closing-early", "unknown-tool"],
)  # fmt: skip
def test_an_lfm2_block_with_a_malformed_call_is_text_not_a_mangled_call(family_dirs, bad):
    """LFM2's block is one Python list of calls, and a block with a call that is none is the
    text it is, as vLLM's lfm2 and pythonic parsers read it (a Llama 3.x output likewise: no call
    of it marks its own end). Where the list was no list of calls, mlx-lm's fallback read the first
    call by a regex to the first ``)]``: a positional argument in the second call made the first
    ``get_weather(city="Paris", days="3)")`` — a call the model never wrote — and dropped the
    second without a word."""
    fmt, _ = fmt_and_prompt(family_dirs, "lfm2.5")
    assert fmt.parser_name == "pythonic"
    text = f"One moment.<|tool_call_start|>[{LFM2_PARIS}, {bad}]<|tool_call_end|>"
    for n in (len(text), 1, 5):
        got, finish = run_output(ChatOutput(fmt, TOOLS), in_pieces(text, n))
        assert (got.content, got.tool_calls, finish) == (text, [], "stop")
    one = "<|tool_call_start|>[search(q=hello world)]<|tool_call_end|>"  # mlx-lm's fallback's case
    got, _ = run_output(ChatOutput(fmt, None), [one])
    assert named_calls(got) == [{"name": "search", "arguments": {"q": "hello world"}}]


@pytest.mark.parametrize(
    "call, args",
    [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', {"city": "Paris"}),
        ('{"name": "get_weather", "arguments": "Paris"}', None),
        ('{"name": "get_weather", "arguments": ["Paris"]}', None),
        ('{"name": "get_weather", "arguments": "[1]"}', None),
    ],
)  # fmt: skip
def test_call_arguments_are_a_json_object_or_the_block_is_text(family_dirs, call, args):
    """mlx-lm's json_tools (Qwen3) passes ``parameters`` through, so the call lost its arguments
    (``{}``), and a non-object reached the client as arguments that are no JSON object."""
    fmt, _ = fmt_and_prompt(family_dirs, "qwen3")
    assert fmt.parser_name == "json_tools"
    got, finish = run_output(ChatOutput(fmt, TOOLS), [f"<tool_call>\n{call}\n</tool_call>"])
    if args is None:
        assert got.tool_calls == [] and call in got.content and finish == "stop"
    else:
        assert named_calls(got) == [{"name": "get_weather", "arguments": args}] and finish == "tool_calls"


def test_call_ids_the_model_repeats_are_made_unique(family_dirs):
    """Kimi numbers its own call ids: two calls numbered alike (or like one in the history) shared
    an id; the openai SDK's Responses stream state raised, and tool results were ambiguous."""
    fmt, _ = fmt_and_prompt(family_dirs, "kimi-k2")
    call = ('<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "%s"}'
            "<|tool_call_end|>")  # fmt: skip
    text = "<|tool_calls_section_begin|>" + call % "Paris" + call % "Oslo" + "<|tool_calls_section_end|>"
    got, _ = run_output(ChatOutput(fmt, TOOLS), [text])
    ids = [c["id"] for c in got.tool_calls]
    assert ids == ["functions.get_weather:0", "functions.get_weather:1"]  # Kimi's own form
    got, _ = run_output(ChatOutput(fmt, TOOLS, taken_ids={"functions.get_weather:0"}), [text])
    assert [c["id"] for c in got.tool_calls] == ["functions.get_weather:1", "functions.get_weather:2"]


def test_dsml_calls_read_each_argument_by_its_string_attribute():
    """DeepSeek V3.2's / V4's markup: ``string="true"`` is the text as written (spaces, quotes and
    all), ``string="false"`` JSON (text that is none stays text); a call without a name is none."""
    from engine.tool_calls import parse_dsml

    one = ('<｜DSML｜invoke name="edit">\n<｜DSML｜parameter name="path" string="true"> a "b".py</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="lines" string="false">[1, 2]</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="force" string="false">true</｜DSML｜parameter>\n'
           '<｜DSML｜parameter name="mode" string="false">fast</｜DSML｜parameter>\n</｜DSML｜invoke>\n')  # fmt: skip
    assert parse_dsml(one) == {"name": "edit", "arguments": {"path": ' a "b".py', "lines": [1, 2], "force": True,
                                                             "mode": "fast"}}  # fmt: skip
    two = parse_dsml(one + one.replace('"edit"', '"view"'))
    assert [c["name"] for c in two] == ["edit", "view"]
    for bad in ("", "<｜DSML｜invoke>x</｜DSML｜invoke>", '<｜DSML｜invoke name="">x</｜DSML｜invoke>'):
        with pytest.raises(ValueError):
            parse_dsml(bad)


def test_json_block_calls_in_each_shape_templates_write():
    """Calls as JSON between a block's markers (``chat.template_call_block`` finds the markers): a
    list of ``{"name", "arguments"}`` (Nemotron Nano v2, Apriel: its ids kept), such objects one a
    line (MiniMax-M1), one object (GigaChat 3.1), Cohere's ``{"tool_name", "parameters"}``,
    Apertus's ``{NAME: ARGUMENTS}`` (only a tool's name); anything else is no call."""
    from engine.tool_calls import parse_json_block

    paris, oslo = {"city": "Paris", "days": 3}, {"city": "Oslo"}
    want = [{"name": "get_weather", "arguments": paris}, {"name": "get_weather", "arguments": oslo}]
    nemotron = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    minimax = '\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    cohere = ('[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris", "days": 3}},\n'
              '    {"tool_call_id": "1", "tool_name": "get_weather", "parameters": {"city": "Oslo"}}\n]')
    apertus = '[{"get_weather": {"city": "Paris", "days": 3}}, {"get_weather": {"city": "Oslo"}}]'
    for text in (nemotron, minimax, cohere, apertus):
        assert parse_json_block(text, TOOLS) == want, text
    assert parse_json_block('{"name": "get_weather", "arguments": {"city": "Oslo"}}', TOOLS) == want[1]
    apriel = '[{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "call_7"}]'
    assert parse_json_block(apriel, TOOLS) == {**want[1], "id": "call_7"}
    for bad in ("", "sunny", '[{"weather": {"city": "Oslo"}}]', '[{"city": "Oslo"}]', "[1]", '{"name": 3}',
                '{"name": "get_weather", "arguments": {}} and more'):  # fmt: skip
        with pytest.raises(ValueError):
            parse_json_block(bad, TOOLS)


@pytest.mark.parametrize(
    ("family", "output"),
    [
        ("nemotron-nano-v2", '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "nope", "arguments": {}}]</TOOLCALL>'),
        ("command-r7b", '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "nope", "parameters": {}}]<|END_ACTION|>'),
    ],
)  # fmt: skip
def test_a_json_block_naming_no_offered_tool_is_text(family_dirs, family, output):
    """A list is one block: where one of its calls names none of the request's tools, the whole is
    the text it is (as vLLM reads a Hermes block), never half of it."""
    fmt, _ = fmt_and_prompt(family_dirs, family)
    got, finish = run_output(ChatOutput(fmt, TOOLS), [output])
    assert (got.content, got.tool_calls, finish) == (output, [], "stop")


def test_minimax_m3_calls_read_as_their_tool_declares_them():
    """MiniMax-M3's tags, each after its namespace token: an argument a string as written (a ``<``
    in it too), a number or boolean as JSON, an array its ``<item>`` elements, an object its
    elements, as the tool's schema declares them (without one, text that is a number is one); a
    call with text outside its elements, an unclosed element or a number that is none is no call."""
    from engine.tool_calls import M3_NS as N
    from engine.tool_calls import parse_minimax_m3

    props = {"path": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
             "opt": {"type": "object", "properties": {"force": {"type": "boolean"}}}, "none": {"type": "array"}}
    tools = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": props}}}]
    body = (f'{N}<invoke name="edit">{N}<path>a <b>.py{N}</path>{N}<n>3{N}</n>{N}<tags>{N}<item>x{N}</item>'
            f"{N}<item>7{N}</item>{N}</tags>{N}<opt>{N}<force>true{N}</force>{N}</opt>{N}<none>{N}</none>{N}</invoke>\n")
    want = {"path": "a <b>.py", "n": 3, "tags": ["x", "7"], "opt": {"force": True}, "none": []}
    assert parse_minimax_m3(f"{N}<tool_call>\n{body}{N}</tool_call>", tools) == {"name": "edit", "arguments": want}
    assert parse_minimax_m3(body + body.replace('"edit"', '"view"'), tools)[1]["arguments"]["tags"] == ["x", 7]
    for bad in (body.replace(f"{N}<n>", f"{N}<n>x", 1).replace(">x3", ">three"), body.replace(f"{N}</path>", ""),
                body.replace(f'">{N}<path>', '">oops' + N + "<path>"), "", f'{N}<invoke name="">{N}</invoke>'):
        with pytest.raises(ValueError):
            parse_minimax_m3(bad, tools)


def test_hy3_calls_read_as_their_tool_declares_them():
    """Hy3's ``<tool_call:opensource>NAME<tool_sep:opensource>`` and key / value pairs: a string as
    written (one that looks like a number too, where the schema says string), anything else its
    JSON; text beside the pairs or a call without a name is no call."""
    from engine.tool_calls import parse_hy3

    props = {"path": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array"}, "code": {"type": "string"}}
    tools = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": props}}}]

    def arg(k: str, v: str) -> str:
        return f"<arg_key:opensource>{k}</arg_key:opensource>\n<arg_value:opensource>{v}</arg_value:opensource>\n"

    body = arg("path", "a.py") + arg("n", "3") + arg("tags", '["x", 7]') + arg("code", "42")
    call = f"<tool_call:opensource>edit<tool_sep:opensource>\n{body}</tool_call:opensource>\n"
    want = {"path": "a.py", "n": 3, "tags": ["x", 7], "code": "42"}
    assert parse_hy3(f"<tool_calls:opensource>\n{call}</tool_calls:opensource>", tools) == {"name": "edit", "arguments": want}
    assert [c["name"] for c in parse_hy3(call + call.replace(">edit<", ">view<"), tools)] == ["edit", "view"]
    for bad in (call.replace(f"{arg('n', '3')}", "oops" + arg("n", "3")), "", call.replace(">edit<", "><")):
        with pytest.raises(ValueError):
            parse_hy3(bad, tools)
