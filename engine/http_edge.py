"""The HTTP edge's guards (ASGI / Starlette, no MLX): CORS, the API key, a 503 for requests cut by
shutdown, a bounded request body (decoded as its ``Content-Encoding`` says), and the client going
away. Their errors are OpenAI-shaped, and
Anthropic-shaped on Anthropic's routes (:func:`error_response`)."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Mapping
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from engine import messages, respond
from engine.content_coding import body_too_large, decode
from engine.errors import ApiError, ClientClosed, ShuttingDown


def anthropic_route(path: str) -> bool:
    """``/v1/messages`` and the paths under it speak Anthropic's API, errors included."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


#: seconds a 429 (server busy: the queue is full) or a 503 (shutting down) asks its client to
#: wait (``Retry-After``; the OpenAI and Anthropic SDKs honour it): a place frees as soon as any
#: running request ends
RETRY_AFTER_SECONDS = 1


def retry_after(status: int) -> dict[str, str]:
    """The ``Retry-After`` header of a response with ``status``: on a 429 and a 503, else none."""
    return {"retry-after": str(RETRY_AFTER_SECONDS)} if status in (429, 503) else {}


def error_response(path: str, e: ApiError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """``e`` as the response of a request for ``path``: OpenAI's error body, or Anthropic's on
    its routes (``{"type": "error", "error": {"type", "message"}}``), with ``Retry-After`` where
    the status asks for one (:func:`retry_after`)."""
    body = messages.error_body(e) if anthropic_route(path) else e.body()
    headers = {**retry_after(e.status), **(headers or {})}
    return JSONResponse(body, status_code=e.status, headers=headers)


#: the origins ``local`` stands for: pages served from this machine, any scheme a browser or a
#: desktop web view gives them, any port
LOCAL_ORIGINS = r"[a-z][a-z0-9+.-]*://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?\Z"  # \Z: a prefix is no match


class Cors(CORSMiddleware):
    """ASGI middleware, outermost: Starlette's CORS for ``origins`` (``TIERED_KV_ALLOWED_ORIGINS``;
    ``*``: any; ``local``: :data:`LOCAL_ORIGINS`). A preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) of
    any path is answered here, before the API key is checked (browsers send no credentials on
    it), allowing every method and the headers it asks for; every other response, errors
    included, carries ``Access-Control-Allow-Origin`` for an allowed origin, and lets the page
    read ``Retry-After`` and the cache-hit headers. A refused preflight is an OpenAI-shaped 400."""

    def __init__(self, app: Any, origins: tuple[str, ...]) -> None:
        super().__init__(
            app, allow_origins=[o for o in origins if o != "local"],
            allow_origin_regex=LOCAL_ORIGINS if "local" in origins else None,
            allow_methods=["*"], allow_headers=["*"],
            # a public page's call to this (local) server: Chrome's Private Network Access
            # preflight; the origin check above is the gate
            allow_private_network=True,
            expose_headers=["retry-after", *respond.HIT_HEADERS],
        )  # fmt: skip

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code != 400:
            return answer
        headers = {k: v for k, v in answer.headers.items() if k not in ("content-length", "content-type")}
        why = bytes(answer.body).decode()  # "Disallowed CORS origin, headers"
        e = ApiError(400, f"{why} (TIERED_KV_ALLOWED_ORIGINS)", code="cors_disallowed")
        return JSONResponse(e.body(), status_code=400, headers=headers)


class Auth:
    """ASGI middleware: ``Authorization: Bearer <api_key>`` (or Anthropic's ``x-api-key: <api_key>``)
    on every path except /health."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.key and scope["path"] != "/health":
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            token = given[7:].strip() if given[:7].lower() == b"bearer " else b""
            token = token or headers.get(b"x-api-key", b"").strip()
            if not hmac.compare_digest(token, self.key):
                e = ApiError(401, "invalid or missing API key", code="invalid_api_key")
                await error_response(scope["path"], e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ShutdownGuard:
    """ASGI middleware: a request still waiting when the server stops (uvicorn cancels it after
    its graceful-shutdown timeout) gets a 503 JSON body, not uvicorn's plain-text 500."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except asyncio.CancelledError:
            if started:
                raise
            headers = {"connection": "close"}
            await error_response(scope["path"], ShuttingDown(), headers)(scope, receive, send)


async def hangup(request: Request) -> None:
    """Returns when the client goes away. Call once its body is read: the ASGI server's next
    message is then ``http.disconnect``, whenever that comes."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, bounded in size (413) and in time (408: a client that trickles its body) and
    decoded (:func:`engine.content_coding.decode`, in the thread pool); a client that closed the
    connection before sending all of it is a 499, not a server error."""
    too_big = body_too_large(limit)
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big

    async def collect() -> bytes:
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_big
            parts.append(part)
        return b"".join(parts)

    try:
        body = await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        msg = f"request body not received within {timeout:g} s"
        raise ApiError(408, msg, code="request_timeout") from None
    except ClientDisconnect:
        raise ClientClosed() from None
    encoding = request.headers.get("content-encoding", "")
    return await run_in_threadpool(decode, body, encoding, limit) if encoding else body
