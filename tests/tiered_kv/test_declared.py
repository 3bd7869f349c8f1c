"""tiered_kv/declared.py: the tensor names an entry's layers / checkpoints metadata declares."""

from __future__ import annotations

import json
import time

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

from tests.fixtures import kv_cache
from tiered_kv import checkpoints, declared, layers


def _filled(c, n: int = 6, dim: int = 32):
    c.update_and_fetch(mx.random.normal((1, 2, n, dim)), mx.random.normal((1, 2, n, dim)))
    return c


def _recurrent() -> C.ArraysCache:
    c = C.ArraysCache(3)
    c[0], c[2] = mx.zeros((1, 3, 4)), mx.ones((1, 5))
    return c


def every_class() -> list:
    """One filled cache of every class the codecs know, a CacheList among them."""
    return [
        kv_cache(6),
        _filled(C.QuantizedKVCache(group_size=32, bits=4)),
        _filled(C.RotatingKVCache(max_size=4, keep=0)),
        _filled(C.ChunkedKVCache(chunk_size=64)),
        _filled(C.ConcatenateKVCache()),
        C.CacheList(kv_cache(6), _recurrent()),
        C.KVCache(),  # empty: declares arrays it does not store
    ]


def test_every_codec_writes_only_declared_names():
    assert set(declared.ARRAYS) == set(layers.CODECS)
    caches = every_class()
    arrays, meta = layers.encode(caches)
    ck, tree = checkpoints.encode({3: checkpoints.snapshot(caches), 6: checkpoints.snapshot(caches)})
    assert tree is not None and ck
    names = [*arrays, *ck, "tokens"]
    assert declared.undeclared(names, {**meta, "checkpoints": tree}) is None
    assert {"5.1.s0", "5.1.s2", "1.keys.2", "ckpt.6.6.s2"} <= set(names)


@pytest.mark.parametrize("name", ["0.x", "0", "keys", "7.keys", "0.keys.0", "1.keys", "1.keys.3",
                                  "2.s3", "2.s01", "2.s-1", "2.s", "ckpt.9.0.keys",
                                  "ckpt.4.0.keys", "ckpt.4.2.s1", ".0.keys", "0.keys."])  # fmt: skip
def test_a_name_no_leaf_declares_is_named(name):
    tree = [{"cls": "KVCache", "meta": {"offset": 6}},
            {"cls": "QuantizedKVCache", "meta": {"offset": 6}},
            {"cls": "ArraysCache", "meta": {"size": 3}}]  # fmt: skip
    ck = {"4": json.dumps([{"cls": None}, {"cls": None}, {"cls": "ArraysCache", "meta": {"size": 1}}])}
    meta = {"layers": json.dumps(tree), "checkpoints": json.dumps(ck)}
    ok = ["tokens", "0.keys", "0.values", "1.keys.0", "1.values.2", "2.s0", "2.s2", "ckpt.4.2.s0"]
    assert declared.undeclared(ok, meta) is None
    assert declared.undeclared([*ok, name], meta) == name


def test_a_size_is_compared_never_counted_out():
    meta = {"layers": json.dumps([{"cls": "ArraysCache", "meta": {"size": 10**15}}])}
    t0 = time.perf_counter()
    assert declared.undeclared(["0.s999999999999"], meta) is None
    assert declared.undeclared(["0.s1000000000000000"], meta) == "0.s1000000000000000"
    assert time.perf_counter() - t0 < 1


def test_an_unknown_class_declares_nothing():
    meta = {"layers": json.dumps([{"cls": "FancyCache", "meta": {}}])}
    assert declared.undeclared(["tokens"], meta) is None
    assert declared.undeclared(["0.keys"], meta) == "0.keys"


@pytest.mark.parametrize("meta", [
    {}, {"layers": "{"}, {"layers": "{}"}, {"layers": "[3]"}, {"layers": "[]", "checkpoints": "[]"},
    {"layers": "[]", "checkpoints": '{"x": "[]"}'}, {"layers": "[]", "checkpoints": '{"4": []}'},
    {"layers": '[{"cls": "CacheList", "items": 3}]'},
    {"layers": '[{"cls": "CacheList", "items": ' * 5000 + "[]" + "}]" * 5000},
])  # fmt: skip
def test_a_malformed_tree_is_a_value_error(meta):
    with pytest.raises(ValueError):
        declared.undeclared(["tokens"], meta)


def test_positional_classes_are_the_codecs_that_can_always_be_cut_back():
    """``serving`` reads old files without MLX: its class list is the codecs' own."""
    assert declared.POSITIONAL == {n for n, c in layers.CODECS.items() if c.positional}


def test_the_array_names_are_spelled_in_declared_only():
    """``declared.ARRAYS`` repeated the names the codecs of ``layers`` spelled again ("keys",
    ``f"keys.{i}"``, ``f"s{i}"``): one renamed in a codec and not there made every file of that
    class corrupt at its next read. The codecs name their arrays through declared's names now:
    layers.py spells none of them."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(layers))
    spelled = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
               and isinstance(n.value, str) and n.value in ("keys", "values", "s")}  # fmt: skip
    formatted = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr)
                 and isinstance(n.values[0], ast.Constant)
                 and n.values[0].value in ("s", "keys.", "values.")]  # fmt: skip
    assert not spelled and not formatted, (spelled, formatted)
    assert declared.quantized(declared.KEYS, 2) == "keys.2" and declared.state(1) == "s1"
