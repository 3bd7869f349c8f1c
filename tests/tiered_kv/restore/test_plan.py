"""tiered_kv/restore/plan.py: the restore plan as a pure function of learned costs (table-driven)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tiered_kv.restore import plan as plan_mod
from tiered_kv.restore.plan import (
    Hit,
    Learned,
    PrefillCost,
    ReadCost,
    extend_pays,
    plan,
    split,
    worth_spilling,
)

KIB = 1024
GB = 1e9
# 32k tokens of an 8B-shaped model (128 KiB per token): a 4 GiB entry
N = 32768
BPT = 128 * KIB
HIT = Hit(N, N * BPT, BPT, warm=0.0, block=256)

PREFILL_FAST = PrefillCost(0.0, 1 / 20000, 0.0)  # 20k tok/s: 1.6 s for 32k
PREFILL_SLOW = PrefillCost(0.0, 1 / 100, 0.0)  # CPU: 100 tok/s


def reads(gb_s: float) -> ReadCost:
    return ReadCost(0.0, gb_s * GB)


def learned(prefill: PrefillCost | None, load: float | None, rng: float | None = None) -> Learned:
    return Learned(
        prefill=prefill,
        load_cold=reads(load) if load else None,
        range_cold=reads(rng) if rng else None,
    )


@pytest.mark.parametrize(
    ("name", "hit", "costs", "mode", "kind", "reason"),
    [
        ("fast disk, slow compute → load", HIT, learned(PREFILL_SLOW, 5.0), "auto", "load", "learned"),
        ("slow disk, fast compute → compute", HIT, learned(PREFILL_FAST, 0.1), "auto", "compute", "learned"),
        ("comparable → both", HIT, learned(PREFILL_FAST, 2.7), "auto", "both", "learned"),
        ("nothing learned → load", HIT, Learned(), "auto", "load", "not learned"),
        ("no read learned → load", HIT, learned(PREFILL_FAST, None), "auto", "load", "not learned"),
        ("no prefill learned → load", HIT, learned(None, 0.1), "auto", "load", "not learned"),
        ("forced load", HIT, learned(PREFILL_FAST, 0.1), "load", "load", "forced"),
        ("forced compute", HIT, learned(PREFILL_SLOW, 5.0), "compute", "compute", "forced"),
        ("forced both", HIT, learned(PREFILL_SLOW, 5.0), "both", "both", "forced"),
        ("forced both, nothing learned: the middle", HIT, Learned(), "both", "both",
         "forced, not learned"),
        ("comparable, but both took 2.5x its prediction here → the better single way", HIT,
         replace(learned(PREFILL_FAST, 2.7), correction=(("both", 1.0, 2.5),)), "auto", "load",
         "learned"),
        ("fast disk, but loads took 4x their prediction here → compute", HIT,
         replace(learned(PREFILL_FAST, 5.0), correction=(("load", 1.0, 4.0), ("both", 1.0, 4.0))), "auto",
         "compute", "learned"),
    ],
)  # fmt: skip
def test_plan_table(name, hit, costs, mode, kind, reason):
    p = plan(hit, costs, mode)
    assert (p.kind, p.reason) == (kind, reason), name
    assert 0 <= p.m <= hit.tokens
    if kind == "load":
        assert p.m == 0
    if kind == "compute":
        assert p.m == hit.tokens
    if kind == "both":
        assert 0 < p.m < hit.tokens and p.m % hit.block == 0


def test_both_split_finishes_together():
    """m is where computing [0, m) takes as long as reading [m, n), to within one block."""
    costs = learned(PREFILL_FAST, 2.7)
    m, seconds = split(HIT, costs)  # type: ignore[misc]
    compute = PREFILL_FAST.seconds(m)
    read = (N - m) * BPT / (2.7 * GB)
    one_block = max(PREFILL_FAST.seconds(256), 256 * BPT / (2.7 * GB))
    assert abs(compute - read) <= one_block
    # compute 20k tok/s vs read 2.7 GB/s ≈ 20.6k tok/s: meet near the middle
    assert 0.4 * N < m < 0.6 * N
    p = plan(HIT, costs)
    assert p.kind == "both" and p.m == m and p.seconds == pytest.approx(seconds)
    assert p.seconds < 0.9 * min(p.load_s, p.compute_s)  # type: ignore[operator,type-var]


def test_both_split_uses_the_range_reader_cost_when_known():
    slow_range = split(HIT, learned(PREFILL_FAST, 2.7, rng=1.0))
    fast_range = split(HIT, learned(PREFILL_FAST, 2.7, rng=10.0))
    assert slow_range and fast_range and slow_range[0] > fast_range[0]  # slower reads: compute more


def test_blocked_both_falls_back_and_says_why():
    hit = Hit(N, N * BPT, BPT, 0.0, "RotatingKVCache layers cannot be split by tokens", 256)
    p = plan(hit, learned(PREFILL_FAST, 2.7))
    assert p.kind in ("load", "compute") and "RotatingKVCache" in p.reason
    forced = plan(hit, learned(PREFILL_FAST, 2.7), "both")
    assert forced.kind in ("load", "compute") and forced.reason.startswith("both unavailable")
    short = plan(Hit(100, 100 * BPT, BPT, 0.0, "", 256), Learned(), "both")
    assert short.kind == "load" and "too short" in short.reason


def test_page_cache_warm_share_moves_the_choice():
    costs = Learned(prefill=PREFILL_FAST, load_cold=reads(0.5), load_warm=reads(20.0))
    cold = plan(Hit(N, N * BPT, BPT, warm=0.0, block=256), costs)
    warm = plan(Hit(N, N * BPT, BPT, warm=1.0, block=256), costs)
    unknown = plan(Hit(N, N * BPT, BPT, warm=None, block=256), costs)
    assert cold.kind == "compute" and warm.kind == "load"
    assert unknown.kind == cold.kind  # unknown page cache: plan for the disk


def test_context_term_makes_long_prompts_dearer():
    quad = PrefillCost(0.0, 1 / 40000, 2e-9)
    assert quad.seconds(N) > 2 * quad.seconds(N // 2)
    assert quad.seconds(1000, 30000) > quad.seconds(1000, 0)


@pytest.mark.parametrize(
    ("costs", "tokens", "admit"),
    [
        (Learned(), 512, True),  # nothing known: admit
        (learned(PREFILL_FAST, 0.05), 512, False),  # fast GPU, slow disk: never worth it
        (learned(PREFILL_SLOW, 0.05), 512, True),  # CPU: loading wins
        (learned(PREFILL_FAST, 5.0), N, True),
        (learned(PREFILL_FAST, 2.2), 4096, True),  # reload 1.2x compute: within the noise margin
    ],
)
def test_admission_by_value(costs, tokens, admit):
    assert worth_spilling(tokens, tokens * BPT, BPT, costs) is admit


def test_admission_assumes_the_best_page_cache_state():
    costs = Learned(prefill=PREFILL_FAST, load_cold=reads(0.05), load_warm=reads(50.0))
    assert worth_spilling(N, N * BPT, BPT, costs)


def test_a_ranged_read_not_yet_measured_is_priced_as_the_load_of_its_page_kind():
    """A whole load runs the same readers as a ranged read (``ranged.read_tensors``): until ranged
    reads are measured, one is priced at the load's rate of its page kind (warm at the warm
    load's, not the cold one's); a measured one is used as it is."""
    from tiered_kv.restore.plan import load_seconds, range_seconds

    warm_hit = replace(HIT, warm=1.0)
    costs = Learned(prefill=PREFILL_FAST, load_cold=reads(1.5), load_warm=reads(2.6))
    whole = load_seconds(warm_hit, costs)
    assert whole is not None
    assert range_seconds(warm_hit, costs, N) == pytest.approx(whole)
    measured = replace(costs, range_warm=reads(9.0))
    assert range_seconds(warm_hit, measured, N) == pytest.approx(N * BPT / (9.0 * GB))
    # cold pages keep the cold rates
    assert range_seconds(HIT, costs, N) == pytest.approx(N * BPT / (1.5 * GB))


def test_a_plan_priced_from_the_other_page_kind_is_not_informed():
    """A warm file priced at the cold rate (nothing warm measured yet) is not an informed plan:
    its outcome says the file was warm, not what the cost model misses. On the H200 (128k
    tokens, 8B) such an outcome (load predicted 10.7 s, 4.3 s actual) became a 0.4x correction
    of every later load, and a warm load of 4.5 s was predicted at 1.7 s."""
    warm_hit = replace(HIT, warm=1.0)
    cold_only = learned(PREFILL_FAST, 1.5, 1.5)
    assert not plan(warm_hit, cold_only, "load").informed
    assert not plan(warm_hit, cold_only, "both").informed
    assert plan(HIT, cold_only, "load").informed and plan(HIT, cold_only, "both").informed
    assert plan(warm_hit, cold_only, "compute").informed  # prefill has no page kind
    both_kinds = replace(cold_only, load_warm=reads(4.0), range_warm=reads(7.0))
    assert plan(warm_hit, both_kinds, "load").informed
    assert plan(warm_hit, both_kinds, "both").informed


def test_memory_held_prefix_prices_compute_from_it():
    """With ``start`` tokens already in memory (a shorter hot hit), recomputing costs only the
    rest: a load of the whole file that beats recomputing all of it loses to recomputing the
    last quarter. The plan priced compute as all ``n`` tokens and chose the load."""
    costs = learned(PREFILL_FAST, 5.0)  # load 0.86 s, compute of all 32k 1.6 s
    assert plan(HIT, costs).kind == "load"
    held = plan(replace(HIT, start=3 * N // 4), costs)
    assert held.kind == "compute" and held.m == N
    assert held.compute_s == pytest.approx(PREFILL_FAST.seconds(N // 4, 3 * N // 4))


def test_both_after_a_memory_held_prefix_computes_from_it():
    """`both` computes ``[start, m)`` onto what memory holds, in whole blocks from ``start``,
    while ``[m, n)`` is read: the split finishes both together from there."""
    start = 4096 + 100
    hit = replace(HIT, start=start)
    costs = learned(PREFILL_FAST, 2.7)
    got = split(hit, costs)
    assert got is not None
    m, _ = got
    assert start < m < N and (m - start) % hit.block == 0
    one_block = max(PREFILL_FAST.seconds(256), 256 * BPT / (2.7 * GB))
    assert abs(PREFILL_FAST.seconds(m - start, start) - (N - m) * BPT / (2.7 * GB)) <= one_block
    assert m > split(HIT, costs)[0]  # type: ignore[index]  # the head starts later: it ends later
    forced = plan(replace(hit, start=N - 200), Learned(), "both")
    assert forced.kind == "load" and "too short" in forced.reason  # 200 tokens: under a block
    middle = plan(hit, Learned(), "both")
    assert middle.kind == "both" and start < middle.m < N and (middle.m - start) % 256 == 0


def test_with_a_held_prefix_both_may_read_only_what_memory_lacks():
    """Memory holds the first half of the hit and reading is far faster than computing: the best
    way reads ``[start, n)`` alone and joins it onto what memory holds (a `both` with no head), at
    half a load's bytes. The split began one block past ``start``, so the plan was a load of the
    whole file (or a head of a block, slower than reading it); with nothing held, m = 0 (a load)
    is still no `both`."""
    start = N // 2
    hit = replace(HIT, start=start, warm=1.0)
    costs = replace(learned(PREFILL_SLOW, 2.0), load_warm=reads(2.0), range_warm=reads(2.0))
    m, seconds = split(hit, costs)  # type: ignore[misc]
    assert m == start
    read_half = (N - start) * BPT / (2.0 * GB)
    assert seconds == pytest.approx(read_half + N * BPT / plan_mod.DEFAULT_JOIN_BYTES_PER_S)
    p = plan(hit, costs)
    assert p.kind == "both" and p.m == start and p.both_s < p.load_s  # type: ignore[operator]
    none_held = split(replace(hit, start=0), costs)
    assert none_held is not None and none_held[0] > 0


def test_a_correction_comes_from_outcomes_of_a_similar_size():
    """What a way leaves out is mostly fixed: on the H100 a `both` of 1B 8k took 1.3x its
    prediction, one of 8B 128k 1.0x. One median over both sizes corrected each wrongly; the
    outcomes near a plan's size correct it, all of the way's outcomes when none is near."""
    small = tuple(("both", 0.05, r) for r in (1.3, 1.35, 1.4))
    large = tuple(("both", 5.0, r) for r in (0.9, 1.0, 1.0))
    le = Learned(correction=small + large + (("load", 0.05, 0.8),))
    assert le.factor("both", 0.06) == pytest.approx(1.35)
    assert le.factor("both", 4.0) == pytest.approx(1.0)
    assert le.factor("both", 0.5) == pytest.approx((1.0 + 1.3) / 2)  # none near: all six
    assert le.factor("both") == pytest.approx((1.0 + 1.3) / 2)
    assert le.factor("load", 100.0) == pytest.approx(0.8)  # its only outcome, far or not
    assert le.factor("compute", 1.0) == 1.0
    assert Learned(correction=(("load", 1.0, 100.0),)).factor("load") == 5.0  # clamped


def test_a_small_hit_is_planned_with_the_corrections_of_small_hits():
    """A short hit where `both` was seen to run 1.4x its prediction (large ones on time) is loaded;
    the same outcomes leave a long hit's `both` as it was."""
    n = 8192
    hit = Hit(n, n * BPT, BPT, warm=0.0, block=256)
    costs = learned(PREFILL_FAST, 2.7)
    assert plan(hit, costs).kind == "both"
    small = plan(hit, costs).both_s
    outcomes = tuple(("both", small, 1.4) for _ in range(3))
    outcomes += tuple(("both", plan(HIT, costs).both_s, 1.0) for _ in range(3))
    told = replace(costs, correction=outcomes)
    assert plan(hit, told).kind != "both"
    assert plan(HIT, told).kind == "both" and plan(HIT, told).both_s == plan(HIT, costs).both_s


