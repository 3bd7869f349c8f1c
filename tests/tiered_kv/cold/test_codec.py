"""tiered_kv/cold/codec.py: every cache class mlx-lm makes goes to disk and comes back equal
(through the tier: encode, write, read, verify, decode)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tests.fixtures import HostUpload, cold_tier, flip_byte, kv_cache
from tiered_kv import declared, layers
from tiered_kv.cold import codec
from tiered_kv.steps import drain


def rotating(n: int) -> C.RotatingKVCache:
    c = C.RotatingKVCache(max_size=8, keep=0)
    c.update_and_fetch(mx.random.normal((1, 2, 4, 8)), mx.random.normal((1, 2, 4, 8)))
    for _ in range(n - 4):
        c.update_and_fetch(mx.random.normal((1, 2, 1, 8)), mx.random.normal((1, 2, 1, 8)))
    return c


def quantized(n: int) -> C.QuantizedKVCache:
    c = C.QuantizedKVCache(group_size=32, bits=4)
    c.update_and_fetch(mx.random.normal((1, 2, n, 32)), mx.random.normal((1, 2, n, 32)))
    return c


def chunked(n: int) -> C.ChunkedKVCache:
    c = C.ChunkedKVCache(chunk_size=64)
    c.update_and_fetch(mx.random.normal((1, 2, n, 8)), mx.random.normal((1, 2, n, 8)))
    return c


def arrays_cache() -> C.ArraysCache:
    c = C.ArraysCache(2)
    c[0] = mx.random.normal((1, 3, 4))
    c[1] = mx.arange(6, dtype=mx.float16).reshape(1, 6)
    return c


CASES = {
    "kv": lambda: [kv_cache(10), kv_cache(10, dtype=mx.float16)],
    "quantized": lambda: [quantized(10)],
    "chunked": lambda: [chunked(10)],
    "rotating": lambda: [rotating(6)],
    "rotating_wrapped": lambda: [rotating(13)],
    "arrays": lambda: [arrays_cache()],
    "cachelist": lambda: [C.CacheList(kv_cache(10), rotating(13)), kv_cache(10, dtype=mx.float32)],
}


def assert_same(a: list, b: list) -> None:
    (xa, ma), (xb, mb) = layers.encode(a), layers.encode(b)
    assert ma == mb and sorted(xa) == sorted(xb)
    for k in xa:
        assert xa[k].dtype == xb[k].dtype and mx.array_equal(xa[k], xb[k]).item(), k


@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_through_disk(tmp_path, case):
    mx.random.seed(0)
    caches = CASES[case]()
    ids = np.arange(10, dtype=np.int32)
    tier = cold_tier(tmp_path)
    tier.persist(ids, caches)
    hit = tier.lookup(list(range(10)) + [77])
    assert hit is not None and hit.tokens == 10 and hit.entry_tokens == 10
    got = tier.load(hit)
    assert got is not None
    assert_same(caches, got[0])
    assert got[1].tolist() == ids.tolist()
    # the reloaded caches (token-major tensors come back as swapaxes views) grow as the originals
    grow = [(x, y) for x, y in zip(layers.leaves(caches), layers.leaves(got[0]), strict=True)
            if not isinstance(x, C.ArraysCache)]  # fmt: skip
    for x, y in grow:
        quant = isinstance(x, C.QuantizedKVCache)
        dim = 32 if quant else x.keys.shape[-1]
        new = mx.random.normal((1, 2, 3, dim)).astype(mx.float32 if quant else x.keys.dtype)
        want, have = x.update_and_fetch(new, -new), y.update_and_fetch(new, -new)
        for u, v in zip(_flat(want), _flat(have), strict=True):
            assert mx.array_equal(u, v).item()
    tier.close()


def _flat(x: object) -> list:
    if isinstance(x, tuple | list):
        return [leaf for item in x for leaf in _flat(item)]
    return [x]


def big_entry(tmp_path, tokens: int = 12_000):
    """A ~48 MB entry file (12+ chunks per tensor) and its checked header."""
    from tiered_kv.cold import encode, store
    from tiered_kv.cold.backend import FileBackend

    def kv() -> C.KVCache:
        c = C.KVCache()
        x = mx.random.normal((1, 4, tokens, 128)).astype(mx.bfloat16)
        c.update_and_fetch(x, -x)
        mx.eval(c.keys, c.values)
        return c

    caches = [kv(), kv()]
    job = codec.prepare(np.arange(tokens, dtype=np.int32), caches, None, "fp")
    backend = FileBackend(tmp_path)
    backend.put("e", encode.encode(job.tokens, job.tensors, job.metadata))
    path = backend.path("e")
    return path, store.read_header(path, "fp"), caches


# host=False on a machine without the CUDA driver: the CPU writes into (managed) memory of few
# allocations, the fallback of a CUDA load whose upload is off
WAYS = [(True, False), (True, True), (False, False)]
WAY_IDS = ["host", "host-beside", "one-buffer"]


@pytest.mark.parametrize(("host", "beside"), WAYS, ids=WAY_IDS)
def test_every_way_of_a_whole_load_gives_the_arrays(tmp_path, host, beside):
    path, header, caches = big_entry(tmp_path)
    got = drain(codec.load_steps(path, header, beside, host=host))
    for i in (0, 1):
        assert mx.array_equal(got[f"{i}.keys"], caches[i].keys[..., :12_000, :]).item()
        assert mx.array_equal(got[f"{i}.values"], caches[i].values[..., :12_000, :]).item()
    assert codec.tokens_of(got).tolist() == list(range(12_000))


@pytest.mark.parametrize(("host", "beside"), WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_fails_every_way_of_loading(tmp_path, host, beside, where):
    from tiered_kv.cold import store

    path, header, _ = big_entry(tmp_path)
    start, size = header.data_start, path.stat().st_size
    offset = {"first": start + 5, "middle": (start + size) // 2, "last": size - 1}[where]
    flip_byte(path, offset)
    with pytest.raises(store.CorruptEntry, match="checksum"):
        drain(codec.load_steps(path, header, beside, host=host))


@pytest.mark.parametrize("beside", [False, True], ids=["whole", "beside"])
def test_a_load_reads_every_byte_of_the_file_once_into_the_arrays(tmp_path, monkeypatch, beside):
    """One read per reload (issue 11): every byte of the data section is read once, straight into
    the arrays' memory — no ``mx.load`` of the file (it reads the file again after a check, or
    copies it while the hashing reads it: 83 % of mlx-lm's warm load on the 2-core machine).
    ``beside``: the generator returns while its read is still held on the read's thread."""
    import threading

    from tiered_kv.cold import ranged, store

    path, header, caches = big_entry(tmp_path)
    read: list[tuple[int, int]] = []
    real, release = ranged._preadv_all, threading.Event()

    def counted(fd: int, views: list[memoryview], offset: int) -> None:
        release.wait(20)  # a slow disk, until the test lets it go
        read.append((offset, sum(len(v) for v in views)))
        real(fd, views, offset)

    monkeypatch.setattr(ranged, "_preadv_all", counted)
    real_load = mx.load

    def load(file, *a, **k):  # the landing's blank file-like object reads nothing
        assert not isinstance(file, (str, os.PathLike)), "mx.load read the file"
        return real_load(file, *a, **k)

    monkeypatch.setattr(mx, "load", load)
    steps = codec.load_steps(path, header, beside, host=True)
    if beside:
        next(steps)
        next(steps)
        assert read == []  # both steps returned while the read was held
    release.set()
    got = drain(steps)
    spans = sorted(read)
    assert sum(n for _, n in spans) == store.data_end(header)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))  # no byte twice
    assert mx.array_equal(got["0.keys"], caches[0].keys[..., :12_000, :]).item()


