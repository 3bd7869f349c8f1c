"""`tiered-kv bench`: its arguments. The benchmark itself (``bench/run.py``: the agent-session replay, ours vs
mlx_lm.server, scenarios a–e; or ``--concurrency``) is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="agent-session replay: ours vs mlx_lm.server")
    p.add_argument(
        "--model", type=Path, help="mlx-lm model dir (default: tiny-bench, built if absent)"
    )
    p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct, fewer/shorter turns")
    p.add_argument(
        "--turns", type=int, help="main requests after the title request (default 6; --real 4)"
    )
    p.add_argument(
        "--scale", type=float, help="session size factor; 1.0 = OpenCode's (default 0.25)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request")
    p.add_argument(
        "--out", type=Path, default=Path("bench/results/latest"), help="results directory"
    )
    p.add_argument("--scenarios", default="a,b,c,d,e", help="comma list out of a,b,c,d,e")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--blas",
        choices=("openblas", "reference"),
        default="openblas",
        help="server subprocess BLAS on Linux CPU (reference = no LD_PRELOAD, no re-exec)",
    )
    p.add_argument(
        "--no-micro", action="store_true", help="skip reload/lookup/spill micro-benchmarks"
    )
    p.add_argument(
        "--sizes",
        default="",
        help="entry size sweep, comma list of GB (e.g. 0.25,1,4): cold write / reload GB/s vs dd "
        "and mlx-lm save/load_prompt_cache (needs ~2x the largest size free on disk)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work dir (KV dirs, server logs)")
    p.add_argument(
        "--concurrency",
        help="run the concurrency scenario instead: comma list of K concurrent sessions, e.g. 1,2,4,8",
    )
    p.add_argument(
        "--decode-tokens", type=int, default=64, help="tokens per request of the decode pass"
    )
    p.add_argument(
        "--repeats", type=int, default=3,
        help="title + main pattern and --concurrency decode pass repetitions (median)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # the bench (httpx, psutil, tqdm; matplotlib for the plot) loads only when this command runs:
    # `tiered-kv serve` never imports it, and a lean install says which extra it lacks
    try:
        from bench import run as bench_run
    except ImportError as e:
        print(f"tiered-kv bench: {e}; install the bench extra: pip install 'tiered-kv[bench]'",
              file=sys.stderr)  # fmt: skip
        return 2
    return bench_run.run(args)
