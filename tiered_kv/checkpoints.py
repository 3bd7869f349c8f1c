"""Checkpoints: snapshots of the non-positional layers (recurrent, sliding window) at positions.

A plain attention layer can be cut back to any shorter length (a slice), a recurrent or
sliding-window layer cannot: its state exists only at the length it was computed for. So during
prefill such a model's state is snapshotted at chosen positions, kept with the entry, and a
later prompt that diverges from the entry is served from the nearest checkpoint at or before the
common prefix. Every rule about checkpoints lives here, one function each:

* :func:`positions`  — where prefill takes them: after each end-of-message token, every
  ``TIERED_KV_CHECKPOINT_TOKENS`` tokens, and at the end of the prompt;
* :func:`take` / :func:`snapshot` — taking one (shared arrays, no copy);
* :func:`restore`    — caches at a checkpoint: positional layers sliced, the others from it;
* :func:`nearest`    — the checkpoint that serves a prompt; :func:`exact_lengths` /
  :func:`serves_all` — the lengths an entry serves exactly (what it may replace);
* :func:`upto` / :func:`inherit` — which of them a stored entry / a lease keeps;
* :func:`within`, :func:`for_disk` — the budget (``TIERED_KV_CHECKPOINT_SHARE``): the latest first;
* :func:`thin`      — over the hot tier's budget share: least recently used entries' earliest first;
* :func:`encode` / :func:`decode` — their on-disk form (arrays ``ckpt.<pos>.<path>``).

Ownership: snapshots share the caches' arrays (MLX arrays are values: later writes make new
buffers); they are made, restored and encoded on the thread that owns MLX. The functions over
positions and sizes are pure (values in, values out).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import mlx.core as mx

from tiered_kv import declared, layers

#: position → the snapshot taken there (one item per leaf; None for positional leaves)
Checkpoints = dict[int, list[Any]]
#: name prefix of checkpoint arrays in an entry file (its owner: what a file may hold)
PREFIX = declared.CHECKPOINT_PREFIX


# -- where ----------------------------------------------------------------------------------
def positions(start: int, rem: Sequence[int], eos_ids: Iterable[int], every: int) -> list[int]:
    """Where to snapshot non-positional layers while ``rem`` is prefilled onto ``start`` tokens:
    after each end-of-message token, every ``every`` tokens, and at the end of the prompt
    (positions in ``(start, start + len(rem)]``)."""
    eos = set(eos_ids)
    end = start + len(rem)
    cuts = {start + j + 1 for j, t in enumerate(rem) if t in eos}
    cuts.update(range((start // every + 1) * every, end, every))
    cuts.add(end)
    return sorted(c for c in cuts if start < c <= end)


# -- snapshot / restore ---------------------------------------------------------------------
def snapshot(caches: Sequence[Any]) -> list[Any]:
    """The non-positional leaves' current state (shared arrays, no copy); None for the others.

    Positional layers are restored from the entry itself by slicing, so a checkpoint costs only
    the recurrent / sliding-window state.
    """
    out: list[Any] = []
    for c in layers.leaves(caches):
        codec = layers.codec_for(c)
        if codec.positional:
            out.append(None)
            continue
        n = codec.length(c) or 0
        v = codec.view(c, n, n)
        assert v is not None, "a layer can always be viewed at its own length"
        out.append(v)
    return out


def take(ckpts: Checkpoints, fed: int, cuts: Sequence[int], caches: Sequence[Any]) -> None:
    """Prefill has evaluated ``fed`` tokens into ``caches``: record a snapshot there when ``fed``
    is one of the checkpoint positions ``cuts``."""
    if fed in cuts:
        ckpts[fed] = snapshot(caches)


def restore(
    caches: Sequence[Any], n: int, total: int, checkpoint: Sequence[Any] | None
) -> list[Any] | None:
    """Caches for the first ``n`` of ``total`` tokens: positional leaves viewed from ``caches``,
    the others from ``checkpoint`` (taken at exactly ``n``; None: views only). None when some
    layer cannot serve ``n``."""
    if checkpoint is None:
        return layers.view(caches, n, total)
    snaps = iter(checkpoint)

    def leaf(c: Any) -> Any | None:
        snap = next(snaps)
        if snap is None:
            return layers.codec_for(c).view(c, n, total)
        length = layers.codec_for(snap).length(snap) or 0
        return layers.codec_for(snap).view(snap, length, length)

    return layers.rebuild(caches, leaf)


# -- which serve what (pure) ----------------------------------------------------------------
def nearest(positions: Iterable[int], n: int) -> int:
    """The checkpoint that serves a prompt sharing ``n`` servable tokens with the entry: the
    latest at or before ``n`` (0: none)."""
    return max((p for p in positions if p <= n), default=0)


def exact_lengths(length: int, positions: Iterable[int], trimmable: bool) -> frozenset[int] | None:
    """Lengths an entry of ``length`` tokens serves exactly (so it may replace an older entry of
    that length): any (None) when every layer can be cut back, else its checkpoints and itself."""
    return None if trimmable else frozenset(positions) | {length}


def serves_all(
    length: int, positions: Iterable[int], trimmable: bool,
    other_length: int, other_positions: Iterable[int],
) -> bool:  # fmt: skip
    """True when an entry serves every request that an entry of ``other_length`` tokens (a prefix
    of its ids) with checkpoints ``other_positions`` served: at that length, and from each of its
    checkpoints."""
    if trimmable or other_length == length:
        return other_length <= length
    return other_length in set(positions) and set(other_positions) <= set(positions)


def upto(ckpts: Mapping[int, list[Any]], n: int) -> Checkpoints:
    """The checkpoints an entry of ``n`` tokens keeps: those inside it (positions in ``(0, n]``)."""
    return {p: snap for p, snap in ckpts.items() if 0 < p <= n}


def inherit(
    ckpts: Mapping[int, list[Any]], n: int, caches: Sequence[Any], needed: bool
) -> Checkpoints:
    """The checkpoints a lease starting at ``n`` tokens carries: the entry's up to ``n``, and,
    when the model needs them, the state it starts from (a checkpoint too)."""
    out = upto(ckpts, n)
    if needed and n not in out:
        out[n] = snapshot(caches)
    return out


# -- budget ---------------------------------------------------------------------------------
def snapshot_bytes(snap: Sequence[Any]) -> int:
    """Memory one snapshot's buffers occupy."""
    return int(sum(c.nbytes for c in snap if c is not None))


