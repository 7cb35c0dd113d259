"""Counting kernels behind the exact, tie-aware retrieval metrics.

Tie-aware average precision (McSherry & Najork 2008; He et al., "Hashing as Tie-Aware Learning to
Rank", CVPR 2018, Prop. 1 / Eq. 6 in the per-position form of docs/errata.md) decomposes additively over
tie groups, and a tie group holding no relevant item contributes nothing. So for one query the
whole ranking is summarised, for every distinct score value ``v`` held by a relevant item, by three
counts: the number of items scoring strictly higher than ``v`` (``N_{d-1}`` in the paper), the
number scoring exactly ``v`` (``n_d``) and the relevant items among those (``n_d^+``). AP_T,
recall@k, precision@k, MAP@R, R-precision and the PR curve all follow from these counts in closed
form (see :mod:`rankwise.metrics.ranking`).

Two interchangeable producers of the counts live here:

* :func:`relevant_group_counts_numba` (CPU): per row, sort only the relevant scores, then one pass
  over the row puts every item between two consecutive distinct relevant values: a table of equal
  width buckets over the relevant values' range narrows each item to a handful of candidates, then a
  binary search among those. The row itself is never sorted, so the cost is O(N + R log R) for N
  items and R relevant ones, whatever the fraction of relevant items. Rows run in parallel.
* :func:`relevant_group_counts_torch` (CUDA, and fallback): a vectorised ``torch.sort`` of the
  whole score chunk followed by run-length bookkeeping with ``cummax`` / ``cummin``.

Both return the same integers in the same order (groups by decreasing score value), so every metric
derived from them is bit-identical between the two paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit, prange

from .._threads import keeps_torch_threads

__all__ = [
    "RelevantGroupCounts",
    "relevant_group_counts",
    "relevant_group_counts_numba",
    "relevant_group_counts_torch",
    "relevant_group_counts_from_lists",
    "relevant_lists_from_classes",
    "BUCKETS_PER_VALUE",
]

# Buckets of the lookup table per distinct relevant value. A plain binary search over m values costs
# log2(m) unpredictable branches per item (~120 ns per item at m = 2,000); with ~4 buckets per value
# most buckets hold at most one value and an item costs one table read. Measured on 20,000-item
# float32 rows with 2,000 relevant: 4 and 8 are equally fast and 3-4x faster than one bucket.
BUCKETS_PER_VALUE = 4
# Cap of the table (per row and thread: 512 KiB of int64); past it buckets just hold more values.
_MAX_BUCKETS = 1 << 16


@dataclass
class RelevantGroupCounts:
    """Per-query tie-group counts of a chunk of queries, in compressed row form.

    Group ``j`` of query ``i`` is entry ``offsets[i] + j`` of the flat arrays; the groups of a
    query are ordered by decreasing score value and only groups holding a relevant item appear.

    Attributes:
        n_groups: (B,) int64, number of distinct score values held by relevant items of each query.
        greater: (S,) int64, items scoring strictly higher than the group (``N_{d-1}``).
        size: (S,) int64, items tied at the group's score (``n_d``), relevant ones included.
        relevant: (S,) int64, relevant items in the group (``n_d^+``), at least 1.
    """

    n_groups: np.ndarray
    greater: np.ndarray
    size: np.ndarray
    relevant: np.ndarray
    # row_ids() / offsets() are asked for several times per chunk by the metrics; built once
    _row_ids: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _offsets: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def n_rows(self) -> int:
        return int(self.n_groups.shape[0])

    def row_ids(self) -> np.ndarray:
        """(S,) int64, the query (row) index of every group entry (read-only)."""
        if self._row_ids is None:
            self._row_ids = np.repeat(np.arange(self.n_rows, dtype=np.int64), self.n_groups)
            self._row_ids.flags.writeable = False
        return self._row_ids

    def offsets(self) -> np.ndarray:
        """(B + 1,) int64, start of each query's groups in the flat arrays (read-only)."""
        if self._offsets is None:
            out = np.zeros(self.n_rows + 1, dtype=np.int64)
            np.cumsum(self.n_groups, out=out[1:])
            out.flags.writeable = False
            self._offsets = out
        return self._offsets


