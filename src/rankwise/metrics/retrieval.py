"""Exact, tie-aware, memory-bounded retrieval evaluation of embeddings (MAP, R@k, NDCG@k, MRR...).

Every query is ranked against the gallery by similarity; the metrics are the expectations over all
orderings of tied items (McSherry & Najork 2008; He et al., "Hashing as Tie-Aware Learning to
Rank", CVPR 2018, Prop. 1, Eq. 6 as corrected in docs/errata.md). MAP@R and R-precision follow
Musgrave, Belongie & Lim, "A Metric Learning Reality Check" (ECCV 2020): with R the number of items
relevant to the query, MAP@R = (1/R) sum_{i<=R} P(i) rel(i) and RP = (#relevant in the top R) / R
(tie-aware forms: :mod:`rankwise.metrics.ranking`, with the expected NDCG@k and reciprocal rank
of binary relevance, also P@k). The mean PR curve is the one plotted by Wen et al. (NeurIPS 2022,
SOPRC, Fig. 2): the mean over queries of interpolated precision.

Queries are processed in chunks (never an N x N matrix): the exact keys of
:mod:`rankwise.similarity` for a block (:mod:`rankwise.metrics._scores`), reduced to
per-relevant-group counts (the numba kernels of :mod:`rankwise.metrics._kernels`, or the device
loop of :mod:`rankwise.metrics._device`), then to the metrics in closed form
(:func:`rankwise.metrics.ranking.group_terms`, shared by both).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from .._threads import keeps_torch_threads
from .._validation import as_tensor, check_choice
from ..similarity import SIMILARITIES
from . import _device
from ._blocks import query_blocks
from ._inputs import QueryGallery, block_relevance, check_chunk_size, check_ks, check_query_gallery
from ._kernels import (
    RelevantGroupCounts,
    relevant_group_counts_from_lists,
    relevant_lists_from_classes,
    relevant_lists_from_mask,
)
from ._scores import BlockScorer
from .ranking import (
    check_ties,
    discount_table_tensor,
    harmonic_table_tensor,
    metrics_from_sums,
    query_metrics_from_counts,
    rank_metrics_from_sums,
    relevant_above,
)
from .verification import VerificationReport

__all__ = [
    "RetrievalReport",
    "ReportField",
    "with_fields",
    "PRCurve",
    "retrieval_metrics",
    "pr_curve",
    "SIMILARITIES",
]

# Memory budget of one chunk's score block on the numba path (the torch path plans its chunks
# from the device's memory: rankwise.metrics._device.memory_budget).
_CHUNK_BYTES = 256 * 2**20
# Above this mean number of relevant items per query the numba path approximates the scores in
# float64 (the torch path always does: its near-tied pairs then almost never occur).
_FLOAT64_APPROXIMATION_RELEVANT = 256
# errors when no query has a relevant item (also raised by rankwise.metrics.distributed)
NO_RELEVANT_MESSAGE = (
    "no query has a relevant item in the gallery (no shared label in `query_labels` / "
    "`gallery_labels`, after excluding each query's own row); the metrics are undefined. "
    "Check the labels, or pass a gallery that contains the query classes."
)
NO_RELEVANT_PR_MESSAGE = (
    "no query has a relevant item in the gallery (no shared label in `query_labels` / "
    "`gallery_labels`); the PR curve is undefined."
)


_Report = TypeVar("_Report", bound="RetrievalReport")


@dataclass(frozen=True)
class ReportField:
    """One metric of a report, declared once: its per-query values and the names it goes by.

    Every metric of a :class:`RetrievalReport` is the mean, over the queries with at least one
    relevant item, of one per-query value (one per cut-off for the ``@k`` metrics). A field
    declared in the report's :attr:`RetrievalReport.FIELDS` is built, merged across query shards,
    written to JSON, read back, printed and offered as a scalar from that one declaration.

    Attributes:
        attribute: the report's attribute (``"map"``, ``"recall_at"``, ...).
        key: the name of its per-query array; with ``{k}`` one array per cut-off
            (``"recall@{k}"``) and the attribute is ``{k: mean}`` over the report's ``ks``.
        label: the printed name (``"mAP"``, ``"recall@{k}"``).
        scalar: the name in :meth:`RetrievalReport.scalars` (what a monitor selects:
            ``"map"``, ``"recall@{k}"``).

    Example:
        >>> from rankwise.metrics.retrieval import ReportField
        >>> field = ReportField("recall_at", "recall@{k}", "recall@{k}", "recall@{k}")
        >>> field.keys((1, 10)), field.per_cutoff
        (['recall@1', 'recall@10'], True)
    """

    attribute: str
    key: str
    label: str
    scalar: str

    @property
    def per_cutoff(self) -> bool:
        """Whether the field has one value per cut-off (a ``{k: value}`` dict)."""
        return "{k}" in self.key

    def keys(self, ks: tuple[int, ...]) -> list[str]:
        """The names of its per-query arrays for the cut-offs ``ks``."""
        return [self.key.format(k=k) for k in ks] if self.per_cutoff else [self.key]

    def reduce(self, arrays: dict[str, np.ndarray], valid: np.ndarray, ks: tuple[int, ...]) -> Any:
        """The field's value: the mean of its per-query values over the ``valid`` queries."""

        def mean(name: str) -> float:
            return float(arrays[name][valid].mean())

        if self.per_cutoff:
            return {k: mean(self.key.format(k=k)) for k in ks}
        return mean(self.key)

    def combine(self, values: list[Any], weights: list[int], ks: tuple[int, ...]) -> Any:
        """The value of a merge from shards' values, weighted by their evaluated queries.

        A shard without the value (a cut-off missing from its dict) makes the merged one NaN.
        """
        if self.per_cutoff:
            return {k: weighted_mean([v.get(k, math.nan) for v in values], weights) for k in ks}
        return weighted_mean(values, weights)

    def nan(self, ks: tuple[int, ...]) -> Any:
        """The value of a report without a query with a relevant item."""
        return dict.fromkeys(ks, math.nan) if self.per_cutoff else math.nan

    def named(self, value: Any, name: str) -> list[tuple[str, float]]:
        """``(name, value)`` pairs of ``value``, ``name`` being :attr:`label` or :attr:`scalar`."""
        if self.per_cutoff:
            return [(name.format(k=k), v) for k, v in value.items()]
        return [(name, value)]

    def to_json(self, value: Any) -> Any:
        """``value`` as JSON (string keys for the cut-offs)."""
        return {str(k): v for k, v in value.items()} if self.per_cutoff else value

    def from_json(self, value: Any) -> Any:
        """Inverse of :meth:`to_json`."""
        if self.per_cutoff:
            return {int(k): float(v) for k, v in value.items()}
        return float(value)


