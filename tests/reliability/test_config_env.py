"""Every TIERED_KV_* variable given a bad value: `tiered-kv serve` and `tiered-kv cache stats` exit
non-zero with a one-line error naming the variable (subprocesses, several at once)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.reliability.server import SOAK
from tests.serving import clean_env
from tiered_kv.config import env_table

ANY_STRING = {"TIERED_KV_CACHE_SALT", "TIERED_KV_API_KEY"}  # every string is a valid value
BAD: dict[str, list[str]] = {
    "TIERED_KV_DIR": ["", "  "],
    "TIERED_KV_MODELS_DIR": [""],
    "TIERED_KV_TIERS": ["warm", "hot,hot", "hot;cold"],
    "TIERED_KV_MEMORY_THRESHOLD": ["0", "1.5", "nan", "-0.1", "half"],
    "TIERED_KV_MIN_CONTINUATION_TOKENS": ["-1", "1.5", "many"],
    "TIERED_KV_CHECKPOINT_TOKENS": ["8", "1e9", "x"],
    "TIERED_KV_CHECKPOINT_SHARE": ["0", "2"],
    "TIERED_KV_PREFILL_CHUNK": ["-1", "15", "70000"],
    "TIERED_KV_BLOCK_TOKENS": ["0", "7", "9000", "sixteen"],
    "TIERED_KV_WRITE_THROUGH": ["maybe", "2"],
    "TIERED_KV_WARMUP": ["later", "2"],  # auto | on | off
    "TIERED_KV_STEP_SHAPES": ["padded", "1"],  # auto | on | off
    "TIERED_KV_KV_BITS": ["3", "16", "-4"],
    "TIERED_KV_KV_GROUP_SIZE": ["16", "100"],
    "TIERED_KV_PREFETCH": ["-1", "lots", "2 parsecs"],
    "TIERED_KV_SHARED": ["http://cache:6379", "redis://", "redis://cache:99999", "redis://h/x"],
    "TIERED_KV_SHARED_TIMEOUT": ["0", "61", "soon"],
    "TIERED_KV_MAX_BATCH": ["0", "-2", "eight"],
    "TIERED_KV_MAX_QUEUE": ["-1", "1.5", "lots"],
    "TIERED_KV_RESTORE": ["fast", "load,compute"],
    "TIERED_KV_SHARED_PREFILL": ["yes", "1"],
    "TIERED_KV_COLD_DEADLINE": ["0", "-1", "soon", "nan"],
    "TIERED_KV_SHUTDOWN_SECONDS": ["0", "1e9", "forever"],
    "TIERED_KV_CHAT_TEMPLATE_ARGS": ["[1]", "{nope", '"thinking"'],
    "TIERED_KV_MAX_TOKENS": ["-1", "lots", "1.5"],
    "TIERED_KV_ALLOWED_ORIGINS": ["localhost:3000", "http://ui.example/", "http://a.example,,*"],
}
SIZE_BAD = ["-1", "12XB", "1.5.5GB", "GB", "inf"]


def cases() -> list[tuple[str, str]]:
    out = []
    for name, _default, form in env_table():
        if name in ANY_STRING:
            continue
        values = BAD.get(name) or (SIZE_BAD if "size" in form else [])
        assert values, f"no bad value listed for {name}"  # a new variable needs its cases here
        out += [(name, v) for v in (values if SOAK else values[:1])]  # CI: one per variable
    return out


def test_every_variable_has_bad_values_or_accepts_any_string():
    names = {n for n, _, _ in env_table()}
    assert ANY_STRING <= names
    assert {n for n, _ in cases()} | ANY_STRING == names


def _run_all(argvs: list[tuple[tuple[str, str], list[str], dict[str, str]]]) -> dict:
    results: dict = {}
    running: list = []
    pending = list(argvs)
    while pending or running:
        while pending and len(running) < 6:
            key, argv, env = pending.pop()
            p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)  # fmt: skip
            running.append((key, p))
        key, p = running.pop(0)
        out, err = p.communicate(timeout=120)
        results[key] = (p.returncode, out, err)
    return results


@pytest.mark.slow
def test_bad_value_exits_nonzero_with_one_line_naming_it(tiny_model_dir, tmp_path):
    jobs = []
    for name, value in cases():
        env = clean_env(TIERED_KV_DIR=str(tmp_path / "kv"), TIERED_KV_MODELS_DIR=str(tmp_path))
        env[name] = value
        serve = [
            sys.executable,
            "-m",
            "engine.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--port",
            "9",
        ]  # fmt: skip  (never reached: the config is checked first)
        stats = [sys.executable, "-m", "engine.cli", "cache", "stats"]
        jobs += [((name, value, "serve"), serve, env), ((name, value, "stats"), stats, env)]
    bad = []
    for (name, value, cmd), (rc, _out, err) in sorted(_run_all(jobs).items()):
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        if rc == 0 or len(lines) != 1 or name not in lines[0]:
            bad.append((name, value, cmd, rc, err[-300:]))
    assert not bad, bad
    print(f"config: {len(jobs)} bad-value runs")


def test_template_args_naming_the_templates_own_stop_serve_before_the_model_loads(
    tiny_model_dir, tmp_path
):
    env = clean_env(TIERED_KV_DIR=str(tmp_path / "kv"), TIERED_KV_MODELS_DIR=str(tmp_path),
                    TIERED_KV_CHAT_TEMPLATE_ARGS='{"add_generation_prompt": false}')  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny_model_dir),
                        "--port", "9"], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "TIERED_KV_CHAT_TEMPLATE_ARGS" in lines[0] and "add_generation_prompt" in lines[0]


def test_cache_dir_that_is_a_file(tiny_model_dir, tmp_path):
    """A path that exists but is not a directory: a one-line error, not a traceback."""
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    env = clean_env(TIERED_KV_DIR=str(f / "kv"), TIERED_KV_MODELS_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny_model_dir),
                        "--port", "9"], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [ln for ln in r.stderr.strip().splitlines() if "Traceback" in ln or "Error" in ln]
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and "TIERED_KV_DIR" in r.stderr, lines or r.stderr[-500:]
