"""tiered_kv/cold/codec.py: every cache class mlx-lm makes goes to disk and comes back equal
(through the tier: encode, write, read, verify, decode)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as C

from tests.fixtures import cold_tier, kv_cache
from tiered_kv import layers


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


def arrays_cache() -> C.ArraysCache:
    c = C.ArraysCache(2)
    c[0] = mx.random.normal((1, 3, 4))
    c[1] = mx.arange(6, dtype=mx.float16).reshape(1, 6)
    return c


CASES = {
    "kv": lambda: [kv_cache(10), kv_cache(10, dtype=mx.float16)],
    "quantized": lambda: [quantized(10)],
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
    tier.close()