def weighted_mean(values: list[float], weights: list[int]) -> float:
    """``sum(values * weights) / sum(weights)`` (``math.fsum``; zero weights left out)."""
    total = sum(weights)
    return math.fsum(v * w for v, w in zip(values, weights, strict=True) if w) / total


def with_fields(
    base: tuple[ReportField, ...], *extra: tuple[str | None, ReportField]
) -> tuple[ReportField, ...]:
    """``base`` with more fields, for a report subclass's :attr:`~RetrievalReport.FIELDS`.

    Each ``(before, field)`` replaces the field of the same attribute in place, or goes before
    the field ``before`` (at the end when None or absent).

    So a field added to the base class reaches the subclass too.

    Example:
        >>> from rankwise.metrics.retrieval import ReportField, RetrievalReport, with_fields
        >>> at_k = ReportField("map_at", "ap@{k}", "AP@{k}", "map@{k}")
        >>> [f.attribute for f in with_fields(RetrievalReport.FIELDS, ("recall_at", at_k))][:3]
        ['map', 'map_at', 'recall_at']
    """
    out = list(base)
    for before, new in extra:
        names = [f.attribute for f in out]
        if new.attribute in names:
            out[names.index(new.attribute)] = new
        elif before in names:
            out.insert(names.index(before), new)
        else:
            out.append(new)
    return tuple(out)


