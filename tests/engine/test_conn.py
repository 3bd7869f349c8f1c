"""engine/conn.py: the repeated-log-line filter, the file-handle limits, and the JSON 431 of the
in-process test server (the header deadline and the rest are tested with real sockets against
`tiered-kv serve` in tests/reliability/test_connections.py)."""

from __future__ import annotations

import logging
import resource

import httpx

from engine import conn


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def record(msg: str, *args: object, name: str = "asyncio") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)


def test_repeated_lines_pass_a_burst_then_are_counted():
    clock = Clock()
    f = conn.RepeatFilter(burst=3, window=60, clock=clock)
    flood = [record("socket.accept() out of system resource\nsocket: fd=%d", i) for i in range(50)]
    assert sum(f.filter(r) for r in flood) == 3
    assert f.filter(record("another line"))  # other lines are not held back
    clock.t = 61  # next window: the line passes again and says how many were dropped
    r = record("socket.accept() out of system resource\nsocket: fd=%d", 99)
    assert f.filter(r) and "[47 similar lines suppressed]" in r.getMessage()


def test_distinct_lines_all_pass():
    f = conn.RepeatFilter(burst=2, window=60, clock=Clock())
    assert all(f.filter(record('%s - "GET /health" 200', f"127.0.0.1:{p}")) for p in range(100))


def test_raise_nofile_limit_within_hard():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        got = conn.raise_nofile_limit(want=128)
        assert got == (128, hard) and resource.getrlimit(resource.RLIMIT_NOFILE) == (128, hard)
        assert conn.raise_nofile_limit(want=100)[0] == 128  # never lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_in_process_server_answers_an_oversized_header_block_with_a_json_431(live):
    """The tests' in-process server runs `tiered-kv serve`'s own (``cli_serve.http_server``: the
    guarded h11 protocol), so every HTTP test goes through the production edge; it ran plain
    uvicorn, whose answer to a 200 KB header is a plain-text 400 and a reset."""
    for _ in range(2):
        r = httpx.get(f"{live.url}/health", headers={"x-big": "a" * 200_000}, timeout=30)
        assert r.status_code == 431, r.text
        assert r.json()["error"]["code"] == "request_headers_too_large"
    assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
