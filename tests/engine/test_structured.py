# mypy: disable-error-code="arg-type,union-attr,index,attr-defined,call-overload"
"""engine/structured.py: a request's JSON mode / JSON Schema enforced while sampling. The grammar
over the tiny model's real tokenizer (llguidance's matcher), then over real HTTP on the tiny
random-weight model — whose free output is never JSON, so a value that parses and matches its
schema is the constraint at work (before it, ``response_format`` was ignored)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from llguidance import LLMatcher
from mlx_lm import load

from engine import structured
from engine.structured import ANY_OBJECT, FormatError, Grammars, lark, schema_of

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok", "color"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}}}  # fmt: skip
ASK = [{"role": "user", "content": "Reply with a JSON object."}]
THINK = ("<think>", "</think>")


def _matches(value: object) -> bool:
    return (isinstance(value, dict) and set(value) == {"n", "ok", "color"}
            and type(value["n"]) is int and 0 <= value["n"] <= 9
            and isinstance(value["ok"], bool) and value["color"] in ("red", "green"))  # fmt: skip


# --- the request's format → its schema (the API edge) --------------------------------------------


def test_each_response_format_becomes_its_schema():
    assert schema_of(None) == ""
    assert schema_of({"type": "text"}) == ""
    assert schema_of({"type": "json_object"}) == ANY_OBJECT
    wrapped = schema_of({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}})
    assert json.loads(wrapped) == SCHEMA
    assert schema_of({"type": "json_schema", "schema": SCHEMA}) == wrapped  # llama.cpp's / Anthropic's shape


@pytest.mark.parametrize(
    "fmt, words",
    [
        ("json", "must be an object"),
        ({"type": "xml"}, "not supported"),
        ({"type": "json_schema", "json_schema": {"schema": 5}}, "needs a 'schema' object"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}, "objectx"),
    ],
)
def test_a_format_that_cannot_be_enforced_is_refused(fmt, words):
    with pytest.raises(FormatError, match=words):
        schema_of(fmt)


# --- the grammar, over the tiny model's tokenizer ---------------------------------------------------


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load(str(tiny_model_dir))[1]


@pytest.fixture(scope="module")
def grammars(tiny_model_dir, tok):
    import json as _json

    vocab = _json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    return Grammars(tok, vocab)


def _accepts(grammars: Grammars, grammar: str, text: str, tok) -> tuple[bool, bool]:
    """(the text is a prefix the grammar allows, the text is a whole output it allows)."""
    m = LLMatcher(grammars._llg(), LLMatcher.grammar_from_lark(grammar))
    ok = m.consume_tokens(tok.encode(text, add_special_tokens=False)) and not m.is_error()
    return ok, ok and m.is_accepting()


VALUE = '{"n": 3, "ok": true, "color": "red"}'


@pytest.mark.parametrize(
    "think, opened, text, prefix, whole",
    [
        (None, False, VALUE, True, True),
        (None, False, '{"n": 3, "ok": ', True, False),  # a value begun: not yet a whole output
        (None, False, '{"n": 3}', False, False),  # required keys missing
        (None, False, '{"n": 12, ', False, False),  # past the maximum
        (None, False, "Sure! " + VALUE, False, False),
        (THINK, False, VALUE, True, True),  # a think block is optional
        (THINK, False, "<think>\nfirst {the} n </thin\n</think>\n\n" + VALUE, True, True),
        (THINK, False, "plain</think>" + VALUE, False, False),  # no block opened: no end marker
        (THINK, True, "still thinking</think>\n" + VALUE, True, True),  # the prompt opened it
        (THINK, True, VALUE, True, False),  # ... so the value is reasoning until the block ends
        (THINK, False, "<think>x</think>not json", False, False),
    ],
)
def test_the_grammar_is_the_value_after_an_optional_think_block(grammars, tok, think, opened, text, prefix, whole):
    assert _accepts(grammars, lark(json.dumps(SCHEMA), think, opened), text, tok) == (prefix, whole)


def test_the_processor_masks_what_cannot_follow_and_ends_with_end_of_sequence(grammars, tok):
    """Fed a whole value token by token (as the decode loop calls it, the ids so far each time), the
    processor leaves the next token of the value allowed and forbids a letter; after the value only
    the end-of-sequence tokens are left."""
    import mlx.core as mx

    vocab = grammars.vocab_size
    prompt = [1, 2, 3]
    proc = grammars.processor(lark(json.dumps(SCHEMA)), len(prompt))
    ids = tok.encode(VALUE, add_special_tokens=False)
    letter = tok.encode("x", add_special_tokens=False)[0]
    for i, t in enumerate(ids):
        out = proc(mx.array(prompt + ids[:i]), mx.zeros((1, vocab)))
        assert out[0, t].item() == 0.0, (i, t)
        assert out[0, letter].item() == float("-inf")
    out = proc(mx.array(prompt + ids), mx.zeros((1, vocab)))
    allowed = {i for i, x in enumerate(out[0].tolist()) if x == 0.0}
    assert allowed and allowed <= set(tok.eos_token_ids)


def test_a_grammar_is_compiled_once_and_each_request_gets_a_matcher_of_its_own(tok, tiny_model_dir):
    """Compiled once per text (``prepare``, off the engine thread in the server); each processor
    starts from a copy, so one request's tokens never move another's matcher; only the newest
    ``KEEP`` grammars are kept."""
    import mlx.core as mx

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    g = Grammars(tok, vocab)
    grammar = lark(json.dumps(SCHEMA))
    g.prepare(grammar)
    kept = g._compiled[grammar]
    first, second = g.processor(grammar, 0), g.processor(grammar, 0)
    assert list(g._compiled) == [grammar] and g._compiled[grammar] is kept
    assert first.matcher is not kept and second.matcher is not first.matcher
    ids = tok.encode(VALUE, add_special_tokens=False)
    first(mx.array(ids[:3]), mx.zeros((1, vocab)))  # the first request is three tokens in
    assert first.matcher.consume_token(ids[3])
    out = second(mx.array([], dtype=mx.int32), mx.zeros((1, vocab)))  # the second is at the start
    assert out[0, ids[0]].item() == 0.0 and out[0, ids[3]].item() == float("-inf")
    assert g.processor(grammar, 0)(mx.array([], dtype=mx.int32), mx.zeros((1, vocab)))[0, ids[0]].item() == 0.0
    for n in range(Grammars.KEEP):
        g.prepare(lark(json.dumps({**SCHEMA, "maxProperties": 3 + n})))
    assert len(g._compiled) == Grammars.KEEP and grammar not in g._compiled


# --- over HTTP, on the tiny random model ----------------------------------------------------------


def test_a_json_schema_answer_is_a_value_of_the_schema(live):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "strict": True, "schema": SCHEMA}}
    r = live.client.chat.completions.create(model="m", messages=ASK, max_tokens=64, temperature=0,
                                            response_format=fmt)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert _matches(value)
    assert list(value) == ["n", "ok", "color"]  # the properties in the schema's order
    sampled = live.client.chat.completions.create(model="m", messages=ASK, max_tokens=64, temperature=1.0,
                                                  seed=7, response_format=fmt)  # fmt: skip
    assert _matches(json.loads(sampled.choices[0].message.content))


def test_a_streamed_json_schema_answer_is_a_value_of_the_schema(live):
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}
    stream = live.client.chat.completions.create(model="m", messages=ASK, max_tokens=64, temperature=0,
                                                 response_format=fmt, stream=True)  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert _matches(json.loads(text))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_mode_answers_an_object(live):
    r = live.client.chat.completions.create(model="m", messages=ASK, max_tokens=200, temperature=0,
                                            response_format={"type": "json_object"})  # fmt: skip
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_a_text_format_and_no_format_are_free_text(live):
    free = live.client.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=0)
    text = live.client.chat.completions.create(model="m", messages=ASK, max_tokens=8, temperature=0,
                                               response_format={"type": "text"})  # fmt: skip
    assert free.choices[0].message.content == text.choices[0].message.content


@pytest.mark.parametrize(
    "fmt",
    [{"type": "xml"}, {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}, "json"],
)
def test_an_unenforceable_format_is_a_400_naming_the_field(live, fmt):
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": ASK, "response_format": fmt})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "response_format"


def test_a_responses_text_format_is_enforced_and_echoed(live):
    fmt = {"type": "json_schema", "name": "pick", "strict": True, "schema": SCHEMA}
    r = live.client.responses.create(model="m", input="Reply with a JSON object.", max_output_tokens=64,
                                     temperature=0, text={"format": fmt})  # fmt: skip
    assert _matches(json.loads(r.output_text))
    assert r.text.format.type == "json_schema" and r.text.format.name == "pick"


def test_an_anthropic_output_format_is_enforced(live):
    body = {"model": "m", "max_tokens": 64, "temperature": 0, "messages": ASK,
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}  # fmt: skip
    r = httpx.post(live.url + "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    assert _matches(json.loads(r.json()["content"][0]["text"]))


def test_structured_output_needs_no_llguidance_until_a_request_asks(tiny_model_dir, tok):
    """The tokenizer's view is built at the first request that needs it (it takes about a second),
    not when the engine starts."""
    g = Grammars(tok, len(tok.get_vocab()))
    assert g._ll is None
    g.processor(structured.lark(ANY_OBJECT), 0)
    assert g._ll is not None


def test_the_grammar_follows_the_models_think_block_and_where_the_prompt_left_it():
    """respond.grammar_of: the request's schema, after the think block of the model's output format,
    started inside it when the chat prompt opened it (what the output parser was told)."""
    from types import SimpleNamespace

    from engine import api, output, respond
    from engine.output_format import OutputFormat

    req = api.ChatRequest.model_validate({"messages": ASK, "response_format": {"type": "json_object"}})
    for think in (None, THINK):
        for opened in (False, True):
            parser = output.ChatOutput(OutputFormat(think), None, False, True, opened)
            out = SimpleNamespace(parser=parser)
            assert respond.grammar_of(req, out) == lark(ANY_OBJECT, think, opened)
    free = api.ChatRequest.model_validate({"messages": ASK})
    assert respond.grammar_of(free, out) == ""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "f"}}
    for choice, enforced in (("auto", True), ("none", True), ("required", False), (named, False)):
        called = api.ChatRequest.model_validate({"messages": ASK, "response_format": {"type": "json_object"},
                                                 "tools": tools, "tool_choice": choice})  # fmt: skip
        grammar = respond.grammar_of(called, out)
        assert (grammar == lark(ANY_OBJECT, THINK, True)) is enforced, choice  # a forced call is the answer
    # ... whose arguments follow its tool's parameters, where the format writes them as one JSON object
    assert grammar == structured.call_lark([("", ANY_OBJECT)], out.parser.fmt.named_close() or "")
    completion = api.CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})
    assert respond.grammar_of(completion, None) == ""  # the legacy API has no such field


def test_a_constrained_request_beside_a_free_one_leaves_the_free_one_as_alone(live):
    """Both in the batch at once: the constrained one's processor (which reads each sampled token)
    masks its own row only."""
    from concurrent.futures import ThreadPoolExecutor

    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}}

    def free() -> str:
        r = live.client.chat.completions.create(model="m", messages=ASK, max_tokens=24, temperature=0)
        return r.choices[0].message.content

    alone = free()
    with ThreadPoolExecutor(2) as ex:
        constrained = ex.submit(lambda: live.client.chat.completions.create(
            model="m", messages=ASK, max_tokens=64, temperature=0, response_format=fmt))  # fmt: skip
        beside = ex.submit(free)
        assert _matches(json.loads(constrained.result().choices[0].message.content))
        assert beside.result() == alone


@pytest.mark.parametrize("family", ["qwen3", "glm-4.7", "minimax-m2", "kimi-k2-thinking", "deepseek-r1-distill",
                                    "gemma-4", "lfm2.5"])
def test_a_think_block_of_the_models_own_tokens_is_accepted(family_dirs, family):
    """The families' think markers are added tokens, which llguidance matches by name only: the
    grammar wrote them as text, so Qwen3's or GLM's own ``<think>`` token was refused (the model
    could not open its block, nor, where the prompt opened it, close it: ``</think>`` could only be
    spelled; Gemma 4's ``<|channel>thought`` holds its ``<|channel>`` token). Now, the value after a
    block of the real tokens, opened by the output or the prompt."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine.output_format import OutputFormat

    tok = load_tokenizer(family_dirs[family])
    fmt = OutputFormat.of(tok)
    assert fmt.think is not None and fmt.marker_tokens, family
    vocab = json.loads((family_dirs[family] / "config.json").read_text())["vocab_size"]
    g = Grammars(tok, vocab)
    start, end = fmt.think
    for opened, text in ((False, f"{start}\nfirst n, then {{\n{end}\n\n{VALUE}"), (False, VALUE),
                         (True, f"thinking{end}\n{VALUE}")):  # fmt: skip
        grammar = lark(json.dumps(SCHEMA), fmt.think, opened, tokens=fmt.marker_tokens)
        assert _accepts(g, grammar, text, tok) == (True, True), (family, opened, text)
    as_text = lark(json.dumps(SCHEMA), fmt.think)  # the markers as text: what the grammar was
    assert _accepts(g, as_text, f"{start}x{end}{VALUE}", tok) == (False, False)


# --- a forced call's arguments -------------------------------------------------------------------


@pytest.mark.parametrize("family", [None, "gpt-oss", "qwen3", "kimi-k2", "qwen3-coder", "minimax-m2", "glm-4.7",
                                    "lfm2.5", "gemma-4", "deepseek-v3.1", "seed-oss", "hy3", "nemotron-nano-v2",
                                    "command-r7b", "apertus", "gigachat-3.1", "granite-3.3", "mistral-small-3.2",
                                    "mistral-nemo"])
def test_a_named_calls_arguments_follow_its_tools_parameters(tiny_model_dir, family_dirs, tmp_path, family):
    """``tool_choice`` naming a function: the prompt opens the call, and its arguments are the tool's
    ``parameters`` as a JSON Schema, then the format's end of the call — on the tiny random model
    (Hermes-style calls; gpt-oss's harmony; Qwen3's json_tools, ``</tool_call>`` a token; Kimi-K2's
    sections, its ends tokens; Qwen3-Coder's, MiniMax-M2's and GLM's arguments as tags, one per
    property; LFM2's Python call; Gemma 4's ``call:NAME{key:<|"|>text<|"|>}``; DeepSeek V3.1's ``NAME<｜tool▁sep｜>{…}``;
    Seed-OSS's ``<parameter=city>Paris</parameter>``; Hy3's ``<arg_key:opensource>`` pairs; the JSON of
    Nemotron Nano v2's ``<TOOLCALL>[…]``, Command R7B's ``"tool_name"`` / ``"parameters"``, Apertus's
    ``{NAME: ARGUMENTS}``, GigaChat 3.1's one object, Granite 3.3's list, as each template writes it — those
    five until 2026-12-08 free; Mistral Small 3.2's ``NAME[CALL_ID]ID[ARGS]`` and Mistral Nemo's
    ``[{"name": …, "arguments": …, "id": ID}]``, the id the model's). Before, the random model's arguments were whatever it wrote: no
    call came back (the block was text, or cut by ``max_tokens``)."""
    from engine.generate import Engine
    from tests.serving import USER, hot_config, serve

    # bounded values (an enum, a small integer): the random model's free strings never end
    params = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
              "properties": {"city": {"enum": ["Paris", "Oslo"]},
                             "days": {"type": "integer", "minimum": 1, "maximum": 9}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": params}}]  # fmt: skip
    model = tiny_model_dir if family is None else family_dirs[family]
    config = hot_config(tmp_path)
    with serve(lambda: Engine(model, config), config) as live:
        r = live.client.chat.completions.create(
            model="m", messages=USER, tools=tools, max_tokens=160, temperature=0,  # tags: ~100 tiny tokens
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 9


@pytest.mark.parametrize("family", [None, "gpt-oss", "qwen3", "kimi-k2", "devstral", "llama-3.3", "qwen3-coder",
                                    "minimax-m2", "glm-4.6", "lfm2.5", "gemma-4", "deepseek-v3.1", "hy3",
                                    "cohere2-moe", "apertus", "granite-3.3"])
def test_a_required_call_is_one_of_the_tools_with_its_parameters(tiny_model_dir, family_dirs, tmp_path, family):
    """``tool_choice: "required"``: the prompt opens a call, then the grammar makes it a call to one
    of the tools, by its name in the format's syntax, its arguments that tool's ``parameters`` —
    on the tiny random model (Hermes; harmony; Qwen3's json_tools; Kimi-K2's numbered sections;
    Devstral's ``[ARGS]``, a token named by its id; Llama 3.3's bare JSON; Qwen3-Coder's and
    MiniMax-M2's tags; GLM's ``<arg_key>`` tokens; LFM2's Python call; Gemma 4's keys and
    ``<|"|>`` quotes); one call, ``parallel_tool_calls`` off. Before, only a named
    call was constrained: after the opener the random model wrote whatever it drew, and no call
    came back."""
    from engine.generate import Engine
    from tests.serving import USER, hot_config, serve

    def tool(name: str, key: str, values: list[str]) -> dict[str, Any]:
        params = {"type": "object", "required": [key], "additionalProperties": False,
                  "properties": {key: {"enum": values}}}  # fmt: skip
        return {"type": "function", "function": {"name": name, "description": name, "parameters": params}}

    tools = [tool("get_weather", "city", ["Paris", "Oslo"]), tool("get_time", "zone", ["UTC", "CET"])]
    allowed = {"get_weather": ("city", ("Paris", "Oslo")), "get_time": ("zone", ("UTC", "CET"))}
    model = tiny_model_dir if family is None else family_dirs[family]
    config = hot_config(tmp_path)
    with serve(lambda: Engine(model, config), config) as live:
        for seed in (0, 1, 2):
            r = live.client.chat.completions.create(model="m", messages=USER, tools=tools, max_tokens=48,
                                                    tool_choice="required", seed=seed,
                                                    parallel_tool_calls=False)  # fmt: skip
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", (family, choice)
            (call,) = choice.message.tool_calls
            key, values = allowed[call.function.name]
            args = json.loads(call.function.arguments)
            assert list(args) == [key] and args[key] in values, (family, call)


@pytest.mark.parametrize("family", ["qwen3", "devstral", "mistral-small-3.2", "mistral-nemo", "kimi-k2", "gpt-oss",
                                    "llama-3.3", "qwen3-coder", "minimax-m2",
                                    "glm-4.6", "glm-4.7", "lfm2.5", "gemma-4", "deepseek-v3.1", "hy3",
                                    "nemotron-nano-v2", "command-r7b", "apertus", "gigachat-3.1", "granite-3.3"])
def test_a_required_grammar_takes_a_call_to_one_of_the_tools(family_dirs, family):
    """Over the family's real tokenizer, after the prompt's opener: ``required``'s grammar takes a
    call to either tool (the added tokens of its head and end as tokens: Mistral's ``[ARGS]`` by
    its id; GLM-4.6's newlines between tags and 4.7's none) and to a tool without parameters (no
    tags, or ``{}``), and refuses an unknown name, arguments against the schema, and — with
    ``parallel_tool_calls: false`` — a second call."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine import api, respond
    from engine.output_format import CALL_ID, GAP, OutputFormat

    tok = load_tokenizer(family_dirs[family])
    fmt = OutputFormat.of(tok)
    vocab = json.loads((family_dirs[family] / "config.json").read_text())["vocab_size"]
    g = Grammars(tok, vocab)
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": params}}
             for n in ("get_weather", "get_time")] + [{"type": "function", "function": {"name": "ping"}}]  # fmt: skip
    req = api.ChatRequest.model_validate({"messages": ASK, "tools": tools, "tool_choice": "required"})
    grammar = respond.call_grammar(req, fmt)

    def call(name: str, args: dict[str, str]) -> str:
        gap = "\n" if family == "glm-4.6" else ""  # the layout of its template
        text = f"{fmt.call_head(name)}{_spelled(fmt, args)}{fmt.named_close()}".replace(GAP, gap)
        return text.replace(CALL_ID, "abcDEF120")  # (Mistral Small 3.2's id, the model's to write)

    one = call("get_time", {"city": "Oslo"})
    assert _accepts(g, grammar, one, tok) == (True, True), (family, grammar)
    assert _accepts(g, grammar, call("get_weather", {"city": "Paris"}), tok) == (True, True)
    assert not _accepts(g, grammar, call("get_news", {"city": "Oslo"}), tok)[0]
    assert not _accepts(g, grammar, call("get_time", {"town": "Oslo"}), tok)[0]
    assert not _accepts(g, grammar, call("get_time", {}), tok)[1]  # its required argument missing
    assert _accepts(g, grammar, call("ping", {}), tok) == (True, True)  # a tool without parameters
    single = api.ChatRequest.model_validate({"messages": ASK, "tools": tools, "tool_choice": "required",
                                             "parallel_tool_calls": False})  # fmt: skip
    second = one + fmt.forced_prefix("required") + call("get_time", {"city": "Oslo"})
    assert not _accepts(g, respond.call_grammar(single, fmt), second, tok)[0]
    assert not _accepts(g, respond.call_grammar(single, fmt), second.replace(fmt.forced_prefix("required"), "\n"), tok)[0]


#: the families whose templates write several calls in one turn (Llama 3.3's raises "This model
#: only supports single tool-calls at once!"; gpt-oss's renders the first alone)
PARALLEL = ["qwen3", "qwen3-coder", "glm-4.6", "glm-4.7", "kimi-k2", "minimax-m2", "devstral", "mistral-small-3.2",
            "mistral-nemo", "gemma-4",
            "gemma-2", "lfm2.5", "lfm2-8b", "deepseek-v3.1", "seed-oss", "hy3", "nemotron-nano-v2", "apertus",
            "granite-3.3"]  # fmt: skip


@pytest.mark.parametrize("family", PARALLEL)
def test_a_required_turn_may_make_several_calls_as_the_template_writes_them(family_dirs, family):
    """``tool_choice: "required"`` is one call or more (OpenAI's, with ``parallel_tool_calls``, its
    default): over the family's real tokenizer its grammar takes two and three calls written as the
    family's template writes two calls in one turn (the same text, where the template spells the
    arguments as the grammar does: Seed-OSS's values, with no newline around them, and LFM2.5's
    strings in single quotes were written in their parser family's layout until 2026-12-08), the server's output parser reads each back, and a format of one call a turn refuses a
    second. Before, the grammar ended the turn after the first call."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine import api, chat, respond
    from engine.output import ChatOutput
    from engine.output_format import CALL_ID, GAP, OutputFormat
    from tests.engine.parsing import named_calls, run_output

    tok = load_tokenizer(family_dirs[family])
    fmt = OutputFormat.of(tok)
    vocab = json.loads((family_dirs[family] / "config.json").read_text())["vocab_size"]
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": params}}
             for n in ("get_weather", "get_time")]  # fmt: skip
    req = api.ChatRequest.model_validate({"messages": ASK, "tools": tools, "tool_choice": "required"})
    grammar = respond.call_grammar(req, fmt)
    gap = "\n" if family == "glm-4.6" else ""
    calls = [("get_weather", {"city": "Oslo"}), ("get_time", {"city": "Oslo"}), ("get_weather", {"city": "Rome"})]
    ids = ["abcDEF120", "abcDEF121", "abcDEF122"]  # (Mistral's templates take ids of nine letters or digits)

    def written(k: int, seq: list[tuple[str, dict[str, str]]] = calls) -> str:
        """The first ``k`` calls, after the prompt's opener, as the grammar spells them."""
        text = str(fmt.call_head(seq[0][0])) + _spelled(fmt, seq[0][1])
        for i, (name, args) in enumerate(seq[1:k], 1):
            text += str(fmt.next_call(name, i)) + _spelled(fmt, args)
        text = (text + str(fmt.named_close())).replace(GAP, gap)
        for i in range(text.count(CALL_ID)):  # ids the model writes (Mistral Small 3.2's), in call order
            text = text.replace(CALL_ID, ids[i], 1)
        return text

    g = Grammars(tok, vocab)
    # one tool, called twice (its one head is no alternative: the repeat still covers the whole call)
    one_tool = api.ChatRequest.model_validate({"messages": ASK, "tools": tools[:1], "tool_choice": "required"})
    for k in (1, 2, 3):
        again = written(k, [calls[0], calls[2], calls[0]])
        assert _accepts(g, respond.call_grammar(one_tool, fmt), again, tok) == (True, True), (family, k)
    for k in (1, 2, 3):
        assert _accepts(g, grammar, written(k), tok) == (True, True), (family, k, grammar)
        got, finish = run_output(ChatOutput(fmt, tools), [fmt.forced_prefix("required") + written(k)])
        assert named_calls(got) == [{"name": n, "arguments": a} for n, a in calls[:k]], (family, k, got)
        assert finish == "tool_calls" and not got.content.strip(), (family, got)
    # two calls as the family's own template writes them back into the conversation
    sent = [{"id": f"functions.{n}:{i}" if family == "kimi-k2" else ids[i], "type": "function",
             "function": {"name": n, "arguments": json.dumps(a)}} for i, (n, a) in enumerate(calls[:2])]  # fmt: skip
    turn = {"role": "assistant", "content": "", "tool_calls": sent}
    rendered = chat.render_chat(tok, [*ASK, turn], tools, generation_prompt=False)
    two = fmt.forced_prefix("required") + written(2)
    assert two in rendered, (family, two, rendered)


@pytest.mark.parametrize("family", [None, "qwen3-coder", "kimi-k2"])
def test_a_served_required_turn_may_make_several_calls(tiny_model_dir, family_dirs, tmp_path, family):
    """Served, ``required`` with parallel calls (the default) on the tiny random model (Hermes,
    Qwen3-Coder's tags, Kimi-K2's numbered calls in one section): every call that comes back is to
    one of the tools with its parameters, and the random model, free to go on after a call, makes
    several. Before, each turn was one call."""
    from engine.generate import Engine
    from tests.serving import USER, hot_config, serve

    params = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"enum": ["Paris", "Oslo"]}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "description": n, "parameters": params}}
             for n in ("get_weather", "get_time")]  # fmt: skip
    model = tiny_model_dir if family is None else family_dirs[family]
    config = hot_config(tmp_path)
    counts = []
    with serve(lambda: Engine(model, config), config) as live:
        for seed in range(4):
            r = live.client.chat.completions.create(model="m", messages=USER, tools=tools, max_tokens=200,
                                                    tool_choice="required", seed=seed)  # fmt: skip
            choice = r.choices[0]
            calls = choice.message.tool_calls or []
            assert calls and choice.finish_reason in ("tool_calls", "length"), (family, choice)
            for call in calls:
                assert call.function.name in ("get_weather", "get_time"), (family, call)
                assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo"), (family, call)
            assert len({call.id for call in calls}) == len(calls)
            counts.append(len(calls))
    assert max(counts) >= 2, (family, counts)


