"""Verification (pair) view of an embedding: exact, tie-aware ROC, ROC AUC and TPR at a fixed FPR.

Every pair of samples is a binary example, positive when the two share a label, scored by their
similarity: the view of Gajić et al. (Eq. 1-3), and of Vogel, Bellet & Clémençon (ICML 2018;
U-statistics over the pairs i < j of Eq. (4)/(5), "max TPR subject to FPR <= alpha"). A threshold t
predicts "positive" for every score >= t, so tied pairs move together and the AUC is the
Mann-Whitney statistic with ties counted 1/2 (docs/metrics.md, "Pair view").
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal, NamedTuple, overload

import numpy as np
import torch

from .._threads import keeps_torch_threads
from .._validation import Interval, as_tensor, check_bool, check_range_pair, check_scalar
from ..similarity import SIMILARITIES, similarity_from_keys
from ._inputs import QueryGallery, block_relevance, check_chunk_size, check_query_gallery
from ._scores import BlockScorer

__all__ = [
    "RocCurve",
    "OperatingPoint",
    "PAIR_SIMILARITIES",
    "pair_scores",
    "roc_curve",
    "roc_curve_from_embeddings",
    "roc_auc",
    "tpr_at_fpr",
    "operating_point",
]

PAIR_SIMILARITIES = SIMILARITIES  # one vocabulary (rankwise.similarity)

# Score-matrix elements materialized per chunk when ``chunk_size`` is not given (~64 MB in fp32).
_DEFAULT_CHUNK_ELEMENTS = 16_000_000


@dataclass(frozen=True)
class RocCurve:
    """A ROC curve, one point per distinct score (or per non-empty bin when built from a histogram).

    Attributes:
        fpr: (n_points,) float64, non-decreasing, starting at 0 and ending at 1.
        tpr: (n_points,) float64, non-decreasing, starting at 0 and ending at 1.
        thresholds: (n_points,) float64, strictly decreasing; point ``k`` predicts "positive" for
            every score ``>= thresholds[k]``. ``thresholds[0] = +inf`` (nothing predicted positive),
            as in scikit-learn >= 1.3.
        n_positive: number of positive pairs / examples.
        n_negative: number of negative pairs / examples.
        bin_width: ``None`` for an exact curve; for a histogram curve the bin width (the points
            then sit at the bin edges and the thresholds are the lower bin edges).
        max_auc_error: 0 for an exact curve; for a histogram curve an upper bound on
            ``|auc - exact AUC|`` (half the fraction of positive/negative pairs sharing a bin).
        mann_whitney: the exact area from the integer counts, as :func:`roc_auc` returns it
            (set by :func:`roc_curve`; ``None`` for a histogram curve or a hand-built one).
    """

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray
    n_positive: int
    n_negative: int
    bin_width: float | None = None
    max_auc_error: float = 0.0
    mann_whitney: float | None = field(default=None, repr=False)

    @property
    def auc(self) -> float:
        """Area under the curve; for an exact curve bit for bit :func:`roc_auc` of its scores."""
        if self.mann_whitney is not None:
            return self.mann_whitney
        return float((np.diff(self.fpr) * (self.tpr[1:] + self.tpr[:-1])).sum() / 2.0)

    @property
    def exact(self) -> bool:
        """True for an exact curve, False for one built from a histogram."""
        return self.bin_width is None

    def __len__(self) -> int:
        return int(self.fpr.shape[0])


class OperatingPoint(NamedTuple):
    """The threshold chosen by :func:`operating_point`: predict positive iff ``score >= threshold``.

    ``threshold = +inf`` means no threshold reaches the FPR budget except predicting nothing
    positive (``tpr = fpr = 0``).
    """

    tpr: float
    fpr: float
    threshold: float


# -- validation ------------------------------------------------------------------------------------


def _check_binary_scores(scores: Any, is_positive: Any) -> tuple[torch.Tensor, torch.Tensor]:
    s = as_tensor(scores, "scores")
    y = as_tensor(is_positive, "is_positive", device=s.device)
    if s.ndim != 1:
        raise ValueError(
            f"`scores` must be 1-D (one score per example/pair), got shape {tuple(s.shape)}; "
            "flatten a score matrix together with its mask, or use pair_scores()."
        )
    if y.ndim != 1:
        raise ValueError(f"`is_positive` must be 1-D, got shape {tuple(y.shape)}.")
    if s.shape[0] != y.shape[0]:
        raise ValueError(
            f"`scores` has length {s.shape[0]} but `is_positive` has length {y.shape[0]}; "
            "pass one target per score."
        )
    if s.is_complex() or s.dtype == torch.bool:
        raise ValueError(f"`scores` must be real numbers, got dtype {s.dtype}.")
    if not s.is_floating_point():
        s = s.to(torch.float64)
    if bool(torch.isnan(s).any()):
        raise ValueError(
            f"`scores` contains {int(torch.isnan(s).sum())} NaN value(s); NaN cannot be ranked. "
            "Check the model output or drop those examples (and their targets) first."
        )
    if y.dtype != torch.bool:
        if y.is_complex() or not bool(((y == 0) | (y == 1)).all()):
            raise ValueError(
                "`is_positive` must be boolean or 0/1 (True for a positive pair / example)."
            )
        y = y != 0
    n_pos = int(y.sum())
    if n_pos == 0:
        raise ValueError(
            "`is_positive` has no positive entry: TPR (and the ROC curve) is undefined without "
            "positives."
        )
    if n_pos == y.shape[0]:
        raise ValueError(
            "`is_positive` has no negative entry: FPR (and the ROC curve) is undefined without "
            "negatives."
        )
    return s, y


def _distinct_score_counts(
    scores: torch.Tensor, is_positive: torch.Tensor, descending: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct scores (sorted) with the number of positives and negatives at each of them."""
    sorted_scores, order = torch.sort(scores, descending=descending)
    sorted_pos = is_positive[order]
    distinct, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    group_end = torch.cumsum(counts, 0)
    pos_cum = torch.cumsum(sorted_pos.to(torch.int64), 0)[group_end - 1]
    pos_per_group = torch.diff(pos_cum, prepend=pos_cum.new_zeros(1))
    neg_per_group = counts - pos_per_group
    return distinct, pos_per_group, neg_per_group


