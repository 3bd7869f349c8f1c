"""OpenAI-compatible (chat, completions, Responses; and Anthropic Messages) HTTP transport (FastAPI):
bytes → request → worker → SSE or JSON.

Transport only. Handlers run on the asyncio loop and never touch MLX; rendering and tokenizing run
in the thread pool, generation on the :class:`engine.worker.Worker` thread (continuous batching).
Request schemas live in ``engine/api.py``, errors in ``engine/errors.py``, response objects in
``engine/openai_bodies.py``; prompts, tool calls, finish reasons and usage in
``engine/respond.py``; the events a job yields in ``engine/events.py``; the SSE pump and the
non-streaming collector both endpoints share in ``engine/sse.py``. This is the HTTP edge: any
exception becomes an OpenAI-shaped (on ``/v1/messages``, Anthropic-shaped) error body here, never a
traceback to the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from engine import api, chat, conn, messages, openai_bodies, respond, responses, sse
from engine.api import ChatRequest, CompletionRequest
from engine.errors import ApiError, error_body
from engine.events import END, Failed
from engine.http_edge import (
    Auth,
    Cors,
    ShutdownGuard,
    error_response,
    hangup,
    read_body,
    retry_after,
)
from engine.loading import max_token_chars
from engine.metrics import CONTENT_TYPE, Metrics
from engine.tool_calls import CALL_ID_PREFIX
from engine.worker import Job, QueueFull, Worker
from tiered_kv import Config, ConfigError

log = logging.getLogger(__name__)
#: request bodies parsed / prompts tokenised at once (thread pool): each holds memory
#: proportional to its body or prompt, and a 16 MB body takes a CPU for a while
TOKENIZE_CONCURRENCY = 2


def template_defaults(config: Config) -> dict[str, Any]:
    """The server's chat-template variables (``TIERED_KV_CHAT_TEMPLATE_ARGS``: a JSON object by
    the Config; its names checked here). Raises ConfigError naming the variable."""
    try:
        return chat.template_args(json.loads(config.chat_template_args or "{}"))
    except ValueError as e:
        raise ConfigError(f"TIERED_KV_CHAT_TEMPLATE_ARGS: {e}") from None


class Server:
    """Routes bound to one worker (which owns the engine) + metrics."""

    def __init__(
        self,
        worker: Worker,
        config: Config,
        keepalive_seconds: float = conn.KEEPALIVE_SECONDS,
        model_id: str | None = None,
        body_timeout_seconds: float = conn.BODY_TIMEOUT_SECONDS,
    ):
        self.worker, self.config, self.keepalive = worker, config, keepalive_seconds
        self.body_timeout = body_timeout_seconds
        self._model_id = model_id
        self.created = openai_bodies.now()
        self.metrics = Metrics(lambda: self.engine.cache.stats() if self.engine else {}, worker)
        self._max_token_chars = 0  # from the tokenizer, once the engine is loaded
        self.template_defaults = template_defaults(config)
        self._tokenizing = asyncio.Semaphore(TOKENIZE_CONCURRENCY)

    @property
    def engine(self) -> Any:
        """The loaded engine (its tokenizer and plain attributes only: MLX stays on its thread)."""
        return self.worker.engine

    @property
    def model_id(self) -> str:
        return self._model_id or str(self.engine.model_dir.name)

    def _error(self, endpoint: str, e: Exception, anthropic: bool = False) -> JSONResponse:
        if isinstance(e, ApiError):
            self.metrics.request(endpoint, e.status)
            body = messages.error_body(e) if anthropic else e.body()
            return JSONResponse(body, status_code=e.status, headers=retry_after(e.status))
        log.exception("internal error on %s", endpoint)
        self.metrics.request(endpoint, 500)
        if anthropic:
            return JSONResponse(messages.error_body(e), status_code=500)
        return JSONResponse(error_body(f"internal error: {e}", "server_error"), status_code=500)

    def _check_chars(self, n_chars: int, param: str) -> None:
        if not self._max_token_chars:
            self._max_token_chars = max_token_chars(self.engine.tokenizer)
        api.check_chars(n_chars, self.engine.context_length, self._max_token_chars, param)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the thread pool, at most TOKENIZE_CONCURRENCY at once."""
        async with self._tokenizing:
            return await run_in_threadpool(fn, *args)

    async def _serve(
        self,
        request: Request,
        endpoint: str,
        parse: Callable[..., Any],  # (body, context_length=) → request
        prepare: Callable[[Any], Any],
        anthropic: bool = False,
    ) -> Response:
        """Every generating endpoint: parse, prepare (thread pool), queue, then stream or collect."""
        try:
            # from the first byte: a title's small body is read, parsed and tokenised before
            # the main request's large one is read; an idle engine waits for it with the others
            arrival = self.worker.arrive()
            try:
                body = await read_body(request, self.config.max_body_bytes, self.body_timeout)
                # the context bounds the turns a body may hold, checked before they are validated
                ctx = self.engine.context_length
                req = await self._off_loop(partial(parse, context_length=ctx), body)
                ids, out = await self._off_loop(prepare, req)
                # structured output, or a forced call's arguments
                asked = getattr(req, "response_format", None) or getattr(req, "forces_call", bool)()
                grammar = await self._off_loop(self._grammar, req, out) if asked else ""
                params = respond.sampling(
                    req, ids, self.engine.context_length, self.engine.vocab_size,
                    self.config.max_tokens, self.engine.xtc_keep, grammar,
                )  # fmt: skip
                job = self.worker.submit(ids, params, endpoint, arrival, self.metrics.generation)
            except QueueFull as e:
                raise ApiError(
                    429, f"server busy: {e}", type_="rate_limit_error", code="queue_full"
                ) from None
            finally:
                arrival.leave()
            # a client that goes away stops its job, waiting or generating (a stream's response,
            # once it runs, watches for it itself)
            watch = asyncio.create_task(self._stop_on_hangup(request, job))
            try:
                return await self._respond(endpoint, req, job, out)
            finally:
                watch.cancel()
        except Exception as e:
            return self._error(endpoint, e, anthropic)

    async def _respond(self, endpoint: str, req: Any, job: Job, out: respond.Output) -> Response:
        """The job's stream, or its collected body."""
        rest = sse.events(job, self.keepalive)
        first = await anext(rest, END)  # the cache hit (or a failure): headers name the tier
        if isinstance(first, Failed):  # nothing sent yet: its own status (a 503 is retried)
            job.stop()
            raise first.error
        headers = respond.hit_headers(first)
        if req.stream:
            # the status is counted when the stream ends: 499 when its client went away first
            stream = sse.pump(job, out, first, rest,
                              lambda status: self.metrics.request(endpoint, status))  # fmt: skip
            return StreamingResponse(
                stream, media_type="text/event-stream", headers={**sse.HEADERS, **headers}
            )
        result = await sse.collect(job, out, first, rest)
        self.metrics.request(endpoint, 200)
        return JSONResponse(result, headers=headers)

    @staticmethod
    async def _stop_on_hangup(request: Request, job: Job) -> None:
        await hangup(request)
        job.stop()

    def _grammar(self, req: Any, out: Any) -> str:
        """The grammar of ``req``'s output ("" for free text), compiled here, off the engine
        thread (and llguidance's view of the tokenizer built by the first request that needs
        it: about a second)."""
        grammar = respond.grammar_of(req, out)
        if grammar:
            self.engine.grammars.prepare(grammar)
        return grammar

    def _chat_prompt(
        self, req: ChatRequest, call_id_prefix: str = CALL_ID_PREFIX
    ) -> tuple[list[int], respond.ChatOutput]:
        self._check_chars(req.content_chars(), req.prompt_param)
        return respond.chat_prompt(
            self.engine.tokenizer, self.engine.encode_text, req, self.model_id,
            self._check_chars, self.template_defaults, call_id_prefix,
        )  # fmt: skip

    async def chat_completions(self, request: Request) -> Response:
        parse = partial(api.parse_body, model=ChatRequest)
        return await self._serve(request, "chat", parse, self._chat_prompt)

    async def anthropic_messages(self, request: Request) -> Response:
        """Anthropic's Messages API over the chat path (``engine/messages.py``)."""

        def prepare(req: ChatRequest) -> tuple[list[int], messages.MessagesOutput]:
            ids, chat_out = self._chat_prompt(req, messages.CALL_ID_PREFIX)
            return ids, messages.MessagesOutput(self.model_id, chat_out.parser, len(ids))

        return await self._serve(request, "messages", messages.parse, prepare, anthropic=True)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API over the chat path (``engine/responses.py``): Codex's wire API."""

        def prepare(req: responses.ResponsesChat) -> tuple[list[int], responses.ResponsesOutput]:
            ids, chat_out = self._chat_prompt(req)
            return ids, responses.ResponsesOutput(self.model_id, chat_out.parser, len(ids), req)

        return await self._serve(request, "responses", responses.parse, prepare)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's ``/v1/messages/count_tokens``: the rendered prompt's length."""
        try:
            body = await read_body(request, self.config.max_body_bytes, self.body_timeout)
            parse = partial(messages.parse, model=messages.CountTokensRequest,
                            context_length=self.engine.context_length)  # fmt: skip
            req = await self._off_loop(parse, body)
            ids, _ = await self._off_loop(self._chat_prompt, req)
        except Exception as e:
            return self._error("count_tokens", e, anthropic=True)
        self.metrics.request("count_tokens", 200)
        return JSONResponse({"input_tokens": len(ids)})

    async def completions(self, request: Request) -> Response:
        def prepare(req: CompletionRequest) -> tuple[list[int], respond.Output]:
            return respond.completion_prompt(
                self.engine.encode_text, req, self.model_id, self._check_chars,
                self.engine.tokenizer, int(self.engine.vocab_size),
            )  # fmt: skip

        parse = partial(api.parse_body, model=CompletionRequest)
        return await self._serve(request, "completions", parse, prepare)

    async def models(self, request: Request) -> Response:
        self.metrics.request("models", 200)
        return JSONResponse(openai_bodies.models_response(self.model_id, self.created))

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (the SDKs' ``models.retrieve``): the served model, or a 404
        naming the id asked for (an id may hold ``/``: ``mlx-community/…``)."""
        asked = request.path_params["model_id"]
        if asked != self.model_id:
            self.metrics.request("models", 404)
            e = ApiError(404, f"The model '{asked}' does not exist", param="model",
                         code="model_not_found")  # fmt: skip
            return error_response(request.url.path, e)
        self.metrics.request("models", 200)
        return JSONResponse(openai_bodies.model_object(self.model_id, self.created))

    async def health(self, request: Request) -> Response:
        w = self.worker
        status = {"status": "ok", "model": self.model_id, "busy": w.busy()}
        status.update(queued=w.pending(), batch_size=w.batch_size, in_flight=w.in_flight)
        return JSONResponse(status)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)


