"""engine/output.py: every tool-call format mlx-lm ships, reasoning split, streamed = whole, plain text untouched.

Each case renders a prompt with the family's real chat template on the tiny model directory
(``family_dirs``: the tiny model wearing the template and the family's marker tokens) and loads the
tokenizer through mlx-lm, so the tool parser and think markers are the ones mlx-lm infers for the real
model. Templates: llama.cpp's ``models/templates/<file>`` (as vendored in the pinned llama-cpp-python
sdist, ``engine/models/templates.py``), which llama.cpp copied from the model's Hugging Face repository
named in ``SOURCES``. Model outputs are canned, written in the syntax the same template uses to render an
assistant tool call in history. What the format says before any output (where it starts, the text
that forces a call) is in test_output_format.py; the checks on a block's calls in test_tool_calls.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.items import Items
from engine.output import ChatOutput, Delta
from engine.output_format import OutputFormat
from tests.engine.parsing import OSLO, PARIS, fmt_and_prompt, in_pieces, named_calls, run_output
from tests.serving import TOOLS

M3 = "]<]minimax[>["  # MiniMax-M3's namespace token, before each of its tags

# family → the Hugging Face repository whose template llama.cpp keeps (templates.FAMILIES names the file)
SOURCES = {
    "qwen3-coder": "Qwen/Qwen3-Coder-30B-A3B-Instruct (llama.cpp models/templates/Qwen3-Coder.jinja)",
    "qwen3": "Qwen/Qwen3-0.6B (llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja)",
    "glm-4.6": "zai-org/GLM-4.6 (llama.cpp models/templates/GLM-4.6.jinja)",
    "glm-4.7": "zai-org/GLM-4.7-Flash (llama.cpp models/templates/GLM-4.7-Flash.jinja)",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct (llama.cpp models/templates/moonshotai-Kimi-K2.jinja)",
    "kimi-k2-thinking": "moonshotai/Kimi-K2-Thinking (llama.cpp models/templates/Kimi-K2-Thinking.jinja)",
    "hy3": "tencent/Hy3 (llama.cpp models/templates/tencent-Hy3.jinja)",
    "kimi-k3": "moonshotai/Kimi-K3 (llama.cpp models/templates/Kimi-K3.jinja)",
    "minimax-m3": "MiniMaxAI/MiniMax-M3 (llama.cpp models/templates/MiniMax-M3.jinja)",
    "minimax-m2": "MiniMaxAI/MiniMax-M2 (llama.cpp models/templates/MiniMax-M2.jinja)",
    "devstral": "unsloth/Devstral-Small-2507 (llama.cpp models/templates/unsloth-mistral-Devstral-Small-2507.jinja)",
    "mistral-small-3.2": "mistralai/Mistral-Small-3.2-24B-Instruct-2506 (llama.cpp models/templates/Mistral-Small-3.2-24B-Instruct-2506.jinja)",
    "gemma-4": "google/gemma-4-31B-it (llama.cpp models/templates/google-gemma-4-31B-it.jinja)",
    "gemma-2": "google/gemma-2-2b-it (llama.cpp models/templates/google-gemma-2-2b-it.jinja)",
    "deepseek-v3.1": "deepseek-ai/DeepSeek-V3.1 (llama.cpp models/templates/deepseek-ai-DeepSeek-V3.1.jinja)",
    "deepseek-v3.2": "deepseek-ai/DeepSeek-V3.2 (llama.cpp models/templates/deepseek-ai-DeepSeek-V3.2.jinja)",
    "nemotron-nano-v2": "nvidia/NVIDIA-Nemotron-Nano-9B-v2 (llama.cpp models/templates/NVIDIA-Nemotron-Nano-v2.jinja)",
    "command-r7b": "CohereForAI/c4ai-command-r7b-12-2024 (llama.cpp models/templates/CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja)",
    "cohere2-moe": "Cohere's MoE chat models (llama.cpp models/templates/Cohere2MoE.jinja)",
    "apriel-1.6": "ServiceNow-AI/Apriel-1.6-15b-Thinker (llama.cpp models/templates/Apriel-1.6-15b-Thinker-fixed.jinja)",
    "granite-3.3": "ibm-granite/granite-3.3-2b-instruct (llama.cpp models/templates/ibm-granite-granite-3.3-2B-Instruct.jinja)",
    "apertus": "swiss-ai/Apertus-8B-Instruct-2509 (llama.cpp models/templates/Apertus-8B-Instruct.jinja)",
    "seed-oss": "ByteDance-Seed/Seed-OSS-36B-Instruct (llama.cpp models/templates/ByteDance-Seed-OSS.jinja)",
    "gigachat-3.1": "ai-sage/GigaChat3.1-10B-A1.8B (llama.cpp models/templates/GigaChat3.1-10B-A1.8B.jinja)",
    "lfm2.5": "LiquidAI/LFM2.5-8B-A1B (llama.cpp models/templates/LFM2.5-8B-A1B.jinja)",
    "llama-3.3": "meta-llama/Llama-3.3-70B-Instruct (llama.cpp models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja)",
    "deepseek-r1-distill": "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (llama.cpp models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja)",
}

# family, parser mlx-lm picks, canned output, expected reasoning, expected content, expected calls
CASES: list[tuple[str, str, str, str, str, list[dict[str, Any]]]] = [
    (
        "qwen3-coder",
        "qwen3_coder",
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
        "",
        "I'll check.",
        [PARIS, OSLO],
    ),
    (
        "qwen3",
        "json_tools",
        "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
        "The user wants the weather.",
        "",
        [PARIS],
    ),
    (
        "glm-4.6",
        "glm47",
        "<think>Need the weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
        "<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "Need the weather.",
        "",
        [PARIS],
    ),
    (  # the generation prompt opens <think>: the output starts in reasoning
        "glm-4.7",
        "glm47",
        "Need the weather.</think><tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Oslo</arg_value></tool_call>",
        "Need the weather.",
        "",
        [OSLO],
    ),
    (
        "kimi-k2",
        "kimi_k2",
        "Checking both.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|>'
        "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
        '{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>',
        "",
        "Checking both.",
        [PARIS, OSLO],
    ),
    (
        "kimi-k2-thinking",
        "kimi_k2",
        "<think>Two cities.</think><|tool_calls_section_begin|><|tool_call_begin|>"
        'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
        "<|tool_calls_section_end|>",
        "Two cities.",
        "",
        [OSLO],
    ),
    (  # opens <think>\n in the generation prompt
        "minimax-m2",
        "minimax_m2",
        'Check the weather.\n</think>\n\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        '<parameter name="city">Paris</parameter>\n<parameter name="days">3</parameter>\n'
        "</invoke>\n</minimax:tool_call>",
        "Check the weather.",
        "",
        [PARIS],
    ),
    (  # no end marker: the call runs to the end of the output
        "devstral",
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}',
        "",
        "Sure.",
        [PARIS],
    ),
    (
        "mistral-small-3.2",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}'
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
        "",
        "",
        [PARIS, OSLO],
    ),
    (
        "gemma-4",
        "gemma4",
        "<|channel>thought\nWeather lookup.<channel|>"
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>',
        "Weather lookup.",
        "",
        [PARIS],
    ),
    (
        "lfm2.5",
        "pythonic",
        'One moment.<|tool_call_start|>[get_weather(city="Paris", days=3), '
        'get_weather(city="Oslo")]<|tool_call_end|>',
        "",
        "One moment.",
        [PARIS, OSLO],
    ),
    (  # XTML (mlx-lm's parser): the prompt opens its think block; an empty answer, then the calls, then
        # its message's end
        "kimi-k3",
        "kimi_k3",
        "Two cities.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris'
        '<|close|>argument<|sep|><|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|>'
        '<|close|>call<|sep|><|open|>call tool="get_weather" index="2"<|sep|><|open|>argument key="city" '
        'type="string"<|sep|>Oslo<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
        "<|close|>message<|sep|>",
        "Two cities.",
        "",
        [PARIS, OSLO],
    ),
    (  # every tag ending :opensource, GLM-like keys and values (mlx-lm has no parser); its generation prompt
        # closes the think block by default (no_think)
        "hy3",
        "hy3",
        "<tool_calls:opensource>\n<tool_call:opensource>get_weather<tool_sep:opensource>\n"
        "<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Paris</arg_value:opensource>\n"
        "<arg_key:opensource>days</arg_key:opensource>\n<arg_value:opensource>3</arg_value:opensource>\n"
        "</tool_call:opensource>\n<tool_call:opensource>get_weather<tool_sep:opensource>\n"
        "<arg_key:opensource>city</arg_key:opensource>\n<arg_value:opensource>Oslo</arg_value:opensource>\n"
        "</tool_call:opensource>\n</tool_calls:opensource>",
        "",
        "",
        [PARIS, OSLO],
    ),
    (  # its tags after a namespace token (mlx-lm has no parser: it takes the template for a JSON one);
        # <mm:think>, its template's words
        "minimax-m3",
        "minimax_m3",
        f"<mm:think>Two cities.</mm:think>{M3}<tool_call>\n{M3}<invoke name=\"get_weather\">{M3}<city>Paris{M3}</city>"
        f"{M3}<days>3{M3}</days>{M3}</invoke>\n{M3}<invoke name=\"get_weather\">{M3}<city>Oslo{M3}</city>"
        f"{M3}</invoke>\n{M3}</tool_call>",
        "Two cities.",
        "",
        [PARIS, OSLO],
    ),
    (  # its own markup (mlx-lm has no parser; its template lists no tools: the server writes DeepSeek's
        # instructions into the system turn); its generation prompt opens <think> (mlx-lm's default)
        "deepseek-v3.1",
        "deepseek_v31",
        'Two cities.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", '
        '"days": 3}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        "Two cities.",
        "",
        [PARIS, OSLO],
    ),
    (  # DSML markup (mlx-lm has no parser): a string argument as written, string="false" as JSON; its
        # generation prompt opens <think> (its template's default here)
        "deepseek-v3.2",
        "dsml",
        'Two cities.</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        "Two cities.",
        "",
        [PARIS, OSLO],
    ),
    (  # JSON between markers of its own (mlx-lm has no parser; chat.template_call_block finds them); its
        # generation prompt opens <think>
        "nemotron-nano-v2",
        "json_block",
        'Two cities.\n</think>\n<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]</TOOLCALL>',
        "Two cities.",
        "",
        [PARIS, OSLO],
    ),
    (  # Cohere's list of {"tool_call_id", "tool_name", "parameters"}, after its own think markers
        "command-r7b",
        "json_block",
        '<|START_THINKING|>Two cities.<|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris", '
        '"days": 3}},\n    {"tool_call_id": "1", "tool_name": "get_weather", "parameters": {"city": "Oslo"}}\n]'
        "<|END_ACTION|>",
        "Two cities.",
        "",
        [PARIS, OSLO],
    ),
    (  # Qwen3-Coder's XML in <seed:tool_call>, after <seed:think> (neither known to mlx-lm)
        "seed-oss",
        "qwen3_coder",
        "<seed:think>Two cities.</seed:think>\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris"
        "</parameter>\n<parameter=days>3</parameter>\n</function>\n</seed:tool_call>\n<seed:tool_call>\n"
        "<function=get_weather>\n<parameter=city>Oslo</parameter>\n</function>\n</seed:tool_call>",
        "Two cities.",
        "",
        [PARIS, OSLO],
    ),
    (  # its generation prompt opens the reasoning ("Here are my reasoning steps:"), a text marker ends it
        "apriel-1.6",
        "json_block",
        "The user wants two cities.\n[BEGIN FINAL RESPONSE]\n<tool_calls>[{\"name\": \"get_weather\", "
        '"arguments": {"city": "Paris", "days": 3}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
        "</tool_calls>",
        "The user wants two cities.",
        "",
        [PARIS, OSLO],
    ),
    (  # <|tool_call|> (its instructions name it; its template writes no call back) and a JSON list, to the end
        "granite-3.3",
        "json_block",
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
        "",
        "",
        [PARIS, OSLO],
    ),
    (  # a list of {NAME: ARGUMENTS}
        "apertus",
        "json_block",
        'Checking.<|tools_prefix|>[{"get_weather": {"city": "Paris", "days": 3}}, '
        '{"get_weather": {"city": "Oslo"}}]<|tools_suffix|>',
        "",
        "Checking.",
        [PARIS, OSLO],
    ),
    (  # one object after its opener, to the end of the output
        "gigachat-3.1",
        "json_block",
        '<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
        "",
        "",
        [PARIS],
    ),
    (  # no markers (mlx-lm has no parser): the whole answer is the call, as the template writes it back
        "llama-3.3",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        "",
        "",
        [PARIS],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_family_tool_calls_whole_and_streamed(family_dirs, case):
    family, parser, output, reasoning, content, calls = case
    fmt, prompt = fmt_and_prompt(family_dirs, family)
    assert fmt.parser_name == parser, SOURCES[family]
    start = fmt.opens_reasoning(prompt)
    whole, finish = run_output(ChatOutput(fmt, TOOLS, start_in_reasoning=start), [output])
    assert (whole.reasoning, whole.content, named_calls(whole)) == (reasoning, content, calls)
    assert finish == "tool_calls"
    assert [c["index"] for c in whole.tool_calls] == list(range(len(calls)))
    for n in (1, 2, 7):  # markers split over pieces in every way
        out = ChatOutput(fmt, TOOLS, start_in_reasoning=start)
        streamed, finish = run_output(out, in_pieces(output, n))
        assert (streamed.reasoning, streamed.content, named_calls(streamed)) == (
            reasoning,
            content,
            calls,
        )
        assert out.result.content == streamed.content and finish == "tool_calls"


@pytest.mark.parametrize(
    ("family", "output", "reasoning"),
    [
        ("command-r7b", "<|START_RESPONSE|>Paris is sunny, 21°C.\n\n- no rain <|END_RESPONSE|>", ""),
        # (its generation prompt opens the think block)
        ("cohere2-moe", "The user wants the weather.<|END_THINKING|><|START_TEXT|>Paris is sunny, 21°C.\n\n- no rain "
                        "<|END_TEXT|>", "The user wants the weather."),
        # mlx-lm's structural markers: its answer's, then its message's end (nothing after it is output)
        ("kimi-k3", "The user wants the weather.<|close|>think<|sep|><|open|>response<|sep|>Paris is sunny, 21°C.\n\n"
                    "- no rain <|close|>response<|sep|><|close|>message<|sep|>", "The user wants the weather."),
    ],
)  # fmt: skip
def test_answer_markers_are_not_content(family_dirs, family, output, reasoning):
    """Cohere's models and Kimi K3 write their answer between markers (Command R7B's
    ``<|START_RESPONSE|>``, the MoE's ``<|START_TEXT|>``, Kimi K3's ``<|open|>response<|sep|>``) that
    their templates write back around the content: content is the text between them, exactly
    (before, the markers were content too — Kimi K3's message end as well, which mlx_lm.server
    strips — and the next turn rendered them twice, so its prompt parted from the cached turn)."""
    fmt, prompt = fmt_and_prompt(family_dirs, family)
    start = fmt.opens_reasoning(prompt)
    for n in (1, 2, 7, len(output)):
        out = ChatOutput(fmt, TOOLS, start_in_reasoning=start)
        got, finish = run_output(out, in_pieces(output, n))
        assert (got.reasoning, got.content, got.tool_calls, finish) == (
            reasoning, "Paris is sunny, 21°C.\n\n- no rain ", [], "stop")  # fmt: skip
        # where the content is in the text (its tokens' log-probabilities are listed by it): its trailing
        # space before the answer's end marker too
        assert "".join(output[a:b] for a, b in zip(out.shown.starts, out.shown.ends, strict=True)) == got.content


@pytest.mark.parametrize("family", ["minimax-m3", "qwen3"])
def test_an_empty_think_block_the_output_opens_with_is_nothing(family_dirs, family):
    """MiniMax-M3 thinks when it decides to; when it does not, it opens its answer with the think
    block's end, as its template writes such a turn back (``</mm:think>answer``): that end is no
    content, nor is whitespace around it, however the text comes in pieces; anywhere else it is
    (a quoted marker stays quoted)."""
    fmt, _ = fmt_and_prompt(family_dirs, family)
    assert fmt.think is not None, family
    end = fmt.think[1]
    for n in (1, 3, 100):
        got, finish = run_output(ChatOutput(fmt, TOOLS), in_pieces(f" {end}\nParis is sunny.", n))
        assert (got.reasoning, got.content, finish) == ("", "Paris is sunny.", "stop")
    got, _ = run_output(ChatOutput(fmt, TOOLS), in_pieces(f"Use {end} to end it.", 2))
    assert got.content == f"Use {end} to end it."
    for text in ("<", " <", "</"):  # only a start of it, then the end of the output: text
        assert run_output(ChatOutput(fmt, TOOLS), [text])[0].content == text


def test_every_family_streams_what_it_says_whole(family_dirs):
    """Texts made of each family's markers (think, answer, message end, call block), words,
    whitespace and a call, cut anywhere: the streamed result is the whole one, and the content is
    exactly the characters its spans point at (fixed seed: 60 texts a family)."""
    import random

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine import chat

    rng = random.Random(7)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for family, path in family_dirs.items():
        tok = load_tokenizer(path)
        fmt = OutputFormat.of(tok)
        if fmt.harmony:  # (engine/harmony.py reads gpt-oss's messages)
            continue
        start = fmt.opens_reasoning(chat.render_chat(tok, [{"role": "user", "content": "hi"}], TOOLS))
        frags = [f for f in ("hello", " ", "\n", "x y", call, *(fmt.think or ()), *(fmt.frame or ()), fmt.close, *fmt.tool) if f]
        for _ in range(60):
            text = "".join(rng.choice(frags) for _ in range(rng.randint(1, 8)))
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            whole, finish = run_output(ChatOutput(fmt, TOOLS, start_in_reasoning=start), [text])
            out = ChatOutput(fmt, TOOLS, start_in_reasoning=start)
            streamed, streamed_finish = run_output(out, pieces)
            said = (whole.content, whole.reasoning, named_calls(whole), finish)
            assert said == (streamed.content, streamed.reasoning, named_calls(streamed), streamed_finish), (family, pieces)
            shown = "".join(text[a:b] for a, b in zip(out.shown.starts, out.shown.ends, strict=True))
            assert shown == streamed.content, (family, pieces)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_family_plain_text_untouched(family_dirs, case):
    fmt, _ = fmt_and_prompt(family_dirs, case[0])
    text = "Paris is sunny, 21°C.\n\n- no rain\n- light wind "
    whole, finish = run_output(ChatOutput(fmt, TOOLS), in_pieces(text, 3))
    assert (whole.content, whole.reasoning, whole.tool_calls, finish) == (text, "", [], "stop")


def test_reasoning_without_tools_and_tool_choice_none(family_dirs):
    fmt, _ = fmt_and_prompt(family_dirs, "qwen3")
    text = '<think>\nhmm\n</think>\n\n<tool_call>\n{"name": "x", "arguments": {}}\n</tool_call>'
    got, finish = run_output(ChatOutput(fmt, TOOLS, parse_tools=False), [text])
    assert got.reasoning == "hmm" and got.content.startswith("<tool_call>") and finish == "stop"


def test_truncated_reasoning_is_reasoning_and_length(family_dirs):
    fmt, _ = fmt_and_prompt(family_dirs, "qwen3")
    got, finish = run_output(ChatOutput(fmt, TOOLS), ["<think>\nstill thinking about"], "length")
    assert (got.reasoning, got.content, finish) == ("still thinking about", "", "length")


def test_unparseable_block_is_content(family_dirs):
    fmt, _ = fmt_and_prompt(family_dirs, "qwen3-coder")
    bad = "<tool_call>\nnot a function\n</tool_call>"
    got, finish = run_output(ChatOutput(fmt, TOOLS), in_pieces(bad, 4))
    assert got.content == bad and got.tool_calls == [] and finish == "stop"


def test_parallel_tool_calls_false_keeps_the_first(family_dirs):
    fmt, _ = fmt_and_prompt(family_dirs, "kimi-k2")
    got, _ = run_output(ChatOutput(fmt, TOOLS, parallel_tool_calls=False), [CASES[4][2]])
    assert named_calls(got) == [PARIS]


# --- Llama 3.x: calls without markers (the whole output is the call's JSON) ----------------------


@pytest.mark.parametrize(
    "text, content, calls, finish",
    [
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
         '{"name": "get_weather", "parameters": {"city": "Oslo"}}', "", [PARIS, OSLO], "tool_calls"),
        ('\n\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n', "", [OSLO], "tool_calls"),
        ('{"city": "Paris", "days": 3}', '{"city": "Paris", "days": 3}', [], "stop"),  # an answer
        ('{"name": "Bob", "parameters": {}}', '{"name": "Bob", "parameters": {}}', [], "stop"),
        ('{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", '
         '"parameters": {"city": "Par', [], "length"),  # cut short by max_tokens: text
        ("<|pyt is not a tag", "<|pyt is not a tag", [], "stop"),
        ('It is {"sunny": true}.', 'It is {"sunny": true}.', [], "stop"),
    ],
    ids=["python-tag-two-calls", "arguments-key", "json-answer", "unknown-name", "cut-short",
         "tag-lookalike", "json-inside-text"],
)  # fmt: skip
def test_llama_whole_output_calls(family_dirs, text, content, calls, finish):
    fmt, _ = fmt_and_prompt(family_dirs, "llama-3.3")
    reason = "length" if finish == "length" else "stop"
    for n in (1, 3, len(text)):
        got, end = run_output(ChatOutput(fmt, TOOLS), in_pieces(text, n), reason)
        assert (got.content, named_calls(got), end) == (content, calls, finish)


def test_llama_plain_text_streams_at_once(family_dirs):
    """Only an output that starts as a call is held: text streams from its first character."""
    fmt, _ = fmt_and_prompt(family_dirs, "llama-3.3")
    out = ChatOutput(fmt, TOOLS)
    assert out.feed("\n").content == "" and out.feed("Sun").content == "\nSun"
    held = ChatOutput(fmt, TOOLS)
    assert held.feed('{"name": "get_we').content == ""


def test_llama_forced_calls_and_parallel_false(family_dirs):
    fmt, _ = fmt_and_prompt(family_dirs, "llama-3.3")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert fmt.forced_prefix("required") == '{"name": "'
    prefix = fmt.forced_prefix(named)
    assert prefix == '{"name": "get_weather", "parameters": '
    got, finish = run_output(ChatOutput(fmt, TOOLS), [prefix, '{"city": "Oslo"}}'])
    assert (named_calls(got), finish) == ([OSLO], "tool_calls")
    two = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}};' + prefix + '{"city": "Oslo"}}'
    got, _ = run_output(ChatOutput(fmt, TOOLS, parallel_tool_calls=False), [two])
    assert named_calls(got) == [PARIS]
    got, _ = run_output(ChatOutput(fmt, TOOLS, parse_tools=False), [two])  # tool_choice "none": text
    assert (got.content, got.tool_calls) == (two, [])


def test_sse_deltas_shape():
    d = Delta("hi", "why", [{"index": 0, "id": "call_1", "type": "function", "function": {}}])
    assert d.sse_deltas() == [
        {"reasoning_content": "why", "reasoning": "why"},
        {"content": "hi"},
        {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {}}]},
    ]


# --- Hermes (the injected format; also the tiny model's own template) ---------------------------


def _hermes(pieces: list[str], **kw: Any) -> tuple[Delta, str | None]:
    return run_output(ChatOutput(OutputFormat(), TOOLS, **kw), pieces)


def test_hermes_single_call_with_text():
    got, _ = _hermes(
        [
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        ]
    )
    call = got.tool_calls[0]
    assert got.content == "Let me check." and call["type"] == "function"
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


AB = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in "ab"]


def test_hermes_parallel_calls_string_arguments():
    one = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>'
    two = '<tool_call>\n{"name": "b", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    got, _ = run_output(ChatOutput(OutputFormat(), AB), [one + "\n" + two + "\n"])
    assert got.content == "" and [c["function"]["name"] for c in got.tool_calls] == ["a", "b"]
    assert json.loads(got.tool_calls[1]["function"]["arguments"]) == {"x": 1}


def test_hermes_invalid_block_stays_text():
    text = "<tool_call>\nnot json\n</tool_call> done"
    got, finish = _hermes([text])
    assert (got.content, got.tool_calls, finish) == (text, [], "stop")


def test_hermes_streaming_holds_text_from_opener():
    out = ChatOutput(OutputFormat(), AB)
    pieces = [
        "Sure",
        " <tool",
        '_call>\n{"name": ',
        '"a", "arguments": {}}',
        "\n</tool_",
        "call>",
        " bye",
    ]
    shown = [out.feed(p) for p in pieces]
    tail, _ = out.finish("stop")
    assert "".join(d.content for d in shown) + tail.content == "Sure bye"
    assert shown[1].content == "" and shown[2].content == "" and out.calls.n == 1


def test_hermes_unclosed_complete_json_is_a_call():
    got, finish = _hermes(
        ['<tool_call>\n{"name": "get_weather", "arguments": ', '{"city": "Oslo"}}']
    )
    assert named_calls(got) == [OSLO] and finish == "tool_calls"


def test_hermes_disabled_passes_text():
    got, _ = _hermes(["<tool_call>{}</tool_call>"], parse_tools=False)
    assert got.content == "<tool_call>{}</tool_call>"


def test_whitespace_streams_at_once_when_no_marker_can_follow():
    """With no tool parsing and no think markers nothing can follow whitespace that would make it
    "not text": a first "\\n" token is shown at once (it was held to the end: TTFT = total time
    for a model that begins with newlines). With a marker to parse it is still held."""
    plain = ChatOutput(OutputFormat(), TOOLS, parse_tools=False)
    assert plain.feed("\n").content == "\n" and plain.feed("\n Hi").content == "\n Hi"
    parsing = ChatOutput(OutputFormat(), TOOLS)
    assert parsing.feed("\n").content == "" and parsing.feed("Hi").content == "\nHi"


@pytest.mark.parametrize(
    "family, text",
    [
        ("glm-4.7", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par"),
        ("glm-4.6", "<tool_call>get_wea"),
        ("kimi-k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                    '<|tool_call_argument_begin|>{"city": "Par'),
        ("qwen3", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),
    ],
)  # fmt: skip
def test_a_call_cut_by_max_tokens_is_text_never_a_call(family_dirs, family, text):
    """Lenient parsers (GLM's, Kimi's) made calls of a block whose end never came: a write_file
    without its content, a call to ``get_wea``; the client ran them."""
    fmt, _ = fmt_and_prompt(family_dirs, family)
    for pieces in ([text], in_pieces(text, 5)):
        got, finish = run_output(ChatOutput(fmt, TOOLS), ["Let me look. ", *pieces], "length")
        assert (got.tool_calls, finish) == ([], "length")
        assert got.content == "Let me look. " + text, family


@pytest.mark.parametrize(
    "text, reasoning, content, calls",
    [
        ("<think>\nI should answer with a <tool_call> block? No, just answer.\n</think>\n\nParis is sunny.",
         "I should answer with a <tool_call> block? No, just answer.", "Paris is sunny.", []),
        ('<think>\nCall it.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
         "</tool_call>\nThen answer.\n</think>\n\nDone.", "Call it.\nThen answer.", "Done.", [OSLO]),
    ],
)  # fmt: skip
def test_a_call_block_opened_inside_reasoning_closes_back_into_it(family_dirs, text, reasoning, content, calls):
    """A think block mentioning the call opener sent the rest of the reasoning and ``</think>``
    into content; a call made while thinking (GLM, Qwen3) left ``</think>`` in content."""
    fmt, _ = fmt_and_prompt(family_dirs, "qwen3")
    for n in (len(text), 1, 4):
        got, _ = run_output(ChatOutput(fmt, TOOLS), in_pieces(text, n))
        assert (got.reasoning, got.content, named_calls(got)) == (reasoning, content, calls), n


@pytest.mark.parametrize("family", ["minimax-m2", "kimi-k2-thinking", "glm-4.7"])
def test_interleaved_thinking_keeps_each_channel_readable(family_dirs, family):
    """MiniMax-M2, Kimi-K2-Thinking and GLM-4.7 think again mid-answer: the whitespace around the
    second think block was dropped on both sides ("…files.Now the answer.", "Plan A.Check B.")."""
    fmt, prompt = fmt_and_prompt(family_dirs, family)
    text = "Plan A.\n</think>\n\nI read the files.\n\n<think>\nCheck B.\n</think>\n\nNow the answer."
    if not fmt.opens_reasoning(prompt):  # Kimi's generation prompt leaves the opener to the model
        text = "<think>" + text
    for n in (len(text), 1, 3):
        got, _ = run_output(ChatOutput(fmt, TOOLS, start_in_reasoning=fmt.opens_reasoning(prompt)),
                      in_pieces(text, n))  # fmt: skip
        assert (got.reasoning, got.content) == ("Plan A.\nCheck B.", "I read the files.\n\nNow the answer.")


@pytest.mark.parametrize(
    "text, reasoning, content",
    [("<think>Plan A.</think><think>Check B.</think>The answer.", "Plan A.\nCheck B.", "The answer."),
     ("<think>Plan A.</think>\n\n<think>Check B.</think>\n\nThe answer.", "Plan A.\nCheck B.", "The answer."),
     ("<think>Plan A.\n\n</think><think>Check B.</think>The answer.", "Plan A.\n\nCheck B.", "The answer."),
     ("<think>A.</think><think>B.</think><think>C.</think>", "A.\nB.\nC.", ""),
     ("The answer is <think>Check.</think>42.", "Check.", "The answer is 42."),
     ("The answer is<think>Check.</think>42.", "Check.", "The answer is42.")],
)  # fmt: skip
@pytest.mark.parametrize("family", ["qwen3", "glm-4.7"])
def test_think_blocks_back_to_back_keep_a_separator(family_dirs, family, text, reasoning, content):
    """Think blocks written back to back joined in ``reasoning_content`` ("Plan A.Check B."), and
    the space before a think block in mid-answer was lost ("The answer is42."). A channel that
    resumes keeps the whitespace the model wrote at the break (after it, else before it); two
    think blocks with none are two thoughts: a newline. Content gets no whitespace the model did
    not write. Typed items (Anthropic, Responses) carry the same reasoning."""
    fmt, prompt = fmt_and_prompt(family_dirs, family)
    start = fmt.opens_reasoning(prompt)
    if start:  # GLM-4.7's generation prompt opens the first block
        text = text.removeprefix("<think>") if text.startswith("<think>") else "</think>" + text
    for n in (len(text), 1, 3):
        out, items, steps = ChatOutput(fmt, TOOLS, start_in_reasoning=start), Items(), []
        for piece in in_pieces(text, n):
            steps += items.steps(out.feed(piece))
        tail, finish = out.finish("stop")
        steps += items.steps(tail) + items.close()
        assert (out.result.reasoning, out.result.content, finish) == (reasoning, content, "stop"), n
        # (a content item after a reasoning one starts without the separator: items are apart)
        assert "".join(x for step, kind, x in steps if (step, kind) == ("text", "reasoning")) == reasoning


def test_glm_unclosed_call_block_ended_by_the_think_block_is_reasoning(family_dirs):
    """GLM's lenient parser made a call of a mention of the opener the think block ended inside
    (``read_file {'raw': 'with the path, then wait.'}``): a tool the model never called."""
    fmt, prompt = fmt_and_prompt(family_dirs, "glm-4.7")
    tools = TOOLS + [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    text = "I should emit <tool_call>read_file with the path, then wait.</think>I'll read it."
    for n in (len(text), 1, 5):
        got, finish = run_output(ChatOutput(fmt, tools, start_in_reasoning=fmt.opens_reasoning(prompt)),
                           in_pieces(text, n))  # fmt: skip
        assert (got.tool_calls, finish, got.content) == ([], "stop", "I'll read it.")
        assert got.reasoning == "I should emit <tool_call>read_file with the path, then wait."
