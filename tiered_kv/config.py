"""Configuration: one frozen dataclass, built once at the edge from ``TIERED_KV_*`` variables.

Nothing below the CLI / server entry points reads ``os.environ``; they receive a :class:`Config`.
A bad value raises :class:`ConfigError` whose message names the variable and the accepted form.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar
from urllib.parse import unquote, urlsplit

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_FORM = "a byte count or a size such as 512MB, 8GiB, 1.5GB"


class ConfigError(ValueError):
    """A TIERED_KV_* value is malformed; the message names the variable and the accepted form."""


def parse_size(text: str) -> int:
    """``'8GiB'`` → 8589934592, ``'512MB'`` → 512000000, ``'1024'`` → 1024. Raises ValueError."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):
        raise ValueError(f"not a size: {text[:40]!r}… is too large")
    return int(value)


def default_root() -> Path:
    """Per-user base directory: ``$XDG_CACHE_HOME/tiered-kv`` or ``~/.cache/tiered-kv``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tiered-kv"


TIERS = ("hot", "cold")
RESTORE_MODES = ("auto", "load", "compute", "both")


@dataclass(frozen=True)
class Config:
    """Every tunable of the cache and the server.

    The ``#:`` field docs are the README's env-var table: ``scripts/env_table.py`` generates it
    (``--write``), a test keeps the two equal. A doc starts ``TIERED_KV_NAME — meaning``; a
    ``Default:`` line shows a default that is not the field's value as it is (paths, auto).
    """

    #: TIERED_KV_DIR — cold-tier directory (index + entry files)
    #: Default: `~/.cache/tiered-kv/kv` (`$XDG_CACHE_HOME` honoured)
    cache_dir: Path = field(default_factory=lambda: default_root() / "kv")
    #: TIERED_KV_MODELS_DIR — where `tiered-kv model` writes converted / generated models
    #: Default: `~/.cache/tiered-kv/models`
    models_dir: Path = field(default_factory=lambda: default_root() / "models")
    #: TIERED_KV_TIERS — `hot,cold`, `hot`, `cold` or `none` (cache off)
    tiers: tuple[str, ...] = ("hot", "cold")
    #: TIERED_KV_HOT_BYTES — byte budget of the memory tier: bytes or `512MB`, `8GiB`, `1.5GB`
    hot_bytes: int = 4 * 1024**3
    #: TIERED_KV_MEMORY_THRESHOLD — evict when MLX active memory passes this share of device memory
    #: (Metal: recommended working set; CUDA: total; CPU: memory limit / RAM)
    memory_threshold: float = 0.85
    #: TIERED_KV_MIN_CONTINUATION_TOKENS — a hit this long that covers the whole stored entry and
    #: ≥ half the prompt continues the entry (taken over, replaced); so does one that covers the
    #: whole prompt that made the entry (its generated answer re-rendered by the client); other
    #: hits share it read-only
    min_continuation_tokens: int = 1000
    #: TIERED_KV_CHECKPOINT_TOKENS — recurrent / sliding-window models: checkpoint spacing during
    #: prefill (16–8192); a checkpoint is also taken at each end-of-message token and at the
    #: prompt's end (`tiered_kv/checkpoints.py`)
    checkpoint_tokens: int = 1024
    #: TIERED_KV_CHECKPOINT_SHARE — share of `TIERED_KV_HOT_BYTES` checkpoints may use (and of an
    #: entry's bytes on disk); past it the least recently used entries' earliest go first
    checkpoint_share: float = 0.25
    #: TIERED_KV_PREFILL_CHUNK — tokens per prefill step (16–65536)
    #: Default: `0` (auto: 2048 on a GPU, 512 on the CPU)
    prefill_chunk: int = 0
    #: TIERED_KV_DISK_BYTES — budget of everything under `TIERED_KV_DIR` (LRU, other fingerprints
    #: and orphans included)
    disk_bytes: int = 20 * 1024**3
    #: TIERED_KV_DISK_FREE_FLOOR — keep this much free on the cache disk
    disk_free_floor: int = 1024**3
    #: TIERED_KV_BLOCK_TOKENS — tokens per hashed block of the disk index (16–8192)
    block_tokens: int = 256
    #: TIERED_KV_SPILL_QUEUE_BYTES — bytes of evicted entries *waiting* for the disk writer (the one
    #: being written not counted); past it the oldest waiting spill is dropped (logged with its
    #: bytes, counted). An entry larger than the bound is still written: it is admitted when
    #: nothing else waits
    spill_queue_bytes: int = 2 * 1024**3
    #: TIERED_KV_COLD_DEADLINE — seconds a cold lookup (index query, entry header) may take on the
    #: request path; past it: a miss (`cold_lookup_timeouts`)
    cold_deadline: float = 0.5
    #: TIERED_KV_SHUTDOWN_SECONDS — at shutdown (SIGTERM, `close()`), how long to wait while every
    #: memory-only entry is written to disk; what is left is logged and counted
    shutdown_seconds: float = 300.0
    #: TIERED_KV_WRITE_THROUGH — `1` persists every finished turn (a crash loses at most the turn
    #: in flight)
    write_through: bool = False
    #: TIERED_KV_PREFETCH — warm start loads this many most recent entries (`4`) or bytes (`2GiB`)
    #: into memory
    prefetch_entries: int = 0
    prefetch_bytes: int = 0
    #: TIERED_KV_KV_BITS — `4` or `8`: store plain KV quantised (mlx-lm QuantizedKVCache)
    kv_bits: int = 0
    #: TIERED_KV_KV_GROUP_SIZE — `32`, `64` or `128`
    kv_group_size: int = 64
    #: TIERED_KV_CACHE_SALT — mixed into every key: tenants with different salts share nothing
    cache_salt: str = ""
    #: TIERED_KV_API_KEY — when set, required as `Authorization: Bearer …` on every endpoint but
    #: `/health`
    api_key: str = ""
    #: TIERED_KV_MAX_BODY_BYTES — largest accepted request body (413 past it)
    max_body_bytes: int = 16 * 1024**2
    #: TIERED_KV_ALLOWED_ORIGINS — the web pages (CORS origins) whose scripts may call the server:
    #: `local` (pages served from this machine: `http(s)://localhost`, `127.0.0.1` or `[::1]`, any
    #: port), `*` any page (mlx_lm.server's and llama.cpp's default: any site open in the browser
    #: could then probe which prompts this cache holds), a comma-separated list of origins such as
    #: `local,https://chat.example.com`, or `none` (no CORS headers: browsers refuse every
    #: cross-origin call). The API key still applies
    allowed_origins: tuple[str, ...] = ("local",)
    #: TIERED_KV_SHARED — `redis://[[user]:password@]host[:port][/db]` or `rediss://…` (TLS): a
    #: cold tier shared by many servers, behind the local one
    #: ([below](#the-shared-tier-redis)); never echoed in errors or logs (kept out of repr: it may
    #: hold a password)
    #: Default: empty (off)
    shared_url: str = field(default="", repr=False)
    #: TIERED_KV_SHARED_TIMEOUT — seconds one shared-tier call may wait on Redis (resolving its host
    #: name, connect, each reply), in (0, 60]; after a failure the tier is skipped with exponential
    #: backoff (1 s to 30 s)
    shared_timeout: float = 1.0
    #: TIERED_KV_SHARED_QUEUE_BYTES — bytes of local entries waiting to be published to Redis; the
    #: oldest waiting one is dropped (counted) past it
    shared_queue_bytes: int = 2 * 1024**3
    #: TIERED_KV_MAX_BATCH — requests generating together (continuous batching), ≥ 1
    max_batch: int = 8
    #: TIERED_KV_SHARED_PREFILL — several requests' prompt chunks in one forward: `on`, `off`, or
    #: `auto` (on a GPU only). Off by default: on the H200 it made K=4 sessions slower (TTFT p50
    #: 1.00 s vs 0.27 s off), and on the CPU a row costs what a request alone does
    shared_prefill: str = "off"
    #: TIERED_KV_MAX_QUEUE — requests waiting for a place in the batch, ≥ 0; past it a 429
    max_queue: int = 64
    #: TIERED_KV_RESTORE — how a disk hit is restored: `auto` (the fastest of load / compute / both
    #: by this machine's measured costs), or forced `load`, `compute`, `both` (benchmarks; `both`
    #: falls back where layers cannot be split)
    restore: str = "auto"
    #: TIERED_KV_WARMUP — at start, run one prefill step, a short odd-length step, a decode step
    #: and a short step onto the cache cut to its length (as a hit continues a stored entry)
    #: through the model (uncached) so that the first request after a restart does not load or
    #: compile kernels: `on`, `off`, or `auto` (on a GPU only: ~0.4 s of the first request on the
    #: H200, and ~0.1 s of the first hot hit; a CPU has no such first-call cost, and a 512-token
    #: step costs seconds at start there)
    warmup: str = "auto"
    #: TIERED_KV_STEP_SHAPES — a prefill step that is not a whole aligned one (a hot hit's suffix)
    #: runs in few attention shapes (query padded to a power of two, keys the cache's whole
    #: buffer, four lengths an octave, under a mask), so mlx-cuda builds its cuDNN attention
    #: graph once per shape, not once per turn (`engine/shapes.py`): `on`, `off`, or `auto` (on
    #: CUDA only: H100 1B 8k, a hot turn's median TTFT 22 ms against 70 ms off; on the CPU and
    #: Metal nothing is built per shape and the padding only costs)
    step_shapes: str = "auto"
    #: TIERED_KV_MAX_TOKENS — new tokens for a request that names no `max_tokens`: `0` is all that
    #: the model's context leaves (as OpenAI, vLLM and llama.cpp do; mlx_lm.server stops at 512).
    #: A request's own `max_tokens` is capped only by the context
    max_tokens: int = 0
    #: TIERED_KV_CHAT_TEMPLATE_ARGS — a JSON object of extra chat-template variables for every
    #: request, e.g. `{"enable_thinking": false}` (as mlx_lm.server's `--chat-template-args`); a
    #: request's `reasoning_effort` and `chat_template_kwargs` override them
    #: Default: empty (none)
    chat_template_args: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """The Config from ``TIERED_KV_*`` (see the module's :func:`from_env`)."""
        return from_env(env, **overrides)

    @property
    def hot_enabled(self) -> bool:
        return "hot" in self.tiers

    @property
    def cold_enabled(self) -> bool:
        return "cold" in self.tiers

    @property
    def shared_enabled(self) -> bool:
        """The shared tier sits behind the local cold tier: on only with both."""
        return bool(self.shared_url) and self.cold_enabled


def _bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(text)


def _tiers(text: str) -> tuple[str, ...]:
    t = text.strip().lower()
    if t in ("none", "off", ""):
        return ()
    parts = tuple(p.strip() for p in t.split(","))
    if not parts or any(p not in TIERS for p in parts) or len(set(parts)) != len(parts):
        raise ValueError(text)
    return parts


_T = TypeVar("_T")


def _checked(convert: Callable[[str], _T], ok: Callable[[_T], bool]) -> Callable[[str], _T]:
    """One variable's parser: ``convert(text)`` (ValueError on a malformed number), then ValueError
    unless ``ok(value)``."""

    def parse(text: str) -> _T:
        value = convert(text)
        if not ok(value):
            raise ValueError(text)
        return value

    return parse


_fraction = _checked(float, lambda v: 0.0 < v <= 1.0)
_seconds = _checked(float, lambda v: 0.0 < v <= 86400.0)
_seconds_short = _checked(float, lambda v: 0.0 < v <= 60.0)
_positive_int = _checked(int, lambda v: v > 0)
_nonneg_int = _checked(int, lambda v: v >= 0)
_kv_bits = _checked(int, lambda v: v in (0, 4, 8))
_group = _checked(int, lambda v: v in (32, 64, 128))
_chunk = _checked(int, lambda v: v == 0 or 16 <= v <= 65536)
_block = _checked(int, lambda v: 16 <= v <= 8192)
_restore = _checked(lambda t: t.strip().lower(), lambda t: t in RESTORE_MODES)
_switch = _checked(lambda t: t.strip().lower(), lambda t: t in ("auto", "on", "off"))


REDIS_FORM = "redis://[[user]:password@]host[:port][/db] or rediss://… (empty = off)"


def redis_url(text: str) -> str:
    """Validate a Redis URL (scheme, host, port, db number); returns it stripped. ValueError."""
    t = text.strip()
    if not t:
        return ""
    u = urlsplit(t)
    if u.scheme not in ("redis", "rediss") or not u.hostname or u.query or u.fragment:
        raise ValueError(text)
    port = u.port  # raises ValueError when out of range or not a number
    if port is not None and port == 0:
        raise ValueError(text)
    db = unquote(u.path.lstrip("/"))
    if db and (not db.isdigit() or int(db) > 65535):
        raise ValueError(text)
    return t


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s,]+", re.IGNORECASE)  # scheme://host[:port]


