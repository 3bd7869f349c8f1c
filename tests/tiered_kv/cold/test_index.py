"""tiered_kv/cold/index.py: plain sqlite, nothing unpickled, refused when others can write it."""

from __future__ import annotations

import os
import pickle
import sqlite3
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tests.fixtures import INDEX_BEFORE_ADDED_COLUMNS
from tiered_kv import keys
from tiered_kv.cold.dbfile import UnsafeCacheDir
from tiered_kv.cold.index import Index
from tiered_kv.cold.rows import Damaged, Record
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config

FP = "0123456789abcdef0123456789abcdef"


def kv(n: int) -> C.KVCache:
    c = C.KVCache()
    c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    return c


def make_tier(root: Path) -> ColdTier:
    return ColdTier(root, FP, Config(cache_dir=root, block_tokens=16))


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # runs on unpickling


def _plant_diskcache_index(db: Path, marker: Path) -> None:
    """The index format before issue 12: diskcache tables with pickled values (a planted
    ``("meta",)`` record ran code on `serve` and `cache stats`)."""
    for p in db.parent.glob("cache.db*"):
        p.unlink()
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE Cache (rowid INTEGER PRIMARY KEY, key BLOB, raw INTEGER, "
                "store_time REAL, expire_time REAL, access_time REAL, access_count INTEGER, "
                "tag BLOB, size INTEGER, mode INTEGER, filename TEXT, value BLOB)")  # fmt: skip
    evil = pickle.dumps(_Payload(marker))
    con.execute("INSERT INTO Cache(key, raw, mode, value) VALUES(?, 0, 4, ?)",
                (pickle.dumps(("meta",)), evil))  # fmt: skip
    con.commit()
    con.close()
    os.chmod(db, 0o600)


def test_planted_pickles_never_run_on_open_or_cache_stats(tmp_path):
    root = tmp_path / "kv"
    tier = make_tier(root)
    tier.persist(np.arange(32), [kv(32)])
    tier.close()
    marker = tmp_path / "owned"
    _plant_diskcache_index(tier.dir / "index" / "cache.db", marker)
    env = {**os.environ, "TIERED_KV_DIR": str(root)}
    for cmd in ("stats", "ls", "verify"):
        r = subprocess.run([sys.executable, "-m", "engine.cli", "cache", cmd], env=env,
                           capture_output=True, text=True, timeout=120)  # fmt: skip
        assert "Traceback" not in r.stderr, r.stderr
    assert not marker.exists()
    tier = make_tier(root)  # foreign index: rebuilt from the files beside it, then swapped in
    assert not marker.exists()
    assert tier.stats()["entries"] == 1 and tier.lookup(np.arange(32)) is not None
    tier.close()


