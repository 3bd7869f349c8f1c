"""Shared test helpers of the library side (``tiered_kv``): tiny models, caches, tiers, files.

One owner for every helper more than one test file uses. Nothing here imports ``engine``: the
library's tests must run without the server (``tests/test_layout.py`` checks it). Server-side
helpers (ports, server processes, tool schemas) live in ``tests/serving.py``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import queue
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
import pytest
import xxhash
from mlx_lm.models import cache as C
from mlx_lm.models import gemma3_text, llama, qwen3_next
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from tiered_kv import checkpoints, keys, layers
from tiered_kv.cold import checksums, gpu, pages, store
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config
from tiered_kv.memory import MemoryProbe
from tiered_kv.opening import open_cache
from tiered_kv.tiered import HitInfo, Lease, TieredCache

if TYPE_CHECKING:
    from tiered_kv.shared.redis_tier import SharedTier

# --- a tiny llama, built in memory (no tokenizer) -------------------------------------------------

VOCAB = 256
HEAD_DIM_64 = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)


#: mlx-cuda 0.32.4 has no float32 ``quantized_matmul`` for the test models' shapes ("No implementation
#: for problem shape: 8x8x64x2 ..."): a quantised model or KV cache cannot run there
CUDA_QUANTIZED_GAP = getattr(mx, "cuda", None) is not None and mx.cuda.is_available()


def f32_tol(cpu: float) -> float:
    """Tolerance of a float32 comparison between computations cut or batched differently: ``cpu``
    on the CPU (where they agree to rounding); 2e-3 on a GPU, whose kernels differ by shape (H100,
    mlx-cuda 0.32.4: KV of other prefill steps parted by up to 3.1e-4, a padded batch's
    log-probabilities by up to 8.2e-4)."""
    return cpu if mx.default_device() == mx.cpu else 2e-3


def make_llama(seed: int = 0, layers: int = 2, **shape: Any) -> llama.Model:
    """A real mlx-lm llama with random weights: hidden 64, 4 heads (2 KV heads), vocab 256 unless
    ``shape`` says otherwise (:data:`HEAD_DIM_64`: the head_dim that 8-bit KV quantisation needs)."""
    mx.random.seed(seed)
    args = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
    )
    model = llama.Model(llama.ModelArgs(**{**args, **shape}))
    mx.eval(model.parameters())
    return model


def big_kv(tokens: int) -> C.KVCache:
    """A plain KV cache of ``tokens`` tokens, 1 KiB per token per array (bf16, 4 heads x 128):
    entries of several checksum chunks per tensor from a few thousand tokens."""
    c = C.KVCache()
    x = mx.random.normal((1, 4, tokens, 128)).astype(mx.bfloat16)
    c.update_and_fetch(x, -x)
    mx.eval(c.keys, c.values)
    return c


def tokens(seed: int, n: int) -> list[int]:
    """``n`` random token ids below :data:`VOCAB`, the same for the same seed."""
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


def feed(model, caches, ids) -> np.ndarray:
    """Run ``ids`` through the model on ``caches``; next-token logits after the last id."""
    out = model(mx.array([list(ids)]), cache=caches)
    mx.eval(out, [c.state for c in caches])
    return np.array(out[0, -1, :])


def cold_logits(model, ids) -> np.ndarray:
    """The logits after ``ids`` from empty caches: what every cache hit must equal."""
    return feed(model, make_prompt_cache(model), ids)


def prefill(
    model, lease: Lease, fed: list[int], chunk_size: int, cuts: Sequence[int] = ()
) -> mx.array:
    """The engine's suffix prefill (``engine/prefill.py``), for the library's tests, which must not
    import the engine: ``lease.remaining`` in evaluated chunks that end at ``cuts`` (checkpoints
    taken there), the last id fed alone; ``fed`` grows. Returns the last position's logits."""
    rem = lease.remaining
    start, body, i = len(fed), len(lease.remaining) - 1, 0
    while i < body:
        end = min([i + chunk_size, body] + [c - start for c in cuts if c - start > i])
        model(mx.array([rem[i:end]]), cache=lease.caches)
        mx.eval([c.state for c in lease.caches])
        fed.extend(rem[i:end])
        _checkpoint(lease, len(fed), cuts)
        i = end
    logits = model(mx.array([rem[-1:]]), cache=lease.caches)[0, -1, :]
    mx.eval([logits] + [c.state for c in lease.caches])
    fed.append(rem[-1])
    _checkpoint(lease, len(fed), cuts)
    return logits


