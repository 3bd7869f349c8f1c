"""tiered_kv/restore/costs.py: fits recover the costs that produced the observations; the book
persists as JSON per model and machine, and a bad file starts afresh."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tiered_kv.restore.costs import CostBook, fit_prefill, fit_read, machine_id
from tiered_kv.restore.plan import PrefillCost


def test_prefill_fit_recovers_rate_and_context_term():
    true = PrefillCost(0.01, 1 / 5000, 1e-8)
    obs = [[k, c, true.seconds(k, c)] for k in (64, 512, 4096) for c in (0, 8192, 32768)]
    got = fit_prefill(obs)
    assert got is not None
    for k, c in ((1000, 0), (8000, 60000)):
        assert got.seconds(k, c) == pytest.approx(true.seconds(k, c), rel=0.02)


def test_one_observation_gives_a_plain_rate():
    got = fit_prefill([[1000, 0, 0.5]])
    assert got is not None and got.tokens_per_second(1000) == pytest.approx(2000)


def test_a_slowed_prefill_does_not_make_the_plan_overestimate_compute():
    """A first call (kernel compiles) or a loaded moment is slower than the machine; the fastest
    prefill of a shape is what it can do (H200, 1B shape: predicted 1.0 s vs 0.46 s actual)."""
    book = CostBook(None, "fp")
    true = PrefillCost(0.0, 1 / 70_000, 0.0)
    book.observe_prefill(32768, 0, 3 * true.seconds(32768))  # the first, slowed
    book.observe_prefill(8192, 0, 2.5 * true.seconds(8192))
    book.observe_prefill(32800, 0, true.seconds(32800))  # later ones, same shapes
    book.observe_prefill(8224, 0, true.seconds(8224))
    got = book.learned.prefill
    assert got is not None
    assert got.seconds(32768) == pytest.approx(true.seconds(32768), rel=0.05)


def test_a_slowed_warm_load_does_not_make_the_plan_overestimate_loads():
    """A process's first warm load pays first-call costs (H200, 1B 8k: 0.30 s, then 0.045 s); the
    fastest warm load of a size is the machine's copy speed. Cold loads are the disk's, which
    varies: all of them are fitted."""
    book = CostBook(None, "fp")
    size = 268_000_000
    book.observe_load(size, 0.30, warm=1.0)  # the first, slowed
    book.observe_load(size + 4096, 0.045, warm=1.0)  # the same size later
    warm = book.learned.load_warm
    assert warm is not None and warm.seconds(size) == pytest.approx(0.045, rel=0.05)
    book.observe_load(size, 0.30, warm=0.0)
    book.observe_load(size, 0.10, warm=0.0)
    cold = book.learned.load_cold
    assert cold is not None and 0.11 < cold.seconds(size) < 0.30  # both fitted, not the best alone


def test_outcomes_become_a_correction_per_way_and_persist(tmp_path):
    path = CostBook.file_for(tmp_path)
    book = CostBook(path, "fp")
    assert book.learned.factor("both") == 1.0  # nothing seen: no correction
    for predicted, actual in ((0.4, 0.9), (0.5, 1.1), (0.8, 1.9)):
        book.observe_outcome("both", predicted, actual)
    book.observe_outcome("compute", 1.0, 0.5)
    book.observe_outcome("load", 1.0, 1000.0)  # clamped
    book.save(force=True)
    again = CostBook(path, "fp").learned
    assert again.factor("both") == pytest.approx(2.2, rel=0.05)
    assert again.factor("compute") == pytest.approx(0.5)
    assert again.factor("load") == 5.0


def test_read_fit():
    obs = [[n, 0.002 + n / 2e9] for n in (1e6, 1e8, 1e9)]
    got = fit_read(obs)
    assert got is not None and got.bytes_per_s == pytest.approx(2e9, rel=0.01)


def test_persisted_per_fingerprint_and_machine(tmp_path):
    path = CostBook.file_for(tmp_path)
    assert machine_id()[0] in path.name
    a = CostBook(path, "fp")
    a.observe_prefill(1000, 0, 0.5)
    a.observe_load(10**8, 0.1, 0.0)
    a.observe_load(10**8, 0.01, 1.0)
    a.save(force=True)
    assert json.loads(path.read_text())["version"] == 2  # JSON, never a pickle
    b = CostBook(path, "fp")
    assert b.learned == a.learned and b.learned.load_cold.bytes_per_s == pytest.approx(1e9)
    assert b.learned.load_warm.bytes_per_s == pytest.approx(1e10)
    assert CostBook(path, "other-model").learned.prefill is None


def test_a_save_cut_short_leaves_a_temp_file_the_sweep_knows(tmp_path, monkeypatch):
    """A process killed between writing the costs' temp file and renaming it left
    ``.costs-….json.<pid>.new``, a name of its own that the cache dir's sweep of dead writers'
    temp files (:func:`verify.stale_temp`) did not know: it stayed for ever."""
    from tiered_kv.cold import backend, verify

    path = CostBook.file_for(tmp_path)
    book = CostBook(path, "fp")

    seen: list[Path] = []

    def killed(src, dst):  # the rename never happens: the writer died first
        seen.append(Path(src))
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", killed)
    book.observe_prefill(1000, 0, 0.5)  # saved at once (the first save is not throttled)
    book.save(force=True)
    monkeypatch.undo()
    tmp = seen[-1]
    assert backend.temp_writer(tmp.name) == os.getpid() and tmp.parent == path.parent
    tmp.write_text("{}")  # as the dead writer left it
    assert tmp in verify.temp_files(tmp_path)


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        '{"version": 1, "fingerprint": "fp", "observations": '
        '{"prefill": [[1, "x", 3]], "load": 5}}',
        "[]",
        "[" * 200_000,  # was a RecursionError out of the server's start (then an abort)
        "fifo",  # a FIFO planted there: its read waited for ever, so the server never started
        "link",  # a symlink: it was followed
    ],
)
def test_bad_file_starts_afresh(tmp_path, body):
    path = CostBook.file_for(tmp_path)
    if body == "fifo":
        os.mkfifo(path)
    elif body == "link":
        (tmp_path / "elsewhere.json").write_text('{"version": 2}')
        path.symlink_to(tmp_path / "elsewhere.json")
    else:
        path.write_text(body)
    book = CostBook(path, "fp")
    assert book.learned.prefill is None
    book.observe_prefill(100, 0, 0.1)
    book.save(force=True)
    assert CostBook(path, "fp").learned.prefill is not None


@pytest.mark.parametrize(
    "kind, row",
    [
        ("prefill", [64, -5, 0.01]),  # log2 of a negative context: the server did not start
        ("prefill", [1e300, 0, 1.0]),  # features overflow: "SVD did not converge", no start
        ("load", [1e308, 1e-300, 0]),
        ("outcome", [1, 1e306, 1.0]),  # log2(inf) at the next restore: the worker died
        ("outcome", [7, 1.0, 1.0]),
        ("load", [1000, 1.0, 5.0]),
        ("prefill", [10**400, 0, 1.0]),  # no float at all
        ("load", [1e15, 1e-300, 0]),  # an infinite rate: loads priced at 0 s, /metrics inf
        ("prefill", [1e8, 0, 1e-6]),
    ],
)
def test_rows_no_machine_makes_are_dropped_and_the_rest_kept(tmp_path, kind, row):
    """Finite but hostile rows got past the file check: they failed the server's start (a
    ValueError or LinAlgError out of the fit) or killed the engine worker at its next restore."""
    path = CostBook.file_for(tmp_path)
    good = [[1000, 0, 0.5], [2000, 0, 1.0]]
    obs = {"prefill": good + ([row] if kind == "prefill" else [])}
    if kind != "prefill":
        obs[kind] = [row]
    path.write_text(json.dumps({"version": 2, "fingerprint": "fp", "observations": obs}))
    book = CostBook(path, "fp")
    assert book.learned.prefill is not None and len(book.obs["prefill"]) == 2
    assert book.obs[kind] == ([] if kind != "prefill" else good)
    book.observe_outcome("both", float("inf"), 1.0)  # a plan priced at inf: ignored, no raise
    book.observe_outcome("load", 1e306, 1.0)
    book.observe_prefill(100, 2000, 0.1)
    assert book.learned.prefill is not None


def test_version_1_file_starts_afresh(tmp_path):
    """Version 1 priced the join per byte read, of the three-copy join: its rows would mislead."""
    path = CostBook.file_for(tmp_path)
    path.write_text('{"version": 1, "fingerprint": "fp", "observations": '
                    '{"prefill": [[1000, 0, 0.5]], "join": [[1000000000, 3.0]]}}')  # fmt: skip
    book = CostBook(path, "fp")
    assert book.learned.prefill is None and book.learned.join_bytes_per_s is None


def test_observations_stay_bounded_and_diverse():
    book = CostBook(None, "fp")
    for _ in range(500):
        book.observe_prefill(1000, 0, 0.5)
    book.observe_prefill(10, 0, 0.01)
    assert len(book.obs["prefill"]) == 4  # 3 of the repeated size, the new size kept


def test_heads_beside_their_reads_become_the_head_factor_and_persist(tmp_path):
    path = CostBook.file_for(tmp_path)
    book = CostBook(path, "fp")
    assert book.learned.head_factor is None  # no head seen: priced as alone
    assert book.learned.head_slower(0.0) == book.learned.head_slower(1.0) == 1.0
    for predicted, actual in ((0.04, 0.046), (0.08, 0.12), (1.0, 1.1)):
        book.observe_head(predicted, actual, 0.0)
    book.observe_head(0.0, 1.0)  # nothing predicted: no row
    book.save(force=True)
    again = CostBook(path, "fp")
    assert len(again.obs["head"]) == 3
    assert again.learned.head_factor == pytest.approx(1.15)
    assert again.stats()["head_factor"] == pytest.approx(1.15)
    quick = CostBook(None, "fp")
    quick.observe_head(1.0, 0.5)  # ran faster than alone: plans (and /metrics) price it as alone
    assert quick.learned.head_factor == 0.5 and quick.stats()["head_factor"] == 1.0


def test_heads_beside_warm_and_cold_reads_are_learned_apart(tmp_path):
    """The H100's heads: beside cold reads as alone (0.93-1.08x), beside warm ones 1.2-2.0x. One
    median over both priced a warm `both` at half its time; each kind now has its own, and a
    head whose read's share was not known counts as cold (as do rows of books written before the
    share was kept)."""
    path = CostBook.file_for(tmp_path)
    book = CostBook(path, "fp")
    for predicted, actual, warm in ((0.2, 0.2, 0.0), (0.8, 0.82, 0.0), (4.1, 4.4, 0.0),
                                    (0.07, 0.084, 1.0), (0.36, 0.55, 1.0), (1.0, 1.9, 0.9)):  # fmt: skip
        book.observe_head(predicted, actual, warm)
    book.observe_head(2.0, 2.0, None)
    le = book.learned
    assert le.head_factor == pytest.approx(1.0125) and le.head_factor_warm == pytest.approx(1.53, abs=0.01)
    assert book.stats()["head_factor_warm"] == pytest.approx(1.53, abs=0.01)
    book.save(force=True)
    raw = json.loads(path.read_text())
    raw["observations"]["head"].append([1.0, 3.0])  # a row of a book written before the share was kept
    path.write_text(json.dumps(raw))
    again = CostBook(path, "fp")
    assert again.learned.head_factor == pytest.approx(1.025)  # the old row counts as cold
    assert again.learned.head_factor_warm == le.head_factor_warm


def test_an_observation_is_fitted_and_saved_when_settled_not_when_made(tmp_path):
    """A restore observes its load (a `both` its head, read and join) before the request's first
    token: each observation refitted the book and the first one after a restart wrote its file,
    inside that TTFT. Now an observation is kept; it is fitted when a plan next reads the book
    (or at settle) and saved at settle, which the engine calls after the first token."""
    path = CostBook.file_for(tmp_path)
    book = CostBook(path, "fp")
    book.observe_load(10**8, 0.1, 0.0)
    assert not path.exists() and book.stats()["load_cold_gb_s"] == 0.0  # kept, not yet fitted
    assert book.learned.load_cold.bytes_per_s == pytest.approx(1e9)  # a plan reads it fitted
    book.observe_load(10**8, 0.01, 1.0)
    book.settle()
    assert path.exists() and book.stats()["load_warm_gb_s"] == pytest.approx(10.0)
    assert CostBook(path, "fp").learned == book.learned
