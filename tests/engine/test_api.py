"""engine/api.py: request parsing and validation → OpenAI-shaped 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from engine import api
from engine.api import ChatRequest, CompletionRequest
from engine.errors import ApiError


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
        ({"messages": [{"role": "user", "content": [  # an image was dropped without a word
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages.0.content"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
            "tool_choice",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": "f"}},
         "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": ["f"]}},
         "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function", "function": {"name": 5}}},
         "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "tool_choice": ["auto"]}, "tool_choice"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "top_k": -1}, "top_k"),
        ({"messages": [{"role": "user", "content": "x"}], "min_p": 1.5}, "min_p"),
        ({"messages": [{"role": "user", "content": "x"}], "xtc_probability": 1.5}, "xtc_probability"),
        ({"messages": [{"role": "user", "content": "x"}], "xtc_threshold": 0.6}, "xtc_threshold"),
        ({"messages": [{"role": "user", "content": "x"}], "repetition_penalty": -1}, "repetition_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "repetition_context_size": 0}, "repetition_context_size"),
        ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -2.5}, "frequency_penalty"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"dog": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-3": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"3": 101}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": [3]}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tools": []}},
         "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "think"},
         "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "x" * 40},
         "reasoning_effort"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
         "top_logprobs"),
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
    # echo was ignored: a client scoring its prompt read the completion as the prompt's
    assert error_of({"prompt": "abc", "echo": True}, CompletionRequest).param == "echo"
    assert parse({"prompt": "abc", "echo": False}, CompletionRequest).prompt_text() == "abc"


def test_check_length():
    """No max_tokens: all the context leaves (it was 256, cutting long answers and tool calls of
    clients that send none), or the server's default; a request's own, capped by the context."""
    assert api.check_length(10, None, 100) == 90
    assert api.check_length(10, None, 100, default=20) == 20
    assert api.check_length(10, None, 25, default=20) == 15
    assert api.check_length(10, 50, 100, default=20) == 50
    assert api.check_length(10, 5, 100) == 5
    assert api.check_length(90, 50, 100) == 10
    with pytest.raises(ApiError) as e:
        api.check_length(100, None, 100)
    assert e.value.code == "context_length_exceeded" and e.value.status == 400






# --- issue 12.6: client mistakes that used to be 500s --------------------------------------------

CHAT_OK = {"messages": [{"role": "user", "content": "hi"}]}


def _with_call(function: object) -> dict:
    call = {"id": "c1", "type": "function", "function": function}
    return {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}  # fmt: skip


@pytest.mark.parametrize(
    "raw, model, param",
    [
        (b'{"prompt": "x", "tools": ' + b"[" * 100 + b"]" * 100 + b"}", CompletionRequest, "tools"),
        (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", CompletionRequest, None),
        (b'{"prompt": "hi \\ud800"}', CompletionRequest, "prompt"),
        (b'{"prompt": ["\\udfff"]}', CompletionRequest, "prompt.0"),
        (b'{"prompt": "hi", "stop": ["\\ud800"]}', CompletionRequest, "stop.0"),
        (b'{"prompt": "hi", "\\ud800": 1}', CompletionRequest, "\ud800"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', ChatRequest,
         "messages.0.content"),
        (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
         ChatRequest, "messages.0.content.0.text"),
    ],
)  # fmt: skip
def test_hostile_json_is_400(raw, model, param):
    e = error_of(raw, model)
    assert e.param == param or e.param.startswith(f"{param}.")  # the deepest path too long to list
    assert e.code in ("invalid_json", "invalid_value")


def test_json_nested_5000_deep_is_400_whichever_refuses_it():
    """Python 3.11's parser refuses 5000 levels itself (a RecursionError: no path to name);
    3.12's parses them and check_json refuses past MAX_JSON_DEPTH, naming a path under prompt."""
    e = error_of(b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}", CompletionRequest)
    assert e.code == "invalid_json"
    assert e.param is None or e.param.startswith("prompt.")


def test_the_depth_bound_counts_the_top_object_as_level_one():
    """MAX_JSON_DEPTH levels pass, one more is refused naming where the deepest container sits
    (an empty one too: it is a level)."""

    def nested(levels: int) -> list:
        inner: list = []
        for _ in range(levels - 1):
            inner = [inner]
        return inner

    api.check_json({"x": nested(api.MAX_JSON_DEPTH - 1), "y": [1, {}]})
    with pytest.raises(ApiError) as e:
        api.check_json({"x": nested(api.MAX_JSON_DEPTH)})
    assert e.value.code == "invalid_json"
    assert e.value.param == ".".join(["x"] + ["0"] * (api.MAX_JSON_DEPTH - 1))