def _origins(text: str) -> tuple[str, ...]:
    """``*``, ``none`` (or empty), or ``local`` and origins ``scheme://host[:port]``,
    comma-separated; an origin as a browser sends it (no path, no trailing slash). ValueError
    otherwise."""
    t = text.strip()
    if t.lower() in ("", "none", "off"):
        return ()
    parts = tuple("local" if p.strip().lower() == "local" else p.strip() for p in t.split(","))
    if any(p not in ("*", "local") and not _ORIGIN.fullmatch(p) for p in parts):
        raise ValueError(text)
    return ("*",) if "*" in parts else parts


def _json_object(text: str) -> str:
    """A JSON object (empty text: none), returned as compact JSON. ValueError otherwise."""
    if not text.strip():
        return ""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(text)
    return json.dumps(value, separators=(",", ":"))


def _path(text: str) -> Path:
    if not text.strip():
        raise ValueError(text)
    return Path(text).expanduser()


def _size(text: str) -> int:
    return parse_size(text)


# variable → (field, parser, accepted form)
_SPEC: dict[str, tuple[str, object, str]] = {
    "TIERED_KV_DIR": ("cache_dir", _path, "a directory path"),
    "TIERED_KV_MODELS_DIR": ("models_dir", _path, "a directory path"),
    "TIERED_KV_TIERS": ("tiers", _tiers, '"hot,cold", "hot", "cold" or "none"'),
    "TIERED_KV_HOT_BYTES": ("hot_bytes", _size, SIZE_FORM),
    "TIERED_KV_MEMORY_THRESHOLD": ("memory_threshold", _fraction, "a number in (0, 1], e.g. 0.85"),
    "TIERED_KV_MIN_CONTINUATION_TOKENS": ("min_continuation_tokens", _nonneg_int, "an integer ≥ 0"),
    "TIERED_KV_CHECKPOINT_TOKENS": ("checkpoint_tokens", _block, "an integer from 16 to 8192"),
    "TIERED_KV_CHECKPOINT_SHARE": ("checkpoint_share", _fraction, "a number in (0, 1], e.g. 0.25"),
    "TIERED_KV_PREFILL_CHUNK": ("prefill_chunk", _chunk, "0 (auto) or an integer from 16 to 65536"),
    "TIERED_KV_DISK_BYTES": ("disk_bytes", _size, SIZE_FORM),
    "TIERED_KV_DISK_FREE_FLOOR": ("disk_free_floor", _size, SIZE_FORM),
    "TIERED_KV_BLOCK_TOKENS": ("block_tokens", _block, "an integer from 16 to 8192"),
    "TIERED_KV_SPILL_QUEUE_BYTES": ("spill_queue_bytes", _size, SIZE_FORM),
    "TIERED_KV_COLD_DEADLINE": ("cold_deadline", _seconds, "seconds in (0, 86400], e.g. 0.5"),
    "TIERED_KV_SHUTDOWN_SECONDS": ("shutdown_seconds", _seconds, "seconds in (0, 86400], e.g. 300"),
    "TIERED_KV_WRITE_THROUGH": ("write_through", _bool, "1/0, true/false, yes/no, on/off"),
    "TIERED_KV_KV_BITS": ("kv_bits", _kv_bits, "0, 4 or 8"),
    "TIERED_KV_KV_GROUP_SIZE": ("kv_group_size", _group, "32, 64 or 128"),
    "TIERED_KV_CACHE_SALT": ("cache_salt", str, "any string"),
    "TIERED_KV_API_KEY": ("api_key", str, "any string"),
    "TIERED_KV_MAX_BODY_BYTES": ("max_body_bytes", _size, SIZE_FORM),
    "TIERED_KV_ALLOWED_ORIGINS": (
        "allowed_origins", _origins,
        '"local", "*", "none" or comma-separated origins such as local,https://chat.example.com',
    ),  # fmt: skip
    "TIERED_KV_SHARED": ("shared_url", redis_url, REDIS_FORM),
    "TIERED_KV_SHARED_TIMEOUT": ("shared_timeout", _seconds_short, "seconds in (0, 60], e.g. 1"),
    "TIERED_KV_SHARED_QUEUE_BYTES": ("shared_queue_bytes", _size, SIZE_FORM),
    "TIERED_KV_MAX_BATCH": ("max_batch", _positive_int, "an integer ≥ 1"),
    "TIERED_KV_MAX_QUEUE": ("max_queue", _nonneg_int, "an integer ≥ 0"),
    "TIERED_KV_RESTORE": ("restore", _restore, '"auto", "load", "compute" or "both"'),
    "TIERED_KV_SHARED_PREFILL": ("shared_prefill", _switch, '"auto", "on" or "off"'),
    "TIERED_KV_WARMUP": ("warmup", _switch, '"auto", "on" or "off"'),
    "TIERED_KV_STEP_SHAPES": ("step_shapes", _switch, '"auto", "on" or "off"'),
    "TIERED_KV_MAX_TOKENS": ("max_tokens", _nonneg_int, "an integer ≥ 0 (0: all the context leaves)"),
    "TIERED_KV_CHAT_TEMPLATE_ARGS": (
        "chat_template_args", _json_object, 'a JSON object such as {"enable_thinking": false}'
    ),
}
_SECRET = {"TIERED_KV_SHARED"}  # never echoed in an error message
PREFETCH_FORM = 'an entry count such as "4" or a size such as "2GiB" (0 = off)'


