"""open_cache: the one place that decides which tiers are on and builds them for one model.

Owner of construction and wiring: the fingerprint (model identity + stored-KV format + layer
layout + salt + MLX and mlx-lm versions), the cold tier (``TIERED_KV_TIERS`` has ``cold``), the shared tier behind it
(``TIERED_KV_SHARED``), and the restore planner with this machine's learned costs (given a
``compute`` function). Call it on the thread that owns MLX: it makes a probe cache, and a
calibration (first start with disk entries and no learned costs) prefills on the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx_lm

from tiered_kv import keys, layers
from tiered_kv.config import Config
from tiered_kv.tiered import TieredCache

if TYPE_CHECKING:  # the restorer's modules load when a cold tier is opened
    from tiered_kv.restore.restorer import Compute


class CacheDirError(OSError):
    """The cold tier's directory cannot be opened or created at start."""


def fingerprint(config: Config, model_identity: Mapping[str, str], probe: list[Any]) -> str:
    """The key every stored entry of this model is filed under (see :func:`keys.fingerprint`):
    ``model_identity`` (e.g. :func:`tiered_kv.model_identity`) plus what this config and the
    model's cache layout (``probe``, one fresh prompt cache) change about the stored KV."""
    parts = {
        **model_identity,
        "kv_bits": str(config.kv_bits),
        "layout": layers.layout(probe),
        "salt": config.cache_salt,
        **code_versions(),
    }
    return keys.fingerprint(parts)


def code_versions() -> dict[str, str]:
    """The code that computes the KV: an upgrade of MLX or mlx-lm (a fixed RoPE, a changed
    attention) must not be served the KV the old code computed, here or by servers sharing the
    directory or Redis. One cache flush per upgrade."""
    return {"mlx": getattr(mx, "__version__", "?"), "mlx_lm": mlx_lm.__version__}


def open_cache(
    config: Config,
    model_identity: Mapping[str, str],
    make_cache: Callable[[], list[Any]],
    compute: Compute | None = None,
) -> TieredCache:
    """The tiered cache for one model.

    ``make_cache`` returns the model's fresh prompt cache (``lambda:
    mlx_lm.models.cache.make_prompt_cache(model)``). ``compute`` (optional) prefills fresh caches;
    with it, disk hits are planned (load, recompute or both, by learned costs); without it they
    are always loaded. ``config.prefill_chunk`` is taken as ``compute``'s prefill step (the caller
    resolves 0, auto, to the step it uses): a `both` computes whole steps. Raises
    :class:`CacheDirError` when the cold tier's directory cannot be opened. The caller owns the
    result and must ``close()`` it (writes what memory holds to disk).
    """
    probe = make_cache()
    fp = fingerprint(config, model_identity, probe)
    cold = _open_cold(config, fp) if config.cold_enabled else None
    shared = None
    if cold is not None and config.shared_enabled:  # [shared tier, issue 17] behind the disk
        from tiered_kv.shared.link import SharedLink

        shared = SharedLink.open(config, cold.fingerprint)
        cold.publish_to(shared.published)  # every entry written locally is published too
    cache = TieredCache(config, make_cache, cold, shared=shared)
    cache.fingerprint = fp
    if cold is not None and compute is not None:
        cache.restorer = _restorer(config, cold, probe, compute)
    return cache


def _open_cold(config: Config, fp: str) -> Any:
    from tiered_kv.cold import gpu, landing
    from tiered_kv.cold.tier import ColdTier

    try:
        cold = ColdTier(config.cache_dir, fp, config)
    except OSError as e:  # misconfiguration at start: say which setting, not a traceback
        raise CacheDirError(f"TIERED_KV_DIR={config.cache_dir}: {e.strerror or e}") from e
    if not landing.host_arrays():
        gpu.shared()  # CUDA: the pinned slots opened now, not on the first disk hit (~40 ms)
    return cold


def _restorer(config: Config, cold: Any, probe: list[Any], compute: Compute) -> Any:
    """issue 15: the disk-hit planner with this machine's learned costs."""
    from tiered_kv.restore.costs import CostBook
    from tiered_kv.restore.restorer import Restorer, blocker_of, calibrate

    device = str(mx.default_device())
    costs = CostBook(CostBook.file_for(cold.dir, device), cold.fingerprint, device)
    mode: Any = config.restore  # validated by config: auto | load | compute | both
    r = Restorer(mode, costs, compute, blocker_of(probe), config.kv_bits, config.kv_group_size,
                 step=config.prefill_chunk or 1)  # fmt: skip
    if costs.learned.prefill is None and config.restore == "auto" and cold.stats()["entries"]:
        calibrate(compute, costs)  # the first disk hit must not plan blind
    return r
