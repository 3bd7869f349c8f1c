"""`tiered-kv` command line: one sub-command family per module (cli_model, cli_cache, cli_serve, cli_bench, smoke).

Each family module exposes ``register(subparsers) -> None`` and sets ``func(args) -> int`` on its parsers.
Configuration enters here: ``tiered_kv.Config.from_env()`` is called once and passed down as ``args.config``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from tiered_kv import Config, ConfigError

FAMILIES = (
    "engine.cli_model", "engine.cli_cache", "engine.cli_serve", "engine.cli_bench", "engine.smoke",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-kv", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in FAMILIES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from engine import blas

    blas.ensure_fast_blas()  # may re-exec this process with OpenBLAS preloaded (Linux)
    from engine.conn import mlx_lm_keeps_hard_limit

    with mlx_lm_keeps_hard_limit():  # the families import mlx-lm
        parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args.config = Config.from_env()
    except ConfigError as e:
        print(f"tiered-kv: {e}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
