"""engine/items.py: deltas as typed items: a channel's run is one item, a call an item of its own,
a resumed channel a new item without the separator that joined its text. The items of the families'
real outputs are checked through the APIs that use them (test_messages.py, test_responses.py) and
test_output.py (think blocks back to back)."""

from __future__ import annotations

from typing import Any

from engine.items import Items
from engine.output import Delta

CALL = {"index": 0, "id": "call_1", "type": "function",
        "function": {"name": "a", "arguments": "{}"}}  # fmt: skip


def _delta(*parts: tuple[str, Any]) -> Delta:
    d = Delta()
    for kind, x in parts:
        if kind == "tool":
            d.call(x)
        else:
            d.say("normal" if kind == "content" else "reasoning", x)
    return d


def test_runs_of_a_channel_are_one_item_and_a_call_is_its_own():
    items = Items()
    steps = items.steps(_delta(("reasoning", "Plan."), ("content", "Let me")))
    steps += items.steps(_delta(("content", " look."), ("tool", CALL), ("content", "Done.")))
    steps += items.close()
    assert steps == [
        ("open", "reasoning", None), ("text", "reasoning", "Plan."), ("close", "reasoning", None),
        ("open", "content", None), ("text", "content", "Let me"), ("text", "content", " look."),
        ("close", "content", None), ("call", "tool", CALL),
        ("open", "content", None), ("text", "content", "Done."), ("close", "content", None),
    ]  # fmt: skip


def test_a_resumed_channel_opens_a_new_item_without_its_separator():
    items = Items()
    items.steps(_delta(("reasoning", "A."), ("content", "Text.")))
    assert items.steps(_delta(("reasoning", "\n"))) == []  # only the separator: no item yet
    assert items.steps(_delta(("reasoning", "\nB."))) == [
        ("close", "content", None), ("open", "reasoning", None), ("text", "reasoning", "B."),
    ]  # fmt: skip
    assert items.close() == [("close", "reasoning", None)] and items.close() == []
