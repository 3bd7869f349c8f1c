from tiered_kv.policy import (
    Item,
    is_continuation,
    lru_victims,
    prompt_resent,
    servable_tokens,
    serves_all,
)


def test_full_hit_still_recomputes_last_token():
    assert servable_tokens(100, 100) == 99
    assert servable_tokens(150, 100) == 99
    assert servable_tokens(40, 100) == 40
    assert servable_tokens(0, 1) == 0


def test_a_hit_serves_all_once_only_the_last_prompt_token_is_left():
    assert serves_all(9, 10) and serves_all(12, 10)
    assert not serves_all(8, 10)
    assert serves_all(0, 1) and serves_all(0, 0)  # nothing any hit could serve


def test_continuation_needs_long_hit_and_half_the_prompt():
    assert is_continuation(1000, 1900, 1000, 1000)
    assert not is_continuation(999, 1000, 1000, 999)
    assert not is_continuation(1000, 2100, 1000, 1000)
    assert not is_continuation(0, 10, 0, 0)


def test_continuation_needs_the_whole_entry():
    """A shared prefix of a longer entry (another conversation's system prompt) is shared read-only:
    handing it over would cut the entry back under the requests running beside this one."""
    assert not is_continuation(1000, 1100, 1000, 5000)
    assert is_continuation(5000, 5100, 1000, 5000)


def test_continuation_of_an_entry_whose_prompt_was_resent_whole():
    """The next turn of an agent resends the entry's whole prompt and diverges inside what the
    model generated (its answer re-rendered): that continues the entry too; a hit short of the
    entry's prompt (a shared system prompt, a regenerate) does not."""
    assert is_continuation(4100, 4600, 1000, 4500, entry_prompt=4000)
    assert is_continuation(4000, 4600, 1000, 4500, entry_prompt=4000)
    assert not is_continuation(3999, 4600, 1000, 4500, entry_prompt=4000)
    assert not is_continuation(4100, 9000, 1000, 4500, entry_prompt=4000)  # under half the prompt


def test_lru_victims_budget_and_memory():
    items = [Item(1, 100, 5), Item(2, 100, 1), Item(3, 100, 9)]
    assert lru_victims(items, 300) == []
    assert lru_victims(items, 200) == [2]
    assert lru_victims(items, 1000, over_memory_bytes=150) == [2, 1]
    assert lru_victims(items, 0, keep=1) == [2, 1]


def test_checkpoints_within_keeps_the_latest():
    from tiered_kv.policy import checkpoints_within

    sizes = {16: 10, 32: 10, 48: 10, 64: 10}
    assert checkpoints_within(sizes, 25) == [48, 64]
    assert checkpoints_within(sizes, 100) == [16, 32, 48, 64]
    assert checkpoints_within(sizes, 5) == []


def test_an_entry_whose_whole_prompt_was_resent_is_redundant_where_both_cut_back():
    assert prompt_resent(120, 100, True)  # the next turn: prompt resent, answer re-rendered
    assert prompt_resent(100, 100, True)
    assert not prompt_resent(99, 100, True)  # a branch inside the prompt
    assert not prompt_resent(120, 100, False)  # an untrimmable layer: the old length is not served
