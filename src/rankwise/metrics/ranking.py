"""Exact tie-aware average precision and NDCG of ranked lists, and the closed forms behind them.

Implements AP_T and DCG_T of He, Cakir, Bargal & Sclaroff, "Hashing as Tie-Aware Learning to Rank"
(CVPR 2018), Prop. 1 (Eq. 6, 7) and App. A (Eq. 18, 19), which follow McSherry & Najork (ECIR 2008):
the expected value of the metric over every ordering of tied items. With tie groups d of size n_d
holding n_d^+ relevant items, N_{d-1} items and N^+_{d-1} relevant items strictly above, and N^+
relevant items in all, the per-group term of AP_T is (docs/errata.md, Eq. 6 corrected)

    AP_T(d) = n_d^+ / (n_d N^+) * sum_{t=N_{d-1}+1}^{N_d} [N^+_{d-1} + 1 + (t - N_{d-1} - 1) b] / t,
    b = (n_d^+ - 1) / (n_d - 1)  (0 when n_d = 1),

whose inner sum is (a - b (N_{d-1} + 1)) (H(N_d) - H(N_{d-1})) + b n_d with a = N^+_{d-1} + 1 and H
the harmonic numbers. Truncated at t <= R it is the tie-aware MAP@R of Musgrave, Belongie & Lim
(ECCV 2020); precision@k and R-precision are hypergeometric expectations. DCG_T uses
G(a) = 2^a - 1, D(t) = 1 / log2(t + 1) and the mean discount over each tie (docs/metrics.md,
"Exact definitions").

The retrieval report's NDCG@k and MRR (binary relevance) come from the same groups. With
C(t) = sum_{s<=t} D(s): each position g+1..g+n of a tie group holds a relevant item with
probability r/n under a random order of the tie (g = N_{d-1}, n = n_d, r = n_d^+), so by linearity

    E[DCG@k] = sum_d (r/n) (C(min(g + n, k)) - C(min(g, k))),    NDCG@k = E[DCG@k] / C(min(R, k)):

a group straddling position k contributes the expected discounted gain of the positions it
occupies that are <= k, times the share of relevant items in it (the ideal DCG does not depend on
the ties, so this ratio is the expected NDCG). The first relevant item lies in the best relevant
group, at g + J, J the place of the first of its r relevant items among its n in a random order:
P(J = j) = C(n - j, r - 1) / C(n, r) (the other r - 1 take r - 1 of the n - j places after j), so

    E[1 / rank] = sum_{j=1}^{n-r+1} C(n - j, r - 1) / C(n, r) / (g + j),

summed from P(J = 1) = r/n by P(J = j+1) = P(J = j) (n - r - j + 1) / (n - j) in double-double
(positive terms, no cancellation); for g = 0 it is r / (n - r + 1) (H(n) - H(r - 1)).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from numba import njit, prange

from .._validation import as_tensor, check_finite
from ._kernels import (
    RelevantGroupCounts,
    harmonic_table_kernel,
    relevant_group_counts,
    tie_group_bounds,
)

__all__ = [
    "TIES",
    "average_precision",
    "ndcg",
    "batched_average_precision",
    "batched_ndcg",
    "check_ties",
    "harmonic_difference",
    "harmonic_table",
    "harmonic_table_tensor",
    "group_terms",
    "metrics_from_sums",
    "precision_weighted_sum",
    "expected_relevant_in_top",
    "hit_probability_at",
    "average_precision_from_counts",
    "query_metrics_from_counts",
    "discount_table",
    "discount_table_tensor",
    "rank_table_tensor",
    "reciprocal_rank",
    "rank_metrics_from_sums",
]

TIES = ("expected", "optimistic", "pessimistic")


def check_ties(ties: str) -> str:
    """``ties`` if it is one of :data:`TIES`, else a ValueError naming the argument."""
    if ties not in TIES:
        raise ValueError(f"`ties` must be one of {TIES}, got {ties!r}.")
    return ties


# -- harmonic numbers ------------------------------------------------------------------------------

# The harmonic table built so far (double-double, rankwise.metrics._kernels.harmonic_table_kernel),
# and the same memory as a tensor: every call reads a prefix, so it is built once per process for
# the longest list seen.
_HARMONIC = np.zeros((1, 2))
_HARMONIC_TENSOR = torch.from_numpy(_HARMONIC)
# a position cut-off past every list: clamped to the end of each group
NO_CUTOFF = 2**62


def _grow_harmonic(n: int) -> None:
    global _HARMONIC, _HARMONIC_TENSOR
    if _HARMONIC.shape[0] <= n:
        _HARMONIC = harmonic_table_kernel(max(n, 2 * _HARMONIC.shape[0]))
        _HARMONIC_TENSOR = torch.from_numpy(_HARMONIC)


def harmonic_table(n: int) -> np.ndarray:
    """(n + 1, 2) read-only float64 table of ``H(0), ..., H(n)`` as double-doubles ``[hi, lo]``.

    ``H(b) - H(a)`` is ``(T[b, 0] - T[a, 0]) + (T[b, 1] - T[a, 1])`` (:func:`harmonic_difference`),
    within a few ulps of the exact value for any ``0 <= a <= b <= n``, with only subtractions and
    an addition: every device and numpy compute it to the same bits.
    """
    _grow_harmonic(n)
    view = _HARMONIC[: n + 1]
    view.flags.writeable = False
    return view


def harmonic_table_tensor(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`harmonic_table` as a float64 tensor on ``device`` (a shared CPU view when CPU)."""
    _grow_harmonic(n)
    table = _HARMONIC_TENSOR[: n + 1]
    return table if device is None else table.to(device)


