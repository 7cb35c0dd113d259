"""Exhaustive Hamming-distance search over packed binary codes: k nearest and within a radius.

Retrieval by Hamming ranking (He, Cakir, Bargal & Sclaroff, "Hashing as Tie-Aware Learning to
Rank", CVPR 2018, Sec. 3.1-3.2): the database is ranked by the integer distance ``d ∈ {0..b}``,
so a ranking is ``b + 1`` tie groups and a counting sort orders it in ``O(N)`` per query (Sec. 3.2,
"Time complexity"). :class:`HammingIndex` does exactly that on packed codes (XOR + popcount, 8
bytes per 64-bit code): two passes over the database per query, one to histogram the distances
and one to place the selected items, so results are ordered by distance and, within a distance,
by insertion order — deterministic, never by an arbitrary sort.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numba import njit, prange

from .._disk import atomic_write
from .._packing import PackedCodes, _word_dtype, as_packed_codes, code_distance
from .._threads import keeps_torch_threads
from .._validation import Interval, check_scalar

__all__ = ["HammingIndex"]

_FORMAT = 1


@njit(parallel=True, cache=True)
def _knn_kernel(queries, database, bits, k, out_dist, out_index):  # pragma: no cover - numba
    n = database.shape[0]
    for i in prange(queries.shape[0]):
        counts = np.zeros(bits + 2, dtype=np.int64)
        for j in range(n):
            counts[code_distance(queries, i, database, j)] += 1
        # threshold distance t: every item closer than t is taken, then the first `need` at t
        taken = 0
        t = 0
        while taken + counts[t] < k:
            taken += counts[t]
            t += 1
        need = k - taken
        pos = np.zeros(bits + 2, dtype=np.int64)
        acc = 0
        for d in range(t + 1):
            pos[d] = acc
            acc += counts[d]
        for j in range(n):
            d = code_distance(queries, i, database, j)
            if d < t:
                slot = pos[d]
                pos[d] += 1
            elif d == t and need > 0:
                slot = pos[d]
                pos[d] += 1
                need -= 1
            else:
                continue
            out_dist[i, slot] = d
            out_index[i, slot] = j


@njit(parallel=True, cache=True)
def _radius_count_kernel(queries, database, radius, counts):  # pragma: no cover - numba
    n = database.shape[0]
    for i in prange(queries.shape[0]):
        c = 0
        for j in range(n):
            if code_distance(queries, i, database, j) <= radius:
                c += 1
        counts[i] = c


@njit(parallel=True, cache=True)
def _radius_fill_kernel(queries, database, radius, lims, out_dist, out_index):  # pragma: no cover
    n = database.shape[0]
    for i in prange(queries.shape[0]):
        hist = np.zeros(radius + 2, dtype=np.int64)
        for j in range(n):
            d = code_distance(queries, i, database, j)
            if d <= radius:
                hist[d] += 1
        pos = np.zeros(radius + 2, dtype=np.int64)
        acc = lims[i]
        for d in range(radius + 1):
            pos[d] = acc
            acc += hist[d]
        for j in range(n):
            d = code_distance(queries, i, database, j)
            if d <= radius:
                out_dist[pos[d]] = d
                out_index[pos[d]] = j
                pos[d] += 1


class HammingIndex:
    """Exact k-nearest-neighbour and radius search by Hamming distance over packed codes.

    Codes are stored packed (``ceil(b / 8)`` bytes in the narrowest machine word). Results are
    ordered as in the module docstring; returned indices are the ``ids`` given to :meth:`add`
    (default: the insertion positions ``0, 1, ...``).

    Args:
        bits: code length ``b``.

    Example:
        >>> import numpy as np
        >>> from rankwise.hashing import HammingIndex
        >>> index = HammingIndex(bits=4)
        >>> index.add(np.array([[1, 1, 1, 1], [1, 1, -1, -1], [1, -1, 1, -1], [-1, -1, -1, -1]]))
        >>> distances, ids = index.search(np.array([[1, 1, 1, -1]]), k=3)  # (N, 4) in {-1, +1}
        >>> distances.tolist(), ids.tolist()  # three codes at distance 1: insertion order
        ([[1, 1, 1]], [[0, 1, 2]])
    """

    def __init__(self, bits: int) -> None:
        self.bits = check_scalar(bits, "bits", Interval("integer", 1, None))
        self._chunks: list[np.ndarray] = []
        self._id_chunks: list[np.ndarray] = []
        self._words: np.ndarray | None = None
        self._ids: np.ndarray | None = None
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def ntotal(self) -> int:
        """Number of stored codes."""
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes taken by the stored codes."""
        return int(sum(c.nbytes for c in self._chunks))

    def _packed(self, codes: Any, name: str) -> PackedCodes:
        packed = as_packed_codes(codes, name, self.bits if _is_packed(codes) else None)
        if packed.bits != self.bits:
            raise ValueError(
                f"`{name}` has {packed.bits}-bit codes but the index holds {self.bits}-bit codes."
            )
        # the kernels read both sides with the index's word size: a PackedCodes of another word
        # type (e.g. uint8 bytes against uint64 words) is repacked, the bits stay the same
        return packed.to(_word_dtype(self.bits))

    def add(self, codes: Any, ids: Any = None) -> None:
        """Append codes (any form accepted by :func:`rankwise.hashing.as_packed_codes`).

        Args:
            codes: ``(n, b)`` ``{-1, +1}`` / ``{0, 1}`` codes or ``(n, W)`` packed words.
            ids: optional ``(n,)`` integer ids returned by the searches (default: positions).
        """
        packed = self._packed(codes, "codes")
        n = len(packed)
        if ids is None:
            id_array = np.arange(self._size, self._size + n, dtype=np.int64)
        else:
            id_array = np.asarray(ids)
            if id_array.shape != (n,) or id_array.dtype.kind not in "iu":
                raise ValueError(f"`ids` must be a 1-D integer array of length {n} (one per code).")
            id_array = id_array.astype(np.int64)
        self._chunks.append(packed.words)
        self._id_chunks.append(id_array)
        self._size += n
        self._words = None
        self._ids = None

    def _database(self) -> tuple[np.ndarray, np.ndarray]:
        words, ids = self._words, self._ids
        if words is None or ids is None:
            if self._chunks:
                words = np.ascontiguousarray(np.concatenate(self._chunks))
                ids = np.concatenate(self._id_chunks)
                self._chunks, self._id_chunks = [words], [ids]
            else:
                words = np.zeros((0, 1), dtype=np.uint8)
                ids = np.zeros(0, dtype=np.int64)
            self._words, self._ids = words, ids
        return words, ids

    def codes(self) -> PackedCodes | None:
        """The stored codes, packed (None while the index is empty)."""
        return PackedCodes(self._database()[0], self.bits) if self._size else None

    @keeps_torch_threads
    def search(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` nearest stored codes of every query.

        Args:
            queries: ``(n_q, b)`` codes or packed words.
            k: number of neighbours, ``1 <= k <= ntotal``.

        Returns:
            ``(distances, ids)``: ``(n_q, k)`` int64 arrays, by increasing distance and then by
            insertion order.
        """
        k = check_scalar(k, "k", Interval("integer", 1, None))
        if self._size == 0:
            raise ValueError("the index is empty (0 codes); add codes with HammingIndex.add first.")
        if k > self._size:
            raise ValueError(
                f"`k`={k} exceeds the {self._size} codes in the index; pass k <= {self._size}."
            )
        q = self._packed(queries, "queries")
        words, ids = self._database()
        out_dist = np.empty((len(q), k), dtype=np.int64)
        out_index = np.empty((len(q), k), dtype=np.int64)
        _knn_kernel(q.words, words, self.bits, k, out_dist, out_index)
        return out_dist, ids[out_index]

    @keeps_torch_threads
    def radius_search(self, queries: Any, radius: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every stored code within Hamming distance ``radius`` (inclusive) of each query.

        Args:
            queries: ``(n_q, b)`` codes or packed words.
            radius: integer ``>= 0``.

        Returns:
            ``(lims, distances, ids)`` in the layout of faiss' range search: the results of query
            ``i`` are ``distances[lims[i]:lims[i+1]]`` and ``ids[lims[i]:lims[i+1]]``, ordered by
            distance and then insertion order; ``lims`` has ``n_q + 1`` entries.
        """
        radius = check_scalar(radius, "radius", Interval("integer", 0, None))
        radius = min(radius, self.bits)
        q = self._packed(queries, "queries")
        words, ids = self._database()
        counts = np.zeros(len(q), dtype=np.int64)
        if self._size:
            _radius_count_kernel(q.words, words, radius, counts)
        lims = np.zeros(len(q) + 1, dtype=np.int64)
        np.cumsum(counts, out=lims[1:])
        out_dist = np.empty(int(lims[-1]), dtype=np.int64)
        out_index = np.empty(int(lims[-1]), dtype=np.int64)
        if self._size:
            _radius_fill_kernel(q.words, words, radius, lims, out_dist, out_index)
        return lims, out_dist, ids[out_index]

    def save(self, path: str | os.PathLike) -> Path:
        """Write the packed codes, ids and code length to a ``.npz`` file (atomically)."""
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_suffix(path.suffix + ".npz")
        words, ids = self._database()
        packed = PackedCodes(words, self.bits).to("uint8").words if self._size else words
        arrays = {"format": np.int64(_FORMAT), "bits": np.int64(self.bits)}
        arrays.update(codes=packed.astype(np.uint8), ids=ids)
        atomic_write(path, lambda handle: np.savez(handle, **arrays))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> HammingIndex:
        """Read an index written by :meth:`save` (no pickled objects are ever loaded)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no Hamming index at {str(path)!r}.")
        try:
            with np.load(path, allow_pickle=False) as data:
                fields = {key: data[key] for key in ("format", "bits", "codes", "ids")}
        except (KeyError, ValueError, OSError) as exc:
            raise ValueError(
                f"{str(path)!r} is not a HammingIndex file (written by HammingIndex.save): {exc}"
            ) from None
        if int(fields["format"]) != _FORMAT:
            raise ValueError(f"{str(path)!r}: unsupported index format {int(fields['format'])}.")
        index = cls(int(fields["bits"]))
        if fields["codes"].shape[0]:
            index.add(fields["codes"], ids=fields["ids"])
        return index

    def __repr__(self) -> str:
        return f"HammingIndex(bits={self.bits}, ntotal={self._size})"


def _is_packed(codes: Any) -> bool:
    """Whether ``codes`` is an array of unsigned words (read as packed codes of the index's bits)."""
    if isinstance(codes, torch.Tensor):
        return not codes.is_floating_point() and not codes.is_signed() and codes.dtype != torch.bool
    return isinstance(codes, np.ndarray) and codes.dtype.kind == "u"
