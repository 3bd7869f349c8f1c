"""Disk budget policy: a pure function from usage metadata to LRU victims. No I/O."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    """One deletable unit under the cache dir (an entry, a stale fingerprint dir, a stray file)."""

    key: Hashable
    nbytes: int
    last_used: float


@dataclass(frozen=True)
class Plan:
    victims: list[Item]
    fits: bool  # False: even deleting every candidate leaves no room for ``incoming``


def select_victims(
    items: Iterable[Item],
    *,
    used: int,
    incoming: int,
    budget: int,
    free: int,
    floor: int,
) -> Plan:
    """Least recently used first, until ``used + incoming <= budget`` and the file system keeps
    ``floor`` bytes free after writing ``incoming`` bytes.

    ``used`` counts everything under the cache dir (non-deletable bytes such as the live index
    included); ``items`` are the deletable units.
    """
    victims: list[Item] = []
    freed = 0

    def ok() -> bool:
        return used - freed + incoming <= budget and free + freed - incoming >= floor

    for item in sorted(items, key=lambda i: (i.last_used, str(i.key))):
        if ok():
            break
        victims.append(item)
        freed += item.nbytes
    return Plan(victims, ok())
