"""The body of `tiered-kv bench` (parsed in ``engine/cli_bench.py``): replay one synthetic agent session
against ours and mlx_lm.server, side by side, or (``--concurrency``) K concurrent sessions.

Scenarios (same requests, interleaved turn by turn): a = ours with TIERED_KV_TIERS=none, b = ours with the
default tiers (one long-lived server), c = ours restarted (SIGTERM, then start) before every request with the
same TIERED_KV_DIR, d = ``python -m mlx_lm.server`` (its own prompt cache), e = the peer restarted per request.
Writes table.md, results.json and ttft.png to ``--out`` and prints the table with a goal summary.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import micro, report
from bench.replay import Measurement, model_id, send
from bench.servers import ServerProcess, ServerSpec, ours_spec, peer_spec
from bench.session import Session, build_session, describe
from engine import blas

RESTARTED = ("c", "e")
ALL = "abcde"


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    if args.real:
        from engine.models import smollm2

        out = smollm2.default_dir(args.config.models_dir)
        if not (out / "config.json").is_file():
            smollm2.fetch(out)
        return out
    out = args.config.models_dir / "tiny-bench"
    if not (out / "config.json").is_file():
        from engine.models import tiny

        tiny.build(out, size="bench", seed=0)
    return out


def _blas_env(mode: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """(env to set, vars to unset) for the server subprocesses.

    openblas: LD_PRELOAD set up front, so ours does not re-exec and the peer uses OpenBLAS too.
    reference: LD_PRELOAD removed and engine.blas's re-exec marker set, so ours does not re-exec either.
    """
    lib = blas.find_openblas()
    if mode == "openblas" and lib is not None:
        return {"LD_PRELOAD": str(lib)}, ()
    return {blas.REEXEC_MARKER: "1"}, ("LD_PRELOAD",)


def _specs(scen: list[str], model: Path, work: Path, mode: str) -> dict[str, ServerSpec]:
    env, unset = _blas_env(mode)
    tkv_unset = (*unset, "TIERED_KV_DIR", "TIERED_KV_TIERS")
    specs = {}
    for s in scen:
        if s in "abc":
            ours = {**env, "TIERED_KV_DIR": str(work / f"kv-{s}")}
            if s == "a":
                ours["TIERED_KV_TIERS"] = "none"
            specs[s] = ours_spec(s, model, ours, tkv_unset)
        else:
            specs[s] = peer_spec(s, model, env, unset)
    return specs


def replay(
    session: Session, servers: dict[str, ServerProcess], model_name: str
) -> list[Measurement]:
    """Every request of ``session`` to every server, request-major (turn by turn), with a progress bar."""
    from tqdm import tqdm

    out: list[Measurement] = []
    requests = session.requests()
    names: dict[str, str] = {}
    with httpx.Client() as client, tqdm(total=len(requests) * len(servers), unit="req") as bar:
        for req in requests:
            for s, srv in servers.items():
                start_s = 0.0
                if s in RESTARTED or srv.proc is None:
                    start_s = srv.restart()
                if s not in names:
                    fallback = "default_model" if s in "de" else model_name
                    names[s] = fallback if s in "de" else model_id(client, srv.base_url, fallback)
                m = send(
                    client,
                    srv.base_url,
                    req,
                    s,
                    names[s],
                    start_s=start_s if s in RESTARTED else 0.0,
                )
                out.append(m)
                bar.set_postfix_str(
                    f"{req.label} {s} ttft={m.ttft_s * 1e3:.0f}ms cached={m.cached_tokens}"
                )
                bar.update()
    return out


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would break the bar
    scen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not scen or any(s not in ALL or len(s) != 1 for s in scen):
        print(
            f"tiered-kv bench: --scenarios must be a comma list of {','.join(ALL)}", file=sys.stderr
        )
        return 2
    turns = args.turns or (4 if args.real else 6)
    scale = args.scale or (0.15 if args.real else 0.25)
    model = _model_dir(args)
    if args.concurrency:
        return run_concurrency(args, model, turns, scale)
    session = build_session(turns, args.seed, args.max_tokens, scale)
    work = Path(tempfile.mkdtemp(prefix="tiered-kv-bench-"))
    servers = {
        s: ServerProcess(spec, work / f"server-{s}.log")
        for s, spec in _specs(scen, model, work, args.blas).items()
    }
    t0 = time.time()
    try:
        measurements = replay(session, servers, model.name)
    finally:
        for srv in servers.values():
            srv.stop()
    results: dict[str, Any] = {
        "meta": _meta(args, model, session, t0),
        "scenarios": {
            s: {
                "title": report.SCENARIO_TITLES[s],
                "argv": list(srv.spec.argv),
                "env": srv.spec.env,
                "peak_rss_bytes": srv.peak_rss,
                "openblas_mapped": srv.openblas_mapped,
                "start_seconds": srv.start_seconds if s in RESTARTED else [],
            }
            for s, srv in servers.items()
        },
        "measurements": [m.to_dict() for m in measurements],
    }
    if not args.no_micro:  # the replay's results first: the micro-benchmarks take minutes
        results["meta"]["wall_s"] = time.time() - t0
        report.write(results, args.out)
        print(f"replay written to {args.out}/table.md; micro-benchmarks next", flush=True)
        gbs = tuple(float(x) for x in args.sizes.split(",") if x.strip())
        results["micro"] = micro.run_all(args.config, model, suffix_turns(measurements), gbs)
    results["meta"]["wall_s"] = time.time() - t0
    print(report.write(results, args.out))
    print(f"results: {args.out}/table.md, results.json, ttft.png; server logs: {work}")
    if not args.keep and not any(m.error for m in measurements):
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_concurrency(args: argparse.Namespace, model: Path, turns: int, scale: float) -> int:
    """K concurrent sessions on a shared system prompt + tools: ours (b) and the peer (d), both up
    at once. Sessions run one server after the other; the decode passes alternate between the two
    (``--repeats`` of each, median), so a change in the machine's load between runs — this
    machine's two cores move single runs by ±20 % — falls on both."""
    from bench import concurrency as conc

    ks = [int(k) for k in args.concurrency.split(",") if k.strip()]
    work = Path(tempfile.mkdtemp(prefix="tiered-kv-bench-conc-"))
    specs = _specs(["b", "d"], model, work, args.blas)
    names = {"b": "tiered-kv", "d": "mlx_lm.server"}
    rows, pattern, single = [], {}, {}
    servers = {s: ServerProcess(spec, work / f"server-{s}.log") for s, spec in specs.items()}
    try:
        mid = {}
        for s, srv in servers.items():
            srv.start()
            with httpx.Client() as client:
                mid[s] = "default_model" if s == "d" else model_id(client, srv.base_url, model.name)
            # unmeasured: kernels compile at first use of each batch shape (on a GPU, seconds),
            # and the server measured first would pay for both
            warm = conc.shared_sessions(max(ks), 1, args.seed + 999, args.max_tokens, scale)
            conc.run_sessions(srv.base_url, mid[s], names[s], warm)
        for k in ks:
            got: dict[str, Any] = {}
            for s, srv in servers.items():
                sessions = conc.shared_sessions(k, turns, args.seed, args.max_tokens, scale)
                got[s] = conc.run_sessions(srv.base_url, mid[s], names[s], sessions)
            tps: dict[str, list[float]] = {s: [] for s in servers}
            for r in range(max(1, args.repeats)):
                for s in list(servers)[:: 1 if r % 2 == 0 else -1]:
                    seed = args.seed + k + 100 * r
                    tps[s].append(conc.run_decode(servers[s].base_url, mid[s], names[s], k,
                                                  args.decode_tokens, seed))  # fmt: skip
            for s, row in got.items():
                row.decode_tps = statistics.median(tps[s])
                if k == 1:
                    single[names[s]] = row.decode_tps
                rows.append(row)
                print(f"{names[s]} K={k}: {row}", flush=True)
        for s, srv in servers.items():
            pattern[names[s]] = conc.title_main(
                srv.base_url, mid[s], names[s], args.seed, args.max_tokens, scale, args.repeats
            )
    finally:
        for srv in servers.values():
            srv.stop()
    rows.sort(key=lambda r: (r.k, r.server))
    out = conc.table(rows, pattern, single)
    head = (
        f"model {model.name}, {turns} turns per session, scale {scale}, max_tokens "
        f"{args.max_tokens}, decode pass {args.decode_tokens} tokens, blas {args.blas}"
    )
    print(head + "\n\n" + out)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "concurrency.md").write_text(head + "\n\n" + out + "\n")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def suffix_turns(measurements: list[Measurement]) -> dict[int, tuple[int, int]]:
    """turn → (previous, current) prompt tokens for turns 2..N, from ours (same tokenization in a/b/c)."""
    for s in "abc":
        p = {m.turn: m.prompt_tokens for m in measurements if m.scenario == s and not m.error}
        if p:
            return {
                t: (p[t - 1], p[t]) for t in sorted(p) if t >= 2 and t - 1 in p and p[t] > p[t - 1]
            }
    return {}


def _meta(args: argparse.Namespace, model: Path, session: Session, t0: float) -> dict:
    return {
        "command": "tiered-kv " + shlex.join(sys.argv[1:]),
        "model": str(model),
        "model_name": model.name,
        "session": describe(session),
        "max_tokens": args.max_tokens,
        "blas": args.blas,
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t0)),
        "cpus": os.cpu_count(),
        "platform": sys.platform,
        "note": "assistant history is fixed synthetic text (identical for every scenario); "
        "generated tokens are discarded",
    }
