"""Issue 12.1: a prompt near the body limit is refused by a cheap length bound, before it is
tokenised, so the server's memory stays bounded by the context, not by the body."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from tests.reliability.server import Server
from tests.serving import clean_env

MIB = 1 << 20


def rss_peak(pid: int) -> int:
    """VmHWM: the process's peak resident set, in bytes (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_huge_prompts_get_400_and_memory_stays_bounded(tiny_model_dir, tmp_path):
    env = clean_env(TIERED_KV_DIR=str(tmp_path / "kv"), TIERED_KV_MODELS_DIR=str(tmp_path / "m"),
                    TIERED_KV_MAX_BODY_BYTES="16MiB")  # fmt: skip
    s = Server(tiny_model_dir, env, tmp_path / "log").start()
    try:
        s.complete("warm up the tokenizer and the model")
        assert s.proc is not None
        before = rss_peak(s.proc.pid)
        prompt = "lorem ipsum dolor sit amet, " * (15 * MIB // 28)  # ~15 MB, under the 16 MiB limit
        bodies = [
            ("/v1/completions", {"prompt": prompt, "max_tokens": 1}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}),
        ]
        replies: list[httpx.Response] = []

        def send(path: str, body: dict) -> None:
            replies.append(httpx.post(s.url + path, json=body, timeout=300))

        threads = [threading.Thread(target=send, args=bodies[i % 2]) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in replies:
            assert r.status_code == 400, r.text[:300]
            assert r.json()["error"]["code"] == "context_length_exceeded"
        grown = rss_peak(s.proc.pid) - before
        # four 15 MB bodies are held at once (raw + parsed); tokenising them took gigabytes
        assert grown < 600 * MIB, f"peak RSS grew by {grown / MIB:.0f} MiB"
        s.complete("still serving")
    finally:
        s.stop()