def _checkpoint(lease: Lease, n: int, cuts: Sequence[int]) -> None:
    checkpoints.take(lease.checkpoints, n, cuts, lease.caches)


def prefill_turn(tc: TieredCache, model, ids: list[int]) -> tuple[np.ndarray, HitInfo]:
    """One request through ``tc``: fetch, :func:`prefill` the suffix in 16-token chunks, store."""
    lease = tc.fetch(ids)
    fed = ids[: lease.hit.tokens]
    logits = np.array(prefill(model, lease, fed, 16))
    tc.store(lease, fed)
    return logits, lease.hit


# --- the cache types mlx-lm models make -----------------------------------------------------------

EOS = 2  # the end-of-message id of the cache-type models: a checkpoint after each


EVERY = 16  # … and one every EVERY tokens


def gemma() -> gemma3_text.Model:
    """gemma3_text: sliding-window RotatingKVCache layers between KVCache layers."""
    mx.random.seed(1)
    m = gemma3_text.Model(
        gemma3_text.ModelArgs(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=4,
            head_dim=16,
            num_key_value_heads=2,
            vocab_size=256,
            sliding_window=16,
            sliding_window_pattern=2,
            query_pre_attn_scalar=16,
        )
    )
    mx.eval(m.parameters())
    return m


def qwen_next() -> qwen3_next.Model:
    """qwen3_next: recurrent ArraysCache layers between KVCache layers."""
    mx.random.seed(2)
    m = qwen3_next.Model(
        qwen3_next.ModelArgs(
            model_type="qwen3_next",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=4,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            num_experts=0,
            num_experts_per_tok=1,
            decoder_sparse_step=1,
            shared_expert_intermediate_size=128,
            mlp_only_layers=[0, 1, 2, 3],
            moe_intermediate_size=64,
            rms_norm_eps=1e-5,
            vocab_size=256,
            num_key_value_heads=2,
            rope_theta=10000.0,
            partial_rotary_factor=0.5,
            max_position_embeddings=4096,
            head_dim=16,
            full_attention_interval=2,
        )
    )
    mx.eval(m.parameters())
    return m


class Steps:
    """A real model that records the length of every forward (``lengths``)."""

    def __init__(self, model) -> None:
        self.model, self.lengths = model, list[int]()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, x, cache=None):
        self.lengths.append(x.shape[-1])
        return self.model(x, cache=cache)


class QuantizedLlama:
    """A llama whose model cache is mlx-lm's QuantizedKVCache (8-bit, group 64)."""

    def __init__(self) -> None:
        self.inner = make_llama(seed=3, **HEAD_DIM_64)
        self.layers, self.args = self.inner.layers, self.inner.args

    def __call__(self, x, cache):
        return self.inner(x, cache=cache)

    def make_cache(self):
        return [QuantizedKVCache(group_size=64, bits=8) for _ in self.layers]


def checkpointed_turn(tc: TieredCache, model, ids: list[int]) -> tuple[np.ndarray, int]:
    """One request through ``tc`` with checkpoints where the model needs them (:data:`EOS`,
    :data:`EVERY`): fetch, :func:`prefill` in 8-token chunks, store; (logits, hit tokens)."""
    lease = tc.fetch(ids)
    fed = ids[: lease.hit.tokens]
    cuts = (
        checkpoints.positions(len(fed), lease.remaining, {EOS}, EVERY)
        if lease.needs_checkpoints
        else []
    )
    logits = prefill(model, lease, fed, 8, cuts)
    tc.store(lease, fed)
    return np.array(logits), lease.hit.tokens


# --- hot tier -------------------------------------------------------------------------------------


