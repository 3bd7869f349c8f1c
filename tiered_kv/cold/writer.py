"""Write-behind of the cold tier: a :class:`tiered_kv.bounded.BoundedWorker` under its names.

One thread, a FIFO bounded in bytes; :mod:`tiered_kv.bounded` has the rules.

Ownership: tasks run on the writer thread and must only touch files, the index and evaluated
arrays' bytes (never build MLX graphs).
"""

from __future__ import annotations

from tiered_kv.bounded import BoundedWorker, OnDrop


class Writer(BoundedWorker):
    def __init__(self, max_bytes: int, on_drop: OnDrop, name: str = "tiered-kv-writer") -> None:
        super().__init__(max_bytes, on_drop, name)

    flush = BoundedWorker.wait_idle

    def unwritten(self) -> list[int]:
        """Bytes of the tasks still queued (after a timed-out drain)."""
        return self.waiting()
