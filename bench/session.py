"""Synthetic OpenCode-shaped agent session: every text is generated from a seed (no real client prompt).

Shape (measured from a real OpenCode 1.18 session): a ~9.5k-character system prompt and 10 tool schemas
(~21k characters of JSON) sent with every main request; ``stream: true`` with usage; ``tool_choice: "auto"``.
Each turn appends an assistant message (usually a tool call with empty content) and a tool result
(hundreds to thousands of characters), or an assistant reply plus a new user message. Before the first
turn the client sends a title-generation request with its own ~2k-character system prompt and no tools.

Fairness: the assistant messages in the history are fixed synthetic ones (not what a server generated), so
every scenario replays byte-identical requests and the prefix of turn t+1 is exactly the prompt of turn t
plus the assistant/tool messages. ``max_tokens`` is small; the generated text is discarded.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

SYSTEM_CHARS = (9000, 10000)
TOOLS_JSON_CHARS = (19500, 22500)
TITLE_SYSTEM_CHARS = (1800, 2200)
TOOL_RESULT_CHARS = (300, 4000)
N_TOOLS = 10
TOOL_NAMES = (
    "read_file",
    "write_file",
    "edit_file",
    "run_shell",
    "search_text",
    "find_files",
    "list_dir",
    "fetch_url",
    "update_todos",
    "spawn_task",
)
_ONSETS = ("b", "c", "d", "f", "g", "l", "m", "n", "p", "r", "s", "t", "v", "pr", "st", "tr", "ch")
_VOWELS = ("a", "e", "i", "o", "u", "io", "ea", "ou")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "ck")


@dataclass(frozen=True)
class Request:
    """One chat-completion request of the session; ``body`` lacks ``model`` (the client adds it)."""

    label: str  # "title", "turn 1", "turn 2", ...
    turn: int  # 0 for the title request
    body: dict


@dataclass(frozen=True)
class Session:
    """The title request, then one main request per turn (each a strict message-prefix extension)."""

    seed: int
    scale: float
    title: Request
    turns: list[Request] = field(default_factory=list)

    def requests(self) -> list[Request]:
        return [self.title, *self.turns]


class _Text:
    """Deterministic pseudo-English built from a seeded lexicon of invented words."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        words: set[str] = set()
        while len(words) < 600:
            n = rng.choice((1, 2, 2, 3))
            words.add(
                "".join(
                    rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n)
                )
            )
        self.words = sorted(words)

    def word(self) -> str:
        return self.rng.choice(self.words)

    def ident(self) -> str:
        return "_".join(self.word() for _ in range(self.rng.randint(1, 3)))

    def sentence(self) -> str:
        ws = [self.word() for _ in range(self.rng.randint(6, 18))]
        return (
            ws[0].capitalize() + " " + " ".join(ws[1:]) + self.rng.choice((".", ".", ".", "!", "?"))
        )

    def paragraph(self) -> str:
        return " ".join(self.sentence() for _ in range(self.rng.randint(2, 5)))

    def path(self) -> str:
        parts = [self.word() for _ in range(self.rng.randint(1, 3))]
        return "src/" + "/".join(parts) + self.rng.choice((".py", ".ts", ".go", ".md"))

    def prose(self, lo: int, hi: int, markdown: bool = True) -> str:
        """Headed sections of paragraphs and bullets, cut to a length in [lo, hi]."""
        target = self.rng.randint(lo, hi)
        out: list[str] = []
        size = 0
        while size < target:
            piece = self.paragraph()
            if markdown and self.rng.random() < 0.25:
                piece = "# " + " ".join(self.word() for _ in range(3)).title() + "\n\n" + piece
            elif markdown and self.rng.random() < 0.3:
                piece = "\n".join("- " + self.sentence() for _ in range(self.rng.randint(2, 5)))
            out.append(piece)
            size += len(piece) + 2
        return "\n\n".join(out)[:target].rstrip() + "\n"

    def code(self, target: int) -> str:
        lines: list[str] = []
        size, n = 0, 1
        while size < target:
            if self.rng.random() < 0.2:
                line = f"def {self.ident()}({self.word()}, {self.word()}):"
            elif self.rng.random() < 0.3:
                line = f"    # {self.sentence()}"
            else:
                line = f"    {self.ident()} = {self.ident()}({self.word()}) + {self.rng.randint(0, 99)}"
            line = f"{n:05d}| {line}"
            lines.append(line)
            size += len(line) + 1
            n += 1
        return "\n".join(lines)


def _tool_schema(text: _Text, name: str, desc_chars: int, scale: float) -> dict:
    props = {}
    most = max(1, round(5 * scale))
    for _ in range(text.rng.randint(min(2, most), most)):
        props[text.ident()] = {
            "type": text.rng.choice(("string", "integer", "boolean")),
            "description": text.sentence(),
        }
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": text.prose(desc_chars - 100, desc_chars + 100, markdown=False).strip(),
            "parameters": {
                "type": "object",
                "properties": props,
                "required": sorted(props)[:1],
                "additionalProperties": False,
            },
        },
    }


