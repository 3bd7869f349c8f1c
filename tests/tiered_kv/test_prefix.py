"""tiered_kv/prefix.py: the longest common token prefix."""

from __future__ import annotations

from tiered_kv import keys
from tiered_kv.prefix import common_prefix


def test_common_prefix_is_exact():
    a = keys.as_int32([1, 2, 3, 4])
    assert common_prefix(a, keys.as_int32([1, 2, 9])) == 2
    assert common_prefix(a, keys.as_int32([1, 2])) == 2
    assert common_prefix(a, keys.as_int32([])) == 0


def test_prompt_len_is_all_ids_where_not_recorded():
    from tiered_kv.prefix import entry_prompt_len

    assert entry_prompt_len(30, None) == 30 and entry_prompt_len(30, 20) == 20
