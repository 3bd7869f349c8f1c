"""Which tensors an entry's metadata declares: the names a file may hold, from its ``layers`` tree
and its ``checkpoints`` trees (JSON in, names out: no I/O, no MLX, so ``store`` checks them with
the rest of the header, for the cache CLI too).

A file's tensors are ``tokens``, then ``<path>.<array>`` for each layer of the ``layers`` tree
(:func:`tiered_kv.layers.encode`: ``path`` is the layer's index, CacheList members
``<index>.<member>``) and ``ckpt.<pos>.<path>.<array>`` for each checkpoint
(:func:`tiered_kv.checkpoints.encode`). :data:`ARRAYS` says which arrays a layer of each cache
class may store; a file holding any other name is corrupt. So the tensor count is bounded by what
the metadata declares before anything is allocated for the tensors (a re-signed header listing
200k one-byte tensors kept the engine thread allocating for 14 s, then was read and ignored).
What is declared need not be present: an empty cache stores no arrays.

What an entry can serve is declared there too (:func:`serving`): whether its layers can be cut
back to any shorter length, and where its checkpoints are — facts the index keeps beside its
tokens so that a lookup answers what a hit serves (:func:`tiered_kv.policy.servable`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: name prefix of checkpoint arrays in an entry file
CHECKPOINT_PREFIX = "ckpt."
#: the one tensor that is no layer's
TOKENS = "tokens"

# The arrays' names are spelled here and nowhere else: the codecs (:data:`tiered_kv.layers.CODECS`)
# name what they write and read through these, and :data:`ARRAYS` checks files against them.
#: an attention layer's two arrays (KVCache, RotatingKVCache, ChunkedKVCache, ConcatenateKVCache)
KEYS, VALUES = "keys", "values"
_KV = (KEYS, VALUES)
#: a QuantizedKVCache stores each of keys / values as this many arrays (weights, scales, biases)
QUANTIZED_PARTS = 3
_STATE = "s"


def quantized(kv: str, i: int) -> str:
    """The name of part ``i`` (:data:`QUANTIZED_PARTS`) of a quantized layer's ``kv`` (KEYS / VALUES)."""
    return f"{kv}.{i}"


def state(i: int) -> str:
    """The name of an ArraysCache layer's ``i``-th state array."""
    return f"{_STATE}{i}"


_QUANTIZED = tuple(quantized(kv, i) for kv in _KV for i in range(QUANTIZED_PARTS))


def _recurrent(meta: Mapping[str, Any], array: str) -> bool:
    """:func:`state` ``i`` for ``i`` below the layer's ``size`` (no list is built: the size is
    data)."""
    digits = array[len(_STATE) :]
    size = meta.get("size")
    return (array.startswith(_STATE) and digits.isascii() and digits.isdigit()
            and (digits == "0" or not digits.startswith("0")) and isinstance(size, int)
            and int(digits) < size)  # fmt: skip


#: cache class → whether a layer of it (with its metadata) may store an array of that name;
#: every codec of :data:`tiered_kv.layers.CODECS` writes only these, named by the names above
#: (checked where entries are prepared, ``cold.codec.prepare``)
ARRAYS: dict[str, Callable[[Mapping[str, Any], str], bool]] = {
    "KVCache": lambda meta, a: a in _KV,
    "RotatingKVCache": lambda meta, a: a in _KV,
    "ChunkedKVCache": lambda meta, a: a in _KV,
    "ConcatenateKVCache": lambda meta, a: a in _KV,
    "QuantizedKVCache": lambda meta, a: a in _QUANTIZED,
    "ArraysCache": _recurrent,
}


#: cache classes whose layers can always be cut back to any shorter length (``positional``
#: codecs of :data:`tiered_kv.layers.CODECS`; a test keeps the two in step)
POSITIONAL = frozenset({"KVCache", "QuantizedKVCache", "ConcatenateKVCache"})


@dataclass(frozen=True)
class Serving:
    """What a stored entry can serve (:func:`tiered_kv.policy.servable`'s facts about it)."""

    trimmable: bool  # every layer can be cut back to any shorter length
    checkpoints: tuple[int, ...]  # positions of its checkpoints, ascending


