"""Prefill steps in few attention shapes, so that on CUDA a step's attention graph is built once.

mlx-cuda runs a prefill step's attention through cuDNN, which builds a graph for each exact
(query length, key length, strides) and keeps some hundreds in a per-process LRU
(``MLX_CUDA_SDPA_CACHE_SIZE``). A hot hit's suffix step has a key length no earlier step had (the
conversation so far), so every turn paid a build: H100, 1B shape, 8k context, 47-60 ms a step of
10-1000 new tokens against 7-13 ms once its graph exists (``bench.step_shapes``, README).

A plain-KV prefill step that is not a *whole aligned step* (``step`` tokens starting at a multiple
of ``step``: a long prefill's body, whose shapes recur on their own) runs instead with

* its query padded to :func:`query_rows` (a power of two, at least 16) with copies of its last
  token: attention is causal, so the padding never reaches the real tokens, and its keys are cut
  off after the step (the cache's offset is set back; the next step overwrites them);
* its keys handed to attention as the cache's whole buffer, which is kept :func:`capacity` long
  (four lengths an octave), with an additive mask that is the causal mask over the real keys and
  hides the rest.

So a step's (query, key) shape is one of a few per octave of context, and its graph is built once
per process. The buffer past the tokens costs memory (at most a quarter of the tokens and under
8192 tokens, plus the padding; the hot tier counts an entry's capacity). :func:`chunk` makes a suffix that fits one
step one padded step, and ends a longer suffix's first step at the next multiple of ``step`` so
that the steps after it are whole aligned ones. Decode buffers grow to the same capacities
(:class:`engine.decoding.DecodeKVCache`): mlx-cuda keys its decode graph by the buffer's length.

The tokens are the same: the masked keys add exact zeros to attention (float32 on the CPU: logits
equal to the plain step's); on a GPU in bf16 the attention kernel differs (a mask array instead of
the causal flag), so logits differ by bf16 rounding as between any two cuts of a prefill.

Where: CUDA (``TIERED_KV_STEP_SHAPES=auto``). On the CPU and Metal nothing is built per shape and
the padding would only cost compute. Only plain ``KVCache`` layers (no checkpoints, no quantised,
rotating or recurrent state, where padding tokens would enter the state) and a request prefilling
alone; several requests sharing a forward keep mlx-lm's batched cache.

Ownership: the thread that owns MLX.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger(__name__)

#: the finest step between key lengths (mlx-lm's KV buffer step)
MIN_GRAIN = 256
#: the coarsest: past 32k tokens a quarter would be more memory than this many tokens of KV
MAX_GRAIN = 8192
#: the shortest padded query
MIN_QUERY = 16


def query_rows(n: int) -> int:
    """The padded query length of an ``n``-token step: the next power of two, at least 16."""
    rows = MIN_QUERY
    while rows < n:
        rows *= 2
    return rows


def capacity(end: int) -> int:
    """The buffer length (attention's key length) for a step ending at token ``end``: four
    lengths an octave (``end`` in (2^k, 2^(k+1)] rounds up to a multiple of 2^(k-2)), in
    multiples of 256 to 8192 — at most a quarter (or 255 tokens) more than the tokens, and at
    most 8191 more (an 8B model's 1 GiB of KV), a few lengths a conversation."""
    grain = min(MAX_GRAIN, max(MIN_GRAIN, 1 << max(0, (end - 1).bit_length() - 3)))
    return -(-end // grain) * grain


def whole(start: int, n: int, step: int) -> bool:
    """A whole aligned step: ``step`` tokens from a multiple of ``step`` (kept causal)."""
    return n == step and start % step == 0


def padded(start: int, n: int, step: int) -> bool:
    """Whether an ``n``-token step from ``start`` runs padded: neither one token nor whole."""
    return n > 1 and not whole(start, n, step)


def chunk(start: int, n: int, step: int) -> int:
    """Tokens of the next step of an ``n``-token prefill from ``start``: all of them when they fit
    one step (one padded step), else up to the next multiple of ``step``, so that the steps
    after it are whole aligned ones."""
    return n if n <= step else max(1, step - start % step)


class PaddedKVCache(C.KVCache):
    """mlx-lm's ``KVCache`` whose steps that are not whole aligned ones hand attention the whole
    buffer (:func:`capacity` long) under an additive mask (see the module). Built over a plain
    cache's buffers for one step by :func:`forward`."""

    keys: mx.array | None  # mlx-lm's buffers (None until the first tokens)
    values: mx.array | None
    offset: int

    def __init__(self, step: int) -> None:
        super().__init__()
        self.prefill_step = step

    def _capacity(self, end: int) -> int:
        held = int(self.keys.shape[2]) if self.keys is not None else 0
        return max(capacity(end), held if capacity(held) == held else 0)

    def _padded(self, n: int) -> bool:
        return padded(self.offset, n, self.prefill_step)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None,
                  **kwargs: Any) -> Any:  # fmt: skip
        if not self._padded(N):
            return super().make_mask(N, return_array=return_array, window_size=window_size)
        if window_size is not None:  # a windowed mask over a plain cache: not this layout's
            raise NotPadded("a windowed attention mask over a plain KV cache")
        cap = self._capacity(self.offset + N)
        seen = mx.arange(cap)[None] <= (mx.arange(N)[:, None] + self.offset)
        if self.keys is None:
            return seen  # MLX turns a boolean mask into an additive one
        dtype = self.keys.dtype
        return mx.where(seen, mx.array(0, dtype), mx.array(-mx.inf, dtype))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        prev, n = self.offset, int(keys.shape[2])
        end, masked = prev + n, self._padded(n)  # attention sees the whole buffer
        cap = self._capacity(end)
        if self.keys is None or self.values is None or int(self.keys.shape[2]) != cap:
            self.keys = _sized(self.keys, keys, prev, cap)
            self.values = _sized(self.values, values, prev, cap)
        self.keys[..., prev:end, :] = keys
        self.values[..., prev:end, :] = values
        self.offset = end
        if not masked:
            return self.keys[..., :end, :], self.values[..., :end, :]
        return self.keys, self.values


def grown(x: mx.array, rows: int, size: int) -> mx.array:
    """The first ``rows`` rows of buffer ``x`` (axis 2) in a buffer of ``size`` rows."""
    b, h, _, d = x.shape
    return mx.concatenate([x[..., :rows, :], mx.zeros((b, h, size - rows, d), x.dtype)], axis=2)


def _sized(buf: mx.array | None, new: mx.array, rows: int, cap: int) -> mx.array:
    """:func:`grown` to ``cap`` rows; zeros shaped as ``new`` when there is nothing to keep."""
    if buf is None or rows == 0:
        b, h, _, d = new.shape
        return mx.zeros((b, h, cap, d), new.dtype)
    return grown(buf, rows, cap)


class NotPadded(Exception):
    """The model asked for an attention mask a padded step cannot give."""


def works(model: Any, step: int) -> bool:
    """Whether ``model`` takes padded steps, checked once at start: a padded 11-token step onto a
    13-token prefix gives the plain step's last logits (within 5 % of their largest magnitude: a
    GPU's masked kernel rounds differently). A model that builds its masks without the cache's
    ``make_mask`` (or a windowed one over plain KV) gets misaligned or failing attention there,
    and keeps mlx-lm's steps."""
    ids = list(range(1, 25))
    try:
        plain, base = make_prompt_cache(model), make_prompt_cache(model)
        if not applies(plain):
            return False
        for c in (plain, base):
            model(mx.array([ids[:13]]), cache=c)
            mx.eval([x.state for x in c])
        want = model(mx.array([ids[13:]]), cache=plain)[0, -1].astype(mx.float32)
        _, got = forward(model, base, ids[13:], step, logits=True)
        assert got is not None
        gap = mx.abs(got[0].astype(mx.float32) - want).max()
        return bool(gap <= 0.05 * mx.abs(want).max())
    except Exception as e:  # shapes that do not broadcast, NotPadded, ...
        log.info("padded prefill steps do not fit this model (%s: %s)", type(e).__name__, e)
        return False


def applies(caches: Sequence[Any]) -> bool:
    """True when every layer is a plain ``KVCache`` (padding tokens enter no other state)."""
    return all(type(c) is C.KVCache for c in caches)


def forward(model: Any, caches: list[Any], tokens: Sequence[int], step: int,
            logits: bool = False) -> tuple[list[Any], mx.array | None]:  # fmt: skip
    """One prefill step of ``tokens`` onto plain ``caches`` in few attention shapes: new caches
    holding exactly the previous tokens plus ``tokens`` (buffers :func:`capacity` long), and the
    last token's logits when ``logits``. ``caches`` are left as they were."""
    n, start = len(tokens), caches[0].offset
    rows = query_rows(n) if padded(start, n, step) else n
    stepping = []
    for c in caches:
        p = PaddedKVCache(step)
        p.keys, p.values, p.offset = c.keys, c.values, c.offset
        stepping.append(p)
    out = model(mx.array([list(tokens) + [tokens[-1]] * (rows - n)]), cache=stepping)
    last = out[:, n - 1, :] if logits else None
    new = []
    for p in stepping:
        c = C.KVCache()
        c.keys, c.values, c.offset = p.keys, p.values, start + n
        new.append(c)
    mx.eval(([last] if last is not None else []) + [c.keys for c in new] + [c.values for c in new])
    return new, last
