"""engine/textout.py: sampled ids → client text; a stop string ends the text before it (text that
could start one is held back until it cannot), end-of-sequence stops, ``max_tokens`` is a length."""

from __future__ import annotations

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.events import SamplingParams
from engine.textout import TextStream

EOS = -1  # an id the tokenizer never makes: only the stream's own eos set knows it


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def stream_all(tok, text: str, **params) -> tuple[str, str | None, TextStream]:
    out = TextStream(tok, SamplingParams(**params), [EOS])
    sent, finish = "", None
    for t in tok.encode(text, add_special_tokens=False):
        piece, finish = out.add(t)
        sent += piece
        if finish:
            return sent, finish, out
    return sent + out.tail(), finish, out


def test_no_stop_gives_the_decoded_text(tok):
    sent, finish, _ = stream_all(tok, "the quick brown fox")
    assert (sent, finish) == ("the quick brown fox", None)


def test_stop_string_cuts_before_it_and_nothing_after_is_sent(tok):
    sent, finish, out = stream_all(tok, "count one two three four", stop=("three",))
    assert (sent, finish) == ("count one two ", "stop") and out.tail() == ""
    assert out.stopped_by == "three"  # which one (Anthropic's stop_sequence names it)


def test_the_stop_string_that_ended_the_text_is_named(tok):
    _, _, out = stream_all(tok, "count one two three four", stop=("four", "two three", "three"))
    assert out.stopped_by == "two three"  # complete with "three", and it starts first
    _, _, out = stream_all(tok, "the quick brown fox", stop=("zebra",))
    assert out.stopped_by is None


def test_text_that_may_start_a_stop_string_is_held_back(tok):
    out = TextStream(tok, SamplingParams(stop=("xyz",)), [EOS])
    pieces = [out.add(t)[0] for t in tok.encode("ab xy", add_special_tokens=False)]
    assert "".join(pieces) + out.tail() == "ab xy"
    assert not "".join(pieces).endswith("xy")  # held until it could no longer be "xyz"


def test_eos_stops_and_max_tokens_is_a_length(tok):
    out = TextStream(tok, SamplingParams(max_tokens=2), [EOS])
    assert out.add(EOS) == ("", "stop") and out.completion == 0
    ids = tok.encode("one two three", add_special_tokens=False)
    assert out.add(ids[0])[1] is None and out.add(ids[1])[1] == "length"