@pytest.mark.parametrize("family", ["llama-3.3", "gpt-oss", "command-r7b", "gigachat-3.1"])
def test_a_format_of_one_call_a_turn_makes_one_under_required(family_dirs, family):
    """Llama 3.3's and gpt-oss's formats write one call a turn, GigaChat 3.1's template renders one
    and Command R7B's numbers its calls: ``required`` stays one call there, ``parallel_tool_calls``
    or not."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine import api, respond
    from engine.output_format import OutputFormat

    tok = load_tokenizer(family_dirs[family])
    fmt = OutputFormat.of(tok)
    vocab = json.loads((family_dirs[family] / "config.json").read_text())["vocab_size"]
    tools = [{"type": "function", "function": {"name": "ping"}}]
    req = api.ChatRequest.model_validate({"messages": ASK, "tools": tools, "tool_choice": "required"})
    grammar = respond.call_grammar(req, fmt)
    one = f"{fmt.call_head('ping')}{{}}{fmt.named_close()}"
    g = Grammars(tok, vocab)
    assert fmt.next_call("ping", 1) is None
    assert _accepts(g, grammar, one, tok) == (True, True)
    assert not _accepts(g, grammar, one + "\n" + fmt.forced_prefix("required") + one, tok)[0]


def _spelled(fmt: Any, args: dict[str, Any]) -> str:
    """A call's arguments as the format writes them: one JSON object, or one by one in its layout."""
    layout = fmt.arg_layout()
    if layout is None:
        return json.dumps(args)

    def value(v: Any) -> str:
        return json.dumps(v) if layout.quote == '"' or not isinstance(v, str) else f"{layout.quote}{v}{layout.quote}"

    keys = sorted(args, key=str.lower) if layout.sort else list(args)
    return layout.sep.join(f"{layout.before}{k}{layout.between}{value(args[k])}{layout.after}" for k in keys)


