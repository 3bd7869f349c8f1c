"""tiered_kv/shared/resolve.py: host names resolved off the request path, within the timeout.

The stalled DNS server is a fake (``socket.getaddrinfo`` blocking for one name, a fault); the
Redis is real.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading

import numpy as np
import pytest

from tiered_kv.shared import resolve
from tiered_kv.shared.redis_tier import SharedTier

STALLED = "stalled-dns.invalid"


@pytest.fixture
def stalled_dns(monkeypatch):
    """``getaddrinfo`` of STALLED blocks (a DNS server that does not answer) until the test ends."""
    real = socket.getaddrinfo
    gate = threading.Event()
    calls: list[str] = []

    def getaddrinfo(host, *args, **kw):
        if host == STALLED:
            calls.append(host)
            gate.wait(60)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield calls
    gate.set()


def _no_entries(view: memoryview) -> np.ndarray:
    raise ValueError("no entry is fetched here")


def _in_thread(fn, wait: float) -> list:
    """``fn()``'s result if it returned within ``wait`` seconds (generous: a bound, not a timing)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(wait)
    assert not t.is_alive(), "the call waited on DNS past the shared tier's timeout"
    return out


def test_an_unresolvable_host_costs_a_request_at_most_the_timeout(stalled_dns):
    tier = SharedTier(f"redis://{STALLED}:6379/0", "fp", 16, _no_entries, timeout=0.3)
    got = _in_thread(lambda: tier.lookup(list(range(64))), wait=15)
    assert got == [None] and stalled_dns == [STALLED]
    s = tier.stats()
    assert s["timeouts"] == 1 and s["outages"] == 1 and s["up"] == 0
    assert _in_thread(lambda: tier.lookup(list(range(64))), wait=15) == [None]
    assert tier.stats()["skipped_down"] == 1  # backoff: no second wait


def test_one_lookup_per_name_in_flight_and_the_answer_is_kept():
    r = resolve.Resolver(ttl=60)
    assert r.addresses("127.0.0.1", 1, 0) == ["127.0.0.1"]  # numeric: no lookup
    assert r.addresses("::1", 1, 0) == ["::1"]
    assert "127.0.0.1" in r.addresses("localhost", 6379, 30)
    assert "127.0.0.1" in r.addresses("localhost", 6379, 0)  # known: no wait at all


def test_a_stale_answer_is_used_while_the_refresh_is_stalled(stalled_dns):
    r = resolve.Resolver(ttl=0)
    r._known[(STALLED, 1)] = (0.0, ["127.0.0.9"])  # resolved once, expired since
    assert r.addresses(STALLED, 1, 0) == ["127.0.0.9"]
    assert r.addresses(STALLED, 1, 0) == ["127.0.0.9"]  # the refresh still runs: not restarted
    assert stalled_dns == [STALLED]


def test_a_name_that_does_not_resolve_raises_the_resolvers_error():
    with pytest.raises(OSError):
        resolve.Resolver().addresses("no-such-host.invalid", 1, 30)


def test_redis_by_host_name(redis_server):
    url = redis_server.url.replace("127.0.0.1", "localhost")
    tier = SharedTier(url, "fp", 16, _no_entries, timeout=5)
    assert tier.ping()
    conn = tier.client.connection_pool.get_connection()
    try:
        assert isinstance(conn, resolve.ResolvedConnection) and conn.host == "localhost"
    finally:
        tier.client.connection_pool.release(conn)


def test_tls_checks_the_certificate_against_the_name_not_the_address(tmp_path):
    """A real TLS redis-server whose certificate names only ``localhost``: the connection goes to
    the resolved address, and the handshake still verifies the name (an address would fail)."""
    import subprocess

    import redis

    from tests.fixtures import free_port
    from tests.redis_server import RedisServer

    if shutil.which("openssl") is None:
        msg = "openssl is not installed (scripts/setup.sh installs it with redis-server)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)  # fmt: skip
    server = RedisServer(tmp_path / "redis")
    tls_port = free_port()
    server.extra = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file",
                    str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]  # fmt: skip

    def ping(cls: type, host: str) -> bool:
        conn = cls(host=host, port=tls_port, ssl_ca_certs=str(cert), ssl_check_hostname=True,
                   socket_connect_timeout=10, socket_timeout=10)  # fmt: skip
        try:
            conn.send_command("PING")
            return conn.read_response() in (b"PONG", "PONG")
        finally:
            conn.disconnect()

    server.start()
    try:
        assert ping(resolve.ResolvedSSLConnection, "localhost")
        with pytest.raises(redis.exceptions.ConnectionError):  # the name is what is checked
            ping(resolve.ResolvedSSLConnection, "127.0.0.1")
    finally:
        server.kill()
