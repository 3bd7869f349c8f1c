"""The real OpenCode client (npm ``opencode-ai``, installed by scripts/setup.sh into ``.tools/opencode``)
against `tiered-kv serve` on SmolLM2: three turns, a server restart, one more turn.

OpenCode runs non-interactively (``opencode run``, ``-c`` to continue the session) in a temp project with
HOME and the XDG dirs in the temp dir, models.dev / autoupdate / LSP downloads / plugins off, and the
``opencode.json`` the README shows for a small-context model (limit.context / limit.output, the largest
tools off, shell and edits denied). Per request the server's own log line gives prompt tokens, cached
tokens, tier and TTFT; the table is printed (``pytest -s``) and attached to every failure.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.serving import agent_project, agent_session, clean_env, client_at, free_port, statuses

ROOT = Path(__file__).resolve().parents[2]
OPENCODE = ROOT / ".tools" / "opencode" / "node_modules" / ".bin" / "opencode"
MAIN_MIN_PROMPT = (
    2000  # OpenCode's title request is a few hundred tokens; its agent turns thousands
)


def opencode_config(port: int) -> dict:
    """The README's small-context opencode.json (SmolLM2: 8k context)."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "tiered-kv": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "tiered-kv",
                "options": {"baseURL": f"http://127.0.0.1:{port}/v1", "apiKey": "unused"},
                "models": {
                    "smollm2": {"name": "SmolLM2 135M", "limit": {"context": 8192, "output": 128}}
                },
            }
        },
        "model": "tiered-kv/smollm2",
        "small_model": "tiered-kv/smollm2",
        "tools": {"task": False, "todowrite": False, "webfetch": False, "skill": False},
        "permission": {"bash": "deny", "edit": "deny", "webfetch": "deny"},
        "autoupdate": False,
        "share": "disabled",
    }


def opencode_env(home: Path, config: Path) -> dict[str, str]:
    env = clean_env(
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_STATE_HOME=str(home / ".local" / "state"),
        OPENCODE_DISABLE_MODELS_FETCH="1",
        OPENCODE_DISABLE_AUTOUPDATE="1",
        OPENCODE_DISABLE_LSP_DOWNLOAD="1",
        OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
        OPENCODE_DISABLE_SHARE="1",
        OPENCODE_DISABLE_CLAUDE_CODE="1",
    )
    for key in list(env):  # no provider keys or opencode settings from the machine leak in
        if key.startswith(("OPENCODE_CONFIG", "OPENAI_", "ANTHROPIC_")):
            env.pop(key)
    env["OPENCODE_CONFIG"] = str(config)  # found without a git root around the project
    return env


def ask(project: Path, env: dict[str, str], message: str, cont: bool) -> str:
    argv = [str(OPENCODE), "run", *(["-c"] if cont else []), message]
    r = subprocess.run(
        argv,
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        stdin=subprocess.DEVNULL,
    )
    assert r.returncode == 0, (
        f"opencode run failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-3000:]}"
    )
    return r.stdout


@pytest.mark.slow
@pytest.mark.smollm2
def test_opencode_turns_restart_turn(smollm2_dir, tmp_path):
    client_at(OPENCODE, "opencode-ai")
    project, home = agent_project(tmp_path)
    port, log = free_port(), tmp_path / "server.log"
    (project / "opencode.json").write_text(json.dumps(opencode_config(port), indent=2))
    server_env = clean_env(TIERED_KV_DIR=str(tmp_path / "kv"))
    env = opencode_env(home, project / "opencode.json")
    rows, _, report = agent_session(
        smollm2_dir, server_env, port, log, lambda message, cont: ask(project, env, message, cont),
        ["What does hello.py print? Answer in one sentence.", "Which language is hello.py written in?",
         "Thanks. Say goodbye."],
        "One more: what is 2 + 2?",
    )  # fmt: skip
    print("\n" + report)
    codes = statuses(log, "/v1/chat/completions")
    assert codes and all(s == 200 for s in codes), report
    main = [r for r in rows if r[1] >= MAIN_MIN_PROMPT]
    assert len(main) >= 4, report
    for label, _prompt, cached, tier, _, _ in main[1:]:
        assert cached > 0 and tier in ("hot", "cold"), f"turn {label} missed the cache\n{report}"
    first_after = next(r for r in main if r[0].startswith("4"))
    assert first_after[3] == "cold", f"the turn after the restart did not load from disk\n{report}"
    assert all(r[3] == "hot" for r in main[1:] if not r[0].startswith("4")), report
    (tmp_path / "opencode_table.md").write_text(report + "\n")
