"""`tiered-kv serve`: load a model (directory or hub id) and serve the OpenAI-compatible API with uvicorn.

On SIGINT/SIGTERM the worker first ends its jobs (queued and running: each a 503 after what it
computed is stored), so every open response ends whole; then uvicorn stops accepting connections,
waits a few seconds for open responses and runs the app's lifespan shutdown, which closes the engine
(flushing the spill queue to disk), so a restart on the same ``TIERED_KV_DIR`` warm-starts from the
disk tier.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from engine import conn
from engine.models.smollm2 import DEFAULT_NAME as DEFAULT_MODEL
from tiered_kv import ConfigError

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the OpenAI-compatible API (/v1/chat/completions, ...)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="mlx-lm model directory or Hugging Face hub id, e.g. mlx-community/Qwen3-4B-4bit "
        f"(resolved as mlx-lm does; default: $TIERED_KV_MODELS_DIR/{DEFAULT_MODEL})",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument(
        "--keepalive",
        type=float,
        default=conn.KEEPALIVE_SECONDS,
        help=f"seconds between SSE keep-alive comments while waiting for tokens "
        f"(default {conn.KEEPALIVE_SECONDS:g})",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        default=conn.BODY_TIMEOUT_SECONDS,
        help=f"seconds a client may take to send its request body before a 408 "
        f"(default {conn.BODY_TIMEOUT_SECONDS:g})",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=conn.HEADER_TIMEOUT_SECONDS,
        help="seconds a connection may take to send a request's headers before it is closed "
        f"(default {conn.HEADER_TIMEOUT_SECONDS:g})",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=conn.IDLE_TIMEOUT_SECONDS,
        help=f"seconds an idle keep-alive connection stays open between requests "
        f"(default {conn.IDLE_TIMEOUT_SECONDS:g})",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = args.config
    if args.model is None:
        model_dir = config.models_dir / DEFAULT_MODEL
        if not (model_dir / "config.json").is_file():
            hint = "run `tiered-kv model fetch smollm2` or pass --model"
            print(f"tiered-kv serve: no model at {model_dir}; {hint}", file=sys.stderr)
            return 2
    else:
        from engine.loading import ModelDirError, resolve_model

        try:
            model_dir = resolve_model(args.model)
        except ModelDirError as e:
            print(f"tiered-kv serve: {e}", file=sys.stderr)
            return 2
    from engine.generate import CacheDirError, Engine
    from engine.loading import looks_like_hub_id
    from engine.server import batch_limits, create_app, template_defaults
    from engine.worker import Worker

    try:
        template_defaults(config)  # before the model loads
    except ConfigError as e:
        print(f"tiered-kv serve: {e}", file=sys.stderr)
        return 2

    log.info(
        "loading %s (tiers: %s, cache dir %s)",
        model_dir,
        ",".join(config.tiers) or "none",
        config.cache_dir,
    )
    # The model is loaded on the engine thread (the one thread that owns MLX), before serving.
    worker = Worker(lambda: Engine(model_dir, config), **batch_limits(config))
    try:
        worker.start()
    except CacheDirError as e:
        print(f"tiered-kv serve: {e}", file=sys.stderr)
        return 2
    if config.api_key == "" and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "serving on %s without TIERED_KV_API_KEY: anyone who can reach it can use it", args.host
        )
    # clients name the model as the user did (a hub id), not by a snapshot hash
    hub_id = args.model and looks_like_hub_id(args.model) and not Path(args.model).exists()
    model_id = str(args.model) if hub_id else None
    app = create_app(
        worker,
        config,
        keepalive_seconds=args.keepalive,
        body_timeout_seconds=args.body_timeout,
        model_id=model_id,
    )
    soft, hard = conn.raise_nofile_limit()
    log.info("open-file limit: %s (hard %s)", soft, hard)
    server = http_server(app, args.host, args.port, args.header_timeout, args.idle_timeout)
    conn.install_repeat_filter(conn.RepeatFilter())  # after uvicorn set up its log handlers
    server.run()
    return 0


def http_server(
    app: Any,
    host: str,
    port: int,
    header_timeout: float = conn.HEADER_TIMEOUT_SECONDS,
    idle_timeout: float = conn.IDLE_TIMEOUT_SECONDS,
    log_level: str = "info",
    graceful_seconds: int = 5,
) -> Any:
    """The one way the app is served (`tiered-kv serve`, and the tests' in-process server): uvicorn
    with the guarded h11 protocol (``engine/conn.py``: the header deadline, JSON 400 / 431 for
    unreadable requests with a lingering close), the idle keep-alive timeout and a graceful
    shutdown of ``graceful_seconds`` (open responses are cancelled past it). Its SIGTERM / SIGINT (where it runs on the main thread) first ends the worker's jobs
    (each a 503 after its cache is stored), so every open response ends whole — a stream with
    its error event — before uvicorn waits on them (it cut them when its graceful timeout ran
    out, and a request cut so could read as a whole answer). ``app``: :func:`create_app`'s."""
    import uvicorn

    worker = app.state.server.worker

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            worker.begin_close()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_seconds,
        # typed int, but a float works (uvicorn hands it to loop.call_later)
        timeout_keep_alive=idle_timeout,  # type: ignore[arg-type]
        http=conn.guarded_h11(header_timeout),
    )
    return Server(config)