@dataclass
class RetrievalReport:
    """Retrieval metrics averaged over the queries that have at least one relevant item.

    Attributes:
        map: mean over queries of AP over the full ranking (not truncated).
        recall_at: {k: fraction of queries with >= 1 relevant item in the top k}.
        precision_at: {k: mean of (expected #relevant in the top k) / k}. Keys are the requested
            cutoffs; a cutoff beyond the ranked list is evaluated at the list length (see
            ``clamped_ks``).
        map_at_r: mean MAP@R (Musgrave et al. 2020).
        r_precision: mean R-precision.
        per_query_ap: (n_queries,) float64 tensor, NaN for queries without a relevant item.
        n_queries: number of queries (including those without a relevant item).
        n_queries_without_relevant: queries with no relevant gallery item, excluded from the means.
        n_gallery: gallery rows (a query's own row, when excluded, is still counted here).
        ties: tie handling used.
        similarity: similarity used.
        ks: the requested cutoffs (duplicates removed).
        clamped_ks: {requested k: k used} for cutoffs larger than the ranked list. Each query
            is evaluated at min(k, its own list length); with an ``exclude_self`` index array
            holding -1 for some queries, those queries' lists are one item longer than the
            length reported here.
        ndcg_at: {k: mean tie-aware NDCG@k of binary relevance} (``E[DCG@k] / IDCG@k``, D(t) =
            1 / log2(t + 1); docs/metrics.md). Default (a report written before it): empty.
        mrr: mean tie-aware reciprocal rank of the first relevant item (``E[1 / rank]`` over the
            orderings of the ties). Default: NaN.
        per_query: the other per-query values behind the means, ``{name: (n_queries,)
            float64}`` (the keys of :attr:`FIELDS` but ``"ap"``; a subclass adds its own), so
            that :func:`~rankwise.metrics.merge_retrieval_reports` of query blocks recomputes
            every mean exactly as one call does. Not in :meth:`to_dict`, the repr or ``==``.
        verification: the pair view of the same evaluation, when asked for (``None`` by default):
            ROC AUC and TPR at each requested FPR of the query-gallery pairs
            (:func:`~rankwise.metrics.verification_metrics`); in :meth:`to_dict` as
            ``"verification"``, in :meth:`rows` and :meth:`scalars` (``roc_auc``,
            ``tpr@fpr=0.001``).

    The metrics are declared once, in :attr:`FIELDS` (:class:`ReportField`): building the report
    from per-query values (:meth:`from_per_query`), the exact merge of query shards,
    :meth:`to_dict` / :meth:`from_dict`, the printed :meth:`rows` and :meth:`scalars` all read it.
    """

    # fields every report of one evaluation shares (merge_retrieval_reports checks them)
    _SETTINGS: ClassVar[tuple[str, ...]] = ("n_gallery", "ties", "similarity", "ks")
    _NO_RELEVANT: ClassVar[str] = NO_RELEVANT_MESSAGE
    # the metrics: each the mean of a per-query value over the queries with a relevant item
    FIELDS: ClassVar[tuple[ReportField, ...]] = (
        ReportField("map", "ap", "mAP", "map"),
        ReportField("recall_at", "recall@{k}", "recall@{k}", "recall@{k}"),
        ReportField("precision_at", "precision@{k}", "precision@{k}", "precision@{k}"),
        ReportField("map_at_r", "map_at_r", "MAP@R", "map_at_r"),
        ReportField("r_precision", "r_prec", "R-precision", "r_precision"),
        ReportField("ndcg_at", "ndcg@{k}", "NDCG@{k}", "ndcg@{k}"),
        ReportField("mrr", "mrr", "MRR", "mrr"),
    )

    map: float
    recall_at: dict[int, float]
    precision_at: dict[int, float]
    map_at_r: float
    r_precision: float
    per_query_ap: torch.Tensor
    n_queries: int
    n_queries_without_relevant: int
    n_gallery: int
    ties: str
    similarity: str
    ks: tuple[int, ...]
    clamped_ks: dict[int, int] = field(default_factory=dict)
    per_query: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)
    ndcg_at: dict[int, float] = field(default_factory=dict)
    mrr: float = math.nan
    verification: VerificationReport | None = None

    def with_verification(self: _Report, verification: VerificationReport | None) -> _Report:
        """This report with the pair view ``verification`` (a copy; ``None`` removes it)."""
        return replace(self, verification=verification)

    def settings(self) -> dict[str, Any]:
        """The fields every report of one evaluation shares (gallery size, ties, ks, ...)."""
        return {name: getattr(self, name) for name in self._SETTINGS}

    def per_query_arrays(self) -> dict[str, np.ndarray] | None:
        """``{"ap": per_query_ap, **per_query}`` as float64 arrays; None without ``per_query``."""
        if not self.per_query:
            return None
        arrays = {"ap": self.per_query_ap.to(torch.float64).cpu().numpy()}
        arrays.update({k: v.to(torch.float64).cpu().numpy() for k, v in self.per_query.items()})
        return arrays

    @classmethod
    def per_query_keys(cls, ks: tuple[int, ...]) -> list[str]:
        """The per-query arrays :meth:`from_per_query` needs for the cut-offs ``ks``."""
        return [key for f in cls.FIELDS for key in f.keys(ks)]

    @classmethod
    def from_per_query(
        cls: type[_Report],
        arrays: dict[str, np.ndarray],
        settings: dict[str, Any],
        clamped_ks: dict[int, int],
    ) -> _Report:
        """The report whose per-query values are ``arrays`` (the means of one evaluation).

        :func:`retrieval_metrics` and :func:`~rankwise.metrics.merge_retrieval_reports` both
        build their report here, so a merge of query blocks is the one-call report bit for bit.

        Args:
            arrays: ``{name: (n_queries,) float64}`` holding every key of :attr:`FIELDS`
                (:meth:`per_query_keys`), NaN for a query without a relevant item (in each).
            settings: the values of :meth:`settings`.
            clamped_ks: as the field.

        Returns:
            The report (of ``cls``).

        Raises:
            ValueError: a per-query array is missing, the arrays disagree on which queries have
                a relevant item, or no query has one.
        """
        ks = settings["ks"]
        keys = cls.per_query_keys(ks)
        missing = [key for key in keys if key not in arrays]
        if missing:
            raise ValueError(
                f"`arrays` lacks the per-query values {missing} of {cls.__name__}.FIELDS; pass "
                "one (n_queries,) array per declared field and cut-off."
            )
        undefined = np.stack([np.isnan(arrays[key]) for key in keys])
        valid: np.ndarray = np.asarray(~undefined.any(0))
        if bool((undefined.all(0) != undefined.any(0)).any()):
            raise ValueError(
                "`arrays` disagree on which queries have a relevant item: a query's per-query "
                "values must be all NaN (no relevant item) or all defined."
            )
        if not valid.any():
            raise ValueError(cls._NO_RELEVANT)
        ap = arrays["ap"]
        return cls(
            **{f.attribute: f.reduce(arrays, valid, ks) for f in cls.FIELDS},
            per_query_ap=torch.from_numpy(ap),
            n_queries=int(ap.shape[0]),
            n_queries_without_relevant=int((~valid).sum()),
            clamped_ks=clamped_ks,
            per_query={k: torch.from_numpy(v) for k, v in arrays.items() if k != "ap"},
            **cls._extra_from_per_query(arrays, valid),
            **settings,
        )

    @classmethod
    def _extra_from_per_query(cls, arrays: dict[str, np.ndarray], valid: np.ndarray) -> dict:
        """A subclass's fields that are not means of :attr:`FIELDS` (ranges, per-query arrays)."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (per-query AP as a list with None for NaN)."""
        out = {f.attribute: f.to_json(getattr(self, f.attribute)) for f in self.FIELDS}
        out.update(
            per_query_ap=[None if math.isnan(v) else v for v in self.per_query_ap.tolist()],
            n_queries=self.n_queries,
            n_queries_without_relevant=self.n_queries_without_relevant,
            n_gallery=self.n_gallery,
            ties=self.ties,
            similarity=self.similarity,
            ks=list(self.ks),
            clamped_ks={str(k): v for k, v in self.clamped_ks.items()},
        )
        if self.verification is not None:  # absent otherwise: the file of before, unchanged
            out["verification"] = self.verification.to_dict()
        return out

    @classmethod
    def from_dict(cls: type[_Report], data: dict[str, Any]) -> _Report:
        """The report of a :meth:`to_dict` (e.g. a run's ``report.json``); unknown keys ignored.

        A metric declared after the file was written (absent from ``data``) keeps its default.

        Example:
            >>> import torch
            >>> from rankwise.metrics import RetrievalReport, retrieval_metrics
            >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
            >>> report = retrieval_metrics(emb, torch.tensor([0, 0, 1, 1]), ks=(1, 2))
            >>> RetrievalReport.from_dict(report.to_dict()).to_dict() == report.to_dict()
            True
        """
        values = {
            f.attribute: f.from_json(data[f.attribute]) for f in cls.FIELDS if f.attribute in data
        }
        values["per_query_ap"] = torch.tensor(
            [math.nan if v is None else float(v) for v in data["per_query_ap"]], dtype=torch.float64
        )
        values["ks"] = tuple(int(k) for k in data["ks"])
        values["clamped_ks"] = {int(k): int(v) for k, v in (data.get("clamped_ks") or {}).items()}
        if data.get("verification") is not None:
            values["verification"] = VerificationReport.from_dict(data["verification"])
        names = {f.name for f in fields(cls)}
        rest = {k: v for k, v in data.items() if k in names and k not in values}
        return cls(**rest, **values)

    def scalars(self) -> dict[str, float]:
        """Every metric as a flat ``{name: value}``: ``map``, ``recall@k``, ``map_at_r``, ...

        The names a monitor (model selection, early stopping) is chosen by.

        Example:
            >>> import torch
            >>> from rankwise.metrics import retrieval_metrics
            >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
            >>> list(retrieval_metrics(emb, torch.tensor([0, 0, 1, 1]), ks=(1,)).scalars())[:3]
            ['map', 'recall@1', 'precision@1']
        """
        out = {
            name: float(value)
            for f in self.FIELDS
            for name, value in f.named(getattr(self, f.attribute), f.scalar)
        }
        if self.verification is not None:
            out.update(self.verification.scalars())
        return out

    def rows(self) -> list[tuple[str, float]]:
        """The ``(printed name, value)`` rows of the report's table, in :attr:`FIELDS` order.

        The names of ``rankwise evaluate`` / ``rankwise train`` (mAP, not MAP, which reads as
        MAP@R's abbreviation; recall@k, not R@k).
        """
        rows = [
            (name, float(value))
            for f in self.FIELDS
            for name, value in f.named(getattr(self, f.attribute), f.label)
        ]
        if self.verification is not None:
            rows += self.verification.rows()
        return rows

    def _title(self) -> str:
        return (
            f"Retrieval ({self.similarity} similarity, ties={self.ties}): "
            f"{self.n_queries} queries x {self.n_gallery} gallery items"
        )

    def __str__(self) -> str:
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        lines = [self._title()]
        lines += [f"  {name:<{width}}  {value:.4f}" for name, value in rows]
        evaluated = self.n_queries - self.n_queries_without_relevant
        if self.n_queries_without_relevant:
            lines.append(
                f"  {self.n_queries_without_relevant} queries without any relevant gallery item "
                f"were excluded; the means are over {evaluated} queries."
            )
        for k, used in self.clamped_ks.items():
            lines.append(
                f"  k={k} exceeds the {used} ranked items; recall@{k}, precision@{k} and "
                f"NDCG@{k} were evaluated at k={used}."
            )
        return "\n".join(lines)


