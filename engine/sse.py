"""One job's events → an SSE byte stream or one collected response: the pump both endpoints share.

No transport and no MLX: ``engine/server.py`` hands the bytes to Starlette, the events come from
the engine thread (``engine/events.py``), the OpenAI objects from an ``engine.respond.Output``.
Runs on the asyncio loop; a consumer that stops early (the client went away) cancels the job, and
the engine stores what the request computed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine import respond
from engine.errors import ClientClosed
from engine.events import END, Chunk, Event, Failed, Hit
from engine.worker import Job

HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
KEEPALIVE, DONE = b": keep-alive\n\n", b"data: [DONE]\n\n"


def encode(obj: dict[str, Any], named: bool = False) -> bytes:
    """One SSE event: OpenAI's are data alone, Anthropic's named by the object's ``type``."""
    data = b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
    return b"event: " + str(obj["type"]).encode() + b"\n" + data if named else data


async def events(job: Job, keepalive: float) -> AsyncIterator[Event | None]:
    """A job's events up to its end; None on each idle keep-alive interval."""
    while (ev := await job.get(keepalive)) is not END:
        yield ev


async def pump(
    job: Job, out: respond.Output, first: Any, rest: AsyncIterator[Any],
    on_status: Callable[[int], None] = lambda status: None,
) -> AsyncIterator[bytes]:
    """Streaming: ``out``'s chunks, keep-alives, a mid-stream error object, then (OpenAI) [DONE].
    ``on_status`` gets 200 once the stream is sent whole, 499 when its client went away first
    (before the stream began, too)."""
    named = out.named_events
    sent = False
    try:
        for obj in out.start(first if isinstance(first, Hit) else None):
            yield encode(obj, named)
        ev = first
        while ev is not END:
            if ev is None:
                yield KEEPALIVE
            elif isinstance(ev, Failed):
                yield encode(out.error(ev.error), named)
                break
            elif isinstance(ev, Chunk):
                for obj in out.feed(ev):
                    yield encode(obj, named)
            ev = await anext(rest, END)
        if not named:
            yield DONE
        sent = True
    finally:
        # a job already stopped lost its client before its stream began: the HTTP edge stopped
        # it (a queued one ends unserved, its empty stream "sent" to nobody)
        gone = not sent or job.cancelled()
        job.stop()  # no-op after the end; stops the request if the client went away
        on_status(499 if gone else 200)


async def collect(
    job: Job, out: respond.Output, first: Any, rest: AsyncIterator[Any]
) -> dict[str, Any]:
    """Non-streaming: every chunk through ``out``, then its body (a client that goes away stops
    the job: the HTTP edge watches for it). A failure is re-raised for the HTTP edge; a job whose
    client went away, before it started or during it, is a 499."""
    try:
        ev = first
        while True:
            if ev is END:
                if job.cancelled():
                    raise ClientClosed()
                raise RuntimeError("generation ended without a final chunk")
            if isinstance(ev, Failed):
                raise ev.error
            elif isinstance(ev, Chunk):
                out.feed(ev)
                if ev.finish_reason is not None:
                    if ev.finish_reason == "cancelled":  # its client went away: nobody reads it
                        raise ClientClosed()
                    return out.body()
            ev = await anext(rest, END)
    finally:
        job.stop()
