"""Corruption of every kind of cache file, and disk faults (ENOSPC, read-only, directory deleted),
at the ColdTier / TieredCache level with a real mlx-lm model: every fault is detected (quarantined,
counted, logged once) and every answer equals the cold (no-cache) answer."""

from __future__ import annotations

import errno
import logging
import os
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from tests.fixtures import flip_byte, make_llama
from tiered_kv import keys
from tiered_kv.cold import backend
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache

FP = keys.fingerprint({"model": "reliability"})
BLOCK = 16


@pytest.fixture(scope="module")
def model() -> llama.Model:
    return make_llama(seed=7)


def prompts(seed: int, n: int, length: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 256, 20).tolist()  # a shared prefix: partial hits too
    return [system + rng.integers(0, 256, length - 20).tolist() for _ in range(n)]


def greedy(model: llama.Model, caches: list, ids: list[int], n: int = 4) -> list[int]:
    out = []
    logits = model(mx.array([ids]), cache=caches)
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=caches)
    return out


def cold_answer(model: llama.Model, ids: list[int]) -> list[int]:
    return greedy(model, make_prompt_cache(model), ids)


def answer(model: llama.Model, cache: TieredCache, ids: list[int]) -> tuple[list[int], str]:
    """Serve ``ids`` through the cache (like the engine: prefill the rest, store the prompt)."""
    lease = cache.fetch(ids)
    logits = model(mx.array([lease.remaining]), cache=lease.caches)
    mx.eval(logits, [c.state for c in lease.caches])
    cache.store(lease, ids)
    first = int(mx.argmax(logits[0, -1]).item())
    fresh = cache.fetch(ids)  # then the continuation from what is stored now
    rest = greedy(model, fresh.caches, fresh.remaining, 4)
    return ([first] if rest[0] == first else [first, -1]) + rest[1:], lease.hit.tier


def make_cache(model: llama.Model, root: Path, **kw: object) -> TieredCache:
    cfg = Config(cache_dir=root, block_tokens=BLOCK, disk_free_floor=0, **kw)
    return TieredCache(cfg, lambda: make_prompt_cache(model), ColdTier(root, FP, cfg))


def entry_files(cache: TieredCache) -> list[Path]:
    assert cache.cold is not None
    return sorted(cache.cold.dir.glob("*.safetensors"), key=lambda p: p.name)  # type: ignore[attr-defined]


def _flip(path: Path, offset: int) -> None:
    flip_byte(path, offset % path.stat().st_size, 0x04)