def total_bytes(ckpts: Mapping[int, list[Any]]) -> int:
    return sum(snapshot_bytes(s) for s in ckpts.values())


def within(sizes: Mapping[int, int], budget: int) -> list[int]:
    """Checkpoint positions to keep under ``budget`` bytes: the latest first (a later checkpoint
    serves more of a prompt that diverges late, the common case for agent turns)."""
    kept, total = [], 0
    for pos in sorted(sizes, reverse=True):
        if total + sizes[pos] > budget:
            break
        kept.append(pos)
        total += sizes[pos]
    return sorted(kept)


def for_disk(ckpts: Mapping[int, list[Any]], share: float, entry_bytes: int) -> Checkpoints:
    """The checkpoints written with an entry of ``entry_bytes``: at most ``share`` of its bytes
    (TIERED_KV_CHECKPOINT_SHARE), so on disk as in memory they keep to their share."""
    sizes = {p: snapshot_bytes(s) for p, s in ckpts.items()}
    return {p: ckpts[p] for p in within(sizes, int(share * entry_bytes))}


def thin(
    entries: Sequence[tuple[int, int, Mapping[int, int]]], limit: int
) -> dict[int, frozenset[int]]:
    """Checkpoints to drop so that all of them fit ``limit`` bytes.

    ``entries`` are ``(key, last_used, {position: bytes})``; returns key → positions to drop:
    the least recently used entries' earliest checkpoints first (a later one serves more of a
    diverging prompt, and a recent entry is likelier to be hit again)."""
    total = sum(sum(sizes.values()) for _, _, sizes in entries)
    drop: dict[int, frozenset[int]] = {}
    for key, _, sizes in sorted(entries, key=lambda e: e[1]):
        gone = []
        for pos in sorted(sizes):
            if total <= limit:
                break
            gone.append(pos)
            total -= sizes[pos]
        if gone:
            drop[key] = frozenset(gone)
        if total <= limit:
            break
    return drop


# -- on disk --------------------------------------------------------------------------------
def encode(ckpts: Mapping[int, list[Any]]) -> tuple[layers.Arrays, str | None]:
    """Checkpoint arrays named ``ckpt.<pos>.<path>`` and their layer trees as one JSON string
    (None when there are none). Lazy slices: evaluate before they cross threads."""
    arrays: layers.Arrays = {}
    tree: dict[str, str] = {}
    for pos, snap in ckpts.items():
        a, m = layers.encode(snap)
        arrays.update({f"{PREFIX}{pos}.{k}": x for k, x in a.items()})
        tree[str(pos)] = m["layers"]
    return arrays, (json.dumps(tree, separators=(",", ":")) if tree else None)


def is_checkpoint_array(name: str) -> bool:
    return name.startswith(PREFIX)


def decode(arrays: Mapping[str, mx.array], tree_json: str | None) -> Checkpoints:
    """Inverse of :func:`encode`. Raises layers.CorruptState / layers.UnsupportedCache."""
    try:
        tree = json.loads(tree_json or "{}")
        by_pos = {int(p): t for p, t in tree.items()}
    except (ValueError, AttributeError) as e:
        raise layers.CorruptState(f"bad checkpoint metadata: {e}") from None
    out: Checkpoints = {}
    for pos, layer_tree in by_pos.items():
        prefix = f"{PREFIX}{pos}."
        sub = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
        out[pos] = layers.decode(sub, {"layers": layer_tree})
    return out