@njit(cache=True, inline="always")
def _bucket_of(s, top, scale, last_bucket):  # pragma: no cover - numba
    """Bucket of score ``s`` (float64): floor((top - s) * scale) clamped to [0, last_bucket].

    Correctly rounded subtraction and multiplication are monotone, and so are floor and the clamp:
    ``s1 < s2`` implies bucket(s1) >= bucket(s2). The bucket therefore brackets exactly the
    distinct values a score can fall between, whatever the rounding.
    """
    t = (top - s) * scale
    if t > 0.0:  # NaN (inf * 0 when scale is 0: a single bucket) lands in bucket 0
        if t < last_bucket:
            return np.int64(t)
        return np.int64(last_bucket)
    return np.int64(0)


@njit(cache=True, inline="always")
def _n_strictly_above(distinct, s, lo, hi):  # pragma: no cover - numba
    """Number of values in the decreasing ``distinct`` that exceed ``s``, known to lie in [lo, hi]."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if distinct[mid] > s:
            lo = mid + 1
        else:
            hi = mid
    return lo


@njit(parallel=True, cache=True)
def _group_counts_kernel(
    scores, rel_ptr, rel_cols, self_index, buckets_per_value, greater, size, n_relevant, n_groups
):  # pragma: no cover - numba
    n_rows, n_items = scores.shape
    for i in prange(n_rows):
        start = rel_ptr[i]
        n_rel = rel_ptr[i + 1] - start
        skip = self_index[i]
        if n_rel == 0:
            n_groups[i] = 0
            continue
        # The distinct relevant values, decreasing, and how many relevant items hold each.
        vals = np.empty(n_rel, dtype=scores.dtype)
        for c in range(n_rel):
            vals[c] = scores[i, rel_cols[start + c]]
        vals.sort()
        distinct = np.empty(n_rel, dtype=scores.dtype)
        rel_count = np.zeros(n_rel, dtype=np.int64)
        m = 0
        for t in range(n_rel - 1, -1, -1):
            v = vals[t]
            if m > 0 and distinct[m - 1] == v:
                rel_count[m - 1] += 1
            else:
                distinct[m] = v
                rel_count[m] = 1
                m += 1
        lowest = distinct[m - 1]
        # Bucket table over [lowest, top]: bucket b holds distinct[first[b]:first[b + 1]]. An item
        # in bucket b lies below every value of the earlier buckets and above those of the later
        # ones (monotone bucketing), so only its own bucket's few values need a search.
        top = np.float64(distinct[0])
        n_buckets = max(1, min(buckets_per_value * m, _MAX_BUCKETS))
        value_span = top - np.float64(lowest)
        scale = n_buckets / value_span if value_span > 0.0 else 0.0
        if not scale < np.inf:  # a span of subnormals: one bucket, a plain binary search
            scale = 0.0
        last_bucket = np.float64(n_buckets - 1)
        first = np.zeros(n_buckets + 1, dtype=np.int64)
        for k in range(m):
            first[_bucket_of(np.float64(distinct[k]), top, scale, last_bucket) + 1] += 1
        for b in range(n_buckets):
            first[b + 1] += first[b]
        between = np.zeros(m, dtype=np.int64)  # items strictly between distinct[k-1] and [k]
        equal = np.zeros(m, dtype=np.int64)
        for j in range(n_items):
            s = scores[i, j]
            if s < lowest:
                continue
            b = _bucket_of(np.float64(s), top, scale, last_bucket)
            lo = _n_strictly_above(distinct, s, first[b], first[b + 1])
            if distinct[lo] == s:
                equal[lo] += 1
            else:
                between[lo] += 1
        if skip >= 0 and scores[i, skip] >= lowest:  # remove the excluded item again
            s = scores[i, skip]
            lo = _n_strictly_above(distinct, s, 0, m)
            if distinct[lo] == s:
                equal[lo] -= 1
            else:
                between[lo] -= 1
        above = 0
        for k in range(m):
            above += between[k]
            greater[start + k] = above
            size[start + k] = equal[k]
            n_relevant[start + k] = rel_count[k]
            above += equal[k]
        n_groups[i] = m


@njit(parallel=True, cache=True)
def _compact_kernel(slot_offsets, n_groups, greater, size, n_relevant):  # pragma: no cover
    n_rows = n_groups.shape[0]
    out_offsets = np.zeros(n_rows + 1, dtype=np.int64)
    for i in range(n_rows):
        out_offsets[i + 1] = out_offsets[i] + n_groups[i]
    n_out = out_offsets[n_rows]
    out_greater = np.empty(n_out, dtype=np.int64)
    out_size = np.empty(n_out, dtype=np.int64)
    out_relevant = np.empty(n_out, dtype=np.int64)
    for i in prange(n_rows):
        src = slot_offsets[i]
        dst = out_offsets[i]
        for k in range(n_groups[i]):
            out_greater[dst + k] = greater[src + k]
            out_size[dst + k] = size[src + k]
            out_relevant[dst + k] = n_relevant[src + k]
    return out_greater, out_size, out_relevant


def _compact(
    slot_offsets: np.ndarray,
    n_groups: np.ndarray,
    greater: np.ndarray,
    size: np.ndarray,
    n_relevant: np.ndarray,
):
    """Drop the unused slots (a row with duplicated relevant scores fills fewer than it owns)."""
    if np.array_equal(np.diff(slot_offsets), n_groups):
        return greater, size, n_relevant
    return _compact_kernel(slot_offsets, n_groups, greater, size, n_relevant)


@njit(parallel=True, cache=True)
def _class_member_lists(query_class, class_ptr, members, self_index):  # pragma: no cover
    n_rows = query_class.shape[0]
    n_listed = np.zeros(n_rows, dtype=np.int64)
    for i in prange(n_rows):
        c = query_class[i]
        if c < 0:
            continue
        n = class_ptr[c + 1] - class_ptr[c]
        skip = self_index[i]
        for t in range(class_ptr[c], class_ptr[c + 1]):  # the excluded row, if of the class
            if members[t] == skip:
                n -= 1
                break
        n_listed[i] = n
    rel_ptr = np.zeros(n_rows + 1, dtype=np.int64)
    for i in range(n_rows):
        rel_ptr[i + 1] = rel_ptr[i] + n_listed[i]
    rel_cols = np.empty(rel_ptr[n_rows], dtype=np.int64)
    for i in prange(n_rows):
        c = query_class[i]
        if c < 0:
            continue
        skip = self_index[i]
        out = rel_ptr[i]
        for t in range(class_ptr[c], class_ptr[c + 1]):
            if members[t] != skip:
                rel_cols[out] = members[t]
                out += 1
    return rel_ptr, rel_cols


def relevant_lists_from_classes(
    query_class: np.ndarray,
    class_ptr: np.ndarray,
    members: np.ndarray,
    self_index: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Relevant-item lists of queries whose relevant items are the gallery rows of their class.

    Args:
        query_class: (B,) int64 class of each query, -1 for a class absent from the gallery.
        class_ptr: (C + 1,) int64, class c's gallery rows are ``members[class_ptr[c]:class_ptr[c+1]]``.
        members: (n_g,) int64 gallery rows grouped by class.
        self_index: (B,) int64 gallery row to leave out of each query's list, -1 for none.

    Returns:
        ``(rel_ptr, rel_cols)`` as taken by :func:`relevant_group_counts_from_lists`.
    """
    query_class = np.ascontiguousarray(query_class, dtype=np.int64)
    self_index = _self_index_or_none(self_index, query_class.shape[0])
    return _class_member_lists(
        query_class,
        np.ascontiguousarray(class_ptr, dtype=np.int64),
        np.ascontiguousarray(members, dtype=np.int64),
        self_index,
    )


