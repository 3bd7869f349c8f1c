"""tiered_kv/cold/scan.py: the whole-file check of ``cache verify`` reads every byte of the data
section once and refuses a corrupt piece, naming its tensor, and a short file."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.fixtures import big_kv, flip_byte
from tiered_kv.cold import checksums, codec, encode, scan, store
from tiered_kv.cold.backend import FileBackend


def _entry(tmp_path, tokens=6_000):
    caches = [big_kv(tokens), big_kv(tokens)]  # ~6 MB per tensor: 2 chunks each
    job = codec.prepare(np.arange(tokens, dtype=np.int32), caches, None, "fp")
    b = FileBackend(tmp_path)
    b.put("e1", encode.encode(job.tokens, job.tensors, job.metadata))
    path = b.path("e1")
    return path, store.read_header(path, "fp")


def test_a_check_reads_every_byte_once_in_pieces(tmp_path, monkeypatch):
    path, header = _entry(tmp_path)
    read: list[tuple[int, int]] = []
    real = scan.read_into

    def counted(fd: int, view: memoryview, offset: int) -> int:
        read.append((offset, len(view)))
        return real(fd, view, offset)

    monkeypatch.setattr(scan, "read_into", counted)
    scan.check_data(path, header, step=checksums.CHUNK_BYTES)  # many pieces, both buffers reused
    assert len(read) > 4 and sum(n for _, n in read) == store.data_end(header)
    assert len(set(read)) == len(read)


@pytest.mark.parametrize("piece", [0, 1, -1])
def test_a_corrupt_piece_anywhere_is_refused_by_its_tensor_name(tmp_path, piece):
    path, header = _entry(tmp_path)
    name = "1.values" if piece == -1 else "0.keys"
    start, stop = header.tensors[name]["data_offsets"]
    bad = start + piece * checksums.CHUNK_BYTES + 3 if piece >= 0 else stop - 1
    flip_byte(path, header.data_start + bad)
    with pytest.raises(store.CorruptEntry, match=name):
        scan.check_data(path, header, step=checksums.CHUNK_BYTES)
    with pytest.raises(store.CorruptEntry, match=name):
        scan.check_data(path, header)  # one piece per tensor


def test_a_truncated_file_is_corrupt(tmp_path):
    path, header = _entry(tmp_path)
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(store.CorruptEntry):
        scan.check_data(path, header)


def test_a_symlink_is_never_followed(tmp_path):
    path, header = _entry(tmp_path)
    link = path.with_name("link.safetensors")
    link.symlink_to(path)
    with pytest.raises(store.CorruptEntry):
        scan.check_data(link, header)
