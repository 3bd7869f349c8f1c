"""Restorer: plans each disk hit (load / compute / both), runs `both`, learns from every outcome.

Ownership and threads: a Restorer belongs to the engine thread that owns MLX. Only in
:meth:`Restorer.both` does it use a second thread — its I/O thread runs
:func:`tiered_kv.cold.ranged.read_range` (files, bytes, numpy; never MLX) while the engine thread
prefills ``[0, m)``. The read lands in the final layer arrays, allocated (unwritten) on the engine
thread before the compute starts: the I/O thread writes bytes into their memory through numpy
views and does nothing else with them, and the engine thread touches them again only after the
read has returned (:mod:`tiered_kv.restore.buffers` states this exception to the one-MLX-thread
rule). They are token-major like the entry file (``(1, n, heads, ...)``, the read one contiguous
run per layer); the join copies the computed ``[0, m)`` into them in place and serves their
``swapaxes`` view, ``(1, heads, n, ...)``: the read tail is copied once, kernel to final array.
A head done before its read computes on a step at a time while the read is predicted to need
longer than a step, and the read (backwards through each tensor) stops where the compute got to
(:class:`tiered_kv.cold.ranged.Meet`): the two meet where they actually run, not only where the
plan priced them.
On CUDA the landing holds only the tail, which the I/O thread's readers stage in pinned memory and
the GPU copies into it (:mod:`tiered_kv.cold.gpu`), and the join concatenates on the GPU. The
CostBook it feeds is fitted and saved when settled (after a request's first token, when the batch
goes idle, after the calibration; saves at most every few seconds) and at :meth:`close`.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from tiered_kv import layers
from tiered_kv.background import Call
from tiered_kv.cold import gpu, pages, ranged, store
from tiered_kv.cold.landing import allocate
from tiered_kv.restore import buffers
from tiered_kv.restore.costs import CostBook
from tiered_kv.restore.plan import KINDS, Hit, Mode, Plan, extend_pays, plan, worth_spilling
from tiered_kv.steps import Steps, drain

log = logging.getLogger(__name__)

#: prefill(ids, held) → model caches holding ``held``'s tokens and then ``ids`` (engine thread).
#: ``held``: caches of the prompt's first tokens that memory holds (views of a hot entry: the
#: compute writes past them, never into them), or None: fresh caches holding exactly ``ids``.
#: Step by step: it yields between prefill steps, and a close stops it there.
Compute = Callable[[list[int], list[Any] | None], Steps[list[Any]]]
#: ``ranged.read_range``'s signature: (path, fingerprint, m, n, into=destinations, gpu=upload or
#: None, stop=event, header=the header the layout came from)
Reader = Callable[..., ranged.RangeRead]
#: where a `both` spends its time (seconds), in order: landing arrays allocated, the head computed
#: (I/O running beside it), the compute carried on past ``m`` while the read still ran, waiting for
#: the read after the compute, the join; and the read itself
PHASES = ("alloc", "head", "extend", "wait", "join", "read")
#: layer classes whose computed and read halves can be joined along the token axis
JOINABLE = frozenset({"KVCache", "QuantizedKVCache"})


class ColdFiles(Protocol):
    """What the Restorer needs of the cold tier."""

    fingerprint: str

    def describe(self, hit: Any) -> tuple[Path, int] | None: ...


@dataclass(frozen=True)
class Decision:
    """A plan as taken for one request, with the predicted time until the prompt is prefilled."""

    kind: str
    tokens: int  # disk-hit tokens the plan restores
    m: int
    predicted_total_s: float  # restore + the suffix prefill (0.0 when not known)
    reason: str
    #: the same before the learned correction of its way (what the outcome corrects)
    raw_total_s: float = 0.0
    #: priced from reads of its own page-cache kind (``Plan.informed``): only such outcomes
    #: correct later plans
    informed: bool = True
    #: tokens memory held already (a shorter hot hit): a `both` computes ``[start, m)`` onto them
    start: int = 0


@dataclass
class BothResult:
    caches: list[Any]
    tokens: np.ndarray
    seconds: float
    nbytes: int
    phases: dict[str, float]  # PHASES → seconds
    m: int = 0  # tokens the compute held at the join (the plan's m, or more: Restorer.extend)


def blocker_of(caches: Sequence[Any]) -> str:
    """Why a model's entries cannot be restored by `both` ("" when they can)."""
    names = {type(c).__name__ for c in layers.leaves(caches)}
    other = sorted(names - JOINABLE)
    return f"{', '.join(other)} layers cannot be split by tokens" if other else ""


