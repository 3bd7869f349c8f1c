"""Helpers of the reliability tests: `tiered-kv serve` as a black-box subprocess.

``TIERED_KV_SOAK=1`` (read here, by the tests only) raises iteration counts and durations of the
fault loops; the default run stays bounded (seconds per test) and seeded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.serving import free_port

SOAK = os.environ.get("TIERED_KV_SOAK", "") not in ("", "0")


def soak(ci: int, long: int) -> int:
    """``ci`` in the default run, ``long`` under ``TIERED_KV_SOAK=1``."""
    return long if SOAK else ci


@dataclass
class Server:
    """One `tiered-kv serve` subprocess (kill it with ``kill`` / ``stop``)."""

    model: Path
    env: dict[str, str]
    log: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    args: tuple[str, ...] = ()  # extra `tiered-kv serve` flags
    nofile: tuple[int, int] | None = None  # RLIMIT_NOFILE (soft, hard) the server starts with

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> Server:
        argv = [sys.executable, "-m", "engine.cli", "serve", "--model", str(self.model),
                "--port", str(self.port), *self.args]  # fmt: skip
        limits = self.nofile

        def preexec() -> None:
            if limits is not None:
                import resource

                resource.setrlimit(resource.RLIMIT_NOFILE, limits)

        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=preexec)  # fmt: skip
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.kill()
        raise AssertionError(f"server did not come up:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL (the crash under test) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def complete(self, prompt: str, max_tokens: int = 6, timeout: float = 60) -> dict:
        """A temperature-0 /v1/completions answer (JSON body)."""
        r = httpx.post(f"{self.url}/v1/completions", timeout=timeout,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                             "temperature": 0})  # fmt: skip
        assert r.status_code == 200, (r.status_code, r.text, self.tail())
        return r.json()

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out
