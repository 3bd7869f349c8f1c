"""engine/inflight.py: a request's token → text (an end-of-sequence token is no output, a cancelled
client ends it), and its one way to end: last chunk with usage, its cache stored as its entry, END;
or a failure, its cache stored all the same, END (a failing store never loses the response).

A real tiny mlx-lm llama and a real TieredCache (helpers: tests/engine/batching.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from engine.events import END, Chunk, Failed, SamplingParams
from engine.inflight import SHORT_PREFILL, Ends, Hold, Seq, short
from tests.engine.batching import IdText, ModelEngine, Sink
from tests.fixtures import make_llama, tokens
from tiered_kv.config import Config


class EosText(IdText):
    eos = {2}

    def add(self, tok: int) -> tuple[str, str | None]:
        return ("", "stop") if tok in self.eos else super().add(tok)


def computed(engine: ModelEngine, ids: list[int]) -> tuple[Seq, Sink]:
    """A request whose caches hold ``ids`` (its whole prompt, fed)."""
    sink = Sink()
    seq = Seq(sink, ids, SamplingParams(max_tokens=4), None, 0.0, np.array(ids, dtype=np.int32))
    seq.lease = engine.cache.fetch(ids)
    caches = make_prompt_cache(engine.model)
    engine.model(mx.array([ids]), cache=caches)
    mx.eval([c.state for c in caches])
    seq.lease.caches, seq.fed = caches, list(ids)
    seq.text = EosText(seq.params)
    return seq, sink


def test_tokens_become_chunks_until_the_end():
    engine = ModelEngine(make_llama(seed=4), Config(tiers=("hot",)))
    seq, sink = computed(engine, tokens(5, 20))
    assert seq.left == 0
    assert seq.on_token(7) is None and sink.chunks[-1].token == 7
    assert seq.on_token(2) == "stop" and len(sink.chunks) == 1  # an end-of-sequence token: no chunk
    sink.cancel = True
    assert seq.on_token(9) == "cancelled"


def test_finish_sends_usage_stores_the_entry_then_ends():
    engine = ModelEngine(make_llama(seed=4), Config(tiers=("hot",)))
    ids = tokens(6, 30)
    seq, sink = computed(engine, ids)
    seq.on_token(7)
    Ends(engine).finish(seq, "length", seq.lease.caches)
    last = sink.events[-2]
    assert isinstance(last, Chunk) and last.finish_reason == "length"
    assert last.usage.prompt_tokens == 30 and last.usage.completion_tokens == 1
    assert sink.events[-1] is END and seq.lease is None
    assert engine.cache.fetch(ids + [1]).hit.tokens == 30  # its entry: exactly its own ids


def test_a_failure_still_stores_and_ends_even_when_the_store_fails(monkeypatch):
    engine = ModelEngine(make_llama(seed=4), Config(tiers=("hot",)))
    ids = tokens(7, 30)
    seq, sink = computed(engine, ids)
    Ends(engine).fail(seq, RuntimeError("boom"), seq.lease.caches)
    assert isinstance(sink.events[-2], Failed) and sink.events[-1] is END
    assert engine.cache.fetch(ids + [1]).hit.tokens == 30

    def broken(*a):
        raise OSError("disk full")

    seq, sink = computed(engine, tokens(8, 30))
    monkeypatch.setattr(engine.cache, "store", broken)
    Ends(engine).finish(seq, "stop", seq.lease.caches)
    assert sink.chunks[-1].finish_reason == "stop" and sink.events[-1] is END


def test_a_failed_or_stopped_request_reports_what_it_computed():
    """A failure or a shutdown ends a request with Failed: its usage (the tokens it computed,
    which /metrics counts) came with no event, so such requests were never counted."""
    engine = ModelEngine(make_llama(seed=4), Config(tiers=("hot",)))
    for end in ("fail", "stop"):
        seq, sink = computed(engine, tokens(9, 30))
        seq.on_token(7)
        if end == "fail":
            Ends(engine).fail(seq, RuntimeError("boom"), seq.lease.caches)
        else:
            Ends(engine).stop(seq, seq.lease.caches)
        failed = sink.events[-2]
        assert isinstance(failed, Failed) and failed.usage is not None, end
        assert failed.usage.prompt_tokens == 30 and failed.usage.completion_tokens == 1


def test_short_prompts_are_never_held():
    """One definition of a short prompt (``inflight.short``): the hold lets it go on whatever
    the first texts awaited, and lets a longer one go on only below the hold."""
    assert short(SHORT_PREFILL) and not short(SHORT_PREFILL + 1)
    hold = Hold(below=10)
    assert hold.lets(SHORT_PREFILL) and hold.lets(9)
    assert not hold.lets(SHORT_PREFILL + 1)
    assert Hold(below=SHORT_PREFILL + 50).lets(SHORT_PREFILL + 49)
    assert not Hold(below=SHORT_PREFILL + 50).lets(SHORT_PREFILL + 50)