class Restorer:
    def __init__(
        self,
        mode: Mode,
        costs: CostBook,
        compute: Compute,
        blocker: str,
        kv_bits: int = 0,
        kv_group_size: int = 64,
        reader: Reader = ranged.read_range,
        landing: str = "",
        step: int = 1,
    ) -> None:
        self.mode, self.costs, self.compute = mode, costs, compute
        #: `compute`'s prefill step (tokens): a `both` computes whole steps, ``m`` a multiple of
        #: it. Its head then runs only the step shapes every prefill (and the calibration) has
        #: already run: on CUDA the first forward of a new chunk length compiles kernels, and a
        #: head of 4255 tokens (8B, steps 2048, 2048, 158, 1) took 0.34 s where the same head took
        #: 0.14 s the second time.
        self.step = max(1, step)
        #: tokens the compute goes on with, a step at a time, when its head is done before the
        #: read (0: it waits, the default): the read, going backwards through each tensor, then
        #: stops where the compute got to (ranged.Meet). Off: a read beside a running prefill is
        #: far slower than the same read alone, and going on priced the read's rest at the pace
        #: it had beside the compute. A/B at the same m (`bench.restore --same-costs`, H100 8B
        #: 128k, page cache dropped, m = 65536): with it 7.98 / 7.42 s (computed on to 98304, the
        #: read 0.56 GB/s), without 6.90 / 6.81 (the read's last 2.3 s alone, ~2.6 GB/s est.); 8B 64k
        #: 2.85 against 2.67 s; H200 8B 32k medians 1.11 / 0.51 s against 0.99 / 0.46 (cold /
        #: warm). All measured before a head's caches got their room once (engine.prefill.fill,
        #: layers.reserve), which took most of that read's slowness away; measured again with the
        #: room (same A/B, m = n/2): 8B 128k 7.11 / 6.97 s against 5.62 / 6.28, 64k 3.21 / 3.46
        #: against 3.00 / 3.50: still no better. A whole prefill step when set (``step`` above:
        #: only compiled step shapes)
        self.extend = 0
        self.blocker, self.kv_bits, self.kv_group_size = blocker, kv_bits, kv_group_size
        self.reader = reader
        #: where `both`'s read lands: "full" or "tail" arrays (buffers.landing(); "" → that)
        self.landing = landing or buffers.landing()
        self._warm: dict[str, float | None] = {}
        self._lock = threading.Lock()  # counters are read by metrics scrapes
        self.counters: dict[str, float] = {
            **{f"restore_{k}": 0 for k in KINDS},
            "restore_both_fallbacks": 0, "restore_not_admitted": 0,
            "restore_not_admitted_bytes": 0, "restore_predicted_seconds": 0.0,
            "restore_actual_seconds": 0.0, "restore_last_predicted_seconds": 0.0,
            "restore_last_actual_seconds": 0.0,
            **{f"restore_both_{p}_seconds": 0.0 for p in PHASES},
        }  # fmt: skip
        #: the phases of the last `both` (PHASES → seconds; empty before one ran)
        self.last_phases: dict[str, float] = {}

    # -- planning ----------------------------------------------------------------------------
    def plan(self, cold: ColdFiles, hit: Any, n: int, prompt_len: int, start: int = 0) -> Decision:
        """The way to restore ``n`` tokens of ``hit`` for a prompt of ``prompt_len`` tokens when
        memory already holds ``start`` of them (a shorter hot hit)."""
        desc = cold.describe(hit)
        if desc is None:
            return Decision("load", n, 0, 0.0, "entry vanished")  # load turns it into a miss
        path, nbytes = desc
        warm = pages.resident_share(path)
        if len(self._warm) >= 64:  # plans whose read never came (a compute, a miss)
            self._warm.clear()
        self._warm[hit.entry_id] = warm  # popped by the read it prices
        entry_tokens = max(1, int(hit.entry_tokens))
        h = Hit(n, nbytes, nbytes / entry_tokens, warm, self.blocker, self.step, start)
        learned = self.costs.learned
        suffix = learned.prefill.seconds(prompt_len - n, n) if learned.prefill else 0.0
        p: Plan = plan(h, learned, self.mode, suffix)  # outcomes are priced with the suffix too
        raw = p.seconds / p.factor
        known = p.seconds > 0 and learned.prefill is not None
        d = Decision(p.kind, n, p.m, p.seconds + suffix if known else 0.0, p.reason,
                     raw + suffix if known else 0.0, p.informed, start)  # fmt: skip
        self._count(f"restore_{p.kind}")
        if self.mode == "both" and p.kind != "both":
            _ = self._fell_back(p.reason)  # forced, but this entry cannot be split: said, counted
        log.debug("restore plan %s (n=%d m=%d warm=%s): %s; load %s compute %s both %s", p.kind,
                  n, p.m, warm, p.reason, p.load_s, p.compute_s, p.both_s)  # fmt: skip
        return d

    # -- learning ----------------------------------------------------------------------------
    def observe_load(self, entry_id: str, nbytes: int, seconds: float) -> None:
        self.costs.observe_load(nbytes, seconds, self._warm.pop(entry_id, None))

    def outcome(self, decision: Decision, actual_total_s: float) -> None:
        """The prompt is prefilled: record predicted vs actual (only for predictions made; only
        informed ones teach the correction)."""
        if decision.predicted_total_s <= 0:
            return
        if decision.informed:
            self.costs.observe_outcome(decision.kind, decision.raw_total_s, actual_total_s)
        with self._lock:
            c = self.counters
            c["restore_predicted_seconds"] += decision.predicted_total_s
            c["restore_actual_seconds"] += actual_total_s
            c["restore_last_predicted_seconds"] = decision.predicted_total_s
            c["restore_last_actual_seconds"] = actual_total_s

    # -- admission ---------------------------------------------------------------------------
    def admit(self, n_tokens: int, nbytes: int) -> bool:
        """Admission by value (auto mode only): False when a reload could never beat a
        recompute of this entry on this machine; counted."""
        if self.mode != "auto" or n_tokens <= 0:
            return True
        ok = worth_spilling(n_tokens, nbytes, nbytes / n_tokens, self.costs.learned, self.blocker)
        if not ok:
            with self._lock:
                self.counters["restore_not_admitted"] += 1
                self.counters["restore_not_admitted_bytes"] += nbytes
        return ok

    # -- both --------------------------------------------------------------------------------
    def both(
        self, cold: ColdFiles, hit: Any, prompt: Sequence[int], d: Decision,
        held: list[Any] | None = None,
    ) -> BothResult | None:  # fmt: skip
        """:meth:`both_steps` run to its end (nothing else to do meanwhile)."""
        return drain(self.both_steps(cold, hit, prompt, d, background=False, held=held))

    def both_steps(
        self, cold: ColdFiles, hit: Any, prompt: Sequence[int], d: Decision,
        background: bool = True, held: list[Any] | None = None,
    ) -> Steps[BothResult | None]:  # fmt: skip
        """Compute ``[start, m)`` here (onto ``held``, caches of the ``d.start`` tokens memory
        holds; None when it holds none) while the I/O thread reads ``[m, n)`` into the final
        arrays; join. None when the file cannot serve the range (gone, corrupt, unsplittable):
        the caller loads instead, and the cold tier's own load then quarantines what is corrupt.
        With ``background``, each ``next()`` once the head is computed returns at once until the
        read is done: the batch loop's decode steps go on beside it."""
        if (held is None) != (d.start == 0):
            return self._fell_back(f"{d.start} tokens planned as held, caches given: {held is not None}")
        desc = cold.describe(hit)
        if desc is None:
            return self._fell_back("entry vanished")
        path, _ = desc
        n, m, start = d.tokens, d.m, d.start
        t0 = time.perf_counter()
        try:
            header = store.read_header(path, cold.fingerprint)  # read once: the read checks it is
            lay = ranged.layout_of(header, m, n)  # still the file's (store.same_file)
            full = allocate(buffers.shapes(lay, m, n, self.landing),
                            one_buffer=self.landing == "tail")
            views = buffers.byte_views(full, m, n)
        except (store.CorruptEntry, ranged.Unsplittable, OSError, ValueError) as e:
            return self._fell_back(f"{type(e).__name__}: {e}")
        t_alloc = time.perf_counter()
        up = gpu.shared() if self.landing == "tail" else None  # CUDA: copied in by the GPU
        stop = threading.Event()
        meet = ranged.Meet(m)
        read = Call(functools.partial(self.reader, path, cold.fingerprint, m, n, into=views,
                                      gpu=up, stop=stop, header=header, meet=meet),
                    "restore-io")  # fmt: skip
        del views  # the I/O thread's now; `full` is not touched until the read returned
        head_error: Exception | None = None
        c = m  # tokens the compute holds
        try:
            try:
                head = self.compute(np.asarray(prompt[start:m]).tolist(), held)
                del held  # the compute's now (it writes past the held tokens)
                # beside a batch its steps are the loop's: the other streams decode between them
                computed = (yield from head) if background else drain(head)
                t_head = time.perf_counter()
                while self._carry_on(read, meet, hit, c, n, start, m, t_head - t_alloc, t_alloc):
                    more = self.compute(np.asarray(prompt[c : c + self.extend]).tolist(), computed)
                    computed = (yield from more) if background else drain(more)
                    c += self.extend
                    meet.floor = c  # the read stops where it gets below this
            except Exception as e:  # the file may still serve: load it (once the read let `full` go)
                head_error = e
                stop.set()
                t_head = time.perf_counter()
            t_ext = time.perf_counter()
            while background and not read.done():
                yield
        except BaseException:  # closed by a cancelled request: the read stops before its next piece
            stop.set()
            raise
        if head_error is not None:
            _wait_out(read)
            return self._fell_back(f"head: {type(head_error).__name__}: {head_error}")
        try:
            rr = read.result()
        except (store.CorruptEntry, ranged.Unsplittable, OSError, ValueError, gpu.DeviceError) as e:
            return self._fell_back(f"{type(e).__name__}: {e}")  # `full` (unverified) is dropped
        t_read = time.perf_counter()
        warm = self._warm.pop(hit.entry_id, None)  # the file's share in the page cache, planned
        alone = self.costs.learned.prefill  # before this head teaches it
        if alone is not None:  # how much the read beside it slowed the head (plan.split)
            self.costs.observe_head(alone.seconds(m - start, start), t_head - t_alloc, warm)
        self.costs.observe_prefill(m - start, start, t_head - t_alloc)
        # bytes served, not read: the learned range rate then prices in the whole-chunk overread
        rr.tensors.clear()  # the views into `full`: the join may update it in place
        self.costs.observe_range(rr.served, rr.seconds, warm)
        if not np.array_equal(rr.tokens[:n], np.asarray(prompt[:n], dtype=np.int32)):
            return self._fell_back("file tokens differ from the prompt")
        if rr.first > c:  # never: the read stops only below what the compute holds
            return self._fell_back(f"the read stopped at {rr.first}, the compute at {c}")
        nbytes = sum(store.nbytes(dt, shp) for dt, shp in lay.values())  # n tokens
        try:
            caches = self.join(computed, full, rr.metadata, c, n, m)
        except (layers.CorruptState, layers.UnsupportedCache, ranged.Unsplittable, KeyError) as e:
            return self._fell_back(f"join: {e}")
        t_join = time.perf_counter()
        # allocation + join per byte of the n tokens: what plan.split adds to `both`
        self.costs.observe_join(nbytes, (t_join - t_read) + (t_alloc - t0))
        phases = {"alloc": t_alloc - t0, "head": t_head - t_alloc, "extend": t_ext - t_head,
                  "wait": t_read - t_ext, "join": t_join - t_read, "read": rr.seconds}  # fmt: skip
        self._record(phases)
        return BothResult(caches, rr.tokens[:n].copy(), t_join - t0, rr.nbytes, phases, c)

    def _carry_on(self, read: Call, meet: ranged.Meet, hit: Any, c: int, n: int, start: int,
                  m: int, head_s: float, t_read: float) -> bool:  # fmt: skip
        """Whether the compute, holding ``c`` tokens with the read still going, computes one more
        :attr:`extend` step (:func:`plan.extend_pays`, priced from the read's progress)."""
        if not self.extend or c + self.extend >= n or read.done():
            return False
        h = Hit(n, 0, meet.total / max(1, n - m), self._warm.get(hit.entry_id))
        return extend_pays(h, self.costs.learned, m, c, self.extend, meet.left(),
                           time.perf_counter() - t_read, head_s / max(1, m - start))  # fmt: skip

    def join(self, computed: list[Any], full: dict[str, mx.array], metadata: dict[str, str],
             m: int, n: int, landed: int | None = None) -> list[Any]:  # fmt: skip
        """Caches holding ``[0, n)``: the computed ``[0, m)`` (quantised like the entry when the
        tier stores quantised KV) and the read ``[m, n)`` in ``full`` — the token-major landing
        arrays, of all ``n`` tokens (the head, swapped, is written into tokens ``[0, m)`` in place;
        the cache holds the ``swapaxes`` view) or of ``[landed, n)`` only (``landed``: the plan's
        m, at most ``m``; one concatenation with the swapped tail from ``m``). ``full`` is
        consumed. Engine thread."""
        landed = m if landed is None else landed
        if self.kv_bits:
            computed = layers.quantize(computed, self.kv_bits, self.kv_group_size)
        mine, _ = layers.encode(computed)
        if set(mine) != set(full):
            raise ranged.Unsplittable("computed layers differ from the entry's tensors")
        arrays: dict[str, mx.array] = {}
        for name in list(full):
            head = mine[name][..., :m, :]
            a = full.pop(name)  # one reference left: the update below writes in place
            if a.ndim != 4 or head.shape[:2] != (a.shape[0], a.shape[2]) or head.shape[3:] != a.shape[3:]:
                raise ranged.Unsplittable(f"computed {name} {head.shape} vs entry {a.shape}")
            head = head.astype(a.dtype) if head.dtype != a.dtype else head
            if a.shape[1] == n:
                a[:, :m] = mx.swapaxes(head, 1, 2)
                arrays[name] = mx.swapaxes(a, 1, 2)
            else:
                tail = mx.swapaxes(a, 1, 2)[..., m - landed :, :]
                arrays[name] = mx.concatenate([head, tail], axis=2)
        mx.eval(list(arrays.values()))
        tree = json.loads(metadata["layers"])
        _set_offsets(tree, n)
        return layers.decode(arrays, {"layers": json.dumps(tree)})

    def _record(self, phases: dict[str, float]) -> None:
        with self._lock:
            self.last_phases = dict(phases)
            for p, s in phases.items():
                self.counters[f"restore_both_{p}_seconds"] += s

    def _fell_back(self, why: str) -> BothResult | None:
        """Count and log a `both` that could not be done; None (the caller loads instead)."""
        log.info("restore by both not taken: %s", why)
        self._count("restore_both_fallbacks")
        return None

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    # -- lifecycle ---------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        with self._lock:
            out = dict(self.counters)
        out.update({f"learned_{k}": v for k, v in self.costs.stats().items()})
        return out

    def close(self) -> None:
        self.costs.save(force=True)