def from_env(env: Mapping[str, str] | None = None, **overrides: object) -> Config:
    """Build the Config from ``env`` (default ``os.environ``); ``overrides`` (CLI flags) win.

    Raises ConfigError naming the first bad variable. Unknown ``TIERED_KV_*`` names are errors too,
    so a typo does not silently fall back to a default.
    """
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    known = set(_SPEC) | {"TIERED_KV_PREFETCH"}
    for name in sorted(env):
        if name.startswith("TIERED_KV_") and name not in known:
            raise ConfigError(f"{name}: unknown variable (known: {', '.join(sorted(known))})")
    for name, (attr, parse, form) in _SPEC.items():
        if name in env:
            try:
                values[attr] = parse(env[name])  # type: ignore[operator]
            except (ValueError, TypeError):
                shown = "(value hidden: may hold a password)" if name in _SECRET else repr(env[name])
                raise ConfigError(f"{name}={shown}: expected {form}") from None
    if "TIERED_KV_PREFETCH" in env:
        raw = env["TIERED_KV_PREFETCH"].strip()
        try:
            if raw.isdigit():
                values["prefetch_entries"] = int(raw)
            else:
                values["prefetch_bytes"] = parse_size(raw)
        except ValueError:
            raise ConfigError(f"TIERED_KV_PREFETCH={raw!r}: expected {PREFETCH_FORM}") from None
    names = {f.name for f in fields(Config)}
    for key, value in overrides.items():
        if key not in names:
            raise TypeError(f"unknown Config field {key}")
        if value is not None:
            values[key] = value
    return Config(**values)  # type: ignore[arg-type]


def env_table() -> list[tuple[str, str, str]]:
    """(variable, default, accepted form) of every variable :func:`from_env` reads."""
    default = Config()
    rows = []
    for name, (attr, _, form) in _SPEC.items():
        rows.append((name, str(getattr(default, attr)), form))
    rows.append(("TIERED_KV_PREFETCH", "0", PREFETCH_FORM))
    return rows
