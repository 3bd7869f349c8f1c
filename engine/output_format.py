"""A tokenizer's output format: its think and tool-call markers, and the state machine over them.

Pure values, no MLX: :meth:`OutputFormat.of` reads the tokenizer once per request on the HTTP
side; :class:`engine.output.ChatOutput` runs mlx-lm's ``TextStateMachine`` over
:meth:`OutputFormat.edges`. What the markers are comes from mlx-lm, which picks them from the
model's chat template and vocabulary (``TokenizerWrapper.tool_parser`` / ``tool_call_start`` /
``tool_call_end``, ``think_start`` / ``think_end``). Ours on top: Hermes where the template ignores
``tools`` (the server injects the Hermes instructions), Llama 3.x's calls without markers, whether
the prompt opened a think block, and the text after the prompt that forces a call (``tool_choice``).
"""

from __future__ import annotations

import keyword
import weakref
from dataclasses import dataclass, replace
from typing import Any

from mlx_lm.generate import TextStateMachine
from mlx_lm.tool_parsers import qwen3_coder

from engine import chat
from engine.tool_calls import (
    DS_CALL,
    DS_CALL_END,
    DS_CALLS,
    DS_SEP,
    DSML,
    HERMES_END,
    HERMES_START,
    HY3_CALLS,
    M3_NS,
    OWN_PARSERS,
    Parser,
    parse_deepseek_v31,
    parse_dsml,
    parse_harmony,
    parse_hermes,
    parse_hy3,
    parse_json_block,
    parse_json_calls,
    parse_minimax_m3,
)

NORMAL, REASONING, TOOL = "normal", "reasoning", "tool"
ANSWER = "answer"  # inside the markers a format writes its answer's text between: content, less them
END = "end"  # after the marker that ends the model's message: nothing
THINK_TOOL = "think_tool"  # a call block opened inside a think block: it closes back into reasoning
CALLS = (TOOL, THINK_TOOL)


