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
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from scipy.special import digamma, gammaln

from .._validation import as_tensor, check_finite
from ._kernels import RelevantGroupCounts, relevant_group_counts, tie_group_bounds

__all__ = [
    "TIES",
    "average_precision",
    "ndcg",
    "batched_average_precision",
    "batched_ndcg",
    "check_ties",
    "harmonic_difference",
    "precision_weighted_sum",
    "expected_relevant_in_top",
    "hit_probability_at",
    "average_precision_from_counts",
    "query_metrics_from_counts",
]

TIES = ("expected", "optimistic", "pessimistic")

# Below this many terms H(hi) - H(lo) is summed directly (exact to rounding); above it the
# digamma difference is used, whose absolute error (~1e-15) is then small relative to the result.
_DIRECT_HARMONIC_TERMS = 16


def check_ties(ties: str) -> str:
    """``ties`` if it is one of :data:`TIES`, else a ValueError naming the argument."""
    if ties not in TIES:
        raise ValueError(f"`ties` must be one of {TIES}, got {ties!r}.")
    return ties


def harmonic_difference(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """H(hi) - H(lo) = sum_{t=lo+1}^{hi} 1/t elementwise, for int arrays with 0 <= lo <= hi."""
    lo, hi = np.broadcast_arrays(np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64))
    span = hi - lo
    out = np.empty(span.shape, dtype=np.float64)
    short = span <= _DIRECT_HARMONIC_TERMS
    long_spans = ~short
    if long_spans.any():
        # digamma only where the span is long: it dominates the cost of few-class evaluations
        out[long_spans] = digamma(hi[long_spans] + 1.0) - digamma(lo[long_spans] + 1.0)
    if short.any():
        # short spans summed directly, in the same order as always (adding 0.0 never changed a
        # value, so skipping finished entries keeps the result bit-identical)
        lo_s = lo[short].astype(np.float64)
        span_s = span[short]
        acc = np.zeros(lo_s.shape, dtype=np.float64)
        active = np.flatnonzero(span_s >= 1)
        term = 1
        while active.size:
            acc[active] += 1.0 / (lo_s[active] + term)
            term += 1
            active = active[span_s[active] >= term]
        out[short] = acc
    return out


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
    g = counts.greater
    n = counts.size
    r = counts.relevant
    p = above
    if ties == "expected":
        upper = g + n if limit is None else np.clip(limit, g, g + n)
        beta = np.where(n > 1, (r - 1) / np.maximum(n - 1, 1), 0.0)
        a = p + 1.0
        inner = (a - beta * (g + 1.0)) * harmonic_difference(g, upper) + beta * (upper - g)
        return r / n * inner
    if ties == "optimistic":
        # relevant items at positions g+1 .. g+r: sum (p+i)/(g+i) = c + (p-g)(H(g+c) - H(g))
        c = r if limit is None else np.clip(limit - g, 0, r)
        return c + (p - g) * harmonic_difference(g, g + c)
    # pessimistic: relevant items at positions g+n-r+1 .. g+n
    first = g + n - r
    c = r if limit is None else np.clip(limit - first, 0, r)
    return c + (p - first) * harmonic_difference(first, first + c)


def expected_relevant_in_top(counts: RelevantGroupCounts, k: np.ndarray, ties: str) -> np.ndarray:
    """Per group entry: expected number of its relevant items ranked at positions <= k.

    Under a uniformly random order of the tie the count is hypergeometric with mean
    r * (k - g) / n for the group straddling the cutoff.

    Args:
        counts: the groups of a chunk of queries.
        k: (S,) int64 cutoff of every entry (a scalar broadcasts).
        ties: "expected", "optimistic" or "pessimistic".
    """
    g = counts.greater
    n = counts.size
    r = counts.relevant
    if ties == "expected":
        return r * np.clip(k - g, 0, n) / n
    if ties == "optimistic":
        return np.clip(k - g, 0, r).astype(np.float64)
    return np.clip(k - g - (n - r), 0, r).astype(np.float64)


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
        nn = n[partial].astype(np.float64)
        rr = r[partial].astype(np.float64)
        tt = t[partial].astype(np.float64)
        log_miss = (
            gammaln(nn - rr + 1)
            - gammaln(nn - rr - tt + 1)
            - gammaln(nn + 1)
            + gammaln(nn - tt + 1)
        )
        out[partial] = 1.0 - np.exp(log_miss)
    return out


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
    terms = precision_weighted_sum(counts, None, ties, relevant_above(counts))
    total = np.bincount(rows, weights=terms, minlength=n_rows)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n_rel > 0, total / np.where(n_rel > 0, n_rel, 1), np.nan)


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
        ``"r_prec"``, ``"recall@k"`` and ``"precision@k"`` per cutoff (and ``"ap@k"``).
    """
    n_rows = counts.n_rows
    rows = counts.row_ids()
    n_rel = np.bincount(rows, weights=counts.relevant, minlength=n_rows)
    has_rel = n_rel > 0
    safe_r = np.where(has_rel, n_rel, 1)
    above = relevant_above(counts)
    r_of_entry = n_rel[rows].astype(np.int64)
    at_r = np.bincount(
        rows, precision_weighted_sum(counts, r_of_entry, ties, above), minlength=n_rows
    )
    top_r = np.bincount(rows, expected_relevant_in_top(counts, r_of_entry, ties), minlength=n_rows)
    out = {
        "ap": average_precision_from_counts(counts, ties),
        "map_at_r": np.where(has_rel, at_r / safe_r, np.nan),
        "r_prec": np.where(has_rel, top_r / safe_r, np.nan),
    }
    first = counts.offsets()[:-1][has_rel]
    for k in ks:
        k_of_row = np.minimum(k, list_length)  # a cutoff past a list is its length
        if ap_at_k:
            at_k = np.bincount(
                rows, precision_weighted_sum(counts, k_of_row[rows], ties, above), minlength=n_rows
            )
            out[f"ap@{k}"] = np.where(has_rel, at_k / safe_r, np.nan)
        hits = np.full(n_rows, np.nan)
        hits[has_rel] = hit_probability_at(
            counts.greater[first],
            counts.size[first],
            counts.relevant[first],
            k_of_row[has_rel],
            ties,
        )
        out[f"recall@{k}"] = hits
        in_top = np.bincount(
            rows, expected_relevant_in_top(counts, k_of_row[rows], ties), minlength=n_rows
        )
        out[f"precision@{k}"] = np.where(has_rel, in_top / k_of_row, np.nan)
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