@dataclass
class PRCurve:
    """Mean interpolated precision-recall curve.

    Attributes:
        recall: (num_points,) float64, recall levels linspace(0, 1, num_points).
        precision: (num_points,) float64, mean over queries of max precision at recall >= level.
        n_queries: queries averaged (those with at least one relevant item).
        n_queries_without_relevant: queries excluded for lack of a relevant item.
        per_query_precision: ``(n_queries, num_points)`` float64 interpolated precision of each
            averaged query, in query order, when asked for (``keep_per_query=True``): what
            :func:`~rankwise.metrics.merge_pr_curves` needs to merge query blocks exactly.
    """

    recall: np.ndarray
    precision: np.ndarray
    n_queries: int
    n_queries_without_relevant: int = 0
    per_query_precision: np.ndarray | None = field(default=None, repr=False, compare=False)


def mean_precision_rows(rows: np.ndarray, total: np.ndarray | None = None) -> np.ndarray:
    """``total`` plus the rows of ``rows`` added one after the other, in order.

    A running sum in query order, so the curve does not depend on where chunks or query blocks
    split the queries (a cumulative sum is sequential by definition).
    """
    start = np.zeros((1, rows.shape[1])) if total is None else total[None, :]
    return np.cumsum(np.concatenate([start, rows]), axis=0)[-1]