@pytest.mark.parametrize("beside", [False, True], ids=["whole", "beside"])
def test_a_load_stuck_on_a_frozen_disk_never_keeps_the_process_from_exiting(tmp_path, beside):
    """The readers ran on ``concurrent.futures`` threads, which the interpreter joins at exit:
    a SIGTERM-ed server whose load a stalled disk held stayed until the read returned (81 s in a
    reviewer's run; forever on a frozen disk). Here every read blocks for good: the load is
    abandoned (closed beside streams; on a daemon thread like the engine's) and the process
    exits."""
    import subprocess
    import sys
    import textwrap

    path, _, _ = big_entry(tmp_path)
    code = textwrap.dedent(f"""
        import threading, time
        from pathlib import Path
        from tiered_kv.cold import codec, ranged, store
        ranged._preadv_all = lambda *a: threading.Event().wait()  # a frozen disk
        path = Path({str(path)!r})
        steps = codec.load_steps(path, store.read_header(path, "fp"), {beside})
        if {beside}:
            next(steps)
            steps.close()
        else:
            threading.Thread(target=lambda: list(steps), daemon=True).start()
        time.sleep(0.5)
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("host", [True, False], ids=["host", "upload"])
def test_a_cancelled_load_stops_reading(tmp_path, monkeypatch, host):
    """A cancelled request's load read the whole file on (and held the whole entry's memory)
    after its generator was closed; 20 cancelled loads of a slow disk held 1.3 GB at once. Its
    readers now stop before their next read."""
    import threading
    import time

    from tiered_kv.cold import gpu, ranged, store

    path, header, _ = big_entry(tmp_path)
    if not host:
        monkeypatch.setattr(gpu, "shared", lambda: HostUpload(slot_bytes=4 << 20))
    read: list[int] = []
    real = ranged._preadv_all

    def slow(fd: int, views: list[memoryview], offset: int) -> None:
        time.sleep(0.1)
        real(fd, views, offset)
        read.append(sum(len(v) for v in views))

    monkeypatch.setattr(ranged, "_preadv_all", slow)
    before = {t.name for t in threading.enumerate()}
    steps = codec.load_steps(path, header, True, host=host)
    next(steps)
    next(steps)
    steps.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and {t.name for t in threading.enumerate()} - before:
        time.sleep(0.05)
    assert not {t.name for t in threading.enumerate()} - before  # every reader ended
    assert sum(read) < store.data_end(header) // 2


@pytest.mark.parametrize("beside", [False, True], ids=["whole", "beside"])
def test_a_cuda_load_reads_through_the_gpu_upload(tmp_path, monkeypatch, beside):
    """CUDA (``host=False`` with an upload): the arrays are allocated unwritten and every tensor
    is read whole through pinned slots, verified there, copied in. (The CPU has no GPU:
    :class:`HostUpload` stands in for the copy engine; the real one runs on the H200.)"""
    from tiered_kv.cold import gpu, store

    path, header, caches = big_entry(tmp_path)
    up = HostUpload(slot_bytes=16 << 20)
    monkeypatch.setattr(gpu, "shared", lambda: up)
    got = drain(codec.load_steps(path, header, beside, host=False))
    assert up.bytes == store.data_end(header) and up.waits == [len(up.copies)]
    [(extents, before)] = up.populated  # the landing, populated before any copy was issued
    assert before == 0 and sum(n for _, n in extents) >= up.bytes
    assert all(any(a <= d and d + k <= a + n for a, n in extents) for d, k in up.copies)
    for i in (0, 1):
        assert mx.array_equal(got[f"{i}.keys"], caches[i].keys[..., :12_000, :]).item()
        assert mx.array_equal(got[f"{i}.values"], caches[i].values[..., :12_000, :]).item()
    assert codec.tokens_of(got).tolist() == list(range(12_000))


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_fails_a_load_through_the_upload(tmp_path, monkeypatch, where):
    from tiered_kv.cold import gpu, store

    path, header, _ = big_entry(tmp_path)
    monkeypatch.setattr(gpu, "shared", lambda: HostUpload(slot_bytes=16 << 20))
    start, size = header.data_start, path.stat().st_size
    flip_byte(path, {"first": start + 5, "middle": (start + size) // 2, "last": size - 1}[where])
    with pytest.raises(store.CorruptEntry, match="checksum"):
        drain(codec.load_steps(path, header, host=False))


def test_a_failed_gpu_copy_falls_back_to_a_cpu_read_and_blames_no_file(tmp_path, monkeypatch):
    from tiered_kv.cold import gpu

    path, header, caches = big_entry(tmp_path)
    monkeypatch.setattr(gpu, "shared", lambda: HostUpload(slot_bytes=16 << 20, fail_after=2))
    got = drain(codec.load_steps(path, header, host=False))
    assert mx.array_equal(got["1.keys"], caches[1].keys[..., :12_000, :]).item()


def test_a_closed_step_wise_cuda_load_leaves_its_read_to_run_out(tmp_path, monkeypatch):
    """A cancelled request closes its load: the engine thread waited there for the rest of the
    read (every decode stream with it: ~3 s for a 4 GiB entry at 1.5 GB/s). The read runs out on
    its own thread, which holds the arrays it writes into."""
    import threading
    import time

    from tiered_kv.cold import gpu, ranged

    path, header, _ = big_entry(tmp_path)
    monkeypatch.setattr(gpu, "shared", lambda: HostUpload(slot_bytes=16 << 20))
    release, real = threading.Event(), ranged.read_tensors

    def held(*a, **kw):
        release.wait(20)  # a slow disk, until the test lets it go
        return real(*a, **kw)

    monkeypatch.setattr(ranged, "read_tensors", held)
    steps = codec.load_steps(path, header, True, host=False)
    next(steps)
    next(steps)
    t0 = time.perf_counter()
    steps.close()
    waited = time.perf_counter() - t0
    release.set()
    assert waited < 10  # it returned while the read was still held


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_an_entry_serves_is_read_from_its_metadata(case):
    """The writer records whether the entry can be cut back (``layers.can_trim``); a file written
    before that key was is taken as trimmable only where every layer is plain attention — never
    more than the entry serves."""
    caches = CASES[case]()
    meta = codec.prepare(np.arange(10, dtype=np.int32), caches, None, "fp").metadata
    trimmable = layers.can_trim(caches)
    assert declared.serving(meta) == declared.Serving(trimmable, ())
    older = {k: v for k, v in meta.items() if k != "trimmable"}
    assert declared.serving(older).trimmable == (case in ("kv", "quantized"))
    assert trimmable or not declared.serving(older).trimmable


def test_an_entrys_metadata_is_as_long_whenever_it_is_written(monkeypatch):
    """The same KV makes a file of the same size at any time: ``created`` was ``repr(time.time())``,
    whose length varies with the clock (1765015037.5 against 1765015037.123456), so the same
    entry written twice differed by a header's padding (an 8-byte flake of test_shapes)."""
    lengths = set()
    for now in (1765015037.5, 1765015037.123456, 1765015037.1234567):
        monkeypatch.setattr(codec.time, "time", lambda now=now: now)
        meta = codec.prepare(np.arange(10, dtype=np.int32), [kv_cache(10)], None, "fp").metadata
        assert float(meta["created"]) == pytest.approx(now, abs=1e-6)
        lengths.add(len(meta["created"]))
    assert len(lengths) == 1
