"""The restore plan of one disk hit: load it, recompute it, or both at once. Pure: no I/O, no MLX.

Given what this machine has measured (:class:`Learned`) and the facts of a hit (:class:`Hit`),
:func:`plan` picks the way that makes the hit's first ``n`` tokens ready soonest:

* ``load``    — read the whole entry file and build its arrays (today's cold reload);
* ``compute`` — ignore the file and prefill the ``n`` tokens (a miss, as far as the cache goes);
* ``both``    — prefill ``[0, m)`` on the MLX thread while an I/O thread reads ``[m, n)`` of every
  layer from the file, then join. ``m`` is chosen so that both finish together (Cake, 2024).

When memory already holds the first ``start`` tokens (a shorter hot hit), the computing starts
there: ``compute`` prefills ``[start, n)`` and ``both``'s head ``[start, m)``. That head may be
empty (``m == start``): the file's ``[start, n)`` is read and joined onto what memory holds, which
beats a load of the whole file when reading is the faster way (on an H100, 8B 8k with half the
hit held: a load 0.141 s, `both` with a head of 2048 tokens 0.137 s).

The suffix prefill after the restore costs the same whichever way, so it does not enter the choice.
When a cost is not known yet the plan is ``load`` (the behaviour before plans existed), which also
teaches the read bandwidth. :func:`worth_spilling` is the admission rule built on the same costs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any, Literal

Kind = Literal["load", "compute", "both"]
Mode = Literal["auto", "load", "compute", "both"]
KINDS: tuple[Kind, ...] = ("load", "compute", "both")

#: `both` is taken only when predicted at most this share of the better single way: it pays a
#: thread hand-off and a join that the model below estimates only roughly.
BOTH_MARGIN = 0.9
#: an entry is refused a file only when its best reload is predicted this many times slower than
#: recomputing it (measurements of short loads and prefills are noisy)
ADMIT_MARGIN = 1.5
#: outcomes predicted within this factor of a plan's seconds correct it (Learned.factor)
NEAR = 2.0
#: a correction never moves a prediction further than this
CLAMP = (0.2, 5.0)
#: a `both`'s head is never priced faster than alone, nor slower than this (Learned.head_factor)
HEAD_CLAMP = (1.0, 3.0)
#: the join's cost per byte of the ``n`` restored tokens (the read lands in the final arrays; the
#: join writes the computed head into them: about one copy of half the bytes); assumed this fast
#: until a join has been measured (``Learned.join_bytes_per_s``, from every `both` run).
DEFAULT_JOIN_BYTES_PER_S = 8e9


@dataclass(frozen=True)
class PrefillCost:
    """seconds(k new tokens after c context tokens) = overhead + k·per_token + k·(c + k/2)·per_pair.

    ``per_pair`` is the attention term: each new token attends to the context and to the new
    tokens before it."""

    overhead: float
    per_token: float
    per_pair: float

    def seconds(self, k: int, c: int = 0) -> float:
        if k <= 0:
            return 0.0
        return self.overhead + k * self.per_token + k * (c + k / 2) * self.per_pair

    def tokens_per_second(self, k: int = 1024, c: int = 0) -> float:
        s = self.seconds(k, c)
        return k / s if s > 0 else 0.0


@dataclass(frozen=True)
class ReadCost:
    """seconds(bytes) = overhead + bytes / bytes_per_s, for one page-cache state."""

    overhead: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.overhead + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclass(frozen=True)
class Learned:
    """What this machine measured for this model (any part may be unknown: None)."""

    prefill: PrefillCost | None = None
    #: the whole load path (read + verify + build arrays), page cache cold / warm
    load_cold: ReadCost | None = None
    load_warm: ReadCost | None = None
    #: the ranged reader of `both` (positioned reads of checksum chunks, no arrays), per byte served
    range_cold: ReadCost | None = None
    range_warm: ReadCost | None = None
    join_bytes_per_s: float | None = None
    #: how much longer a `both`'s head computes than the same prefill alone beside a read of a
    #: file on disk (median of actual / predicted over such heads; None before one ran): it
    #: computes beside the I/O thread's copies. Priced at the alone rate, `m` came out too large
    #: and `both` looked faster than the load it then lost to.
    head_factor: float | None = None
    #: the same beside a read out of the page cache, which copies ten times as fast: on the H100
    #: heads took 1.2-2.0x as long as alone beside a warm read, 0.93-1.08x beside a cold one, and
    #: one median over both priced warm `both`s at half their time (1B 64k: 0.15 s predicted,
    #: 0.26 taken; the load it was chosen over took 0.19)
    head_factor_warm: float | None = None
    #: outcomes seen, ``(way, predicted seconds, actual / predicted)``: how much longer than
    #: predicted each way took here. It corrects what the cost model leaves out (the `both` join
    #: and its hand-off, first-call overheads) with what this machine did; see :meth:`factor`.
    correction: tuple[tuple[str, float, float], ...] = ()

    def head_slower(self, warm: float | None) -> float:
        """How much slower than alone plans price a head beside a read of a file with share
        ``warm`` in the page cache (None: not known, as cold): the factors of the two kinds
        mixed by that share, one standing in for the other until it is seen (1.0 before
        either), each clamped to :data:`HEAD_CLAMP`."""

        def clamp(x: float | None) -> float | None:
            return None if x is None else min(HEAD_CLAMP[1], max(HEAD_CLAMP[0], x))

        mixed = _blend(warm, clamp(self.head_factor), clamp(self.head_factor_warm))
        return 1.0 if mixed is None else mixed

    def factor(self, kind: str, seconds: float | None = None) -> float:
        """The correction of ``kind``: the median ratio of its outcomes predicted within
        :data:`NEAR` times ``seconds`` (a whole prediction, as outcomes record it: the restore and
        the prompt's prefill after it; what a way leaves out is mostly fixed: at 1B 8k on the
        H100 a `both` took 1.3x its prediction, at 8B 128k 1.0x, and one median over both sizes
        was wrong for each), else of all its outcomes; 1.0 when none was seen. Clamped."""
        rows = [(p, r) for way, p, r in self.correction if way == kind]
        if seconds is not None and seconds > 0:
            near = [(p, r) for p, r in rows if seconds / NEAR <= p <= seconds * NEAR]
            rows = near or rows
        if not rows:
            return 1.0
        return min(CLAMP[1], max(CLAMP[0], statistics.median(r for _, r in rows)))


@dataclass(frozen=True)
class Hit:
    """A disk hit: ``tokens`` to restore from an entry file of ``entry_bytes``."""

    tokens: int
    entry_bytes: int
    #: KV bytes per token of the layers a ranged read returns
    bytes_per_token: float
    #: share of the file in the page cache (probed), None when it cannot be told
    warm: float | None = None
    #: "" when `both` can serve this entry; else why not (e.g. "recurrent layers")
    both_blocker: str = ""
    #: `m` is a multiple of this from ``start`` (1: ranged reads round to checksum chunks)
    block: int = 1
    #: tokens of the hit that memory holds already (a shorter hot hit): computing starts there
    start: int = 0

    def compute_seconds(self, prefill: PrefillCost, m: int, slower: float = 1.0) -> float:
        """Computing tokens ``[start, m)`` onto the ``start`` that memory holds (``slower``: as a
        `both`'s head, :attr:`Learned.head_factor`)."""
        return prefill.seconds(m - self.start, self.start) * slower


@dataclass(frozen=True)
class Plan:
    kind: Kind
    m: int  # tokens computed: 0 for load, n for compute, the split for both
    seconds: float  # predicted seconds until the n tokens are ready (0.0 when not known)
    reason: str  # "learned" | "forced" | "not learned" | why `both` was not possible
    load_s: float | None = None
    compute_s: float | None = None
    both_s: float | None = None
    factor: float = 1.0  # the correction applied to ``seconds`` (Learned.correction)
    #: its reads were priced from reads of their own kind (page-cache warm or cold) that this
    #: machine measured. An outcome of a plan that was not (a warm file priced at the cold rate,
    #: nothing warm measured yet) says which kind the file was, not what the cost model misses:
    #: it must not correct later plans (it did: 128k warm, the load predicted at 0.4x)
    informed: bool = True


#: a read with at least this share of its file in the page cache counts as warm
WARM = 0.5


def _priced(warm: float | None, cold_cost: ReadCost | None, warm_cost: ReadCost | None) -> bool:
    """True when a read of share ``warm`` has a measured cost of its own kind."""
    return (warm_cost if warm is not None and warm >= WARM else cold_cost) is not None


def _blend(warm: float | None, cold: float | None, hot: float | None) -> float | None:
    """A value for a file with share ``warm`` in the page cache (unknown share: cold), from its
    value when cold and when warm, mixed by that share; one stands in for the other until it is
    known; None when neither is."""
    if cold is None and hot is None:
        return None
    cold = hot if cold is None else cold
    hot = cold if hot is None else hot
    assert cold is not None and hot is not None
    f = 0.0 if warm is None else min(1.0, max(0.0, warm))
    return f * hot + (1 - f) * cold


def _mix(warm: float | None, cold_cost: ReadCost | None, warm_cost: ReadCost | None,
         nbytes: float) -> float | None:  # fmt: skip
    """Seconds to read ``nbytes`` with share ``warm`` in the page cache (unknown share: cold)."""
    return _blend(warm, cold_cost.seconds(nbytes) if cold_cost else None,
                  warm_cost.seconds(nbytes) if warm_cost else None)  # fmt: skip


def load_seconds(hit: Hit, learned: Learned) -> float | None:
    return _mix(hit.warm, learned.load_cold, learned.load_warm, hit.entry_bytes)


def range_seconds(hit: Hit, learned: Learned, tokens: int) -> float | None:
    """Reading ``tokens`` tokens of every layer by ranges; until ranged reads of a page kind are
    measured, at the whole load's rate of that kind: a whole load runs the same readers
    (``ranged.read_tensors``). (When loads still built arrays by ``mx.load``, a warm ranged read
    was priced 2x faster than the load: H200 8B 64k, load 2.6 GB/s, ranged 7-9; the H100's 1B
    8k warm load is now 7.8 GB/s, its ranged read 6.6.)"""
    cold = learned.range_cold or learned.load_cold
    warm = learned.range_warm or learned.load_warm
    return _mix(hit.warm, cold, warm, tokens * hit.bytes_per_token)


def split(hit: Hit, learned: Learned) -> tuple[int, float] | None:
    """(m, predicted seconds) of `both`: the smallest m, whole blocks from ``hit.start``, where
    computing [start, m) takes at least as long as reading [m, n), or the better of its
    neighbour; None if unknown. With tokens held (``start > 0``) m may be ``start`` itself (no
    head: only the tokens memory lacks are read); with none, m > 0 (m = 0 is a load). The seconds include the join (allocation of the final arrays +
    writing the head into them), priced per byte of the ``n`` tokens at the learned join rate."""
    p = learned.prefill
    if p is None or range_seconds(hit, learned, 1) is None:
        return None
    n, s, block = hit.tokens, hit.start, max(1, hit.block)

    join = n * hit.bytes_per_token / (learned.join_bytes_per_s or DEFAULT_JOIN_BYTES_PER_S)

    def at(b: int) -> int:
        return s + b * block

    slower = learned.head_slower(hit.warm)

    def cost(m: int) -> float:
        r = range_seconds(hit, learned, n - m) or 0.0
        return max(hit.compute_seconds(p, m, slower), r) + join

    lo, hi = 0, (n - s) // block  # in blocks: compute rises with m, the read falls
    while lo < hi:
        mid = (lo + hi) // 2
        m = at(mid)
        if hit.compute_seconds(p, m, slower) >= (range_seconds(hit, learned, n - m) or 0.0):
            hi = mid
        else:
            lo = mid + 1
    options = [at(b) for b in (lo - 1, lo) if 0 <= b and 0 < at(b) < n]
    if not options:
        return None
    m = min(options, key=cost)
    return m, cost(m)


def extend_pays(hit: Hit, learned: Learned, m: int, c: int, tokens: int, left: float,
                elapsed: float, head_per_token: float) -> bool:  # fmt: skip
    """Whether a `both` whose compute holds ``c`` tokens (its head ``[start, m)`` done) while its
    read of ``[m, n)`` goes on should compute ``tokens`` more rather than wait (the read then stops
    where the compute got to): only while the read is predicted to need longer than they take.
    The read's pace so far is its pace beside the compute; how much faster it would go alone is
    not known here, and on the H100 (8B 128k) it was an estimated ~5x: going on made the `both` later than
    waiting, which is why the restorer asks only when ``Restorer.extend`` is set (with heads given
    their room once, which took most of that slowness away, still no better: 8B 128k 7.11 / 6.97 s
    against 5.62 / 6.28 at m = n/2). The read's rest is priced
    by its pace so far (``left``: the share of its bytes not served after ``elapsed`` seconds), or
    before it served any by the learned range rate; the tokens at the learned prefill rate, as
    slow as heads beside a read of the hit's page state run (:meth:`Learned.head_slower`), else at
    ``head_per_token`` (this head's own pace). False when neither rate of the read is known."""
    if left < 1.0:
        read_left = elapsed * left / max(1e-9, 1.0 - left)
    else:
        priced = range_seconds(hit, learned, hit.tokens - m)
        if priced is None:
            return False
        read_left = priced - elapsed
    if learned.prefill is not None:
        step = learned.prefill.seconds(tokens, c) * learned.head_slower(hit.warm)
    else:
        step = head_per_token * tokens
    return read_left > step


def plan(hit: Hit, learned: Learned, mode: Mode = "auto", after: float = 0.0) -> Plan:
    """The way to restore ``hit`` (see the module doc). ``mode`` other than auto forces a way;
    a forced `both` that the entry cannot do falls back to auto's choice of load / compute.
    ``after``: the predicted seconds of the prompt's prefill after the hit (the same whatever the
    way): outcomes are recorded with it in their prediction, so a way's correction is looked up
    near its seconds plus these (:meth:`Learned.factor`)."""
    n = hit.tokens
    raw_load = load_seconds(hit, learned)
    raw_compute = hit.compute_seconds(learned.prefill, n) if learned.prefill else None
    raw_both = split(hit, learned) if not hit.both_blocker else None

    def total(seconds: float | None) -> float | None:
        return None if seconds is None else seconds + after

    fl = learned.factor("load", total(raw_load))
    fc = learned.factor("compute", total(raw_compute))
    fb = learned.factor("both", total(raw_both[1]) if raw_both else None)
    load_s = raw_load * fl if raw_load is not None else None
    compute_s = raw_compute * fc if raw_compute is not None else None
    both = (raw_both[0], raw_both[1] * fb) if raw_both is not None else None
    both_s = both[1] if both else None
    est: dict[str, Any] = {"load_s": load_s, "compute_s": compute_s, "both_s": both_s}
    load_ok = _priced(hit.warm, learned.load_cold, learned.load_warm)
    both_ok = _priced(hit.warm, learned.range_cold, learned.range_warm)
    if mode == "load":
        return Plan("load", 0, load_s or 0.0, "forced", **est, factor=fl, informed=load_ok)
    if mode == "compute":
        return Plan("compute", n, compute_s or 0.0, "forced", **est, factor=fc)
    if mode == "both":
        if both is not None:
            return Plan("both", both[0], both[1], "forced", **est, factor=fb, informed=both_ok)
        block, s = max(1, hit.block), hit.start
        m = s + max(block, ((n - s) // 2) // block * block)  # nothing learned: meet in the middle
        if not hit.both_blocker and s < m < n:
            return Plan("both", m, 0.0, "forced, not learned", **est)
        # the entry cannot be split (or is too short to be): choose as auto does, and say why
        why = hit.both_blocker or "too short to split"
        return replace(plan(hit, learned, "auto", after), reason=f"both unavailable: {why}")
    if load_s is None or compute_s is None:
        return Plan("load", 0, load_s or 0.0, "not learned", **est, factor=fl)
    reason = f"learned; both unavailable: {hit.both_blocker}" if hit.both_blocker else "learned"
    if both is not None and both[1] < BOTH_MARGIN * min(load_s, compute_s):
        return Plan("both", both[0], both[1], reason, **est, factor=fb, informed=both_ok)
    if compute_s < load_s:
        return Plan("compute", n, compute_s, reason, **est, factor=fc)
    return Plan("load", 0, load_s, reason, **est, factor=fl, informed=load_ok)


def worth_spilling(tokens: int, entry_bytes: int, bytes_per_token: float, learned: Learned,
                   both_blocker: str = "") -> bool:  # fmt: skip
    """Admission by value: False only when, on what this machine measured, reloading the entry
    (by load or by both, from a warm page cache — the best case) could never beat recomputing it:
    it would take more than ``ADMIT_MARGIN`` times as long (a margin for noisy measurements).
    Unknown costs admit."""
    fastest = _fastest(learned)
    if fastest is None or learned.prefill is None:
        return True
    hit = Hit(tokens, entry_bytes, bytes_per_token, 1.0, both_blocker, 1)
    p = plan(hit, fastest, "auto")
    if p.compute_s is None or p.load_s is None:
        return True
    reload = p.load_s
    if p.both_s is not None and p.both_s < BOTH_MARGIN * p.compute_s:
        reload = min(reload, p.both_s)  # a `both` that mostly computes is no reason for a file
    return reload <= ADMIT_MARGIN * p.compute_s


def _fastest(learned: Learned) -> Learned | None:
    """``learned`` with each read cost replaced by the fastest one known (page-cache warm)."""

    def best(*costs: ReadCost | None) -> ReadCost | None:
        known = [c for c in costs if c is not None]
        return min(known, key=lambda c: c.seconds(1 << 30)) if known else None

    load = best(learned.load_warm, learned.load_cold)
    if load is None:
        return None
    rng = best(learned.range_warm, learned.range_cold)
    return replace(learned, load_cold=load, load_warm=load, range_cold=rng, range_warm=rng)
