"""tiered_kv/cold/loads.py: the read path through ColdTier: damaged, foreign, unreadable and
resized files, a wrong index row, recent()."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from tests.fixtures import (
    cold_tier,
    damage_index,
    entry_file,
    flip_byte,
    kv_cache,
    rewrite_meta,
)
from tiered_kv.cold import checksums, store


@pytest.mark.parametrize("damage", ["truncate", "header_flip", "data_flip", "version", "random"])
def test_damaged_file_is_a_miss_and_quarantined(tmp_path, damage):
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    path = entry_file(tier)
    hdr_len = int.from_bytes(path.read_bytes()[:8], "little")
    if damage == "truncate":
        os.truncate(path, path.stat().st_size - 7)
    elif damage == "header_flip":
        flip_byte(path, 8 + hdr_len // 2)
    elif damage == "data_flip":
        flip_byte(path, path.stat().st_size - 3)
    elif damage == "version":
        rewrite_meta(path, format_version="0")
    else:
        path.write_bytes(os.urandom(300))
    hit = tier.lookup(list(range(8)))
    assert hit is not None
    assert tier.load(hit) is None
    assert tier.stats()["quarantined"] == 1 and tier.stats()["entries"] == 0
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    assert tier.lookup(list(range(8))) is None
    tier.close()


def _as_format_2(path) -> None:
    """Rewrite a format-3 entry file the way format 2 wrote it: every tensor head-major (its
    logical shape), no ``token_major`` list, digests over those bytes, ``format_version`` "2"."""
    import json
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = store.parse_buffer(memoryview(raw))
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    data, sums, off = [], {}, 0
    for name in sorted(head, key=lambda k: head[k]["data_offsets"][0]):
        a, z = head[name]["data_offsets"]
        b = raw[8 + n + a : 8 + n + z]
        if name in header.token_major:
            stored = np.frombuffer(b, np.uint8).reshape(*head[name]["shape"][:3], -1)
            b = np.ascontiguousarray(stored.swapaxes(1, 2)).tobytes()
        head[name] = {**head[name], "shape": list(header.shape(name)), "data_offsets": [off, off + len(b)]}
        sums[name] = checksums.chunk_digests([memoryview(b)], header.chunk_bytes)
        data.append(b)
        off += len(b)
    del meta["token_major"]
    meta.update(format_version="2", xxh3=json.dumps(sums, separators=(",", ":")))
    new = store.header_bytes(head, meta)
    path.write_bytes(struct.pack("<Q", len(new)) + new + b"".join(data))


def test_a_format_2_file_is_a_miss_not_an_error(tmp_path):
    """Format 2 (head-major tensors) is refused as foreign: a miss, quarantined; `verify` lists it
    as foreign (a file in an old fingerprint dir is the same; FORMAT_VERSION is in the key)."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    path = entry_file(tier)
    _as_format_2(path)
    with pytest.raises(store.ForeignEntry, match="format version '2'"):
        store.read_header(path, tier.fingerprint)
    report = tier.verify()
    assert report.foreign == [path.name] and not report.corrupt
    hit = tier.lookup(list(range(8)))
    assert hit is not None and tier.load(hit) is None
    assert tier.stats()["quarantined"] == 1 and tier.lookup(list(range(8))) is None
    tier.close()


def test_file_of_another_fingerprint_is_refused(tmp_path):
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    rewrite_meta(entry_file(tier), fingerprint="someone-else")
    with pytest.raises(store.ForeignEntry):
        store.read_header(entry_file(tier), tier.fingerprint)
    assert tier.load(tier.lookup(list(range(8)))) is None
    assert tier.stats()["quarantined"] == 1
    tier.close()


def test_recent_lists_most_recently_used(tmp_path):
    tier = cold_tier(tmp_path)
    for i in range(3):
        tier.persist(np.arange(8) + 100 * i, [kv_cache(8)])
    tier.load(tier.lookup(list(range(8))))
    got = tier.recent(2, 0)
    assert [h.tokens for h in got] == [8, 8] and got[0].entry_id == tier.lookup(range(8)).entry_id
    assert tier.recent(0, 0) == [] and len(tier.recent(0, 10**9)) == 3
    tier.close()