class FakeProbe(MemoryProbe):
    """A memory reading the test controls (only faults are faked)."""

    def __init__(self, active: int = 0, capacity: int = 1 << 40) -> None:
        super().__init__(capacity)
        self.value = active

    def active(self) -> int:
        return self.value


def hot_only(model, probe: MemoryProbe | None = None, **kw: Any) -> TieredCache:
    """A TieredCache with the hot tier alone, its memory read from ``probe`` (a :class:`FakeProbe`)."""
    cfg = Config(tiers=("hot",), **kw)
    return TieredCache(cfg, lambda: make_prompt_cache(model), None, probe or FakeProbe())


def store_turn(
    tc: TieredCache, model, prompt: list[int], extra: Sequence[int] = ()
) -> tuple[np.ndarray, int]:
    """Fetch, feed the suffix, optionally feed ``extra`` (generated ids), store: (logits, hit tokens)."""
    lease = tc.fetch(prompt)
    assert lease.remaining == prompt[lease.hit.tokens :]
    logits = feed(model, lease.caches, lease.remaining)
    fed = list(prompt)
    if extra:
        feed(model, lease.caches, extra)
        fed += list(extra)
    tc.store(lease, fed)
    return logits, lease.hit.tokens


#: the model identity :func:`open_tc` files entries under
IDENTITY = {"model": "test-fingerprint"}


def open_tc(model, root, **kw) -> TieredCache:
    """Through the door: open_cache decides which tiers are on (``tiers=()``: none)."""
    kw.setdefault("cold_deadline", 30.0)  # a loaded machine must not turn a lookup into a miss
    cfg = Config(cache_dir=root, block_tokens=16, **kw)
    return open_cache(cfg, IDENTITY, lambda: make_prompt_cache(model))


def entry_arrays(entry) -> dict[str, np.ndarray]:
    """A stored entry's arrays, copied out (to compare before / after)."""
    arrays, _ = layers.encode(entry.caches)
    return {k: np.array(v) for k, v in arrays.items()}


# --- cold tier ------------------------------------------------------------------------------------

TIER_FP = keys.fingerprint({"model": "test"})
BLOCK = 4  # block tokens of :func:`cold_tier`


def cold_tier(root: Path, **kw) -> ColdTier:
    """A ColdTier under ``root`` with :data:`BLOCK`-token blocks and fingerprint :data:`TIER_FP`."""
    # a loaded test machine can take longer than the 0.5 s lookup deadline: a miss there is not
    # what these tests check (tests/tiered_kv/cold/test_reader.py tests the deadline itself)
    kw.setdefault("cold_deadline", 30.0)
    cfg = Config(cache_dir=root, block_tokens=BLOCK, **kw)
    return ColdTier(root, TIER_FP, cfg)


def kv_cache(n: int, d: int = 8, dtype=mx.bfloat16) -> C.KVCache:
    """A KVCache holding ``n`` random tokens (2 heads of width ``d``; values = 2 × keys)."""
    c = C.KVCache()
    x = mx.random.normal((1, 2, n, d)).astype(dtype)
    c.update_and_fetch(x, x * 2)
    return c


def flip_byte(path: Path, offset: int, mask: int = 0x10) -> None:
    """XOR the byte at ``offset`` of ``path`` (negative: from the end) with ``mask``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        at = f.tell()
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))


def entry_file(tier: ColdTier) -> Path:
    """The tier's one entry file."""
    (path,) = tier.dir.glob("*.safetensors")
    return path


def damage_index(tier: ColdTier, sql: str, *params: object) -> None:
    """Run ``sql`` (an UPDATE no writer of ours makes) on ``tier``'s index file with a plain
    sqlite connection of its own, committed: sqlite's columns take any type."""
    import sqlite3

    con = sqlite3.connect(tier.dir / "index" / "cache.db")
    try:
        con.execute(sql, params)
        con.commit()
    finally:
        con.close()


