"""Counting kernels behind the exact, tie-aware retrieval metrics.

Tie-aware average precision (McSherry & Najork 2008; He et al., "Hashing as Tie-Aware Learning to
Rank", CVPR 2018, Prop. 1 / Eq. 6 with the errata's per-position form) decomposes additively over
tie groups, and a tie group holding no relevant item contributes nothing. So for one query the
whole ranking is summarised, for every distinct score value ``v`` held by a relevant item, by three
counts: the number of items scoring strictly higher than ``v`` (``N_{d-1}`` in the paper), the
number scoring exactly ``v`` (``n_d``) and the relevant items among those (``n_d^+``). AP_T,
recall@k, precision@k, MAP@R, R-precision and the PR curve all follow from these counts in closed
form (see :mod:`rankwise.metrics.ranking`).

Two interchangeable producers of the counts live here:

* :func:`relevant_group_counts_numba` (CPU): per row, sort only the (few) relevant scores, then one
  pass over the row puts every item in its bucket by binary search among the distinct relevant
  values; rows with many relevant items are sorted instead (then no slower). Rows run in parallel.
* :func:`relevant_group_counts_torch` (CUDA, and fallback): a vectorised ``torch.sort`` of the
  whole score chunk followed by run-length bookkeeping with ``cummax`` / ``cummin``.

Both return the same integers in the same order (groups by decreasing score value), so every metric
derived from them is bit-identical between the two paths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

__all__ = [
    "RelevantGroupCounts",
    "relevant_group_counts",
    "relevant_group_counts_numba",
    "relevant_group_counts_torch",
    "relevant_group_counts_from_lists",
    "SORT_FRACTION",
]

# A row whose relevant items exceed this fraction of the row is sorted whole. The binary-search pass
# costs N log(m) (branchy compares) and the sort N log(N): measured on float32 rows of N = 60,000,
# bucketing is faster up to ~10 % relevant and breaks even near 30 %.
SORT_FRACTION = 0.25


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

    @property
    def n_rows(self) -> int:
        return int(self.n_groups.shape[0])

    def row_ids(self) -> np.ndarray:
        """(S,) int64, the query (row) index of every group entry."""
        return np.repeat(np.arange(self.n_rows, dtype=np.int64), self.n_groups)

    def offsets(self) -> np.ndarray:
        """(B + 1,) int64, start of each query's groups in the flat arrays."""
        out = np.zeros(self.n_rows + 1, dtype=np.int64)
        np.cumsum(self.n_groups, out=out[1:])
        return out


@njit(parallel=True, cache=True)
def _group_counts_kernel(scores, rel_ptr, rel_cols, self_index, sort_fraction,
                         greater, size, n_relevant, n_groups):  # pragma: no cover - numba
    n_rows, n_items = scores.shape
    for i in prange(n_rows):
        start = rel_ptr[i]
        n_rel = rel_ptr[i + 1] - start
        skip = self_index[i]
        if n_rel == 0:
            n_groups[i] = 0
            continue
        if n_rel > sort_fraction * n_items:
            # Many relevant items: sort the row (descending) and scan its runs of equal scores.
            is_relevant = np.zeros(n_items, dtype=np.bool_)
            for c in range(start, start + n_rel):
                is_relevant[rel_cols[c]] = True
            order = np.argsort(-scores[i])
            m = 0
            pos = 0  # rank among the non-excluded items
            t = 0
            while t < n_items:
                v = scores[i, order[t]]
                run_size = 0
                run_rel = 0
                u = t
                while u < n_items and scores[i, order[u]] == v:
                    j = order[u]
                    if j != skip:
                        run_size += 1
                        if is_relevant[j]:
                            run_rel += 1
                    u += 1
                if run_rel > 0:
                    greater[start + m] = pos
                    size[start + m] = run_size
                    n_relevant[start + m] = run_rel
                    m += 1
                pos += run_size
                t = u
            n_groups[i] = m
            continue
        # Few relevant items: sort their scores, then bucket every item by binary search.
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
        between = np.zeros(m, dtype=np.int64)  # items strictly between distinct[k-1] and [k]
        equal = np.zeros(m, dtype=np.int64)
        lowest = distinct[m - 1]
        for j in range(n_items):
            s = scores[i, j]
            if s < lowest:
                continue
            lo = 0
            hi = m
            while lo < hi:  # lo = number of distinct relevant values strictly above s
                mid = (lo + hi) >> 1
                if distinct[mid] > s:
                    lo = mid + 1
                else:
                    hi = mid
            if distinct[lo] == s:
                equal[lo] += 1
            else:
                between[lo] += 1
        if skip >= 0 and scores[i, skip] >= lowest:  # remove the excluded item again
            s = scores[i, skip]
            lo = 0
            hi = m
            while lo < hi:
                mid = (lo + hi) >> 1
                if distinct[mid] > s:
                    lo = mid + 1
                else:
                    hi = mid
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


def _compact(slot_offsets: np.ndarray, n_groups: np.ndarray, *arrays: np.ndarray):
    """Drop the unused slots (a row with duplicated relevant scores fills fewer than it owns)."""
    n_slots = np.diff(slot_offsets)
    if np.array_equal(n_slots, n_groups):
        return arrays
    row_of_slot = np.repeat(np.arange(n_groups.shape[0]), n_slots)
    rank_in_row = np.arange(slot_offsets[-1]) - slot_offsets[:-1][row_of_slot]
    keep = rank_in_row < n_groups[row_of_slot]
    return tuple(a[keep] for a in arrays)


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
    scores: np.ndarray, rel_ptr: np.ndarray, rel_cols: np.ndarray,
    self_index: np.ndarray | None = None, sort_fraction: float = SORT_FRACTION,
) -> RelevantGroupCounts:
    """Tie-group counts with the parallel numba kernel, relevant items given as index lists.

    Args:
        scores: (B, N) float32 / float64 numpy array, higher = ranked first.
        rel_ptr: (B + 1,) int64, row i's relevant items are ``rel_cols[rel_ptr[i]:rel_ptr[i+1]]``.
        rel_cols: int64 column indices of the relevant items (the excluded item must not be
            among them).
        self_index: (B,) int64, a column to remove from each row entirely, -1 for none.
        sort_fraction: rows with more than ``sort_fraction * N`` relevant items are sorted whole.
    """
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
    _group_counts_kernel(scores, rel_ptr, rel_cols, self_index, float(sort_fraction),
                         greater, size, n_relevant, n_groups)
    greater, size, n_relevant = _compact(rel_ptr, n_groups, greater, size, n_relevant)
    return RelevantGroupCounts(n_groups, greater, size, n_relevant)


def relevant_group_counts_numba(
    scores: np.ndarray, relevant: np.ndarray, self_index: np.ndarray | None = None,
    sort_fraction: float = SORT_FRACTION,
) -> RelevantGroupCounts:
    """Tie-group counts of every row with the parallel numba kernel (CPU), from a mask.

    Args:
        scores: (B, N) float32 / float64 numpy array, higher = ranked first.
        relevant: (B, N) bool numpy array.
        self_index: (B,) int64, a column to remove from each row entirely (neither an item nor
            relevant), -1 for none. ``None`` removes nothing.
        sort_fraction: rows with more than ``sort_fraction * N`` relevant items are sorted whole.
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
    return relevant_group_counts_from_lists(scores, rel_ptr, cols, self_index, sort_fraction)


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


def relevant_group_counts(
    scores: torch.Tensor, relevant: torch.Tensor, self_index: torch.Tensor | None = None,
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
