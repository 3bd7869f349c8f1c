"""Probe: prefill steps onto a cache with stable attention shapes (CUDA cuDNN graph reuse).

plain: mlx-lm KVCache, causal mask (a new (q, k) shape each turn -> a cuDNN graph build)
bucket: query padded to a power of two (>=16), keys handed to attention as the whole buffer of a
        bucketed capacity (multiple of G), with an additive array mask.
"""
import sys, time
import mlx.core as mx
from mlx_lm.models import cache as C
from engine.loading import load_model

G = int(sys.argv[3]) if len(sys.argv) > 3 else 4096


def qb(n):
    b = 16
    while b < n:
        b *= 2
    return b


def cap_of(end):
    return -(-end // G) * G


class Bucket(C.KVCache):
    def make_mask(self, N, return_array=False, window_size=None, **kw):
        if self.keys is None or N == 1:
            return super().make_mask(N, return_array=return_array, window_size=window_size)
        cap = cap_of(self.offset + N)
        q = mx.arange(N)[:, None] + self.offset
        k = mx.arange(cap)[None]
        return mx.where(k <= q, mx.array(0, self.keys.dtype), mx.array(-mx.inf, self.keys.dtype))

    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        if self.keys is None or n == 1:
            return super().update_and_fetch(keys, values)
        prev = self.offset
        cap = cap_of(prev + n)
        if self.keys.shape[2] != cap:
            def grow(x):
                keep = x[..., : min(prev, cap), :]
                b, h, _, d = x.shape
                return mx.concatenate([keep, mx.zeros((b, h, cap - keep.shape[2], d), x.dtype)], axis=2)
            self.keys, self.values = grow(self.keys), grow(self.values)
        self.keys[..., prev : prev + n, :] = keys
        self.values[..., prev : prev + n, :] = values
        self.offset += n
        return self.keys, self.values


def ids(n, salt):
    return [(i * 7919 + salt) % 4000 + 3 for i in range(n)]


def build(model, cls, ctx):
    cache = [cls() for _ in model.layers]
    for s in range(0, ctx, 2048):
        model(mx.array([ids(min(2048, ctx - s), s)]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def step_plain(model, cache, toks):
    t = time.perf_counter()
    out = model(mx.array([toks]), cache=cache)
    last = out[0, -1]
    mx.eval([last] + [c.state for c in cache])
    return time.perf_counter() - t, last


def step_bucket(model, cache, toks):
    t = time.perf_counter()
    n = len(toks)
    pad = qb(n) - n
    out = model(mx.array([toks + [toks[-1]] * pad]), cache=cache)
    last = out[0, n - 1]
    mx.eval([last] + [c.keys for c in cache] + [c.values for c in cache])
    for c in cache:
        c.offset -= pad
    return time.perf_counter() - t, last


def main():
    model, _ = load_model(sys.argv[1])
    ctx = int(sys.argv[2])
    step_plain(model, build(model, C.KVCache, 16), ids(8, 1))
    turns = [10, 37, 300, 1000, 150, 700, 64, 2000, 12, 500]
    for rnd in range(2):
        base = ctx + rnd * 777
        a = build(model, C.KVCache, base)
        b = build(model, Bucket, base)
        rows = []
        for k, n in enumerate(turns):
            toks = ids(n, 100 * k + rnd)
            ta, la = step_plain(model, a, toks)
            tb, lb = step_bucket(model, b, toks)
            d = mx.abs(la.astype(mx.float32) - lb.astype(mx.float32)).max().item()
            same = mx.argmax(la).item() == mx.argmax(lb).item()
            rows.append((a[0].offset, n, ta * 1e3, tb * 1e3, d, same))
        print(f"round {rnd} ctx {base} G {G}")
        for r in rows:
            print("  end %6d new %5d plain %7.1f ms bucket %7.1f ms maxdiff %.4f argmax-same %s" % r)
        print("  total plain %.1f bucket %.1f" % (sum(r[2] for r in rows), sum(r[3] for r in rows)))
    # a long prefill: causal plain vs bucket, whole 2048 steps from 0
    for rep in range(2):
        t = time.perf_counter(); build(model, C.KVCache, 32768); tp = time.perf_counter() - t
        t = time.perf_counter(); build(model, Bucket, 32768); tb = time.perf_counter() - t
        print(f"32k cold prefill in 2048 steps: plain {tp:.3f}s bucket {tb:.3f}s")


main()
