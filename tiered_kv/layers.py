"""Per-layer cache types: an explicit registry of what each mlx-lm cache class supports.

For every supported class a :class:`Codec` says

* ``length``  — how many tokens the layer state represents (``None``: the class does not know,
  e.g. recurrent ``ArraysCache`` state; then the entry's token count is authoritative);
* ``view``    — a *new* cache object that represents the first ``n`` tokens and **shares** the
  stored arrays (no copy). MLX arrays are values: a later ``update_and_fetch`` on the view
  (slice assignment, concatenate) produces new buffers and never writes into a buffer that the
  stored entry still references, so a stored entry is never mutated by generation on a view.
  ``None`` when the state cannot be served at ``n`` (wrapped rotating window, recurrent state
  at another length);
* ``cut``     — the first ``n`` tokens of a cache the caller owns, as a cache the caller owns (the
  argument must not be used afterwards: the result may share and later write its buffers);
  ``None`` when the class cannot be cut to ``n`` (a rotating window past its window, recurrent
  state — served from checkpoints instead, see :mod:`tiered_kv.checkpoints`). The one place that
  knows how each class is cut back: mlx-lm's ``trim()`` is right for some classes and wrong for
  ``ConcatenateKVCache`` (it lowers the offset, the arrays keep the tail);
* ``encode`` / ``decode`` — the valid region as named arrays plus string meta (class, offset,
  quantisation parameters), the cold tier's on-disk form.

Unknown classes raise :class:`UnsupportedCache`; callers turn that into "do not cache" (logged once).
No ``globals()`` lookup: decoding only instantiates classes named in ``CODECS``. The arrays' names
are :mod:`tiered_kv.declared`'s (``KEYS``, ``quantized``, ``state``): the header check that reads
files without MLX checks them against the same spelling.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

from tiered_kv import declared
from tiered_kv.declared import KEYS, VALUES

Arrays = dict[str, mx.array]
Meta = dict[str, Any]


class UnsupportedCache(TypeError):
    """A cache class this project does not know how to share or persist."""


class CorruptState(ValueError):
    """Encoded layer state that does not decode into a consistent cache (bad shapes, missing arrays)."""


@dataclass(frozen=True)
class Codec:
    cls: type
    length: Callable[[Any], int | None]
    view: Callable[[Any, int, int], Any | None]
    encode: Callable[[Any], tuple[Arrays, Meta]]
    decode: Callable[[Arrays, Meta], Any]
    cut: Callable[[Any, int], Any | None]
    #: True when any prefix of the state is a slice of it (plain attention KV). False for state
    #: that only exists at its own length (recurrent, sliding window): those layers need checkpoints.
    positional: bool = True


def _sl(x: mx.array, start: int, stop: int) -> mx.array:
    return x[..., start:stop, :]


# -- KVCache ---------------------------------------------------------------------------------
def _kv_view(c: C.KVCache, n: int, total: int) -> C.KVCache | None:
    out = C.KVCache()
    if n > c.offset:
        return None
    if n > 0:
        out.keys, out.values, out.offset = _sl(c.keys, 0, n), _sl(c.values, 0, n), n
    return out


def _trim_copy(c: Any, n: int) -> Any:
    """A shallow copy cut to ``n`` by the class's own ``trim()`` (offset lowered, buffers and their
    capacity shared: the next write lands in them, as on the original)."""
    out = copy.copy(c)
    out.trim(out.offset - n)
    return out


def _kv_cut(c: C.KVCache | C.QuantizedKVCache, n: int) -> Any | None:
    return _trim_copy(c, n) if 0 <= n <= c.offset else None


def _kv_encode(c: C.KVCache) -> tuple[Arrays, Meta]:
    if c.keys is None:
        return {}, {"offset": 0}
    return {KEYS: _sl(c.keys, 0, c.offset), VALUES: _sl(c.values, 0, c.offset)}, {
        "offset": c.offset
    }


def _kv_decode(a: Arrays, m: Meta) -> C.KVCache:
    c = C.KVCache()
    off = int(m["offset"])
    if off:
        k, v = a[KEYS], a[VALUES]
        if k.ndim != 4 or k.shape[2] != off or v.shape[2] != off:
            raise CorruptState(f"KVCache arrays do not match offset {off}")
        c.keys, c.values, c.offset = k, v, off
    return c


# -- QuantizedKVCache ------------------------------------------------------------------------
def _q_view(c: C.QuantizedKVCache, n: int, total: int) -> C.QuantizedKVCache | None:
    out = C.QuantizedKVCache(group_size=c.group_size, bits=c.bits)
    if n > c.offset:
        return None
    if n > 0:
        out.keys = tuple(_sl(x, 0, n) for x in c.keys)
        out.values = tuple(_sl(x, 0, n) for x in c.values)
        out.offset = n
    return out


def _q_encode(c: C.QuantizedKVCache) -> tuple[Arrays, Meta]:
    meta = {"offset": c.offset, "group_size": c.group_size, "bits": c.bits}
    if c.keys is None:
        meta["offset"] = 0
        return {}, meta
    arrays: Arrays = {}
    for name, parts in ((KEYS, c.keys), (VALUES, c.values)):
        for i, x in enumerate(parts):
            arrays[declared.quantized(name, i)] = _sl(x, 0, c.offset)
    return arrays, meta


def _q_decode(a: Arrays, m: Meta) -> C.QuantizedKVCache:
    c = C.QuantizedKVCache(group_size=int(m["group_size"]), bits=int(m["bits"]))
    off = int(m["offset"])
    if off:
        try:
            parts = range(declared.QUANTIZED_PARTS)
            c.keys = tuple(a[declared.quantized(KEYS, i)] for i in parts)
            c.values = tuple(a[declared.quantized(VALUES, i)] for i in parts)
        except KeyError as e:
            raise CorruptState(f"QuantizedKVCache missing {e}") from None
        if any(x.shape[2] != off for x in (*c.keys, *c.values)):
            raise CorruptState("QuantizedKVCache arrays do not match offset")
        c.offset = off
    return c


# -- RotatingKVCache (sliding window) --------------------------------------------------------
def _rot_length(c: C.RotatingKVCache) -> int:
    return int(c.offset)


def _rot_view(c: C.RotatingKVCache, n: int, total: int) -> C.RotatingKVCache | None:
    out = C.RotatingKVCache(max_size=c.max_size, keep=c.keep)
    if n > c.offset:
        return None
    if n == 0:
        return out
    if c.offset <= c.max_size and c.keys is not None and c._idx == c.offset:
        # Not wrapped yet: the buffer is in temporal order, so the first n tokens are a slice.
        out.keys, out.values = _sl(c.keys, 0, n), _sl(c.values, 0, n)
        out.offset, out._idx = n, n
        return out
    if n == c.offset:
        # Wrapped: only the exact state is valid. Share the buffers, never the array objects:
        # mlx-lm writes a token by slice assignment, which rebinds the array it is called on, so
        # a shared object would carry the request's writes into the stored state. A slice is an
        # array of its own (and a buffer still shared is copied, not written, by the update).
        out.keys, out.values = _sl(c.keys, 0, c.keys.shape[2]), _sl(c.values, 0, c.values.shape[2])
        out.offset, out._idx = c.offset, c._idx
        return out
    return None


def _rot_cut(c: C.RotatingKVCache, n: int) -> C.RotatingKVCache | None:
    if n == c.offset:
        return copy.copy(c)
    # in temporal order and never wrapped (mlx-lm's is_trimmable), else the earlier tokens are gone
    return _trim_copy(c, n) if 0 <= n < c.offset and _trimmable(c) else None


def _rot_encode(c: C.RotatingKVCache) -> tuple[Arrays, Meta]:
    meta = {"offset": c.offset, "keep": c.keep, "max_size": c.max_size, "idx": c._idx}
    if c.keys is None:
        return {}, meta
    stored = c.keys.shape[2] if c.offset > c.max_size or c._idx != c.offset else c.offset
    meta["stored"] = stored
    return {KEYS: _sl(c.keys, 0, stored), VALUES: _sl(c.values, 0, stored)}, meta


def _rot_decode(a: Arrays, m: Meta) -> C.RotatingKVCache:
    c = C.RotatingKVCache(max_size=int(m["max_size"]), keep=int(m["keep"]))
    c.offset, c._idx = int(m["offset"]), int(m["idx"])
    if KEYS in a:
        c.keys, c.values = a[KEYS], a[VALUES]
        if c.keys.shape[2] != int(m["stored"]) or c.values.shape[2] != int(m["stored"]):
            raise CorruptState("RotatingKVCache arrays do not match meta")
    elif c.offset:
        raise CorruptState("RotatingKVCache without arrays")
    return c


# -- ArraysCache (recurrent / SSM state: exact length only) ----------------------------------
def _arr_view(c: C.ArraysCache, n: int, total: int) -> C.ArraysCache | None:
    if n != total:
        return None
    out = C.ArraysCache(len(c.cache))
    # state arrays of its own (sharing the buffers): mlx-lm's recurrent layers rebind their state
    # today, but a slice assignment into a shared array object would reach the stored entry
    out.cache = [x if x is None or x.ndim == 0 else x[0 : x.shape[0]] for x in c.cache]
    return out


def _arr_cut(c: C.ArraysCache, n: int) -> None:
    return None  # recurrent state: its length is not known and it has no earlier states


def _arr_encode(c: C.ArraysCache) -> tuple[Arrays, Meta]:
    if c.left_padding is not None or c.lengths is not None:
        raise UnsupportedCache("batched ArraysCache (left_padding / lengths) is not cached")
    arrays = {declared.state(i): x for i, x in enumerate(c.cache) if x is not None}
    return arrays, {"size": len(c.cache)}


def _arr_decode(a: Arrays, m: Meta) -> C.ArraysCache:
    c = C.ArraysCache(int(m["size"]))
    c.cache = [a.get(declared.state(i)) for i in range(int(m["size"]))]
    return c


# -- ChunkedKVCache --------------------------------------------------------------------------
def _ch_view(c: C.ChunkedKVCache, n: int, total: int) -> C.ChunkedKVCache | None:
    out = C.ChunkedKVCache(c.chunk_size)
    if n > c.offset or (n < c.offset and n < c.start_position):
        return None
    if n == 0:
        return out
    s = c.start_position
    out.keys, out.values = _sl(c.keys, 0, n - s), _sl(c.values, 0, n - s)
    out.offset, out.start_position = n, s
    return out


def _ch_cut(c: C.ChunkedKVCache, n: int) -> C.ChunkedKVCache | None:
    if n == c.offset:
        return copy.copy(c)
    # tokens before start_position were dropped by the chunking
    return _trim_copy(c, n) if c.start_position <= n < c.offset else None


def _ch_encode(c: C.ChunkedKVCache) -> tuple[Arrays, Meta]:
    meta = {"offset": c.offset, "chunk_size": c.chunk_size, "start": c.start_position}
    if c.keys is None:
        return {}, meta
    end = c.offset - c.start_position
    return {KEYS: _sl(c.keys, 0, end), VALUES: _sl(c.values, 0, end)}, meta


def _ch_decode(a: Arrays, m: Meta) -> C.ChunkedKVCache:
    c = C.ChunkedKVCache(int(m["chunk_size"]))
    c.offset, c.start_position = int(m["offset"]), int(m["start"])
    if KEYS in a:
        c.keys, c.values = a[KEYS], a[VALUES]
        if c.keys.shape[2] != c.offset - c.start_position:
            raise CorruptState("ChunkedKVCache arrays do not match meta")
    return c


# -- ConcatenateKVCache (buffers exactly as long as the valid tokens) -------------------------
def _cat_view(c: Any, n: int, total: int) -> Any:
    out = C.ConcatenateKVCache()
    if n > c.offset:
        return None
    if n > 0:
        out.keys, out.values, out.offset = _sl(c.keys, 0, n), _sl(c.values, 0, n), n
    return out


def _cat_cut(c: C.ConcatenateKVCache, n: int) -> C.ConcatenateKVCache | None:
    # never trim(): it lowers the offset and the next concatenate appends after the stale tail
    return c if n == c.offset else _cat_view(c, n, c.offset)


def _cat_decode(a: Arrays, m: Meta) -> Any:
    c = C.ConcatenateKVCache()
    off = int(m["offset"])
    if off:
        c.keys, c.values, c.offset = a[KEYS], a[VALUES], off
        if c.keys.shape[2] != off or c.values.shape[2] != off:
            raise CorruptState(f"ConcatenateKVCache arrays do not match offset {off}")
    return c


CODECS: dict[str, Codec] = {
    "KVCache": Codec(C.KVCache, lambda c: int(c.offset), _kv_view, _kv_encode, _kv_decode, _kv_cut),
    "QuantizedKVCache": Codec(
        C.QuantizedKVCache, lambda c: int(c.offset), _q_view, _q_encode, _q_decode, _kv_cut
    ),
    "RotatingKVCache": Codec(
        C.RotatingKVCache, _rot_length, _rot_view, _rot_encode, _rot_decode, _rot_cut,
        positional=False,
    ),
    "ArraysCache": Codec(
        C.ArraysCache, lambda c: None, _arr_view, _arr_encode, _arr_decode, _arr_cut,
        positional=False,
    ),
    "ConcatenateKVCache": Codec(
        C.ConcatenateKVCache, lambda c: int(c.offset), _cat_view, _kv_encode, _cat_decode, _cat_cut
    ),
    "ChunkedKVCache": Codec(
        C.ChunkedKVCache, lambda c: int(c.offset), _ch_view, _ch_encode, _ch_decode, _ch_cut,
        positional=False,
    ),
}


def codec_for(layer: Any) -> Codec:
    """The codec of ``layer``'s exact class (subclasses are not assumed compatible)."""
    codec = CODECS.get(type(layer).__name__)
    if codec is None or type(layer) is not codec.cls:
        raise UnsupportedCache(f"cache class {type(layer).__module__}.{type(layer).__name__}")
    return codec


