"""tiered_kv/opening.py: open_cache decides once which tiers are on, and builds and wires them."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache

from tiered_kv import keys, layers
from tiered_kv.config import Config
from tiered_kv.opening import CacheDirError, fingerprint, open_cache

IDENTITY = {"model": "m", "tokenizer": "t", "dtype": "bfloat16"}


def test_the_tiers_are_decided_once_by_open_cache(small_model, tmp_path):
    make = lambda: make_prompt_cache(small_model)  # noqa: E731
    hot = open_cache(Config(cache_dir=tmp_path / "a", tiers=("hot",), shared_url="redis://nowhere:1"),
                     IDENTITY, make, compute=lambda ids, held: make())  # fmt: skip
    assert hot.cold is None and hot.shared is None and hot.restorer is None
    assert not (tmp_path / "a").exists()  # an off cold tier touches no directory
    hot.close()
    both = open_cache(Config(cache_dir=tmp_path / "b"), IDENTITY, make)
    assert both.cold is not None and both.shared is None
    assert both.restorer is None  # no compute function: disk hits are always loaded
    assert both.cold.dir.parent == tmp_path / "b"  # type: ignore[attr-defined]
    both.close()


def test_a_restorer_comes_with_a_compute_function(small_model, tmp_path):
    make = lambda: make_prompt_cache(small_model)  # noqa: E731
    tc = open_cache(Config(cache_dir=tmp_path), IDENTITY, make, compute=lambda ids, held: make())
    assert tc.restorer is not None and tc.restorer.costs.fingerprint == tc.cold.fingerprint
    tc.close()


def test_the_fingerprint_keeps_the_engines_parts(small_model):
    """The same parts as before the door, and the versions of the code computing the KV."""
    probe = make_prompt_cache(small_model)
    parts = {**IDENTITY, "kv_bits": "0", "layout": layers.layout(probe), "salt": "",
             "mlx": getattr(mx, "__version__", "?"), "mlx_lm": mlx_lm.__version__}  # fmt: skip
    assert fingerprint(Config(), IDENTITY, probe) == keys.fingerprint(parts)
    assert fingerprint(Config(cache_salt="s"), IDENTITY, probe) != keys.fingerprint(parts)


@pytest.mark.parametrize("module", [mx, mlx_lm], ids=["mlx", "mlx_lm"])
def test_an_upgrade_of_mlx_or_mlx_lm_is_another_fingerprint(small_model, monkeypatch, module):
    """KV computed by the old code (before a fixed RoPE or attention) is not served after an
    upgrade: an entry on disk or in Redis stays with the versions that computed it."""
    probe = make_prompt_cache(small_model)
    before = fingerprint(Config(), IDENTITY, probe)
    monkeypatch.setattr(module, "__version__", module.__version__ + ".post1")
    assert fingerprint(Config(), IDENTITY, probe) != before


def test_an_unusable_cache_dir_is_one_typed_error(small_model, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CacheDirError, match="TIERED_KV_DIR="):
        open_cache(Config(cache_dir=tmp_path / "file"), IDENTITY, lambda: make_prompt_cache(small_model))
