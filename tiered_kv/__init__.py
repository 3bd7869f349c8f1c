"""tiered-kv: a tiered (memory → disk → shared Redis) KV prompt cache for mlx-lm — the one door.

A server imports from here and nothing deeper::

    import tiered_kv
    from mlx_lm.models.cache import make_prompt_cache

    config = tiered_kv.Config.from_env()            # TIERED_KV_* (or Config(...) by hand)
    cache = tiered_kv.open_cache(config, tiered_kv.model_identity(model_dir),
                                 lambda: make_prompt_cache(model))
    lease = cache.fetch(prompt_ids)                 # lease.caches hold lease.hit.tokens tokens
    ...                                             # prefill lease.remaining into lease.caches
                                                    # (lease.needs_checkpoints: take_checkpoint
                                                    # at each checkpoint_positions(...) position;
                                                    # a fill of many steps: reserve_room after
                                                    # its first, for room for the rest)
    cache.store(lease, ids_the_caches_hold)         # the lease is given back
    cache.close()                                   # memory's entries written to disk

Every call on the cache runs on the one thread that owns MLX. ``CacheAdmin`` inspects / verifies
/ clears a cache directory without a model (``tiered-kv cache ...``).

Names are imported on first use (PEP 562): ``from tiered_kv import Config`` loads no MLX, so a
command line can read its configuration before anything imports mlx-lm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiered_kv.admin import (
        CacheAdmin,
        NotAFingerprint,
        SharedAdmin,
        SharedUnreachable,
        UnsafeCacheDir,
    )
    from tiered_kv.checkpoints import positions as checkpoint_positions
    from tiered_kv.checkpoints import snapshot
    from tiered_kv.checkpoints import take as take_checkpoint
    from tiered_kv.config import Config, ConfigError, parse_size
    from tiered_kv.identity import model_identity
    from tiered_kv.layers import reserve as reserve_room
    from tiered_kv.opening import CacheDirError, open_cache
    from tiered_kv.tiered import HitInfo, Lease, TieredCache

#: exported name → the module that owns it ("module:name" where the name there differs)
_HOME = {
    "checkpoint_positions": "tiered_kv.checkpoints:positions",
    "snapshot": "tiered_kv.checkpoints",
    "take_checkpoint": "tiered_kv.checkpoints:take",
    "CacheAdmin": "tiered_kv.admin",
    "NotAFingerprint": "tiered_kv.admin",
    "SharedAdmin": "tiered_kv.admin",
    "SharedUnreachable": "tiered_kv.admin",
    "UnsafeCacheDir": "tiered_kv.admin",
    "Config": "tiered_kv.config",
    "ConfigError": "tiered_kv.config",
    "parse_size": "tiered_kv.config",
    "model_identity": "tiered_kv.identity",
    "reserve_room": "tiered_kv.layers:reserve",
    "CacheDirError": "tiered_kv.opening",
    "open_cache": "tiered_kv.opening",
    "HitInfo": "tiered_kv.tiered",
    "Lease": "tiered_kv.tiered",
    "TieredCache": "tiered_kv.tiered",
    "Steps": "tiered_kv.steps",
    "drain": "tiered_kv.steps",
}

__all__ = [
    "CacheAdmin",
    "CacheDirError",
    "Config",
    "ConfigError",
    "HitInfo",
    "Lease",
    "NotAFingerprint",
    "SharedAdmin",
    "SharedUnreachable",
    "Steps",
    "TieredCache",
    "UnsafeCacheDir",
    "checkpoint_positions",
    "drain",
    "model_identity",
    "open_cache",
    "parse_size",
    "reserve_room",
    "snapshot",
    "take_checkpoint",
]


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:  # submodules (``from tiered_kv import layers``) are found by the import system
        raise AttributeError(f"module 'tiered_kv' has no attribute {name!r}")
    module, _, attr = home.partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
