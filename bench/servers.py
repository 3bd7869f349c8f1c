"""Server subprocesses for the benchmark: start on a free 127.0.0.1 port, wait until ready, stop gracefully.

Ownership: a :class:`ServerProcess` owns its child process and one sampler thread that polls the RSS of the
child's whole process tree (psutil). The peak survives restarts, so a restarted scenario reports the largest
tree seen over all its lives.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

READY_PATHS = ("/health", "/v1/models")


@dataclass(frozen=True)
class ServerSpec:
    """How to launch one server: ``argv`` may contain ``{port}``; ``env`` is merged over os.environ."""

    name: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    unset: tuple[str, ...] = ()  # variables removed from the inherited environment


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ours_spec(
    name: str, model: Path, env: dict[str, str], unset: tuple[str, ...] = ()
) -> ServerSpec:
    argv = (sys.executable, "-m", "engine.cli", "serve", "--model", str(model), "--port", "{port}")
    return ServerSpec(name, argv, env, unset)


def peer_spec(
    name: str, model: Path, env: dict[str, str], unset: tuple[str, ...] = ()
) -> ServerSpec:
    argv = (sys.executable, "-m", "mlx_lm.server", "--model", str(model), "--host", "127.0.0.1")
    return ServerSpec(name, (*argv, "--port", "{port}"), env, unset)


def tree_rss_bytes(root_pid: int) -> int:
    """Sum of RSS over ``root_pid`` and all its descendants (0 once it is gone)."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue  # exited between the listing and the reading
    return total


def _maps_openblas(pid: int) -> bool | None:
    """Whether the process has libopenblas mapped (verifies the BLAS mode); None where unknown."""
    try:
        return any("libopenblas" in m.path for m in psutil.Process(pid).memory_maps())
    except (psutil.Error, AttributeError, NotImplementedError):  # memory_maps: not on macOS
        return None


class ServerProcess:
    """One scenario's server; ``start()``/``stop()`` may be called repeatedly (restart scenarios)."""

    def __init__(self, spec: ServerSpec, log_path: Path, ready_timeout: float = 300.0) -> None:
        self.spec = spec
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.peak_rss = 0
        self.start_seconds: list[float] = []
        self.openblas_mapped: bool | None = None  # libopenblas in the server's memory map (Linux)
        self._sampling = threading.Event()
        self._sampler: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Launch and wait until a ready path answers 200; returns (and records) the start seconds."""
        assert self.proc is None, "already running"
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in self.spec.unset}
        env.update(self.spec.env)
        argv = [a.replace("{port}", str(self.port)) for a in self.spec.argv]
        t0 = time.perf_counter()
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        log.write(f"\n==== start {' '.join(argv)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._sampling.set()
        self._sampler = threading.Thread(
            target=self._sample, name=f"rss-{self.spec.name}", daemon=True
        )
        self._sampler.start()
        self._wait_ready(t0)
        seconds = time.perf_counter() - t0
        self.openblas_mapped = _maps_openblas(self.proc.pid)
        self.start_seconds.append(seconds)
        return seconds

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None
        with httpx.Client(timeout=2.0) as client:
            while time.perf_counter() - t0 < self.ready_timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.spec.name}: server exited with {self.proc.returncode}; see {self.log_path}"
                    )
                for path in READY_PATHS:
                    try:
                        if client.get(self.base_url + path).status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"{self.spec.name}: not ready after {self.ready_timeout:.0f}s")

    def _sample(self) -> None:
        while self._sampling.is_set():
            proc = self.proc
            if proc is not None:
                self.peak_rss = max(self.peak_rss, tree_rss_bytes(proc.pid))
            time.sleep(0.1)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM, wait for a graceful exit (the cold tier flushes), SIGKILL after ``timeout``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            self.peak_rss = max(self.peak_rss, tree_rss_bytes(proc.pid))
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._sampling.clear()
        if self._sampler is not None:
            self._sampler.join()
            self._sampler = None

    def restart(self) -> float:
        self.stop()
        return self.start()
