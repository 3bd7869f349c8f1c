"""tiered_kv/shared/reads.py: every index value is read within its bound (real Redis)."""

from __future__ import annotations

import redis

from tiered_kv.shared import reads

BOUNDS = {**reads.FACTS, **reads.SERVING}


def _read(client: redis.Redis, key: str) -> reads.Fields | None:
    pipe = client.pipeline(transaction=False)
    reads.queue_fields(pipe, key, BOUNDS)
    return reads.fields_of(pipe.execute(raise_on_error=False)[0], BOUNDS)


def _sent(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_fields_within_their_bounds_are_read_and_longer_ones_never(redis_server):
    c = redis_server.client()
    c.hset("e", mapping={"n_tokens": 64, "nbytes": b"1" * (8 << 20), "trimmable": b"1",
                         "checkpoints": b"16,32"})  # fmt: skip
    before = _sent(c)
    got = _read(c, "e")
    assert _sent(c) - before < 1 << 20
    assert got is not None and got.oversized == ("nbytes",) and not got.gone
    assert got.values == (b"64", None, None, None, b"1", b"16,32")


def test_a_missing_hash_is_gone_and_another_type_is_none(redis_server):
    c = redis_server.client()
    got = _read(c, "nothing")
    assert got is not None and got.gone
    c.set("s", b"not a hash")
    assert _read(c, "s") is None


def test_ids_and_tokens_are_read_within_their_bounds(redis_server):
    c = redis_server.client()
    c.set("b", b"a" * 32)
    c.set("b2", b"a" * 33)
    c.set("t", b"\x01\x00\x00\x00" * 1000)
    pipe = c.pipeline(transaction=False)
    reads.queue_eid(pipe, "b")
    reads.queue_eid(pipe, "b2")
    reads.queue_tokens(pipe, "t", 3)
    one, two, toks = pipe.execute()
    assert reads.eid_of(one) == "a" * 32 and reads.eid_of(two) is None
    assert reads.tokens_of(toks) == b"\x01\x00\x00\x00" * 3


def test_fields_are_read_on_a_full_redis_under_noeviction(redis_server):
    """The script only reads: Redis runs it where it refuses every write (and it carries no
    ``#!lua flags=`` line, which Redis 6 refuses)."""
    c = redis_server.client()
    c.hset("e", mapping={"n_tokens": 64, "trimmable": b"0", "checkpoints": b"-"})
    c.set("filler", b"x" * (4 << 20))
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory", "1mb")
    try:
        try:
            c.set("w", b"y")
            raise AssertionError("a write was accepted: Redis is not full")
        except redis.exceptions.OutOfMemoryError:
            pass
        got = _read(c, "e")
    finally:
        c.config_set("maxmemory", "0")
    assert got is not None and got.values[0] == b"64" and got.values[4:] == (b"0", b"-")
    assert not reads._FIELDS_SCRIPT.lstrip().startswith("#!")


def test_a_key_of_another_type_is_no_refusal_in_redis_6s_words_either(redis_server):
    """A key of another type fails the fields script with WRONGTYPE: Redis 7 replies with the
    command's error as it is, Redis 6 (Ubuntu 22.04, Debian 11) wraps it ("Error running script
    (call to f_…): @user_script:4: WRONGTYPE …", before redis/redis#10329). Read as a refusal,
    it failed the whole survey (``cache verify`` "unreachable") where one entry is corrupt."""
    c = redis_server.client()
    c.set("e", b"x")
    pipe = c.pipeline(transaction=False)
    reads.queue_fields(pipe, "e", BOUNDS)
    pipe.eval("return redis.call('NOSUCHCOMMAND')", 0)
    own, refused = pipe.execute(raise_on_error=False)
    six = redis.exceptions.ResponseError(
        "Error running script (call to f_d71973d91533e6adc81062d4da1d15aa24bb3ebc): "
        "@user_script:4: WRONGTYPE Operation against a key holding the wrong kind of value")
    assert reads.refusal([own]) is None and reads.refusal([six]) is None
    assert reads.refusal([own, six, refused]) is refused
