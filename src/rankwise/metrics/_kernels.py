"""Counting kernels behind the exact, tie-aware retrieval metrics.

Tie-aware average precision (McSherry & Najork 2008; He et al., "Hashing as Tie-Aware Learning to
Rank", CVPR 2018, Prop. 1 / Eq. 6 in the per-position form of docs/errata.md) decomposes additively
over tie groups, and a group without a relevant item contributes nothing. So one query's ranking is
summarised, for every distinct score value ``v`` held by a relevant item, by three counts: the items
scoring strictly higher (``N_{d-1}``), exactly ``v`` (``n_d``), and the relevant ones among those
(``n_d^+``). Every metric follows from them in closed form (:mod:`rankwise.metrics.ranking`).

:func:`relevant_group_counts_numba` (CPU, a bucket table per row, O(N + R log R)) and
:func:`relevant_group_counts_torch` (any device, one sort per chunk) return the same integers in
the same order (groups by decreasing value), so every metric is bit-identical between them;
:func:`relevant_group_counts_from_lists` also takes an approximate block with an error bound and
returns the counts of the exact keys (docs/metrics.md, "How the counts are computed").
"""

from __future__ import annotations

from collections.abc import Callable
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
    "relevant_lists_from_mask",
    "tie_group_bounds",
    "harmonic_table_kernel",
    "BUCKETS_PER_VALUE",
]

# Buckets of the lookup table per distinct relevant value: most then hold at most one value, so an
# item costs one table read (4 and 8 measured 3-4x faster than one bucket, a plain binary search).
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
def _two_sum(a, b):  # pragma: no cover - numba
    """``a + b`` rounded and its exact rounding error (Knuth's TwoSum)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@njit(cache=True, inline="always")
def _split(a):  # pragma: no cover - numba
    """Dekker's split of a float64 into two halves of at most 26 significant bits."""
    c = 134217729.0 * a  # 2^27 + 1
    hi = c - (c - a)
    return hi, a - hi


@njit(cache=True)
def harmonic_table_kernel(n):  # pragma: no cover - numba
    """(n + 1, 2) float64: ``H(t) = sum_{i <= t} 1/i`` as the unevaluated sum ``[t, 0] + [t, 1]``.

    Double-double accumulation (TwoSum; ``1/i`` itself as a double-double through Dekker's exact
    product, no fused multiply-add): each entry carries about 100 correct bits, so
    ``(H[b, 0] - H[a, 0]) + (H[b, 1] - H[a, 1])`` is ``H(b) - H(a)`` to a few float64 ulps of the
    result however close ``a`` and ``b`` are. The loop is sequential, so a longer table starts
    with the same bits as a shorter one.
    """
    out = np.zeros((n + 1, 2))
    hi = 0.0
    lo = 0.0
    for t in range(1, n + 1):
        x = np.float64(t)
        r = 1.0 / x
        # 1 - r x exactly (r x = p + e), then the correction of r
        p = r * x
        rh, rl = _split(r)
        xh, xl = _split(x)
        e = ((rh * xh - p) + rh * xl + rl * xh) + rl * xl
        r_lo = ((1.0 - p) - e) / x
        s, err = _two_sum(hi, r)
        err = err + (lo + r_lo)
        hi = s + err
        lo = err - (hi - s)
        out[t, 0] = hi
        out[t, 1] = lo
    return out


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


@njit(cache=True)
def _distinct_descending(vals):  # pragma: no cover - numba
    """Distinct values of the ascending ``vals``, decreasing, with their multiplicities."""
    n = vals.shape[0]
    distinct = np.empty(n, dtype=vals.dtype)
    count = np.zeros(n, dtype=np.int64)
    m = 0
    for t in range(n - 1, -1, -1):
        v = vals[t]
        if m > 0 and distinct[m - 1] == v:
            count[m - 1] += 1
        else:
            distinct[m] = v
            count[m] = 1
            m += 1
    return distinct, count, m


@njit(cache=True)
def _bucket_table(values, m, buckets_per_value):  # pragma: no cover - numba
    """Bucket table over the decreasing ``values[:m]`` (duplicates allowed).

    Bucket b holds ``values[first[b]:first[b + 1]]``. A score in bucket b lies below every value of
    the earlier buckets and above those of the later ones (monotone bucketing), so only its own
    bucket's few values need a search.
    """
    top = np.float64(values[0])
    n_buckets = max(1, min(buckets_per_value * m, _MAX_BUCKETS))
    value_span = top - np.float64(values[m - 1])
    scale = n_buckets / value_span if value_span > 0.0 else 0.0
    if not scale < np.inf:  # a span of subnormals: one bucket, a plain binary search
        scale = 0.0
    last_bucket = np.float64(n_buckets - 1)
    first = np.zeros(n_buckets + 1, dtype=np.int64)
    for k in range(m):
        first[_bucket_of(np.float64(values[k]), top, scale, last_bucket) + 1] += 1
    for b in range(n_buckets):
        first[b + 1] += first[b]
    return first, top, scale, last_bucket