# -- whole-model helpers (a model's cache is a list of layers; CacheList nests) ----------------
def leaves(caches: Sequence[Any]) -> list[Any]:
    """The per-layer caches with CacheList members flattened, in model order."""
    out: list[Any] = []
    for c in caches:
        if isinstance(c, C.CacheList) and type(c) is C.CacheList:
            out.extend(leaves(c.caches))
        else:
            out.append(c)
    return out


def check_supported(caches: Sequence[Any]) -> None:
    """Raise UnsupportedCache if any layer (CacheList members included) has no codec."""
    for leaf in leaves(caches):
        codec_for(leaf)


def nbytes(caches: Sequence[Any]) -> int:
    """Bytes of the valid state (not buffer capacity): what a copy or a file would hold."""
    arrays, _ = encode(caches)
    return sum(a.nbytes for a in arrays.values())


def reserve(caches: Sequence[Any], more: int) -> None:
    """Give every plain ``KVCache`` leaf room for ``more`` tokens past its offset, in one buffer
    (rounded up to its ``step``), so the prefill steps after write into it in place.

    mlx-lm's ``KVCache`` grows by a concatenation when a step does not fit: a long fill in steps
    allocates a larger copy of the whole cache every step. On CUDA (H100, 8B shape) those fresh
    allocations slowed a ranged read running beside the compute to a fraction of its pace: a
    `both` of 128k tokens (m 65536) 5.98-6.18 s with them, 4.14-4.17 s with the room reserved, its
    read 5.97 s against 3.92. Other classes (quantised, rotating, recurrent) are left as they are.
    Values only: the new buffers are this cache's own, the arrays it held before are not written.
    """
    grown: list[mx.array] = []
    for c in leaves(caches):
        if type(c) is not C.KVCache or c.keys is None or more <= 0:
            continue
        want = -(-(c.offset + more) // c.step) * c.step
        if c.keys.shape[2] >= want:
            continue
        b, h, _, dk = c.keys.shape
        keys = mx.zeros((b, h, want, dk), c.keys.dtype)
        values = mx.zeros((b, h, want, c.values.shape[3]), c.values.dtype)
        keys[..., : c.offset, :] = c.keys[..., : c.offset, :]
        values[..., : c.offset, :] = c.values[..., : c.offset, :]
        c.keys, c.values = keys, values
        grown += [keys, values]
    if grown:
        mx.eval(grown)


def can_trim(caches: Sequence[Any]) -> bool:
    """True when every layer can be cut back to any shorter length (plain attention KV)."""
    return all(codec_for(c).length(c) is not None and _trimmable(c) for c in leaves(caches))


def _trimmable(c: Any) -> bool:
    if isinstance(c, C.RotatingKVCache):
        return c.offset < c.max_size and c._idx == c.offset
    return True


def rebuild(caches: Sequence[Any], leaf: Callable[[Any], Any | None]) -> list[Any] | None:
    """``caches`` with every leaf replaced by ``leaf(c)``, in model order (CacheLists rebuilt
    around their members); None when ``leaf`` gives None for any of them."""
    out: list[Any] = []
    for c in caches:
        if type(c) is C.CacheList:
            sub = rebuild(c.caches, leaf)
            if sub is None:
                return None
            out.append(C.CacheList(*sub))
            continue
        v = leaf(c)
        if v is None:
            return None
        out.append(v)
    return out


def view(caches: Sequence[Any], n: int, total: int) -> list[Any] | None:
    """New cache objects for the first ``n`` of ``total`` tokens, sharing arrays; None if any
    layer cannot serve ``n``."""
    return rebuild(caches, lambda c: codec_for(c).view(c, n, total))


def cut(caches: Sequence[Any], n: int, have: int | None = None) -> list[Any] | None:
    """Owned caches cut back to their first ``n`` tokens (each leaf through its codec's ``cut``),
    or None — and the arguments untouched — when some leaf cannot be cut to ``n``.

    The arguments must not be used afterwards (the result shares their buffers). Leaves already
    at ``n`` are kept as they are. A leaf that does not know its length (recurrent state) is at
    ``have`` when given, else at ``n`` when every leaf that knows its length is.
    """
    known = [x for c in leaves(caches) if (x := codec_for(c).length(c)) is not None]
    if have is None:
        have = n if all(x == n for x in known) else -1

    def leaf(c: Any) -> Any | None:
        codec = codec_for(c)
        length = codec.length(c)
        return c if (have if length is None else length) == n else codec.cut(c, n)

    return rebuild(caches, leaf)


def encode(caches: Sequence[Any]) -> tuple[Arrays, dict[str, str]]:
    """Flatten a model cache into named arrays (``"<path>.<name>"``) and string metadata.

    ``metadata["layers"]`` is a JSON tree of ``{"cls": name, "meta": {...}}`` or
    ``{"cls": "CacheList", "items": [...]}``; arrays are the valid regions only (lazy slices:
    ``mx.eval`` them before they cross threads).
    """
    arrays: Arrays = {}
    tree = _encode_items(caches, "", arrays)
    return arrays, {"layers": json.dumps(tree, separators=(",", ":"))}


# encode / decode recurse through module functions, never a nested function that calls itself:
# that closure is a reference cycle (function -> its cell -> function) holding the arrays, which
# then outlive their last user until the next cyclic garbage collection (a whole reloaded entry)
def _encode_items(items: Sequence[Any], prefix: str, arrays: Arrays) -> list[dict[str, Any]]:
    """The metadata tree of ``items``; their arrays added to ``arrays``."""
    tree: list[dict[str, Any]] = []
    for i, c in enumerate(items):
        path = f"{prefix}{i}"
        if c is None:  # a checkpoint's placeholder for a layer served from the entry itself
            tree.append({"cls": None})
            continue
        if type(c) is C.CacheList:
            tree.append({"cls": "CacheList", "items": _encode_items(c.caches, path + ".", arrays)})
            continue
        codec = codec_for(c)
        a, m = codec.encode(c)
        for k, x in a.items():
            arrays[f"{path}.{k}"] = x
        tree.append({"cls": type(c).__name__, "meta": m})
    return tree


def decode(arrays: Arrays, metadata: dict[str, str]) -> list[Any]:
    """Inverse of :func:`encode`. Raises CorruptState / UnsupportedCache on foreign content."""
    try:
        tree = json.loads(metadata["layers"])
    except (KeyError, ValueError) as e:
        raise CorruptState(f"bad layer metadata: {e}") from None
    return _decode_items(tree, "", arrays)


def _decode_items(items: list[dict[str, Any]], prefix: str, arrays: Arrays) -> list[Any]:
    """The caches of the metadata tree ``items``, from ``arrays``."""
    out: list[Any] = []
    for i, node in enumerate(items):
        path = f"{prefix}{i}"
        cls = node.get("cls")
        if cls is None:
            out.append(None)
            continue
        if cls == "CacheList":
            out.append(C.CacheList(*_decode_items(node["items"], path + ".", arrays)))
            continue
        codec = CODECS.get(cls)
        if codec is None:
            raise UnsupportedCache(f"stored cache class {cls!r}")
        mine = {
            k[len(path) + 1 :]: v
            for k, v in arrays.items()
            if k.startswith(path + ".") and "." not in k[len(path) + 1 :].split(".", 1)[0]
        }
        try:
            out.append(codec.decode(mine, node["meta"]))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            if isinstance(e, CorruptState):
                raise
            raise CorruptState(f"layer {path}: {e!r}") from None
    return out


def layout(caches: Sequence[Any]) -> str:
    """A short description of the per-layer classes, part of the cold tier's fingerprint."""
    return ",".join(type(c).__name__ for c in leaves(caches))


# -- checkpoints (non-positional layers) -----------------------------------------------------
def needs_checkpoints(caches: Sequence[Any]) -> bool:
    """True when some layer's state cannot be cut back to an earlier length."""
    return any(not codec_for(c).positional for c in leaves(caches))


def quantize(caches: Sequence[Any], bits: int, group_size: int) -> list[Any]:
    """Plain KVCache leaves converted to mlx-lm's QuantizedKVCache (others unchanged)."""
    out: list[Any] = []
    for c in caches:
        if type(c) is C.CacheList:
            out.append(C.CacheList(*quantize(c.caches, bits, group_size)))
        elif type(c) is C.KVCache and c.keys is not None and c.keys.shape[-1] % group_size == 0:
            q = C.QuantizedKVCache(group_size=group_size, bits=bits)
            k, v = _sl(c.keys, 0, c.offset), _sl(c.values, 0, c.offset)
            q.keys = mx.quantize(k, group_size=group_size, bits=bits)
            q.values = mx.quantize(v, group_size=group_size, bits=bits)
            q.offset = c.offset
            out.append(q)
        else:
            out.append(c)
    return out
