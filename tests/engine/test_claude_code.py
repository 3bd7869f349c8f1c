"""The real Claude Code client (npm ``@anthropic-ai/claude-code``, installed by scripts/setup.sh into
``.tools/claude-code``) against `tiered-kv serve` over Anthropic's Messages API: two turns, a server
restart, one more turn.

Claude Code runs non-interactively (``claude -p``, ``-c`` to continue) in a temp project with HOME in
the temp dir and its non-essential traffic off, with its whole default system prompt and tool set
(~25k tokens of the tiny model's tokenizer: SmolLM2's 8k context cannot hold it, so the model is the
random-weight tiny one, 32k context). Its answers are random text up to the output limit, which
Claude Code treats as an over-long answer and continues, so a turn makes several requests; what is
checked is the protocol (every request a 200, Claude Code reads no API error and counts our cache
reads) and the cache (each request after the first of the session hits memory; the first after the
restart loads from disk). The server's log lines give the table (``pytest -s``, and every failure).
A second test scripts the model's text (the random model never calls a tool): Claude Code gets a
``Read`` call in our ``tool_use`` block, runs it, sends the file back as a ``tool_result``, and takes
the next answer as its result.
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
)  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]
CLAUDE = ROOT / ".tools" / "claude-code" / "node_modules" / ".bin" / "claude"
MAIN_MIN_PROMPT = 10000  # Claude Code's agent turns: its system prompt and tools alone


def claude_env(home: Path, port: int) -> dict[str, str]:
    env = {k: v for k, v in clean_env().items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(
        HOME=str(home),
        ANTHROPIC_BASE_URL=f"http://127.0.0.1:{port}",
        ANTHROPIC_API_KEY="unused",
        ANTHROPIC_MODEL="tiny-test",
        ANTHROPIC_SMALL_FAST_MODEL="tiny-test",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_AUTOUPDATER="1",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="32",
    )
    return env


def ask(project: Path, env: dict[str, str], message: str, cont: bool) -> dict:
    argv = [str(CLAUDE), "-p", message, "--output-format", "json", *(["-c"] if cont else [])]
    r = subprocess.run(argv, cwd=project, env=env, capture_output=True, text=True, timeout=1200,
                       stdin=subprocess.DEVNULL)  # fmt: skip
    try:
        return dict(json.loads(r.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise AssertionError(f"claude -p gave no JSON result ({r.returncode}):\n{r.stdout}\n"
                             f"{r.stderr[-3000:]}") from None  # fmt: skip


@pytest.mark.slow
def test_claude_code_turns_restart_turn(tiny_model_dir, tmp_path):
    client_at(CLAUDE, "@anthropic-ai/claude-code")
    project, home = agent_project(tmp_path)
    port, log = free_port(), tmp_path / "server.log"
    server_env = clean_env(TIERED_KV_DIR=str(tmp_path / "kv"))
    env = claude_env(home, port)
    rows, results, report = agent_session(
        tiny_model_dir, server_env, port, log, lambda message, cont: ask(project, env, message, cont),
        ["What does hello.py print?", "Say goodbye."], "One more: what is 2 + 2?",
    )  # fmt: skip
    print("\n" + report)
    codes = statuses(log, "/v1/messages")
    assert codes and all(s == 200 for s in codes), f"{codes}\n{report}"
    assert len(codes) == len(GENERATION.findall(log.read_text())), report  # each request generated
    for r in results:  # Claude Code read every response (an answer past its limit is not an API error)
        assert r.get("api_error_status") is None, r
    assert all(r["modelUsage"]["tiny-test"]["cacheReadInputTokens"] > 0 for r in results), results
    main = [r for r in rows if r[1] >= MAIN_MIN_PROMPT]
    assert len(main) >= 3 and {r[0] for r in main} == {"1", "2", "3 (after restart)"}, report
    assert main[0][2] == 0 and main[0][3] == "none", report
    after = [r for r in main if r[0].startswith("3")]
    assert after[0][3] == "cold" and after[0][2] > MAIN_MIN_PROMPT, f"no disk hit after the restart\n{report}"
    for row in main[1:]:
        assert row[2] >= row[1] - 1000, f"request of turn {row[0]} missed most of its prompt\n{report}"
        assert row[3] == ("cold" if row is after[0] else "hot"), report
    (tmp_path / "claude_code_table.md").write_text(report + "\n")


@pytest.mark.slow
def test_claude_code_runs_our_tool_call_and_sends_its_result_back(tiny_model_dir, tmp_path):
    client_at(CLAUDE, "@anthropic-ai/claude-code")
    project, home = agent_project(tmp_path)
    hello = project / "hello.py"
    call = json.dumps({"name": "Read", "arguments": {"file_path": str(hello)}})
    scripts = [["I will read it.\n<tool_call>\n", call, "\n</tool_call>"], ["It prints ", "hello from tiered-kv."]]
    config = hot_config(tmp_path / "kv")
    with serve(lambda: ScriptedTurns(Engine(tiny_model_dir, config), scripts), config) as live:
        engine = live.app.state.server.engine
        env = claude_env(home, int(live.url.rsplit(":", 1)[1]))
        result = ask(project, env, "What does hello.py print?", cont=False)
    assert result["result"] == "It prints hello from tiered-kv." and result["num_turns"] == 2, result
    assert result.get("api_error_status") is None and not result["is_error"], result
    assert len(engine.prompts) == 2 and "hello from tiered-kv" not in engine.prompts[0]
    # the tool's result is in the second prompt, after the call as the template renders it
    second = engine.prompts[1]
    assert second.index('"name": "Read"') < second.index("hello from tiered-kv"), second[-2000:]
