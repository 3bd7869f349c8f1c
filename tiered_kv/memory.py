"""How much device memory MLX may use, and how much it uses now.

Metal: the recommended working set; CUDA: the device's total memory; CPU: MLX's memory limit
capped by physical RAM. Tests replace :class:`MemoryProbe` with a fake reading.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx


def device_memory_bytes() -> int:
    """Memory MLX can use on its default device."""
    try:
        info = mx.device_info()
    except Exception:  # older MLX: no generic device_info
        info = {}
    for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
        if key in info and int(info[key]) > 0:
            return int(info[key])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = mx.get_memory_limit()
    return min(ram, limit) if limit > 0 else ram


@dataclass
class MemoryProbe:
    """Reads MLX's active memory against the device's capacity."""

    capacity: int = 0

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            self.capacity = device_memory_bytes()

    def active(self) -> int:
        return int(mx.get_active_memory())

    def over_threshold(self, threshold: float) -> int:
        """Bytes by which active memory exceeds ``threshold × capacity`` (0 when below)."""
        return max(0, self.active() - int(threshold * self.capacity))
