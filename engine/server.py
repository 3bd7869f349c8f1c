"""OpenAI-compatible HTTP transport (FastAPI): parse → tokenize → queue on the worker → JSON or SSE.

Ownership: handlers run on the asyncio loop and never touch MLX; tokenizing runs in the thread pool, and
the model is loaded and run on the single :class:`engine.worker.Worker` thread (the engine thread). Schemas
and validation live in ``engine/api.py``, prompt rendering in ``engine/chat.py``, content / reasoning /
tool-call output in ``engine/output.py``. This is the HTTP edge: any
exception becomes an OpenAI-shaped error body here, never a traceback to the client.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine import api, chat, output
from engine.api import ApiError, ChatRequest, CompletionRequest
from engine.generate import Chunk, SamplingParams
from engine.loading import max_token_chars
from engine.metrics import CONTENT_TYPE, Metrics
from engine.worker import END, Job, Worker
from tiered_kv.config import Config
from tiered_kv.tiered import HitInfo

log = logging.getLogger(__name__)
#: request bodies parsed / prompts tokenised at once (thread pool): each holds memory
#: proportional to its body or prompt, and a 16 MB body takes a CPU for a while
TOKENIZE_CONCURRENCY = 2
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
KEEPALIVE = b": keep-alive\n\n"


@dataclass
class _Ctx:
    """One generation request as the transport sees it."""

    rid: str
    created: int
    model: str
    job: Job
    request: Request
    include_usage: bool
    out: output.ChatOutput | None = None  # chat only: content / reasoning / tool calls
    hit: HitInfo | None = None


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _tier_headers(hit: HitInfo | None) -> dict[str, str]:
    if hit is None:
        return {}
    return {"x-tiered-kv-cache-tier": hit.tier, "x-tiered-kv-cached-tokens": str(hit.tokens)}


class _Auth:
    """ASGI middleware: ``Authorization: Bearer <api_key>`` on every path except /health."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.key and scope["path"] != "/health":
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            token = given[7:].strip() if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                body = api.error_body(
                    "invalid or missing API key", "invalid_request_error", None, "invalid_api_key"
                )
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ShutdownGuard:
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
            body = api.error_body(
                "the server is shutting down; retry the request",
                "server_error",
                None,
                "server_shutting_down",
            )
            headers = {"connection": "close", "retry-after": "1"}
            await JSONResponse(body, status_code=503, headers=headers)(scope, receive, send)


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, bounded in size (413) and in time (408: a client that trickles its body)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")

    async def collect() -> bytes:
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise ApiError(
                    413, f"request body larger than {limit} bytes", code="request_too_large"
                )
            parts.append(part)
        return b"".join(parts)

    try:
        return await asyncio.wait_for(collect(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(
            408, f"request body not received within {timeout:g} s", code="request_timeout"
        ) from None


class Server:
    """Routes bound to one worker (which owns the engine) + metrics."""

    def __init__(
        self,
        worker: Worker,
        config: Config,
        keepalive_seconds: float = 5.0,
        model_id: str | None = None,
        body_timeout_seconds: float = 30.0,
    ):
        self.worker, self.config, self.keepalive = worker, config, keepalive_seconds
        self.body_timeout = body_timeout_seconds
        self._model_id = model_id
        self.created = api.now()
        self.metrics = Metrics(lambda: self.engine.cache.stats() if self.engine else {})
        worker.set_on_wait(self.metrics.queue_wait.observe)
        self._max_token_chars = 0  # from the tokenizer, once the engine is loaded
        self._tokenizing = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    @property
    def engine(self) -> Any:
        """The loaded engine (its tokenizer and plain attributes only: MLX stays on its thread)."""
        return self.worker.engine

    @property
    def model_id(self) -> str:
        return self._model_id or self.engine.model_dir.name

    # -- plumbing --------------------------------------------------------------------------------
    def _error(self, endpoint: str, e: Exception) -> JSONResponse:
        if isinstance(e, ApiError):
            self.metrics.request(endpoint, e.status)
            return JSONResponse(e.body(), status_code=e.status)
        log.exception("internal error on %s", endpoint)
        self.metrics.request(endpoint, 500)
        return JSONResponse(api.error_body(f"internal error: {e}", "server_error"), status_code=500)

    def _check_chars(self, n_chars: int, param: str) -> None:
        if not self._max_token_chars:
            self._max_token_chars = max_token_chars(self.engine.tokenizer)
        api.check_chars(n_chars, self.engine.context_length, self._max_token_chars, param)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the thread pool, at most TOKENIZE_CONCURRENCY at once."""
        async with self._tokenizing:
            return await run_in_threadpool(fn, *args)

    def _params(self, req: Any, prompt_len: int) -> SamplingParams:
        max_tokens = api.check_length(prompt_len, req.requested_max(), self.engine.context_length)
        return SamplingParams(max_tokens, req.temperature, req.top_p, req.seed, req.stop_tuple())

    async def _wait_hit(self, ctx: _Ctx) -> list[Any]:
        """Events up to the cache hit (so headers can name the tier), waiting at most one keep-alive."""
        got: list[Any] = []
        while ctx.hit is None:
            item = await ctx.job.get(self.keepalive)
            if item is None:
                break
            if isinstance(item, HitInfo):
                ctx.hit = item
            else:
                got.append(item)
                if item is END or isinstance(item, Exception):
                    break
        return got

    async def _events(self, ctx: _Ctx, early: list[Any]) -> AsyncIterator[Any]:
        """Chunks / exception of a job; None on each idle keep-alive interval."""
        for item in early:
            if item is END:
                return
            yield item
        while True:
            item = await ctx.job.get(self.keepalive)
            if item is END:
                return
            if isinstance(item, HitInfo):
                ctx.hit = item
                continue
            yield item

    async def _collect(self, ctx: _Ctx, early: list[Any]) -> tuple[str, Chunk]:
        """Non-streaming: all text and the last chunk; a client gone away cancels the job."""
        text = []
        async for item in self._events(ctx, early):
            if item is None:
                if await ctx.request.is_disconnected():
                    ctx.job.cancel.set()
                continue
            if isinstance(item, Exception):
                raise item
            text.append(item.text)
            if item.finish_reason is not None:
                if item.usage is not None:
                    self.metrics.generation(item.usage)
                return "".join(text), item
        raise RuntimeError("generation ended without a final chunk")

    # -- chat ------------------------------------------------------------------------------------
    def _chat_prompt(self, req: ChatRequest) -> tuple[list[int], output.ChatOutput]:
        """The prompt ids and the request's output parser (formats from the model's tokenizer)."""
        tools, tok = req.tool_dicts(), self.engine.tokenizer
        fmt = output.OutputFormat.of(tok, hermes=not chat.template_supports_tools(tok))
        parse = bool(tools) and req.tool_choice != "none"
        prefix = fmt.forced_prefix(req.tool_choice) if parse else ""
        try:
            text = chat.render_chat(tok, req.message_dicts(), tools)
        except TemplateError as e:  # e.g. "roles must alternate": the messages, not the server
            raise ApiError(
                400, f"the model's chat template rejected the messages: {e}", param="messages"
            ) from None
        reasoning = fmt.opens_reasoning(text) and not prefix
        out = output.ChatOutput(fmt, tools, parse, req.parallel_tool_calls, reasoning)
        out.feed(prefix)  # a forced call's opener is held until the model closes the call
        self._check_chars(len(text) + len(prefix), "messages")
        return self.engine.encode_text(text + prefix), out

    async def chat_completions(self, request: Request) -> Response:
        try:
            raw = await _read_body(request, self.config.max_body_bytes, self.body_timeout)
            req = await self._off_loop(api.parse_body, raw, ChatRequest)
            self._check_chars(req.content_chars(), "messages")  # before rendering it
            ids, out = await self._off_loop(self._chat_prompt, req)
            params = self._params(req, len(ids))
            ctx = _Ctx(
                api.new_id("chatcmpl"),
                api.now(),
                self.model_id,
                self.worker.submit(ids, params, "chat"),
                request,
                req.include_usage,
                out=out,
            )
            early = await self._wait_hit(ctx)
            if req.stream:
                self.metrics.request("chat", 200)
                stream = self._chat_stream(ctx, early)
                return StreamingResponse(
                    stream,
                    media_type="text/event-stream",
                    headers={**SSE_HEADERS, **_tier_headers(ctx.hit)},
                )
            try:
                text, last = await self._collect(ctx, early)
            finally:
                ctx.job.cancel.set()
            out.feed(text)
            _, finish = out.finish(last.finish_reason)
            res = out.result
            calls = [{k: v for k, v in c.items() if k != "index"} for c in res.tool_calls]
            body = api.chat_response(
                ctx.rid, ctx.model, res.content, calls, finish, last.usage, res.reasoning
            )
            self.metrics.request("chat", 200)
            return JSONResponse(body, headers=_tier_headers(ctx.hit))
        except Exception as e:
            return self._error("chat", e)

    async def _chat_stream(self, ctx: _Ctx, early: list[Any]) -> AsyncIterator[bytes]:
        out = ctx.out
        assert out is not None

        def delta(d: dict[str, Any], finish: str | None = None) -> bytes:
            return _sse(api.chat_chunk(ctx.rid, ctx.created, ctx.model, d, finish))

        try:
            yield delta({"role": "assistant", "content": ""})
            async for item in self._events(ctx, early):
                if item is None:
                    yield KEEPALIVE
                    continue
                if isinstance(item, Exception):
                    yield _sse(_stream_error(item))
                    break
                for d in out.feed(item.text).sse_deltas():
                    yield delta(d)
                if item.finish_reason is not None:
                    tail, finish = out.finish(item.finish_reason)
                    for d in tail.sse_deltas():
                        yield delta(d)
                    yield delta({}, finish)
                    if item.usage is not None:
                        self.metrics.generation(item.usage)
                        if ctx.include_usage:
                            yield _sse(
                                api.usage_chunk(
                                    ctx.rid,
                                    ctx.created,
                                    ctx.model,
                                    "chat.completion.chunk",
                                    item.usage,
                                )
                            )
            yield b"data: [DONE]\n\n"
        finally:
            ctx.job.cancel.set()  # no-op after the end; stops the engine if the client went away

    # -- completions -----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        try:
            raw = await _read_body(request, self.config.max_body_bytes, self.body_timeout)
            req = await self._off_loop(api.parse_body, raw, CompletionRequest)
            self._check_chars(len(req.prompt_text()), "prompt")
            ids = await self._off_loop(self.engine.encode_text, req.prompt_text())
            if not ids:
                raise ApiError(400, "prompt is empty", param="prompt", code="invalid_value")
            params = self._params(req, len(ids))
            ctx = _Ctx(
                api.new_id("cmpl"),
                api.now(),
                self.model_id,
                self.worker.submit(ids, params, "completion"),
                request,
                req.include_usage,
            )
            early = await self._wait_hit(ctx)
            if req.stream:
                self.metrics.request("completions", 200)
                return StreamingResponse(
                    self._completion_stream(ctx, early),
                    media_type="text/event-stream",
                    headers={**SSE_HEADERS, **_tier_headers(ctx.hit)},
                )
            try:
                text, last = await self._collect(ctx, early)
            finally:
                ctx.job.cancel.set()
            finish = api.openai_finish(last.finish_reason, False)
            self.metrics.request("completions", 200)
            body = api.completion_response(ctx.rid, ctx.model, text, finish, last.usage)
            return JSONResponse(body, headers=_tier_headers(ctx.hit))
        except Exception as e:
            return self._error("completions", e)

    async def _completion_stream(self, ctx: _Ctx, early: list[Any]) -> AsyncIterator[bytes]:
        try:
            async for item in self._events(ctx, early):
                if item is None:
                    yield KEEPALIVE
                    continue
                if isinstance(item, Exception):
                    yield _sse(_stream_error(item))
                    break
                finish = api.openai_finish(item.finish_reason, False)
                if item.text or finish:
                    yield _sse(
                        api.completion_chunk(ctx.rid, ctx.created, ctx.model, item.text, finish)
                    )
                if item.usage is not None:
                    self.metrics.generation(item.usage)
                    if ctx.include_usage:
                        yield _sse(
                            api.usage_chunk(
                                ctx.rid, ctx.created, ctx.model, "text_completion", item.usage
                            )
                        )
            yield b"data: [DONE]\n\n"
        finally:
            ctx.job.cancel.set()

    # -- small endpoints -------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        self.metrics.request("models", 200)
        return JSONResponse(api.models_response(self.model_id, self.created))

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": self.model_id,
                "busy": self.worker.busy(),
                "queued": self.worker.pending(),
            }
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def _stream_error(e: Exception) -> dict[str, Any]:
    if isinstance(e, ApiError):
        return e.body()
    log.error("generation failed mid-stream: %s", e)
    return api.error_body(f"internal error: {e}", "server_error")


def create_app(
    engine: Worker | Callable[[], Any],
    config: Config,
    keepalive_seconds: float = 5.0,
    model_id: str | None = None,
    body_timeout_seconds: float = 30.0,
) -> FastAPI:
    """The ASGI app over a :class:`Worker` (or a zero-argument engine factory, run on the worker's
    thread). Its lifespan starts the worker (the model loads there); shutdown cancels jobs and closes
    the engine."""
    worker = engine if isinstance(engine, Worker) else Worker(engine)
    server = Server(worker, config, keepalive_seconds, model_id, body_timeout_seconds)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(server.worker.start)
        yield
        await run_in_threadpool(server.worker.close)

    app = FastAPI(
        title="tiered-kv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.server = server
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_endpoint, methods=["GET"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(
            api.error_body(str(exc.detail), "invalid_request_error", None, code),
            status_code=exc.status_code,
        )

    if config.api_key:
        app.add_middleware(_Auth, api_key=config.api_key)
    app.add_middleware(_ShutdownGuard)  # outermost
    return app
