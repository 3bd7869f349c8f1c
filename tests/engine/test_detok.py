import json

import pytest
from mlx_lm import tokenizer_utils
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from engine.detok import IncrementalDecoder, TokenBytes, piece_text
from engine.loading import load_model


def test_deltas_concatenate_to_decode(tiny_model_dir):
    _, tok = load_model(tiny_model_dir)
    for text in (" leading space kept", "naïve café — ünïcödé ✓ 日本語", "a\n\n  b\tc"):
        ids = tok.encode(text, add_special_tokens=False)
        d = IncrementalDecoder(tok)
        out = "".join(d.add(t) for t in ids) + d.flush()
        assert out == tok.decode(ids)


def test_mlx_lm_bpe_detokenizer_still_drops_the_leading_space(tiny_model_dir):
    """Why engine/detok.py exists: when this fails, mlx-lm's own streaming detokenizer may do instead."""
    _, tok = load_model(tiny_model_dir)
    ids = tok.encode(" leading space kept", add_special_tokens=False)
    det = tok.detokenizer
    det.reset()
    for t in ids:
        det.add_token(t)
    det.finalize()
    assert det.text != tok.decode(ids) == " leading space kept"


# --- TokenBytes: what each generated token adds, for logprobs ------------------------------------

TEXTS = (" leading space kept", "naïve café — ünïcödé ✓ 日本語 🙂", "a\n\n  b\tc")


@pytest.fixture(scope="module")
def spm_tokenizer(tmp_path_factory):
    """A SentencePiece-style tokenizer (``▁`` for spaces, ``<0xNN>`` byte fallback, the decoder
    that mlx-lm recognises as SPM: Mistral's, Llama 2's, Gemma's kind), trained here."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])  # fmt: skip
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(["the cache holds the prompt of the world"] * 50, trainer=trainer)
    out = tmp_path_factory.mktemp("spm")
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    wrapper = tokenizer_utils.load(out)
    assert isinstance(wrapper.detokenizer, tokenizer_utils.SPMStreamingDetokenizer)
    return wrapper


@pytest.fixture(params=["byte-level BPE", "SentencePiece"])
def tokenizer(request, tiny_model_dir, spm_tokenizer):
    return load_model(tiny_model_dir)[1] if request.param == "byte-level BPE" else spm_tokenizer


def test_token_bytes_concatenate_to_the_generated_text(tokenizer):
    """The first token of a completion as the completion's text starts (SentencePiece's decode
    strips one leading space), every later one with its own space, and a token holding part of a
    character holds those bytes — not decode([id]), which drops the space of ``▁the`` and turns
    a byte of ``✓`` into U+FFFD."""
    token_bytes = TokenBytes(tokenizer)
    before = []  # each token decoded alone, as logprobs named tokens before
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        raw = b"".join(token_bytes(t, first=i == 0) for i, t in enumerate(ids))
        assert raw.decode("utf-8") == tokenizer.decode(ids)
        before.append("".join(str(tokenizer.decode([t])) for t in ids) == tokenizer.decode(ids))
    assert not all(before)
    parts = [token_bytes(t) for t in tokenizer.encode("✓🙂", add_special_tokens=False)]
    assert any(_not_utf8(p) for p in parts)  # a part of a character: its own bytes


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_piece_text_escapes_a_part_of_a_character():
    assert piece_text(" café".encode()) == " café"
    assert piece_text("✓".encode()[:2]) == "bytes:\\xe2\\x9c"


def test_an_id_the_tokenizer_does_not_name_adds_no_bytes(tokenizer):
    token_bytes = TokenBytes(tokenizer)
    assert token_bytes(10**7) == b"" and token_bytes(-1) == b""


def test_a_text_that_continues_the_prompt_keeps_its_first_space(tokenizer):
    """A completion, or a continued assistant message (an Anthropic prefill): SentencePiece's
    decode strips the first token's space, right for a turn of its own, but the prompt 'prompt'
    went on as 'promptthe world'. Decoded after the prompt's last id, the text
    and its tokens' bytes join the prompt as decode(prompt + generated)."""
    whole = tokenizer.encode("prompt the world", add_special_tokens=False)
    text = tokenizer.decode(whole)
    cut = next(i for i in range(1, len(whole)) if text.startswith(tokenizer.decode(whole[:i]) + " "))
    prompt, gen = whole[:cut], whole[cut:]
    d = IncrementalDecoder(tokenizer, after=prompt[-1])
    text = "".join(d.add(t) for t in gen) + d.flush()
    assert tokenizer.decode(prompt) + text == tokenizer.decode(whole)
    token_bytes = TokenBytes(tokenizer, trim_first=False)
    assert b"".join(token_bytes(t, first=i == 0) for i, t in enumerate(gen)).decode() == text
