"""Connection hygiene for `tiered-kv serve`: a header deadline, answers to unreadable requests, the
file-handle limit, log floods.

* **Header deadline.** uvicorn (h11) closes a connection idle *between* requests after
  ``timeout_keep_alive``, but not one that never finishes its request headers: its keep-alive timer
  stops at the first byte, and none runs before the first request. Half-open connections then pile
  up until the process runs out of file handles. :func:`guarded_h11` adds one deadline per request
  for the whole header block (more bytes do not extend it), as nginx's ``client_header_timeout``.
* **Unreadable requests.** A header block past h11's buffer (``h11_max_incomplete_event_size``,
  16 KiB) or a request h11 cannot parse got uvicorn's plain-text 400 and a close with the rest of
  the request unread, which the client sees as a connection reset before it reads the answer. The
  guarded protocol answers with h11's status (431 for the header block), an OpenAI-shaped body, and
  a lingering close: it sends its end, then reads and drops what the client still sends (for at
  most the header deadline), as nginx's ``lingering_close``.
* **File handles.** :func:`raise_nofile_limit` lifts the soft RLIMIT_NOFILE towards the hard limit
  at start (macOS defaults to a soft limit of 256); :func:`mlx_lm_keeps_hard_limit` stops
  mlx-lm's import-time ``setrlimit(RLIMIT_NOFILE, (2048, 4096))`` from lowering a higher hard limit
  for good, or from failing the whole start where the hard limit is below 4096.
* **Log floods.** :class:`RepeatFilter` lets a repeated log line through a few times a minute and
  then counts it (out of file handles, asyncio logs every failed ``accept``, each with a traceback).

Runs on the asyncio loop only; no MLX.

It also owns the connection timings' defaults (the ``tiered-kv serve`` flags' and the app's).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.errors import error_body

log = logging.getLogger(__name__)

#: seconds a connection may take to send a request's headers before it is closed (--header-timeout)
HEADER_TIMEOUT_SECONDS = 10.0
#: seconds an idle keep-alive connection stays open between requests (--idle-timeout)
IDLE_TIMEOUT_SECONDS = 5.0
#: seconds a client may take to send its request body before a 408 (--body-timeout)
BODY_TIMEOUT_SECONDS = 30.0
#: seconds between SSE keep-alive comments while a stream waits for tokens (--keepalive)
KEEPALIVE_SECONDS = 5.0


class _HintedConnection(h11.Connection):
    """h11's connection that keeps the status its last protocol error hints at (431: the header
    block outgrew the buffer; 400 else)."""

    error_status = 400

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint
            raise


class _HeaderDeadline(H11Protocol):
    """H11Protocol that closes a connection whose request headers are not complete in time, and
    answers a request h11 cannot read with its status, then closes lingering."""

    header_timeout: float = HEADER_TIMEOUT_SECONDS
    _lingering = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn.__class__ = _HintedConnection  # uvicorn builds it; same state, its errors kept

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a request already answered: dropped
            return
        super().data_received(data)
        self._watch_headers()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot serve (``msg`` says why): h11's status, an
        OpenAI-shaped body, then the lingering close."""
        status = 431 if getattr(self.conn, "error_status", 400) == 431 else 400
        if status == 431:
            message, code = "request header fields too large", "request_headers_too_large"
        else:
            message, code = msg.rstrip("."), "invalid_http_request"
        body = json.dumps(error_body(message, code=code)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]  # fmt: skip
        head = h11.Response(status_code=status, headers=headers,
                            reason=HTTPStatus(status).phrase.encode())  # fmt: skip
        for event in (head, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event) or b"")
        if not self.transport.can_write_eof():  # TLS: no half-close, uvicorn's plain close
            self.transport.close()
            return
        # closing with unread bytes would reset the connection, and the client would lose the
        # answer: end our side, drop what comes until the client ends its own (or the deadline)
        self._lingering = True
        self.transport.write_eof()
        self.loop.call_later(self.header_timeout, self.transport.close)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _awaiting_headers(self) -> bool:
        """Before the first request, or after a response until the next request's headers end."""
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _watch_headers(self) -> None:
        """One deadline from the moment we wait for a request until its headers are complete;
        bytes that trickle in do not extend it. (Idle between requests, uvicorn's keep-alive
        timer closes the connection first when it is the shorter.)"""
        if not self._awaiting_headers():
            self._cancel_header_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._awaiting_headers():
            self.transport.close()


def guarded_h11(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a ``header_timeout`` deadline (seconds) on request headers;
    pass it as ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (_HeaderDeadline,), {"header_timeout": header_timeout})


def raise_nofile_limit(want: int = 65536) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to ``min(want, hard)`` when it is lower; returns (soft, hard)
    as they are afterwards. A platform without it or a refusal leaves the limit as it is."""
    try:
        import resource
    except ImportError:  # not POSIX
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # macOS caps at OPEN_MAX for some hard values
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft, hard


@contextmanager
def mlx_lm_keeps_hard_limit() -> Iterator[None]:
    """While importing mlx-lm: its ``setrlimit(RLIMIT_NOFILE, (2048, 4096))`` only raises the
    soft limit, within the hard one, and never changes the hard limit."""
    try:
        import resource
    except ImportError:  # not POSIX
        yield
        return
    original = resource.setrlimit

    def within_hard(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            original(which, limits)
            return
        soft, hard = resource.getrlimit(which)
        want = limits[0] if hard == resource.RLIM_INFINITY else min(limits[0], hard)
        if soft != resource.RLIM_INFINITY and soft < want:
            original(which, (want, hard))

    resource.setrlimit = within_hard
    try:
        import mlx_lm.utils  # noqa: F401  (the import that calls setrlimit)

        yield
    finally:
        resource.setrlimit = original


class RepeatFilter(logging.Filter):
    """Lets each distinct line (logger, level, first line of the message) through ``burst``
    times per ``window`` seconds; the rest are dropped and counted, and the count is appended
    to the next line of that kind let through."""

    def __init__(self, burst: int = 5, window: float = 60.0, clock: Any = time.monotonic) -> None:
        super().__init__()
        self.burst, self.window, self.clock = burst, window, clock
        self._seen: dict[
            tuple[str, int, str], list[float]
        ] = {}  # key -> [window start, n, dropped]
        self._window_start = clock()

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        if now - self._window_start >= self.window:  # forget old keys: the dict stays small
            self._seen = {k: v for k, v in self._seen.items() if v[2]}
            for v in self._seen.values():
                v[0], v[1] = now, 0
            self._window_start = now
        try:
            first = record.getMessage().split("\n", 1)[0][:200]
        except Exception:  # a broken format string: let logging report it
            return True
        key = (record.name, record.levelno, first)
        state = self._seen.setdefault(key, [now, 0, 0])
        state[1] += 1
        if state[1] > self.burst:
            state[2] += 1
            return False
        if state[2]:
            record.msg = f"{record.msg} [{int(state[2])} similar lines suppressed]"
            state[2] = 0
        return True


def install_repeat_filter(
    flt: logging.Filter, names: tuple[str, ...] = ("", "uvicorn", "uvicorn.error", "asyncio")
) -> None:
    """Attach ``flt`` to the handlers of the named loggers ("" is the root logger). The access
    log is left out: one line per request, and a keep-alive client repeats the same line."""
    for name in names:
        for handler in logging.getLogger(name).handlers:
            if flt not in handler.filters:
                handler.addFilter(flt)