def rewrite_meta(path: Path, **changes: str) -> None:
    """Re-sign a file with changed metadata (a well-formed foreign file)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    meta.update(changes)
    new = store.header_bytes(head, meta)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


def with_tensors(raw: bytes, extra: dict[str, bytes], **changes: str) -> bytes:
    """The entry ``raw`` with one-dimensional U8 tensors ``extra`` appended (their chunk digests
    added) and its metadata changed by ``changes``, re-signed: a header anyone who can write the
    cache dir can make (its checksum is a public xxh3)."""
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8 : 8 + n])
    meta = head.pop("__metadata__")
    sums, chunk = json.loads(meta["xxh3"]), int(meta["chunk_bytes"])
    end = max(t["data_offsets"][1] for t in head.values())
    for name, data in extra.items():
        head[name] = {"dtype": "U8", "shape": [len(data)], "data_offsets": [end, end + len(data)]}
        sums[name] = checksums.chunk_digests([memoryview(data)] if data else [], chunk)
        end += len(data)
    meta.update(changes, xxh3=json.dumps(sums, separators=(",", ":")))
    new = store.header_bytes(head, meta)
    return struct.pack("<Q", len(new)) + new + raw[8 + n :] + b"".join(extra.values())


def precious(outside: Path, name: str = "model.safetensors", size: int = 4096) -> Path:
    """A file outside the cache dir that nothing may touch (old mtime: first in any LRU)."""
    outside.mkdir(parents=True, exist_ok=True)
    p = outside / name
    p.write_bytes(b"w" * size)
    os.chmod(p, 0o644)
    os.utime(p, (1e9, 1e9))
    return p


def intact(p: Path, size: int = 4096) -> bool:
    """``p`` is still the untouched :func:`precious` file."""
    return p.is_file() and p.read_bytes() == b"w" * size and stat.S_IMODE(p.stat().st_mode) == 0o644


# --- network --------------------------------------------------------------------------------------


def dead_pid() -> int:
    """A process id no process can have (one past the kernel's ``pid_max``): a dead writer's.
    A small constant (123) was a live process on the device machine."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    except (OSError, ValueError):
        return (1 << 22) + 1


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HostUpload:
    """:class:`tiered_kv.cold.gpu.Upload`'s interface where the CPU has no GPU: slots are plain
    buffers and a "copy" is a ``memmove`` into host memory, done at once. It drives the readers'
    real staging path (whole chunks into a slot, verified there, the destination's part copied
    out) on the CPU; the real upload is run on CUDA by ``tests/tiered_kv/cold/test_gpu.py``.
    Records every copy (destination address, bytes), the copies issued before each wait, and
    each population asked for (its extents, with the copies issued before it)."""

    def __init__(self, slot_bytes: int = 1 << 20, slots: int = 3, fail_after: int | None = None):
        self.slot_bytes, self.bytes = slot_bytes, 0
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()  # taken as the real
        for _ in range(slots):  # one's: a reader waits while every slot is in use
            self._free.put(np.empty(slot_bytes, np.uint8))
        self._lock = threading.Lock()
        self.copies: list[tuple[int, int]] = []
        self.waits: list[int] = []
        self.populated: list[tuple[list[tuple[int, int]], int]] = []  # (extents, copies before)
        self.fail_after = fail_after  # raise gpu.DeviceError at that copy

    def batch(self) -> HostUpload:
        return self

    def populate(self, extents: list[tuple[int, int]]) -> None:
        with self._lock:
            self.populated.append((list(extents), len(self.copies)))

    def slot(self) -> Any:
        up = self

        class _Slot:
            def __enter__(self) -> Any:
                self.arr = up._free.get()
                self.buf = self.arr.data.cast("B")
                return self

            def copy(self, start: int, nbytes: int, dst: int) -> None:
                with up._lock:
                    if up.fail_after is not None and len(up.copies) >= up.fail_after:
                        raise gpu.DeviceError("injected: cuMemcpyHtoDAsync_v2 returned 700")
                    up.copies.append((dst, nbytes))
                    up.bytes += nbytes
                ctypes.memmove(dst, self.arr.ctypes.data + start, nbytes)

            def __exit__(self, *exc: object) -> None:
                up._free.put(self.arr)

        return _Slot()

    def wait(self) -> None:
        with self._lock:
            self.waits.append(len(self.copies))


#: a cold index as schema 2 first made it: no prompt / serving columns, one entry
INDEX_BEFORE_ADDED_COLUMNS = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE entries(id TEXT PRIMARY KEY, file TEXT NOT NULL, n_tokens INTEGER NOT NULL,
    nbytes INTEGER NOT NULL, created REAL NOT NULL, last_used REAL NOT NULL, tokens BLOB NOT NULL);
CREATE TABLE blocks(hash INTEGER NOT NULL, entry TEXT NOT NULL, depth INTEGER NOT NULL,
    last INTEGER NOT NULL);
INSERT INTO entries VALUES('old', 'old.safetensors', 8, 1, 1, 1, zeroblob(32));
"""


# --- the shared tier's byte mechanics: a toy entry format ---------------------------------------------
# ``tokens ‖ payload ‖ xxh3``, checked by :func:`toy_check` (tests/tiered_kv/shared/test_redis_tier.py,
# test_writes.py, test_health.py); test_link.py runs the real entry format through the real cold tier.

SHARED_BLOCK = 16  # block tokens of :func:`toy_tier`


def toy_entry(tokens: list[int], payload: int = 3000) -> bytes:
    head = np.asarray([len(tokens)], "<i4").tobytes() + np.asarray(tokens, "<i4").tobytes()
    body = head + np.random.default_rng(len(tokens)).bytes(payload)
    return body + xxhash.xxh3_64_digest(body)


def toy_check(view: memoryview) -> np.ndarray:
    body, digest = bytes(view[:-8]), bytes(view[-8:])
    if xxhash.xxh3_64_digest(body) != digest:
        raise ValueError("checksum mismatch")
    n = int(np.frombuffer(body[:4], "<i4")[0])
    return np.frombuffer(body[4 : 4 + 4 * n], "<i4").copy()


def toy_ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 30000, n).tolist()


def toy_tier(url: str, fp: str = "fp-a", chunk: int = 1000, timeout: float = 0.5,
             clock: Callable[[], float] = time.monotonic) -> SharedTier:  # fmt: skip
    from tiered_kv.shared.redis_tier import SharedTier  # redis only where the shared tests run

    return SharedTier(url, fp, SHARED_BLOCK, toy_check, timeout=timeout, chunk_bytes=chunk,
                      clock=clock)  # fmt: skip


class StepClock:
    """A monotonic clock that moves only when told: the shared tier's backoff, measured in steps a
    test takes, not in seconds a loaded machine spends."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# --- what this kernel can do (skip markers of the page-level tests) -------------------------------

#: ``pages.reopen``'s own description needs Linux's /proc; elsewhere (macOS) it is a dup, as documented
needs_proc_fd = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"),
    reason="no /proc/self/fd (macOS): pages.reopen is a dup there, sharing the description")


def _populate_write() -> str | None:
    """Why this kernel cannot run the prefault tests, or None: one real
    ``madvise(MADV_POPULATE_WRITE)`` on a page of its own (Linux < 5.14 answers EINVAL)."""
    if sys.platform != "linux":
        return "MADV_POPULATE_WRITE is Linux's"
    libc = pages._libc()
    if libc is None:
        return "no C library to call madvise through"
    page = mmap.mmap(-1, mmap.PAGESIZE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    try:
        if libc.madvise(ctypes.c_void_p(addr), mmap.PAGESIZE, pages._MADV_POPULATE_WRITE) == 0:
            return None
        e = ctypes.get_errno()
    finally:
        page.close()
    return (f"this kernel lacks MADV_POPULATE_WRITE (Linux >= 5.14): madvise failed with "
            f"{errno.errorcode.get(e, e)}")  # fmt: skip


_NO_POPULATE_WRITE = _populate_write()
needs_populate_write = pytest.mark.skipif(_NO_POPULATE_WRITE is not None,
                                          reason=_NO_POPULATE_WRITE or "")  # fmt: skip