def test_a_head_slowed_beside_its_read_moves_the_split_and_the_choice():
    """A head computing beside the I/O thread ran slower than alone (H100 8B 8k: 2048 tokens in
    0.12 s where alone they take 0.08). Priced at the alone rate, `m` was too large and `both`
    looked faster than the load it lost to; priced at the head's own rate, `m` moves down and
    the plan takes the load where `both` no longer pays."""
    costs = learned(PREFILL_FAST, 2.7)
    m_alone, s_alone = split(HIT, costs)  # type: ignore[misc]
    m_slow, s_slow = split(HIT, replace(costs, head_factor=1.5))  # type: ignore[misc]
    assert m_slow < m_alone and s_slow > s_alone
    compute = PREFILL_FAST.seconds(m_slow) * 1.5
    read = (N - m_slow) * BPT / (2.7 * GB)
    assert abs(compute - read) <= max(PREFILL_FAST.seconds(256) * 1.5, 256 * BPT / (2.7 * GB))
    assert plan(HIT, replace(costs, head_factor=3.0)).kind != "both"
    # never priced faster than alone: a head that happened to run quicker moves nothing
    assert split(HIT, replace(costs, head_factor=0.5)) == (m_alone, s_alone)


def test_a_head_is_priced_by_the_page_state_of_the_read_beside_it():
    """Heads beside a warm read (the page cache copied to the GPU at 10-25 GB/s) ran 1.2-2.0x as
    long as alone on the H100, beside a cold one (the disk's 1-2 GB/s) as alone. With one factor
    for both, a warm `both` was priced at half its time and chosen over a faster load (1B 64k:
    0.15 s predicted, 0.26 taken, the load 0.19). Each kind prices its own heads; a file partly
    warm mixes them; a kind not seen yet borrows the other's."""
    costs = replace(learned(PREFILL_FAST, 0.5), load_warm=reads(2.0), range_warm=reads(2.0))
    warm, cold = replace(HIT, warm=1.0), HIT
    both_kinds = replace(costs, head_factor=1.0, head_factor_warm=2.0)
    assert split(cold, both_kinds) == split(cold, costs)  # cold heads: as alone
    assert split(warm, both_kinds) == split(warm, replace(costs, head_factor=2.0))
    assert split(warm, both_kinds)[1] > split(warm, costs)[1]  # type: ignore[index]
    assert plan(warm, costs).kind == "both" and plan(warm, both_kinds).kind == "compute"
    assert both_kinds.head_slower(0.5) == pytest.approx(1.5)
    assert both_kinds.head_slower(None) == 1.0  # a share not known: as cold
    only_warm = replace(costs, head_factor_warm=2.0)
    assert only_warm.head_slower(0.0) == only_warm.head_slower(1.0) == 2.0
    assert costs.head_slower(1.0) == 1.0  # no head seen: priced as alone


