"""tiered_kv/shared/bulk.py against a real redis-server: SET from a view and GET into a buffer
round-trip byte for byte; a missing key is None; a value of another length is refused."""

from __future__ import annotations

import numpy as np
import pytest

from tiered_kv.shared import bulk


def test_set_from_then_get_into_round_trips(redis_server):
    client = redis_server.client()
    data = np.random.default_rng(0).bytes(3 << 20)
    bulk.set_from(client, "k", memoryview(data))
    out = bytearray(len(data))
    assert bulk.get_into(client, "k", memoryview(out)) == len(data) and bytes(out) == data
    assert client.get("k") == data  # what the plain client sees too
    assert client.ping()  # the connection went back to the pool in a clean state


def test_missing_key_is_none_and_another_length_is_refused(redis_server):
    client = redis_server.client()
    assert bulk.get_into(client, "absent", memoryview(bytearray(4))) is None
    client.set("k", b"12345")
    with pytest.raises(ValueError):
        bulk.get_into(client, "k", memoryview(bytearray(4)))
    assert client.get("k") == b"12345"  # the pool still answers after the refused read
