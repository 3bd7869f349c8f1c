"""Longest common token prefix, vectorised (numpy): cheap for hundreds of 32k-token entries."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TokenArray = np.ndarray  # 1-D int32


def as_tokens(ids: Sequence[int] | np.ndarray) -> TokenArray:
    """Token ids as a read-only 1-D int32 array (entries are immutable values)."""
    arr = np.array(ids, dtype=np.int32).reshape(-1)
    arr.setflags(write=False)
    return arr


def common_prefix(a: TokenArray, b: TokenArray) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