def _as_kernel_scores(scores: np.ndarray) -> np.ndarray:
    scores = np.ascontiguousarray(scores)
    if scores.dtype not in (np.float32, np.float64):
        scores = scores.astype(np.float32)
    return scores


def _self_index_or_none(self_index, n_rows: int) -> np.ndarray:
    if self_index is None:
        return np.full(n_rows, -1, dtype=np.int64)
    return np.ascontiguousarray(self_index, dtype=np.int64)


def relevant_group_counts_from_lists(
    scores: np.ndarray,
    rel_ptr: np.ndarray,
    rel_cols: np.ndarray,
    self_index: np.ndarray | None = None,
    buckets_per_value: int = BUCKETS_PER_VALUE,
) -> RelevantGroupCounts:
    """Tie-group counts with the parallel numba kernel, relevant items given as index lists.

    Args:
        scores: (B, N) float32 / float64 numpy array, higher = ranked first.
        rel_ptr: (B + 1,) int64, row i's relevant items are ``rel_cols[rel_ptr[i]:rel_ptr[i+1]]``.
        rel_cols: int64 column indices of the relevant items (the excluded item must not be
            among them).
        self_index: (B,) int64, a column to remove from each row entirely, -1 for none.
        buckets_per_value: lookup-table buckets per distinct relevant value; the counts do not
            depend on it (``0`` leaves a single bucket per row: a plain binary search).
    """
    if (
        isinstance(buckets_per_value, bool)
        or not isinstance(buckets_per_value, (int, np.integer))
        or buckets_per_value < 0
    ):
        raise ValueError(
            f"`buckets_per_value` must be a non-negative integer, got {buckets_per_value!r}."
        )
    scores = _as_kernel_scores(scores)
    n_rows = scores.shape[0]
    self_index = _self_index_or_none(self_index, n_rows)
    rel_ptr = np.ascontiguousarray(rel_ptr, dtype=np.int64)
    rel_cols = np.ascontiguousarray(rel_cols, dtype=np.int64)
    n_slots = int(rel_ptr[-1])
    greater = np.empty(n_slots, dtype=np.int64)
    size = np.empty(n_slots, dtype=np.int64)
    n_relevant = np.empty(n_slots, dtype=np.int64)
    n_groups = np.zeros(n_rows, dtype=np.int64)
    _group_counts_kernel(
        scores,
        rel_ptr,
        rel_cols,
        self_index,
        int(buckets_per_value),
        greater,
        size,
        n_relevant,
        n_groups,
    )
    greater, size, n_relevant = _compact(rel_ptr, n_groups, greater, size, n_relevant)
    return RelevantGroupCounts(n_groups, greater, size, n_relevant)