def batch_limits(config: Config) -> dict[str, int]:
    """The Worker's keyword arguments from the config (TIERED_KV_MAX_BATCH / _MAX_QUEUE)."""
    return {"max_batch": config.max_batch, "max_queue": config.max_queue}


def create_app(
    engine: Worker | Callable[[], Any],
    config: Config,
    keepalive_seconds: float = conn.KEEPALIVE_SECONDS,
    model_id: str | None = None,
    body_timeout_seconds: float = conn.BODY_TIMEOUT_SECONDS,
) -> FastAPI:
    """The ASGI app over a :class:`Worker` (or a zero-argument engine factory, run on the worker's
    thread). Its lifespan starts the worker (the model loads there); shutdown cancels jobs and
    closes the engine."""
    worker = engine if isinstance(engine, Worker) else Worker(engine, **batch_limits(config))
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
    app.add_api_route("/v1/responses", server.responses, methods=["POST"])
    app.add_api_route("/v1/messages", server.anthropic_messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"])
    # HEAD wherever GET is served (HTTP requires it; `wget --spider` health checks send it)
    app.add_api_route("/v1/models", server.models, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET", "HEAD"])
    app.add_api_route("/health", server.health, methods=["GET", "HEAD"])
    app.add_api_route("/metrics", server.metrics_endpoint, methods=["GET", "HEAD"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        e = ApiError(exc.status_code, str(exc.detail), code=code)
        return error_response(request.url.path, e, exc.headers)

    if config.api_key:
        app.add_middleware(Auth, api_key=config.api_key)
    app.add_middleware(ShutdownGuard)
    if config.allowed_origins:  # outermost: its preflight needs no key, every answer its headers
        app.add_middleware(Cors, origins=config.allowed_origins)
    return app
