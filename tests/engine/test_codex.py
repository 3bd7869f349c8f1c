"""The real Codex CLI (npm ``@openai/codex``, installed by scripts/setup.sh into ``.tools/codex``)
against `tiered-kv serve` over OpenAI's Responses API (Codex's only wire API for a custom
provider): two turns, a server restart, one more turn.

Codex runs non-interactively (``codex exec``, then ``codex exec resume --last``) in a temp project,
with CODEX_HOME in the temp dir holding a ``config.toml`` whose provider is the server. Its whole
default prompt and tools are ~19k tokens of the tiny model's tokenizer (more than SmolLM2's 8k
context), so the model is the random-weight tiny one (32k context). Codex sends no output limit;
the server's ``TIERED_KV_MAX_TOKENS=32`` ends each answer at 32 tokens, which the Responses API
reports as ``response.incomplete`` (reason ``max_output_tokens``) and Codex as an error of the turn:
that line in its output shows it read our whole stream. Checked besides: every request a 200, each
after the first hits memory, the first after the restart loads from disk. The server's log lines
give the table (``pytest -s``, and every failure). A second test scripts the model's text: Codex
gets an ``exec_command`` call in our ``function_call`` item, runs it, sends its output back as a
``function_call_output``, and prints the next answer.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from engine.generate import Engine
from tests.serving import (
    GENERATION,
    ScriptedTurns,
    agent_project,
    agent_session,
    clean_env,
    client_at,
    free_port,
    hot_config,
    serve,
    statuses,
)

ROOT = Path(__file__).resolve().parents[2]
CODEX = ROOT / ".tools" / "codex" / "node_modules" / ".bin" / "codex"
MAIN_MIN_PROMPT = 10000  # Codex's turns: its instructions and tools alone
INCOMPLETE = "Incomplete response returned, reason: max_output_tokens"


def codex_env(home: Path, port: int) -> dict[str, str]:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(
        'model = "tiny-test"\nmodel_provider = "tkv"\n\n[model_providers.tkv]\nname = "tiered-kv"\n'
        f'base_url = "http://127.0.0.1:{port}/v1"\nwire_api = "responses"\n'
    )
    env = {k: v for k, v in clean_env().items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(HOME=str(home), CODEX_HOME=str(codex_home), OPENAI_API_KEY="unused")
    return env


def ask(project: Path, env: dict[str, str], message: str, cont: bool) -> str:
    argv = [str(CODEX), "exec", "--skip-git-repo-check", *(["resume", "--last"] if cont else []), message]
    r = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=1200,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    return r.stdout + r.stderr


@pytest.mark.slow
def test_codex_turns_restart_turn(tiny_model_dir, tmp_path):
    client_at(CODEX, "@openai/codex")
    project, home = agent_project(tmp_path)
    port, log = free_port(), tmp_path / "server.log"
    server_env = clean_env(TIERED_KV_DIR=str(tmp_path / "kv"), TIERED_KV_MAX_TOKENS="32")
    env = codex_env(home, port)
    rows, said, report = agent_session(
        tiny_model_dir, server_env, port, log, lambda message, cont: ask(project, env, message, cont),
        ["What does hello.py print?", "Say goodbye."], "One more: what is 2 + 2?",
    )  # fmt: skip
    print("\n" + report)
    codes = statuses(log, "/v1/responses")
    assert codes and all(s == 200 for s in codes), f"{codes}\n{report}"
    assert len(codes) == len(GENERATION.findall(log.read_text())), report  # each request generated
    for out in said:  # Codex read each stream to its end (the length stop, named)
        assert INCOMPLETE in out, out[-3000:]
    main = [r for r in rows if r[1] >= MAIN_MIN_PROMPT]
    assert [r[0] for r in main] == ["1", "2", "3 (after restart)"], report
    assert main[0][2] == 0 and main[0][3] == "none", report
    assert main[1][3] == "hot" and main[2][3] == "cold", report
    for row in main[1:]:
        assert row[2] >= row[1] - 1000, f"request of turn {row[0]} missed most of its prompt\n{report}"
    (tmp_path / "codex_table.md").write_text(report + "\n")


@pytest.mark.slow
def test_codex_runs_our_function_call_and_sends_its_output_back(tiny_model_dir, tmp_path):
    client_at(CODEX, "@openai/codex")
    project, home = agent_project(tmp_path)
    call = json.dumps({"name": "exec_command", "arguments": {"cmd": "cat hello.py"}})
    scripts = [["I will look.\n<tool_call>\n", call, "\n</tool_call>"], ["It prints ", "hello from tiered-kv."]]
    config = hot_config(tmp_path / "kv")
    with serve(lambda: ScriptedTurns(Engine(tiny_model_dir, config), scripts), config) as live:
        engine = live.app.state.server.engine
        said = ask(project, codex_env(home, int(live.url.rsplit(":", 1)[1])), "What does hello.py print?", False)
    assert "It prints hello from tiered-kv." in said, said[-3000:]
    assert len(engine.prompts) == 2, said[-3000:]
    second = engine.prompts[1]
    assert second.index('"cat hello.py"') < second.index("hello from tiered-kv"), second[-2000:]