def test_the_json_walk_holds_one_open_container_per_level():
    """check_json pushed every container of a level with its path string before walking any:
    3.7M empty lists (11 MB of body) held 481 MB and 2.7 s of a parse slot. It holds the
    containers it is inside, so a wide body costs no memory beyond the parsed JSON."""
    import tracemalloc

    data = {"x": [[0] for _ in range(100_000)], "y": [{} for _ in range(100_000)]}
    tracemalloc.start()
    try:
        api.check_json(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100_000, peak


def test_surrogate_pairs_are_fine():
    assert parse(b'{"prompt": "\\ud83d\\ude00"}', CompletionRequest).prompt_text() == "\U0001f600"


@pytest.mark.parametrize("seed", [-(2**63) - 1, -(2**70), 2**64, 2**80])
def test_seed_out_of_range_is_400(seed):
    assert error_of({**CHAT_OK, "seed": seed}).param == "seed"


def test_seed_range_accepted():
    assert parse({**CHAT_OK, "seed": 0}).seed == 0
    assert parse({**CHAT_OK, "seed": 2**64 - 1}).seed == 2**64 - 1
    assert parse({**CHAT_OK, "seed": -(2**63)}).seed == 2**63  # OpenAI's int64 minimum


def test_a_negative_seed_samples_as_its_unsigned_64_bit_value(live):
    """OpenAI takes signed 64-bit seeds; a negative one was a 400. It wraps modulo 2**64 (-1 is
    2**64 - 1), so the same seed gives the same text, and so does its unsigned twin."""
    url = live.url + "/v1/chat/completions"

    def said(seed: int) -> str:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12,
                "temperature": 1.0, "seed": seed}  # fmt: skip
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    first = said(-1)
    assert said(-1) == first == said(2**64 - 1)
    assert said(-(2**63)) == said(2**63)


@pytest.mark.parametrize("function", ["get_weather", ["get_weather"], 3, None, {"arguments": "{}"},
                                      {"name": "f", "arguments": 5}])  # fmt: skip
def test_assistant_tool_call_function_must_be_an_object(function):
    assert error_of(_with_call(function)).param == "messages.1.tool_calls"


def test_assistant_tool_call_arguments_string_or_object():
    for args in ("{}", {"city": "Paris"}):
        parse(_with_call({"name": "f", "arguments": args}))
    parse(_with_call({"name": "f"}))


def test_char_bound_before_tokenising():
    api.check_chars(640, 64, 10, "prompt")
    with pytest.raises(ApiError) as e:
        api.check_chars(641, 64, 10, "prompt")
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"


def test_sampling_fields_reach_the_engine_and_a_bias_names_a_real_token():
    """mlx_lm.server's sampling fields (top_k, min_p, the penalties, logit_bias) reach the engine's
    parameters (they were dropped); a bias on an id past the vocabulary is a 400, not an index
    past the logits."""
    from engine.respond import sampling

    body = {"messages": [{"role": "user", "content": "x"}], "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.1, "repetition_context_size": 64, "presence_penalty": 1.5,
            "frequency_penalty": -0.5, "frequency_context_size": 32, "logit_bias": {"7": -100},
            "xtc_probability": 0.5, "xtc_threshold": 0.2}
    p = sampling(parse(body), [1] * 10, 4096, 100, xtc_keep=(2, 9))
    assert (p.xtc_probability, p.xtc_threshold, p.xtc_keep) == (0.5, 0.2, (2, 9))
    assert (p.top_k, p.min_p, p.repetition_penalty, p.repetition_context_size) == (20, 0.05, 1.1, 64)
    assert (p.presence_penalty, p.frequency_penalty, p.frequency_context_size) == (1.5, -0.5, 32)
    assert p.logit_bias == ((7, -100.0),) and p.presence_context_size == 20
    body["logit_bias"] = {"100": 5}
    with pytest.raises(ApiError) as e:
        sampling(parse(body), [1] * 10, 4096, 100)
    assert e.value.status == 400 and e.value.param == "logit_bias"


def test_a_top_k_of_the_whole_vocabulary_is_off():
    """top_k >= the vocabulary keeps every token: off (mlx-lm's top-k raises there)."""
    from engine.respond import sampling

    body = {"messages": [{"role": "user", "content": "x"}]}
    tops = [sampling(parse({**body, "top_k": k}), [1] * 10, 4096, 100).top_k for k in (99, 100, 10**9)]
    assert tops == [99, 0, 0]


