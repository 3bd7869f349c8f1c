"""tiered_kv/cold/budget.py: pure LRU victim selection."""

from __future__ import annotations

from tiered_kv.cold.budget import Item, select_victims


def _items():
    return [Item("new", 100, 30.0), Item("old", 100, 10.0), Item("mid", 100, 20.0)]


def test_lru_victims_until_under_budget():
    plan = select_victims(_items(), used=300, incoming=100, budget=300, free=10**9, floor=0)
    assert [v.key for v in plan.victims] == ["old"] and plan.fits


def test_free_floor_evicts_too():
    plan = select_victims(_items(), used=300, incoming=100, budget=10**9, free=150, floor=200)
    assert [v.key for v in plan.victims] == ["old", "mid"] and plan.fits


def test_nothing_to_do_and_cannot_fit():
    assert select_victims(_items(), used=300, incoming=0, budget=300, free=1, floor=0).victims == []
    plan = select_victims(_items(), used=350, incoming=500, budget=400, free=10**9, floor=0)
    assert not plan.fits and len(plan.victims) == 3
