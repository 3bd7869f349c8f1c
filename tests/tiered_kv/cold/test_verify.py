"""tiered_kv/cold/verify.py: reconcile at open, full verify and its fix (through the tier)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from tests.fixtures import BLOCK, TIER_FP, cold_tier, damage_index, dead_pid, flip_byte, kv_cache
from tiered_kv import keys
from tiered_kv.cold import verify
from tiered_kv.cold.index import Index
from tiered_kv.cold.rows import Record


def test_reopen_reconciles_orphans_and_missing_files(tmp_path):
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.persist(np.arange(8) + 50, [kv_cache(8)])
    tier.close()
    files = sorted(tier.dir.glob("*.safetensors"))
    files[0].unlink()
    (tier.dir / "stray.safetensors").write_bytes(b"x")
    (tier.dir / f".partial.{dead_pid()}.tmp").write_bytes(b"x")
    tier = cold_tier(tmp_path)
    assert tier.stats()["entries"] == 1
    assert {p.name for p in tier.dir.iterdir()} == {"index", files[1].name}
    assert tier.verify().clean
    tier.close()


def test_verify_reports_and_fixes(tmp_path):
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.persist(np.arange(8) + 50, [kv_cache(8)])
    a, b = sorted(tier.dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
    flip_byte(b, b.stat().st_size - 1)
    report = tier.verify()
    assert report.corrupt == [b.name] and report.ok == [a.name] and not report.clean
    report = tier.verify(fix=True)
    assert tier.verify().clean and tier.stats()["entries"] == 1
    tier.close()


def test_a_second_opener_between_publish_and_commit_loses_nothing(tmp_path, monkeypatch):
    """Another process opens the directory just after the writer published its file and before
    its index commit: it adopts the file (same id). The writer's commit took its own adopted
    record for an older entry it supersedes, removed it and deleted the file it had just written."""
    a = cold_tier(tmp_path)
    put = a.site.backend.put

    def put_then_open(key, entry):
        n = put(key, entry)
        cold_tier(tmp_path).close()  # a second server starting on the same directory
        return n

    monkeypatch.setattr(a.site.backend, "put", put_then_open)
    ids = np.arange(40)
    a.persist(ids, [kv_cache(40)])
    assert [p.name for p in a.dir.glob("*.safetensors")] == [r.file for r in a.index.records()]
    hit = a.lookup(list(ids) + [1])
    assert hit is not None and a.load(hit) is not None
    a.close()


def test_a_commit_while_another_process_opens_keeps_its_record(tmp_path, monkeypatch):
    """Reconcile listed the files, then read the records: an entry another process published and
    committed between the two looked like a record whose file is gone, and was dropped."""
    from tiered_kv.cold import verify

    a = cold_tier(tmp_path)
    listed = verify.entry_files

    def list_then_commit(fp_dir):
        files = listed(fp_dir)
        if not a.index.records():
            a.persist(np.arange(40), [kv_cache(40)])  # the other process writes meanwhile
        return files

    monkeypatch.setattr(verify, "entry_files", list_then_commit)
    b = cold_tier(tmp_path)
    assert b.stats()["entries"] == 1 and len(a.index.records()) == 1
    assert a.lookup(list(range(40)) + [1]) is not None
    a.close()
    b.close()


def test_verify_reports_an_unreadable_file_and_never_moves_it(tmp_path, monkeypatch):
    """A file verify could not read (EACCES, EIO) was "corrupt", and ``--fix`` quarantined it."""
    import errno
    import os

    from tiered_kv.cold import fsafe

    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    [path] = tier.dir.glob("*.safetensors")
    real = fsafe.open_nofollow

    def refusing(p, flags, mode=0o600):
        if p == path:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(p))
        return real(p, flags, mode)

    monkeypatch.setattr(fsafe, "open_nofollow", refusing)
    report = tier.verify(fix=True)
    assert report.unreadable == [path.name] and report.corrupt == [] and path.exists()
    tier.close()


def test_a_dead_writers_temp_file_named_with_our_pid_is_swept(tmp_path):
    """A server in a container restarts with the pid of the one killed mid-write (often 1): its
    temp file looked like a live writer's (ours), was kept at open and counted against the
    budget for good. At open and before each write none of ours is in flight: it is stale."""
    import os

    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    tier.close()
    planted = tier.dir / f".x.safetensors.{os.getpid()}.tmp"
    planted.write_bytes(b"x" * 1000)
    tier = cold_tier(tmp_path)
    assert not planted.exists()
    planted.write_bytes(b"x" * 1000)  # killed again while this one serves: swept at the next write
    tier.persist(np.arange(8) + 50, [kv_cache(8)])
    assert not planted.exists() and tier.stats()["spills"] == 1
    tier.close()


def test_another_tier_of_this_process_keeps_a_temp_file_being_written(tmp_path):
    """Two tiers of one process on one directory (a re-open before the old tier's last write
    ended, a library user with two caches): each took the other's temp file in flight, named
    with the same pid, for a dead writer's and swept it at its open or before its writes — the
    other's publish then failed (ENOENT) and the entry was lost (half the writes of two busy
    tiers). A temp file this process is writing now is never stale."""
    from tiered_kv.cold import encode
    from tiered_kv.cold.backend import FileBackend

    cold_tier(tmp_path).close()
    fp_dir = next(p for p in tmp_path.iterdir() if p.name != "quarantine")
    opened = []

    def pieces():
        yield memoryview(b"x" * 64)
        other = cold_tier(tmp_path)  # its open sweeps the stale temp files
        other.persist(np.arange(8), [kv_cache(8)])  # and so does each of its writes
        opened.append(other.stats()["spills"])
        other.close()
        yield memoryview(b"y" * 64)

    FileBackend(fp_dir).put("k" * 32, encode.Encoded(pieces(), 128))
    assert opened == [1] and (fp_dir / f"{'k' * 32}.safetensors").stat().st_size == 128


def test_a_writer_in_another_pid_namespace_keeps_its_temp_file(tmp_path):
    """Two servers in two containers (two PID namespaces) sharing one cache directory: each took
    the other's temp file in flight for a dead writer's — its pid does not exist, or is its own
    pid 1 — and swept it, so about half the writes of two busy servers failed (ENOENT at the
    publish). A temp name now says where its pid means something; elsewhere only its age does."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from tiered_kv.cold import encode
    from tiered_kv.cold.backend import FileBackend

    if shutil.which("unshare") is None or subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True
    ).returncode:
        pytest.skip("needs unshare --pid (root, or a user namespace)")
    cold_tier(tmp_path).close()
    fp_dir = next(p for p in tmp_path.iterdir() if p.name != "quarantine")
    script = ("from pathlib import Path; from tests.fixtures import cold_tier;"
              f"cold_tier(Path({str(tmp_path)!r})).close()")  # fmt: skip
    swept = []

    def pieces():
        yield memoryview(b"x" * 64)
        out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                              script], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).parents[3])  # fmt: skip
        swept.append((out.returncode, out.stderr[-2000:]))
        yield memoryview(b"y" * 64)

    FileBackend(fp_dir).put("k" * 32, encode.Encoded(pieces(), 128))
    assert swept[0][0] == 0, swept
    assert (fp_dir / f"{'k' * 32}.safetensors").stat().st_size == 128