def test_recent_sees_a_load_whose_touch_commits_while_it_reads(tmp_path):
    """recent() read the records, then copied the touches not yet committed: a touch that
    committed in between was in neither, and the entry just loaded was not listed first (a
    flake of the test above on a busy machine). The index read is slowed to make it certain."""
    tier = cold_tier(tmp_path)
    for i in range(3):
        tier.persist(np.arange(8) + 100 * i, [kv_cache(8)])
    index = tier.site.index
    records = index.records

    def slow_records():
        out = records()
        time.sleep(0.3)  # the writer commits the load's touch meanwhile
        return out

    index.records = slow_records  # type: ignore[method-assign]
    tier.load(tier.lookup(list(range(8))))
    got = tier.recent(1, 0)
    assert got[0].entry_id == tier.lookup(range(8)).entry_id
    tier.close()


def test_a_fifo_planted_at_an_entry_is_one_miss_not_a_stuck_tier(tmp_path):
    """Its open (O_RDONLY on a FIFO) waited for a writer for ever on the reader thread: every
    later lookup timed out to a miss, intact entries and new ones too, until a restart."""
    tier = cold_tier(tmp_path, cold_deadline=5.0)
    tier.persist(np.arange(8), [kv_cache(8)])
    path = entry_file(tier)
    path.unlink()
    os.mkfifo(path, 0o600)
    hit = tier.lookup(list(range(8)))
    assert hit is None or tier.load(hit) is None
    assert tier.stats()["quarantined"] == 1
    tier.persist(np.arange(8) + 50, [kv_cache(8)])
    hit = tier.lookup(list(range(50, 58)))
    assert hit is not None and tier.load(hit) is not None
    tier.close()


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO])
def test_an_unreadable_entry_is_a_miss_not_corrupt(tmp_path, monkeypatch, code):
    """A file that cannot be read (permissions, an I/O error) was quarantined as corrupt — and
    the budget deletes quarantine: a good entry was lost to a transient fault."""
    from tiered_kv.cold import fsafe

    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    path = entry_file(tier)
    real = fsafe.open_nofollow

    def refusing(p, flags, mode=0o600):
        if Path(p) == path:
            raise OSError(code, os.strerror(code), str(p))
        return real(p, flags, mode)

    monkeypatch.setattr(fsafe, "open_nofollow", refusing)
    assert tier.load(tier.lookup(list(range(8)))) is None
    assert tier.stats()["quarantined"] == 0 and tier.stats()["load_errors"] == 1
    monkeypatch.setattr(fsafe, "open_nofollow", real)
    assert path.exists() and tier.load(tier.lookup(list(range(8)))) is not None
    tier.close()