@dataclass
class _Prepared:
    qg: QueryGallery
    self_index: torch.Tensor | None
    backend: str
    chunk_size: int | None  # None: planned per backend
    n_query: int
    n_gallery: int
    n_ranked: int  # items in each ranked list (gallery minus the excluded row, if any)
    scorer: BlockScorer
    classes: _ClassIndex | None = None  # class id labels

    @property
    def similarity(self) -> str:
        return self.qg.similarity

    @property
    def query_labels(self) -> torch.Tensor:
        return self.qg.query_labels

    @property
    def gallery_labels(self) -> torch.Tensor:
        return self.qg.gallery_labels

    def list_length(self) -> np.ndarray:
        """(n_q,) int64 items ranked for each query (an excluded row is not ranked)."""
        out = np.full(self.n_query, self.n_gallery, dtype=np.int64)
        if self.self_index is not None:
            out -= (self.self_index >= 0).cpu().numpy()
        return out


@dataclass
class _ClassIndex:
    """Gallery rows grouped by class, so a query's relevant items are listed without a mask."""

    query_class: np.ndarray  # (n_q,) int64 compact class of each query, -1 if not in the gallery
    class_ptr: np.ndarray  # (C + 1,) int64, class c's rows are members[class_ptr[c]:class_ptr[c+1]]
    members: np.ndarray  # (n_g,) int64 gallery rows sorted by class (increasing within a class)
    gallery_class: np.ndarray  # (n_g,) int64 compact class of each gallery row

    @staticmethod
    def build(query_labels: torch.Tensor, gallery_labels: torch.Tensor) -> _ClassIndex:
        """Index the gallery rows of every class and the class of every query."""
        gl = gallery_labels.cpu().numpy()
        ql = query_labels.cpu().numpy()
        classes, g_class = np.unique(gl, return_inverse=True)
        members = np.argsort(g_class, kind="stable").astype(np.int64)
        class_ptr = np.zeros(classes.shape[0] + 1, dtype=np.int64)
        np.cumsum(np.bincount(g_class, minlength=classes.shape[0]), out=class_ptr[1:])
        pos = np.minimum(np.searchsorted(classes, ql), classes.shape[0] - 1)
        query_class = np.where(classes[pos] == ql, pos, -1).astype(np.int64)
        return _ClassIndex(query_class, class_ptr, members, g_class.astype(np.int64))

    def relevant_counts(self, self_index: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(n_q,) relevant gallery items of each query, and whether its excluded row is one."""
        sizes = np.diff(self.class_ptr)
        present = self.query_class >= 0
        counts = np.where(present, sizes[np.maximum(self.query_class, 0)], 0)
        self_relevant = np.zeros(counts.shape[0], dtype=bool)
        if self_index is not None:
            has = self_index >= 0
            own = self.gallery_class[np.maximum(self_index, 0)]
            self_relevant = has & present & (own == self.query_class)
        return counts - self_relevant, self_relevant

    def mean_relevant(self) -> float:
        """Mean number of gallery items of each query's class."""
        sizes = np.diff(self.class_ptr)
        counts = np.where(self.query_class >= 0, sizes[self.query_class], 0)
        return float(counts.mean()) if counts.size else 0.0

    def relevant_lists(self, lo: int, hi: int, self_index: np.ndarray | None):
        """(rel_ptr, rel_cols) of queries lo..hi-1: their class's gallery rows, self removed."""
        return relevant_lists_from_classes(
            self.query_class[lo:hi], self.class_ptr, self.members, self_index
        )


def check_self_index(
    exclude_self: Any, n_queries: int, n_gallery: int, device: torch.device, rows: str
) -> torch.Tensor:
    """An ``exclude_self`` index array as (n_queries,) int64 gallery rows (-1: none), checked.

    ``rows`` names in the message what the array holds ("gallery row of each of the 5 queries").
    """
    idx = as_tensor(exclude_self, "exclude_self", device)
    if (
        idx.ndim != 1
        or idx.shape[0] != n_queries
        or idx.is_floating_point()
        or idx.dtype == torch.bool
    ):
        raise ValueError(
            f"`exclude_self` must be None, a bool, or a 1-D integer array with the {rows} "
            "(-1 for none)."
        )
    idx = idx.to(torch.int64)
    if bool(((idx < -1) | (idx >= n_gallery)).any()):
        raise ValueError(f"`exclude_self` indices must lie in [-1, {n_gallery - 1}].")
    return idx


def _self_index(exclude_self: Any, qg: QueryGallery) -> tuple[torch.Tensor | None, int]:
    """Gallery row excluded from each query's list (or None) and the list length."""
    n_q, n_g = qg.query.shape[0], qg.gallery.shape[0]
    if exclude_self is None:
        exclude_self = qg.leave_one_out
    self_index = None
    if isinstance(exclude_self, (bool, np.bool_)):
        if exclude_self:
            if n_g != n_q:
                raise ValueError(
                    f"`exclude_self=True` needs the query rows to be the gallery rows, but "
                    f"`query` has {n_q} rows and `gallery` {n_g}; pass an index "
                    "array (gallery row of each query, -1 for none) instead."
                )
            self_index = torch.arange(n_q, device=qg.device)
    else:
        rows = f"gallery row of each of the {n_q} queries"
        self_index = check_self_index(exclude_self, n_q, n_g, qg.device, rows)
    n_ranked = n_g - (1 if self_index is not None and bool((self_index >= 0).any()) else 0)
    if n_ranked < 1:
        raise ValueError(
            "the gallery is empty once each query's own row is excluded; pass a `gallery` with at "
            "least one other item."
        )
    return self_index, n_ranked


def _prepare(
    query,
    query_labels,
    gallery,
    gallery_labels,
    similarity,
    exclude_self,
    chunk_size,
    device,
    backend,
) -> _Prepared:
    backend = check_choice(backend, "backend", ("auto", "numba", "torch"))
    qg = check_query_gallery(
        query, query_labels, gallery, gallery_labels, similarity=similarity, device=device
    )
    chunk_size = check_chunk_size(chunk_size)
    self_index, n_ranked = _self_index(exclude_self, qg)
    if backend == "auto":
        backend = "numba" if qg.device.type == "cpu" else "torch"
    classes = None
    if not qg.multi_hot:
        classes = _ClassIndex.build(qg.query_labels, qg.gallery_labels)
    # with many relevant items per query a float64 approximation leaves far fewer pairs to
    # recompute by exact key than a float32 one; the torch path always takes it (its near-tied
    # pairs need a second pass)
    scorer = BlockScorer(
        qg.query,
        qg.gallery,
        qg.similarity,
        approximate=True,
        float64_approximation=backend == "torch"
        or (classes is not None and classes.mean_relevant() > _FLOAT64_APPROXIMATION_RELEVANT),
    )
    n_q, n_g = qg.query.shape[0], qg.gallery.shape[0]
    if chunk_size is None and backend == "numba":
        chunk_size = max(1, min(n_q, _CHUNK_BYTES // max(n_g * scorer.bytes_per_score, 1)))
    return _Prepared(qg, self_index, backend, chunk_size, n_q, n_g, n_ranked, scorer, classes)


def _multi_hot_relevant_counts(
    p: _Prepared, self_index: torch.Tensor | None
) -> tuple[np.ndarray, np.ndarray]:
    """Relevant counts of multi-hot queries (device pass, one read-back) and self relevance."""
    ql = p.query_labels.to(torch.float32)
    gl_t = p.gallery_labels.to(torch.float32).T.contiguous()
    counts = torch.empty(p.n_query, dtype=torch.int64, device=ql.device)
    rows = max(1, _CHUNK_BYTES // max(p.n_gallery * 8, 1))
    for lo in range(0, p.n_query, rows):
        counts[lo : lo + rows] = ((ql[lo : lo + rows] @ gl_t) > 0).sum(1)
    own = torch.zeros(p.n_query, dtype=torch.bool, device=ql.device)
    if self_index is not None:
        shared = (ql * gl_t.T[self_index.clamp_min(0)]).sum(1) > 0
        own = (self_index >= 0) & shared
    both = torch.stack([counts, own.to(torch.int64)]).cpu().numpy()
    return both[0] - both[1], both[1].astype(bool)


def _device_problem(p: _Prepared, ks: tuple[int, ...]) -> _device.DeviceProblem:
    """The per-call device tensors of the chunk loop (one read-back at most, before the loop)."""
    ops = p.scorer.loop_operands()
    device = ops.query.device
    si = p.self_index
    if p.classes is not None:
        si_host = None if si is None else si.cpu().numpy()
        n_rel, self_rel = p.classes.relevant_counts(si_host)
        query_labels = torch.from_numpy(p.classes.query_class.astype(np.int32))[:, None]
        gallery_labels = torch.from_numpy(p.classes.gallery_class.astype(np.int32))
    else:
        n_rel, self_rel = _multi_hot_relevant_counts(p, si)
        query_labels = p.query_labels.to(torch.float32)
        gallery_labels = p.gallery_labels.to(torch.float32).T.contiguous()
    list_length = p.list_length()
    cut = np.stack([list_length, n_rel] + [np.minimum(k, list_length) for k in ks])
    self_column = self_fill = None
    if si is not None:
        self_column = si.clamp_min(0)[:, None]
        inf = torch.tensor(float("inf"), dtype=ops.dtype, device=device)
        self_fill = torch.where(si >= 0, -inf, inf)[:, None]

    def on_device(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

    gallery_rows = self_row = None
    if not ops.exact:  # windows: copies of one row tie without exact keys
        gallery_rows = _device.gallery_row_copies(p.scorer.exact.gallery)
        if si is not None:
            self_row = torch.where(si >= 0, gallery_rows[si.clamp_min(0), 1], -1)[:, None]

    return _device.DeviceProblem(
        operands=ops,
        n_gallery=p.n_gallery,
        gallery_labels=gallery_labels.to(device),
        query_labels=query_labels.to(device),
        self_column=self_column,
        self_fill=self_fill,
        offset=on_device(self_rel[:, None], torch.int32),
        n_relevant_column=on_device(n_rel[:, None], torch.int32),
        relevant_total=on_device((n_rel + self_rel)[:, None], torch.int64),
        cut=on_device(cut[:, None, :], torch.float64),
        n_relevant=n_rel.astype(np.int64),
        gallery_rows=gallery_rows,
        self_row=self_row,
    )


def _pair_keys(p: _Prepared):
    """Callable giving the exact-key operands of the near-tie pass (built on first use)."""
    ops = p.scorer.exact
    return lambda: (ops.code, *ops.transposed_operands())


def _device_table(p: _Prepared) -> torch.Tensor:
    return harmonic_table_tensor(p.n_gallery, p.qg.device)


def _torch_per_query(p: _Prepared, ks: tuple[int, ...], ties: str):
    """Per-query metrics of the device loop (see rankwise.metrics._device)."""
    prob = _device_problem(p, ks)
    budget = _device.memory_budget(p.qg.device)
    discounts = discount_table_tensor(p.n_gallery, p.qg.device)  # every position, as the table
    result = _device.run_metrics(
        prob, ties, _device_table(p), p.chunk_size, budget, _pair_keys(p), discounts
    )
    values = result.values
    n_sums = len(ks) + 3
    start, end, e_start, e_end = values[n_sums + len(ks) : n_sums + len(ks) + 4].astype(np.int64)
    top = np.stack([p.n_gallery - end, end - start, e_end - e_start])
    list_length = p.list_length()
    out = metrics_from_sums(
        values[:2], values[2:n_sums], prob.n_relevant, top, ks, list_length, ties
    )
    dcg = values[n_sums : n_sums + len(ks)]
    out.update(rank_metrics_from_sums(dcg, prob.n_relevant, top, ks, list_length, ties))
    return out


def _numba_per_query(p: _Prepared, ks: tuple[int, ...], ties: str):
    """Per-query metrics chunk by chunk from the numba counts (closed forms on the host)."""
    per_query = {name: np.full(p.n_query, np.nan) for name in RetrievalReport.per_query_keys(ks)}
    list_length = p.list_length()
    for lo, hi, counts in _iterate_counts(p):
        for name, values in query_metrics_from_counts(counts, ties, ks, list_length[lo:hi]).items():
            per_query[name][lo:hi] = values
    return per_query


def _block_counts(p: _Prepared, lo: int, hi: int) -> RelevantGroupCounts:
    """Tie-group counts of the exact keys of query rows lo..hi-1 (numba kernel, host)."""
    block = p.scorer.block(lo, hi)
    self_index = None if p.self_index is None else p.self_index[lo:hi]
    si = None if self_index is None else self_index.cpu().numpy()
    if p.classes is not None:
        rel_ptr, rel_cols = p.classes.relevant_lists(lo, hi, si)
    else:
        rel_ptr, rel_cols = relevant_lists_from_mask(
            block_relevance(p.query_labels[lo:hi], p.gallery_labels).cpu().numpy(), si
        )
    return relevant_group_counts_from_lists(
        block.values.cpu().numpy(),
        rel_ptr,
        rel_cols,
        si,
        bound=block.bound,
        exact_keys=lambda rows, cols: p.scorer.pair_keys(rows + lo, cols),
    )


def _iterate_counts(p: _Prepared) -> Iterator[tuple[int, int, RelevantGroupCounts]]:
    """Yield (first row, last row + 1, group counts) for each chunk of queries (numba path)."""
    assert p.chunk_size is not None
    for lo in range(0, p.n_query, p.chunk_size):
        hi = min(p.n_query, lo + p.chunk_size)
        yield lo, hi, _block_counts(p, lo, hi)


@query_blocks
@keeps_torch_threads
def retrieval_metrics(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    ks: Any = (1, 10, 100),
    similarity: str = "cosine",
    ties: str = "expected",
    exclude_self: Any = None,
    chunk_size: int | None = None,
    device: Any = None,
    backend: str = "auto",
) -> RetrievalReport:
    """Exact (tie-aware) retrieval metrics of embeddings, memory-bounded and linear per query.

    Args:
        query: (n_q, d) float embeddings (fp16 / bf16 / integer codes accepted).
        query_labels: (n_q,) integer class ids or (n_q, C) multi-hot 0/1 matrix; an item is
            relevant to a query when the class is the same / at least one label is shared.
        gallery: (n_g, d) embeddings, or None to rank the queries against each other with each
            query's own row excluded (leave-one-out, the SOP / CUB protocol).
        gallery_labels: labels of the gallery, same kind as ``query_labels``.
        ks: cutoffs of recall@k and precision@k; cutoffs above the list length are clamped.
        similarity: ``"cosine"``, ``"dot"`` or ``"euclidean"`` (ranked by increasing distance).
        ties: ``"expected"`` (mean over all orderings of tied items), ``"optimistic"`` or
            ``"pessimistic"``.
        exclude_self: None (= True iff ``gallery`` is None), a bool (True: query i is gallery row
            i), or a (n_q,) integer array with the gallery row of each query (-1 for none).
        chunk_size: queries per chunk; default: near 256 MB of scores per chunk (numba), or
            planned from the device's free memory (torch; docs/metrics.md).
        device: where the scores are computed; default the query's device.
        backend: ``"auto"`` (numba on the CPU, torch elsewhere), ``"numba"`` or ``"torch"``.

    Raises:
        ValueError: bad input (naming the argument), or no query has a relevant gallery item.

    Example:
        >>> import torch
        >>> from rankwise.metrics import retrieval_metrics
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> report = retrieval_metrics(emb, torch.tensor([0, 0, 1, 1]), ks=(1, 2))  # leave-one-out
        >>> report.per_query_ap.tolist(), report.map, report.recall_at[1]
        ([1.0, 1.0, 1.0, 0.5], 0.875, 0.75)
    """
    check_ties(ties)
    ks = check_ks(ks)
    p = _prepare(
        query,
        query_labels,
        gallery,
        gallery_labels,
        similarity,
        exclude_self,
        chunk_size,
        device,
        backend,
    )
    if p.backend == "torch":
        per_query = _torch_per_query(p, ks, ties)
    else:
        per_query = _numba_per_query(p, ks, ties)
    clamped = {k: min(k, p.n_ranked) for k in ks if k > p.n_ranked}
    settings = {"n_gallery": p.n_gallery, "ties": ties, "similarity": p.similarity, "ks": ks}
    return RetrievalReport.from_per_query(per_query, settings, clamped)


def _recall_slots(n_rel: np.ndarray, num_points: int) -> np.ndarray:
    """(L, n) int64: per recall level, the 0-based index of the first item whose recall reaches it.

    ``max(ceil(level R / (L - 1)), 1) - 1`` (0 for queries with R = 0).
    """
    levels = np.arange(num_points, dtype=np.int64)[:, None]
    intervals = num_points - 1
    need = (levels * n_rel[None, :] + intervals - 1) // intervals
    return np.maximum(need, 1) - 1


def _numba_pr_curves(p: _Prepared, ties: str, num_points: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, n_q) per-query curves and (n_q,) relevant counts from the numba counts."""
    curves = np.zeros((num_points, p.n_query))
    n_rel = np.zeros(p.n_query, dtype=np.int64)
    for lo, hi, counts in _iterate_counts(p):
        rows = counts.row_ids()
        chunk_rel = np.bincount(rows, weights=counts.relevant, minlength=hi - lo).astype(np.int64)
        n_rel[lo:hi] = chunk_rel
        width = max(int(chunk_rel.max(initial=0)), 1)
        table = torch.zeros(3, width, hi - lo, dtype=torch.float64)
        table[1] = 1  # an empty slot: one item, no relevant one (never read)
        slot = torch.from_numpy(relevant_above(counts))
        values = np.stack([counts.greater, counts.size, counts.relevant]).astype(np.float64)
        table[:, slot, torch.from_numpy(np.array(rows))] = torch.from_numpy(values)
        curves[:, lo:hi] = _device.pr_terms(
            table[0],
            table[1],
            table[2],
            torch.arange(width)[:, None],
            torch.from_numpy(chunk_rel)[None],
            torch.from_numpy(_recall_slots(chunk_rel, num_points)),
            ties,
        ).numpy()
    return curves, n_rel


def _torch_pr_curves(p: _Prepared, ties: str, num_points: int) -> tuple[np.ndarray, np.ndarray]:
    """(L, n_q) per-query curves and (n_q,) relevant counts from the device loop."""
    prob = _device_problem(p, ())
    need = torch.from_numpy(_recall_slots(prob.n_relevant, num_points)).to(p.qg.device)
    prob = replace(prob, need=need)
    budget = _device.memory_budget(p.qg.device)
    result = _device.run_pr_curve(prob, ties, _device_table(p), p.chunk_size, budget, _pair_keys(p))
    return result.values, prob.n_relevant


@query_blocks
@keeps_torch_threads
def pr_curve(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    similarity: str = "cosine",
    ties: str = "expected",
    num_points: int = 101,
    exclude_self: Any = None,
    chunk_size: int | None = None,
    device: Any = None,
    backend: str = "auto",
    keep_per_query: bool = False,
) -> PRCurve:
    """Mean interpolated precision-recall curve over the queries (SOPRC paper, Fig. 2).

    For each query with R relevant items, the i-th relevant item (in rank order) has recall i / R
    and precision i / pos_i. Within a tie group spanning positions g+1..g+n that holds r relevant
    items, the j-th of them sits at pos = g + j (``"optimistic"``), g + n - r + j
    (``"pessimistic"``) or, for ``"expected"``, at its expected position g + j (n + 1) / (r + 1)
    under a random order of the tie (the mean of the j-th order statistic): precision is then taken
    at the expected position. The interpolated precision at recall level rho is the maximum
    precision over relevant items with recall >= rho; the curve is its mean over queries at
    ``linspace(0, 1, num_points)``, summed in query order (whatever the chunks).

    Args: as :func:`retrieval_metrics`; ``num_points`` >= 2 recall levels; ``keep_per_query``
    also returns each query's interpolated precision (``num_points`` floats per query), for an
    exact merge of query blocks (:func:`~rankwise.metrics.merge_pr_curves`).

    Example:
        >>> import torch
        >>> from rankwise.metrics import pr_curve
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> curve = pr_curve(emb, torch.tensor([0, 0, 1, 1]), num_points=3)
        >>> curve.recall.tolist(), curve.precision.tolist()
        ([0.0, 0.5, 1.0], [0.875, 0.875, 0.875])
    """
    check_ties(ties)
    if (
        isinstance(num_points, bool)
        or not isinstance(num_points, (int, np.integer))
        or num_points < 2
    ):
        raise ValueError(f"`num_points` must be an integer >= 2, got {num_points!r}.")
    p = _prepare(
        query,
        query_labels,
        gallery,
        gallery_labels,
        similarity,
        exclude_self,
        chunk_size,
        device,
        backend,
    )
    if p.backend == "torch":
        curves, n_rel = _torch_pr_curves(p, ties, num_points)
    else:
        curves, n_rel = _numba_pr_curves(p, ties, num_points)
    used = n_rel > 0
    n_used = int(used.sum())
    n_without = p.n_query - n_used
    if n_used == 0:
        raise ValueError(NO_RELEVANT_PR_MESSAGE)
    # the averaged queries' curves summed one after the other in query order: the same bits for
    # every backend and chunking, and for a merge of query blocks (merge_pr_curves)
    rows = np.ascontiguousarray(curves[:, used].T)
    total = mean_precision_rows(rows)
    per_query = rows if keep_per_query else None
    recall = np.linspace(0.0, 1.0, num_points)
    return PRCurve(recall, total / n_used, n_used, n_without, per_query)