@dataclass(frozen=True)
class OutputFormat:
    """The markers of one tokenizer: think block, tool-call block (end "" = to the end of the output)
    and the parser of a block's text; ``parser_name`` names the mlx-lm parser module ("hermes",
    "llama3_json": ours). ``whole``: calls have no markers; an output that starts as a call (``{``
    or ``<|python_tag|>``) is held to its end and parsed whole (Llama 3.x)."""

    think: tuple[str, str] | None = None
    tool: tuple[str, str] = (HERMES_START, HERMES_END)
    parse: Parser = parse_hermes
    parser_name: str = "hermes"
    whole: bool = False
    #: gpt-oss's harmony messages (``engine/harmony.py`` parses them; ``think`` / ``tool`` above
    #: are then its analysis channel and its call opener)
    harmony: bool = False
    #: the added tokens of the vocabulary its think and call markers are made of (Qwen3's, GLM's
    #: ``<think>``, Gemma 4's ``<|channel>`` of ``<|channel>thought``, Qwen's ``</tool_call>``,
    #: Mistral's ``[ARGS]``), each as (text, name in a grammar): a grammar names them as tokens
    #: (llguidance matches no added token by its text; one not spelled ``<...>`` by its id, ``<[7]>``)
    marker_tokens: tuple[tuple[str, str], ...] = ()
    #: the markers the model writes its answer's text between, which are not content (Cohere
    #: Command R7B's ``<|START_RESPONSE|>…<|END_RESPONSE|>``, Kimi K3's ``<|open|>response<|sep|>…``;
    #: its template writes them back)
    frame: tuple[str, str] | None = None
    #: what ends the model's message, nothing after it output (Kimi K3's ``<|close|>message<|sep|>``)
    close: str | None = None
    #: how a JSON block's call is spelled (``json_block``: :func:`chat.call_json`; Mistral Nemo's
    #: list), where the template writes it (or :func:`chat.call_writer` does) as the name and the
    #: arguments alone (and an id the model writes)
    call_json: chat.CallJson | None = None
    #: how the template writes a call's arguments where it differs from its parser's family
    #: (:meth:`arg_layout`): Seed-OSS's Qwen3-Coder tags, LFM2.5's single-quoted Python strings
    args: ArgLayout | None = None
    #: how the template opens a call to {name} where it differs from its parser family's
    #: (:data:`_NAMED`): Mistral Small 3.2's ``[CALL_ID]``, the model's id after it
    named: str | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> OutputFormat:
        """:meth:`markers_of`, and the added tokens its markers are made of."""
        fmt = cls.markers_of(tokenizer)
        named = fmt._opening("", 0)  # a call's fixed text, less its name
        layout = fmt.arg_layout()
        markers = (*(fmt.think or ()), *fmt.tool, named, *filter(None, [fmt.named_close()]),
                   *(layout.texts() if layout else ()))  # fmt: skip
        inside = _added_in(tokenizer, tuple(m for m in markers if m))
        return replace(fmt, marker_tokens=inside) if inside else fmt

    @classmethod
    def markers_of(cls, tokenizer: Any) -> OutputFormat:
        """What ``tokenizer`` (an mlx-lm TokenizerWrapper, or any HF tokenizer) and its chat template
        say: Hermes where the template ignores ``tools`` (the server injects Hermes instructions,
        :mod:`engine.chat`), so calls come back as Hermes whatever mlx-lm infers; where mlx-lm has
        no parser, the way the template writes calls back: DeepSeek's DSML, Llama 3.x's bare JSON,
        JSON or Qwen3-Coder's XML between markers of its own (:func:`chat.template_call_block`);
        else mlx-lm's (MiniMax-M3's: ours, before mlx-lm's JSON). Think markers: :data:`THINK_TEXTS`'
        where the template holds them, else mlx-lm's, else :data:`THINK_PAIRS`' where the vocabulary
        does; answer markers: :data:`FRAME_PAIRS`' or mlx-lm's structural markers', where the
        template writes text between them."""
        if _has_tokens(tokenizer, HARMONY_VOCAB):
            return HARMONY
        # the template's own words first (MiniMax-M3's vocabulary may hold <think> too), then mlx-lm's
        # markers, then pairs of tokens it does not know
        think = next((pair for pair in THINK_TEXTS if chat.template_holds(tokenizer, pair)), None)
        if think is None and getattr(tokenizer, "has_thinking", False):
            think = (str(tokenizer.think_start), str(tokenizer.think_end))
        elif think is None:
            think = next((pair for pair in THINK_PAIRS if _has_tokens(tokenizer, frozenset(pair))), None)
        fmt = cls._calls_of(tokenizer, think)
        # mlx-lm's structural markers (Kimi K3's): its answer's two, then its message's end
        structural = tuple(str(m) for m in getattr(tokenizer, "structural_markers", None) or ())
        pairs = FRAME_PAIRS + ((structural[0], structural[1]),) if len(structural) >= 2 else FRAME_PAIRS
        frame = next((pair for pair in pairs if chat.template_frames_text(tokenizer, pair)), None)
        if frame is None:
            return fmt
        close = structural[2] if frame == structural[:2] and len(structural) == 3 else None
        return replace(fmt, frame=frame, close=close)

    @classmethod
    def _calls_of(cls, tokenizer: Any, think: tuple[str, str] | None) -> OutputFormat:
        """:meth:`markers_of`'s format, less its answer markers."""
        if not chat.template_supports_tools(tokenizer):  # Hermes instructions, or DeepSeek V3.1's
            if chat.template_writes_deepseek_calls(tokenizer):
                return cls(think, DS_CALLS, parse_deepseek_v31, "deepseek_v31")
            return cls(think)
        if chat.template_writes_minimax_m3_calls(tokenizer):  # (mlx-lm takes its template for a JSON one)
            return cls(think, (M3_NS + "<tool_call>", M3_NS + "</tool_call>"), parse_minimax_m3, "minimax_m3")
        parser = getattr(tokenizer, "tool_parser", None)
        if parser is None and chat.template_writes_hy3_calls(tokenizer):
            return cls(think, HY3_CALLS, parse_hy3, "hy3")
        if parser is None and (dsml := chat.template_dsml_block(tokenizer)):
            return cls(think, (f"<{DSML}{dsml}>", f"</{DSML}{dsml}>"), parse_dsml, "dsml")
        if parser is None and chat.template_writes_json_calls(tokenizer):
            return cls(think, ("", ""), parse_json_calls, "llama3_json", whole=True)
        block = chat.template_call_block(tokenizer) if parser is None else None
        if block is not None and block.body == "function":  # Seed-OSS's: Qwen3-Coder's calls, its own block
            return cls(think, (block.start, block.end), qwen3_coder.parse_tool_call, "qwen3_coder", args=_SEED_ARGS)
        if block is not None and (block.start, block.end) != (HERMES_START, HERMES_END):
            return cls(think, (block.start, block.end), parse_json_block, "json_block", call_json=block.json)
        if parser is None and (opener := chat.template_call_text(tokenizer)):  # Granite 3.3's, to the end
            return cls(think, (opener, ""), parse_json_block, "json_block", call_json=chat.written_call_json(tokenizer))
        if parser is None or not getattr(tokenizer, "tool_call_start", None):
            return cls(think)
        tool = (str(tokenizer.tool_call_start), str(tokenizer.tool_call_end or ""))
        name = parser.__module__.rsplit(".", 1)[-1]
        args = _PYTHON_SINGLE_QUOTES if name == "pythonic" and chat.template_quotes_python_strings(tokenizer) else None
        named = _MISTRAL_CALL_IDS if name == "mistral" and chat.template_writes_mistral_call_ids(tokenizer) else None
        spelled = chat.template_mistral_json_calls(tokenizer) if name == "mistral" and named is None else None
        return cls(think, tool, OWN_PARSERS.get(name, parser), name, args=args, named=named, call_json=spelled)

    def opens_reasoning(self, prompt_text: str, continued: str = "") -> bool:
        """Whether the model starts inside a think block: the generation prompt opens one (the
        prompt ends with the opener: GLM-4.7, MiniMax-M2, DeepSeek-R1), or the assistant message
        it continues (``continued``: its text) left one open. A marker in the conversation's own
        text — a user message or a tool result quoting ``<think>`` — opens nothing."""
        if self.think is None:
            return False
        start, end = self.think
        head = prompt_text
        if continued:
            s, e = continued.rfind(start), continued.rfind(end)
            if s != e:  # the continued text has a marker: its last one decides
                return s > e
            cut = prompt_text.rfind(continued.strip())
            head = prompt_text[:cut] if cut >= 0 else ""
        return head.rstrip().endswith(start)

    def forced_prefix(self, tool_choice: Any, calls_before: int = 0) -> str:
        """Text after the generation prompt that makes the model call (``required``) or call one
        named function; formats we cannot name a function in get the call opener only.
        ``calls_before``: the calls in the conversation so far (Kimi numbers its call ids by it)."""
        if tool_choice == "required":  # the opener, and the newline after it where the format has one
            if self.whole:
                return '{"name": "'
            newline = _NAMED.get(self.parser_name, "").startswith("{start}\n")
            return self.tool[0] + ("\n" if newline else "")
        if not isinstance(tool_choice, dict):
            return ""
        named = self._opening(str(tool_choice["function"]["name"]), calls_before)
        return named.split(CALL_ID)[0] if named else self.tool[0]  # (an id is the model's to write)

    def _opening(self, name: str, index: int) -> str:
        """A call to ``name`` opened, up to its arguments, in the format's syntax ("" where we cannot
        name a function in it); :data:`CALL_ID` where the model writes the call's id."""
        if self.call_json is not None:
            return self.tool[0] + self.call_json.head.replace(chat.NAME_SLOT, name)
        named = self.named or _NAMED.get(self.parser_name)
        return named.format(start=self.tool[0], name=name, index=index) if named else ""

    def named_rest(self, name: str, calls_before: int = 0) -> str:
        """What a forced call to ``name`` writes after :meth:`forced_prefix` (in the prompt) up to its
        arguments: "" but where the model writes the call's id there (Mistral Small 3.2's
        ``[CALL_ID]`` id ``[ARGS]``), the grammar's to enforce."""
        named = self._opening(name, calls_before)
        return named[len(named.split(CALL_ID)[0]) :]

    def call_head(self, name: str, calls_before: int = 0) -> str | None:
        """What a call to ``name`` writes after ``required``'s opening (:meth:`forced_prefix`) up to
        its arguments (Hermes: ``{"name": "NAME", "arguments": ``); None where no grammar of the
        format's arguments is written (:meth:`named_close`)."""
        if self.named_close() is None:
            return None
        opened = self.forced_prefix("required")
        named = self._opening(name, calls_before)
        return named[len(opened) :] if named.startswith(opened) else None

    def named_close(self) -> str | None:
        """What closes a forced named call after its arguments (:meth:`forced_prefix` opened it);
        None where no grammar of the format's arguments is written: they are neither one JSON
        object written whole nor one by one (:meth:`arg_layout`)."""
        if self.call_json is not None:
            return self.call_json.tail + self.tool[1]
        layout = self.arg_layout()
        return layout.close.replace("{end}", self.tool[1]) if layout else _NAMED_CLOSE.get(self.parser_name)

    def next_call(self, name: str, index: int) -> str | None:
        """What the format writes from the end of one call's arguments to the start of the next's,
        a call to ``name`` (``index``: the calls before it in the conversation, which Kimi numbers
        its ids by), where a forced call may be one of several (``required`` with parallel calls):
        the call's end and a new block (Hermes, Qwen3-Coder, GLM, Gemma 4, Mistral), or the next
        call inside the same block (Kimi-K2's section, MiniMax-M2's ``<invoke>``, LFM2's list,
        DeepSeek V3.1's calls; a JSON block's list, as :attr:`call_json` found it) — as each
        family's template writes two calls. None where the format writes one call a turn (Llama
        3.3, gpt-oss; GigaChat 3.1's template renders one, Cohere's numbers them) or no grammar of
        its arguments is written."""
        if self.call_json is not None:  # JSON between a template's own markers, as it writes a second
            between = self.call_json.between
            return between.replace(chat.NAME_SLOT, name) if between is not None else None
        again, close = _AGAIN.get(self.parser_name), self.named_close()
        if again is None or close is None:
            return None
        return again.format(close=close, named=self._opening(name, index), name=name, index=index)

    def arg_layout(self) -> ArgLayout | None:
        """Where a call writes its arguments one by one (tags: Qwen3-Coder's ``<parameter=city>``,
        MiniMax-M2's ``<parameter name="city">``, GLM's ``<arg_key>city</arg_key>``; LFM2's Python
        keywords ``city="Paris"``; Gemma 4's ``city:<|"|>Paris<|"|>``): how (:class:`ArgLayout`);
        None where they are one JSON object or free. The template's own where it differs
        (:attr:`args`: Seed-OSS's Qwen3-Coder calls write a value with no newline around it,
        LFM2.5-8B-A1B's Python calls a string between single quotes)."""
        return self.args or _ARG_LAYOUTS.get(self.parser_name)

    def machine(self, tools: bool) -> TextStateMachine:
        """mlx-lm's text state machine over our markers (the tool edges only when calls are parsed)."""
        return TextStateMachine(self.edges(tools))

    def edges(self, tools: bool) -> dict[str, list[tuple[str, str]]]:
        """State → ``[(marker, next state)]``; no two edges of a state lead to one state."""
        edges: dict[str, list[tuple[str, str]]] = {NORMAL: []}
        if self.think is not None:
            edges[NORMAL].append((self.think[0], REASONING))
            edges[REASONING] = [(self.think[1], NORMAL)]
        if self.frame is not None:
            edges[NORMAL].append((self.frame[0], ANSWER))
            edges[ANSWER] = [(self.frame[1], NORMAL)]
        if self.close is not None:
            edges[NORMAL].append((self.close, END))
            edges[END] = []
        if tools and not self.whole:
            edges[NORMAL].append((self.tool[0], TOOL))
            edges[TOOL] = [(self.tool[1], NORMAL)] if self.tool[1] else []
            if self.think is not None:  # GLM and Qwen3 call from inside a think block
                edges[REASONING].append((self.tool[0], THINK_TOOL))
                edges[THINK_TOOL] = [(self.think[1], NORMAL)]  # the block did not close
                if self.tool[1]:
                    edges[THINK_TOOL].append((self.tool[1], REASONING))
        return edges