def _damage(
    kind: str, paths: list[Path], root: Path, fp_dir: Path, rng: np.random.Generator
) -> int:
    """Apply ``kind``; returns how many entry files it made unservable."""
    a, b = paths[0], paths[1]
    if kind == "truncate":
        os.truncate(a, int(rng.integers(1, a.stat().st_size)))
    elif kind == "bitflip_header":
        _flip(a, 8 + int(rng.integers(0, 64)))
    elif kind == "bitflip_data":
        _flip(a, a.stat().st_size - 1 - int(rng.integers(0, 512)))
    elif kind == "zero_fill":
        a.write_bytes(bytes(a.stat().st_size))
    elif kind == "zero_page":
        data = bytearray(a.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 4096] = bytes(min(4096, len(data) - len(data) // 2))
        a.write_bytes(bytes(data))
    elif kind == "swap":
        tmp = a.with_suffix(".x")
        os.replace(a, tmp)
        os.replace(b, a)
        os.replace(tmp, b)
        return 2
    elif kind == "foreign_dir":  # another model's fingerprint dir copied in, files renamed
        other = root / "other-model"
        for i, p in enumerate(sorted(other.glob("*.safetensors"))):
            shutil.copy(p, fp_dir / f"f{i:031d}.safetensors")
        shutil.copy(next(iter(sorted(other.glob("*.safetensors")))), a)  # and over one of ours
    elif kind == "index_deleted":
        shutil.rmtree(fp_dir / "index")
        return 0
    elif kind == "index_garbage":
        for p in (fp_dir / "index").glob("cache.db*"):
            p.write_bytes(rng.bytes(8192))
        return 0
    elif kind == "index_truncated":
        for p in (fp_dir / "index").glob("cache.db*"):
            os.truncate(p, p.stat().st_size // 3)
        return 0
    else:
        raise AssertionError(kind)
    return 1


KINDS = ["truncate", "bitflip_header", "bitflip_data", "zero_fill", "zero_page", "swap",
         "foreign_dir", "index_deleted", "index_garbage", "index_truncated"]  # fmt: skip


def _foreign(model: llama.Model, root: Path) -> None:
    """Entry files of another model (other fingerprint) at ``root/other-model``."""
    cfg = Config(cache_dir=root, block_tokens=BLOCK, tiers=("cold",))
    other = ColdTier(root / "o", "another-model", cfg)
    for ids in prompts(99, 2):
        c = make_prompt_cache(model)
        model(mx.array([ids]), cache=c)
        mx.eval([x.state for x in c])
        other.persist(np.array(ids), c)
    other.close()
    shutil.copytree(other.dir, root / "other-model")
    shutil.rmtree(root / "o")


@pytest.mark.parametrize("kind", KINDS)
def test_corruption_is_quarantined_and_answers_equal_cold(model, tmp_path, kind):
    rng = np.random.default_rng(KINDS.index(kind))
    root = tmp_path / "kv"
    ps = prompts(KINDS.index(kind), 3)
    want = [cold_answer(model, p) for p in ps]
    cache = make_cache(model, root, tiers=("cold",))
    for p in ps:
        assert answer(model, cache, p)[0] == cold_answer(model, p)
    paths = entry_files(cache)
    fp_dir = cache.cold.dir
    assert len(paths) == 3
    cache.close()
    if kind == "foreign_dir":
        _foreign(model, tmp_path)
        shutil.move(str(tmp_path / "other-model"), root / "other-model")
    bad = _damage(kind, paths, root, fp_dir, rng)
    cache = make_cache(model, root, tiers=("cold",))  # restart on the damaged directory
    tiers = []
    for p, w in zip(ps, want, strict=True):
        got, tier = answer(model, cache, p)
        assert got == w, kind
        tiers.append(tier)
    st = cache.stats()
    assert st["cold_quarantined"] >= bad, st
    assert tiers.count("cold") >= 3 - bad - (1 if kind == "swap" else 0)
    report = cache.cold.verify()
    assert not report.corrupt and not report.foreign, report  # nothing bad left being served
    cache.close()


@pytest.mark.parametrize("fault", ["enospc", "erofs", "dir_deleted"])
def test_disk_fault_keeps_answering_and_is_counted_once(
    model, tmp_path, monkeypatch, caplog, fault
):
    root = tmp_path / "kv"
    cache = make_cache(model, root, hot_bytes=1)  # every store evicts the previous entry: spills
    ps = prompts(5, 8)
    real_open, real_replace = os.open, os.replace
    code = errno.ENOSPC if fault == "enospc" else errno.EROFS

    def is_cache_write(path: object, flags: int = os.O_WRONLY) -> bool:
        return str(path).startswith(str(root)) and bool(flags & (os.O_WRONLY | os.O_RDWR))

    def bad_open(path, flags, *a, **k):
        if is_cache_write(path, flags):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *a, **k)

    def bad_replace(src, dst, *a, **k):
        if is_cache_write(dst):
            raise OSError(code, os.strerror(code), str(dst))
        return real_replace(src, dst, *a, **k)

    answer(model, cache, ps[0])
    cache.cold.flush()
    with caplog.at_level(logging.WARNING, logger="tiered_kv"):
        if fault == "dir_deleted":
            shutil.rmtree(root)
        else:
            monkeypatch.setattr(os, "open", bad_open)
            monkeypatch.setattr(os, "replace", bad_replace)
        for p in ps[1:] + ps[:3]:  # new prompts and repeats
            got, _ = answer(model, cache, p)
            assert got == cold_answer(model, p)
        cache.cold.flush()
        monkeypatch.undo()
    st = cache.stats()
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("tiered_kv.cold")]
    if fault == "dir_deleted":
        assert st["cold_dir_recreated"] == 1 and st["cold_write_errors"] == 0, st
        assert sum("vanished" in m for m in msgs) == 1, msgs
    else:
        key = "cold_disk_full" if fault == "enospc" else "cold_read_only"
        assert st[key] >= 5 and st["cold_write_errors"] == st[key], st
        assert len(msgs) == 1, msgs  # logged once however often it happens
        assert not list(root.rglob(f"*{backend.TMP_SUFFIX}"))
    answer(model, cache, ps[0])  # the fault is gone: spills work again
    cache.cold.flush()
    assert cache.stats()["cold_spills"] > st["cold_spills"]
    cache.close()