# -- scores -> curve / scalar ----------------------------------------------------------------------


def roc_curve(scores: Any, is_positive: Any, *, drop_intermediate: bool = False) -> RocCurve:
    """Exact, tie-aware ROC curve of scored binary examples (Gajić et al., Eq. 2-3).

    One point per distinct score (a run of ties is one diagonal segment). Equal to
    ``sklearn.metrics.roc_curve(is_positive, scores, drop_intermediate=drop_intermediate)``.

    Args:
        scores: (n,) real scores, higher means "more likely positive"; tensor or array, any device.
        is_positive: (n,) bool or 0/1 targets.
        drop_intermediate: scikit-learn's rule on the exact integer counts (docs/metrics.md);
            the area is unchanged.

    Returns:
        :class:`RocCurve` with (fpr, tpr, thresholds) float64 numpy arrays.

    Raises:
        ValueError: mismatched lengths, NaN scores, or no positive / no negative.

    Example:
        >>> from rankwise.metrics import roc_curve
        >>> curve = roc_curve([0.9, 0.8, 0.8, 0.3, 0.1], [1, 1, 0, 1, 0])  # a tie at 0.8
        >>> curve.fpr.tolist(), curve.tpr.round(4).tolist(), curve.thresholds[1:].tolist()
        ([0.0, 0.0, 0.5, 0.5, 1.0], [0.0, 0.3333, 0.6667, 1.0, 1.0], [0.9, 0.8, 0.3, 0.1])
    """
    drop_intermediate = check_bool(drop_intermediate, "drop_intermediate")
    s, y = _check_binary_scores(scores, is_positive)
    distinct, pos, neg = _distinct_score_counts(s, y, descending=True)
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    # negatives scored below each distinct score (descending order): the same integer as roc_auc
    area = _mann_whitney(pos, n_neg - torch.cumsum(neg, 0), neg, n_pos, n_neg)
    tps = torch.cumsum(pos, 0).cpu().numpy()
    fps = torch.cumsum(neg, 0).cpu().numpy()
    thresholds = distinct.to(torch.float64).cpu().numpy()
    if drop_intermediate and fps.shape[0] > 2:
        # second differences of integer counts: exact, unlike differences of rounded rates
        corner = (np.diff(fps, 2) != 0) | (np.diff(tps, 2) != 0)
        keep = np.flatnonzero(np.r_[True, corner, True])
        tps, fps, thresholds = tps[keep], fps[keep], thresholds[keep]
    tpr = np.r_[0, tps].astype(np.float64) / n_pos
    fpr = np.r_[0, fps].astype(np.float64) / n_neg
    return RocCurve(
        fpr=fpr,
        tpr=tpr,
        thresholds=np.r_[np.inf, thresholds],
        n_positive=n_pos,
        n_negative=n_neg,
        mann_whitney=area,
    )


