"""tiered_kv/cold/checksums.py: the chunk digest rule the writer and every reader share."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import xxhash

from tiered_kv.cold import checksums

DATA = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 1001, 10_000])
def test_chunk_digests_are_each_chunks_xxh3_concatenated_the_last_one_shorter(size):
    data = memoryview(DATA[:size])
    want = "".join(xxhash.xxh3_64_hexdigest(data[i : i + 1000]) for i in range(0, size, 1000))
    got = checksums.chunk_digests([data] if size else [], 1000)
    assert got == want
    assert len(got) == checksums.n_digest_chars(size, 1000) == checksums.HEX * -(-size // 1000)


@pytest.mark.parametrize("block", [1, 7, 333, 1000, 1001, 4096, 10_000])
def test_chunk_digests_do_not_depend_on_how_the_stream_is_cut(block):
    whole = checksums.chunk_digests([memoryview(DATA)], 1000)
    cut = [memoryview(DATA)[i : i + block] for i in range(0, len(DATA), block)]
    assert checksums.chunk_digests(cut, 1000) == whole
    d = checksums.Digests(1000)  # fed block by block, as the writer does
    for b in cut:
        d.update(b)
    assert d.hexdigests() == whole


def test_the_hashing_pool_is_one_pool_of_named_threads():
    assert checksums.pool() is checksums.pool()
    name = checksums.pool().submit(lambda: threading.current_thread().name).result()
    assert name.startswith("tkv-xxh3")
