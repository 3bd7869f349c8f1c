"""Prefix stability with real chat templates: how much of turn k+1's prompt the cache serves from turn k.

For each model family (``engine/models/templates.py``: the family's real template on the tiny model, its
markers as tokens) an OpenCode-shaped session runs through the real server path: a long system prompt and
OpenCode's tools, assistant turns that reason and call tools (empty content), tool results, a second user
request. What the model "generates" on each request is the family's own rendering of that assistant turn
(its think block and its tool-call syntax), which ``engine/output.py`` parses exactly as the server does;
the client's next request is built from that parsed output, as OpenCode builds it. The cache is the real
``TieredCache`` (hot tier): each request stores its prompt + generated ids, the next one is looked up.

Two clients: one that drops reasoning from history and one that sends it back as ``reasoning_content``. Per family and client: the share of each
later prompt served from the cache (mean over the session; new tool results and user messages are the
unserved rest), the share of the previous entry (prompt + generated) reused (worst turn; 100% = the
template renders history exactly as it was generated), and the tokens of the previous entry past the
first difference (e.g. reasoning the template drops), which the cache skips by serving the longest
true prefix.

    python -m bench.prefix_stability            # all families (needs the templates: setup.sh)
    python -m bench.prefix_stability qwen3 glm-4.7
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from engine import chat
from engine.generate import Engine
from engine.models import templates, tiny
from engine.output_format import OutputFormat
from engine.respond import output_parser
from engine.tool_calls import new_call_id
from tiered_kv import Config
from tiered_kv.prefix import as_tokens, common_prefix

SYSTEM = (
    "You are opencode, an interactive CLI tool that helps users with software engineering tasks. "
    "Use the instructions below and the tools available to you to assist the user.\n\n"
    + "\n".join(
        f"# Rule {i}\nKeep answers short; prefer editing existing files; run the tests after a change; "
        f"never commit unless asked; follow the style of file {i} in the repository."
        for i in range(40)
    )
)


def _tool(name: str, desc: str, **props: str) -> dict[str, Any]:
    properties = {k: {"type": v, "description": f"The {k}"} for k, v in props.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {"type": "object", "properties": properties, "required": list(props)},
        },
    }


TOOLS = [
    _tool("bash", "Run a shell command", command="string", timeout="integer"),
    _tool("read", "Read a file", filePath="string"),
    _tool(
        "edit", "Replace text in a file", filePath="string", oldString="string", newString="string"
    ),
    _tool("grep", "Search file contents", pattern="string", path="string"),
    _tool("glob", "Find files by pattern", pattern="string"),
]

# (reasoning, tool call or None, final text, what the tool answers / the next user message)
Step = tuple[str, tuple[str, dict[str, Any]] | None, str, str]
SESSION: list[Step] = [
    ("The user wants a log line on eviction. Find the eviction code first.",
     ("grep", {"pattern": "def _evict", "path": "tiered_kv"}), "",
     "tiered_kv/hot.py:120:    def _evict(self, entry: Entry) -> None:"),
    ("It is in hot.py; read it.", ("read", {"filePath": "tiered_kv/hot.py"}), "",
     "\n".join(f"{i}: line {i} of hot.py" for i in range(100, 160))),
    ("Add log.info before the spill hand-off.",
     ("edit", {"filePath": "tiered_kv/hot.py", "oldString": "self.on_evict(entry)",
               "newString": "log.info('evict %d', entry.id)\n        self.on_evict(entry)"}), "",
     "Edit applied successfully."),
    ("Done; tell the user.", None, "Added a log line in `HotTier._evict`.",
     "Now run the tests."),
    ("Run pytest.", ("bash", {"command": "pytest -q tests/tiered_kv", "timeout": 600}), "",
     "42 passed in 3.1s"),
    ("All green.", None, "All 42 tests pass.", ""),
]  # fmt: skip


@dataclass
class Result:
    family: str
    parser: str
    served: list[float]
    reused: list[float]
    lost: list[int]
    prompts: list[int]
    note: str = ""
    brk: str = ""


def _call_id(fmt: OutputFormat, name: str, n: int) -> str:
    return f"functions.{name}:{n}" if fmt.parser_name == "kimi_k2" else new_call_id(fmt.parser_name)


def _generated(tok: Any, msgs: list[dict[str, Any]], turn: dict[str, Any], eos: str) -> str:
    """What the model writes for ``turn``: the template's own rendering of it, up to its end marker."""
    prompt = chat.render_chat(tok, msgs, TOOLS)
    full = chat.render_chat(tok, msgs + [turn], TOOLS, generation_prompt=False)  # as the server renders history
    n = 0
    while n < min(len(prompt), len(full)) and prompt[n] == full[n]:
        n += 1
    tag = full.rfind("<", 0, n)
    if tag >= 0 and ">" not in full[tag:n]:  # the two part inside a marker (``<think>`` / ``<TOOLCALL>``): all of it
        n = tag
    text = full[n:]
    # its end: the family's, or the template's eos_token (the tiny tokenizer's, which a template such as
    # Mistral Nemo's writes after a call: the real model's is the family's, never part of its text)
    cuts = [i for i in (text.find(e) for e in (eos, str(getattr(tok, "eos_token", "") or "")) if e) if i >= 0]
    return (text[: min(cuts)] if cuts else text).rstrip("\n") if text else text