def _mann_whitney(
    pos: torch.Tensor, negatives_below: torch.Tensor, neg: torch.Tensor, n_pos: int, n_neg: int
) -> float:
    """AUC from per-distinct-score counts: wins + ties / 2, in integer arithmetic until the end."""
    # 2 x (wins + ties/2), kept in int64: at most 2 * n_pos * n_neg < 2^63 for n < ~4e9.
    twice_wins = int((pos * (2 * negatives_below + neg)).sum())
    return twice_wins / (2.0 * n_pos * n_neg)


def roc_auc(scores: Any, is_positive: Any) -> float:
    """Exact ROC AUC: the Mann-Whitney statistic with ties counted 1/2, in O(n log n).

    AUC = P(s+ > s-) + 1/2 P(s+ = s-), in integer arithmetic from the per-distinct-score counts.
    Equals ``sklearn.metrics.roc_auc_score(is_positive, scores)``.

    Args: as :func:`roc_curve`. Raises ``ValueError`` on mismatched lengths, NaN scores, or no
    positive / no negative.

    Example:
        >>> from rankwise.metrics import roc_auc
        >>> roc_auc([0.9, 0.8, 0.8, 0.3, 0.1], [1, 1, 0, 1, 0])  # 4 of 6 pairs ordered, 1 tied
        0.75
    """
    s, y = _check_binary_scores(scores, is_positive)
    _, pos, neg = _distinct_score_counts(s, y, descending=False)
    negatives_below = torch.cumsum(neg, 0) - neg
    return _mann_whitney(pos, negatives_below, neg, int(pos.sum()), int(neg.sum()))


def _check_sample_weight(sample_weight: Any, is_positive: torch.Tensor) -> torch.Tensor | None:
    """(n,) int64 (exact) or float64 weights, finite, non-negative, with weight on both classes."""
    if sample_weight is None:
        return None
    w = as_tensor(sample_weight, "sample_weight", device=is_positive.device)
    if w.ndim != 1:
        raise ValueError(
            f"`sample_weight` must be 1-D (one weight per score), got shape {tuple(w.shape)}."
        )
    if w.shape[0] != is_positive.shape[0]:
        raise ValueError(
            f"`sample_weight` has {w.shape[0]} entries but `scores` has {is_positive.shape[0]}; "
            "pass one weight per score."
        )
    w = w.to(torch.float64) if w.is_floating_point() or w.is_complex() else w.to(torch.int64)
    if w.is_complex() or not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError("`sample_weight` must hold finite, non-negative numbers.")
    if w.is_floating_point() and bool((w == w.round()).all()) and float(w.sum()) < 2.0**53:
        w = w.to(torch.int64)  # whole-number weights are counts: keep the exact budget check
    for name, mask in (("positives", is_positive), ("negatives", ~is_positive)):
        if not bool((w[mask] > 0).any()):
            raise ValueError(
                f"`sample_weight` gives the {name} a total weight of 0, so the "
                f"{'TPR' if name == 'positives' else 'FPR'} is undefined; give some of them a "
                "positive weight."
            )
    return w