@njit(cache=True, inline="always")
def _n_above(values, first, top, scale, last_bucket, s):  # pragma: no cover - numba
    """Number of the decreasing ``values`` strictly greater than ``s`` (through the table)."""
    b = _bucket_of(np.float64(s), top, scale, last_bucket)
    return _n_strictly_above(values, s, first[b], first[b + 1])


@njit(cache=True)
def _write_groups(
    start, m, between, equal, rel_count, greater, size, n_relevant
):  # pragma: no cover - numba
    """Counts of the m groups of one row from items strictly between / equal to each value."""
    above = 0
    for k in range(m):
        above += between[k]
        greater[start + k] = above
        size[start + k] = equal[k]
        n_relevant[start + k] = rel_count[k]
        above += equal[k]


@njit(parallel=True, cache=True)
def _group_counts_kernel(
    scores, rel_ptr, rel_cols, self_index, buckets_per_value, greater, size, n_relevant, n_groups
):  # pragma: no cover - numba
    n_rows, n_items = scores.shape
    for i in prange(n_rows):
        start = rel_ptr[i]
        n_rel = rel_ptr[i + 1] - start
        skip = self_index[i]
        n_groups[i] = 0
        if n_rel == 0:
            continue
        # The distinct relevant values, decreasing, and how many relevant items hold each.
        vals = np.empty(n_rel, dtype=scores.dtype)
        for c in range(n_rel):
            vals[c] = scores[i, rel_cols[start + c]]
        vals.sort()
        distinct, rel_count, m = _distinct_descending(vals)
        lowest = distinct[m - 1]
        first, top, scale, last_bucket = _bucket_table(distinct, m, buckets_per_value)
        between = np.zeros(m, dtype=np.int64)  # items strictly between distinct[k-1] and [k]
        equal = np.zeros(m, dtype=np.int64)
        for j in range(n_items):
            s = scores[i, j]
            if s < lowest:
                continue
            lo = _n_above(distinct, first, top, scale, last_bucket, s)
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
        _write_groups(start, m, between, equal, rel_count, greater, size, n_relevant)
        n_groups[i] = m


# counts of the exact keys from an approximate block (see rankwise.metrics._scores)
#
# Phase A (_approx_pass_kernel): per row, the relevant items sorted by approximate value; runs of
# them closer than 2 * bound (their order or ties are uncertain); every other item either lies more
# than 2 * bound away from every relevant value -- then the number p of relevant items above it is
# certain and it is tallied in gap[p] -- or it is "ambiguous": listed with the window [a, b) of
# relevant positions it is close to. Phase B (the caller): exact keys of the ambiguous items and of
# the relevant items that need one (in a run, or in an ambiguous item's window). Phase C
# (_verified_groups_kernel): runs re-sorted by exact key, groups of equal keys, ambiguous items
# placed by exact comparison, certain items by their gap: the counts of the exact keys.


@njit(cache=True)
def _sorted_relevant(scores, i, rel_cols, start, n_rel, order):  # pragma: no cover - numba
    """Approximate values of row i's relevant items, decreasing; their columns go to ``order``."""
    vals = np.empty(n_rel)
    for c in range(n_rel):
        vals[c] = np.float64(scores[i, rel_cols[start + c]])
    idx = np.argsort(vals)
    sv = np.empty(n_rel)
    for t in range(n_rel):
        sv[t] = vals[idx[n_rel - 1 - t]]
        order[start + t] = rel_cols[start + idx[n_rel - 1 - t]]
    return sv


@njit(cache=True)
def _mark_runs(sv, two_e, start, run_start, need):  # pragma: no cover - numba
    """Runs of relevant positions whose neighbours are within 2 * bound: all need exact keys."""
    for t in range(sv.shape[0]):
        run_start[start + t] = t == 0 or sv[t - 1] - sv[t] > two_e
        need[start + t] = False
    for t in range(1, sv.shape[0]):
        if not run_start[start + t]:
            need[start + t - 1] = True
            need[start + t] = True


