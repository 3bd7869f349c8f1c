"""Shared test helpers of the server side (``engine``): the server in-process over real HTTP, the
server as a ``tiered-kv serve`` subprocess, its environment, and the tool schema requests carry.

The library-side helpers (models, caches, tiers, :func:`free_port`) are in ``tests/fixtures.py``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from engine.cli_serve import http_server
from engine.events import SamplingParams
from engine.generate import Engine
from engine.server import create_app
from tests.fixtures import free_port
from tiered_kv.config import Config

__all__ = [
    "AUTH", "TOOLS", "USER", "Live", "ScriptText", "Scripted", "ScriptedTurns", "agent_project", "agent_session", "client_at", "clean_env",
    "free_port", "hot_config", "serve", "start", "statuses", "stop",
]  # fmt: skip

# One tool, as agents send it: a city (required) and an optional day count.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

AUTH = {"Authorization": "Bearer sekret"}  # the API key of the guarded servers

# a question the tiny models answer with a few tokens
USER = [{"role": "user", "content": "what is the weather in paris and in london today?"}]


def hot_config(tmp: Path, **kw) -> Config:
    """The hot tier alone, small continuation threshold and prefill chunks (a tiny model's scale)."""
    return Config(cache_dir=tmp, tiers=("hot",), min_continuation_tokens=16, prefill_chunk=16, **kw)


# --- a scripted engine: the real one, saying given text --------------------------------------------


class ScriptText:
    """A TextStream that ignores the sampled ids and says ``script`` (then stops)."""

    def __init__(self, script: list[str]):
        self.script, self.completion = list(script), 0

    def add(self, tok: int) -> tuple[str, str | None]:
        if not self.script:
            return "", "stop"
        self.completion += 1
        piece = self.script.pop(0)
        return piece, (None if self.script else "stop")

    def tail(self) -> str:
        return ""


class Scripted:
    """The real engine (model, cache, batch loop), except that its text is ``script`` (the random tiny
    model never writes a tool call) and its request setup before the prefill sleeps ``delay`` seconds
    (on the engine thread, as a slow prefill would)."""

    def __init__(self, engine: Engine, script: list[str], delay: float = 0.0):
        self._engine, self.script, self.delay = engine, script, delay

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def text_stream(self, params: SamplingParams) -> ScriptText:
        time.sleep(self.delay)
        return ScriptText(self.script)


class ScriptedTurns(Scripted):
    """The real engine saying one script per request, in order (then "Done."), and keeping each
    rendered prompt: an agent client's tool loop (a call, the client's result, an answer)."""

    def __init__(self, engine: Engine, scripts: list[list[str]]):
        super().__init__(engine, [])
        self.scripts, self.prompts = scripts, list[str]()

    def encode_text(self, text: str) -> list[int]:
        self.prompts.append(text)
        return list(self._engine.encode_text(text))

    def text_stream(self, params: SamplingParams) -> ScriptText:
        self.script = self.scripts.pop(0) if self.scripts else ["Done."]
        return super().text_stream(params)


# --- in process: uvicorn in a thread ---------------------------------------------------------------


class Live:
    """A running server: ``url``, ``client`` (openai), ``app``."""

    def __init__(self, app, port: int):
        # imported here, not at the top: the engine tests that start no server then run where the
        # openai package is absent (the GPU device's wheels)
        import openai

        self.app, self.url = app, f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="sekret", max_retries=0)