def relevant_group_counts_numba(
    scores: np.ndarray,
    relevant: np.ndarray,
    self_index: np.ndarray | None = None,
    buckets_per_value: int = BUCKETS_PER_VALUE,
) -> RelevantGroupCounts:
    """Tie-group counts of every row with the parallel numba kernel (CPU), from a mask.

    Args:
        scores: (B, N) float32 / float64 numpy array, higher = ranked first.
        relevant: (B, N) bool numpy array.
        self_index: (B,) int64, a column to remove from each row entirely (neither an item nor
            relevant), -1 for none. ``None`` removes nothing.
        buckets_per_value: as :func:`relevant_group_counts_from_lists`.
    """
    n_rows = scores.shape[0]
    self_index = _self_index_or_none(self_index, n_rows)
    relevant = np.asarray(relevant, dtype=np.bool_)
    rows_with_self = np.nonzero(self_index >= 0)[0]
    if rows_with_self.size and relevant[rows_with_self, self_index[rows_with_self]].any():
        relevant = relevant.copy()
        relevant[rows_with_self, self_index[rows_with_self]] = False
    rows, cols = np.nonzero(relevant)
    rel_ptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n_rows), out=rel_ptr[1:])
    return relevant_group_counts_from_lists(scores, rel_ptr, cols, self_index, buckets_per_value)