def _scaled(lohi: tuple[int, int], scale: float) -> tuple[int, int]:
    return int(lohi[0] * scale), int(lohi[1] * scale)


def _tools(text: _Text, scale: float = 1.0) -> list[dict]:
    """10 schemas whose JSON totals a size inside TOOLS_JSON_CHARS (descriptions share the budget).

    Two passes from one derived seed: the first measures the non-description overhead, the second
    sizes the descriptions so the total lands on the target.
    """
    target = int(text.rng.randint(20500, 21500) * scale)
    weights = [text.rng.uniform(0.3, 2.5) for _ in range(N_TOOLS)]
    sub_seed = text.rng.randrange(2**32)
    desc_total = max(2000, target - 10 * 600)
    for _ in range(2):
        budget = [max(150, int(desc_total * w / sum(weights))) for w in weights]
        sub = _Text.__new__(_Text)
        sub.rng, sub.words = random.Random(sub_seed), text.words
        tools = [_tool_schema(sub, n, b, scale) for n, b in zip(TOOL_NAMES, budget, strict=True)]
        size = len(json.dumps(tools))
        desc = sum(len(json.dumps(t["function"]["description"])) for t in tools)
        desc_total = target - (size - desc)
    return tools


def _tool_result(text: _Text, name: str, scale: float = 1.0) -> str:
    lo, hi = _scaled(TOOL_RESULT_CHARS, scale)
    size = int(min(hi, max(lo, text.rng.lognormvariate(7.2, 0.6) * scale)))
    if name == "read_file":
        return f"<file>\n{text.code(size - 20)}\n</file>"[:size]
    if name == "search_text":
        lines: list[str] = []
        while sum(len(x) + 1 for x in lines) < size:
            lines.append(f"{text.path()}:{text.rng.randint(1, 900)}: {text.sentence()}")
        return "\n".join(lines)[:size]
    if name in ("find_files", "list_dir"):
        lines = []
        while sum(len(x) + 1 for x in lines) < size:
            lines.append(text.path())
        return "\n".join(lines)[:size]
    return text.prose(size, size, markdown=False)


def _tool_call(text: _Text, turn: int, name: str) -> dict:
    args = {"path": text.path()} if name != "run_shell" else {"command": f"make {text.word()}"}
    if name == "search_text":
        args = {"pattern": text.ident(), "path": "src"}
    return {
        "id": f"call_{turn:03d}_{text.rng.randrange(16**8):08x}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def _turn_messages(text: _Text, turn: int, scale: float) -> list[dict]:
    """Messages appended after turn ``turn``'s request: a tool call + result, or a reply + new user."""
    if turn % 4 == 0:
        return [
            {"role": "assistant", "content": text.paragraph()},
            {"role": "user", "content": text.paragraph()},
        ]
    name = text.rng.choice(("read_file", "read_file", "search_text", "run_shell", "find_files"))
    call = _tool_call(text, turn, name)
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": _tool_result(text, name, scale)},
    ]


def build_session(turns: int, seed: int = 0, max_tokens: int = 16, scale: float = 1.0) -> Session:
    """A deterministic session of ``turns`` main requests (plus the title request) for ``seed``.

    ``scale`` multiplies every character size (system prompt, tool JSON, title prompt, tool results);
    1.0 is the measured OpenCode shape, smaller values keep a CPU-only run to minutes.
    """
    assert turns >= 1 and 0.05 <= scale <= 4.0
    text = _Text(random.Random(seed))
    system = text.prose(*_scaled(SYSTEM_CHARS, scale))
    tools = _tools(text, scale)
    title_system = text.prose(*_scaled(TITLE_SYSTEM_CHARS, scale))
    first_user = text.paragraph()
    common = {
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": seed,
    }
    title = Request(
        "title",
        0,
        {
            **common,
            "messages": [
                {"role": "system", "content": title_system},
                {"role": "user", "content": first_user},
            ],
        },
    )
    history: list[dict] = [
        {"role": "system", "content": system},
        {"role": "user", "content": first_user},
    ]
    requests = []
    for t in range(1, turns + 1):
        body = {**common, "messages": list(history), "tools": tools, "tool_choice": "auto"}
        requests.append(Request(f"turn {t}", t, body))
        history.extend(_turn_messages(text, t, scale))
    return Session(seed, scale, title, requests)


def describe(session: Session) -> dict:
    """Sizes in characters, for the report header and the tests."""
    first = session.turns[0].body
    return {
        "seed": session.seed,
        "scale": session.scale,
        "turns": len(session.turns),
        "system_chars": len(first["messages"][0]["content"]),
        "tools_json_chars": len(json.dumps(first["tools"])),
        "title_system_chars": len(session.title.body["messages"][0]["content"]),
        "last_request_chars": len(json.dumps(session.turns[-1].body)),
    }
