# mypy: disable-error-code="arg-type,union-attr,index,attr-defined,call-overload"
# (the openai client types input items and tools as TypedDicts / unions; tests pass plain dicts)
"""engine/responses.py: OpenAI Responses requests become the chat requests the server serves, the
chat parser's output becomes output items and numbered events; over real HTTP with the official
``openai`` client (text and the cache on the tiny model; tool calls and reasoning scripted)."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import (
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseStreamEvent,
)

from engine import api, output, responses
from engine.errors import ApiError
from engine.events import Chunk, Usage
from engine.generate import Engine
from tests.serving import Scripted, hot_config, serve

FN = {"type": "function", "name": "get_weather", "description": "Weather of a city",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip
AGENTS = {"type": "namespace", "name": "multi_agent_v1", "description": "sub-agents",
          "tools": [{"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]}  # fmt: skip
TOOLS = [FN, AGENTS, {"type": "web_search", "external_web_access": False}]
ASK = "what is the weather in paris and in london today?"
TOOL_TEXT = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _chat(**kw) -> responses.ResponsesChat:
    return responses.to_chat(responses.ResponsesRequest.model_validate({"input": ASK, **kw}))


# --- requests → chat requests -------------------------------------------------------------------


def test_a_codex_shaped_input_becomes_the_chat_messages():
    chat = _chat(
        instructions="You are Codex.",
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Skills."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "Paris first."}], "encrypted_content": None},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": "and london?"},
        ],
        tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
        max_output_tokens=64, reasoning={"effort": "low", "summary": "auto"}, store=False,
        include=["reasoning.encrypted_content"], prompt_cache_key="abc",
    )  # fmt: skip
    got = chat.message_dicts()
    assert [m["role"] for m in got] == ["system", "developer", "user", "assistant", "tool", "user"]
    assert got[0]["content"] == "You are Codex." and got[1]["content"] == "Skills."
    assert got[3]["content"] == "Looking." and got[3]["reasoning_content"] == "Paris first."
    assert got[3]["tool_calls"] == [{"id": "call_1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]  # fmt: skip
    assert got[4] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert [t["function"]["name"] for t in chat.tool_dicts()] == ["get_weather", "close_agent"]  # web_search dropped
    assert chat.namespaces == {"close_agent": "multi_agent_v1"}
    assert chat.forced_tool() == "get_weather" and chat.parallel_tool_calls is False
    assert chat.requested_max() == 64 and chat.reasoning_effort == "low"


def test_function_calls_with_no_assistant_text_make_one_turn():
    chat = _chat(input=[{"role": "user", "content": ASK},
                        {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": "{}"},
                        {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "a", "output": [{"type": "input_text", "text": "x"}]},
                        {"type": "function_call_output", "call_id": "b", "output": "y"}])  # fmt: skip
    got = chat.message_dicts()
    assert [m["role"] for m in got] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in got[1]["tool_calls"]] == ["a", "b"] and got[2]["content"] == "x"


@pytest.mark.parametrize(
    "body",
    [
        {"input": ASK, "previous_response_id": "resp_1"},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]},
        {"input": [{"type": "web_search_call", "id": "ws"}]},
        {"input": [{"role": "robot", "content": "hi"}]},
        {"input": [{"type": "function_call", "call_id": "a", "arguments": "{}"}]},
        {"input": ASK, "tool_choice": {"type": "web_search"}},
        {"input": ASK, "tool_choice": "sometimes"},
        {"input": ASK, "max_output_tokens": 0},
        {"input": 5},
        {},
        {"input": []},
    ],
)
def test_client_mistakes_are_400s(body):
    with pytest.raises(ApiError) as e:
        responses.parse(json.dumps(body).encode())
    assert e.value.status == 400


def test_an_empty_input_names_input():
    """It named ``messages``, a field the Responses API does not have."""
    with pytest.raises(ApiError) as e:
        responses.parse(json.dumps({"input": [], "instructions": "Be brief."}).encode())
    assert e.value.param == "input"


def test_the_turn_bound_counts_the_input_items_that_render_a_token():
    """Before validation a Responses body's turns are counted on its items: a message and a
    function_call_output each become a chat message, a function_call a tool call (each renders a
    token at least: 400k calls took seconds to render before the prompt's length refused them),
    a reasoning item joins the next turn and is not counted: a user turn and 6 calls (with the
    assistant turn they make, 8 in the chat request) fit a context of 8 tokens by this bound, 8
    calls or 9 messages do not."""
    calls = [{"type": "function_call", "name": "f", "arguments": "{}", "call_id": str(i)}
             for i in range(8)]  # fmt: skip
    body = {"input": [{"role": "user", "content": ASK}, *calls[:6], {"type": "reasoning", "summary": []}]}
    chat = responses.parse(json.dumps(body).encode(), context_length=8)
    assert [m["role"] for m in chat.message_dicts()] == ["user", "assistant"]
    for items in ([{"role": "user", "content": ASK}, *calls], [{"role": "user", "content": ""}] * 9):
        with pytest.raises(ApiError) as e:
            responses.parse(json.dumps({"input": items}).encode(), context_length=8)
        assert e.value.code == "context_length_exceeded" and e.value.param == "input"
        assert "9 messages" in e.value.message


def test_the_tool_bound_counts_a_namespaces_tools_before_they_are_walked():
    """``api.MAX_TOOLS`` counts each tool a namespace holds, as the chat request counts them once
    flattened, before anything walks them: a namespace counted as one entry had its tools walked
    and flattened (300k in a 12 MB body: 1.4 s, 0.1 s listed flat) before the chat request refused
    them, so its malformed last tool, past the bound, was the error. As many in namespaces are
    served; a namespace's malformed tool is named by its path (it was by its index in the namespace)."""
    many = [{"type": "function", "name": f"f{i}"} for i in range(api.MAX_TOOLS)]
    split = [{"type": "namespace", "name": "a", "tools": many[:200]}, {"type": "namespace", "name": "b",
                                                                        "tools": many[200:]}]  # fmt: skip
    assert len(responses.parse(json.dumps({"input": ASK, "tools": split}).encode()).tool_dicts()) == api.MAX_TOOLS
    over = [{"type": "namespace", "name": "a", "tools": [*many, {"type": "function"}]}]
    with pytest.raises(ApiError) as e:
        responses.parse(json.dumps({"input": ASK, "tools": over}).encode())
    assert (e.value.param, e.value.code) == ("tools", "array_above_max_length"), e.value.message
    assert f"got {api.MAX_TOOLS + 1} instead" in e.value.message
    bad = [FN, {"type": "namespace", "name": "a", "tools": [FN, {"type": "function"}]}]
    with pytest.raises(ApiError) as e:
        responses.parse(json.dumps({"input": ASK, "tools": bad}).encode())
    assert e.value.param == "tools.1.tools.1"


def test_a_namespace_whose_tools_are_no_list_holds_none():
    chat = _chat(tools=[{"type": "namespace", "name": "n", "tools": 5}, FN])  # was a TypeError: a 500
    assert [t["function"]["name"] for t in chat.tool_dicts()] == ["get_weather"] and chat.namespaces == {}


# --- chat output → output items and events ------------------------------------------------------


def _run(pieces: list[str], reason: str = "stop", think: bool = False, **chat) -> tuple[responses.ResponsesOutput, list]:
    fmt = output.OutputFormat(think=("<think>", "</think>") if think else None)
    req = _chat(tools=TOOLS, **chat)
    parser = output.ChatOutput(fmt, req.tool_dicts(), True)
    out = responses.ResponsesOutput("m", parser, 40, req)
    events = _sent(out.start())
    usage = Usage(prompt_tokens=40, completion_tokens=3, cached_tokens=30, cache_tier="hot", ttft_seconds=0.1)  # fmt: skip
    for i, p in enumerate(pieces):
        last = i == len(pieces) - 1
        events += _sent(out.feed(Chunk(p, 1, reason if last else None, usage if last else None)))
    return out, events


def _sent(events: list[dict]) -> list[dict]:
    """The events as they went out (the server writes each at once; the response they carry
    goes on changing after)."""
    return json.loads(json.dumps(events))


def test_text_then_a_call_stream_as_a_message_item_and_a_function_call_item():
    out, events = _run([TOOL_TEXT[:20], TOOL_TEXT[20:40], TOOL_TEXT[40:]])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [(0, "message"), (1, "function_call")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["content"][0]["text"] == "Let me look." and done[0]["status"] == "completed"
    assert done[1]["name"] == "get_weather" and json.loads(done[1]["arguments"]) == {"city": "Paris"}
    assert kinds.index("response.output_text.done") < kinds.index("response.function_call_arguments.done")
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == done
    assert final["usage"]["input_tokens"] == 40
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 30, "cache_write_tokens": 0}
    assert out.body() == final


def test_a_namespaced_call_names_its_namespace_and_a_length_stop_is_incomplete():
    call = '<tool_call>\n{"name": "close_agent", "arguments": {"target": "a1"}}\n</tool_call>'
    _, events = _run([call])
    item = next(e["item"] for e in events if e["type"] == "response.output_item.done")
    assert item["name"] == "close_agent" and item["namespace"] == "multi_agent_v1"
    out, events = _run(["<think>\nhm", "m\n</think>\n\nIt is", " sunny"], reason="length", think=True)
    assert events[-1]["type"] == "response.incomplete"
    assert out.body()["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in out.body()["output"]] == ["reasoning", "message"]
    assert out.body()["output"][0]["content"][0]["text"] == "hmm"
    # the message the length cut short is incomplete (it said completed), the reasoning complete
    assert [i["status"] for i in out.body()["output"]] == ["completed", "incomplete"]


def test_a_reasoning_item_streams_its_content_part_as_a_message_does():
    """A reasoning item streamed ``reasoning_text.delta`` / ``.done`` with no
    ``response.content_part.added`` / ``.done`` around them; OpenAI's stream has them for a
    reasoning item's ``reasoning_text`` part as for a message's ``output_text`` part (the openai
    SDK's part union holds both). Every event is one of the SDK's types, and its accumulator
    (``ResponseStreamState``) takes the stream."""
    out, events = _run(["<think>\nParis", " first.\n</think>\n\nIt is", " sunny."], think=True)
    per_item: dict[int, list[str]] = {}
    for e in events:
        if "output_index" in e and per_item.get(e["output_index"], [""])[-1] != e["type"]:
            per_item.setdefault(e["output_index"], []).append(e["type"])  # (deltas in a row as one)
    for index, (item, text) in enumerate([("reasoning", "Paris first."), ("message", "It is sunny.")]):
        delta = "reasoning_text" if item == "reasoning" else "output_text"
        assert per_item[index] == ["response.output_item.added", "response.content_part.added",
                                   f"response.{delta}.delta", f"response.{delta}.done",
                                   "response.content_part.done", "response.output_item.done"]  # fmt: skip
        added, done = (e for e in events if e["type"].startswith("response.content_part.") and e["output_index"] == index)
        item_id = out.body()["output"][index]["id"]
        assert (added["item_id"], added["content_index"], done["item_id"], done["content_index"]) == (item_id, 0, item_id, 0)
        assert (added["part"]["type"], added["part"]["text"]) == (delta, "")
        assert done["part"] == out.body()["output"][index]["content"][0] and done["part"]["text"] == text
        ResponseContentPartAddedEvent.model_validate(added)  # the SDK's types, strictly
        ResponseContentPartDoneEvent.model_validate(done)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:  # as the SDK's stream reads them
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))