#: per tokenizer (held weakly), :func:`_added_in`'s answers: its added vocabulary does not change,
#: and a request need not list it again (gpt-oss's holds ~1100 tokens)
_added_seen: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], tuple[tuple[str, str], ...]]] = (
    weakref.WeakKeyDictionary()
)


def _added_in(tokenizer: Any, markers: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The added tokens of the vocabulary that occur in ``markers`` (longest first), each with its
    name in an llguidance grammar: its text where that is ``<...>``, else its id (``<[7]>``)."""
    try:
        return _added_seen[tokenizer][markers]
    except (KeyError, TypeError):  # not asked yet (TypeError: it cannot be held weakly)
        pass
    found = _added_scan(tokenizer, markers)
    try:
        _added_seen.setdefault(tokenizer, {})[markers] = found
    except TypeError:
        pass
    return found


def _added_scan(tokenizer: Any, markers: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    added = getattr(tokenizer, "get_added_vocab", None)
    try:
        vocab = added() if added is not None else {}
    except (AttributeError, TypeError, ValueError):
        return ()
    found = sorted((t for t in vocab if t and any(t in m for m in markers)), key=len, reverse=True)
    return tuple(
        (t, t if t.startswith("<") and t.endswith(">") else f"<[{vocab[t]}]>") for t in found
    )


def _has_tokens(tokenizer: Any, tokens: frozenset[str]) -> bool:
    """Whether each of ``tokens`` is one token of the vocabulary (looked up one by one: a whole
    ``get_vocab`` of a 200k vocabulary costs tens of milliseconds a request)."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return False
    unk = getattr(tokenizer, "unk_token_id", None)
    try:
        ids = [convert(t) for t in tokens]
    except (KeyError, TypeError, ValueError):
        return False
    return all(isinstance(i, int) and i != unk for i in ids)


#: think markers of families mlx-lm finds none for (it knows ``<think>``, LongCat's, Gemma 4's, Kimi
#: K3's): Seed-OSS's, Cohere's (Command R7B, Cohere2 MoE), Apertus's, Hy3's
THINK_PAIRS = (("<seed:think>", "</seed:think>"), ("<|START_THINKING|>", "<|END_THINKING|>"),
               ("<|inner_prefix|>", "<|inner_suffix|>"), ("<think:opensource>", "</think:opensource>"))  # fmt: skip

#: think markers written as text, where the chat template holds both: Apriel 1.6's (its generation
#: prompt opens the reasoning, ``[BEGIN FINAL RESPONSE]`` ends it), MiniMax-M3's
THINK_TEXTS = (("Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]"), ("<mm:think>", "</mm:think>"))

#: answer markers (:attr:`OutputFormat.frame`), each where the template writes an assistant's text
#: between them: Command R7B's, Cohere2 MoE's
FRAME_PAIRS = (("<|START_RESPONSE|>", "<|END_RESPONSE|>"), ("<|START_TEXT|>", "<|END_TEXT|>"))

#: the special tokens of gpt-oss's harmony format (o200k_harmony)
HARMONY_VOCAB = frozenset(
    {"<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>"}
)
HARMONY = OutputFormat(("<|channel|>analysis<|message|>", "<|end|>"),
                       ("<|channel|>commentary to=functions.", ""), parse_harmony, "harmony",
                       harmony=True)  # fmt: skip

# What closes a forced named call once its arguments (a JSON object) are written, in the formats
# whose named opening leaves exactly the arguments to write ("" : the call runs to the output's
# end, an end-of-sequence token); the others write arguments that are no JSON (XML, Python).
_NAMED_CLOSE = {
    "hermes": "}\n" + HERMES_END,
    "json_tools": "}\n" + HERMES_END,
    "llama3_json": "}",
    "harmony": "",
    "mistral": "",
    "kimi_k2": "<|tool_call_end|><|tool_calls_section_end|>",
    "deepseek_v31": DS_CALL_END + DS_CALLS[1],
}

#: in an argument layout (:class:`ArgLayout`), a newline the model may write or not (a grammar reads
#: it as an optional one): GLM-4.6 writes one before each opening tag and the call's end, 4.7 none
GAP = "\x1d"
#: in a call's opening or end, its id, the model's to write (:data:`chat.CALL_ID`: Mistral's)
CALL_ID = chat.CALL_ID


@dataclass(frozen=True)
class ArgLayout:
    """How a format writes a call's arguments one by one: each is ``before`` + its name +
    ``between`` + its value + ``after``, two of them apart by ``sep``, then ``close`` (the call's
    end; ``{end}``: the call block's end marker). A string's value is ``quote``-delimited text
    (``quote`` "": the text runs to ``after``, a tag's end; ``'"'``: a JSON string, as Python reads
    it too), any other value its JSON (what the parsers read). ``bare_keys``: names are written
    unquoted, so only identifiers can be (a Python call's keyword arguments, Gemma 4's keys).
    ``sort``: in their names' order, case ignored (Gemma 4's template sorts them with jinja's
    ``dictsort``), else as the schema declares them. ``keywords``: whether Python's reserved words
    can be names (not in a Python call: ``f(from=1)`` does not parse, and mlx-lm's fallback parser
    reads its quoted values as literals)."""

    before: str
    between: str
    after: str
    close: str
    sep: str = ""
    quote: str = ""
    bare_keys: bool = False
    sort: bool = False
    keywords: bool = True

    def texts(self) -> tuple[str, ...]:
        """Its fixed texts (the added tokens a grammar must name are found in them)."""
        return tuple(t for t in (self.before, self.between, self.after, self.close, self.sep, self.quote) if t)

    def takes(self, key: str) -> bool:
        """Whether an argument of this name can be written (and read back) in this layout."""
        if not self.bare_keys:
            return bool(key)
        return key.isidentifier() and (self.keywords or not keyword.iskeyword(key))


# The formats whose calls write their arguments one by one (:meth:`OutputFormat.arg_layout`).
_ARG_LAYOUTS = {
    "qwen3_coder": ArgLayout("<parameter=", ">\n", "\n</parameter>\n", "</function>\n{end}"),
    "minimax_m2": ArgLayout('<parameter name="', '">', "</parameter>\n", "</invoke>\n{end}"),
    "glm47": ArgLayout(f"{GAP}<arg_key>", f"</arg_key>{GAP}<arg_value>", "</arg_value>", f"{GAP}{{end}}"),
    "pythonic": ArgLayout("", "=", "", ")]{end}", sep=", ", quote='"', bare_keys=True, keywords=False),
    "gemma4": ArgLayout("", ":", "", "}{end}", sep=",", quote='<|"|>', bare_keys=True, sort=True),
    "hy3": ArgLayout("<arg_key:opensource>", "</arg_key:opensource>\n<arg_value:opensource>",
                     "</arg_value:opensource>\n", "</tool_call:opensource>\n{end}"),  # fmt: skip
}

# Layouts a template writes in place of its parser family's (:attr:`OutputFormat.args`): Seed-OSS's
# ``<parameter=city>Oslo</parameter>``, where Qwen3-Coder's writes the value on a line of its own;
# LFM2.5-8B-A1B's ``city='Oslo'`` (its template quotes a string so, any other value its JSON)
_SEED_ARGS = ArgLayout("<parameter=", ">", "</parameter>\n", "</function>\n{end}")
_PYTHON_SINGLE_QUOTES = replace(_ARG_LAYOUTS["pythonic"], quote="'")

# Mistral Small 3.2's opening of a call (its template writes the id after ``[CALL_ID]``)
_MISTRAL_CALL_IDS = "{start}{name}[CALL_ID]" + CALL_ID + "[ARGS]"

# A forced call's next one (:meth:`OutputFormat.next_call`), as each family's template writes a
# second call: {close} the call's end (:meth:`OutputFormat.named_close`), {named} a call to {name}
# opened (:meth:`OutputFormat.forced_prefix`), {index} its number in the conversation
_AGAIN = {
    "hermes": "{close}\n{named}",
    "json_tools": "{close}\n{named}",
    "qwen3_coder": "{close}\n{named}",
    "glm47": "{close}" + GAP + "{named}",
    "gemma4": "{close}{named}",
    "mistral": "{named}",
    "kimi_k2": "<|tool_call_end|><|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>",
    "minimax_m2": '</invoke>\n<invoke name="{name}">\n',
    "pythonic": "), {name}(",
    "deepseek_v31": DS_CALL_END + DS_CALL + "{name}" + DS_SEP,
    "hy3": "</tool_call:opensource>\n<tool_call:opensource>{name}<tool_sep:opensource>\n",
}

# Forced named calls: the opening of a call to {name}, in each family's own syntax.
_NAMED = {
    "hermes": '{start}\n{{"name": "{name}", "arguments": ',
    "json_tools": '{start}\n{{"name": "{name}", "arguments": ',
    "qwen3_coder": "{start}\n<function={name}>\n",
    "glm47": "{start}{name}",
    "kimi_k2": "{start}<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>",
    "minimax_m2": '{start}\n<invoke name="{name}">\n',
    "mistral": "{start}{name}[ARGS]",
    "gemma4": "{start}call:{name}{{",
    "pythonic": "{start}[{name}(",
    "llama3_json": '{{"name": "{name}", "parameters": ',
    "harmony": "{start}{name} <|constrain|>json<|message|>",
    "dsml": '{start}\n<｜DSML｜invoke name="{name}">\n',
    "deepseek_v31": "{start}" + DS_CALL + "{name}" + DS_SEP,
    "minimax_m3": "{start}\n" + M3_NS + '<invoke name="{name}">',
    "hy3": "{start}\n<tool_call:opensource>{name}<tool_sep:opensource>\n",
}
