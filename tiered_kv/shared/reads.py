"""Bounded reads of the shared tier's index values: what Redis holds is data, and any value may be
512 MB (another writer's, an attacker's, a damaged one), so nothing of the layout but an entry's
chunks (their lengths checked first, :mod:`bulk`) is read without a bound. One owner for each
bound, used by the request path (:mod:`redis_tier`), the write path (:mod:`writes`) and the admin
path (:mod:`survey`) alike:

* ``b:<hash>`` — an entry id: :data:`EID_LEN` bytes, one more read (a longer value is no id);
* ``t:<eid>`` — token ids: as many as the caller compares, one more read by the admin path;
* ``e:<eid>`` — fields, each with its bound (:data:`FACTS`, :data:`SERVING`, :data:`CREATED`),
  read by one script that takes a field's length and, within its bound, its value in one atomic
  step: a field rewritten by another writer cannot fall between the two (two round trips left a
  field set to 512 MB between them read whole). The script calls only reads, and has no
  ``#!lua flags=no-writes`` line: Redis 6 refuses that line (every lookup would fail, unlogged, as
  a skipped candidate), and Redis 7 runs a script without it that only reads on a replica and on a
  full Redis under ``noeviction`` alike (refused there: a script's first write).

Each ``queue_*`` adds its command to a pipeline; the matching ``*_of`` turns its reply (an
exception object where the pipeline ran with ``raise_on_error=False``) into values or None
(:func:`facts_of` / :func:`serving_of` the ``e:`` fields' values).
Bytes only, any thread (the pipeline is the caller's).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from tiered_kv.declared import Serving

EID_LEN = 32
_EID = re.compile(rb"[0-9a-f]{%d}" % EID_LEN)  # entry ids read from Redis are data: checked
_MAX_FACT = 20  # digits of an entry's fact (an int64)
#: an entry's facts in its e: hash, each a number of at most 20 digits
FACTS = dict.fromkeys(("n_tokens", "nbytes", "nchunks", "chunk_bytes"), _MAX_FACT)
#: what an entry serves (:class:`declared.Serving`), beside its facts (a checkpoint every 256
#: tokens of a 1M-token entry is ~30 kB)
SERVING = {"trimmable": 1, "checkpoints": 64 << 10}
#: when it was published (``repr`` of a float: at most 24 characters)
CREATED = {"created": 32}

# (field, bound) pairs in ARGV: for each, false (absent), its length (past its bound: not read) or
# its value; HSTRLEN on a key of another type raises WRONGTYPE, which fails the script
_FIELDS_SCRIPT = """
local out = {}
for i = 1, #ARGV, 2 do
  local n = redis.call('HSTRLEN', KEYS[1], ARGV[i])
  if n == 0 then
    out[#out + 1] = false
  elseif n > tonumber(ARGV[i + 1]) then
    out[#out + 1] = n
  else
    out[#out + 1] = redis.call('HGET', KEYS[1], ARGV[i])
  end
end
return out
"""


@dataclass(frozen=True)
class Fields:
    """What a bounded read of an ``e:`` hash found."""

    values: tuple[bytes | None, ...]  # in the order asked; None: absent, or past its bound
    oversized: tuple[str, ...]  # the fields past their bound (never read)

    @property
    def gone(self) -> bool:
        """Nothing there (the key does not exist, or holds none of the fields)."""
        return not self.oversized and all(v is None for v in self.values)


def queue_fields(pipe: Any, key: str, bounds: Mapping[str, int]) -> None:
    """Read the fields ``bounds`` names of the hash ``key``, each only within its bound."""
    args = [x for name, bound in bounds.items() for x in (name, bound)]
    pipe.eval(_FIELDS_SCRIPT, 1, key, *args)


def fields_of(reply: Any, bounds: Mapping[str, int]) -> Fields | None:
    """A :func:`queue_fields` reply; None where the key is no hash (or the read failed)."""
    if not isinstance(reply, list) or len(reply) != len(bounds):
        return None
    values: list[bytes | None] = []
    oversized: list[str] = []
    for name, v in zip(bounds, reply, strict=True):
        if isinstance(v, int):
            oversized.append(name)
        values.append(v if isinstance(v, bytes) else None)
    return Fields(tuple(values), tuple(oversized))


def facts_of(meta: Sequence[bytes | None]) -> tuple[int, int, int, int] | None:
    try:
        n_tokens, nbytes, nchunks, chunk = (int(v) for v in meta)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return n_tokens, nbytes, nchunks, chunk


def serving_of(meta: Sequence[bytes | None]) -> Serving | None:
    """An entry's ``trimmable`` and ``checkpoints`` fields (``-``: none) as read back; None when
    absent or not what a publisher writes."""
    if len(meta) != len(SERVING):
        return None
    trim, points = meta
    if trim not in (b"0", b"1") or not isinstance(points, bytes):
        return None
    if points == b"-":
        return Serving(trim == b"1", ())
    parts = points.split(b",")
    if not all(p.isdigit() and p.isascii() and len(p) <= 18 for p in parts):
        return None
    return Serving(trim == b"1", tuple(sorted(int(p) for p in parts)))


def refusal(replies: Sequence[Any]) -> redis.exceptions.RedisError | None:
    """The first of a pipeline's replies that Redis refused for another reason than a key of
    another type (WRONGTYPE: another writer's data, read as nothing; Redis 6 wraps it in the
    script's error, "Error running script (…): @user_script:4: WRONGTYPE …"): e.g. a server,
    proxy or ACL user that runs no scripts. None where there is none. Such a reply says nothing
    of the key: a reader must not take it for a damaged value."""
    for r in replies:
        if isinstance(r, redis.exceptions.RedisError) and "WRONGTYPE" not in str(r):
            return r
    return None


def queue_eid(pipe: Any, key: str) -> None:
    """Read a ``b:`` key: one byte past an entry id (a longer value is no id)."""
    pipe.getrange(key, 0, EID_LEN)


def eid_of(reply: Any) -> str | None:
    return reply.decode() if isinstance(reply, bytes) and _EID.fullmatch(reply) else None


def queue_tokens(pipe: Any, key: str, n: int) -> None:
    """Read the first ``n`` token ids of a ``t:`` key (4 bytes each): no more is ever read."""
    pipe.getrange(key, 0, 4 * n - 1)


def tokens_of(reply: Any) -> bytes | None:
    """A :func:`queue_tokens` reply, whole ids only; None for a key of another type."""
    return reply[: len(reply) // 4 * 4] if isinstance(reply, bytes) else None
