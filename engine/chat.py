"""Chat prompts in, tool calls out: template rendering, OpenCode message normalisation, Hermes parsing.

Pure text functions (no MLX); safe to call from any thread. Rendering goes through the model's own chat
template (``tokenizer.apply_chat_template``). A template that ignores ``tools`` (SmolLM2's plain ChatML)
gets them injected into the system message in Hermes format, and assistant tool calls / tool results are
written as ``<tool_call>`` / ``<tool_response>`` text, so the model sees the same format it is asked to emit.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_PROBE_TOOL = {"type": "function", "function": {"name": "tiered_kv_probe_fn", "parameters": {}}}
_tool_support: dict[int, bool] = {}  # id(tokenizer) → does its template render ``tools``?

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


# --- messages -------------------------------------------------------------------------------------


def content_text(content: Any) -> str:
    """OpenAI content (None, a string, or a list of parts) → plain text; non-text parts are dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("text", "input_text"):
            parts.append(str(part.get("text", "")))
        elif isinstance(part, str):
            parts.append(part)
    return "".join(parts)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as a dict when they are a JSON object string (templates ``tojson`` them)."""
    if isinstance(raw, str):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            return raw
        return value if isinstance(value, dict) else raw
    return raw if raw is not None else {}


def _tool_call(tc: dict[str, Any]) -> dict[str, Any]:
    fn = tc.get("function") or {}
    return {
        "id": tc.get("id", ""),
        "type": "function",
        "function": {"name": str(fn.get("name", "")), "arguments": _arguments(fn.get("arguments"))},
    }


def normalise_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenCode's messages → what chat templates expect.

    Content lists become text; null content becomes ""; ``developer`` becomes ``system``; assistant
    ``tool_calls`` keep their ids with arguments decoded to dicts; ``tool`` messages keep ``tool_call_id``.
    """
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": content_text(m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(tc) for tc in m["tool_calls"]]
        if role == "tool":
            msg["tool_call_id"] = m.get("tool_call_id") or ""
            if m.get("name"):
                msg["name"] = m["name"]
        out.append(msg)
    return out


# --- rendering ------------------------------------------------------------------------------------


def _apply(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": True}
    if tools:
        kwargs["tools"] = tools
    return str(tokenizer.apply_chat_template(messages, **kwargs))


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders ``tools`` (probed once per tokenizer)."""
    key = id(tokenizer)
    if key not in _tool_support:
        probe = [{"role": "user", "content": "hi"}]
        try:
            _tool_support[key] = "tiered_kv_probe_fn" in _apply(tokenizer, probe, [_PROBE_TOOL])
        except Exception:  # a template may raise on tools it does not understand
            _tool_support[key] = False
    return _tool_support[key]


def format_tool_call(name: str, arguments: Any) -> str:
    """The Hermes text of one call, as the model is told to write it."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{CLOSE}'


def hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """For templates without tool support: tools into the system turn, calls/results into text."""
    out: list[dict[str, Any]] = []
    if tools:
        listing = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        block = HERMES_SYSTEM.format(tools=listing)
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + block})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                format_tool_call(tc["function"]["name"], tc["function"]["arguments"])
                for tc in m["tool_calls"]
            ]
            text = "\n".join(([m["content"]] if m["content"] else []) + calls)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{k: v for k, v in m.items() if not k.startswith("_")} for m in out]


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    """Messages (+ tools) → the prompt text, ending with the assistant generation prompt."""
    msgs = normalise_messages(messages)
    if template_supports_tools(tokenizer):
        return _apply(tokenizer, msgs, tools or None)
    return _apply(tokenizer, hermes_messages(msgs, tools), None)


def forced_prefix(tool_choice: Any) -> str:
    """Text appended after the generation prompt to force a call (``required`` or a named function)."""
    if tool_choice == "required":
        return OPEN + "\n"
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return f'{OPEN}\n{{"name": "{name}", "arguments": '
    return ""


# --- parsing --------------------------------------------------------------------------------------


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_call(body: str) -> dict[str, Any] | None:
    """The JSON inside one ``<tool_call>`` block → an OpenAI tool call, or None if it is not one."""
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {
        "id": _call_id(),
        "type": "function",
        "function": {"name": obj["name"], "arguments": args},
    }


@dataclass
class ToolCallParser:
    """Incremental splitter of model text into content and tool calls.

    ``feed`` returns the content that is safe to show now; text from a ``<tool_call>`` opener on (or a
    partial opener at the end) is held until the block closes. A block that does not parse is content.
    """

    enabled: bool = True
    calls: list[dict[str, Any]] = field(default_factory=list)
    _buf: str = ""

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if not self.enabled:
            return text, []
        self._buf += text
        shown = ""
        new: list[dict[str, Any]] = []
        while (start := self._buf.find(OPEN)) >= 0:
            before = self._buf[:start]
            text = before.rstrip()  # whitespace next to a call is not content
            end = self._buf.find(CLOSE, start)
            if end < 0:
                shown += text
                self._buf = self._buf[len(text) :]
                return shown, new
            call = parse_call(self._buf[start + len(OPEN) : end])
            if call is None:  # not a call after all: show the block as text
                shown += self._buf[: end + len(CLOSE)]
            else:
                shown += text
                new.append(call)
                self.calls.append(call)
            self._buf = self._buf[end + len(CLOSE) :]
        # hold a partial opener and trailing whitespace (it may precede a call)
        cut = len(self._buf) - _partial_suffix(self._buf, OPEN)
        cut = len(self._buf[:cut].rstrip())
        shown += self._buf[:cut]
        self._buf = self._buf[cut:]
        return shown, new

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """End of output: an unclosed block is parsed if its JSON is complete, else shown as text."""
        rest, self._buf = self._buf, ""
        if rest.lstrip().startswith(OPEN):
            call = parse_call(rest.lstrip()[len(OPEN) :])
            if call is not None:
                self.calls.append(call)
                return "", [call]
        if self.calls and not rest.strip():
            return "", []
        return rest, []


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Whole completion → (content, tool calls)."""
    p = ToolCallParser()
    shown, calls = p.feed(text)
    tail, more = p.finish()
    return shown + tail, calls + more
