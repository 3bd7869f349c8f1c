"""Benchmark: TTFT of the first request after a restart, disk hit restored by load / compute / both / auto.

For each prompt length: one request prefills ``T`` tokens and the cache is closed (the entry is spilled
to disk). Then, per page-cache state (``cold``: ``os.sync`` + ``posix_fadvise(DONTNEED)`` on every entry
file; ``warm``: the files read once) and per mode, a *restart* (a fresh TieredCache + cold tier +
restorer over the same loaded model, reading the persisted costs) serves the prompt plus a 32-token
suffix with ``TIERED_KV_RESTORE=mode``; TTFT is fetch + restore + suffix prefill + first token. The
learned costs accumulate over the runs in that cache dir, as they would on a real machine (with
``--same-costs`` each restart plans with what the setup learned instead, so two ways compared — say
``both,extend``, a both without and with its compute going on past m — plan alike). With
``--repeats`` the restarts run in rounds (load, compute, both, auto; then compute, auto, load, both;
...: :func:`rounds`): a slow drift of the machine touches every mode alike, each mode follows each
other alike, and in the first round ``auto`` runs after the forced ways, so it knows what they measured.

    python -m bench.restore --model DIR --tokens 2048,8192
    python -m bench.restore --size 8b --tokens 8192,32768,65536,131072   # random bf16 8B shape
    python -m bench.restore --size 1b --tokens 8192 --repeats 5   # the median of 5 restarts
    python -m bench.restore --size 8b --tokens 32768 --held 0.25  # memory holds the first 8k tokens

``--held F``: at each restart memory already holds the first ``F`` of the disk hit (a hot entry put in
place before the request, as another session's shared system prompt would be): compute and both
start from it, load reads the whole file all the same.

``--size`` builds the random model with ``engine.models.tiny`` under ``--models-dir`` (once). The table
goes to stdout; no network, no hub.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import tiered_kv
from bench.dd import drop_page_cache
from engine import warmup
from engine.generate import default_prefill_chunk
from engine.loading import load_model
from engine.prefill import fill, prefill
from tiered_kv import Config, HitInfo, Lease, TieredCache
from tiered_kv.cold.pages import resident_share  # page-cache share of the files read
from tiered_kv.hot import new_entry  # --held: a hot entry put in place before the request
from tiered_kv.restore.restorer import calibrate  # measured directly: the planner's calibration

SUFFIX = 32
EXTEND = "extend"  # --modes: a forced both whose compute goes on past m (Restorer.extend, off by default)


class Bench:
    def __init__(self, model_dir: Path, root: Path, chunk: int) -> None:
        self.model, _ = load_model(model_dir)
        self.identity = tiered_kv.model_identity(model_dir)
        self.root, self.chunk = root, chunk or default_prefill_chunk()
        self.device = str(mx.default_device())
        self.vocab = int(self.model.args.vocab_size)
        self.suffix_s = self.fetch_s = 0.0
        self.setup_s = 0.0  # the setup's prefill of the whole prompt (nothing cached): a compute
        self.phases: dict[str, float] = {}
        # as a server before it serves (engine/warmup.py, on by default on a GPU): without it the
        # setup's prefill and each way's first run built kernels (1B 8k on an H100: 0.30-0.39 s
        # against 0.09-0.21 after), and the costs learned from them priced compute at 3x its speed
        if mx.default_device().type == mx.gpu:
            warmup.run(self.model, self.chunk)

    def compute(self, ids: list[int], held: list[Any] | None = None) -> tiered_kv.Steps[list[Any]]:
        """What Engine.compute_prefix does (whole steps, no logits; step by step)."""
        caches = held if held is not None else make_prompt_cache(self.model)
        lease = Lease(caches, list(ids), HitInfo())
        yield from fill(self.model, lease, self.chunk)
        return lease.caches

    def open(self, tokens: int, mode: str) -> TieredCache:
        """A restart: what Engine.__init__ builds around an already loaded model. Mode ``extend``
        (the bench's own): a forced ``both`` whose compute goes on past its ``m`` while the read
        is predicted to need longer (the A/B of Restorer.extend, off by default)."""
        cfg = Config(cache_dir=self.root / f"t{tokens}", restore="both" if mode == EXTEND else mode,
                     prefill_chunk=self.chunk,
                     hot_bytes=1 << 40, disk_bytes=1 << 40, spill_queue_bytes=1 << 40)  # fmt: skip
        make = lambda: make_prompt_cache(self.model)  # noqa: E731
        tc = tiered_kv.open_cache(cfg, self.identity, make, self.compute)
        if mode == EXTEND:
            tc.restorer.extend = tc.restorer.step
        return tc

    def request(self, tc: TieredCache, ids: list[int]) -> tuple[float, int, HitInfo]:
        """TTFT of ``ids`` and its greedy first token; the prefill teaches the costs (as the Engine).
        ``self.suffix_s``: the seconds of its prefill after the restore; ``self.fetch_s``: of the
        fetch before it (lookup, plan, restore)."""
        r = tc.restorer
        r.last_phases = {}
        t0 = time.perf_counter()
        lease = tc.fetch(ids)
        fed = ids[: lease.hit.tokens]
        tp, start, new = time.perf_counter(), len(fed), len(lease.remaining)
        self.fetch_s = tp - t0
        logits = prefill(self.model, lease, fed, self.chunk)
        tok = mx.argmax(logits).tolist()
        assert isinstance(tok, int)
        ttft, dt = time.perf_counter() - t0, time.perf_counter() - tp
        self.suffix_s = dt
        r.costs.observe_prefill(new, start, dt)
        if lease.hit.restore is not None:
            r.outcome(lease.hit.restore, lease.hit.load_seconds + dt)
        r.costs.settle()
        tc.store(lease, fed)
        return ttft, tok, lease.hit

    def setup(self, tokens: int, ids: list[int]) -> Path | None:
        """The entry spilled to disk (after a prefill of the whole prompt: ``setup_s``, its TTFT); returns
        the file the costs it taught were saved to."""
        shutil.rmtree(self.root / f"t{tokens}", ignore_errors=True)
        tc = self.open(tokens, "load")
        if tc.restorer.costs.learned.prefill is None:
            calibrate(self.compute, tc.restorer.costs)
        self.setup_s, _, _ = self.request(tc, ids)
        tc.close()  # spills the entry and saves the costs
        tc.restorer.close()
        return tc.restorer.costs.path

    def run(self, tokens: int, ids: list[int], mode: str, held: int = 0) -> tuple[float, int, HitInfo]:
        """A restart serving ``ids``; ``held``: memory already holds its first ``held`` tokens
        (another session's system prompt, computed before the request: not in its TTFT)."""
        # a restart is a fresh process: nothing of the previous run may be freed during this one
        gc.collect()
        mx.clear_cache()
        tc = self.open(tokens, mode)
        try:
            if held:
                caches = tiered_kv.drain(self.compute(ids[:held], None))
                tc.hot.insert(new_entry(ids[:held], caches))
            return self.request(tc, ids)
        finally:
            self.phases = dict(tc.restorer.last_phases)
            tc.hot.entries.clear()  # a restart, not a shutdown: keep the disk as setup left it
            assert tc.cold is not None
            tc.cold.close()
            tc.restorer.close()
            mx.clear_cache()


def rounds(modes: list[str], i: int) -> list[str]:
    """The order of round ``i``: the first as given (``auto`` last, knowing what the forced ways
    measured), later ones rows of a Williams square, so that over ``len(modes)`` rounds every mode
    runs right after every other once (an even count of modes). In a fixed order ``auto`` always ran
    right after ``both``, and on the H100 (1B 8k warm) its loads took 0.047-0.049 s where the forced
    loads took 0.042-0.044."""
    n = len(modes)
    w, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: each difference once
    while len(w) < n:
        w.append(lo)
        lo += 1
        if len(w) < n:
            w.append(hi)
            hi -= 1
    name = {w[j]: modes[j] for j in range(n)}
    return [name[(w[j] + i) % n] for j in range(n)]


def entry_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.safetensors") if p.is_file()]


def set_pages(root: Path, state: str) -> float | None:
    """Drop (cold: :func:`bench.dd.drop_page_cache`, as every reload bench) or fill (warm) the
    page cache of every entry file; the probed share after."""
    files = entry_files(root)
    if state == "cold":
        drop_page_cache(*files)
    else:
        for p in files:
            with p.open("rb") as f:
                while f.read(64 << 20):
                    pass
    shares = [s for s in (resident_share(p) for p in files) if s is not None]
    return sum(shares) / len(shares) if shares else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="an mlx-lm model directory")
    src.add_argument("--size", help="build engine.models.tiny SIZE (e.g. bench, 1b, 8b)")
    ap.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "tkv-models")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--modes", default="load,compute,both,auto",
                    help=f"ways to restore ('{EXTEND}': both, its compute going on past m)")
    ap.add_argument("--pages", default="cold,warm")
    ap.add_argument("--dir", type=Path, default=None, help="cache dir (default: a temp dir)")
    ap.add_argument("--chunk", type=int, default=0, help="prefill step (0: the engine's default)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="restarts per mode and page state; the median TTFT is reported")  # fmt: skip
    ap.add_argument("--same-costs", action="store_true",
                    help="every restart plans with the costs the setup learned (each run's lessons "
                         "undone): an A/B of two ways, e.g. both,extend, then plans alike")  # fmt: skip
    ap.add_argument("--held", type=float, default=0.0,
                    help="share of each prompt's disk hit that memory already holds at the restart "
                         "(a shorter hot hit: compute and both start from it)")  # fmt: skip
    a = ap.parse_args(argv)
    model_dir = a.model
    if a.size:
        from engine.models import tiny

        model_dir = a.models_dir / f"tiny-{a.size}"
        if not (model_dir / "config.json").exists():
            tiny.build(model_dir, size=a.size)
    root = a.dir or Path(tempfile.mkdtemp(prefix="tkv-restore-"))
    bench = Bench(model_dir, root, a.chunk)
    modes, pages = a.modes.split(","), a.pages.split(",")
    print(f"# restore benchmark: {model_dir.name} on {bench.device}, cache dir {root}"
          + (f", memory holds the first {a.held:.0%} of each hit" if a.held else ""))  # fmt: skip
    # both's phases (Restorer.last_phases): alloc → head (compute, the read beside it) → extend (the
    # compute carried on past m while the read still ran; plan (m→m') says where it got) → wait (for
    # the read after the compute) → join; read = the I/O thread's time; suffix = the prefill after;
    # fetch = lookup + plan + restore before it, restore = the load's (or both's) own seconds: a way
    # chosen by auto and the same way forced, side by side, show where their difference lies
    print(
        "| tokens | pages | mode | TTFT s | plan (m) | tier | predicted s | token "
        "| alloc s | head s | extend s | read s | wait s | join s | suffix s | fetch s (restore s) | runs s (in order) |"
    )
    print("|---:|---|---|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    summary = []
    setups: dict[int, float] = {}
    for t in (int(x) for x in a.tokens.split(",")):
        rng = np.random.default_rng(t)
        ids = rng.integers(3, bench.vocab, t).tolist()
        prompt = ids + rng.integers(3, bench.vocab, SUFFIX).tolist()
        costs = bench.setup(t, ids)
        setups[t] = bench.setup_s
        learned = costs.read_bytes() if a.same_costs and costs is not None else None
        for state in pages:
            ttfts: dict[str, float] = {}
            first_tok = None
            runs: dict[str, list] = {mode: [] for mode in modes}  # each a restart
            for i in range(a.repeats):  # in rounds: drift of the machine touches every mode alike
                for mode in rounds(modes, i):
                    if costs is not None and learned is not None:
                        costs.write_bytes(learned)
                    share = set_pages(root / f"t{t}", state)
                    ttft, tok, hit = bench.run(t, prompt, mode, int(a.held * t))
                    runs[mode].append((ttft, tok, hit, bench.phases, bench.suffix_s, share, bench.fetch_s))
            for mode in modes:  # the row is the median run's
                rs = sorted(runs[mode], key=lambda r: r[0])
                ttft, tok, hit, ph, suffix_s, share, fetch_s = rs[len(rs) // 2]
                toks = {r[1] for r in rs}
                tok = tok if len(toks) == 1 else -1  # a run that differs shows as DIFF
                cols = " | ".join(f"{ph[k]:.3f}" if k in ph else "-"
                                  for k in ("alloc", "head", "extend", "read", "wait", "join"))  # fmt: skip
                d = hit.restore
                first_tok = tok if first_tok is None else first_tok
                ttfts[mode] = ttft
                plan = f"{d.kind} ({d.m})" if d else "-"
                if d and d.kind == "both" and hit.held + hit.computed != d.m:
                    plan = f"both ({d.m}→{hit.held + hit.computed})"  # the compute went on
                pred = f"{d.predicted_total_s:.3f}" if d and d.predicted_total_s else "-"
                same = "=" if tok == first_tok else f"DIFF {tok}"
                # each run with its way's initial (l / c / b): what auto chose run by run
                each = " ".join(f"{r[0]:.3f}{r[2].restore.kind[0] if r[2].restore else ''}"
                                for r in runs[mode])  # fmt: skip
                print(f"| {t} | {state} ({share if share is None else round(share, 2)}) | {mode} "
                      f"| {ttft:.3f} | {plan} | {hit.tier} | {pred} | {same} | {cols} "
                      f"| {suffix_s:.3f} | {fetch_s:.3f} ({hit.load_seconds:.3f}) | {each} |",
                      flush=True)  # fmt: skip
            summary.append((t, state, ttfts))
    print("\n| tokens | pages | min(load, compute) s | both / min | auto / min | goals |")
    print("|---:|---|---:|---:|---:|---|")
    for t, state, tt in summary:
        if "load" not in tt or "compute" not in tt:
            continue
        best = min(tt["load"], tt["compute"])
        near = max(tt["load"], tt["compute"]) <= 2 * best
        both = tt.get("both", float("nan")) / best
        auto = tt.get("auto", float("nan")) / best
        goals = [f"auto {'ok' if auto <= 1.05 else 'MISSED'}"] if "auto" in tt else []
        if near and "both" in tt:
            goals.append(f"both {'ok' if both <= 0.8 else 'MISSED'} (within 2x)")
        if EXTEND in tt:
            goals.append(f"{EXTEND} / min {tt[EXTEND] / best:.2f}")
        print(f"| {t} | {state} | {best:.3f} | {both:.2f} | {auto:.2f} | {', '.join(goals)} |")
    print("\nThe setup's prefill of each prompt (nothing cached, page cache aside: a compute, once): "
          + ", ".join(f"{t} tokens {s:.3f} s" for t, s in setups.items()))
    if a.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
