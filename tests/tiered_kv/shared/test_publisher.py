"""tiered_kv/shared/publisher.py: write-behind bounded in bytes, never blocking the submitter; map_file
maps a local entry read-only for publishing (gone or a symlink → None)."""

from __future__ import annotations

import threading
import time

import numpy as np

from tiered_kv.shared.publisher import Publisher, map_file


def test_queue_drops_oldest_past_the_bound_and_publishes_the_rest():
    gate = threading.Event()
    published: list[bytes] = []
    dropped: list[int] = []

    def publish(data, tokens) -> bool:
        gate.wait(10)
        published.append(bytes(data))
        return True

    p = Publisher(publish, max_bytes=100, on_drop=dropped.append)
    p.submit(lambda: b"first", np.arange(1), 60)
    while p.pending_bytes:  # taken by the thread, which now blocks in publish
        time.sleep(0.01)
    for name in (b"a", b"b", b"c"):
        p.submit(lambda name=name: name, np.arange(1), 60)  # type: ignore[misc]  # one of 60 fits under 100
    assert p.pending_bytes == 60 and dropped == [60, 60]
    gate.set()
    assert p.flush(10)
    assert published == [b"first", b"c"]
    p.close(5)


def test_an_entry_larger_than_the_bound_is_admitted_alone():
    published = []
    p = Publisher(lambda d, t: published.append(len(d)) or True, 10, lambda n: None)  # type: ignore[func-returns-value]
    p.submit(lambda: b"x" * 50, np.arange(1), 50)
    assert p.flush(10) and published == [50]
    p.close(5)


def test_gone_entry_and_failing_publish_do_not_kill_the_thread():
    calls = []

    def publish(data, tokens) -> bool:
        calls.append(data)
        if data == b"boom":
            raise RuntimeError("bug")
        return True

    p = Publisher(publish, 1000, lambda n: None)
    p.submit(lambda: None, np.arange(1), 1)  # the local entry was deleted meanwhile
    p.submit(lambda: b"boom", np.arange(1), 1)
    p.submit(lambda: b"ok", np.arange(1), 1)
    assert p.flush(10) and calls == [b"boom", b"ok"]
    p.close(5)


def test_close_drops_what_is_left_after_its_timeout():
    gate = threading.Event()
    dropped: list[int] = []
    p = Publisher(lambda d, t: gate.wait(10), 1000, dropped.append)
    p.submit(lambda: b"1", np.arange(1), 7)
    p.submit(lambda: b"2", np.arange(1), 8)
    assert not p.close(0.2)
    gate.set()
    assert 8 in dropped


def test_maps_the_file_and_misses_when_gone_or_a_link(tmp_path):
    f = tmp_path / "e.safetensors"
    f.write_bytes(b"abc" * 1000)
    view = map_file(f)
    assert view is not None and bytes(view[:6]) == b"abcabc" and len(view) == 3000
    assert map_file(tmp_path / "gone") is None
    link = tmp_path / "link.safetensors"
    link.symlink_to(f)
    assert map_file(link) is None