@njit(cache=True)
def _scan_row(
    scores, i, sv, table, two_e, rel_cols, start, skip, need, gap, gap_base, slots, amb
):  # pragma: no cover - numba
    """Tally the certain items of row i in ``gap``; list the ambiguous ones; return their count."""
    first, top, scale, last_bucket = table
    amb_col, amb_lo, amb_hi = amb
    n_rel = sv.shape[0]
    low_cut = sv[n_rel - 1] - two_e
    # the cut in the scores' own dtype, rounded down: a cheaper first test that is still certain
    cut = np.empty(1, dtype=scores.dtype)
    cut[0] = low_cut
    if np.float64(cut[0]) > low_cut:
        cut[0] = np.nextafter(cut[0], -np.inf)
    native_cut = cut[0]
    next_rel = start  # relevant columns are increasing: skip them with a moving pointer
    slot_lo, slot_hi = slots
    n_amb = 0
    for j in range(scores.shape[1]):
        if scores[i, j] < native_cut:  # below every relevant value, certainly (never relevant)
            continue
        s = np.float64(scores[i, j])
        if s < low_cut:
            continue
        if next_rel < start + n_rel and rel_cols[next_rel] == j:
            next_rel += 1
            continue
        if j == skip:
            continue
        a = _n_above(sv, first, top, scale, last_bucket, s + two_e)
        if a < n_rel and sv[a] >= s - two_e:
            b = a + 1
            while b < n_rel and sv[b] >= s - two_e:
                b += 1
            for t in range(a, b):
                need[start + t] = True
            if slot_lo + n_amb < slot_hi:
                amb_col[slot_lo + n_amb] = j
                amb_lo[slot_lo + n_amb] = a
                amb_hi[slot_lo + n_amb] = b
            n_amb += 1
        else:
            gap[gap_base + a] += 1
    return n_amb


@njit(parallel=True, cache=True)
def _approx_pass_kernel(
    scores,
    bound,
    rel_ptr,
    rel_cols,
    self_index,
    buckets_per_value,
    order,
    run_start,
    need,
    gap,
    amb_count,
    amb_ptr,
    amb_col,
    amb_lo,
    amb_hi,
):  # pragma: no cover - numba
    for i in prange(scores.shape[0]):
        start = rel_ptr[i]
        n_rel = rel_ptr[i + 1] - start
        amb_count[i] = 0
        for t in range(n_rel + 1):
            gap[start + i + t] = 0
        if n_rel == 0:
            continue
        two_e = 2.0 * bound[i]
        sv = _sorted_relevant(scores, i, rel_cols, start, n_rel, order)
        _mark_runs(sv, two_e, start, run_start, need)
        table = _bucket_table(sv, n_rel, buckets_per_value)
        amb_count[i] = _scan_row(
            scores,
            i,
            sv,
            table,
            two_e,
            rel_cols,
            start,
            self_index[i],
            need,
            gap,
            start + i,
            (amb_ptr[i], amb_ptr[i + 1]),
            (amb_col, amb_lo, amb_hi),
        )


@njit(cache=True)
def _sort_runs_descending(ex, run_start, start):  # pragma: no cover - numba
    """Sort every run of ``ex`` (exact keys of a row's relevant positions) in decreasing order."""
    n = ex.shape[0]
    r = 0
    while r < n:
        e = r + 1
        while e < n and not run_start[start + e]:
            e += 1
        if e - r > 1:
            part = np.sort(ex[r:e])
            for t in range(e - r):
                ex[r + t] = part[e - r - 1 - t]
        r = e


