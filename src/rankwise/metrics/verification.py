"""Verification metrics of embeddings, exact and streamed: ROC AUC and TPR (FNMR) at fixed FPRs (FMR).

The pair view of :mod:`rankwise.metrics.curves` (Gajić et al., Eq. 1-3; Vogel, Bellet & Clémençon,
ICML 2018, "max TPR subject to FPR <= alpha") over the query-gallery pairs of an evaluation, without
materialising them. A pair is positive when the query and the gallery item share a label; its
score is its exact key of :mod:`rankwise.similarity`, the key the tie-aware retrieval metrics rank
and tie by, so two pairs tie exactly when they tie there.

Streaming: the exact keys of the positive pairs (few: the relevant items of each query) are sorted
into ``K`` distinct keys first; then the score blocks of the queries are streamed and every negative
pair is counted into one of ``2K + 1`` cells: strictly between two consecutive positive keys, or
equal to one (:class:`PairCounts`). Memory is O(positive pairs + one block), whatever the number of
negative pairs. These counts determine the Mann-Whitney AUC (ties counted 1/2) and the operating
point of :func:`rankwise.metrics.operating_point` exactly, since both change only at a positive
score; counts of disjoint query shards against the same keys add up (exact sharded evaluation).
Ranking blocks are screened with the proven bound of :mod:`rankwise.metrics._scores`: only a
negative whose interval contains a positive key gets its exact key recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from .._threads import keeps_torch_threads
from .._validation import Interval, check_scalar
from ..similarity import similarity_from_keys
from ._inputs import QueryGallery, block_relevance, check_chunk_size, check_query_gallery
from ._scores import BlockScorer
from .curves import OperatingPoint, _mann_whitney, point_from_cumulative

__all__ = [
    "PairCounts",
    "VerificationReport",
    "check_fprs",
    "fpr_name",
    "pair_counts",
    "pairs_description",
    "positive_pair_keys",
    "verification_metrics",
]

# score-block elements per chunk when ``chunk_size`` is not given (a few hundred MB of temporaries)
_CHUNK_ELEMENTS = 4_000_000


def fpr_name(fpr: float) -> str:
    """The name of an FPR in the report's keys and scalars: the shortest exact ``repr``.

    Example:
        >>> fpr_name(1e-3), fpr_name(1e-5)
        ('0.001', '1e-05')
    """
    return repr(float(fpr))


def check_fprs(fprs: Any, name: str = "fpr") -> tuple[float, ...]:
    """FPR budgets (a number or a sequence of them), each in the open interval (0, 1), sorted.

    Args:
        fprs: e.g. ``(1e-3, 1e-4)`` or ``0.01``; an empty sequence is allowed (no TPR reported).
        name: the argument or config key the error names.

    Returns:
        The distinct values as floats, increasing.

    Raises:
        ValueError: a value that is not a real number in (0, 1), naming ``name``.

    Example:
        >>> check_fprs([1e-3, 1e-4, 1e-3])
        (0.0001, 0.001)
    """
    if isinstance(fprs, (int, float, np.integer, np.floating)) and not isinstance(fprs, bool):
        fprs = (fprs,)
    if isinstance(fprs, (str, bytes)):
        raise ValueError(f"`{name}` must be numbers in (0, 1), e.g. (1e-3, 1e-4); got {fprs!r}.")
    try:
        values = list(fprs)
    except TypeError:
        raise ValueError(
            f"`{name}` must be a sequence of numbers in (0, 1), e.g. (1e-3, 1e-4); got {fprs!r}."
        ) from None
    checked = [check_scalar(v, name, Interval("real", 0.0, 1.0, closed="neither")) for v in values]
    return tuple(sorted({float(v) for v in checked}))


@dataclass(frozen=True)
class PairCounts:
    """Positive and negative pairs counted against the sorted distinct keys of the positive pairs.

    Attributes:
        keys: ``(K,)`` float64, strictly increasing: the exact keys (:mod:`rankwise.similarity`)
            at which positive pairs score.
        positive: ``(K,)`` int64 positive pairs at each key.
        negative: ``(2K + 1,)`` int64: ``negative[2k]`` negative pairs strictly between
            ``keys[k - 1]`` and ``keys[k]`` (below ``keys[0]`` for ``k = 0``, above ``keys[-1]``
            for ``k = K``), ``negative[2k + 1]`` negative pairs with key ``keys[k]`` (tied).
        similarity: the similarity of the keys.
        n_excluded: query-gallery pairs left out (a query's own row).

    Counts of disjoint query shards against the same ``keys`` add up (:meth:`merge`).

    Example:
        >>> import numpy as np
        >>> counts = PairCounts(np.array([0.5, 0.8]), np.array([1, 2]), np.array([3, 1, 0, 0, 0]), "dot")
        >>> counts.n_positive, counts.n_negative, counts.roc_auc()  # (1 * 3.5 + 2 * 4) / (3 * 4)
        (3, 4, 0.9583333333333334)
    """

    keys: np.ndarray
    positive: np.ndarray
    negative: np.ndarray
    similarity: str
    n_excluded: int = 0

    @property
    def n_positive(self) -> int:
        """Positive (same-label) pairs."""
        return int(self.positive.sum())

    @property
    def n_negative(self) -> int:
        """Negative (different-label) pairs."""
        return int(self.negative.sum())

    def merge(self, other: PairCounts) -> PairCounts:
        """The counts of both (disjoint pairs counted against the same keys), added exactly.

        Raises:
            ValueError: different keys or similarities (count each shard against the keys of
                every shard's positive pairs: :func:`positive_pair_keys`).
        """
        if self.similarity != other.similarity or not np.array_equal(self.keys, other.keys):
            raise ValueError(
                "pair counts merge only when counted against the same positive keys and "
                "similarity; pass `positive_keys=positive_pair_keys(...)` of the whole split to "
                "every shard's pair_counts."
            )
        return PairCounts(
            self.keys,
            self.positive + other.positive,
            self.negative + other.negative,
            self.similarity,
            self.n_excluded + other.n_excluded,
        )

    def _check_defined(self) -> None:
        if self.n_positive == 0 or self.n_negative == 0:
            missing = (
                "positive (same-label)" if self.n_positive == 0 else "negative (different-label)"
            )
            raise ValueError(
                f"the labels give no {missing} pair, so the ROC curve is undefined; check "
                "`query_labels` / `gallery_labels`."
            )

    def _below_at(self) -> tuple[np.ndarray, np.ndarray]:
        """Negatives strictly below each key and tied with it."""
        below = (
            np.cumsum(self.negative)[0::2][: self.keys.shape[0]]
            if self.keys.size
            else self.negative[:0]
        )
        return below, self.negative[1::2]

    def roc_auc(self) -> float:
        """The Mann-Whitney AUC with ties counted 1/2.

        Bit for bit :func:`~rankwise.metrics.roc_auc` of the explicit pair list (the same integer,
        the same division).
        """
        self._check_defined()
        below, at = self._below_at()
        n_pos, n_neg = self.n_positive, self.n_negative
        if 2 * n_pos * n_neg < 2**63:
            return _mann_whitney(
                torch.from_numpy(self.positive),
                torch.from_numpy(below),
                torch.from_numpy(at),
                n_pos,
                n_neg,
            )
        # beyond int64: the same integer in Python's unbounded integers
        twice = sum(
            int(p) * (2 * int(b) + int(a)) for p, b, a in zip(self.positive, below, at, strict=True)
        )
        return twice / (2.0 * n_pos * n_neg)

    def operating_point(self, fpr: float) -> OperatingPoint:
        """The rule of :func:`~rankwise.metrics.operating_point` on these pairs.

        Only a positive key can be the chosen threshold (a lower threshold between two positive
        keys adds false positives and no true one), so the point equals that of the explicit pair
        list; the threshold is returned as a similarity value (``cos``, ``q . g``, ``-||q - g||``).
        """
        alpha = check_scalar(fpr, "fpr", Interval("real", 0.0, 1.0, closed="neither"))
        self._check_defined()
        below, _ = self._below_at()
        n_neg = self.n_negative
        true_pos = np.cumsum(self.positive[::-1])
        false_pos = (n_neg - below)[::-1]  # negatives scored >= each key, keys decreasing
        values = similarity_from_keys(torch.from_numpy(self.keys), self.similarity).numpy()[::-1]
        budget = math.floor(Fraction(alpha) * n_neg)
        return point_from_cumulative(values, true_pos, false_pos, budget, self.n_positive, n_neg)

    def report(self, fpr: Any = (), *, pairs: str = "") -> VerificationReport:
        """The :class:`VerificationReport` of these counts at the FPR budgets ``fpr``."""
        fprs = check_fprs(fpr)
        return VerificationReport(
            roc_auc=self.roc_auc(),
            operating_points={f: self.operating_point(f) for f in fprs},
            n_positive_pairs=self.n_positive,
            n_negative_pairs=self.n_negative,
            n_excluded_pairs=self.n_excluded,
            similarity=self.similarity,
            pairs=pairs,
            counts=self,
        )


@dataclass
class VerificationReport:
    """ROC AUC and the operating point at each requested FPR of an evaluation's pairs.

    Attributes:
        roc_auc: exact Mann-Whitney AUC, ties counted 1/2.
        operating_points: ``{fpr: OperatingPoint(tpr, achieved fpr, threshold)}`` per requested
            FPR (FMR): the largest TPR of a threshold whose FPR is at most ``fpr``; FNMR = 1 - TPR.
        n_positive_pairs: positive (same-label) pairs counted.
        n_negative_pairs: negative pairs counted.
        n_excluded_pairs: pairs left out (each query's own row).
        similarity: the similarity the thresholds are values of.
        pairs: which pairs were counted, in words.
        counts: the :class:`PairCounts` behind it (for an exact merge; not written to JSON).
    """

    roc_auc: float
    operating_points: dict[float, OperatingPoint]
    n_positive_pairs: int
    n_negative_pairs: int
    n_excluded_pairs: int
    similarity: str
    pairs: str = ""
    counts: PairCounts | None = field(default=None, repr=False, compare=False)

    @property
    def fprs(self) -> tuple[float, ...]:
        """The requested FPRs, increasing."""
        return tuple(self.operating_points)

    def tpr_at(self, fpr: float) -> float:
        """The TPR at the requested FPR ``fpr`` (``KeyError`` when it was not requested)."""
        return self.operating_points[float(fpr)].tpr

    def scalars(self) -> dict[str, float]:
        """``{"roc_auc": ..., "tpr@fpr=0.001": ...}``: the names a monitor selects by."""
        out = {"roc_auc": float(self.roc_auc)}
        out.update({f"tpr@fpr={fpr_name(f)}": p.tpr for f, p in self.operating_points.items()})
        return out

    def rows(self) -> list[tuple[str, float]]:
        """The printed ``(name, value)`` rows: ``ROC AUC``, ``TPR@FPR=0.001``, ..."""
        rows = [("ROC AUC", float(self.roc_auc))]
        rows += [(f"TPR@FPR={fpr_name(f)}", p.tpr) for f, p in self.operating_points.items()]
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (an infinite threshold, nothing accepted, as ``None``)."""
        points = {
            fpr_name(f): {
                "tpr": p.tpr,
                "fnmr": 1.0 - p.tpr,
                "fpr": p.fpr,
                "threshold": None if math.isinf(p.threshold) else p.threshold,
            }
            for f, p in self.operating_points.items()
        }
        return {
            "roc_auc": self.roc_auc,
            "tpr_at_fpr": {k: v["tpr"] for k, v in points.items()},
            "operating_points": points,
            "n_positive_pairs": self.n_positive_pairs,
            "n_negative_pairs": self.n_negative_pairs,
            "n_excluded_pairs": self.n_excluded_pairs,
            "similarity": self.similarity,
            "pairs": self.pairs,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VerificationReport:
        """Inverse of :meth:`to_dict` (without the counts)."""
        points = {
            float(k): OperatingPoint(
                float(v["tpr"]),
                float(v["fpr"]),
                math.inf if v.get("threshold") is None else float(v["threshold"]),
            )
            for k, v in (data.get("operating_points") or {}).items()
        }
        return cls(
            roc_auc=float(data["roc_auc"]),
            operating_points=points,
            n_positive_pairs=int(data["n_positive_pairs"]),
            n_negative_pairs=int(data["n_negative_pairs"]),
            n_excluded_pairs=int(data.get("n_excluded_pairs", 0)),
            similarity=str(data.get("similarity", "")),
            pairs=str(data.get("pairs", "")),
        )


# -- counting ------------------------------------------------------------------------------------


@dataclass
class _Problem:
    qg: QueryGallery
    self_index: torch.Tensor | None  # (n_q,) gallery row left out of each query's pairs, -1: none
    chunk_size: int
    scorer: BlockScorer

    @property
    def pairs(self) -> str:
        return pairs_description(self.qg.leave_one_out, self.self_index is not None)


def pairs_description(leave_one_out: bool, excluded: bool) -> str:
    """Which pairs a report counted, in words (``VerificationReport.pairs``).

    Example:
        >>> pairs_description(True, True)
        'leave-one-out: ordered pairs (i, j), i != j (each unordered pair twice)'
    """
    if leave_one_out and excluded:
        return "leave-one-out: ordered pairs (i, j), i != j (each unordered pair twice)"
    if excluded:
        return "query x gallery pairs, each query's own gallery row left out"
    return "query x gallery pairs"


def _prepare(
    query: Any,
    query_labels: Any,
    gallery: Any,
    gallery_labels: Any,
    similarity: str,
    exclude_self: Any,
    chunk_size: Any,
    device: Any,
) -> _Problem:
    from .retrieval import _self_index  # the retrieval report's rule for a query's own row

    qg = check_query_gallery(
        query, query_labels, gallery, gallery_labels, similarity=similarity, device=device
    )
    chunk = check_chunk_size(chunk_size)
    self_index, _ = _self_index(exclude_self, qg)
    if chunk is None:
        chunk = max(1, _CHUNK_ELEMENTS // max(1, qg.gallery.shape[0]))
    scorer = BlockScorer(qg.query, qg.gallery, qg.similarity, approximate=True)
    return _Problem(qg, self_index, chunk, scorer)


def _chunks(p: _Problem) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(first row, last row + 1, (b, n_g) bool mask of the positive pairs, own row left out)."""
    n_q, n_g = p.qg.query.shape[0], p.qg.gallery.shape[0]
    for lo in range(0, n_q, p.chunk_size):
        hi = min(n_q, lo + p.chunk_size)
        positive = block_relevance(p.qg.query_labels[lo:hi], p.qg.gallery_labels)
        if p.self_index is not None:
            own = p.self_index[lo:hi]
            rows = torch.nonzero(own >= 0).flatten()
            positive[rows, own[rows]] = False
        assert positive.shape == (hi - lo, n_g)
        yield lo, hi, positive


def _own_mask(p: _Problem, lo: int, hi: int, shape: tuple[int, ...]) -> torch.Tensor | None:
    if p.self_index is None:
        return None
    own = p.self_index[lo:hi]
    rows = torch.nonzero(own >= 0).flatten()
    mask = torch.zeros(shape, dtype=torch.bool, device=p.qg.device)
    mask[rows, own[rows]] = True
    return mask


def _positive_keys(p: _Problem) -> list[torch.Tensor]:
    """Float64 exact keys of the positive pairs of each chunk, in the order of :func:`_chunks`."""
    parts = []
    for lo, _, positive in _chunks(p):
        rows, cols = torch.nonzero(positive, as_tuple=True)
        keys = torch.empty(0, dtype=torch.float64, device=p.qg.device)
        if rows.numel():
            keys = p.scorer.pair_keys_tensor(rows + lo, cols).to(p.qg.device)
        parts.append(keys)
    return parts


def _distinct(parts: list[torch.Tensor]) -> torch.Tensor:
    """The sorted distinct keys of every part."""
    return torch.unique(torch.cat(parts)) if parts else torch.empty(0, dtype=torch.float64)


def _codes(p: _Problem, lo: int, hi: int, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(b, n_g) int64 cell of every pair of rows lo..hi-1: ``#keys < key + #keys <= key``.

    Even: strictly between two positive keys; odd ``2k + 1``: equal to ``keys[k]``. Screened on
    the approximate block: a pair whose value interval holds no positive key's value is placed
    without its exact key (the similarity is non-decreasing in the key).
    """
    block = p.scorer.block(lo, hi, keys=True)
    if block.bound is None:
        x = block.values.to(torch.float64).contiguous()
        return torch.searchsorted(keys, x) + torch.searchsorted(keys, x, right=True)
    low, high = p.scorer.value_interval(block)
    index = torch.searchsorted(values, low.contiguous())
    n_keys = keys.shape[0]
    nearest = values[index.clamp(max=n_keys - 1)]
    codes = 2 * index
    unsure = (index < n_keys) & (nearest <= high)
    rows, cols = torch.nonzero(unsure, as_tuple=True)
    if rows.numel():
        exact = p.scorer.pair_keys_tensor(rows + lo, cols).to(keys.device)
        codes[rows, cols] = torch.searchsorted(keys, exact) + torch.searchsorted(
            keys, exact, right=True
        )
    return codes


def _count(
    p: _Problem, keys: torch.Tensor, chunk_keys: list[torch.Tensor] | None = None
) -> PairCounts:
    """Every pair of the problem counted against the sorted distinct positive ``keys``.

    ``chunk_keys``: the positive pairs' keys of each chunk when already computed.
    """
    dev = p.qg.device
    keys = keys.to(device=dev, dtype=torch.float64).contiguous()
    values = similarity_from_keys(keys, p.qg.similarity).contiguous()
    n_keys = keys.shape[0]
    positive = torch.zeros(n_keys, dtype=torch.int64, device=dev)
    negative = torch.zeros(2 * n_keys + 1, dtype=torch.int64, device=dev)
    for index, (lo, hi, is_positive) in enumerate(_chunks(p)):
        rows, cols = torch.nonzero(is_positive, as_tuple=True)
        if rows.numel():
            pos_keys = (
                chunk_keys[index]
                if chunk_keys is not None
                else p.scorer.pair_keys_tensor(rows + lo, cols).to(dev)
            )
            at = torch.searchsorted(keys, pos_keys).clamp(max=max(n_keys - 1, 0))
            if n_keys == 0 or not bool((keys[at] == pos_keys).all()):
                raise ValueError(
                    "`positive_keys` lacks the key of a positive pair; pass the keys of every "
                    "positive pair of the split (positive_pair_keys)."
                )
            positive += torch.bincount(at, minlength=n_keys)
        if n_keys == 0:
            negatives = ~is_positive
            own = _own_mask(p, lo, hi, tuple(is_positive.shape))
            if own is not None:
                negatives &= ~own
            negative[0] += negatives.sum()
            continue
        codes = _codes(p, lo, hi, keys, values)
        negatives = ~is_positive
        own = _own_mask(p, lo, hi, tuple(is_positive.shape))
        if own is not None:
            negatives &= ~own
        negative += torch.bincount(codes[negatives], minlength=2 * n_keys + 1)
    n_excluded = 0 if p.self_index is None else int((p.self_index >= 0).sum())
    return PairCounts(
        keys.cpu().numpy(),
        positive.cpu().numpy(),
        negative.cpu().numpy(),
        p.qg.similarity,
        n_excluded,
    )


@keeps_torch_threads
def positive_pair_keys(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    similarity: str = "cosine",
    exclude_self: Any = None,
    chunk_size: int | None = None,
    device: Any = None,
) -> np.ndarray:
    """The sorted distinct exact keys of the positive pairs: what shards count against.

    Args: as :func:`pair_counts`.

    Returns:
        ``(K,)`` float64, strictly increasing.

    Example:
        >>> import torch
        >>> emb = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
        >>> positive_pair_keys(emb, torch.tensor([0, 0, 1]), similarity="dot").tolist()
        [0.5]
    """
    p = _prepare(
        query, query_labels, gallery, gallery_labels, similarity, exclude_self, chunk_size, device
    )
    return _distinct(_positive_keys(p)).cpu().numpy()


@keeps_torch_threads
def pair_counts(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    similarity: str = "cosine",
    exclude_self: Any = None,
    positive_keys: Any = None,
    chunk_size: int | None = None,
    device: Any = None,
) -> PairCounts:
    """Count the query-gallery pairs, streamed, against the distinct keys of the positive pairs.

    Args:
        query: ``(n_q, d)`` embeddings.
        query_labels: ``(n_q,)`` class ids or ``(n_q, C)`` multi-hot labels; a pair is positive
            when the two share a label.
        gallery: ``(n_g, d)`` embeddings, or ``None`` for leave-one-out (the queries against each
            other: the ordered pairs ``(i, j)``, ``i != j``, each unordered pair twice, which
            leaves the AUC and every TPR at an FPR unchanged).
        gallery_labels: the gallery's labels.
        similarity: ``"cosine"``, ``"dot"`` or ``"euclidean"``.
        exclude_self: as :func:`~rankwise.metrics.retrieval_metrics` (``None``: leave-one-out
            leaves each query's own row out; a bool, or the gallery row of each query, ``-1``
            for none).
        positive_keys: the keys to count against (:func:`positive_pair_keys` of the whole split,
            for query shards whose counts are merged); default the keys of this call's positive
            pairs.
        chunk_size: query rows per block (default: about 4M scores per block).
        device: where to compute (default the query's device).

    Returns:
        The :class:`PairCounts`.

    Raises:
        ValueError: bad input naming the argument, or a positive pair whose key is not in
            ``positive_keys``.

    Example:
        >>> import torch
        >>> emb = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])  # (1, 2) ties with (0, 1)
        >>> counts = pair_counts(emb, torch.tensor([0, 0, 1]), similarity="dot")
        >>> counts.keys.tolist(), counts.positive.tolist(), counts.negative.tolist()
        ([0.5], [2], [2, 2, 0])
    """
    p = _prepare(
        query, query_labels, gallery, gallery_labels, similarity, exclude_self, chunk_size, device
    )
    if positive_keys is None:
        parts = _positive_keys(p)
        return _count(p, _distinct(parts), parts)
    keys = torch.as_tensor(np.asarray(positive_keys, dtype=np.float64))
    if keys.ndim != 1 or bool((keys[1:] <= keys[:-1]).any()):
        raise ValueError(
            "`positive_keys` must be a 1-D strictly increasing array (positive_pair_keys)."
        )
    return _count(p, keys)


@keeps_torch_threads
def verification_metrics(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    fpr: Iterable[float] | float = (),
    similarity: str = "cosine",
    exclude_self: Any = None,
    chunk_size: int | None = None,
    device: Any = None,
) -> VerificationReport:
    """Exact ROC AUC and TPR at each FPR of the query-gallery pairs, streamed in blocks.

    Equal to :func:`~rankwise.metrics.roc_auc` and :func:`~rankwise.metrics.operating_point` of
    the explicit list of pairs scored by their exact keys (ties move together), in memory
    O(positive pairs + one block). Args as :func:`pair_counts`, plus ``fpr``: the FPR (FMR)
    budgets, each in (0, 1).

    Returns:
        The :class:`VerificationReport`.

    Example:
        >>> import torch
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> report = verification_metrics(emb, torch.tensor([0, 0, 1, 1]), fpr=[0.25])
        >>> report.roc_auc, report.tpr_at(0.25), report.n_positive_pairs, report.n_negative_pairs
        (0.875, 1.0, 4, 8)
    """
    fprs = check_fprs(fpr)
    p = _prepare(
        query, query_labels, gallery, gallery_labels, similarity, exclude_self, chunk_size, device
    )
    parts = _positive_keys(p)
    counts = _count(p, _distinct(parts), parts)
    return counts.report(fprs, pairs=p.pairs)
