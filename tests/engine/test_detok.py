from engine.detok import IncrementalDecoder
from engine.loading import load_model


def test_deltas_concatenate_to_decode(tiny_model_dir):
    _, tok = load_model(tiny_model_dir)
    for text in (" leading space kept", "naïve café — ünïcödé ✓ 日本語", "a\n\n  b\tc"):
        ids = tok.encode(text, add_special_tokens=False)
        d = IncrementalDecoder(tok)
        out = "".join(d.add(t) for t in ids) + d.flush()
        assert out == tok.decode(ids)