def serving(metadata: Mapping[str, str]) -> Serving:
    """An entry's :class:`Serving` from its checked header's metadata: ``trimmable`` as the writer
    recorded it (:func:`tiered_kv.layers.can_trim`); a file written before that key was is
    trimmable when every layer's class can always be cut back (plain attention: a sliding window
    not yet full is then taken as one that cannot, which under-serves, never over-serves).
    Malformed metadata (the header check refuses it first) serves as little as possible."""
    try:
        ckpts = json.loads(metadata.get("checkpoints") or "{}")
        points = tuple(sorted(int(p) for p in ckpts))
        recorded = metadata.get("trimmable")
        trimmable = recorded == "1" if recorded is not None else _positional(
            json.loads(metadata["layers"]))
    except (KeyError, ValueError, TypeError, AttributeError, RecursionError):
        return Serving(False, ())
    return Serving(trimmable, points)


def _positional(tree: list[dict[str, Any]]) -> bool:
    """Every layer of an encoded layer tree (``layers.encode``) is of a :data:`POSITIONAL` class."""
    for node in tree:
        cls = node["cls"]
        if cls == "CacheList":
            if not _positional(node["items"]):
                return False
        elif cls not in POSITIONAL:
            return False
    return True


def undeclared(names: Iterable[str], metadata: Mapping[str, str]) -> str | None:
    """The first of ``names`` that ``metadata`` does not declare, None when it declares them all.
    Raises ValueError when its ``layers`` or ``checkpoints`` tree is malformed."""
    try:
        leaves = _declared_leaves(metadata)
    except RecursionError:  # a tree nested past Python's stack
        raise ValueError("layer tree nested too deep") from None
    for name in names:
        if name != TOKENS and not _declared(name, leaves):
            return name
    return None


def _declared_leaves(metadata: Mapping[str, str]) -> dict[str, tuple[str, Mapping[str, Any]]]:
    leaves: dict[str, tuple[str, Mapping[str, Any]]] = {}
    _leaves(_json(metadata.get("layers"), "layers"), "", leaves)
    ckpts = _json(metadata.get("checkpoints", "{}"), "checkpoints")
    if not isinstance(ckpts, dict):
        raise ValueError("checkpoints is not an object")
    for pos, tree in ckpts.items():
        if not (pos.isascii() and pos.isdigit()):
            raise ValueError(f"checkpoint position {pos!r}")
        _leaves(_json(tree, "checkpoint"), f"{CHECKPOINT_PREFIX}{int(pos)}.", leaves)
    return leaves


def _declared(name: str, leaves: Mapping[str, tuple[str, Mapping[str, Any]]]) -> bool:
    """``name`` is ``<leaf path>.<array>`` of a declared leaf whose class stores that array."""
    at = name.find(".")
    while at != -1:
        leaf = leaves.get(name[:at])
        if leaf is not None and ARRAYS[leaf[0]](leaf[1], name[at + 1 :]):
            return True
        at = name.find(".", at + 1)
    return False


def _json(raw: Any, what: str) -> Any:
    if not isinstance(raw, str):
        raise ValueError(f"no {what} metadata")
    return json.loads(raw)


def _leaves(items: Any, prefix: str, out: dict[str, tuple[str, Mapping[str, Any]]]) -> None:
    """The layer leaves of the metadata tree ``items`` (``layers.encode``'s) by path, into ``out``;
    a placeholder (``cls`` None) and a class without arrays here declare nothing."""
    if not isinstance(items, list):
        raise ValueError("a layer tree is not a list")
    for i, node in enumerate(items):
        if not isinstance(node, dict):
            raise ValueError("a layer node is not an object")
        path, cls = f"{prefix}{i}", node.get("cls")
        if cls == "CacheList":
            _leaves(node.get("items"), path + ".", out)
        elif isinstance(cls, str) and cls in ARRAYS:
            meta = node.get("meta")
            out[path] = (cls, meta if isinstance(meta, dict) else {})