def harmonic_difference(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """H(hi) - H(lo) = sum_{t=lo+1}^{hi} 1/t elementwise, for int arrays with 0 <= lo <= hi."""
    lo, hi = np.broadcast_arrays(np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64))
    if lo.size == 0:
        return np.zeros(lo.shape, dtype=np.float64)
    if bool((lo < 0).any()) or bool((hi < lo).any()):
        raise ValueError("`harmonic_difference` needs 0 <= lo <= hi elementwise.")
    table = harmonic_table(int(hi.max()))
    return (table[hi, 0] - table[lo, 0]) + (table[hi, 1] - table[lo, 1])


def table_difference(table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """:func:`harmonic_difference` on tensors: ``H(hi[c]) - H(lo)`` for each leading index ``c``.

    Args:
        table: (M, 2) float64 :func:`harmonic_table` on the tensors' device.
        lo: (*S) integer-valued (any dtype).
        hi: (C, *S) integer-valued, ``lo <= hi[c] < M``.

    Returns:
        (C, *S) float64, in the operations of :func:`harmonic_difference` (so the same bits).
    """
    rows = table[torch.cat([hi, lo.expand_as(hi[:1])]).long()]
    diff = rows[:-1] - rows[-1:]
    return diff[..., 0] + diff[..., 1]


# -- the closed forms of every metric, per tie group -----------------------------------------------


def _table_rows(table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """(C, *S, columns) ``table[hi[c]] - table[lo]``: one read of the table for every row of ``hi``.

    With the harmonic and discount tables side by side (4 columns), one lookup serves both: the
    differences are those of :func:`table_difference`, column by column (the same bits).
    """
    rows = table[torch.cat([hi, lo.expand_as(hi[:1])]).long()]
    return rows[:-1] - rows[-1:]


def group_terms(
    g: torch.Tensor,
    n: torch.Tensor,
    r: torch.Tensor,
    a: torch.Tensor,
    cut: torch.Tensor,
    ties: str,
    table: torch.Tensor,
    n_pw: int = 2,
    gn: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per tie group: expected precision-weighted sums and relevant counts up to cut-offs.

    The one implementation of the closed forms (He et al. 2018, Prop. 1 with docs/errata.md; the
    hypergeometric expectations of MAP@R, R-precision and P@k), shared by every backend so that
    they agree to the last bit. Elementwise torch operations (``+ - * /``, clamps, table reads),
    all correctly rounded, so the values do not depend on the device, the layout or the chunk.

    Args:
        g: (*S) float64 items strictly above the group (``N_{d-1}``), integer-valued.
        n: (*S) float64 items tied in the group (``n_d``); empty slots: 1.
        r: (*S) float64 relevant items in the group (``n_d^+``); empty slots: 0 (term 0).
        a: float64 broadcastable to S: relevant items strictly above the group, plus one.
        cut: (C, ...) float64 broadcastable to (C, *S), C >= 2: position cut-offs; ``cut[0]`` at
            least ``g + n`` (no cut-off: AP), ``cut[1]`` the query's R (MAP@R, R-precision), then
            the P@k cut-offs ``min(k, list length)``.
        ties: ``"expected"``, ``"optimistic"`` or ``"pessimistic"``.
        table: (M, 2) float64 :func:`harmonic_table` on the device, covering every position; or
            (M, 4): :func:`discount_table` of the same positions in columns 2-3
            (:func:`rank_table_tensor`), and then also the expected DCG terms of binary
            relevance at the cut-offs ``cut[2:]`` (one table read serves both).
        n_pw: number of leading cut-offs that need the precision-weighted sum, 1 <= n_pw <= C.
        gn: ``g + n`` when the caller has it (the same bits; one operation less), or None.

    Returns:
        (n_pw + C - 1, *S) float64. Rows ``:n_pw``: ``E[sum over the group's positions
        t <= cut of rel(t) precision(t)]`` (summed over a query's groups and divided by R: AP_T,
        MAP@R, AP@k); then ``E[# relevant items of the group at positions <= cut]`` for
        ``cut[1:]`` (R-precision times R, P@k times k); with the discount table, then
        ``E[sum of D(t) over the group's relevant items at positions t <= cut]`` for
        ``cut[2:]`` (summed per query: E[DCG@k] of binary relevance).
    """
    shape = _broadcast_shape(g.shape, n.shape, r.shape)
    dcg = table.shape[1] == 4
    n_dcg = cut.shape[0] - 2 if dcg else 0
    out = torch.empty(
        (n_pw + cut.shape[0] - 1 + n_dcg, *shape), dtype=torch.float64, device=g.device
    )
    n_er = n_pw + cut.shape[0] - 1
    if ties == "expected":
        if gn is None:
            gn = g + n
        up = torch.clamp(cut, min=g, max=gn)
        # expected positions of the group within the cut-off, times n / n: written where the
        # counts go (rows n_pw..), cnt[0] parked in the last precision-weighted row until the
        # sum below overwrites it (it is read into beta * cnt first)
        cnt = torch.sub(up, g, out=out[n_pw - 1 : n_er])
        diff = _table_rows(table, g, up if dcg else up[:n_pw])
        hd = diff[:n_pw, ..., 0] + diff[:n_pw, ..., 1]
        # b = (n^+ - 1) / (n - 1), 0 for a group of one (then n^+ = 1, and the formula gives 0)
        beta = (r - 1) / (n - 1).clamp_min(1)
        torch.add((a - beta * (g + 1)) * hd, beta * cnt[:n_pw], out=out[:n_pw])
        if dcg:  # the positions g+1 .. up within the cut, each relevant w.p. r/n
            torch.add(diff[2:, ..., 2], diff[2:, ..., 3], out=out[n_er:])
        return out.mul_(r / n)  # every row times r / n (x * y is y * x, bit for bit)
    # optimistic: relevant items at positions g+1 .. g+r; pessimistic: g+n-r+1 .. g+n;
    # sum_i (p + i) / (base + i) = c + (p - base) (H(base + c) - H(base))
    base = g if ties == "optimistic" else g + n - r
    c = torch.clamp(cut - base, min=torch.zeros((), dtype=base.dtype, device=base.device), max=r)
    diff = _table_rows(table, base, base + (c if dcg else c[:n_pw]))
    hd = diff[:n_pw, ..., 0] + diff[:n_pw, ..., 1]
    torch.add(c[:n_pw], (a - 1 - base) * hd, out=out[:n_pw])
    out[n_pw:n_er] = c[1:]
    if dcg:  # the relevant items at base+1 .. base+c within the cut
        torch.add(diff[2:, ..., 2], diff[2:, ..., 3], out=out[n_er:])
    return out


def rank_table_tensor(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(n + 1, 4) float64: :func:`harmonic_table` and :func:`discount_table` side by side.

    The ``table`` of :func:`group_terms` that gives the DCG rows too.

    Example:
        >>> from rankwise.metrics.ranking import rank_table_tensor
        >>> rank_table_tensor(2).shape
        torch.Size([3, 4])
    """
    table = torch.cat([harmonic_table_tensor(n), discount_table_tensor(n)], 1)
    return table if device is None else table.to(device)


def _broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The broadcast of tensor shapes (numpy's rules), in plain Python.

    ``torch.broadcast_shapes`` imports ``torch.fx.experimental.symbolic_shapes`` and sympy on its
    first call (0.5 s of every fresh process's first evaluation).
    """
    out: list[int] = []
    for dims in itertools.zip_longest(*(reversed(s) for s in shapes), fillvalue=1):
        sizes = {d for d in dims if d != 1}
        if len(sizes) > 1:
            raise ValueError(f"shapes {shapes} cannot be broadcast together")
        out.append(sizes.pop() if sizes else 1)
    return tuple(reversed(out))


def _counts_terms(
    counts: RelevantGroupCounts,
    ties: str,
    cuts: list[np.ndarray],
    n_pw: int,
    above: np.ndarray | None = None,
    dcg: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`group_terms` of a chunk's counts (CPU tensors), cut-offs given per group entry.

    ``dcg``: the DCG rows too (at ``cuts[2:]``, after the relevant counts).
    """
    last = int((counts.greater + counts.size).max()) if counts.size.size else 0
    table = rank_table_tensor(max(last, 1)) if dcg else harmonic_table_tensor(max(last, 1))
    if above is None:
        above = relevant_above(counts)
    terms = group_terms(
        torch.from_numpy(counts.greater.astype(np.float64)),
        torch.from_numpy(counts.size.astype(np.float64)),
        torch.from_numpy(counts.relevant.astype(np.float64)),
        torch.from_numpy(np.asarray(above, dtype=np.float64) + 1.0),
        torch.from_numpy(np.stack([np.asarray(c, dtype=np.float64) for c in cuts])),
        ties,
        table,
        n_pw,
    ).numpy()
    return terms[:n_pw], terms[n_pw:]


def _row_sums(rows: np.ndarray, terms: np.ndarray, n_rows: int) -> np.ndarray:
    """(T, n_rows): each row of ``terms`` summed per query, in entry order (sequentially).

    ``np.bincount`` adds the weights one by one in the order given, so a query's groups are summed
    from the highest score down, as the device loop sums its slots (its cumulative sum).
    """
    return np.stack([np.bincount(rows, weights=t, minlength=n_rows) for t in terms])


def precision_weighted_sum(
    counts: RelevantGroupCounts, limit: np.ndarray | None, ties: str, above: np.ndarray
) -> np.ndarray:
    """Per group entry: E[sum over the group's positions t <= limit of rel(t) * precision(t)].

    Summed over a query's groups and divided by its number of relevant items this is AP_T
    (``limit=None``) or tie-aware MAP@R (``limit = R`` per entry).

    Args:
        counts: the groups of a chunk of queries.
        limit: (S,) int64 position cutoff of every entry, or None for no cutoff.
        ties: "expected", "optimistic" or "pessimistic".
        above: (S,) int64 relevant items strictly above each group (``N^+_{d-1}``).
    """
    s = counts.relevant.shape[0]
    cut = np.full(s, NO_CUTOFF, dtype=np.int64) if limit is None else np.broadcast_to(limit, (s,))
    pw, _ = _counts_terms(counts, ties, [cut, np.zeros(s, dtype=np.int64)], 1, above)
    return pw[0]


def expected_relevant_in_top(counts: RelevantGroupCounts, k: np.ndarray, ties: str) -> np.ndarray:
    """Per group entry: expected number of its relevant items ranked at positions <= k.

    Under a uniformly random order of the tie the count is hypergeometric with mean
    r * (k - g) / n for the group straddling the cutoff.

    Args:
        counts: the groups of a chunk of queries.
        k: (S,) int64 cutoff of every entry (a scalar broadcasts).
        ties: "expected", "optimistic" or "pessimistic".
    """
    s = counts.relevant.shape[0]
    k = np.broadcast_to(np.asarray(k, dtype=np.int64), (s,))
    _, er = _counts_terms(counts, ties, [np.full(s, NO_CUTOFF, dtype=np.int64), k], 1)
    return er[0]


def hit_probability_at(
    first_greater: np.ndarray,
    first_size: np.ndarray,
    first_relevant: np.ndarray,
    k: int | np.ndarray,
    ties: str,
) -> np.ndarray:
    """Probability that at least one relevant item is ranked at positions <= k.

    Only the best relevant group matters: ``first_greater`` (g) irrelevant items lie above it, and
    of its n tied items r are relevant. Within the tie the top k - g positions miss every relevant
    item with probability C(n - r, k - g) / C(n, k - g).

    Args:
        first_greater: (Q,) int64 items strictly above each query's best relevant group.
        first_size: (Q,) int64 items tied in that group.
        first_relevant: (Q,) int64 relevant items in that group.
        k: the cutoff, a scalar or (Q,) per query.
        ties: "expected", "optimistic" or "pessimistic".
    """
    g, n, r = first_greater, first_size, first_relevant
    t = k - g
    if ties == "optimistic":
        return (t > 0).astype(np.float64)
    if ties == "pessimistic":
        return (t > n - r).astype(np.float64)
    out = np.where(t > n - r, 1.0, 0.0)
    partial = (t > 0) & (t <= n - r)
    if partial.any():
        out[partial] = _hit_probability_in_tie(
            np.broadcast_to(n, t.shape)[partial],
            np.broadcast_to(r, t.shape)[partial],
            t[partial],
        )
    return out


def _hit_probability_in_tie(n: np.ndarray, r: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``1 - C(n - r, t) / C(n, t)`` for int64 arrays with ``1 <= t <= n - r``, to a few ulp.

    The miss probability is the product ``prod_{i < m} (1 - s / (n - i))`` with ``m = min(t, r)``
    and ``s = max(t, r)`` (the ratio is symmetric in r and t). Its logarithm is summed factor by
    factor -- ``log1p(-s / (n - i))`` when ``s / (n - i) <= 1/2``, else ``log((n - s - i) / (n -
    i))``, each within ~2.5 ulp of its value -- with Neumaier's compensated summation (all terms
    are negative), and ``-expm1`` of a sum ``L <= 0`` is within a few ulp of ``1 - e^L`` (its
    condition number is at most 1). A difference of ``gammaln`` values would lose the digits
    of the large ones: 7e5 ulp at n = 3,000. Each distinct triple is computed once, the triples
    with the longest products first, so the work is the sum of their ``m``.
    """
    triples, inverse = np.unique(np.stack([n, r, t]).astype(np.int64), axis=1, return_inverse=True)
    nn, rr, tt = triples
    m = np.minimum(rr, tt)
    order = np.argsort(-m, kind="stable")
    hit = np.empty(m.shape[0])
    with np.errstate(divide="ignore", invalid="ignore"):  # the branch np.where does not take
        log_miss = _log_miss_probability(
            nn[order].astype(np.float64), np.maximum(rr, tt)[order].astype(np.float64), m[order]
        )
    hit[order] = -np.expm1(log_miss)
    return hit[inverse.reshape(-1)]


def _log_miss_probability(n: np.ndarray, s: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``sum_{i < m} log(1 - s / (n - i))`` per entry, compensated; ``m`` sorted decreasing."""
    total = np.zeros(n.shape[0])
    compensation = np.zeros(n.shape[0])
    active = n.shape[0]
    for i in range(int(m[0]) if m.size else 0):
        while m[active - 1] <= i:  # drop the finished entries (the last ones)
            active -= 1
        below = n[:active] - i
        fraction = s[:active] / below
        term = np.where(fraction <= 0.5, np.log1p(-fraction), np.log((below - s[:active]) / below))
        acc = total[:active]
        new = acc + term
        # Neumaier: the rounding error of each addition, added back once at the end
        compensation[:active] += np.where(
            np.abs(acc) >= np.abs(term), (acc - new) + term, (term - new) + acc
        )
        total[:active] = new
    return total + compensation


def relevant_above(counts: RelevantGroupCounts) -> np.ndarray:
    """(S,) relevant items strictly above each group: exclusive cumulative sum within each query."""
    cum = np.cumsum(counts.relevant)
    exclusive = cum - counts.relevant
    offsets = counts.offsets()
    starts = np.repeat(
        exclusive[offsets[:-1][counts.n_groups > 0]], counts.n_groups[counts.n_groups > 0]
    )
    return exclusive - starts


def average_precision_from_counts(counts: RelevantGroupCounts, ties: str) -> np.ndarray:
    """(B,) float64 AP of every query of a chunk (NaN where a query has no relevant item)."""
    rows = counts.row_ids()
    n_rows = counts.n_rows
    n_rel = np.bincount(rows, weights=counts.relevant, minlength=n_rows)
    s = rows.shape[0]
    pw, _ = _counts_terms(
        counts, ties, [np.full(s, NO_CUTOFF, dtype=np.int64), np.zeros(s, dtype=np.int64)], 1
    )
    total = _row_sums(rows, pw, n_rows)[0]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_rel > 0, total / np.where(n_rel > 0, n_rel, 1), np.nan)


def metrics_from_sums(
    pw: np.ndarray,
    er: np.ndarray,
    n_rel: np.ndarray,
    top: np.ndarray,
    ks: Iterable[int],
    list_length: np.ndarray,
    ties: str,
    ap_at_k: bool = False,
) -> dict[str, np.ndarray]:
    """Per-query metrics from the per-query sums of :func:`group_terms` (host, numpy).

    Args:
        pw: (2 [+ K], B) summed precision-weighted terms: no cut-off, R [, each k].
        er: (1 + K, B) summed relevant counts: up to R, then up to each k.
        n_rel: (B,) relevant items of each query (0: the query's metrics are NaN).
        top: (3, B) int64 ``g, n, r`` of each query's best relevant group (for recall@k).
        ks: the cut-offs.
        list_length: (B,) int64 length of each query's ranked list.
        ties: the tie handling.
        ap_at_k: ``pw`` holds the AP@k sums too.

    Returns:
        As :func:`query_metrics_from_counts`.
    """
    has_rel = n_rel > 0
    safe_r = np.where(has_rel, n_rel, 1).astype(np.float64)
    out = {
        "ap": np.where(has_rel, pw[0] / safe_r, np.nan),
        "map_at_r": np.where(has_rel, pw[1] / safe_r, np.nan),
        "r_prec": np.where(has_rel, er[0] / safe_r, np.nan),
    }
    g0, n0, r0 = (np.asarray(x, dtype=np.int64)[has_rel] for x in top)
    for i, k in enumerate(ks):
        k_of_row = np.minimum(k, list_length)  # a cutoff past a list is its length
        if ap_at_k:
            out[f"ap@{k}"] = np.where(has_rel, pw[2 + i] / safe_r, np.nan)
        hits = np.full(n_rel.shape[0], np.nan)
        hits[has_rel] = hit_probability_at(g0, n0, r0, k_of_row[has_rel], ties)
        out[f"recall@{k}"] = hits
        out[f"precision@{k}"] = np.where(has_rel, er[1 + i] / k_of_row, np.nan)
    return out


def query_metrics_from_counts(
    counts: RelevantGroupCounts,
    ties: str,
    ks: Iterable[int],
    list_length: np.ndarray,
    ap_at_k: bool = False,
) -> dict[str, np.ndarray]:
    """Per-query AP, MAP@R, R-precision, recall@k, precision@k (and AP@k) of a chunk's counts.

    Args:
        counts: relevant-group counts of the chunk's B queries.
        ties: "expected", "optimistic" or "pessimistic".
        ks: the cutoffs.
        list_length: (B,) int64 length of each query's ranked list; a cutoff past it is taken at
            that length.
        ap_at_k: also the truncated AP_T@k (normalized by the query's number of relevant items).

    Returns:
        (B,) float64 arrays, NaN for queries without a relevant item: ``"ap"``, ``"map_at_r"``,
        ``"r_prec"``, ``"recall@k"`` and ``"precision@k"`` per cutoff (and ``"ap@k"``), then
        ``"ndcg@k"`` per cutoff and ``"mrr"`` (:func:`rank_metrics_from_sums`).
    """
    ks = tuple(ks)
    n_rows = counts.n_rows
    rows = counts.row_ids()
    n_rel = np.bincount(rows, weights=counts.relevant, minlength=n_rows).astype(np.int64)
    list_length = np.asarray(list_length, dtype=np.int64)
    cuts = [list_length[rows], n_rel[rows]]
    cuts += [np.minimum(k, list_length)[rows] for k in ks]
    pw, er = _counts_terms(counts, ties, cuts, 2 + (len(ks) if ap_at_k else 0), dcg=True)
    er, dcg = er[: 1 + len(ks)], er[1 + len(ks) :]
    first = counts.offsets()[:-1]
    top = np.zeros((3, n_rows), dtype=np.int64)
    has_rel = n_rel > 0
    for row, values in enumerate((counts.greater, counts.size, counts.relevant)):
        top[row, has_rel] = values[first[has_rel]]
    out = metrics_from_sums(
        _row_sums(rows, pw, n_rows),
        _row_sums(rows, er, n_rows),
        n_rel,
        top,
        ks,
        list_length,
        ties,
        ap_at_k,
    )
    out.update(
        rank_metrics_from_sums(_row_sums(rows, dcg, n_rows), n_rel, top, ks, list_length, ties)
    )
    return out


# -- NDCG@k and MRR of binary relevance, from the same tie groups ---------------------------------

# The discount table built so far (double-double prefix sums of D(t) = 1/log2(t + 1)), grown like
# the harmonic table: a longer table starts with the same bits.
_DISCOUNT = np.zeros((1, 2))
_DISCOUNT_TENSOR = torch.from_numpy(_DISCOUNT)


@njit(cache=True)
def _discount_table_kernel(n):  # pragma: no cover - numba
    """(n + 1, 2) float64: ``C(t) = sum_{s <= t} 1/log2(s + 1)`` as ``[t, 0] + [t, 1]``.

    Each discount is rounded once (``math.log2``, then a division); the sums are double-double
    (TwoSum), so ``C(b) - C(a)`` is the sum of those discounts to a few ulps of the result.
    """
    out = np.zeros((n + 1, 2))
    hi = 0.0
    lo = 0.0
    for t in range(1, n + 1):
        d = 1.0 / math.log2(t + 1.0)
        s = hi + d
        bb = s - hi
        err = (hi - (s - bb)) + (d - bb) + lo
        hi = s + err
        lo = err - (hi - s)
        out[t, 0] = hi
        out[t, 1] = lo
    return out


def _grow_discounts(n: int) -> None:
    global _DISCOUNT, _DISCOUNT_TENSOR
    if _DISCOUNT.shape[0] <= n:
        _DISCOUNT = _discount_table_kernel(max(n, 2 * _DISCOUNT.shape[0]))
        _DISCOUNT_TENSOR = torch.from_numpy(_DISCOUNT)


def discount_table(n: int) -> np.ndarray:
    """(n + 1, 2) read-only float64 cumulative discounts ``C(0), ..., C(n)`` as double-doubles.

    ``C(t) = sum_{s=1}^{t} 1 / log2(s + 1)``; ``C(b) - C(a)`` is
    ``(T[b, 0] - T[a, 0]) + (T[b, 1] - T[a, 1])``, as for :func:`harmonic_table`.

    Example:
        >>> from rankwise.metrics.ranking import discount_table
        >>> table = discount_table(3)
        >>> [round(float(c), 6) for c in table[:, 0] + table[:, 1]]
        [0.0, 1.0, 1.63093, 2.13093]
    """
    _grow_discounts(n)
    view = _DISCOUNT[: n + 1]
    view.flags.writeable = False
    return view


def discount_table_tensor(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`discount_table` as a float64 tensor on ``device`` (a shared CPU view when CPU)."""
    _grow_discounts(n)
    table = _DISCOUNT_TENSOR[: n + 1]
    return table if device is None else table.to(device)


@njit(cache=True, inline="always")
def _fast_two_sum(a, b):  # pragma: no cover - numba
    s = a + b
    return s, b - (s - a)


@njit(cache=True, inline="always")
def _two_product(a, b):  # pragma: no cover - numba
    """``a * b`` rounded and its exact error (Dekker's product, no fused multiply-add)."""
    p = a * b
    c = 134217729.0 * a
    ah = c - (c - a)
    al = a - ah
    c = 134217729.0 * b
    bh = c - (c - b)
    bl = b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


@njit(cache=True, inline="always")
def _dd_scale(hi, lo, num, den):  # pragma: no cover - numba
    """The double-double ``(hi + lo) * num / den`` for integer-valued ``num``, ``den`` < 2^53."""
    p, e = _two_product(hi, num)
    hi, lo = _fast_two_sum(p, e + lo * num)
    q = hi / den
    p, e = _two_product(q, den)
    return _fast_two_sum(q, (((hi - p) - e) + lo) / den)


@njit(parallel=True, cache=True)
def _expected_reciprocal_rank_kernel(g, n, r, out):  # pragma: no cover - numba
    for i in prange(g.shape[0]):
        if r[i] >= n[i]:  # the first item of the group is relevant
            out[i] = 1.0 / (g[i] + 1.0)
            continue
        last = n[i] - r[i] + 1  # the first relevant item lies at 1 .. n - r + 1 of the group
        p_hi, p_lo = _dd_scale(1.0, 0.0, np.float64(r[i]), np.float64(n[i]))  # P(J = 1) = r / n
        s_hi = 0.0
        s_lo = 0.0
        for j in range(1, last + 1):
            t_hi, t_lo = _dd_scale(p_hi, p_lo, 1.0, np.float64(g[i] + j))
            s = s_hi + t_hi
            bb = s - s_hi
            err = (s_hi - (s - bb)) + (t_hi - bb) + s_lo + t_lo
            s_hi, s_lo = _fast_two_sum(s, err)
            if j == last:
                break
            # P(J = j + 1) = P(J = j) (n - r - j + 1) / (n - j)
            p_hi, p_lo = _dd_scale(
                p_hi, p_lo, np.float64(n[i] - r[i] - j + 1), np.float64(n[i] - j)
            )
            if p_hi == 0.0:  # every later term is 0 too
                break
        out[i] = s_hi + s_lo


def reciprocal_rank(
    first_greater: np.ndarray, first_size: np.ndarray, first_relevant: np.ndarray, ties: str
) -> np.ndarray:
    """Expected reciprocal rank of the first relevant item, from each query's best group.

    ``g`` items lie above the best group (none relevant), which ties ``n`` items, ``r`` of them
    relevant. The first relevant item is at ``g + J``, ``J`` its place within the group: under a
    uniformly random order of the tie, ``P(J = j) = C(n - j, r - 1) / C(n, r)`` for ``j = 1 ..
    n - r + 1`` (the other ``r - 1`` relevant items among the ``n - j`` places after it), so

        E[1 / (g + J)] = sum_j C(n - j, r - 1) / C(n, r) / (g + j),

    with ``P(J = 1) = r / n`` and ``P(J = j + 1) = P(J = j) (n - r - j + 1) / (n - j)``. The
    terms are positive (no cancellation) and carried in double-double (Dekker's product, TwoSum),
    so the result is within an ulp or so of the exact value however long the tie; the loop stops
    early when the probabilities underflow to 0. For ``g = 0`` it equals the closed form
    ``r / (n - r + 1) (H(n) - H(r - 1))``. Optimistic: ``1 / (g + 1)``; pessimistic:
    ``1 / (g + n - r + 1)``.

    Args:
        first_greater: (Q,) int64 items above each query's best relevant group.
        first_size: (Q,) int64 items tied in that group.
        first_relevant: (Q,) int64 relevant items in it (>= 1).
        ties: "expected", "optimistic" or "pessimistic".

    Returns:
        (Q,) float64.

    Example:
        >>> import numpy as np
        >>> from rankwise.metrics.ranking import reciprocal_rank
        >>> g, n, r = np.array([1]), np.array([3]), np.array([1])  # one irrelevant, then a tie
        >>> float(reciprocal_rank(g, n, r, "expected")[0])  # (1/2 + 1/3 + 1/4) / 3
        0.3611111111111111
    """
    g, n, r = (
        np.ascontiguousarray(x, dtype=np.int64) for x in (first_greater, first_size, first_relevant)
    )
    if ties == "optimistic":
        return 1.0 / (g + 1.0)
    if ties == "pessimistic":
        return 1.0 / (g + n - r + 1.0)
    out = np.empty(g.shape[0], dtype=np.float64)
    _expected_reciprocal_rank_kernel(g, n, r, out)
    return out


def rank_metrics_from_sums(
    dcg: np.ndarray,
    n_rel: np.ndarray,
    top: np.ndarray,
    ks: Iterable[int],
    list_length: np.ndarray,
    ties: str,
) -> dict[str, np.ndarray]:
    """Per-query NDCG@k and MRR from the per-query DCG sums of :func:`group_terms` (host, numpy).

    NDCG@k = E[DCG@k] / IDCG@k with IDCG@k = C(min(R, k)) (every relevant item first; the ideal
    does not depend on the ties, so the ratio of the expectation is the expectation of the ratio).

    Args:
        dcg: (K, B) summed DCG rows of :func:`group_terms` (with the discount table), one per
            cut-off.
        n_rel: (B,) relevant items of each query (0: its values are NaN).
        top: (3, B) int64 ``g, n, r`` of each query's best relevant group.
        ks: the cut-offs.
        list_length: (B,) int64 length of each query's ranked list.
        ties: the tie handling.

    Returns:
        ``{"ndcg@k": (B,) float64 per cut-off, "mrr": (B,) float64}``.
    """
    ks = tuple(ks)
    has_rel = n_rel > 0
    list_length = np.asarray(list_length, dtype=np.int64)
    out = {}
    ideal_at = [np.minimum(np.minimum(k, list_length), n_rel) for k in ks]
    table = discount_table(max((int(m.max(initial=0)) for m in ideal_at), default=0))
    for i, k in enumerate(ks):
        ideal = table[ideal_at[i], 0] + table[ideal_at[i], 1]
        out[f"ndcg@{k}"] = np.where(has_rel, dcg[i] / np.where(has_rel, ideal, 1.0), np.nan)
    mrr = np.full(n_rel.shape[0], np.nan)
    g0, n0, r0 = (np.asarray(x, dtype=np.int64)[has_rel] for x in top)
    mrr[has_rel] = reciprocal_rank(g0, n0, r0, ties)
    out["mrr"] = mrr
    return out


def _scores_2d(scores: Any, name: str) -> torch.Tensor:
    t = as_tensor(scores, name)
    if t.ndim != 2:
        raise ValueError(f"`{name}` must be 2-D (n_queries, n_items), got shape {tuple(t.shape)}.")
    if t.shape[1] == 0:
        raise ValueError(f"`{name}` has no items (0 columns); pass at least one item per list.")
    if t.dtype == torch.bool or not t.is_floating_point():
        t = t.to(torch.float64)
    check_finite(t, name)
    return t


def _scores_1d(scores: Any, name: str) -> torch.Tensor:
    t = as_tensor(scores, name)
    if t.ndim != 1:
        raise ValueError(
            f"`{name}` must be 1-D (one ranked list), got shape {tuple(t.shape)}; "
            "use the batched_* function for 2-D input."
        )
    return t


def _relevance_like(relevance: Any, scores: torch.Tensor, name: str) -> torch.Tensor:
    t = as_tensor(relevance, name, scores.device)
    if tuple(t.shape) != tuple(scores.shape):
        raise ValueError(
            f"`{name}` has shape {tuple(t.shape)} but the scores have {tuple(scores.shape)}; "
            "pass one relevance value per scored item."
        )
    if t.dtype != torch.bool:
        if t.is_complex() or not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(f"`{name}` must be binary (bool or 0/1); use ndcg for graded gains.")
        t = t.to(torch.bool)
    return t


def batched_average_precision(scores: Any, relevance: Any, ties: str = "expected") -> torch.Tensor:
    """Average precision of each row of a score matrix, tie-aware by default.

    Args:
        scores: (Q, N) float tensor / array, higher = ranked first.
        relevance: (Q, N) bool or 0/1, True for relevant items.
        ties: ``"expected"`` (mean over all orderings of tied items), ``"optimistic"`` (relevant
            first within a tie) or ``"pessimistic"`` (relevant last).

    Returns:
        (Q,) float64 tensor on the scores' device; NaN for rows without a relevant item.

    Example:
        >>> import torch
        >>> from rankwise.metrics import batched_average_precision
        >>> scores = torch.tensor([[3.0, 2.0, 1.0], [1.0, 1.0, 1.0]])  # row 2: one three-way tie
        >>> relevance = torch.tensor([[1, 0, 1], [1, 0, 1]])
        >>> batched_average_precision(scores, relevance).round(decimals=4).tolist()
        [0.8333, 0.8056]
    """
    check_ties(ties)
    s = _scores_2d(scores, "scores")
    rel = _relevance_like(relevance, s, "relevance")
    counts = relevant_group_counts(s, rel)
    ap = average_precision_from_counts(counts, ties)
    return torch.from_numpy(ap).to(s.device)


def average_precision(scores: Any, relevance: Any, ties: str = "expected") -> float:
    """Average precision of one ranked list, tie-aware by default (McSherry & Najork 2008).

    Args: as :func:`batched_average_precision`, for one list: (N,) ``scores`` and ``relevance``.

    Raises:
        ValueError: if ``relevance`` has no relevant item (AP is undefined).

    Example:
        >>> from rankwise.metrics import average_precision
        >>> round(average_precision([3.0, 2.0, 1.0, 0.0], [1, 0, 1, 0]), 4)  # ranks 1, 3
        0.8333
        >>> round(average_precision([3.0, 2.0, 2.0, 0.0], [1, 0, 1, 0]), 4)  # ranks 2, 3 tied
        0.9167
        >>> average_precision([3.0, 2.0, 2.0, 0.0], [1, 0, 1, 0], ties="optimistic")
        1.0
    """
    s = _scores_1d(scores, "scores")
    rel = _relevance_like(relevance, s, "relevance")
    if not bool(rel.any()):
        raise ValueError("`relevance` has no relevant item; average precision is undefined.")
    return float(batched_average_precision(s.unsqueeze(0), rel.unsqueeze(0), ties)[0])


def _check_k(k: Any, n_items: int) -> int:
    if k is None:
        return n_items
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"`k` must be a positive integer or None, got {k!r}.")
    return min(int(k), n_items)


def batched_ndcg(
    scores: Any, gains: Any, k: int | None = None, ties: str = "expected"
) -> torch.Tensor:
    """NDCG@k of each row with G(a) = 2^a - 1 and D(t) = 1/log2(t + 1), tie-aware by default.

    Args:
        scores: (Q, N) float tensor / array, higher = ranked first.
        gains: (Q, N) graded relevance a >= 0 (float or int).
        k: cutoff (positions <= k count); None = the whole list. Clamped to N.
        ties: ``"expected"`` (every item of a tie gets the mean discount of the positions the tie
            spans, truncated at k), ``"optimistic"`` (higher gains first within a tie) or
            ``"pessimistic"`` (lower gains first).

    Returns:
        (Q,) float64 tensor on the scores' device; NaN for rows whose gains are all 0.

    Example:
        >>> import torch
        >>> from rankwise.metrics import batched_ndcg
        >>> scores = torch.tensor([[3.0, 2.0, 1.0], [1.0, 1.0, 1.0]])  # row 2: all tied
        >>> gains = torch.tensor([[2, 1, 0], [2, 1, 0]])
        >>> batched_ndcg(scores, gains, k=2).round(decimals=4).tolist()
        [1.0, 0.5989]
    """
    check_ties(ties)
    s = _scores_2d(scores, "scores")
    a = as_tensor(gains, "gains", s.device)
    if tuple(a.shape) != tuple(s.shape):
        raise ValueError(
            f"`gains` has shape {tuple(a.shape)} but the scores have {tuple(s.shape)}."
        )
    a = a.to(torch.float64)
    check_finite(a, "gains")
    if bool((a < 0).any()):
        raise ValueError("`gains` must be non-negative graded relevance values.")
    n_items = s.shape[1]
    cutoff = _check_k(k, n_items)
    device = s.device
    gain = torch.exp2(a) - 1.0
    positions = torch.arange(1, n_items + 1, device=device, dtype=torch.float64)
    discount = torch.where(positions <= cutoff, 1.0 / torch.log2(positions + 1.0), 0.0)
    ideal = (torch.sort(gain, dim=1, descending=True).values * discount).sum(1)
    if not bool(torch.isfinite(ideal).all()):
        raise ValueError(
            f"`gains` up to {float(a.max()):g} overflow float64: the gain 2^a - 1 (or the ideal "
            "DCG summing them) exceeds 1.8e308 when a approaches 1024; rescale the graded "
            "relevance (e.g. use ranks 0, 1, 2, ... instead of raw scores)."
        )
    if ties == "expected":
        sorted_scores, order = torch.sort(s, dim=1, descending=True)
        g_sorted = torch.gather(gain, 1, order)
        first, last = tie_group_bounds(sorted_scores)
        disc_cum = torch.cat(
            [torch.zeros(1, device=device, dtype=torch.float64), torch.cumsum(discount, 0)]
        )
        mean_discount = (disc_cum[last + 1] - disc_cum[first]) / (last - first + 1)
        dcg = (g_sorted * mean_discount).sum(1)
    else:
        # lexicographic sort: secondary key (gain) first, then a stable sort on the score
        by_gain = torch.sort(gain, dim=1, descending=(ties == "optimistic"), stable=True).indices
        s_by_gain = torch.gather(s, 1, by_gain)
        order = torch.gather(
            by_gain, 1, torch.sort(s_by_gain, dim=1, descending=True, stable=True).indices
        )
        dcg = (torch.gather(gain, 1, order) * discount).sum(1)
    return torch.where(
        ideal > 0, dcg / torch.where(ideal > 0, ideal, 1.0), torch.full_like(dcg, float("nan"))
    )


def ndcg(scores: Any, gains: Any, k: int | None = None, ties: str = "expected") -> float:
    """NDCG@k of one ranked list (TALR paper Eq. 3-5, tie-aware Eq. 7 / 18).

    Args: as :func:`batched_ndcg`, for one list: (N,) ``scores`` and ``gains``.

    Raises:
        ValueError: if every gain is 0 (NDCG is undefined).

    Example:
        >>> from rankwise.metrics import ndcg
        >>> ndcg([3.0, 2.0, 1.0], [2, 1, 0])  # the ideal order
        1.0
        >>> round(ndcg([3.0, 2.0, 1.0], [2, 0, 1]), 4)
        0.9639
    """
    s = _scores_1d(scores, "scores")
    a = as_tensor(gains, "gains", s.device)
    if a.ndim != 1 or a.shape[0] != s.shape[0]:
        raise ValueError(
            f"`gains` has shape {tuple(a.shape)} but the scores have {tuple(s.shape)}."
        )
    value = float(batched_ndcg(s.unsqueeze(0), a.unsqueeze(0), k, ties)[0])
    if np.isnan(value):
        raise ValueError("`gains` are all 0: the ideal DCG is 0 and NDCG is undefined.")
    return value
