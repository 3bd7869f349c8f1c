from engine.detok import IncrementalDecoder
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
