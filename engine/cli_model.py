"""`tiered-kv model …`: build the tiny random model, fetch + convert SmolLM2.

    tiered-kv model tiny [OUT_DIR] [--size test|test-llama3|bench|1b|8b|gemma3-test|gemma3-1b|gemma3-4b] [--seed N]
    tiered-kv model fetch smollm2 [OUT_DIR] [--keep-4bit]
    tiered-kv model fetch templates [OUT_DIR]     (model families' chat templates, for tests/benchmarks)

Default output directories live under ``Config.models_dir``. Failures print one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from engine.blas import blas_status
from engine.models.tiny import ALL_SIZES

log = logging.getLogger(__name__)
FETCHABLE = ("smollm2", "templates")


def _fail(message: str) -> int:
    print(f"tiered-kv model: {message}", file=sys.stderr)
    return 1


def _tiny(args: argparse.Namespace) -> int:
    from engine.models import tiny

    out = args.out_dir or args.config.models_dir / f"tiny-{args.size}"
    log.info("%s", blas_status())
    try:
        path = tiny.build(out, size=args.size, seed=args.seed)
    except (tiny.TinyModelError, OSError) as e:
        return _fail(str(e))
    print(path)
    return 0


def _fetch(args: argparse.Namespace) -> int:
    if args.name not in FETCHABLE:
        return _fail(f"unknown model {args.name!r}; known: {', '.join(FETCHABLE)}")
    if args.name == "templates":
        from engine.models import templates

        try:
            print(templates.fetch(args.out_dir or templates.default_dir(args.config.models_dir)))
        except (templates.FetchError, OSError) as e:
            return _fail(str(e))
        return 0
    from engine.models import smollm2

    out = args.out_dir or smollm2.default_dir(args.config.models_dir, args.keep_4bit)
    log.info("%s", blas_status())
    try:
        path = smollm2.fetch(out, quantized=args.keep_4bit)
    except (smollm2.FetchError, OSError, ValueError) as e:
        return _fail(str(e))
    print(path)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``model`` family (``tiny``, ``fetch``) to the ``tiered-kv`` parser."""
    model = subparsers.add_parser("model", help="build or fetch a local mlx-lm model directory")
    sub = model.add_subparsers(dest="model_command", required=True)

    tiny = sub.add_parser(
        "tiny", help="deterministic random-weight llama + locally trained tokenizer"
    )
    tiny.add_argument("out_dir", nargs="?", type=Path, help="default: $MODELS_DIR/tiny-SIZE")
    tiny.add_argument("--size", choices=ALL_SIZES, default="test")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_tiny)

    fetch = sub.add_parser("fetch", help="download and convert a model (no hub needed)")
    fetch.add_argument("name", help="model name: " + ", ".join(FETCHABLE))
    fetch.add_argument("out_dir", nargs="?", type=Path, help="default: $MODELS_DIR/<model>")
    fetch.add_argument(
        "--keep-4bit", action="store_true", help="keep the GGUF's 4-bit weights (MLX affine)"
    )
    fetch.set_defaults(func=_fetch)