def relevant_group_counts_torch(
    scores: torch.Tensor, relevant: torch.Tensor, self_index: torch.Tensor | None = None
) -> RelevantGroupCounts:
    """Tie-group counts of every row with vectorised torch ops (any device).

    Args:
        scores: (B, N) floating tensor, higher = ranked first.
        relevant: (B, N) bool tensor on the same device.
        self_index: (B,) int64 tensor, a column to remove from each row, -1 for none.
    """
    n_rows, n_items = scores.shape
    device = scores.device
    relevant = relevant.to(torch.bool)
    if self_index is not None and bool((self_index >= 0).any()):
        # The excluded item goes to -inf (below every finite score, so it never shares a group with
        # a relevant item) and loses its relevance; it is then dropped from the counts below.
        rows = torch.nonzero(self_index >= 0).squeeze(1)
        cols = self_index[rows]
        scores = scores.clone()
        relevant = relevant.clone()
        scores[rows, cols] = float("-inf")
        relevant[rows, cols] = False
    sorted_scores, order = torch.sort(scores, dim=1, descending=True)
    rel_sorted = torch.gather(relevant, 1, order)
    pos = torch.arange(n_items, device=device).expand(n_rows, n_items)
    starts_group = torch.ones(n_rows, n_items, dtype=torch.bool, device=device)
    starts_group[:, 1:] = sorted_scores[:, 1:] != sorted_scores[:, :-1]
    ends_group = torch.ones_like(starts_group)
    ends_group[:, :-1] = starts_group[:, 1:]
    group_start = torch.cummax(torch.where(starts_group, pos, 0), dim=1).values
    group_end = torch.flip(
        torch.cummin(torch.flip(torch.where(ends_group, pos, n_items - 1), [1]), dim=1).values, [1]
    )
    rel_cum = torch.cumsum(rel_sorted, dim=1)  # relevant items at ranks <= t (inclusive)
    rel_before = rel_cum - rel_sorted.to(rel_cum.dtype)  # strictly before t
    rel_above_group = torch.gather(rel_before, 1, group_start)
    first_relevant_of_group = rel_sorted & (rel_before == rel_above_group)
    row, col = torch.nonzero(first_relevant_of_group, as_tuple=True)
    g_start = group_start[row, col]
    g_end = group_end[row, col]
    greater = g_start
    size = g_end - g_start + 1
    n_relevant = rel_cum[row, g_end] - rel_above_group[row, col]
    n_groups = torch.bincount(row, minlength=n_rows)
    return RelevantGroupCounts(
        n_groups.cpu().numpy().astype(np.int64),
        greater.cpu().numpy().astype(np.int64),
        size.cpu().numpy().astype(np.int64),
        n_relevant.cpu().numpy().astype(np.int64),
    )


@keeps_torch_threads
def relevant_group_counts(
    scores: torch.Tensor,
    relevant: torch.Tensor,
    self_index: torch.Tensor | None = None,
    backend: str = "auto",
) -> RelevantGroupCounts:
    """Dispatch to the numba kernel (CPU tensors) or the torch path (other devices / forced).

    Args:
        scores: (B, N) floating tensor; fp16 / bf16 on the CPU are widened to float32 (exact).
        relevant: (B, N) bool tensor.
        self_index: (B,) int64 tensor or None.
        backend: ``"auto"``, ``"numba"`` or ``"torch"``.
    """
    if backend not in ("auto", "numba", "torch"):
        raise ValueError(f"`backend` must be 'auto', 'numba' or 'torch', got {backend!r}.")
    use_numba = backend == "numba" or (backend == "auto" and scores.device.type == "cpu")
    if use_numba:
        s = scores.detach().cpu()
        if s.dtype not in (torch.float32, torch.float64):
            s = s.to(torch.float32)
        si = None if self_index is None else self_index.detach().cpu().numpy()
        return relevant_group_counts_numba(s.numpy(), relevant.detach().cpu().numpy(), si)
    return relevant_group_counts_torch(scores.detach(), relevant.detach(), self_index)
