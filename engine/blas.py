"""Fast CPU BLAS for MLX on Linux: preload Debian's OpenBLAS by re-executing the process once.

The ``mlx[cpu]`` wheel bundles the netlib reference BLAS; its ``sgemm`` is ~50x slower than OpenBLAS on
float32 matmuls. The dynamic loader resolves ``cblas_*`` from the first library that defines them, so
starting the process with ``LD_PRELOAD=libopenblas.so.0`` makes MLX use OpenBLAS. ``LD_PRELOAD`` is read
only at process start, hence the re-exec.

This module is part of the process edge (like ``engine/cli.py``): it is the one place besides
``tiered_kv.config`` that reads and writes ``os.environ``.

Scripts (Makefile, CI) get the variable with ``eval "$(python -m engine.blas --preload-env)"``-style use:
``python -m engine.blas --preload-env`` prints ``LD_PRELOAD=...`` or nothing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: Debian/Ubuntu ``libopenblas0-pthread`` locations, per architecture.
OPENBLAS_PATHS = (
    Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"),
    Path("/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"),
)
#: Set in the re-executed child so the re-exec happens at most once.
REEXEC_MARKER = "TKV_BLAS_REEXEC"  # not TIERED_KV_*: config.from_env rejects unknown ones
WARNING = (
    "tiered-kv: OpenBLAS not found; MLX float32 matmuls will run ~50x slower; "
    "apt-get install libopenblas0-pthread"
)


def find_openblas() -> Path | None:
    """The first existing Debian OpenBLAS library, or None (always None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    return next((p for p in OPENBLAS_PATHS if p.exists()), None)


def _preloaded(lib: Path, env: dict[str, str] | os._Environ[str] | None = None) -> bool:
    env = os.environ if env is None else env
    entries = env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
    return str(lib) in entries or any(Path(e).name == lib.name for e in entries if e)


def preload_value(lib: Path) -> str:
    """``LD_PRELOAD`` with ``lib`` first, keeping whatever was already preloaded."""
    current = os.environ.get("LD_PRELOAD", "")
    return f"{lib}:{current}" if current else str(lib)


def _is_cli_process() -> bool:
    """True when this process is the ``tiered-kv`` command (console script or ``python -m engine.cli``).

    ``engine.cli.main(argv)`` is also called in-process (tests, pytest); re-executing those with
    ``sys.argv`` would run the wrong program, so they are left alone.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name == "engine.cli":
        return True
    return Path(sys.argv[0]).name in ("tiered-kv", "tiered-kv.exe") if sys.argv else False


def ensure_fast_blas() -> None:
    """Make MLX's CPU matmuls use OpenBLAS; call first thing in the CLI's ``main()``.

    Linux + OpenBLAS present + not yet preloaded + this is the ``tiered-kv`` process → ``os.execv`` the same
    command with ``LD_PRELOAD`` set (never returns). OpenBLAS absent → one warning line on stderr.
    macOS (Accelerate) and every other case → nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    lib = find_openblas()
    if lib is None:
        print(WARNING, file=sys.stderr)
        return
    if _preloaded(lib) or os.environ.get(REEXEC_MARKER) or not _is_cli_process():
        return
    env = dict(os.environ, LD_PRELOAD=preload_value(lib), **{REEXEC_MARKER: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "engine.cli", *sys.argv[1:]], env)


def blas_status() -> str:
    """One line for logs: which BLAS MLX's CPU matmuls will use in this process."""
    if sys.platform == "darwin":
        return "blas: Accelerate (macOS)"
    lib = find_openblas()
    if lib is None:
        return "blas: reference (OpenBLAS not found; apt-get install libopenblas0-pthread)"
    if _preloaded(lib):
        return f"blas: OpenBLAS preloaded ({lib})"
    return f"blas: reference (OpenBLAS at {lib} not preloaded; start with LD_PRELOAD={lib})"


def matmul_gflops(n: int = 2048, repeats: int = 3) -> float:
    """Measured float32 ``n x n`` matmul throughput of MLX's CPU device in this process (GFLOP/s)."""
    import time

    import mlx.core as mx

    a = mx.random.normal((n, n), key=mx.random.key(0), stream=mx.cpu)
    b = mx.random.normal((n, n), key=mx.random.key(1), stream=mx.cpu)
    mx.eval(mx.matmul(a, b, stream=mx.cpu))  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.blas [--preload-env | --matmul]``: LD_PRELOAD line, matmul speed, or status."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--matmul"]:
        print(f"{blas_status()}\nfloat32 2048x2048 matmul: {matmul_gflops():.1f} GFLOP/s")
        return 0
    if args == ["--preload-env"]:
        lib = find_openblas()
        if lib is not None:
            print(
                f"LD_PRELOAD={preload_value(lib) if not _preloaded(lib) else os.environ['LD_PRELOAD']}"
            )
        return 0
    if args:
        print("usage: python -m engine.blas [--preload-env | --matmul]", file=sys.stderr)
        return 2
    print(blas_status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