def test_an_entry_grown_past_its_indexed_size_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """A planted file with a valid header declaring a 2 GiB tensor (sparse: a few KiB on disk) was
    loaded whole — 2 GiB allocated — before its checksums refused it. The index knows the size the
    file was written at: a file of another size is corrupt before any data is read."""
    from tiered_kv.cold import codec

    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    path = entry_file(tier)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    tensors = json.loads(raw[8 : 8 + n])
    meta, data = tensors.pop("__metadata__"), raw[8 + n :]
    end, pad = max(t["data_offsets"][1] for t in tensors.values()), 1 << 30
    tensors["1.s0"] = {"dtype": "F32", "shape": [pad // 4], "data_offsets": [end, end + pad]}
    tree = json.loads(meta["layers"]) + [{"cls": "ArraysCache", "meta": {"size": 1}}]
    meta["layers"] = json.dumps(tree)  # a layer that declares it
    sums = json.loads(meta["xxh3"])  # a valid header: its checksum is public
    sums["1.s0"] = "0" * checksums.n_digest_chars(pad, int(meta["chunk_bytes"]))
    meta["xxh3"] = json.dumps(sums, separators=(",", ":"))
    head = store.header_bytes(tensors, meta)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + data)
        f.truncate(8 + len(head) + len(data) + pad)  # sparse: nothing more on disk
    assert store.read_header(path, tier.fingerprint).n_tokens == 8  # the header alone is fine
    loads: list[tuple] = []

    def load_steps(*a, **k):
        loads.append(a)
        return iter(())

    monkeypatch.setattr(codec, "load_steps", load_steps)
    hit = tier.lookup(list(range(8)))
    assert hit is None or tier.load(hit) is None
    assert tier.flush(30)  # the writer checks it whole (a row may be what is wrong): corrupt
    assert loads == [] and tier.stats()["quarantined"] == 1
    tier.close()


def test_arrays_mlx_cannot_allocate_are_a_miss_not_a_failed_request(tmp_path, monkeypatch):
    """On CUDA an entry larger than the free GPU memory fails its allocation (RuntimeError): that
    reached the request as a 500. It is a miss, counted; the file is kept."""
    from tiered_kv.cold import codec

    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])

    def refused(*a, **k):
        raise RuntimeError("[cuda::malloc] out of memory")

    monkeypatch.setattr(codec, "allocate", refused)
    assert tier.load(tier.lookup(list(range(8)))) is None
    assert tier.stats()["load_errors"] == 1 and tier.stats()["quarantined"] == 0
    monkeypatch.undo()
    assert tier.load(tier.lookup(list(range(8)))) is not None
    tier.close()


@pytest.mark.parametrize("key, value", [("n_tokens", "8.0"), ("n_tokens", "eight"), ("n_tokens", ""),
                                        ("n_tokens", "0" * 4990 + "8"), ("chunk_bytes", "²"),
                                        ("chunk_bytes", "0" * 4990 + "1048576")])  # fmt: skip
def test_a_count_that_is_no_integer_is_quarantined(tmp_path, key, value):
    """A re-signed header whose ``n_tokens`` or ``chunk_bytes`` is no integer int() takes (a
    superscript digit, more than 4300 digits) raised a bare ValueError from the header check —
    not CorruptEntry — out of the load into the request."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(8), [kv_cache(8)])
    rewrite_meta(entry_file(tier), **{key: value})
    assert tier.load(tier.lookup(list(range(8)))) is None
    assert tier.stats()["quarantined"] == 1
    tier.close()


@pytest.mark.parametrize("off", [100, -100])
def test_a_row_of_the_wrong_size_is_repaired_not_its_good_file_quarantined(tmp_path, off):
    """An index row whose ``nbytes`` differed from its file's size had the file quarantined,
    though the file checked out against its own header (size included) and checksums: the row
    was wrong, not the file. The load still refuses it before allocating anything (a miss), and
    the writer checks the file whole: the row is repaired and the entry served from then on."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(16), [kv_cache(16)])
    size = entry_file(tier).stat().st_size
    damage_index(tier, "UPDATE entries SET nbytes = nbytes + ?", off)
    assert tier.load(tier.lookup(list(range(16)))) is None  # refused before anything is made
    assert tier.flush(30)
    st = tier.stats()
    assert st["quarantined"] == 0 and st["index_errors"] == 1 and st["bytes"] == size, st
    assert [r.nbytes for r in tier.index.records()] == [size]
    got = tier.load(tier.lookup(list(range(16))))
    assert got is not None and np.array_equal(got.tokens, np.arange(16))
    assert tier.flush(30) and tier.stats()["index_errors"] == 1  # repaired once
    tier.close()


def test_a_row_of_the_wrong_size_over_a_damaged_file_still_quarantines_it(tmp_path):
    """The file is the truth only where its checksums say so: damaged data is still quarantined."""
    tier = cold_tier(tmp_path)
    tier.persist(np.arange(16), [kv_cache(16)])
    flip_byte(entry_file(tier), -3)
    damage_index(tier, "UPDATE entries SET nbytes = nbytes + 100")
    assert tier.load(tier.lookup(list(range(16)))) is None
    assert tier.flush(30)
    assert tier.stats()["quarantined"] == 1 and tier.stats()["entries"] == 0
    tier.close()
