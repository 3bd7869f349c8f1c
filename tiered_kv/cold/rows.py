"""The cold index's rows as values: records going in, records and stored ids coming back out.

Pure conversions, no I/O: a :class:`Record` becomes the values of an ``entries`` row and its
``blocks`` rows (:mod:`schema` names the columns); a row read back becomes a :class:`Record` or a
:class:`Stored`, checked first — sqlite's columns take any type, so a value no writer of ours makes
raises :class:`Damaged` (the index is rebuilt from the files), never a bare TypeError later.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Record:
    entry_id: str
    file: str
    n_tokens: int
    nbytes: int
    created: float
    last_used: float
    #: the entry's chained block keys — carried by records being *added* only; records read
    #: back from the index leave it empty (the keys live in the ``blocks`` table)
    blocks: tuple[int, ...] = ()
    #: how many of its ids were the prompt (None: all, or not known)
    prompt_tokens: int | None = None
    #: the key of the prompt's last full block (:func:`keys.prompt_key`) — carried by records
    #: being added only, like ``blocks``
    prompt_key: int | None = None
    #: what the entry serves (``declared.Serving``: its layers can be cut back, its checkpoint
    #: positions) — carried by records being added only; read back by :meth:`Index.stored`
    trimmable: bool | None = None
    checkpoints: tuple[int, ...] = ()


@dataclass(frozen=True)
class Stored:
    """What a lookup reads of one entry: its ids and what it can serve."""

    tokens: np.ndarray
    #: None: not recorded (a row written by a version before the column; the file's header says)
    trimmable: bool | None
    checkpoints: tuple[int, ...]


class Damaged(sqlite3.DatabaseError):
    """A row no writer of ours makes (sqlite's columns take any type): the index is damaged."""


def damaged(e: BaseException) -> bool:
    """Whether ``e`` says the index is damaged (no database, or rows of the wrong kind), as
    opposed to a busy, full or read-only one: rebuilt from the files."""
    return type(e) is sqlite3.DatabaseError or isinstance(e, Damaged)


def signed(h: int) -> int:
    """A 64-bit block key as sqlite stores it (a signed INTEGER)."""
    return h - (1 << 64) if h >= 1 << 63 else h


def entry_row(rec: Record, tokens: bytes) -> tuple:
    """The values of ``rec``'s ``entries`` row (:data:`schema.INSERT_ENTRY`)."""
    pkey = None if rec.prompt_key is None else signed(rec.prompt_key)
    return (rec.entry_id, rec.file, rec.n_tokens, rec.nbytes, rec.created, rec.last_used,
            tokens, rec.prompt_tokens, pkey, *serving(rec.trimmable, rec.checkpoints))  # fmt: skip


def serving(trimmable: bool | None, checkpoints: Sequence[int]) -> tuple[int | None, str | None]:
    """The ``trimmable``, ``checkpoints`` values of what an entry serves (NULL, NULL: not known)."""
    if trimmable is None:
        return None, None
    return int(trimmable), json.dumps(list(checkpoints))


def block_rows(rec: Record) -> list[tuple[int, str, int, int]]:
    """``rec``'s ``blocks`` rows (:data:`schema.INSERT_BLOCK`): key, entry, depth, last."""
    n = len(rec.blocks)
    return [(signed(h), rec.entry_id, d, int(d == n)) for d, h in enumerate(rec.blocks, 1)]


def record(row: Sequence) -> Record:
    """A record read back: the six :data:`schema.COLS`, then prompt_tokens. Raises Damaged."""
    eid, file, n_tokens, nbytes, created, last_used, prompt_tokens = row
    if not (isinstance(eid, str) and isinstance(file, str) and type(n_tokens) is int
            and type(nbytes) is int and n_tokens >= 0 and nbytes >= 0  # sizes the budget sums
            and isinstance(created, (int, float))
            and isinstance(last_used, (int, float))
            and (prompt_tokens is None or type(prompt_tokens) is int)):  # fmt: skip
        raise Damaged(f"index row of entry {str(eid)[:40]!r} is malformed")
    return Record(eid, file, n_tokens, nbytes, created, last_used, prompt_tokens=prompt_tokens)


def stored(row: Sequence, entry_id: str) -> Stored:
    """An entry's ids and what it serves: tokens, trimmable, checkpoints. Raises Damaged."""
    raw, trimmable, points = row
    if trimmable not in (None, 0, 1):
        raise Damaged(f"index row of entry {entry_id[:40]!r} is malformed")
    ckpts = positions(points, entry_id) if trimmable is not None else ()
    return Stored(ids(raw, entry_id), None if trimmable is None else bool(trimmable), ckpts)


def ids(raw: object, entry_id: str) -> np.ndarray:
    """The tokens column: int32 LE ids. A value that is no whole number of them (text, a blob of
    an odd length) raises Damaged, not numpy's TypeError / ValueError."""
    if not isinstance(raw, bytes) or len(raw) % 4:
        raise Damaged(f"index row of entry {entry_id[:40]!r} has malformed token ids")
    return np.frombuffer(raw, dtype="<i4")


def positions(text: object, entry_id: str) -> tuple[int, ...]:
    """The checkpoints column: a JSON list of positions (0 too: a file may hold one there, the
    header check accepts it and it serves nothing). Raises Damaged."""
    points = loads(text) if isinstance(text, str) else None
    if not (isinstance(points, list) and all(type(p) is int and p >= 0 for p in points)):
        raise Damaged(f"index row of entry {entry_id[:40]!r} has malformed checkpoints")
    return tuple(points)


def loads(text: str) -> object:
    """JSON text's value, None when it is not JSON (nested past Python's stack too: json raises
    RecursionError there, which no caller expects of a damaged value)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None
