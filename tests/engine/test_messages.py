# mypy: disable-error-code="arg-type,union-attr,index,attr-defined"
# (the anthropic client types messages and blocks as TypedDicts / unions; tests pass plain dicts)
"""engine/messages.py: Anthropic Messages requests become the chat requests the server serves, the
chat parser's output becomes content blocks and named events; over real HTTP with the official
``anthropic`` client (plain text and the cache on the tiny model; tool calls and thinking scripted)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pydantic
import pytest

from engine import messages, output
from engine.errors import ApiError
from engine.events import Chunk, Hit, Usage
from engine.generate import Engine
from tests.serving import AUTH, Scripted, ScriptedTurns, hot_config, serve

TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]  # fmt: skip
USER = [{"role": "user", "content": "what is the weather in paris and in london today?"}]
GREEDY = {"temperature": 0}  # the API has dropped sampling fields; the server still takes them
TOOL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _req(**kw) -> messages.MessagesRequest:
    return messages.MessagesRequest.model_validate({"max_tokens": 16, "messages": USER, **kw})


# --- requests → chat requests -------------------------------------------------------------------


def test_a_tool_conversation_becomes_the_chat_messages_agents_send():
    req = _req(
        system=[{"type": "text", "text": "You are terse."},
                {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
        messages=USER + [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Paris first.", "signature": "x"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "and london?"}]},
        ],
        tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"], top_k=5, temperature=0.5, thinking={"type": "disabled"},
        output_config={"effort": "low"},
    )  # fmt: skip
    chat = messages.to_chat(req)
    got = chat.message_dicts()
    assert got[0] == {"role": "system", "content": "You are terse.\n\nUse tools."}
    assert got[1] == {"role": "user", "content": USER[0]["content"]}
    assert got[2]["role"] == "assistant" and got[2]["content"] == "Looking."
    assert got[2]["reasoning_content"] == "Paris first."
    assert got[2]["tool_calls"] == [{"id": "toolu_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]  # fmt: skip
    assert got[3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert got[4] == {"role": "user", "content": "and london?"}
    assert len(got) == 5
    tool = chat.tool_dicts()[0]["function"]
    assert tool["name"] == "get_weather" and tool["parameters"] == TOOLS[0]["input_schema"]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop_tuple() == ("END",) and chat.top_k == 5 and chat.temperature == 0.5
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.requested_max() == 16
    assert chat.reasoning_effort == "low"


def test_a_system_turn_among_the_messages_stays_where_it_is():
    """Claude Code (2.1.332) sends its environment as a system turn after the first user turn."""
    env = [{"type": "text", "text": "# Environment\n - Platform: linux"}]
    chat = messages.to_chat(_req(system="S", messages=USER + [{"role": "system", "content": env}]))
    assert [m["role"] for m in chat.message_dicts()] == ["system", "user", "system"]
    assert chat.message_dicts()[-1]["content"] == env[0]["text"]


def test_tool_choice_by_name_and_an_error_result():
    chat = messages.to_chat(_req(
        tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"},
        messages=USER + [
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "no such city",
                                          "is_error": True}]},
        ],
    ))  # fmt: skip
    assert chat.forced_tool() == "get_weather"
    assert chat.message_dicts()[-1] == {"role": "tool", "tool_call_id": "t", "content": "Error: no such city"}


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "tool", "content": "hi"}]},
        {"messages": USER + [{"role": "system", "content": [{"type": "tool_use", "name": "x", "input": {}}]}]},
        {"messages": USER, "tool_choice": {"type": "sometimes"}},
        {"messages": USER, "tool_choice": {"type": "tool"}},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {}}]}]},
        {"messages": USER, "tools": [{"description": "no name"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": USER, "max_tokens": 0},
        {"messages": USER, "temperature": 1.5},
        {"messages": []},
    ],
)
def test_client_mistakes_are_400s(body):
    with pytest.raises(ApiError) as e:
        messages.parse(json.dumps({"max_tokens": 8, **body}).encode())
    assert e.value.status == 400
    assert e.value.param != "max_tokens" or body.get("max_tokens") == 0  # each case its own mistake
    assert messages.error_body(e.value)["error"]["type"] == "invalid_request_error"


def test_an_input_schema_that_is_no_object_names_it():
    """It was named ``tools.0.function.parameters``, the chat form's name, not the request's."""
    body = {"max_tokens": 8, "messages": USER, "tools": [{"name": "x", "input_schema": "str"}]}
    with pytest.raises(ApiError) as e:
        messages.parse(json.dumps(body).encode())
    assert e.value.param == "tools.0.input_schema"


def test_max_tokens_is_required_but_not_to_count_tokens():
    """Anthropic requires max_tokens (a request without it generated to the end of the context);
    count_tokens takes none."""
    with pytest.raises(ApiError) as e:
        messages.parse(json.dumps({"messages": USER}).encode())
    assert e.value.status == 400 and e.value.param == "max_tokens"
    assert messages.error_body(e.value)["error"]["message"] == "max_tokens: Field required"
    chat = messages.parse(json.dumps({"messages": USER}).encode(), messages.CountTokensRequest)
    assert chat.max_tokens is None


# --- chat output → content blocks and events ----------------------------------------------------


def _usage(completion: int = 3) -> Usage:
    return Usage(prompt_tokens=40, completion_tokens=completion, cached_tokens=30, cache_tier="hot",
                 ttft_seconds=0.1)  # fmt: skip


def _run(pieces: list[str], reason: str = "stop", think: bool = False,
         stop: str | None = None) -> tuple[messages.MessagesOutput, list]:  # fmt: skip
    fmt = output.OutputFormat(think=("<think>", "</think>") if think else None)
    out = messages.MessagesOutput("m", output.ChatOutput(fmt, TOOLS, True), 40)
    events = out.start(Hit(tokens=30, tier="hot"))
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        events += out.feed(Chunk(p, 1, reason if last else None, _usage() if last else None,
                                 stop_sequence=stop if last else None))  # fmt: skip
    return out, events


def test_a_tool_call_streams_as_a_text_block_then_a_tool_use_block():
    out, events = _run([TOOL_TEXT[:20], TOOL_TEXT[20:40], TOOL_TEXT[40:]])
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["cache_read_input_tokens"] == 30
    assert events[0]["message"]["usage"]["input_tokens"] == 10
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "text"), (1, "tool_use")]
    assert starts[1]["content_block"]["input"] == {} and starts[1]["content_block"]["name"] == "get_weather"
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")  # fmt: skip
    args = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
            and e["delta"]["type"] == "input_json_delta"]  # fmt: skip
    assert text == "Let me look." and [json.loads(a) for a in args] == [{"city": "Paris"}]
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]  # each block stopped once, text before the call starts
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert events[-2]["usage"] == {"input_tokens": 10, "cache_creation_input_tokens": 0,
                                   "cache_read_input_tokens": 30, "output_tokens": 3, "cache_tier": "hot"}  # fmt: skip
    body = out.body()
    assert body["content"] == [{"type": "text", "text": "Let me look."},
                               {"type": "tool_use", "id": starts[1]["content_block"]["id"],
                                "name": "get_weather", "input": {"city": "Paris"}}]  # fmt: skip
    assert body["stop_reason"] == "tool_use" and body["usage"]["output_tokens"] == 3


def test_thinking_then_text_and_a_length_stop():
    out, events = _run(["<think>\nParis", ", so sunny.\n</think>\n\nIt is", " sunny."], reason="length", think=True)
    assert out.body()["content"] == [{"type": "thinking", "thinking": "Paris, so sunny.", "signature": ""},
                                     {"type": "text", "text": "It is sunny."}]  # fmt: skip
    assert out.body()["stop_reason"] == "max_tokens"
    deltas = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert deltas == ["thinking_delta", "thinking_delta", "text_delta", "text_delta"]


def test_a_stop_string_is_the_stop_sequence():
    out, events = _run(["It is ", "sunny"], stop="\n\n")
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}
    assert out.body()["stop_reason"] == "stop_sequence" and out.body()["stop_sequence"] == "\n\n"
    out, _ = _run(["It is ", "sunny"])
    assert out.body()["stop_reason"] == "end_turn" and out.body()["stop_sequence"] is None


# --- over HTTP, with the anthropic client -------------------------------------------------------


@pytest.fixture()
def client(tiny_model_dir, tmp_path):
    config = hot_config(tmp_path)
    with serve(lambda: Engine(tiny_model_dir, config), config) as s:
        yield anthropic.Anthropic(base_url=s.url, api_key="sekret", max_retries=0), s


def test_messages_and_the_cache_over_http(client):
    c, _ = client
    first = c.messages.create(model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY)
    assert first.type == "message" and first.role == "assistant"
    assert first.stop_reason in ("end_turn", "max_tokens") and first.usage.output_tokens <= 8
    assert first.usage.cache_read_input_tokens == 0 and first.usage.input_tokens > 10
    history = USER + [{"role": "assistant", "content": first.content},
                      {"role": "user", "content": "and tomorrow?"}]  # fmt: skip
    second = c.messages.create(model="tiny", max_tokens=4, messages=history, extra_body=GREEDY)
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens
    # streamed: the events assemble into the same kind of message, and the cache says so
    with c.messages.stream(model="tiny", max_tokens=4, messages=history, extra_body=GREEDY) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == "".join(b.text for b in final.content if b.type == "text")
    assert final.content[0].text == second.content[0].text  # greedy: the same words
    assert final.usage.cache_read_input_tokens >= second.usage.input_tokens + second.usage.cache_read_input_tokens - 1
    assert final.usage.output_tokens == second.usage.output_tokens
    count = c.messages.count_tokens(model="tiny", messages=history)
    assert count.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
    # a stop sequence from the greedy text itself: the text ends before it, and it is named
    said = first.content[0].text
    assert len(said) >= 4, said
    stop = said[len(said) // 2 :]
    cut = c.messages.create(model="tiny", max_tokens=8, messages=USER, extra_body=GREEDY,
                            stop_sequences=[stop])  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == said[: said.index(stop)]


def test_the_anthropic_sdk_lists_and_retrieves_the_model(client):
    """``models.list`` / ``models.retrieve`` of the anthropic SDK (Claude Code asks for the model):
    the one ``/v1/models`` path carries Anthropic's fields beside OpenAI's. It had OpenAI's only:
    no ``type``, ``display_name``, ``created_at`` or ``lifecycle``, and no page fields."""
    c, s = client
    page = c.models.list()
    (model,) = page.data
    assert model.type == "model" and model.display_name == model.id and model.created_at.year >= 2024
    assert page.has_more is False and page.first_id == page.last_id == model.id
    got = c.models.retrieve(model.id)
    assert got.id == model.id and got.type == "model" and got.lifecycle == "active"
    raw = httpx.get(s.url + "/v1/models/" + model.id, headers={"x-api-key": "sekret"}).json()
    assert raw["object"] == "model" and raw["owned_by"] == "tiered-kv"  # OpenAI's, as before
    assert anthropic.types.ModelInfo.model_validate(raw).created_at == got.created_at


def test_errors_are_anthropic_shaped(client):
    c, live = client
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="tiny", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]}])  # fmt: skip
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(live.url + "/v1/messages", content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(live.url + "/v1/messages", json={"messages": USER})  # no max_tokens
    assert r.status_code == 400 and r.json()["error"] == {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}  # fmt: skip
    assert httpx.post(live.url + "/v1/messages/count_tokens", json={"messages": USER}).status_code == 200
    # a tool_choice no tool answers (it was served, forcing a call of an unknown tool)
    for choice, tools in (({"type": "tool", "name": "nope"}, TOOLS), ({"type": "any"}, None)):
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="tiny", max_tokens=2, messages=USER, tool_choice=choice,
                              **({"tools": tools} if tools else {}))  # fmt: skip
        assert e.value.body["error"]["type"] == "invalid_request_error"
        assert "tool_choice" in e.value.body["error"]["message"]


@pytest.fixture()
def scripted(tiny_model_dir, tmp_path):
    config = hot_config(tmp_path)
    with serve(lambda: Scripted(Engine(tiny_model_dir, config), []), config) as s:
        yield anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0), s.app.state.server.engine


def test_a_tool_call_round_trip(scripted):
    c, engine = scripted
    engine.script = [TOOL_TEXT[:20], TOOL_TEXT[20:33], TOOL_TEXT[33:]]
    with c.messages.stream(model="t", max_tokens=64, messages=USER, tools=TOOLS) as s:
        events = [e.type for e in s]
        msg = s.get_final_message()
    assert events.count("content_block_start") == 2 and events[-1] == "message_stop"
    assert msg.stop_reason == "tool_use" and msg.content[0].text == "Let me look."
    use = msg.content[1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    # the client answers with a tool_result: the next turn renders and runs
    engine.script = ["It is ", "sunny."]
    history = USER + [{"role": "assistant", "content": msg.content},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": "sunny, 21C"}]}]  # fmt: skip
    again = c.messages.create(model="t", max_tokens=64, messages=history, tools=TOOLS)
    assert again.content[0].text == "It is sunny." and again.stop_reason == "end_turn"
    assert again.usage.cache_read_input_tokens > 0


def test_an_assistant_prefill_is_continued(tiny_model_dir, tmp_path):
    """A last message of the assistant's is text the model goes on from, as Anthropic's API does
    (a client prefills ``{`` for JSON): the prompt started a new assistant turn after it."""
    config = hot_config(tmp_path)
    engine = None

    def make():
        nonlocal engine
        engine = ScriptedTurns(Engine(tiny_model_dir, config), [[" 42."]])
        return engine

    with serve(make, config) as live:
        c = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)
        prefill = [*USER, {"role": "assistant", "content": "The answer is"}]
        msg = c.messages.create(model="t", max_tokens=8, messages=prefill)
    assert msg.content[0].text == " 42."
    assert engine is not None and engine.prompts[-1].endswith("The answer is")


def test_thinking_of_a_reasoning_model(family_dirs, tmp_path):
    script = ["<think>\nParis, so ", "the weather tool.\n</th", "ink>\n\n<tool_call>\n",
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']  # fmt: skip
    config = hot_config(tmp_path)
    with serve(lambda: Scripted(Engine(family_dirs["qwen3"], config), script), config) as live:
        c = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)
        msg = c.messages.create(model="t", max_tokens=64, messages=USER, tools=TOOLS)
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == "Paris, so the weather tool." and msg.content[1].input == {"city": "Paris"}
    assert msg.id.startswith("msg_"), msg.id  # Anthropic's prefix (it was msg-)


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body


def test_the_api_key_as_x_api_key(guarded):
    """Anthropic's key header; a missing or wrong key is Anthropic's authentication_error (it was
    an OpenAI-shaped body: the anthropic SDK found no error type in it)."""
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        _anthropic_error(httpx.post(guarded.url + path, json=body), 401, "authentication_error")
    wrong = httpx.post(guarded.url + "/v1/messages", json=body, headers={"x-api-key": "wrong"})
    _anthropic_error(wrong, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=guarded.url, api_key="wrong", max_retries=0).messages.create(
            model="t", max_tokens=2, messages=USER)  # fmt: skip
    assert e.value.body["error"]["type"] == "authentication_error"
    ok = httpx.post(guarded.url + "/v1/messages", json=body, headers={"x-api-key": "sekret"})
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    assert httpx.post(guarded.url + "/v1/messages", json=body, headers=AUTH).status_code == 200


def test_unknown_paths_and_methods_under_messages_are_anthropic_shaped(guarded):
    """404 / 405 under /v1/messages are Anthropic's error objects (they were OpenAI's)."""
    _anthropic_error(httpx.get(guarded.url + "/v1/messages", headers=AUTH), 405, "invalid_request_error")
    _anthropic_error(httpx.post(guarded.url + "/v1/messages/nothing", headers=AUTH), 404, "not_found_error")
    r = httpx.get(guarded.url + "/v1/nothing", headers=AUTH)  # elsewhere: OpenAI's
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_a_length_cut_after_a_call_is_max_tokens():
    """The output was cut: ``tool_use`` won over ``max_tokens`` (a client ran the calls as the
    turn's end, the cut text lost)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    out, events = _run([call, "\nAnd then I will"], reason="length")
    assert [b["type"] for b in out.body()["content"]] == ["tool_use", "text"]
    assert out.body()["stop_reason"] == "max_tokens"
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"


def test_text_after_a_call_in_one_chunk_comes_after_its_tool_use_block():
    """A chunk holding a call's end and the text after it: the text block came before the call."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call'
    out, _ = _run(["Checking.\n", call, ">\nAfter the call."])
    blocks = out.body()["content"]
    assert [b["type"] for b in blocks] == ["text", "tool_use", "text"]
    assert blocks[0]["text"] == "Checking." and blocks[2]["text"].strip() == "After the call."


def test_thinking_at_the_end_leaves_no_whitespace_block_and_a_resumed_block_no_separator():
    """The whitespace after a last think block became a text block of its own ('\\n\\n': Anthropic
    refuses such a block sent back in history); a block resumed after thinking began with it."""
    out, _ = _run(["Hi.<think>hmm</think>\n\n"], think=True)
    assert [(b["type"], b.get("text", b.get("thinking"))) for b in out.body()["content"]] == [
        ("text", "Hi."), ("thinking", "hmm")]  # fmt: skip
    out, _ = _run(["Plan.\n<think>\nCheck B.\n</think>\n\nMore."], think=True)
    assert [(b["type"], b.get("text", b.get("thinking"))) for b in out.body()["content"]] == [
        ("text", "Plan."), ("thinking", "Check B."), ("text", "More.")]  # fmt: skip


def test_a_call_block_cut_by_a_stop_string_is_text():
    """A stop string that lands inside a call block cuts it as max_tokens does: a lenient parser
    made a half call of it, and the turn ended in tool_use."""
    half = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    out, _ = _run(["Let me look.\n", half], stop="\n</tool_call>")
    assert [b["type"] for b in out.body()["content"]] == ["text"]
    assert out.body()["content"][0]["text"].endswith(half)
    assert out.body()["stop_reason"] == "stop_sequence"


def test_tool_use_ids_are_anthropics_and_round_trip_while_chat_calls_keep_openais(tiny_model_dir, tmp_path):
    """A tool_use block's id is Anthropic's ``toolu_…``, streamed and not (it was OpenAI's
    ``call_…``); the chat API's calls keep ``call_``; a tool_result naming the id is the next turn,
    whose prompt holds the result after the call and hits the cache."""
    call = TOOL_TEXT.split("<tool_call>")[1].split("</tool_call>")[0]
    scripts = [["<tool_call>", call, "</tool_call>"] for _ in range(3)] + [["It is ", "sunny."]]
    config = hot_config(tmp_path)
    engine = None

    def make():
        nonlocal engine
        engine = ScriptedTurns(Engine(tiny_model_dir, config), scripts)
        return engine

    with serve(make, config) as live:
        c = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)
        whole = c.messages.create(model="t", max_tokens=64, messages=USER, tools=TOOLS)
        with c.messages.stream(model="t", max_tokens=64, messages=USER, tools=TOOLS) as s:
            starts = [e.content_block for e in s if e.type == "content_block_start"]
            streamed = s.get_final_message()
        chat = live.client.chat.completions.create(
            model="t", messages=USER, tools=[{"type": "function", "function": {
                "name": "get_weather", "parameters": dict(TOOLS[0]["input_schema"])}}])  # fmt: skip
        uses = [whole.content[0], streamed.content[0], starts[0]]
        assert all(u.type == "tool_use" and u.id.startswith("toolu_") for u in uses), uses
        assert starts[0].id == streamed.content[0].id and whole.content[0].id != streamed.content[0].id
        assert chat.choices[0].message.tool_calls[0].id.startswith("call_")
        use = whole.content[0]
        history: list = [*USER, {"role": "assistant", "content": whole.content},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                         "content": "sunny, 21C"}]}]  # fmt: skip
        again = c.messages.create(model="t", max_tokens=64, messages=history, tools=TOOLS)
    assert again.content[0].text == "It is sunny." and again.stop_reason == "end_turn"
    assert (again.usage.cache_read_input_tokens or 0) >= whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)
    assert engine is not None and engine.prompts[-1].index('"get_weather"') < engine.prompts[-1].index("sunny, 21C")


def test_an_id_the_model_wrote_is_kept_and_rendered_back(family_dirs, tmp_path):
    """Kimi writes its own ids (``functions.NAME:N``) and its template renders them back where the
    model wrote them: the Messages API keeps them (a ``toolu_`` id in their place would differ from
    the cached tokens of the call), and the next turn renders the id the tool_result names."""
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')  # fmt: skip
    config = hot_config(tmp_path)
    engine = None

    def make():
        nonlocal engine
        engine = ScriptedTurns(Engine(family_dirs["kimi-k2"], config), [[call], ["It is sunny."]])
        return engine

    with serve(make, config) as live:
        c = anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)
        first = c.messages.create(model="t", max_tokens=64, messages=USER, tools=TOOLS)
        use = first.content[0]
        assert use.type == "tool_use" and use.id == "functions.get_weather:0", first.content
        history: list = [*USER, {"role": "assistant", "content": first.content},
                           {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                         "content": "sunny, 21C"}]}]  # fmt: skip
        again = c.messages.create(model="t", max_tokens=64, messages=history, tools=TOOLS)
    assert again.content[0].text == "It is sunny."
    assert (again.usage.cache_read_input_tokens or 0) >= first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0)
    assert engine is not None and call.split("<|tool_call_argument_begin|>")[0] in engine.prompts[-1]


def _raw_events(text: str) -> list[tuple[str | None, dict]]:
    """An SSE body's named events: (the ``event:`` name, the data's object)."""
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            out.append((name, json.loads(line.removeprefix("data:"))))
            name = None
    return out


def test_bodies_and_events_are_the_sdks_types(family_dirs, tmp_path):
    """The raw body and every raw event parse as the ``anthropic`` SDK's own models, with no field
    beyond them but the usage's ``cache_tier``; each event is named by its type; the events go
    message_start, blocks (start, deltas, stop, indexed in order), message_delta, message_stop."""
    script = ["<think>\nParis, so ", "the weather tool.\n</think>\n\nLet me look.", "\n<tool_call>\n",
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']  # fmt: skip
    config = hot_config(tmp_path)
    body = {"model": "t", "max_tokens": 64, "messages": USER, "tools": TOOLS}
    with serve(lambda: Scripted(Engine(family_dirs["qwen3"], config), script), config) as live:
        whole = httpx.post(live.url + "/v1/messages", json=body).json()
        streamed = httpx.post(live.url + "/v1/messages", json={**body, "stream": True}).text
    msg = anthropic.types.Message.model_validate(whole)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"] and msg.stop_reason == "tool_use"
    assert _extra(msg) == {"usage": {"cache_tier": "none"}}
    events = _raw_events(streamed)
    assert all(name == data["type"] for name, data in events), events
    parse = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent).validate_python
    typed = [parse(data) for _, data in events]
    assert all(set(_extra(e)) <= {"message", "usage"} for e in typed), [_extra(e) for e in typed]
    kinds = [e.type for e in typed]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    blocks = [e for e in typed[1:-2] if e.type != "content_block_delta"]
    assert [(e.type, e.index) for e in blocks] == [(t, i) for i in range(3)
                                                  for t in ("content_block_start", "content_block_stop")]
    assert [e.content_block.type for e in blocks[::2]] == ["thinking", "text", "tool_use"]
    assert typed[-2].delta.stop_reason == "tool_use" and typed[-2].usage.output_tokens == msg.usage.output_tokens


def _extra(m: pydantic.BaseModel) -> dict:
    """The fields of ``m`` and of the models in it that its type does not have, by where they are."""
    out: dict = dict(m.model_extra or {})
    for name in type(m).model_fields:
        value = getattr(m, name)
        for i, v in enumerate(value if isinstance(value, list) else [value]):
            if isinstance(v, pydantic.BaseModel) and (inner := _extra(v)):
                out[name if not isinstance(value, list) else f"{name}.{i}"] = inner
    return out