def _rchar() -> int:
    """Bytes this process has read through read(2) / pread(2) so far (page cache hits too)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="Linux /proc/self/io only")
def test_the_open_reads_no_ids_blob(tmp_path):
    """The open's check read every row, its ids blob too (``Index.check``, and the records'
    ``prompt_tokens``, which sits after the blob, walks its overflow pages): opening 10k entries
    of 2k tokens read 102 MB in 0.45 s. It checks the columns ahead of the ids now, so an open
    of 200 entries of 32 KiB ids reads less than a quarter of them."""
    tier = cold_tier(tmp_path)
    rng = np.random.default_rng(0)
    batch = []
    for i in range(200):
        toks = rng.integers(0, 50_000, 8192, dtype=np.int32)
        (tier.dir / f"e{i}.safetensors").touch()  # the open lists files, never reads them
        blocks = tuple(keys.block_hashes(toks, BLOCK, tier.seed))
        batch.append((Record(f"e{i}", f"e{i}.safetensors", len(toks), 0, i, i, blocks[:4],
                             trimmable=True), toks.tobytes()))  # fmt: skip
    tier.index.add_many(batch)
    tier.close()
    blobs = 200 * 8192 * 4
    before = _rchar()
    index = Index(tier.dir / "index")  # its own connection: nothing of it cached yet
    counts = verify.reconcile(tier.dir, TIER_FP, index, tier.site.quarantine_dir, False,
                              tier.seed, BLOCK)  # fmt: skip
    read = _rchar() - before
    assert counts["missing"] == 0 and counts["orphans"] == 0
    assert read < blobs / 4, (read, blobs)
    index.close()


def test_a_damaged_ids_blob_in_a_big_index_is_caught_when_used_and_never_served(tmp_path):
    """The open no longer reads every row's ids: a blob no writer of ours makes (an odd length)
    among 24 entries is found by the lookup that reaches it — counted once as an index error, a
    miss, never served — and the index is rebuilt from the files; the other entries serve."""
    tier = cold_tier(tmp_path)
    for i in range(24):
        tier.persist(np.arange(16) + 100 * i, [kv_cache(16)])
    assert tier.flush(30)
    bad = tier.lookup(list(range(16)) + [1])
    tier.close()
    damage_index(tier, "UPDATE entries SET tokens = tokens || x'00' WHERE id = ?", bad.entry_id)
    tier = cold_tier(tmp_path)
    assert tier.stats()["index_errors"] == 0 and tier.stats()["entries"] == 24  # opened as it is
    other = tier.lookup(list(range(300, 316)) + [1])
    assert other is not None and tier.load(other) is not None  # the damaged row is not read
    assert tier.lookup(list(range(16)) + [1]) is None  # found: a miss
    assert tier.flush(30)
    assert tier.stats()["index_errors"] == 1, tier.stats()
    hit = tier.lookup(list(range(16)) + [1])  # rebuilt from the files
    assert hit is not None and hit.serves == 16 and tier.load(hit) is not None
    assert tier.stats()["index_errors"] == 1 and tier.stats()["entries"] == 24
    tier.close()


def test_rows_an_older_version_wrote_say_what_they_serve_after_an_open_for_writing(tmp_path):
    """A row an older version wrote does not say what its entry serves (trimmable, checkpoints
    NULL): every lookup whose answer depended on it read the file's header, at every use, for
    ever. The open for writing fills them in from the headers, once; a row whose file cannot be
    read stays as it is."""
    from mlx_lm.models.cache import RotatingKVCache

    from tiered_kv import checkpoints

    def windowed(n: int) -> list:
        window = RotatingKVCache(max_size=8)
        x = mx.random.normal((1, 2, n, 8))
        window.update_and_fetch(x, x)
        return [kv_cache(n), window]

    tier = cold_tier(tmp_path)
    tier.persist(np.arange(16), windowed(16), {p: checkpoints.snapshot(windowed(p)) for p in (8, 12)})
    tier.persist(np.arange(16) + 100, [kv_cache(16)])
    tier.persist(np.arange(16) + 200, [kv_cache(16)])
    assert tier.flush(30)
    ids = {k: tier.lookup(list(range(k, k + 16)) + [1]).entry_id for k in (0, 100, 200)}
    tier.close()
    damage_index(tier, "UPDATE entries SET trimmable=NULL, checkpoints=NULL")  # an older writer's
    flip_byte(tier.dir / f"{ids[200]}.safetensors", 10)  # its header: unreadable
    tier = cold_tier(tmp_path)
    served = {k: tier.index.stored(eid) for k, eid in ids.items()}
    assert (served[0].trimmable, served[0].checkpoints) == (False, (8, 12))
    assert (served[100].trimmable, served[100].checkpoints) == (True, ())
    assert served[200].trimmable is None  # left as it was: its load finds the file corrupt
    hit = tier.lookup(list(range(14)) + [99] * 4)
    assert hit is not None and (hit.tokens, hit.serves) == (14, 12)
    tier.close()