@pytest.mark.parametrize(
    ("name", "costs", "left", "elapsed", "head_per_token", "go_on"),
    [
        ("half the read left after 1 s (1 s more), a step 0.1 s → go on",
         learned(PREFILL_FAST, 1.0), 0.5, 1.0, 0.0, True),
        ("1 % left after 1 s (0.01 s more), a step 0.1 s → wait",
         learned(PREFILL_FAST, 1.0), 0.01, 1.0, 0.0, False),
        ("nothing served yet after 0.5 s, the tail priced 2.1 s → go on",
         learned(PREFILL_FAST, 1.0), 1.0, 0.5, 0.0, True),
        ("nothing served yet after 3 s, its price passed → wait",
         learned(PREFILL_FAST, 1.0), 1.0, 3.0, 0.0, False),
        ("nothing served, no read rate known → wait", learned(PREFILL_FAST, None), 1.0, 0.5, 0.0,
         False),
        ("no prefill learned: this head's pace, 2 s a step against 1 s left → wait",
         learned(None, 1.0), 0.5, 1.0, 1e-3, False),
        ("no prefill learned: this head's pace, 0.2 s a step against 1 s left → go on",
         learned(None, 1.0), 0.5, 1.0, 1e-4, True),
        ("0.2 s left, a step 0.1 s alone → go on", learned(PREFILL_FAST, 1.0), 1 / 6, 1.0, 0.0,
         True),
        ("0.2 s left, a step 0.1 s alone but heads beside cold reads run 3x → wait",
         replace(learned(PREFILL_FAST, 1.0), head_factor=3.0), 1 / 6, 1.0, 0.0, False),
    ],
)  # fmt: skip
def test_a_both_computes_on_past_its_head_only_while_the_read_needs_longer(
    name, costs, left, elapsed, head_per_token, go_on
):
    """After its head, a `both` whose read is still going computes another step (2048 tokens,
    0.1 s at 20k tok/s) only while the read is predicted to need longer: by its pace so far, or
    before it served anything by the learned range rate (here the tail of 16k tokens, 2 GiB at
    1 GB/s: 2.1 s); the step as slow as heads beside a read run."""
    m = N // 2
    assert extend_pays(HIT, costs, m, m, 2048, left, elapsed, head_per_token) is go_on, name