@njit(parallel=True, cache=True)
def _verified_groups_kernel(
    rel_ptr,
    run_start,
    rel_keys,
    gap,
    amb_ptr,
    amb_lo,
    amb_hi,
    amb_count,
    amb_key,
    greater,
    size,
    n_relevant,
    n_groups,
):  # pragma: no cover - numba
    for i in prange(rel_ptr.shape[0] - 1):
        start = rel_ptr[i]
        n_rel = rel_ptr[i + 1] - start
        n_groups[i] = 0
        if n_rel == 0:
            continue
        ex = rel_keys[start : start + n_rel].copy()
        _sort_runs_descending(ex, run_start, start)
        # a new group at every run start and at every change of exact key inside a run
        group_of = np.empty(n_rel, dtype=np.int64)
        m = 0
        for t in range(n_rel):
            if t == 0 or run_start[start + t] or ex[t] != ex[t - 1]:
                m += 1
            group_of[t] = m - 1
        between = np.zeros(m, dtype=np.int64)
        equal = np.zeros(m, dtype=np.int64)
        rel_count = np.zeros(m, dtype=np.int64)
        for t in range(n_rel):
            equal[group_of[t]] += 1
            rel_count[group_of[t]] += 1
            between[group_of[t]] += gap[start + i + t]  # certain items just above position t
        for slot in range(amb_ptr[i], amb_ptr[i] + amb_count[i]):
            x = amb_key[slot]
            c = amb_lo[slot]
            while c < amb_hi[slot] and ex[c] > x:
                c += 1
            if c < amb_hi[slot] and ex[c] == x:
                equal[group_of[c]] += 1
            elif c < n_rel:
                between[group_of[c]] += 1
        _write_groups(start, m, between, equal, rel_count, greater, size, n_relevant)
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
    *,
    bound: np.ndarray | None = None,
    exact_keys: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
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
        bound: None when ``scores`` are the exact scores. Otherwise (B,) float64: ``scores``
            approximate exact keys, ``|scores[i, j] - phi_i(key_ij)| <= bound[i]`` for a strictly
            increasing ``phi_i``, and the counts returned are those of the exact keys.
        exact_keys: with ``bound``: ``exact_keys(rows, cols)`` returns the float64 exact keys of
            the pairs (row ``rows[m]`` of this block, column ``cols[m]``); it is asked only for the
            pairs whose order or ties the approximation leaves open.

    Returns:
        The counts, groups ordered by decreasing (exact) score within each row.
    """
    if (
        isinstance(buckets_per_value, bool)
        or not isinstance(buckets_per_value, (int, np.integer))
        or buckets_per_value < 0
    ):
        raise ValueError(
            f"`buckets_per_value` must be a non-negative integer, got {buckets_per_value!r}."
        )
    scores = np.ascontiguousarray(scores)
    if scores.dtype not in (np.float32, np.float64):
        scores = scores.astype(np.float32)
    n_rows = scores.shape[0]
    self_index = _self_index_or_none(self_index, n_rows)
    rel_ptr = np.ascontiguousarray(rel_ptr, dtype=np.int64)
    rel_cols = np.ascontiguousarray(rel_cols, dtype=np.int64)
    if bound is not None:
        if exact_keys is None:
            raise ValueError("`exact_keys` is required with `bound` (approximate scores).")
        return _verified_counts(
            scores, rel_ptr, rel_cols, self_index, bound, exact_keys, int(buckets_per_value)
        )
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


def _increasing_within_rows(rel_ptr: np.ndarray, rel_cols: np.ndarray) -> np.ndarray:
    """``rel_cols`` sorted increasingly inside every row (the verified scan skips them in order)."""
    sizes = np.diff(rel_ptr)
    rows = np.repeat(np.arange(sizes.shape[0], dtype=np.int64), sizes)
    increasing = np.diff(rel_cols) > 0
    row_change = rows[1:] != rows[:-1]
    if bool((increasing | row_change).all()):
        return rel_cols
    return np.ascontiguousarray(rel_cols[np.lexsort((rel_cols, rows))])


def _verified_counts(
    scores: np.ndarray,
    rel_ptr: np.ndarray,
    rel_cols: np.ndarray,
    self_index: np.ndarray,
    bound: np.ndarray,
    exact_keys: Callable[[np.ndarray, np.ndarray], np.ndarray],
    buckets_per_value: int,
) -> RelevantGroupCounts:
    """Counts of the exact keys from approximate scores (phases A-C, see the kernels above)."""
    n_rows = scores.shape[0]
    n_slots = int(rel_ptr[-1])
    sizes = np.diff(rel_ptr)
    rel_cols = _increasing_within_rows(rel_ptr, rel_cols)
    bound = np.ascontiguousarray(bound, dtype=np.float64)
    order = np.empty(n_slots, dtype=np.int64)
    run_start = np.empty(n_slots, dtype=np.bool_)
    need = np.zeros(n_slots, dtype=np.bool_)
    gap = np.zeros(n_slots + n_rows, dtype=np.int64)
    amb_count = np.zeros(n_rows, dtype=np.int64)
    capacity = 4 * sizes + 64  # ambiguous items listed per row; rows with more are scanned again
    while True:
        amb_ptr = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(capacity, out=amb_ptr[1:])
        amb = tuple(np.empty(int(amb_ptr[-1]), dtype=np.int64) for _ in range(3))
        _approx_pass_kernel(
            scores,
            bound,
            rel_ptr,
            rel_cols,
            self_index,
            buckets_per_value,
            order,
            run_start,
            need,
            gap,
            amb_count,
            amb_ptr,
            *amb,
        )
        if bool((amb_count <= capacity).all()):
            break
        capacity = np.maximum(capacity, amb_count)
    # phase B: exact keys of the ambiguous items and of the relevant items that need one
    amb_rows = np.repeat(np.arange(n_rows, dtype=np.int64), amb_count)
    first_of_row = np.cumsum(amb_count) - amb_count
    slots = amb_ptr[amb_rows] + np.arange(amb_rows.shape[0]) - first_of_row[amb_rows]
    rel_rows = np.repeat(np.arange(n_rows, dtype=np.int64), sizes)[need]
    keys = np.asarray(
        exact_keys(
            np.concatenate([amb_rows, rel_rows]), np.concatenate([amb[0][slots], order[need]])
        ),
        dtype=np.float64,
    )
    amb_key = np.empty(int(amb_ptr[-1]), dtype=np.float64)
    amb_key[slots] = keys[: slots.shape[0]]
    rel_keys = np.full(n_slots, np.nan)
    rel_keys[need] = keys[slots.shape[0] :]
    # phase C
    greater = np.empty(n_slots, dtype=np.int64)
    size = np.empty(n_slots, dtype=np.int64)
    n_relevant = np.empty(n_slots, dtype=np.int64)
    n_groups = np.zeros(n_rows, dtype=np.int64)
    _verified_groups_kernel(
        rel_ptr,
        run_start,
        rel_keys,
        gap,
        amb_ptr,
        amb[1],
        amb[2],
        amb_count,
        amb_key,
        greater,
        size,
        n_relevant,
        n_groups,
    )
    greater, size, n_relevant = _compact(rel_ptr, n_groups, greater, size, n_relevant)
    return RelevantGroupCounts(n_groups, greater, size, n_relevant)


def relevant_lists_from_mask(
    relevant: np.ndarray, self_index: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Relevant-item lists (increasing columns) of a (B, N) bool mask, excluded columns removed.

    Args:
        relevant: (B, N) bool numpy array.
        self_index: (B,) int64 column to leave out of each row's list, -1 for none.

    Returns:
        ``(rel_ptr, rel_cols)`` as taken by :func:`relevant_group_counts_from_lists`.
    """
    n_rows = relevant.shape[0]
    self_index = _self_index_or_none(self_index, n_rows)
    relevant = np.asarray(relevant, dtype=np.bool_)
    rows_with_self = np.nonzero(self_index >= 0)[0]
    if rows_with_self.size and relevant[rows_with_self, self_index[rows_with_self]].any():
        relevant = relevant.copy()
        relevant[rows_with_self, self_index[rows_with_self]] = False
    rows, cols = np.nonzero(relevant)
    rel_ptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n_rows), out=rel_ptr[1:])
    return rel_ptr, cols.astype(np.int64)


