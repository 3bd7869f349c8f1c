"""Security: cache files private to their user, tenants separated by a salt, no request field
becomes a path, the API key compared in constant time."""

from __future__ import annotations

import inspect
import stat
from pathlib import Path

import httpx
import numpy as np
from mlx_lm.models.cache import KVCache

import engine.http_edge
import engine.server
from tests.reliability.server import Server
from tests.serving import clean_env
from tiered_kv.cold.tier import ColdTier
from tiered_kv.config import Config


def kv(n: int) -> KVCache:
    import mlx.core as mx

    c = KVCache()
    x = mx.random.normal((1, 2, n, 16))
    c.update_and_fetch(x, x)
    return c


def test_cache_files_are_private(tmp_path):
    tier = ColdTier(tmp_path, "fp", Config(cache_dir=tmp_path, block_tokens=16))
    tier.persist(np.arange(40), [kv(40)])
    tier.spill(np.arange(40) + 100, [kv(40)])
    tier.flush()
    tier.close()
    seen = 0
    for p in [tmp_path, *tmp_path.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        want = 0o700 if p.is_dir() else 0o600
        assert mode & 0o077 == 0, f"{p} is {oct(mode)}"  # nothing for group or others
        assert mode == want or p.is_dir(), f"{p} is {oct(mode)}"
        seen += 1
    assert seen >= 5  # root, fingerprint dir, index dir + db, two entry files


def test_salted_tenants_share_nothing(tmp_path):
    ids = np.arange(48)
    a = ColdTier(tmp_path, "fp", Config(cache_dir=tmp_path, block_tokens=16, cache_salt="tenant-a"))
    b = ColdTier(tmp_path, "fp", Config(cache_dir=tmp_path, block_tokens=16, cache_salt="tenant-b"))
    a.persist(ids, [kv(48)])
    assert a.lookup(ids) is not None
    assert b.lookup(ids) is None  # b cannot see (nor time) a's prefixes
    assert a.dir != b.dir and a.fingerprint != b.fingerprint
    a.close()
    b.close()


def test_no_request_field_becomes_a_path(tiny_model_dir, tmp_path):
    kv_dir = tmp_path / "kv"
    s = Server(tiny_model_dir, clean_env(TIERED_KV_DIR=str(kv_dir), TIERED_KV_MODELS_DIR=str(tmp_path / "m"),
                                         TIERED_KV_BLOCK_TOKENS="16"), tmp_path / "log").start()  # fmt: skip
    try:
        evil = ["../../../../tmp/owned", "/etc/passwd", str(tmp_path / "owned"), "..", "x/../../y"]
        for name in evil:
            for path, body in (
                (
                    "/v1/chat/completions",
                    {
                        "model": name,
                        "messages": [{"role": "user", "content": name}],
                        "max_tokens": 2,
                        "user": name,
                    },
                ),  # fmt: skip
                ("/v1/completions", {"model": name, "prompt": name * 10, "max_tokens": 2}),
            ):
                r = httpx.post(s.url + path, json=body, timeout=60)
                assert r.status_code == 200, r.text
    finally:
        s.stop()
    assert not (tmp_path / "owned").exists() and not Path("/tmp/owned").exists()
    names = {p.name for p in kv_dir.iterdir()}
    assert all(n == "quarantine" or all(ch in "0123456789abcdef" for ch in n) for n in names), names


def test_api_key_is_compared_in_constant_time():
    src = inspect.getsource(engine.server) + inspect.getsource(engine.http_edge)
    assert "hmac.compare_digest" in src
    assert "== self.config.api_key" not in src and "api_key ==" not in src


def test_serve_refuses_a_cache_dir_others_can_write_in_one_line(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys

    kv_dir = tmp_path / "kv"
    kv_dir.mkdir()
    os.chmod(kv_dir, 0o777)  # e.g. made under umask 000: anyone could plant entries or an index
    env = clean_env(TIERED_KV_DIR=str(kv_dir), TIERED_KV_MODELS_DIR=str(tmp_path / "m"))
    r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny_model_dir),
                        "--port", "9"], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-800:]
    assert "writable by other users" in r.stderr and "TIERED_KV_DIR" in r.stderr, r.stderr[-800:]
