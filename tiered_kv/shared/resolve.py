"""Host names resolved off the request path, within the shared tier's timeout.

redis-py resolves the host (``socket.getaddrinfo``) for every new connection on the calling thread
with no bound of its own: a name whose DNS server does not answer held a request for the system
resolver's timeouts (5 s per try and server), far past ``TIERED_KV_SHARED_TIMEOUT``. Here the
lookup runs on a daemon thread; a connection waits for it at most its connect timeout and then
fails as a timeout (the tier logs once and backs off, and the lookup goes on in the background).
An answer is kept for ``ttl`` seconds, then refreshed in the background while the old one
is still used, so once a name has resolved a connection never waits on DNS again. A numeric host
(an IP address) is used as it is.

The connection classes here pass the resolved address to redis-py's own ``_connect`` and put the
name back before TLS is set up, so ``rediss://`` still checks the certificate against the name.
Threads: any; one lookup per name in flight.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Any

import redis


class Resolver:
    def __init__(self, ttl: float = 30.0) -> None:
        self.ttl = ttl
        self._lock = threading.Lock()
        self._known: dict[tuple[str, int], tuple[float, list[str]]] = {}  # → (expires, addresses)
        self._failed: dict[tuple[str, int], OSError] = {}
        self._inflight: dict[tuple[str, int], threading.Event] = {}

    def addresses(self, host: str, port: int, timeout: float | None) -> list[str]:
        """IP addresses of ``host`` (in the system's order). Waits at most ``timeout`` seconds
        for a name not resolved before; raises ``TimeoutError`` past it, the resolver's
        ``OSError`` (``socket.gaierror``) when the name does not resolve."""
        if _numeric(host):
            return [host]
        key = (host, port)
        with self._lock:
            known = self._known.get(key)
            if known is not None and known[0] > time.monotonic():
                return known[1]
            done = self._inflight.get(key)
            if done is None:
                done = self._inflight[key] = threading.Event()
                threading.Thread(target=self._lookup, args=(key, done), daemon=True,
                                 name=f"tiered-kv-resolve-{host}").start()  # fmt: skip
            if known is not None:
                return known[1]  # stale while the refresh runs
        if not done.wait(timeout):
            raise TimeoutError(f"resolving {host!r} took longer than {timeout:g}s")
        with self._lock:
            known = self._known.get(key)
            failed = self._failed.get(key)
        if known is not None:
            return known[1]
        raise failed if failed is not None else OSError(f"resolving {host!r} failed")

    def _lookup(self, key: tuple[str, int], done: threading.Event) -> None:
        try:
            infos = socket.getaddrinfo(key[0], key[1], 0, socket.SOCK_STREAM)
            addrs = list(dict.fromkeys(str(info[4][0]) for info in infos))
            with self._lock:
                if addrs:
                    self._known[key] = (time.monotonic() + self.ttl, addrs)
                    self._failed.pop(key, None)
                else:
                    self._failed[key] = OSError(f"no address for {key[0]!r}")
        except OSError as e:
            with self._lock:
                self._failed[key] = e  # an answer kept from before stays in use
        finally:
            with self._lock:
                del self._inflight[key]
            done.set()


def _numeric(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


#: the process's resolver (one answer per name for every shared-tier client)
RESOLVER = Resolver()


class ResolvedConnection(redis.Connection):
    """A TCP connection whose host name is resolved by :data:`RESOLVER` (bounded by the
    connect timeout) before redis-py connects to the address."""

    def _connect(self) -> Any:
        name = self.host
        addrs = RESOLVER.addresses(name, self.port, self.socket_connect_timeout)
        err: OSError | None = None
        for addr in addrs:
            self.host = addr  # redis-py's getaddrinfo of an address does not touch DNS
            try:
                return super()._connect()
            except OSError as e:
                err = e
            finally:
                self.host = name
        raise err or OSError(f"no address for {name!r}")


class ResolvedSSLConnection(redis.SSLConnection, ResolvedConnection):
    """TLS over :class:`ResolvedConnection`: ``SSLConnection._connect`` wraps the socket that
    ``ResolvedConnection._connect`` returns, with the host name (not the address) for SNI and
    the certificate check."""


def connection_class(scheme: str) -> type[redis.Connection]:
    return ResolvedSSLConnection if scheme == "rediss" else ResolvedConnection