def relevant_group_counts_numba(
    scores: np.ndarray,
    relevant: np.ndarray,
    self_index: np.ndarray | None = None,
    buckets_per_value: int = BUCKETS_PER_VALUE,
) -> RelevantGroupCounts:
    """Tie-group counts of every row with the parallel numba kernel (CPU), from a mask.

    Args: as :func:`relevant_group_counts_from_lists`, the relevant items given as a (B, N) bool
    numpy array ``relevant``.
    """
    rel_ptr, cols = relevant_lists_from_mask(relevant, self_index)
    return relevant_group_counts_from_lists(scores, rel_ptr, cols, self_index, buckets_per_value)


def tie_group_bounds(sorted_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, N) first and last position of the tie group of every entry of row-sorted scores."""
    n_rows, n_items = sorted_scores.shape
    device = sorted_scores.device
    pos = torch.arange(n_items, device=device).expand(n_rows, n_items)
    starts = torch.ones(n_rows, n_items, dtype=torch.bool, device=device)
    starts[:, 1:] = sorted_scores[:, 1:] != sorted_scores[:, :-1]
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    first = torch.cummax(torch.where(starts, pos, 0), dim=1).values
    last = torch.flip(
        torch.cummin(torch.flip(torch.where(ends, pos, n_items - 1), [1]), dim=1).values, [1]
    )
    return first, last


def relevant_group_counts_torch(
    scores: torch.Tensor, relevant: torch.Tensor, self_index: torch.Tensor | None = None
) -> RelevantGroupCounts:
    """Tie-group counts of every row with vectorised torch ops (any device).

    Args: as :func:`relevant_group_counts_numba`, as tensors on one device.
    """
    n_rows = scores.shape[0]
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
    group_start, group_end = tie_group_bounds(sorted_scores)
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

    Args: as :func:`relevant_group_counts_torch` (fp16 / bf16 scores on the CPU are widened to
    float32, exactly), and ``backend``: ``"auto"``, ``"numba"`` or ``"torch"``.
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
