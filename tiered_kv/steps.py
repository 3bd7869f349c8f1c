"""Step-wise calls: a generator that yields while it waits on another thread and returns its result.

The batch loop keeps decoding while a disk hit is read: the load is written as a generator, the
loop calls ``next()`` between its decode steps, and a caller with nothing else to do runs it to
its end with :func:`drain`.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")
Steps = Generator[None, None, T]  # next() until StopIteration carries the result


def drain(steps: Steps[T]) -> T:
    """Run a step-wise call to its end (nothing else to do meanwhile)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
