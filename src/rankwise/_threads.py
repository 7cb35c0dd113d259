"""Keep torch's intra-op thread count stable across numba calls.

numba's OpenMP threading layer shares the OpenMP runtime with torch's CPU kernels, and its first
parallel launch resets the runtime's thread count (to numba's own, the number of cores). torch then
silently runs with that many threads, which changes the reduction order of its kernels, so a
training run that evaluates (numba) and then trains (torch) would no longer be bit-for-bit
reproducible — e.g. an interrupted-and-resumed run would differ from an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["preserve_torch_threads"]


@contextmanager
def preserve_torch_threads() -> Iterator[None]:
    """Restore ``torch.get_num_threads()`` after the block if anything inside changed it."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