@pytest.mark.parametrize("what", ["root", "fingerprint_dir", "index_dir", "index_file"])
def test_cache_dir_or_index_writable_by_others_is_refused(tmp_path, what):
    root = tmp_path / "kv"
    make_tier(root).close()
    target = {"root": root, "fingerprint_dir": root / FP, "index_dir": root / FP / "index",
              "index_file": root / FP / "index" / "cache.db"}[what]  # fmt: skip
    os.chmod(target, 0o777 if target.is_dir() else 0o666)
    with pytest.raises(UnsafeCacheDir, match="writable by other users"):
        make_tier(root)
    env = {**os.environ, "TIERED_KV_DIR": str(root)}
    r = subprocess.run([sys.executable, "-m", "engine.cli", "cache", "stats"], env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode != 0 and len(lines) == 1 and "writable by other users" in lines[0], r


def test_symlinked_index_dir_is_replaced_not_followed(tmp_path):
    root = tmp_path / "kv"
    tier = make_tier(root)
    tier.persist(np.arange(32), [kv(32)])
    tier.close()
    elsewhere = tmp_path / "elsewhere"
    os.replace(root / FP / "index", elsewhere)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    os.symlink(elsewhere, root / FP / "index")
    tier = make_tier(root)  # the link is removed; a fresh index is rebuilt from the files
    assert not (root / FP / "index").is_symlink() and tier.lookup(np.arange(32)) is not None
    tier.close()
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before


def test_lookup_queries_find_the_deepest_newest_entry_and_prefixes(tmp_path):
    index = Index(tmp_path / "index")
    seed = "s:4"

    def add(eid: str, toks: list[int], when: float) -> None:
        blocks = tuple(keys.block_hashes(toks, 4, seed))
        rec = Record(eid, f"{eid}.safetensors", len(toks), 1, when, when, blocks)
        index.add(rec, np.asarray(toks, "<i4").tobytes())

    base = list(range(100, 116))
    add("short", base[:8], 1)
    add("long", base, 2)
    add("other", base[:4] + [7] * 12, 3)
    probe = keys.block_hashes(base + [1, 2, 3, 4], 4, seed)
    assert list(index.candidates(probe))[0] == ("long", 4)
    assert {r.entry_id for r in index.covered_by(probe)} == {"short", "long"}
    assert index.summary() == (3, 3)
    gone = index.remove(["long"])
    assert [r.entry_id for r in gone] == ["long"] and index.get("long") is None
    assert list(index.candidates(probe))[0] == ("short", 2)
    index.close()


def test_symlinked_index_file_is_never_followed(tmp_path):
    root = tmp_path / "kv"
    make_tier(root).close()
    db = root / FP / "index" / "cache.db"
    target = tmp_path / "victim.db"
    target.write_bytes(b"precious")
    for p in db.parent.glob("cache.db*"):
        p.unlink()
    os.symlink(target, db)
    make_tier(root).close()
    assert target.read_bytes() == b"precious" and not db.is_symlink()


def _index_before_prompt_columns(path: Path) -> None:
    """An index as schema 2 first made it: no prompt_tokens / prompt_key columns."""
    path.mkdir(mode=0o700)
    con = sqlite3.connect(path / "cache.db")
    con.executescript(INDEX_BEFORE_ADDED_COLUMNS)
    con.commit()
    con.close()
    os.chmod(path / "cache.db", 0o600)


def test_an_index_made_before_the_prompt_columns_reads_and_gains_them(tmp_path):
    """Read-only it reads as before (prompt not known); opened for writing it gains the columns
    (NULL for the old rows) and finds entries by their prompt's last block."""
    _index_before_prompt_columns(tmp_path / "index")
    ro = Index(tmp_path / "index", readonly=True)
    assert [(r.entry_id, r.prompt_tokens) for r in ro.records()] == [("old", None)]
    assert ro.covered_by([1, 2, 3]) == []
    ro.close()
    index = Index(tmp_path / "index")
    assert index.get("old") is not None and index.get("old").prompt_tokens is None
    toks = list(range(100, 120))
    blocks = tuple(keys.block_hashes(toks, 4, "s:4"))
    pkey = keys.prompt_key(blocks, 13, 4)
    assert pkey == blocks[2]
    index.add(Record("new", "new.safetensors", 20, 1, 2, 2, blocks, 13, pkey), b"\0" * 80)
    assert index.get("new").prompt_tokens == 13
    resent = keys.block_hashes(toks[:12] + [5] * 8, 4, "s:4")  # diverges after the prompt's blocks
    assert [r.entry_id for r in index.covered_by(resent)] == ["new"]
    assert index.covered_by(keys.block_hashes(toks[:8] + [5] * 12, 4, "s:4")) == []
    index.close()
    again = Index(tmp_path / "index")  # a second open adds nothing twice
    assert {r.entry_id for r in again.records()} == {"old", "new"}
    again.close()


def test_what_an_entry_serves_is_kept_and_not_known_for_older_rows(tmp_path):
    """``trimmable`` / ``checkpoints`` round-trip; a row an older version wrote (or a read-only
    index made before the columns) reads as not known; a value no writer makes is Damaged."""
    _index_before_prompt_columns(tmp_path / "index")
    ro = Index(tmp_path / "index", readonly=True)
    old = ro.stored("old")
    assert old is not None and old.trimmable is None and old.checkpoints == () and len(old.tokens) == 8
    ro.close()
    index = Index(tmp_path / "index")
    assert index.stored("old").trimmable is None and index.stored("gone") is None
    blocks = tuple(keys.block_hashes(list(range(16)), 4, "s:4"))
    index.add(Record("w", "w.safetensors", 16, 1, 2, 2, blocks, None, None, False, (8, 12)), b"\0" * 64)
    index.add(Record("t", "t.safetensors", 16, 1, 3, 3, blocks, None, None, True), b"\0" * 64)
    assert (index.stored("w").trimmable, index.stored("w").checkpoints) == (False, (8, 12))
    assert (index.stored("t").trimmable, index.stored("t").checkpoints) == (True, ())
    with sqlite3.connect(tmp_path / "index" / "cache.db") as con:
        con.execute("UPDATE entries SET checkpoints='[8, \"x\"]' WHERE id='w'")
    con.close()
    with pytest.raises(Damaged):
        index.stored("w")
    index.close()


@pytest.mark.parametrize("ids", ["x'0000000001'", "'text'"])
def test_token_ids_that_are_no_whole_int32s_are_damaged_not_a_numpy_error(tmp_path, ids):
    """A tokens column of text or of a length that is no multiple of 4 escaped a lookup (and
    ``cache verify``) as numpy's ValueError / TypeError instead of Damaged; ``check`` finds it."""
    index = Index(tmp_path / "index")
    blocks = tuple(keys.block_hashes(list(range(8)), 4, "s:4"))
    index.add(Record("e", "e.safetensors", 8, 1, 2, 2, blocks, None, None, True), b"\0" * 32)
    index.check()
    with sqlite3.connect(tmp_path / "index" / "cache.db") as con:
        con.execute(f"UPDATE entries SET tokens={ids}")
    con.close()
    for read in (lambda: index.tokens("e"), lambda: index.stored("e"), index.check):
        with pytest.raises(Damaged, match="token ids"):
            read()
    index.close()


def test_candidates_skip_excluded_entries_for_the_next_newest_holder(tmp_path):
    index = Index(tmp_path / "index")
    toks = list(range(100, 116))
    for i, eid in enumerate(("older", "newer")):
        blocks = tuple(keys.block_hashes(toks[: 8 + 4 * i], 4, "s:4"))
        index.add(Record(eid, f"{eid}.safetensors", 8 + 4 * i, 1, i, i, blocks), b"\0" * 4 * (8 + 4 * i))
    probe = keys.block_hashes(toks, 4, "s:4")
    assert list(index.candidates(probe)) == [("newer", 3)]  # newest holder of every block
    assert list(index.candidates(probe, {"newer"})) == [("older", 2)]
    assert list(index.candidates(probe, {"newer", "older"})) == []
    index.close()


def _linear_candidates(index: Index, probe: list, exclude: set[str]) -> list[tuple[str, int]]:
    """The candidates by their definition: each block's newest holder, deepest first, distinct."""
    out: list[tuple[str, int]] = []
    for d in range(len(probe), 0, -1):
        eid = index._newest_holder(probe[d - 1], sorted(exclude))
        if eid is not None and eid not in {e for e, _ in out}:
            out.append((eid, d))
    return out[:4]


def test_candidates_are_each_blocks_newest_holder_deepest_first(tmp_path):
    """Entries branching off one prompt at many depths, added in a shuffled order, some excluded:
    the candidates are, deepest first, the newest holder of each block (what a walk of one query
    per block finds)."""
    index = Index(tmp_path / "index")
    rng = np.random.default_rng(5)
    base = list(range(1000, 1000 + 4 * 40))
    order = rng.permutation(12)
    for when, i in enumerate(order):
        cut = int(rng.integers(1, 40)) * 4
        toks = base[:cut] + [int(i)] * 4
        blocks = tuple(keys.block_hashes(toks, 4, "s:4"))
        index.add(Record(f"e{i}", f"e{i}.safetensors", len(toks), 1, when, when, blocks),
                  np.asarray(toks, "<i4").tobytes())  # fmt: skip
    probe = keys.block_hashes(base, 4, "s:4")
    for exclude in (set(), {"e3"}, {"e0", "e5", "e7"}):
        want = _linear_candidates(index, probe, exclude)
        assert list(index.candidates(probe, exclude)) == want and want, exclude
    index.close()


def test_candidates_past_an_entry_take_a_few_queries_not_one_per_block(tmp_path):
    """Past the first candidate (a lookup whose entry cannot be cut back asks for more), the walk
    queried the index once per block of the prompt: 2000 queries for a 32k-token prompt in
    16-token blocks, 10 ms. Where the newest holder changes is found by binary search."""
    index = Index(tmp_path / "index")
    toks = list(range(2048))
    blocks = tuple(keys.block_hashes(toks, 4, "s:4"))
    index.add(Record("one", "one.safetensors", len(toks), 1, 1, 1, blocks),
              np.asarray(toks, "<i4").tobytes())  # fmt: skip
    queries: list[str] = []
    index._conn().set_trace_callback(queries.append)
    assert list(index.candidates(list(blocks))) == [("one", 512)]
    assert list(index.candidates(list(blocks), {"one"})) == []
    index._conn().set_trace_callback(None)
    assert len(queries) < 60, len(queries)  # log2(512) per search: 4 of them
    index.close()


def test_prompt_key_is_the_last_full_block_inside_the_prompt():
    blocks = [keys.BlockHash(k) for k in (11, 22, 33)]
    assert keys.prompt_key(blocks, 12, 4) == 33  # every id was prompt
    assert keys.prompt_key(blocks, 9, 4) == 22
    assert keys.prompt_key(blocks, 8, 4) == 22
    assert keys.prompt_key(blocks, 3, 4) is None  # shorter than a block
    assert keys.prompt_key(blocks, 40, 4) == 33
    assert keys.prompt_key([], 3, 4) is None


def test_read_only_where_the_path_holds_uri_characters(tmp_path):
    """The read-only index is opened by URI: a cache dir named with ``#``, ``?`` or ``%41`` opened
    another file (or none), so `tiered-kv cache` said "index missing" and verify could not check."""
    for name in ("a#b", "c?d", "e%41f", "g h"):
        path = tmp_path / name / "index"
        Index(path).add(Record("x", "x.safetensors", 8, 1, 1, 1, (1, 2), None, None), b"\0" * 32)
        ro = Index(path, readonly=True, create=False)
        assert [r.entry_id for r in ro.records()] == ["x"], name
        ro.close()


def _sums(index: Index) -> tuple[int, int]:
    """(entries, bytes) summed over the records, as the budget did before every write."""
    recs = index.records()
    return len(recs), sum(r.nbytes for r in recs)


def test_the_totals_row_follows_every_change_and_an_older_index_gains_it(tmp_path):
    """The budget summed every record before each write (its cost grew with the entries); it
    reads one row the index's triggers keep now. It follows adds, replacements, removals and a
    cleared index; an index made before it (an older build) gains it, counted, when opened for
    writing, and one opened read-only sums the rows as before."""
    index = Index(tmp_path / "index")
    index.claim_meta({"schema": 2})
    for i in range(5):
        index.add(Record(f"e{i}", f"e{i}.safetensors", 8, 100 + i, i, i), b"\0" * 32)
    index.add(Record("e1", "e1.safetensors", 8, 7, 9, 9), b"\0" * 32, remove=["e2", "nope"])
    index.add_many([(Record(f"m{i}", f"m{i}.safetensors", 8, 1000, 1, 1), b"\0" * 32)
                    for i in range(3)])  # fmt: skip
    index.remove(["e3"])
    assert index.summary() == _sums(index) == (6, 100 + 7 + 104 + 3000)
    conn = sqlite3.connect(tmp_path / "index" / "cache.db")
    conn.executescript("DROP TABLE totals; DROP TRIGGER totals_insert; DROP TRIGGER totals_delete;"
                       "DROP TRIGGER totals_update")  # fmt: skip
    conn.close()
    index.close()
    ro = Index(tmp_path / "index", readonly=True)
    assert ro.summary() == _sums(ro)
    ro.close()
    index = Index(tmp_path / "index")
    assert index.summary() == _sums(index) == (6, 3211)
    index.add(Record("x", "x.safetensors", 8, 5, 9, 9), b"\0" * 32)
    assert index.summary() == (7, 3216)
    assert index.claim_meta({"schema": 3}) and index.summary() == (0, 0)
    index.close()


def test_a_row_of_malformed_bytes_makes_the_totals_damaged(tmp_path):
    index = Index(tmp_path / "index")
    index.add(Record("a", "a.safetensors", 8, 100, 1, 1), b"\0" * 32)
    conn = sqlite3.connect(tmp_path / "index" / "cache.db")
    conn.execute("UPDATE entries SET nbytes='12 MB'")
    conn.commit()
    with pytest.raises(Damaged):
        index.summary()
    conn.execute("UPDATE entries SET nbytes=50")
    conn.commit()
    conn.close()
    assert index.summary() == (1, 50)
    index.close()
