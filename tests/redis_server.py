"""A real ``redis-server`` for tests: a free loopback port, its own temp dir, no persistence.

``scripts/setup.sh`` installs Debian's ``redis-server``; where the binary is missing the fixture
skips with that reason (under ``CI=true`` it fails instead: CI must have installed it).
:class:`CuttingProxy`: a real TCP proxy in front of it that drops a connection at a chosen command.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from tests.fixtures import free_port


def binary() -> str:
    path = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )
    if path is None:
        msg = "redis-server is not installed (scripts/setup.sh installs Debian's redis-server)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@dataclass
class RedisServer:
    dir: Path
    port: int = field(default_factory=free_port)
    password: str = ""
    maxmemory: str = "0"
    extra: list[str] = field(default_factory=list)  # more redis-server arguments (e.g. TLS)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None,
                           socket_timeout=5)  # fmt: skip

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = [binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", "--maxmemory", self.maxmemory,
                "--maxmemory-policy", "allkeys-lru", "--protected-mode", "yes"]  # fmt: skip
        if self.password:
            argv += ["--requirepass", self.password]
        argv += self.extra
        log = (self.dir / "redis.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server exited {self.proc.returncode}")
            try:
                if self.client().ping():
                    return self
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not come up")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def restart_empty(self) -> None:
        """Killed and started again on the same port with an empty dataset."""
        self.kill()
        self.start()


class CuttingProxy:
    """A real TCP proxy in front of a redis-server that closes a connection, instead of forwarding,
    when the client sends a command containing ``cut`` (e.g. ``b"UNLINK"``): the client sees the
    connection drop at that command (a network fault at a chosen moment, Redis itself unharmed).
    ``cuts``: how many connections it closed so far."""

    def __init__(self, upstream_port: int, cut: bytes) -> None:
        self.cut = cut
        self.cuts = 0
        self._upstream = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="cutting-proxy").start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            server = socket.create_connection(("127.0.0.1", self._upstream))
            with self._lock:
                self._socks += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, inspect: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if inspect and self.cut in data.upper():
                    with self._lock:
                        self.cuts += 1
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for s in self._socks:
                s.close()
