"""Check and repair a fingerprint directory: reconcile at open, full verify, quarantine.

Works on files and the index only (no model, no MLX), so the ``cache`` CLI can use it. Callers
serialise it with writes (the tier runs it on its writer thread).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tiered_kv import declared, keys
from tiered_kv.cold import backend, fsafe, scan, store
from tiered_kv.cold.index import Index
from tiered_kv.cold.rows import Record
from tiered_kv.prefix import entry_prompt_len

log = logging.getLogger(__name__)


@dataclass
class VerifyReport:
    fingerprint: str
    ok: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)  # files without an index record
    corrupt: list[str] = field(default_factory=list)  # short / truncated / checksum mismatch
    foreign: list[str] = field(default_factory=list)  # other fingerprint or format version
    missing: list[str] = field(default_factory=list)  # records whose file is gone
    temp: list[str] = field(default_factory=list)  # leftover temp files
    unreadable: list[str] = field(default_factory=list)  # could not be read (EACCES, EIO): kept

    @property
    def clean(self) -> bool:
        return not (self.orphans or self.corrupt or self.foreign or self.missing or self.temp)


def entry_files(fp_dir: Path) -> list[Path]:
    """Entry files: regular files only, a symlink is never read nor quarantined (its target may
    be anything, a model's weights)."""
    return [
        p for p in fsafe.regular_files(fp_dir, suffix=store.SUFFIX) if not p.name.startswith(".")
    ]


def temp_files(fp_dir: Path) -> list[Path]:
    return [p for p in fsafe.regular_files(fp_dir) if backend.is_temp(p.name)]


#: a temp file of a live process older than this is abandoned (no write takes that long)
TEMP_GRACE_SECONDS = 600.0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except (OverflowError, ValueError):
        return False
    return True


def stale_temp(path: Path, now: float | None = None, mine_stale: bool = False) -> bool:
    """A temp file (:func:`backend.temp_path`) whose writer is dead, or older than the grace period.
    A live writer's fresh temp file — another process sharing the directory — is never stale.
    ``mine_stale``: the caller's own writes are not in flight (at open, or the writer thread
    between writes), so one named with this process's id is a dead one's — a container's server
    restarts with the same pid (often 1) — unless another tier of this process sharing the
    directory is writing it now (:func:`backend.writing`)."""
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return False
    if age > TEMP_GRACE_SECONDS:
        return True
    pid = backend.temp_writer(path.name)
    if pid is None:
        return False  # not our naming: leave it to the grace period
    if pid == os.getpid():  # another tier of this process may be writing it right now
        return mine_stale and not backend.writing(path)
    return not pid_alive(pid)


def sweep_temp(fp_dir: Path) -> None:
    """Delete the stale temp files of ``fp_dir``; only while none of this process's writes is in
    flight (at open, or on the writer thread between writes)."""
    for tmp in temp_files(fp_dir):
        if stale_temp(tmp, mine_stale=True):
            tmp.unlink(missing_ok=True)


def quarantine(path: Path, qdir: Path, fingerprint: str) -> None:
    """Move ``path`` to ``qdir/<fingerprint>-<name>`` (0700 dir); a vanished file is fine. A
    symlinked ``qdir`` is refused (nothing moves out of the cache dir): the file is deleted."""
    try:
        fsafe.make_dir(qdir, store.DIR_MODE)
        os.replace(path, qdir / f"{fingerprint}-{path.name}")
    except FileNotFoundError:
        pass
    except OSError as e:  # cannot move (read-only fs...): try to delete so it is not re-read
        log.warning("cannot quarantine %s: %s", path, e)
        path.unlink(missing_ok=True)


def record_from_file(
    path: Path, fingerprint: str, seed: str, block_tokens: int
) -> tuple[Record, bytes]:
    """Rebuild an index record from a file's header and tokens (data checked later, on load)."""
    header = store.read_header(path, fingerprint)
    tokens = store.read_tokens(path, header)
    st = path.stat()
    created = float(header.metadata.get("created", st.st_mtime))
    blocks = tuple(keys.block_hashes(tokens, block_tokens, seed))
    prompt = store.prompt_of(header.metadata, len(tokens))
    pkey = keys.prompt_key(blocks, entry_prompt_len(len(tokens), prompt), block_tokens)
    serves = declared.serving(header.metadata)
    rec = Record(path.stem, path.name, len(tokens), st.st_size, created, st.st_mtime, blocks,
                 prompt, pkey, serves.trimmable, serves.checkpoints)  # fmt: skip
    return rec, tokens.tobytes()


def reconcile(
    fp_dir: Path, fingerprint: str, index: Index, qdir: Path, rebuild: bool, seed: str,
    block_tokens: int,
) -> dict[str, int]:  # fmt: skip
    """At open: remove stale temp files (dead writers only: other processes may share the
    directory); with ``rebuild`` index every valid file, otherwise check the records' columns
    ahead of their ids (:meth:`Index.files_by_id`: no ids blob is read), drop records whose file is
    gone and adopt orphan files (a crash between publish and commit, or another process's
    commit in flight: adopting twice is harmless, the entry id is the file name). Bad files are
    quarantined."""
    counts = {"quarantined": 0, "orphans": 0, "missing": 0, "rebuilt": 0}
    sweep_temp(fp_dir)
    # records before files: a record's file is published before its commit, so one listed here
    # was there when the files are listed after (another process may commit between the two)
    # (Damaged: the caller rebuilds; the rest of each row is checked where it is used)
    records = {} if rebuild else index.files_by_id()
    files = entry_files(fp_dir)
    if not rebuild:
        names = {p.name for p in files}
        missing = [eid for eid, file in records.items() if file not in names]
        index.remove(missing)
        counts["missing"] = len(missing)
        known = set(index.files_by_id().values())
        files = [p for p in files if p.name not in known]
        counts["orphans"] = len(files)
    items = []
    for path in files:
        try:
            rec, tokens = record_from_file(path, fingerprint, seed, block_tokens)
        except FileNotFoundError:
            continue  # superseded by another process meanwhile
        except (store.CorruptEntry, OSError) as e:
            log.warning("reconcile: quarantining %s: %s", path.name, e)
            quarantine(path, qdir, fingerprint)
            counts["quarantined"] += 1
            continue
        if len(rec.blocks) == 0:
            path.unlink(missing_ok=True)
            continue
        items.append((rec, tokens))
    if items:
        index.add_many(items)
    counts["rebuilt"] = len(items)
    counts["backfilled"] = 0 if rebuild else backfill_serving(fp_dir, fingerprint, index)
    return counts


def backfill_serving(fp_dir: Path, fingerprint: str, index: Index) -> int:
    """At an open for writing: give the rows an older version wrote, which do not say what the
    entry serves, what their file's header says — once, so that no lookup reads a header for them
    any more (:meth:`lookup.Finder._serving_of`, where a partial match depends on it). A header
    that cannot be read leaves its row as it is (a load finds the file so). The rows filled."""
    found = []
    for eid, file in index.unserved().items():
        try:
            header = store.read_header(fp_dir / Path(file).name, fingerprint)
        except (OSError, store.CorruptEntry):
            continue
        serves = declared.serving(header.metadata)
        found.append((eid, serves.trimmable, serves.checkpoints))
    if found:
        index.set_serving(found)
    return len(found)


def check_entry(path: Path, fingerprint: str, stored: np.ndarray | None) -> store.Header:
    """The whole check of one entry file: its header, every chunk digest (read in pieces: no
    arrays), its ids against ``stored`` (the index's; None: not compared). Its header; raises
    CorruptEntry / ForeignEntry, FileNotFoundError, OSError."""
    header = store.read_header(path, fingerprint)
    scan.check_data(path, header)
    if stored is not None and stored.tobytes() != store.read_tokens(path, header).tobytes():
        raise store.CorruptEntry("tokens differ from the index")
    return header


def verify_dir(
    fp_dir: Path, fingerprint: str, index: Index | None, qdir: Path, fix: bool = False
) -> VerifyReport:
    """Full check: every file's header and data checksum, tokens against the index."""
    report = VerifyReport(fingerprint)
    by_file = {r.file: r for r in index.records()} if index is not None else {}
    report.temp = [p.name for p in temp_files(fp_dir) if stale_temp(p)]
    files = entry_files(fp_dir)
    names = {p.name for p in files}
    report.missing = [r.file for r in by_file.values() if r.file not in names]
    bad: list[Path] = []
    for path in files:
        try:
            rec = by_file.get(path.name)
            stored = None
            if rec is not None and index is not None:
                stored = index.tokens(rec.entry_id)
                if stored is None:
                    raise store.CorruptEntry("tokens differ from the index")
            check_entry(path, fingerprint, stored)
        except FileNotFoundError:
            continue  # superseded / evicted by a running process meanwhile
        except store.ForeignEntry:
            report.foreign.append(path.name)
            bad.append(path)
            continue
        except store.CorruptEntry:
            report.corrupt.append(path.name)
            bad.append(path)
            continue
        except OSError:  # not known to be bad: never moved
            report.unreadable.append(path.name)
            continue
        (report.ok if path.name in by_file or index is None else report.orphans).append(path.name)
    if fix:
        _fix(fp_dir, fingerprint, index, qdir, report, bad, by_file)
    return report


def _fix(
    fp_dir: Path, fingerprint: str, index: Index | None, qdir: Path, report: VerifyReport,
    bad: list[Path], by_file: dict[str, Record],
) -> None:  # fmt: skip
    if index is not None:
        drop = [by_file[n].entry_id for n in report.missing]
        drop += [by_file[p.name].entry_id for p in bad if p.name in by_file]
        index.remove(drop)  # index first, then files
    for path in bad:
        quarantine(path, qdir, fingerprint)
    now = time.time()
    for name in report.orphans:  # a young orphan may be a running process's commit in flight
        p = fp_dir / name
        try:
            if now - p.stat().st_mtime > TEMP_GRACE_SECONDS:
                p.unlink()
        except FileNotFoundError:
            pass
    for name in report.temp:  # only stale temp files: a live writer may own a fresh one
        if stale_temp(fp_dir / name):
            (fp_dir / name).unlink(missing_ok=True)
