"""tiered_kv/cold/scan.py: the byte-only threads that read a whole entry file beside a loader —
the scan verifies every piece as it reads it, and refuses what follows a bad one."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.fixtures import big_kv
from tiered_kv.cold import codec, scan, store
from tiered_kv.cold.backend import FileBackend


def _entry(tmp_path, tokens=6_000):
    caches = [big_kv(tokens), big_kv(tokens)]  # ~6 MB per tensor: 2 chunks each
    job = codec.prepare(np.arange(tokens, dtype=np.int32), caches, None, "fp")
    b = FileBackend(tmp_path)
    b.put("e1", store.encode(job.tokens, job.tensors, job.metadata))
    path = b.path("e1")
    return path, store.read_header(path, "fp")


def test_scan_reads_in_ring_buffers_and_verifies_every_piece(tmp_path):
    path, header = _entry(tmp_path)
    reader = scan.Scan(path, header, step=store.CHUNK_BYTES, ring=2)  # many pieces, buffers reused
    reader.wait(store.data_end(header))
    reader.close()


@pytest.mark.parametrize("piece", [0, 1, -1])
def test_scan_verifies_the_prefix_before_a_corrupt_piece_and_refuses_past_it(tmp_path, piece):
    path, header = _entry(tmp_path)
    name = "1.values" if piece == -1 else "0.keys"
    start, stop = header.tensors[name]["data_offsets"]
    bad = start + piece * store.CHUNK_BYTES + 3 if piece >= 0 else stop - 1
    with open(path, "r+b") as f:
        f.seek(header.data_start + bad)
        b = f.read(1)
        f.seek(header.data_start + bad)
        f.write(bytes([b[0] ^ 0x80]))
    reader = scan.Scan(path, header, step=store.CHUNK_BYTES, ring=2)
    try:
        piece_start = start + (bad - start) // store.CHUNK_BYTES * store.CHUNK_BYTES
        reader.wait(piece_start)  # everything before the bad piece is fine
        with pytest.raises(store.CorruptEntry, match=name):
            reader.wait(store.data_end(header))
    finally:
        reader.close()
    with pytest.raises(store.CorruptEntry):
        scan.check_data(path, header)


def test_scan_of_a_truncated_file_is_corrupt(tmp_path):
    path, header = _entry(tmp_path)
    os.truncate(path, path.stat().st_size - 100)
    reader = scan.Scan(path, header)
    with pytest.raises(store.CorruptEntry):
        reader.wait(store.data_end(header))
    reader.close()


def test_scan_closed_early_stops_its_thread(tmp_path):
    path, header = _entry(tmp_path)
    reader = scan.Scan(path, header, step=store.CHUNK_BYTES, ring=1)
    reader.close()
    assert not reader._thread.is_alive()