def test_a_penalty_context_size_is_at_most_the_context():
    """A penalty looks back at most over the whole context (3e9 was a 500 from mlx-lm's 32-bit
    slice, failing the requests decoding beside it too)."""
    from engine.respond import sampling

    body = {"messages": [{"role": "user", "content": "x"}], "repetition_context_size": 3_000_000_000,
            "presence_context_size": 4096, "frequency_context_size": 64}  # fmt: skip
    p = sampling(parse(body), [1] * 10, 4096, 100)
    assert (p.repetition_context_size, p.presence_context_size, p.frequency_context_size) == (4096, 4096, 64)


def test_a_tool_choice_no_tool_answers_is_a_400():
    """required or a named function without tools, or a name none of the tools has: a 400 naming
    tool_choice, as OpenAI's (it was served, forcing a call of a function the client lacks)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = {"messages": [{"role": "user", "content": "x"}]}
    named = {"type": "function", "function": {"name": "g"}}
    for body in ({**chat, "tool_choice": "required"}, {**chat, "tool_choice": named},
                 {**chat, "tools": tools, "tool_choice": named}):  # fmt: skip
        with pytest.raises(ApiError) as e:
            parse(body).check_tool_choice()
        assert e.value.status == 400 and e.value.param == "tool_choice", body
    for choice in (None, "auto", "none", "required", {"type": "function", "function": {"name": "f"}}):
        parse({**chat, "tools": tools, "tool_choice": choice}).check_tool_choice()
    for choice in (None, "auto", "none"):  # without tools: nothing to force
        parse({**chat, "tool_choice": choice}).check_tool_choice()


def test_template_arguments_layer_server_then_effort_then_request():
    req = parse({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low",
                 "chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    defaults = {"enable_thinking": False, "reasoning_effort": "high", "other": 1}
    assert req.template_args(defaults) == {"enable_thinking": True, "reasoning_effort": "low", "other": 1}
    assert parse({"messages": [{"role": "user", "content": "x"}]}).template_args({}) == {}


def test_logprob_counts():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse(chat).logprob_count() == -1
    assert parse({**chat, "logprobs": True}).logprob_count() == 0
    assert parse({**chat, "logprobs": True, "top_logprobs": 5}).logprob_count() == 5
    with pytest.raises(ApiError) as e:
        parse({**chat, "top_logprobs": 2}).logprob_count()
    assert e.value.status == 400 and e.value.param == "top_logprobs"
    assert parse({"prompt": "x", "logprobs": 2}, CompletionRequest).logprob_count() == 2
    assert parse({"prompt": "x"}, CompletionRequest).logprob_count() == -1
    assert error_of({"prompt": "x", "logprobs": 6}, CompletionRequest).param == "logprobs"


@pytest.mark.parametrize("model, body", [
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}]}),
    (CompletionRequest, {"prompt": "x"}),
])
def test_stream_options_without_stream_is_400_as_openai_answers(model, body):
    """OpenAI: "The 'stream_options' parameter is only allowed when 'stream' is enabled" (a body
    asking for a usage chunk it would never get was served as if it had not asked)."""
    for stream in ({}, {"stream": False}):
        e = error_of({**body, **stream, "stream_options": {"include_usage": True}}, model)
        assert e.param == "stream_options" and "stream" in e.message
    assert parse({**body, "stream": True, "stream_options": {"include_usage": True}}, model).include_usage
    assert not parse({**body, "stream_options": None}, model).include_usage  # null: not given


NULLABLE = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
            "n", "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p")  # fmt: skip


@pytest.mark.parametrize("model, body, own", [
    (ChatRequest, {"messages": [{"role": "user", "content": "x", "name": None}]},
     ("max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
      "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs")),
    (CompletionRequest, {"prompt": "x"}, ("logprobs", "echo")),
])
def test_a_null_field_is_the_field_not_given(model, body, own):
    """OpenAI's fields are nullable and clients on typed SDKs or proxies send unset ones as null:
    ``"temperature": null`` or ``"n": null`` was a 400; it is the default now."""
    given = parse({**body, **{k: None for k in NULLABLE + own}}, model)
    assert given.model_dump() == parse(body, model).model_dump()
    assert given.temperature == 1.0 and given.n == 1 and given.stream is False
    assert error_of({**body, "temperature": "hot"}, model).param == "temperature"  # still checked


def test_a_completion_suffix_or_best_of_not_served_is_400():
    """``suffix`` (fill in the middle: the text after the insertion) and ``best_of`` > 1 were
    ignored, as ``echo`` was: an editor's completion written as if nothing followed the cursor.
    An empty suffix and a best_of of 1 ask for nothing more, and stay accepted."""
    assert error_of({"prompt": "def f(", "suffix": "\n    return x"}, CompletionRequest).param == "suffix"
    assert error_of({"prompt": "a", "best_of": 3}, CompletionRequest).param == "best_of"
    assert parse({"prompt": "a", "suffix": "", "best_of": 1}, CompletionRequest).prompt_text() == "a"


def test_json_past_max_json_values_is_refused_naming_its_field():
    """60k arrays nested 62 deep (7.5 MB, 3.7M values) were walked and validated for 3.7 s to a
    200. A body of more than MAX_JSON_VALUES values is a 400 naming the top-level field they are
    in, counted in check_json's one walk; as many pass."""
    n = api.MAX_JSON_VALUES
    api.check_json({"x": [0] * (n - 1)})  # the field's own value and its entries: n values
    with pytest.raises(ApiError) as e:
        api.check_json({"y": 1, "x": [[0] * 1000 for _ in range(n // 1000)]})
    assert e.value.status == 400 and e.value.code == "invalid_json" and e.value.param == "x"


def test_a_million_token_agent_conversation_is_within_max_json_values():
    """The bound is far from what a real client sends: a Claude Code-style conversation of 1M
    tokens (~4 characters a token) in short turns — a text, a tool call and its result each —
    with 100 tools holds a fraction of MAX_JSON_VALUES."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d"}
                                               for i in range(8)}, "required": ["p0"]}  # fmt: skip
    tools = [{"name": f"tool{i}", "description": "does a thing", "input_schema": schema}
             for i in range(100)]  # fmt: skip
    messages: list[dict] = [{"role": "user", "content": "fix the bug"}]
    chars = 0
    while chars < 4_000_000:
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": "Let me look at that file. " * 4},
            {"type": "tool_use", "id": "toolu_01", "name": "Read",
             "input": {"file_path": "/src/app/main.py", "offset": 1, "limit": 100}},
        ]})  # fmt: skip
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01",
             "content": [{"type": "text", "text": "x = 1\n" * 60}],
             "cache_control": {"type": "ephemeral"}},
        ]})  # fmt: skip
        chars += 104 + 360 + 60
    body = {"model": "m", "max_tokens": 8, "system": "s", "tools": tools, "messages": messages}
    api.check_json(body)

    def values(v) -> int:
        inner = v.values() if isinstance(v, dict) else v if isinstance(v, list) else ()
        return sum(1 + values(x) for x in inner)

    assert values(body) < api.MAX_JSON_VALUES / 4, values(body)


def test_a_body_surely_past_max_json_values_is_refused_before_it_is_parsed(monkeypatch):
    """16 MiB of ``[],`` took 1.0 s in json.loads (5.6M lists, the GIL held: every stream's decode
    waited) before check_json refused it. More commas outside strings than MAX_JSON_VALUES is more
    values for certain: the same 400, and json.loads never runs. Commas inside strings (escaped
    quotes and backslashes among them) are not counted: such bodies parse as before."""
    n = api.MAX_JSON_VALUES
    lists = b'{"messages": [], "x": [' + b"[]," * (n + 10) + b"[]]}"
    strings = b'{"x": [' + b'",\\\\",' * (n - 10) + b'""]}'  # n - 9 strings, each with a comma
    text = json.dumps({"messages": [{"role": "user", "content": 'a, "b",\\ ' * (n // 2)}]}).encode()
    assert text.count(b",") > n and strings.count(b",") > n
    assert api.surely_past_max_values(lists)
    assert not api.surely_past_max_values(strings) and not api.surely_past_max_values(text)
    parsed: list[int] = []
    real = json.loads

    def loads(raw: bytes) -> object:
        parsed.append(len(raw))
        return real(raw)

    monkeypatch.setattr(api.json, "loads", loads)
    with pytest.raises(ApiError) as e:
        api.parse_body(lists, ChatRequest)
    assert e.value.status == 400 and e.value.code == "invalid_json" and not parsed
    assert str(n) in e.value.message
    assert api.parse_body(text, ChatRequest).messages[0].content.startswith("a, ")
    assert parsed == [len(text)]