def run_family(family: str, tiny_dir: Path, tdir: Path, work: Path, send_reasoning: bool) -> Result:
    fdir = templates.family_dir(tiny_dir, family, tdir, work / family)
    config = Config(cache_dir=work / "kv", tiers=("hot",), hot_bytes=1 << 30)
    engine = Engine(fdir, config)
    tok = engine.tokenizer
    fmt = OutputFormat.of(tok)
    res = Result(family, fmt.parser_name, [], [], [], [])
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Add a log line when the hot tier evicts an entry."},
    ]
    prev: list[int] = []
    for k, (reasoning, call, text, answer) in enumerate(SESSION):
        prompt_text = chat.render_chat(tok, msgs, TOOLS)
        ids = engine.encode_text(prompt_text)
        turn: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "reasoning_content": reasoning,
        }
        if call is not None:
            name, args = call
            turn["tool_calls"] = [
                {"id": _call_id(fmt, name, k), "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}
            ]  # fmt: skip
        gen_text = _generated(tok, msgs, turn, templates.FAMILIES[family].eos)
        gen = engine.encode_text(gen_text)
        _, hit = engine.logits(ids + gen)  # stores the entry for prompt + generated ids
        if k:
            true = common_prefix(as_tokens(prev), as_tokens(ids + gen))
            assert hit.tokens == min(true, len(ids + gen) - 1), (
                "cache served less than the true prefix"
            )
            served = min(hit.tokens, len(ids) - 1)
            res.served.append(served / len(ids))
            res.reused.append(served / len(prev))
            res.lost.append(max(0, len(prev) - served))
            if res.lost[-1] == max(res.lost) and res.lost[-1] > 0:  # where the worst break is
                was = engine.tokenizer.decode(prev[served : served + 6])
                now = engine.tokenizer.decode(ids[served : served + 6])
                res.brk = f"turn {k + 1}: {was!r} became {now!r}"
        res.prompts.append(len(ids))
        prev = ids + gen
        # the client: parse what came back, send it back as OpenCode does
        out = output_parser(fmt, TOOLS, start_in_reasoning=fmt.opens_reasoning(prompt_text))
        out.feed(gen_text)
        out.finish("stop")
        back: dict[str, Any] = {"role": "assistant", "content": out.result.content}
        if send_reasoning and out.result.reasoning:
            back["reasoning_content"] = out.result.reasoning
        if out.result.tool_calls:
            back["tool_calls"] = [
                {k2: v for k2, v in c.items() if k2 != "index"} for c in out.result.tool_calls
            ]
        elif call is not None:
            res.note = res.note or f"turn {k + 1}: the call did not parse back"
        msgs = msgs + [back]
        if not answer:
            break
        if out.result.tool_calls:
            for c in out.result.tool_calls:
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": answer})
        else:
            msgs.append({"role": "user", "content": answer})
    engine.close()
    return res


def main(argv: list[str]) -> None:
    families = argv or list(templates.FAMILIES)
    tdir = templates.fetch(templates.default_dir(Config.from_env().models_dir))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny_dir = tiny.build(work / "tiny", size="test", seed=0)
        print("| family | parser | prompt tokens (turn 1 → last) | reasoning dropped: prompt served "
              "(mean), previous entry reused (worst), tokens lost (max) | reasoning sent back: same "
              "| note (reasoning dropped: where the worst turn breaks) |")  # fmt: skip
        print("|---|---|---:|---:|---:|---|")
        for family in families:
            cells, breaks = [], []
            for send in (False, True):
                try:
                    r = run_family(
                        family, tiny_dir, tdir, work / ("back" if send else "drop"), send
                    )
                except TemplateError as e:  # what a user of this template meets: a 400 from us
                    print(f"| {family} | - | - | - | - | template fails in transformers: {e} |")
                    break
                breaks.append(r.brk)
                cells.append(
                    f"{100 * sum(r.served) / len(r.served):.1f}%, {100 * min(r.reused):.1f}%, "
                    f"{max(r.lost)}"
                )
            else:
                print(
                    f"| {family} | {r.parser} | {r.prompts[0]} → {r.prompts[-1]} | {cells[0]} | "
                    f"{cells[1]} | {'; '.join(x for x in [r.note, breaks[0]] if x)} |"
                )


if __name__ == "__main__":
    main(sys.argv[1:])