def started(server: uvicorn.Server, timeout: float = 30.0) -> threading.Thread:
    """``server`` running on a thread of its own, once it accepts connections (its thread)."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    return thread


@contextmanager
def serve(make_engine: Callable[[], Any], config: Config, keepalive: float = 0.2) -> Iterator[Live]:
    """Serve the engine that ``make_engine`` builds (on the server's engine thread): an Engine, or a
    stand-in with its interface (test_server.py's scripted engine), as `tiered-kv serve` does
    (:func:`engine.cli_serve.http_server`), on a thread."""
    app = create_app(make_engine, config, keepalive_seconds=keepalive)
    port = free_port()
    # `tiered-kv serve`'s own server (the guarded h11 protocol and its timeouts): every HTTP test
    # goes through the production edge
    server = http_server(app, "127.0.0.1", port, log_level="warning")
    thread = started(server)
    try:
        yield Live(app, port)
    finally:
        server.should_exit = True
        thread.join(30)


# --- a subprocess: `tiered-kv serve` ---------------------------------------------------------------

def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``TIERED_KV_*`` setting, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
    env.update(extra)
    return env


def start(model: Path, env: dict[str, str], port: int, log: Path) -> subprocess.Popen:
    """`tiered-kv serve --model MODEL --port PORT`, logging to ``log``; returns once /health answers."""
    argv = [sys.executable, "-m", "engine.cli", "serve", "--model", str(model), "--port", str(port)]
    proc = subprocess.Popen(argv, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        assert proc.poll() is None, f"server exited early:\n{log.read_text()}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server did not come up:\n{log.read_text()}")


def stop(proc: subprocess.Popen, log: Path) -> None:
    """SIGTERM, and check the server shut down gracefully."""
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"server ignored SIGTERM:\n{log.read_text()}") from None
    # uvicorn re-raises the signal after its graceful shutdown, so the exit status is "killed by SIGTERM"
    assert rc in (0, -signal.SIGTERM), log.read_text()
    assert "Application shutdown complete" in log.read_text()


# --- a real agent client's session over `tiered-kv serve` ------------------------------------------

#: the server's line per generation (engine/metrics.py)
GENERATION = re.compile(
    r"generation: prompt (\d+) tokens, cached (\d+) \(tier (\w+)\), ttft ([\d.]+)s, completion (\d+)"
)
Row = tuple[str, int, int, str, float, int]  # turn, prompt, cached, tier, TTFT s, completion


def client_at(path: Path, what: str) -> None:
    """Skip (fail under CI) when the npm client ``path`` that setup.sh installs is missing."""
    import pytest

    if not path.exists():
        msg = f"{path} missing: run scripts/setup.sh (npm install of {what})"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def agent_project(tmp_path: Path) -> tuple[Path, Path]:
    """A client's project (holding ``hello.py``) and its HOME, fresh under ``tmp_path``."""
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    home.mkdir()
    (project / "hello.py").write_text("print('hello from tiered-kv')\n")
    return project, home


def generations(log: Path) -> list[tuple[int, int, str, float, int]]:
    return [(int(m[1]), int(m[2]), m[3], float(m[4]), int(m[5])) for m in GENERATION.finditer(log.read_text())]


def statuses(log: Path, route: str) -> list[int]:
    """HTTP statuses of the POSTs to ``route`` in the server's access log."""
    return [int(s) for s in re.findall(rf'"POST {re.escape(route)}(?:\?\S*)? HTTP/1.1" (\d+)', log.read_text())]


def agent_session(
    model: Path, server_env: dict[str, str], port: int, log: Path, ask: Callable[[str, bool], Any],
    messages: list[str], after_restart: str,
) -> tuple[list[Row], list[Any], str]:  # fmt: skip
    """``messages`` as the turns of one session (``ask(message, continue)``: the client's own
    command), a graceful restart of the server, then ``after_restart`` continuing it. Returns a row
    per generation the server logged (labelled with its turn), what each ``ask`` returned, and the
    rows as a markdown table."""
    rows: list[Row] = []
    answers: list[Any] = []

    def turn(label: str, message: str, cont: bool) -> None:
        seen = len(generations(log))
        answers.append(ask(message, cont))
        rows.extend((label, *r) for r in generations(log)[seen:])

    proc = start(model, server_env, port, log)
    try:
        for i, message in enumerate(messages):
            turn(str(i + 1), message, i > 0)
    finally:
        stop(proc, log)
    proc = start(model, server_env, port, log)
    try:
        turn(f"{len(messages) + 1} (after restart)", after_restart, True)
    finally:
        stop(proc, log)
    table = ["| turn | request | prompt tokens | cached tokens | tier | TTFT s | completion |",
             "|---|---|---:|---:|---|---:|---:|"]  # fmt: skip
    for n, (label, p, c, tier, ttft, comp) in enumerate(rows):
        table.append(f"| {label} | {n + 1} | {p} | {c} | {tier} | {ttft:.2f} | {comp} |")
    return rows, answers, "\n".join(table)
