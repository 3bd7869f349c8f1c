"""tiered_kv/memory.py: the device's capacity is known on every backend, and the probe reports
how far active memory is over a threshold of it."""

from __future__ import annotations

from tests.fixtures import FakeProbe
from tiered_kv.memory import MemoryProbe, device_memory_bytes


def test_capacity_defaults_to_the_device():
    assert 0 < device_memory_bytes()
    assert MemoryProbe().capacity == device_memory_bytes()
    assert MemoryProbe(capacity=123).capacity == 123
    assert MemoryProbe().active() >= 0


def test_over_threshold_is_the_excess_or_zero():
    probe = FakeProbe(active=900, capacity=1000)
    assert probe.over_threshold(0.5) == 400
    probe.value = 300
    assert probe.over_threshold(0.5) == 0
