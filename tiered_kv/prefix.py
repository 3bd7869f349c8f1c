"""Longest common token prefix, vectorised (numpy): cheap for hundreds of 32k-token entries; how
much of an entry's ids was its prompt (numpy only: the disk tier's tools import it without MLX)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TokenArray = np.ndarray  # 1-D int32


def entry_prompt_len(n_ids: int, prompt_tokens: int | None) -> int:
    """How many of an entry's ``n_ids`` ids were its request's prompt: ``prompt_tokens``, or all
    of them where that is None (not recorded: entries and files from before it was, adopted
    ones)."""
    return n_ids if prompt_tokens is None else prompt_tokens


def as_tokens(ids: Sequence[int] | np.ndarray) -> TokenArray:
    """Token ids as a read-only 1-D int32 array (entries are immutable values)."""
    arr = np.array(ids, dtype=np.int32).reshape(-1)
    arr.setflags(write=False)
    return arr


def common_prefix(a: TokenArray, b: TokenArray) -> int:
    """Number of leading tokens ``a`` and ``b`` share.

    Compares in windows that double in size, so entries that diverge early (another conversation
    sharing only the system prompt) cost a fraction of their length.
    """
    n = min(len(a), len(b))
    start, width = 0, 256
    while start < n:
        stop = min(n, start + width)
        diff = np.flatnonzero(a[start:stop] != b[start:stop])
        if len(diff):
            return start + int(diff[0])
        start, width = stop, width * 2
    return n