@pytest.mark.parametrize("family", ["lfm2.5", "gemma-4"])
def test_arguments_apart_by_a_separator_may_each_be_left_out(family_dirs, family):
    """LFM2's ``f(a="x", b=1)`` and Gemma 4's ``call:f{a:<|"|>x<|"|>,b:1}``: any optional argument may
    be missing, the required one not, and the separator stands only between two of them (none
    leading, trailing or doubled); each value of its type, and what the grammar takes parses back
    to the call's arguments, typed."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine import api, respond
    from engine.output import ChatOutput
    from engine.output_format import OutputFormat
    from tests.engine.parsing import run_output

    tok = load_tokenizer(family_dirs[family])
    fmt = OutputFormat.of(tok)
    layout = fmt.arg_layout()
    assert layout is not None and layout.sep, family
    g = Grammars(tok, json.loads((family_dirs[family] / "config.json").read_text())["vocab_size"])
    params = {"type": "object", "required": ["b"],
              "properties": {"a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "boolean"},
                             "d": {"type": "array", "items": {"type": "string"}}, "e": {"type": "object"}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    named = {"type": "function", "function": {"name": "f"}}
    grammar = respond.call_grammar(api.ChatRequest.model_validate(
        {"messages": ASK, "tools": tools, "tool_choice": named}), fmt)  # fmt: skip
    close = fmt.named_close() or ""
    for args in ({"b": 1}, {"a": "x y", "b": 2}, {"b": 3, "c": True}, {"a": "", "b": -4, "c": False},
                 {"b": 5, "d": ["p", "q, r"], "e": {"x": True, "y": None, "z": [1.5]}}):  # fmt: skip
        text = _spelled(fmt, args) + close
        assert _accepts(g, grammar, text, tok) == (True, True), (family, text)
        got, _ = run_output(ChatOutput(fmt, tools), [fmt.forced_prefix(named), text])
        assert [json.loads(c["function"]["arguments"]) for c in got.tool_calls] == [args], (family, text)
    sep = layout.sep
    for bad in (f"{sep}b=1".replace("=", layout.between), _spelled(fmt, {"b": 1}) + sep, _spelled(fmt, {"a": "x"}),
                _spelled(fmt, {"a": "x", "b": 1}).replace(sep, sep + sep), _spelled(fmt, {"b": "1"})):  # fmt: skip
        assert _accepts(g, grammar, bad + close, tok) != (True, True), (family, bad)


def test_a_name_the_call_syntax_cannot_write_leaves_the_call_free():
    """Python's keywords are no keyword arguments (``f(from=1)`` does not parse; mlx-lm's fallback
    parser then reads ``from="2024"`` as the integer 2024): LFM2's named call to such a tool is left
    free, and ``required`` gives it no arguments; Gemma 4 writes the name bare, as it may."""
    from engine import api, respond
    from engine.output_format import OutputFormat

    params = {"type": "object", "properties": {"from": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    named = {"type": "function", "function": {"name": "f"}}
    pythonic = OutputFormat(None, ("<|tool_call_start|>", "<|tool_call_end|>"), parser_name="pythonic")
    gemma = OutputFormat(None, ("<|tool_call>", "<tool_call|>"), parser_name="gemma4")

    def grammar(fmt: OutputFormat, choice: Any) -> str:
        req = api.ChatRequest.model_validate({"messages": ASK, "tools": tools, "tool_choice": choice})
        return respond.call_grammar(req, fmt)

    assert grammar(pythonic, named) == ""
    assert "from" not in grammar(pythonic, "required") and grammar(pythonic, "required")
    assert '"from:"' in grammar(gemma, named)


def test_a_call_grammar_is_the_arguments_then_the_formats_end():
    obj = '{"type":"object"}'
    assert structured.call_lark([("", obj)], "}\n</tool_call>", (("</tool_call>", "</tool_call>"),)).startswith(
        'start: value0 "}\\n" </tool_call>\n')
    assert structured.call_lark([("", obj)], "").startswith("start: value0\n")
    # required: one of the calls, each its head (the name in the format's syntax) then its arguments;
    # an added token not spelled <...> is named by its id
    either = structured.call_lark([('a", "arguments": ', obj), ("b[X]", obj)], "}", (("[X]", "<[7]>"),))
    assert either.startswith('start: ("a\\", \\"arguments\\": " value0 | "b" <[7]> value1) "}"\n'), either


def test_a_schemas_check_is_kept_only_for_schemas_of_a_bounded_size():
    """``check`` keeps llguidance's answer per schema text (a forced call checks every tool each
    request), for schemas up to ``KEEP_CHECKED_BYTES``: 256 bodies of 16 MiB kept would be 4 GiB."""
    small = json.dumps({"type": "object", "properties": {"k": {"type": "string", "description": "s"}}})
    big = json.dumps({"type": "object", "description": "x" * structured.KEEP_CHECKED_BYTES})
    structured._compile_error.cache_clear()
    for schema in (small, small, big, big):
        structured.check(schema)
    info = structured._compile_error.cache_info()
    assert (info.currsize, info.hits) == (1, 1)
    with pytest.raises(FormatError):
        structured.check(json.dumps({"type": "object", "description": "y" * structured.KEEP_CHECKED_BYTES,
                                     "properties": {"k": {"type": "nonsense"}}}))  # fmt: skip


def test_gemma_4s_forced_call_takes_what_its_template_writes_back(family_dirs):
    """The grammar of a forced Gemma 4 call takes the call as its template renders it in the
    history (keys sorted case-insensitively, as jinja's ``dictsort``; strings between ``<|"|>``;
    other values bare): what the model was taught to write."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine import api, chat, respond
    from engine.output_format import OutputFormat

    tok = load_tokenizer(family_dirs["gemma-4"])
    fmt = OutputFormat.of(tok)
    g = Grammars(tok, json.loads((family_dirs["gemma-4"] / "config.json").read_text())["vocab_size"])
    params = {"type": "object", "required": ["city"],
              "properties": {"city": {"type": "string"}, "Days": {"type": "integer"}, "metric": {"type": "boolean"},
                             "b": {"enum": ["x", "y"]}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": params}}]
    args = {"city": "Paris", "Days": 3, "metric": True, "b": "y"}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]}]  # fmt: skip
    text = chat.render_chat(tok, history, tools)
    opened = text.index("<|tool_call>call:get_weather{") + len("<|tool_call>")
    written = text[opened : text.index("<tool_call|>", opened) + len("<tool_call|>")]
    assert written.startswith("call:get_weather{b:") and "Days:3" in written, written  # (b, city, Days, metric)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        req = api.ChatRequest.model_validate({"messages": ASK, "tools": tools, "tool_choice": choice})
        head = "" if choice == "required" else fmt.forced_prefix(choice)[len("<|tool_call>") :]
        assert _accepts(g, respond.call_grammar(req, fmt), written[len(head) :], tok) == (True, True), choice
