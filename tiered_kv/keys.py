"""Prefix keys: pure functions from (fingerprint, block size, parent key, block ids) to hashes.

No I/O, no MLX. A key is only an *index*: every consumer compares the stored token ids exactly
before serving anything, so a collision costs a miss, never a wrong answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import NewType

import numpy as np
import xxhash

#: On-disk / key format version. Bump on any incompatible change of the entry file or the key
#: scheme: it is mixed into every fingerprint, so old files land in another directory (and are
#: evicted as stale) instead of being misread.
#: 2: chunked xxh3 per tensor in the entry header, sqlite index. 3: splittable layer tensors are
#: stored token-major, (1, T, heads, row), listed in the header's token_major (a token range of
#: a tensor is one contiguous run of the file).
FORMAT_VERSION = 3

BlockHash = NewType("BlockHash", int)  # xxh3_64 of (parent key, block ids as int32 LE bytes)


def fingerprint(parts: Mapping[str, str]) -> str:
    """Hex digest (32 chars) of ``parts`` plus :data:`FORMAT_VERSION`.

    ``parts`` names everything that makes KV state incompatible: model identity, tokenizer +
    chat-template hash, KV dtype / quantisation, cache layout, salt. Order does not matter.
    """
    canon = dict(parts)
    canon.setdefault("format_version", str(FORMAT_VERSION))
    text = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return xxhash.xxh3_128_hexdigest(text.encode())


def tier_fingerprint(base: str, salt: str = "", kv_bits: int = 0, kv_group_size: int = 64) -> str:
    """The cold tier's directory key: ``base`` unless a salt or stored-KV quantisation is set.

    Salted tenants therefore share no directory, no index and no file.
    """
    if not salt and not kv_bits:
        return base
    parts = {"base": base, "salt": salt}
    if kv_bits:
        parts["kv"] = f"q{kv_bits}g{kv_group_size}"
    return fingerprint(parts)


def as_int32(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array (the hashed and stored form)."""
    arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i4"))
    assert arr.ndim == 1, "token ids must be one-dimensional"
    return arr


def seed_key(seed: str) -> int:
    """The chain's root parent: a hash of the seed (fingerprint + block size)."""
    return xxhash.xxh3_64_intdigest(seed.encode())


def block_hashes(
    tokens: Sequence[int] | np.ndarray, block_tokens: int, seed: str
) -> list[BlockHash]:
    """Chained keys of the full blocks of ``tokens``: key_i = xxh3_64(key_{i-1} ‖ block_i).

    Only full blocks are hashed; a prompt shorter than one block has no keys.
    """
    assert block_tokens > 0
    buf = as_int32(tokens).tobytes()
    step = 4 * block_tokens
    parent = seed_key(seed)
    out: list[BlockHash] = []
    for start in range(0, len(buf) - step + 1, step):
        parent = xxhash.xxh3_64_intdigest(parent.to_bytes(8, "little") + buf[start : start + step])
        out.append(BlockHash(parent))
    return out


def prompt_key(blocks: Sequence[BlockHash], prompt_len: int, block_tokens: int) -> BlockHash | None:
    """The key of the last full block inside an entry's prompt (its first ``prompt_len`` ids), of
    the entry's chained ``blocks``: a new entry whose keys hold it resent that much of the
    prompt. None when the prompt is shorter than one block."""
    depth = min(prompt_len // block_tokens, len(blocks))
    return blocks[depth - 1] if depth > 0 else None
