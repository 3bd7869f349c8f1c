"""publisher.map_file: a local entry mapped read-only for publishing; gone or a symlink → None."""

from __future__ import annotations

from tiered_kv.shared.publisher import map_file


def test_maps_the_file_and_misses_when_gone_or_a_link(tmp_path):
    f = tmp_path / "e.safetensors"
    f.write_bytes(b"abc" * 1000)
    view = map_file(f)
    assert view is not None and bytes(view[:6]) == b"abcabc" and len(view) == 3000
    assert map_file(tmp_path / "gone") is None
    link = tmp_path / "link.safetensors"
    link.symlink_to(f)
    assert map_file(link) is None