def test_usage_is_the_sdks_response_usage():
    """openai 3.63's ResponseUsage requires input_tokens_details.cache_write_tokens: a client
    that validates the usage it gets (``model_validate``) refused ours without it."""
    from openai.types.responses import ResponseUsage

    u = Usage(prompt_tokens=40, completion_tokens=3, cached_tokens=30, cache_tier="hot", ttft_seconds=0.1)
    got = ResponseUsage.model_validate(responses.usage_dict(u, 40))
    assert got.input_tokens_details.cache_write_tokens == 0  # as Anthropic's cache_creation_input_tokens
    assert got.input_tokens_details.cached_tokens == 30
    ResponseUsage.model_validate(responses.usage_dict(None, 40))


def test_instructions_are_echoed():
    """The response body said ``instructions: null`` whatever the request sent."""
    out, _ = _run(["Hi."], instructions="Be brief.")
    assert out.body()["instructions"] == "Be brief."
    assert _run(["Hi."])[0].body()["instructions"] is None


# --- over HTTP, with the openai client ----------------------------------------------------------


@pytest.fixture()
def client(tiny_model_dir, tmp_path):
    config = hot_config(tmp_path)
    with serve(lambda: Engine(tiny_model_dir, config), config) as s:
        yield s


def test_responses_and_the_cache_over_http(client):
    c = client.client
    first = c.responses.create(model="tiny", input=ASK, max_output_tokens=8, temperature=0)
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert first.usage.input_tokens > 10 and first.usage.input_tokens_details.cached_tokens == 0
    said = first.output_text
    history = [{"role": "user", "content": ASK}, {"role": "assistant", "content": said},
               {"role": "user", "content": "and tomorrow?"}]  # fmt: skip
    second = c.responses.create(model="tiny", input=history, max_output_tokens=4, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    # streamed (4 tokens: the stream ends in response.incomplete, as OpenAI's does at the limit)
    events = list(c.responses.create(model="tiny", input=history, max_output_tokens=4, temperature=0,
                                     stream=True))  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert "".join(deltas) == final.output_text == second.output_text  # greedy: the same words
    assert final.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 1


def test_errors_are_openai_shaped(client):
    r = httpx.post(client.url + "/v1/responses", json={"input": ASK, "previous_response_id": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    # a tool's parameters that are no object: named as the client sent them (it was
    # tools.0.function.parameters, the chat request's path)
    tools = [{"type": "function", "name": "f", "parameters": ["city"]}]
    r = httpx.post(client.url + "/v1/responses", json={"input": ASK, "tools": tools})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.0.parameters", r.text


@pytest.fixture()
def scripted(tiny_model_dir, tmp_path):
    config = hot_config(tmp_path)
    with serve(lambda: Scripted(Engine(tiny_model_dir, config), []), config) as s:
        yield s.client, s.app.state.server.engine


def test_a_function_call_round_trip(scripted):
    c, engine = scripted
    engine.script = [TOOL_TEXT[:20], TOOL_TEXT[20:33], TOOL_TEXT[33:]]
    with c.responses.stream(model="t", input=ASK, tools=TOOLS) as s:
        kinds = [e.type for e in s]
        resp = s.get_final_response()
    assert kinds[-1] == "response.completed"
    msg, call = resp.output
    assert msg.content[0].text == "Let me look." and call.type == "function_call"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    engine.script = ["It is ", "sunny."]
    again = c.responses.create(model="t", tools=TOOLS, input=[
        {"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in resp.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])  # fmt: skip
    assert again.output_text == "It is sunny." and again.usage.input_tokens_details.cached_tokens > 0


def test_reasoning_of_a_reasoning_model(family_dirs, tmp_path):
    script = ["<think>\nParis, so ", "the weather tool.\n</th", "ink>\n\n<tool_call>\n",
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']  # fmt: skip
    config = hot_config(tmp_path)
    with serve(lambda: Scripted(Engine(family_dirs["qwen3"], config), script), config) as live:
        resp = live.client.responses.create(model="t", input=ASK, tools=TOOLS)
    assert [o.type for o in resp.output] == ["reasoning", "function_call"]
    assert resp.output[0].content[0].text == "Paris, so the weather tool."


def test_ids_have_openais_prefixes(family_dirs, tmp_path):
    """A response is ``resp_…``, its items ``rs_…``, ``msg_…``, ``fc_…`` (and a call ``call_…``),
    streamed or not, as OpenAI's; they were ``resp-…``, ``rs-…``, ``msg-…``, ``fc-…``."""
    script = ["<think>\nParis.\n</think>\n\nLet me look.\n<tool_call>\n",
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>']  # fmt: skip
    config = hot_config(tmp_path)
    with serve(lambda: Scripted(Engine(family_dirs["qwen3"], config), []), config) as live:
        engine = live.app.state.server.engine
        engine.script = list(script)
        resp = live.client.responses.create(model="t", input=ASK, tools=TOOLS)
        engine.script = list(script)
        events = list(live.client.responses.create(model="t", input=ASK, tools=TOOLS, stream=True))
    streamed = events[-1].response
    for r in (resp, streamed):
        assert r.id.startswith("resp_"), r.id
        assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
        prefixes = [o.id.split("_")[0] + "_" for o in r.output]
        assert prefixes == ["rs_", "msg_", "fc_"], [o.id for o in r.output]
        assert r.output[2].call_id.startswith("call_")
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [o.id for o in streamed.output]
