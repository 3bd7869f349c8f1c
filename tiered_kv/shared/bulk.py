"""Large Redis values without extra copies: GET straight into the caller's buffer, SET from a view.

Why not plain ``client.get`` / ``client.set``: redis-py reads a reply through its socket buffer and
parser into a new ``bytes`` object (a 64 MiB chunk is copied two or three times; measured 2-3x
slower than reading the socket into place on loopback), and hiredis packs a SET's value into one
new command buffer. Here one RESP command is written with the value as its own piece and a bulk
reply is read with ``recv_into`` into the destination. Everything else uses the redis-py client.

Each call takes a connection from the client's pool and gives it back; on any error the
connection is dropped (its stream position is unknown). Errors: ``redis.exceptions.*`` and
``OSError`` (socket timeouts included), as from the client.
"""

from __future__ import annotations

import time
from typing import Any

import redis

_MAX_LINE = 64


def get_into(
    client: redis.Redis, key: str, out: memoryview, deadline: float | None = None
) -> int | None:
    """Read ``key``'s value into ``out``; its length, or None when the key does not exist.
    A value of another length than ``len(out)`` raises ``ValueError`` (nothing read past it);
    past ``deadline`` (``time.monotonic()``) the read raises ``TimeoutError`` (a link that
    trickles bytes never trips the socket's per-``recv`` timeout)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    ok = False
    try:
        conn.send_command("GET", key)
        sock = _socket(conn)
        line = _line(sock)
        if line == b"_":  # RESP3 null (redis-py negotiates RESP3 where the server speaks it)
            ok = True
            return None
        if line.startswith(b"-"):
            raise redis.exceptions.ResponseError(line[1:].decode(errors="replace"))
        if not line.startswith(b"$"):
            raise redis.exceptions.InvalidResponse(f"unexpected reply {line[:16]!r}")
        n = int(line[1:])
        if n < 0:
            ok = True
            return None
        if n != len(out):
            raise ValueError(f"value of {n} bytes where {len(out)} were expected")
        _read_exact(sock, out, deadline)
        _read_exact(sock, memoryview(bytearray(2)), deadline)  # the closing CRLF
        ok = True
        return n
    finally:
        if not ok:
            conn.disconnect()
        pool.release(conn)


def set_from(client: redis.Redis, key: str, value: memoryview) -> None:
    """SET ``key`` to ``value`` (sent as is, no copy of its bytes)."""
    k = key.encode()
    head = b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, len(value))
    pool = client.connection_pool
    conn = pool.get_connection()
    ok = False
    try:
        conn.send_packed_command([head, value, b"\r\n"])
        reply = conn.read_response()
        if reply not in (b"OK", "OK", True):
            raise redis.exceptions.InvalidResponse(f"SET answered {reply!r}")
        ok = True
    finally:
        if not ok:
            conn.disconnect()
        pool.release(conn)


def _socket(conn: Any) -> Any:
    sock = getattr(conn, "_sock", None)
    if sock is None:
        raise redis.exceptions.ConnectionError("no socket")
    return sock


def _line(sock: Any) -> bytes:
    """One RESP header line (``$123``), read a byte at a time so nothing past it is consumed."""
    buf = bytearray()
    while not buf.endswith(b"\r\n"):
        b = sock.recv(1)
        if not b:
            raise redis.exceptions.ConnectionError("connection closed by server")
        buf += b
        if len(buf) > _MAX_LINE:
            raise redis.exceptions.InvalidResponse("reply header too long")
    return bytes(buf[:-2])


def _read_exact(sock: Any, view: memoryview, deadline: float | None = None) -> None:
    got, n = 0, len(view)
    while got < n:
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"read of {n} bytes past its deadline ({got} read)")
        k = sock.recv_into(view[got:], min(n - got, 1 << 20))
        if k == 0:
            raise redis.exceptions.ConnectionError("connection closed by server")
        got += k
