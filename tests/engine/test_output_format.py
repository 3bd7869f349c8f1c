"""engine/output_format.py: what a tokenizer's output format says: where the output starts (in a
think block or not) and the text that forces a call, on the families' real templates
(``family_dirs``, as in test_output.py), and the Hermes fallback."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine import chat
from engine.output import ChatOutput
from engine.output_format import OutputFormat
from tests.engine.parsing import OSLO, fmt_and_prompt, in_pieces, named_calls, run_output
from tests.serving import TOOLS


def test_reasoning_start_state_from_prompt(family_dirs):
    """Templates that open the think block in the generation prompt start the output in reasoning."""
    opened = {f for f in family_dirs if f != "llama-3.3" and _opens(family_dirs, f)}
    assert {"glm-4.7", "minimax-m2", "deepseek-r1-distill"} <= opened
    assert "qwen3" not in opened and "kimi-k2" not in opened
    fmt, prompt = fmt_and_prompt(family_dirs, "deepseek-r1-distill")
    out = ChatOutput(fmt, None, parse_tools=False, start_in_reasoning=fmt.opens_reasoning(prompt))
    got, finish = run_output(out, ["Let me think", ".\n</th", "ink>\n\nIt is ", "sunny."])
    assert (got.reasoning, got.content, finish) == ("Let me think.", "It is sunny.", "stop")


def test_a_think_marker_quoted_in_the_conversation_opens_nothing(family_dirs):
    """A user message quoting the opener (an agent reading code about reasoning models) put the
    whole answer in reasoning, content empty: only the generation prompt opens a think block."""
    checked = 0
    for family in family_dirs:
        fmt, _ = fmt_and_prompt(family_dirs, family)
        if fmt.think is None:
            continue
        tok = load_tokenizer(family_dirs[family])
        quoting = [{"role": "user", "content": f"Why is THINK_START = '{fmt.think[0]}' here?"}]
        prompt = chat.render_chat(tok, quoting, TOOLS)
        assert fmt.think[0] in prompt, family
        assert fmt.opens_reasoning(prompt) == _opens(family_dirs, family), family
        checked += 1
    assert checked >= 5


@pytest.mark.parametrize(
    "prompt, continued, opened",
    [
        ("<|user|>hi<|assistant|><think>Let me", "<think>Let me", True),  # the prefill opened it
        ("<|user|>hi<|assistant|><think>a</think>It is", "<think>a</think>It is", False),
        ("<|user|>hi<|assistant|><think>\nLet me", "Let me", True),  # the template opened it
        ("<|user|>hi<|assistant|><think>\na</think>It is", "a</think>It is", False),
        ("<|user|>what is <think>?<|assistant|>Sure", "Sure", False),
    ],
)  # fmt: skip
def test_a_continued_assistant_message_decides_by_its_own_markers(prompt, continued, opened):
    fmt = OutputFormat(think=("<think>", "</think>"))
    assert fmt.opens_reasoning(prompt, continued) is opened


def _opens(family_dirs: dict, family: str) -> bool:
    fmt, prompt = fmt_and_prompt(family_dirs, family)
    return fmt.opens_reasoning(prompt)


def test_hermes_fallback_without_mlx_parser():
    """A tokenizer without an mlx-lm parser (SmolLM2's template ignores tools): Hermes, as injected."""
    fmt = OutputFormat.of(object())
    assert fmt.parser_name == "hermes" and fmt.think is None
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n</tool_call>'
    got, finish = run_output(ChatOutput(fmt, TOOLS), in_pieces(text, 5))
    assert (got.content, named_calls(got), finish) == ("Let me look.", [OSLO], "tool_calls")


def test_forced_prefixes(family_dirs):
    named = {"type": "function", "function": {"name": "get_weather"}}
    hermes = OutputFormat()
    assert hermes.forced_prefix("required") == "<tool_call>\n"
    assert hermes.forced_prefix(named) == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert hermes.forced_prefix("auto") == ""
    fmt, _ = fmt_and_prompt(family_dirs, "qwen3-coder")
    prefix = fmt.forced_prefix(named)
    assert prefix == "<tool_call>\n<function=get_weather>\n"
    out = ChatOutput(fmt, TOOLS)
    got, finish = run_output(
        out, [prefix, "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"]
    )
    assert named_calls(got) == [OSLO] and finish == "tool_calls"
    # required: the opener and the newline after it where the format writes one (GLM's name follows
    # its opener at once: it got Hermes' newline; MiniMax-M2's ``<invoke`` goes on a line of its own)
    openers = {"qwen3-coder": "<tool_call>\n", "glm-4.7": "<tool_call>", "minimax-m2": "<minimax:tool_call>\n",
               "deepseek-v3.2": "<｜DSML｜function_calls>\n", "minimax-m3": "]<]minimax[>[<tool_call>\n"}
    for family, opener in openers.items():
        assert fmt_and_prompt(family_dirs, family)[0].forced_prefix("required") == opener, family


def test_a_forced_deepseek_call_names_its_function_in_dsml(family_dirs):
    """DeepSeek V3.2's named call: the prompt opens the block and its ``invoke``; the model writes the
    parameters, and the call comes back (its arguments are not enforced: no grammar of them)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    fmt, _ = fmt_and_prompt(family_dirs, "deepseek-v3.2")
    prefix = fmt.forced_prefix(named)
    assert prefix == '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n' and fmt.named_close() is None
    rest = '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>'
    got, finish = run_output(ChatOutput(fmt, TOOLS), [prefix, rest])
    assert named_calls(got) == [OSLO] and finish == "tool_calls"


def test_a_forced_deepseek_v31_call_is_its_json_arguments(family_dirs):
    """DeepSeek V3.1's named call: the prompt opens the block and the call to the function; the
    model writes its arguments, a JSON object a grammar holds to the tool's schema, then the ends."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    fmt, _ = fmt_and_prompt(family_dirs, "deepseek-v3.1")
    prefix = fmt.forced_prefix(named)
    assert prefix == "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    assert fmt.named_close() == "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    assert fmt.forced_prefix("required") == "<｜tool▁calls▁begin｜>"
    got, finish = run_output(ChatOutput(fmt, TOOLS), [prefix, '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'])
    assert named_calls(got) == [OSLO] and finish == "tool_calls"


def test_a_forced_kimi_call_is_numbered_after_the_calls_before_it(family_dirs):
    """Kimi's call ids are ``functions.NAME:N``, N counting the conversation's calls: every forced
    call was ``:0``, so tool results in the history named one id for several calls."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    fmt, _ = fmt_and_prompt(family_dirs, "kimi-k2")
    assert fmt.parser_name == "kimi_k2"
    ids = []
    for before in (0, 2):
        prefix = fmt.forced_prefix(named, before)
        assert f"functions.get_weather:{before}" in prefix
        got, _ = run_output(ChatOutput(fmt, TOOLS), [prefix, '{"city": "Oslo"}<|tool_call_end|>'
                                               "<|tool_calls_section_end|>"])  # fmt: skip
        assert named_calls(got) == [OSLO]
        ids.append(got.tool_calls[0]["id"])
    assert ids[0] != ids[1]