def _cumulative_rates(
    scores: torch.Tensor, is_positive: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """Distinct scores (descending) with the (weighted) positives and negatives scored >= each."""
    if weights is None:
        distinct, pos, neg = _distinct_score_counts(scores, is_positive, descending=True)
        return distinct, torch.cumsum(pos, 0).cpu().numpy(), torch.cumsum(neg, 0).cpu().numpy()
    sorted_scores, order = torch.sort(scores, descending=True)
    sorted_pos, sorted_w = is_positive[order], weights[order]
    distinct, counts = torch.unique_consecutive(sorted_scores, return_counts=True)
    group_end = torch.cumsum(counts, 0) - 1
    zero = torch.zeros_like(sorted_w)
    true_pos = torch.cumsum(torch.where(sorted_pos, sorted_w, zero), 0)[group_end]
    false_pos = torch.cumsum(torch.where(sorted_pos, zero, sorted_w), 0)[group_end]
    return distinct, true_pos.cpu().numpy(), false_pos.cpu().numpy()


def operating_point(
    scores: Any, is_positive: Any, fpr: float, *, sample_weight: Any = None
) -> OperatingPoint:
    """The threshold to deploy under an FPR budget (pointwise ROC, Vogel et al., ICML 2018).

    Among the thresholds (the distinct scores) whose FPR is at most ``fpr``, the one with the
    largest TPR and, among those, the smallest FPR. Ties are never split, so the achieved FPR can
    be smaller than ``fpr``; the budget is checked exactly on the integer counts.

    With ``sample_weight`` both rates are weighted sums over their class. Whole-number weights count
    as repeated examples and keep the check exact; other weights are checked up to n·ε·Σw.

    Args:
        scores: (n,) real scores.
        is_positive: (n,) bool or 0/1 targets.
        fpr: the FPR budget alpha, in (0, 1).
        sample_weight: optional (n,) finite non-negative weights (both classes must carry some).

    Returns:
        :class:`OperatingPoint` (tpr, fpr achieved, threshold); threshold ``+inf`` (predict nothing
        positive, tpr = fpr = 0) when no distinct score reaches a positive within the budget.

    Example:
        >>> from rankwise.metrics import operating_point
        >>> operating_point([0.9, 0.8, 0.8, 0.3, 0.1], [1, 1, 0, 1, 0], fpr=0.5)
        OperatingPoint(tpr=1.0, fpr=0.5, threshold=0.3)
        >>> operating_point([0.9, 0.8, 0.8, 0.3, 0.1], [1, 1, 0, 1, 0], fpr=0.4).threshold  # 0.8: tie
        0.9
    """
    alpha = check_scalar(fpr, "fpr", Interval("real", 0.0, 1.0, closed="neither"))
    s, y = _check_binary_scores(scores, is_positive)
    weights = _check_sample_weight(sample_weight, y)
    distinct, true_pos, false_pos = _cumulative_rates(s, y, weights)
    n_neg = false_pos[-1].item()
    if weights is None or not weights.is_floating_point():
        # FP / n_neg <= alpha  <=>  FP <= floor(alpha * n_neg), alpha taken as the exact binary value
        budget = math.floor(Fraction(alpha) * n_neg)
    else:
        budget = alpha * n_neg + s.shape[0] * np.finfo(np.float64).eps * n_neg
    return point_from_cumulative(distinct, true_pos, false_pos, budget, true_pos[-1].item(), n_neg)


def point_from_cumulative(
    distinct: Any,
    true_pos: np.ndarray,
    false_pos: np.ndarray,
    budget: Any,
    n_pos: Any,
    n_neg: Any,
) -> OperatingPoint:
    """:func:`operating_point`'s rule on cumulative counts at descending thresholds.

    Args:
        distinct: the thresholds, in decreasing order.
        true_pos: positives scored ``>=`` each threshold (non-decreasing; the last is ``n_pos``).
        false_pos: negatives scored ``>=`` each threshold (the last is ``n_neg``).
        budget: the largest admissible number (or weight) of false positives.
        n_pos: all positives (the TPR's denominator).
        n_neg: all negatives (the FPR's denominator).

    Returns:
        The :class:`OperatingPoint` (shared with the streamed pair counts of
        :mod:`rankwise.metrics.verification`).
    """
    n_admissible = int(np.searchsorted(false_pos, budget, side="right"))  # FP is non-decreasing
    best = true_pos[n_admissible - 1].item() if n_admissible else 0
    if best == 0:
        return OperatingPoint(tpr=0.0, fpr=0.0, threshold=math.inf)
    k = int(np.searchsorted(true_pos, best, side="left"))  # the first threshold reaching `best`
    return OperatingPoint(
        tpr=best / n_pos, fpr=false_pos[k].item() / n_neg, threshold=float(distinct[k])
    )


@overload
def tpr_at_fpr(
    scores: Any,
    is_positive: Any,
    fpr: float,
    *,
    return_threshold: Literal[False] = False,
    sample_weight: Any = None,
) -> float: ...


@overload
def tpr_at_fpr(
    scores: Any,
    is_positive: Any,
    fpr: float,
    *,
    return_threshold: Literal[True],
    sample_weight: Any = None,
) -> tuple[float, float]: ...


@overload
def tpr_at_fpr(
    scores: Any,
    is_positive: Any,
    fpr: float,
    *,
    return_threshold: bool = False,
    sample_weight: Any = None,
) -> float | tuple[float, float]: ...


def tpr_at_fpr(
    scores: Any,
    is_positive: Any,
    fpr: float,
    *,
    return_threshold: bool = False,
    sample_weight: Any = None,
) -> float | tuple[float, float]:
    """Largest TPR reachable by a threshold whose FPR is at most ``fpr`` (ties move together).

    See :func:`operating_point` for the rule and ``sample_weight``. With ``return_threshold=True``
    returns ``(tpr, threshold)``: predict positive iff ``score >= threshold``.

    Example:
        >>> from rankwise.metrics import tpr_at_fpr
        >>> tpr_at_fpr([0.9, 0.8, 0.8, 0.3, 0.1], [1, 1, 0, 1, 0], fpr=0.5, return_threshold=True)
        (1.0, 0.3)
        >>> round(tpr_at_fpr([0.9, 0.8, 0.8, 0.3, 0.1], [1, 1, 0, 1, 0], fpr=0.4), 4)
        0.3333
    """
    point = operating_point(scores, is_positive, fpr, sample_weight=sample_weight)
    return (point.tpr, point.threshold) if return_threshold else point.tpr


# -- embeddings -> pairs ---------------------------------------------------------------------------


@dataclass
class _PairProblem:
    qg: QueryGallery
    exclude_self: bool
    chunk_size: int
    scorer: BlockScorer

    @property
    def n_pairs(self) -> int:
        nq, ng = self.qg.query.shape[0], self.qg.gallery.shape[0]
        if self.qg.leave_one_out:
            return nq * (nq - 1) // 2 if self.exclude_self else nq * (nq + 1) // 2
        return nq * ng - (nq if self.exclude_self else 0)


def _prepare_pairs(
    query: Any,
    query_labels: Any,
    gallery: Any,
    gallery_labels: Any,
    similarity: str,
    exclude_self: bool | None,
    chunk_size: int | None,
    device: torch.device | str | None,
    *,
    approximate: bool = False,
) -> _PairProblem:
    qg = check_query_gallery(
        query, query_labels, gallery, gallery_labels, similarity=similarity, device=device
    )
    if exclude_self is not None and not isinstance(exclude_self, (bool, np.bool_)):
        raise ValueError(
            f"`exclude_self` must be None, True or False for pair scores, got {exclude_self!r}."
        )
    chunk_size = check_chunk_size(chunk_size)
    if qg.leave_one_out:
        exclude = True if exclude_self is None else bool(exclude_self)
    else:
        exclude = bool(exclude_self) if exclude_self is not None else False
        if exclude and qg.gallery.shape[0] != qg.query.shape[0]:
            raise ValueError(
                "`exclude_self=True` drops the pairs (i, i), so `gallery` must have as many rows "
                f"as `query` (got {qg.gallery.shape[0]} and {qg.query.shape[0]})."
            )
    if chunk_size is None:
        chunk_size = max(1, _DEFAULT_CHUNK_ELEMENTS // max(1, qg.gallery.shape[0]))
    scorer = BlockScorer(qg.query, qg.gallery, qg.similarity, approximate=approximate)
    return _PairProblem(qg, exclude, chunk_size, scorer)


def _pair_blocks(p: _PairProblem) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """(first row, last row + 1, first column, (b, m) keep mask) per block, each pair once."""
    nq = p.qg.query.shape[0]
    dev = p.qg.device
    for start in range(0, nq, p.chunk_size):
        stop = min(nq, start + p.chunk_size)
        rows = torch.arange(start, stop, device=dev)
        col_lo = start if p.qg.leave_one_out else 0  # no pair j > i in the columns before `start`
        cols = torch.arange(col_lo, p.qg.gallery.shape[0], device=dev)
        if p.qg.leave_one_out:
            keep = (
                cols[None, :] > rows[:, None] if p.exclude_self else cols[None, :] >= rows[:, None]
            )
        elif p.exclude_self:
            keep = cols[None, :] != rows[:, None]
        else:
            keep = torch.ones(stop - start, cols.shape[0], dtype=torch.bool, device=dev)
        yield start, stop, col_lo, keep


@keeps_torch_threads
def pair_scores(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    similarity: str = "cosine",
    exclude_self: bool | None = None,
    max_pairs: int = 50_000_000,
    chunk_size: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Similarity and same-label flag of every (query, item) pair, the examples of the pair view.

    Leave-one-out (``gallery=None``): each unordered pair i < j once, n(n-1)/2 pairs. With a
    gallery: all n_q * n_g pairs. Scores are the exact float64 values of
    :func:`rankwise.similarity.exact_similarity` (independent of ``chunk_size`` and device).

    Args:
        query: (n_q, d) float embeddings (any device; computed there unless ``device`` is given).
        query_labels: (n_q,) integer class ids or (n_q, C) multi-hot; a pair is positive when the
            two share at least one label.
        gallery: optional (n_g, d) embeddings; ``None`` pairs the queries with each other.
        gallery_labels: (n_g,) or (n_g, C), same kind as ``query_labels``.
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"euclidean"`` (score ``-||q - g||``;
            alias ``"neg_euclidean"``).
        exclude_self: drop the self pairs (i, i); default True for leave-one-out, False with a
            gallery (then True needs as many gallery rows as queries).
        max_pairs: refuse to materialize more pairs than this (memory guard).
        chunk_size: query rows per block of the score matrix (default: ~16M scores per block).
        device: where to compute; default the device of ``query``.

    Returns:
        ``(scores, is_positive)``: (n_pairs,) float64 tensor and (n_pairs,) bool tensor,
        leave-one-out pairs in row-major order of the upper triangle.

    Raises:
        ValueError: bad shapes / NaN / label kinds, or more than ``max_pairs`` pairs (pass
            ``bins=`` to :func:`roc_curve_from_embeddings` instead).

    Example:
        >>> import torch
        >>> from rankwise.metrics import pair_scores
        >>> emb = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
        >>> scores, same = pair_scores(emb, torch.tensor([0, 0, 1]))  # pairs (0, 1), (0, 2), (1, 2)
        >>> scores.round(decimals=4).tolist(), same.tolist()
        ([0.6, 0.0, 0.8], [True, False, False])
    """
    p = _prepare_pairs(
        query, query_labels, gallery, gallery_labels, similarity, exclude_self, chunk_size, device
    )
    max_pairs = check_scalar(max_pairs, "max_pairs", Interval("integer", 0, None))
    n_pairs = p.n_pairs
    if n_pairs > max_pairs:
        raise ValueError(
            f"{n_pairs:,} pairs exceed `max_pairs`={max_pairs:,} (about "
            f"{n_pairs * 9 / 2**30:.1f} GiB); pass `bins=` (e.g. "
            "bins=10_000) to roc_curve_from_embeddings() for a memory-bounded histogram ROC, "
            "subsample the queries, or raise `max_pairs`."
        )
    dev = p.qg.device
    scores = torch.empty(n_pairs, dtype=torch.float64, device=dev)
    is_positive = torch.empty(n_pairs, dtype=torch.bool, device=dev)
    offset = 0
    for start, stop, col_lo, keep in _pair_blocks(p):  # every pair once
        keys = p.scorer.keys(start, stop, col_lo)
        rel = block_relevance(p.qg.query_labels[start:stop], p.qg.gallery_labels[col_lo:])
        block_scores = similarity_from_keys(keys, p.qg.similarity)[keep]
        n = block_scores.shape[0]
        scores[offset : offset + n] = block_scores
        is_positive[offset : offset + n] = rel[keep]
        offset += n
    return scores, is_positive


# -- embeddings -> curve ---------------------------------------------------------------------------


def _block_value_bounds(
    p: _PairProblem, start: int, stop: int, col_lo: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact values of a block, or (low, high) bounds of them when the block is approximate."""
    block = p.scorer.block(start, stop, col_lo, keys=True)
    if block.bound is None:
        return similarity_from_keys(block.values.to(torch.float64), p.qg.similarity), None
    return p.scorer.value_interval(block)


def _score_range(p: _PairProblem) -> tuple[float, float]:
    """Range of the pair scores, one streaming pass (used for histograms of dot / euclidean)."""
    lo, hi = math.inf, -math.inf
    for start, stop, col_lo, keep in _pair_blocks(p):
        low, high = _block_value_bounds(p, start, stop, col_lo)
        high = low if high is None else high
        if bool(keep.any()):
            lo = min(lo, float(low[keep].min()))
            hi = max(hi, float(high[keep].max()))
    if hi == lo:  # every pair has the same score: one bin holds them all
        hi = lo + 1.0
    return lo, hi


def _bins_of(values: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bin k of each value: the number of lower edges ``edges[1:]`` at or below it (clamped)."""
    bins = edges.shape[0]
    width = float(edges[1] - edges[0])
    guess = ((values - float(edges[0])) / width).floor().clamp_(0, bins - 1).long()
    # the division may round across an edge: one comparison with the true edges on each side
    guess -= ((values < edges[guess]) & (guess > 0)).long()
    upper = (guess + 1).clamp_(max=bins - 1)
    guess += ((values >= edges[upper]) & (guess < bins - 1)).long()
    return guess


def _block_bins(
    p: _PairProblem, start: int, stop: int, col_lo: int, edges: torch.Tensor
) -> torch.Tensor:
    """(b, m) bin of the exact score of every pair; pairs whose bound straddles an edge get keys."""
    low, high = _block_value_bounds(p, start, stop, col_lo)
    low_bins = _bins_of(low, edges)
    if high is None:
        return low_bins
    rows, cols = torch.nonzero(low_bins != _bins_of(high, edges), as_tuple=True)
    if rows.numel():
        keys = p.scorer.pair_keys((rows + start).cpu().numpy(), (cols + col_lo).cpu().numpy())
        exact = similarity_from_keys(torch.from_numpy(keys), p.qg.similarity).to(low.device)
        low_bins[rows, cols] = _bins_of(exact, edges)
    return low_bins


def _histogram_roc(p: _PairProblem, bins: int, score_range: tuple[float, float] | None) -> RocCurve:
    if score_range is None:
        score_range = (-1.0, 1.0) if p.qg.similarity == "cosine" else _score_range(p)
    lo, hi = check_range_pair(score_range, "score_range")
    width = (hi - lo) / bins
    dev = p.qg.device
    edges = lo + width * torch.arange(bins, dtype=torch.float64, device=dev)
    pos_hist = torch.zeros(bins, dtype=torch.int64, device=dev)
    neg_hist = torch.zeros(bins, dtype=torch.int64, device=dev)
    for start, stop, col_lo, keep in _pair_blocks(p):
        # Scores outside the range are clamped into the end bins: counted, never dropped.
        idx = _block_bins(p, start, stop, col_lo, edges)[keep]
        pos = block_relevance(p.qg.query_labels[start:stop], p.qg.gallery_labels[col_lo:])[keep]
        pos_hist += torch.bincount(idx[pos], minlength=bins)
        neg_hist += torch.bincount(idx[~pos], minlength=bins)
    n_pos, n_neg = int(pos_hist.sum()), int(neg_hist.sum())
    if n_pos == 0 or n_neg == 0:
        missing = "positive (same-label)" if n_pos == 0 else "negative (different-label)"
        raise ValueError(
            f"the labels give no {missing} pair, so the ROC curve is undefined; check "
            "`query_labels` / `gallery_labels`."
        )
    pos_np = pos_hist.cpu().numpy()[::-1]
    neg_np = neg_hist.cpu().numpy()[::-1]
    nonempty = (pos_np + neg_np) > 0
    lower_edges = edges.cpu().numpy()[::-1]
    tps = np.r_[0, np.cumsum(pos_np)[nonempty]].astype(np.float64)
    fps = np.r_[0, np.cumsum(neg_np)[nonempty]].astype(np.float64)
    thresholds = np.r_[np.inf, lower_edges[nonempty]]
    # Within a bin the order of positives and negatives is unknown; the curve joins the bin's
    # corners linearly (as if tied), so the AUC can be off by at most half the pairs sharing a bin.
    shared = float((pos_np.astype(np.float64) * neg_np.astype(np.float64)).sum())
    return RocCurve(
        fpr=fps / n_neg,
        tpr=tps / n_pos,
        thresholds=thresholds,
        n_positive=n_pos,
        n_negative=n_neg,
        bin_width=width,
        max_auc_error=0.5 * shared / (float(n_pos) * float(n_neg)),
    )


@keeps_torch_threads
def roc_curve_from_embeddings(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    similarity: str = "cosine",
    exclude_self: bool | None = None,
    bins: int | None = None,
    score_range: tuple[float, float] | None = None,
    drop_intermediate: bool = False,
    max_pairs: int = 50_000_000,
    chunk_size: int | None = None,
    device: torch.device | str | None = None,
) -> RocCurve:
    """ROC curve of the pair view of embeddings: exact, or streamed through a histogram.

    ``bins=None`` (default): exact and tie-aware, through :func:`pair_scores` and
    :func:`roc_curve` (memory O(n_pairs); refused above ``max_pairs``).

    ``bins=int``: memory O(bins + chunk): the exact pair scores are streamed into positive and
    negative histograms over ``score_range`` (default [-1, 1] for cosine, else one extra pass);
    ``curve.max_auc_error`` bounds the AUC error (docs/metrics.md, "Pair view").

    Args: as :func:`pair_scores` (``max_pairs`` for the exact curve only), plus ``bins`` (histogram
    bins, >= 2, or ``None`` for the exact curve), ``score_range`` (``(lo, hi)`` of the histogram;
    scores outside are clamped into the end bins) and ``drop_intermediate`` (exact curve only; see
    :func:`roc_curve`).

    Returns:
        :class:`RocCurve` (``bin_width`` and ``max_auc_error`` set for the histogram form).

    Example:
        >>> import torch
        >>> from rankwise.metrics import roc_curve_from_embeddings
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> curve = roc_curve_from_embeddings(emb, torch.tensor([0, 0, 1, 1]))  # 6 pairs
        >>> curve.n_positive, curve.n_negative, curve.mann_whitney
        (2, 4, 0.875)
        >>> roc_curve_from_embeddings(emb, torch.tensor([0, 0, 1, 1]), bins=4).bin_width
        0.5
    """
    if bins is None:
        scores, is_positive = pair_scores(
            query,
            query_labels,
            gallery,
            gallery_labels,
            similarity=similarity,
            exclude_self=exclude_self,
            max_pairs=max_pairs,
            chunk_size=chunk_size,
            device=device,
        )
        if scores.numel() == 0:
            raise ValueError("`query` has fewer than 2 rows: there is no pair to score.")
        return roc_curve(scores, is_positive, drop_intermediate=drop_intermediate)
    bins = check_scalar(bins, "bins", Interval("integer", 2, None))
    p = _prepare_pairs(
        query,
        query_labels,
        gallery,
        gallery_labels,
        similarity,
        exclude_self,
        chunk_size,
        device,
        approximate=True,
    )
    return _histogram_roc(p, bins, score_range)
