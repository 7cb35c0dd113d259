"""Keep torch's intra-op thread count stable across numba calls.

numba's OpenMP threading layer shares the OpenMP runtime with torch's CPU kernels, and its first
parallel launch resets the runtime's thread count (to numba's own, the number of cores). torch then
silently runs with that many threads, which changes the reduction order of its kernels, so a
training run that evaluates (numba) and then trains (torch) would no longer be bit-for-bit
reproducible — e.g. an interrupted-and-resumed run would differ from an uninterrupted one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

import torch

__all__ = ["keeps_torch_threads", "preserve_torch_threads"]

P = ParamSpec("P")
R = TypeVar("R")


@contextmanager
def preserve_torch_threads() -> Iterator[None]:
    """Restore ``torch.get_num_threads()`` after the block if anything inside changed it."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def keeps_torch_threads(function: Callable[P, R]) -> Callable[P, R]:
    """Decorator form of :func:`preserve_torch_threads` for entry points that run numba kernels."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with preserve_torch_threads():
            return function(*args, **kwargs)

    return wrapper
