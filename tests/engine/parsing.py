"""Helpers of the output parser's tests (tests/engine/test_output.py, test_output_format.py,
test_tool_calls.py): a family's output format and generation prompt, read through mlx-lm from the
tiny model wearing the family's template (``family_dirs``), and a :class:`ChatOutput` run over text
pieces."""

from __future__ import annotations

import json
from typing import Any

from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine import chat
from engine.output import ChatOutput, Delta
from engine.output_format import OutputFormat
from tests.serving import TOOLS

USER = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Weather?"},
]
PARIS = {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
OSLO = {"name": "get_weather", "arguments": {"city": "Oslo"}}


def fmt_and_prompt(family_dirs: dict, family: str) -> tuple[OutputFormat, str]:
    tok = load_tokenizer(family_dirs[family])
    prompt = chat.render_chat(tok, USER, TOOLS)  # as the server renders it (Gemma 2 takes no system turn)
    return OutputFormat.of(tok), prompt


def run_output(out: ChatOutput, pieces: list[str], reason: str = "stop") -> tuple[Delta, str | None]:
    got = Delta()
    for p in pieces:
        got.merge(out.feed(p))
    tail, finish = out.finish(reason)
    got.merge(tail)
    return got, finish


def named_calls(delta: Delta) -> list[dict[str, Any]]:
    return [
        {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
        for c in delta.tool_calls
    ]


def in_pieces(text: str, n: int) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]