def _set_offsets(tree: list[dict[str, Any]], n: int) -> None:
    for node in tree:
        if node.get("cls") == "CacheList":
            _set_offsets(node["items"], n)
        elif node.get("cls") in JOINABLE:
            node["meta"]["offset"] = n
        else:
            raise ranged.Unsplittable(f"layer class {node.get('cls')}")


def calibrate(compute: Compute, costs: CostBook, budget_s: float = 2.0) -> int:
    """A short prefill calibration when nothing is known: a warm-up, then prompts of growing
    length until ``budget_s`` is spent, each run twice and the faster one recorded (a length's
    first run may compile kernels: on CUDA 256 tokens took 0.47 s once and 0.11 s after, and the
    slow one made every long prefill predicted ~1.7x too slow). Fitted and saved at its end (it
    runs at start, before any request settles the book). Returns the prefills recorded. Engine
    thread."""
    drain(compute([1] * 8, None))  # warm-up: first-call overheads are not the machine's speed
    done, t_all = 0, time.perf_counter()
    for k in (64, 256, 1024, 4096):
        ids = [(i * 7919) % 200 + 3 for i in range(k)]
        runs = []
        for _ in range(2):
            t0 = time.perf_counter()
            drain(compute(ids, None))
            runs.append(time.perf_counter() - t0)
        dt = min(runs)
        costs.observe_prefill(k, 0, dt)
        done += 1
        if time.perf_counter() - t_all + 8 * dt > budget_s:
            break  # the next one is 4x longer, run twice
    costs.settle()  # no request's first token settles these: fitted (for /metrics) and saved now
    return done


def _wait_out(future: Any) -> None:
    """Until the I/O thread is done with the arrays it reads into; its outcome does not matter."""
    try:
        future.result()
    except Exception:
        pass
