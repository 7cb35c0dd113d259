"""Exact retrieval metrics over query shards: per-shard reports merged, and the torch.distributed form.

The retrieval metrics of :mod:`rankwise.metrics.retrieval` (tie-aware AP of He et al., CVPR 2018,
Prop. 1; MAP@R and R-precision of Musgrave et al., ECCV 2020; the mean PR curve of Wen et al.,
NeurIPS 2022, Fig. 2) are means of per-query values that depend only on the query's scores against
the whole gallery. So shards of queries ranked against the full gallery merge
(:func:`merge_retrieval_reports`, :func:`merge_pr_curves`) into the single-process value: bit for
bit when the shard reports carry their per-query values (``RetrievalReport.per_query``,
``PRCurve.per_query_precision``, as :func:`~rankwise.metrics.retrieval_metrics` and
``pr_curve(..., keep_per_query=True)`` give them), else up to the rounding of a float64 mean.

Two torch.distributed forms: :func:`distributed_retrieval_metrics` / :func:`distributed_pr_curve`
take each rank's own shard and all-gather the gallery; :func:`sharded_metric` /
:func:`sharded_curve` take the whole (already gathered) split on every rank, as a data-parallel
trainer holds it, and rank only this rank's share of the queries with any ``metric_fn`` marked by
:func:`~rankwise.metrics.query_blocks` (the mergeable contract; docs/metrics.md, "Sharded
evaluation").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._distributed import all_gather_rows, is_distributed, rank_and_world_size
from .._validation import as_tensor, check_embeddings
from ..similarity import check_similarity
from . import retrieval
from ._blocks import supports_query_blocks
from ._inputs import check_device, check_gallery_pair, check_label_array, check_query_gallery
from .retrieval import (
    PRCurve,
    RetrievalReport,
    check_self_index,
    mean_precision_rows,
    pr_curve,
    retrieval_metrics,
    weighted_mean,
)
from .verification import (
    PairCounts,
    VerificationReport,
    check_fprs,
    pair_counts,
    pairs_description,
    positive_pair_keys,
    verification_metrics,
)

__all__ = [
    "distributed_pr_curve",
    "distributed_retrieval_metrics",
    "merge_pr_curves",
    "merge_retrieval_reports",
    "query_share",
    "sharded_curve",
    "sharded_metric",
    "sharded_verification",
]


def _n_evaluated(report: RetrievalReport) -> int:
    return report.n_queries - report.n_queries_without_relevant


def merge_retrieval_reports(reports: Sequence[RetrievalReport]) -> RetrievalReport:
    """The report of all queries from the reports of disjoint query shards (in query order).

    Each report must rank its shard of the queries against the same gallery with the same ``ks``,
    ``similarity`` and ``ties`` (and each query's own row excluded as in the single-process call). A
    shard in which no query has a relevant item is passed as a report whose ``per_query_ap`` is all
    NaN and ``n_queries_without_relevant == n_queries`` (its means are ignored).

    When every report carries its per-query values (``per_query``, as every rankwise metric
    gives them) and all are of one class, the merged report is built from the concatenated
    per-query values by the class's ``from_per_query``, exactly as the one call builds it: every
    field is bit for bit the single-process value (a
    :class:`~rankwise.metrics.HammingRetrievalReport` stays one). Otherwise the means are merged
    as query-weighted means of the shard means (float64 rounding).

    Args:
        reports: one :class:`~rankwise.metrics.RetrievalReport` per shard, in the order of the
            shards' queries.

    Returns:
        The merged report: ``per_query_ap`` concatenated; mAP the mean of the per-query APs with
        a relevant item (as :func:`~rankwise.metrics.retrieval_metrics` computes it); the other
        means from the per-query values, or weighted by the shards' numbers of evaluated
        queries; counts summed; a clamped cut-off at the smallest list length of any shard.

    Raises:
        ValueError: no report, reports of different settings, or no query with a relevant item.

    Example:
        >>> import numpy as np, torch
        >>> from rankwise.metrics import merge_retrieval_reports, retrieval_metrics
        >>> x = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> y = torch.tensor([0, 0, 1, 1])
        >>> rows = (np.arange(0, 2), np.arange(2, 4))  # two query shards, one gallery
        >>> shards = [retrieval_metrics(x[r], y[r], x, y, exclude_self=r) for r in rows]
        >>> merge_retrieval_reports(shards).map == retrieval_metrics(x, y).map
        True
    """
    reports = list(reports)
    if not reports:
        raise ValueError("`reports` is empty; pass the report of at least one query shard.")
    _check_same_setting(reports)
    ks = reports[0].ks
    clamped: dict[int, int] = {}
    for report in reports:
        for k, k_used in report.clamped_ks.items():
            clamped[k] = min(k_used, clamped.get(k, k_used))
    clamped = {k: clamped[k] for k in ks if k in clamped}
    verification = _merged_verification(reports)
    exact = _exact_merge(reports, clamped)
    if exact is not None:
        return exact.with_verification(verification)
    ap = torch.cat([r.per_query_ap.to(torch.float64).cpu() for r in reports]).numpy()
    valid = ~np.isnan(ap)
    if not valid.any():
        raise ValueError(retrieval.NO_RELEVANT_MESSAGE)
    used = [r for r in reports if _n_evaluated(r) > 0]
    weights = [_n_evaluated(r) for r in used]
    means = {
        f.attribute: f.combine([getattr(r, f.attribute) for r in used], weights, ks)
        for f in RetrievalReport.FIELDS
    }
    means["map"] = float(ap[valid].mean())  # exact from the per-query APs every report carries
    return RetrievalReport(
        **means,
        per_query_ap=torch.from_numpy(ap),
        n_queries=sum(r.n_queries for r in reports),
        n_queries_without_relevant=sum(r.n_queries_without_relevant for r in reports),
        n_gallery=reports[0].n_gallery,
        ties=reports[0].ties,
        similarity=reports[0].similarity,
        ks=ks,
        clamped_ks=clamped,
        verification=verification,
    )


def _merged_verification(reports: list[RetrievalReport]) -> VerificationReport | None:
    """The pair view of the merged report: the shards' pair counts added (exact), or None.

    ROC AUC and TPR at an FPR are pair-level, not means over queries: only the counts merge.
    """
    views = [r.verification for r in reports]
    if all(v is None for v in views):
        return None
    if any(v is None or v.counts is None for v in views):
        raise ValueError(
            "only some of `reports` carry their verification pair counts, so the merged ROC AUC "
            "would leave pairs out; count every shard against the same positive keys "
            "(rankwise.metrics.pair_counts with positive_keys=...), or drop the verification "
            "from every report (report.with_verification(None))."
        )
    present = [v for v in views if v is not None]
    fprs = present[0].fprs
    if any(v.fprs != fprs for v in present):
        raise ValueError(
            "`reports` carry verification metrics at different FPRs "
            f"({[list(v.fprs) for v in present]}); evaluate every shard with the same `fpr`."
        )
    counts = [v.counts for v in present if v.counts is not None]
    merged = functools.reduce(PairCounts.merge, counts)
    return merged.report(fprs, pairs=present[0].pairs)


def _check_same_setting(reports: list[RetrievalReport]) -> None:
    """Raise when the reports do not come from one evaluation setting."""
    for attribute in reports[0]._SETTINGS:
        values = [getattr(r, attribute, None) for r in reports]
        if any(v != values[0] for v in values[1:]):
            raise ValueError(
                f"`reports` must come from the same evaluation setting; their {attribute} differ "
                f"({values}). Rank every shard against the same gallery with the same arguments."
            )


def _exact_merge(reports: list[RetrievalReport], clamped: dict[int, int]) -> RetrievalReport | None:
    """The merge from the concatenated per-query values; None when a report lacks them."""
    kind = type(reports[0])
    arrays = [r.per_query_arrays() for r in reports]
    if any(type(r) is not kind for r in reports) or any(a is None for a in arrays):
        return None
    names = list(arrays[0] or {})
    if any(list(a or {}) != names for a in arrays):
        return None
    merged = {name: np.concatenate([(a or {})[name] for a in arrays]) for name in names}
    return kind.from_per_query(merged, reports[0].settings(), clamped)


def merge_pr_curves(curves: Sequence[PRCurve]) -> PRCurve:
    """The mean PR curve of all queries from the curves of disjoint query shards.

    Args:
        curves: one :class:`~rankwise.metrics.PRCurve` per shard (same recall levels), in the
            order of the shards' queries; a shard without a query with a relevant item has
            ``n_queries == 0``.

    Returns:
        The curve averaged over every shard's queries: bit for bit the single-process curve when
        every shard kept its per-query precision (``pr_curve(..., keep_per_query=True)``; the
        result keeps the concatenated rows), else weighted by ``n_queries`` (float64 rounding).

    Raises:
        ValueError: no curve, different recall levels, or no query with a relevant item.

    Example:
        >>> import numpy as np, torch
        >>> from rankwise.metrics import merge_pr_curves, pr_curve
        >>> x = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> y = torch.tensor([0, 0, 1, 1])
        >>> rows = (np.arange(0, 2), np.arange(2, 4))  # two query shards, one gallery
        >>> shards = [pr_curve(x[r], y[r], x, y, exclude_self=r) for r in rows]
        >>> merge_pr_curves(shards).precision[[0, 50, 100]].tolist()  # recall 0, 0.5, 1
        [0.875, 0.875, 0.875]
    """
    curves = list(curves)
    if not curves:
        raise ValueError("`curves` is empty; pass the curve of at least one query shard.")
    recall = np.asarray(curves[0].recall, dtype=np.float64)
    for curve in curves[1:]:
        if not np.array_equal(np.asarray(curve.recall, dtype=np.float64), recall):
            raise ValueError("`curves` have different recall levels; use the same num_points.")
    used = [c for c in curves if c.n_queries > 0]
    if not used:
        raise ValueError(retrieval.NO_RELEVANT_PR_MESSAGE)
    if all(
        c.per_query_precision is not None and c.per_query_precision.shape[0] == c.n_queries
        for c in curves
    ):
        rows = np.concatenate([np.asarray(c.per_query_precision) for c in curves])
        return PRCurve(
            recall,
            mean_precision_rows(rows) / rows.shape[0],
            int(rows.shape[0]),
            sum(c.n_queries_without_relevant for c in curves),
            rows,
        )
    weights = [c.n_queries for c in used]
    stacked = np.stack([np.asarray(c.precision, dtype=np.float64) for c in used])
    precision = np.array(
        [weighted_mean(list(stacked[:, j]), weights) for j in range(recall.shape[0])]
    )
    return PRCurve(
        recall, precision, sum(weights), sum(c.n_queries_without_relevant for c in curves)
    )


# -- torch.distributed ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Shard:
    query: torch.Tensor
    query_labels: torch.Tensor
    gallery: torch.Tensor
    gallery_labels: torch.Tensor
    exclude_self: Any  # as passed (None / bool / index array), resolved by `self_index`
    offset: int  # global row of this rank's first query
    n_total: int  # queries on all ranks

    def self_index(self) -> torch.Tensor | None:
        """The gallery row of each local query (-1: none), or None; may raise ValueError."""
        n_local, n_gallery = self.query.shape[0], self.gallery.shape[0]
        if self.exclude_self is None or self.exclude_self is False:
            return None
        if self.exclude_self is True:
            if self.n_total != n_gallery:
                raise ValueError(
                    f"`exclude_self=True` needs the query rows to be the gallery rows, but the "
                    f"shards hold {self.n_total} queries and {n_gallery} gallery rows; pass an "
                    "index array (global gallery row of each local query, -1 for none) instead."
                )
            return torch.arange(self.offset, self.offset + n_local, device=self.query.device)
        rows = f"global gallery row of each of this rank's {n_local} queries"
        return check_self_index(self.exclude_self, n_local, n_gallery, self.query.device, rows)


def _relevant_counts(
    query_labels: torch.Tensor, gallery_labels: torch.Tensor, self_index: torch.Tensor | None
) -> torch.Tensor:
    """Relevant gallery items of every query, its own row excluded: (n_q,) int64."""
    if query_labels.ndim == 1:
        classes, counts = torch.unique(gallery_labels, return_counts=True)
        pos = torch.searchsorted(classes, query_labels).clamp(max=classes.numel() - 1)
        found = classes[pos] == query_labels
        relevant = torch.where(found, counts[pos], 0)
    else:
        gallery_hot = gallery_labels.to(torch.float32)
        relevant = torch.cat(
            [
                ((rows.to(torch.float32) @ gallery_hot.T) > 0).sum(1)
                for rows in query_labels.split(4096)
            ]
        )
    if self_index is not None:
        own = self_index >= 0
        if query_labels.ndim == 1:
            same = gallery_labels[self_index.clamp(min=0)] == query_labels
        else:
            same = (gallery_labels[self_index.clamp(min=0)] & query_labels).any(1)
        relevant = relevant - (own & same).to(relevant.dtype)
    return relevant


def _check_local(
    query: Any, query_labels: Any, gallery: Any, gallery_labels: Any, similarity: Any, device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """This rank's arguments through the shared query/gallery check (empty shards allowed)."""
    q_rows = as_tensor(query, "query").shape[0] if query is not None else 0
    g_rows = 1 if gallery is None else as_tensor(gallery, "gallery").shape[0]
    if q_rows and g_rows:  # the one check every metric uses, with its messages
        qg = check_query_gallery(
            query, query_labels, gallery, gallery_labels, similarity=similarity, device=device
        )
        if qg.leave_one_out:
            return qg.query, qg.query_labels, None, None
        return qg.query, qg.query_labels, qg.gallery, qg.gallery_labels
    # an empty shard (a rank without queries, or without gallery rows): the same checks, per part
    check_similarity(similarity)
    dev = check_device(device, query)
    q = check_embeddings(query, "query", dev, allow_empty=True)
    ql = check_label_array(query_labels, q.shape[0], "query_labels", dev)
    check_gallery_pair(gallery, gallery_labels)
    if gallery is None:
        return q, ql, None, None
    g = check_embeddings(gallery, "gallery", dev, allow_empty=True)
    return q, ql, g, check_label_array(gallery_labels, g.shape[0], "gallery_labels", dev)


def _agree(error: Exception | None, group: Any) -> None:
    """Raise the same ``ValueError`` on every rank when the local check failed on any rank.

    Every rank must know before the first tensor collective, or the ranks that passed would wait
    in it for the one that raised.
    """
    _, world = rank_and_world_size(group)
    messages: list[Any] = [None] * world
    dist.all_gather_object(messages, None if error is None else str(error), group=group)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    if len(failed) == 1:
        rank, message = failed[0]
        raise ValueError(f"{message} (on rank {rank})") from error
    if len({m for _, m in failed}) == 1:
        where = "every rank" if len(failed) == world else f"ranks {[r for r, _ in failed]}"
        raise ValueError(f"{failed[0][1]} (on {where})") from error
    raise ValueError(
        "bad input on several ranks: " + "; ".join(f"rank {r}: {m}" for r, m in failed)
    ) from error


def _shard(
    query: Any,
    query_labels: Any,
    gallery: Any,
    gallery_labels: Any,
    gallery_sharded: bool,
    exclude_self: Any,
    group: Any,
    kwargs: dict[str, Any],
) -> _Shard:
    try:
        q, ql, g, gl = _check_local(
            query,
            query_labels,
            gallery,
            gallery_labels,
            kwargs.get("similarity", "cosine"),
            kwargs.get("device"),
        )
        error = None
    except ValueError as exc:
        error = exc
    _agree(error, group)
    full_q, sizes = all_gather_rows(q, group)
    rank, _ = rank_and_world_size(group)
    offset = sum(sizes[:rank])
    if g is None or gl is None:  # _check_local gives both or neither
        g, gl = full_q, all_gather_rows(ql, group)[0]
        exclude_self = True if exclude_self is None else exclude_self
    elif gallery_sharded:
        g, gl = all_gather_rows(g, group)[0], all_gather_rows(gl, group)[0]
    return _Shard(q, ql, g, gl, exclude_self, offset, sum(sizes))


def _merged(local: Any, group: Any) -> list[Any]:
    """All-gather each rank's result (or exception); raise on every rank when one failed."""
    _, world = rank_and_world_size(group)
    gathered: list[Any] = [None] * world
    payload = (
        ("error", f"{type(local).__name__}: {local}") if isinstance(local, Exception) else local
    )
    dist.all_gather_object(gathered, payload, group=group)
    if isinstance(local, Exception):
        raise local
    failed = [
        f"rank {r}: {item[1]}"
        for r, item in enumerate(gathered)
        if isinstance(item, tuple) and item and item[0] == "error"
    ]
    if failed:
        raise ValueError("the evaluation failed on other ranks: " + "; ".join(failed))
    return gathered


def _local_result(shard: _Shard, compute: Any) -> Any:
    """This rank's ``compute(shard, self_index)``, ``("empty", n_queries)`` or its error.

    An error is raised on every rank by :func:`_merged`, never here: the others would hang.
    """
    try:
        self_index = shard.self_index()
        if shard.query.shape[0] == 0:
            return ("empty", 0)
        relevant = _relevant_counts(shard.query_labels, shard.gallery_labels, self_index)
        if not bool((relevant > 0).any()):
            return ("empty", int(shard.query.shape[0]))
        return compute(shard, self_index)
    except Exception as exc:  # any failure: every rank must hear of it, or the others hang
        return exc


def _sharded_results(
    metric: Callable[..., Any],
    result_type: type,
    data: tuple[Any, Any, Any, Any],
    gallery_sharded: bool,
    exclude_self: Any,
    group: Any,
    kwargs: dict[str, Any],
) -> tuple[list[Any], Any]:
    """Every rank's result of ``metric`` on its shard (a collective), and the first real one.

    A rank without a relevant item contributes the placeholder of :func:`_local_result`, which the
    callers fill from the real result; no real result at all is a ``ValueError``.
    """
    shard = _shard(*data, gallery_sharded, exclude_self, group, kwargs)

    def compute(s: _Shard, self_index: torch.Tensor | None) -> Any:
        exclude_self = False if self_index is None else self_index
        return metric(
            s.query,
            s.query_labels,
            s.gallery,
            s.gallery_labels,
            exclude_self=exclude_self,
            **kwargs,
        )

    results = _merged(_local_result(shard, compute), group)
    present = [r for r in results if isinstance(r, result_type)]
    if not present:
        raise ValueError(retrieval.NO_RELEVANT_MESSAGE)
    return results, present[0]


def distributed_retrieval_metrics(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    gallery_sharded: bool = True,
    exclude_self: Any = None,
    group: Any = None,
    **kwargs: Any,
) -> RetrievalReport:
    """:func:`~rankwise.metrics.retrieval_metrics` of queries sharded across the ranks of a group.

    A collective: every rank of ``group`` calls it with its shard and gets the same report, equal
    to ``retrieval_metrics`` on the concatenation of the shards in rank order (see the module
    docstring for what is exact). Without an initialized multi-rank process group it is
    ``retrieval_metrics`` itself.

    Args:
        query: this rank's ``(n_rank, d)`` query embeddings (``n_rank`` may differ between
            ranks, and be 0).
        query_labels: their ``(n_rank,)`` class ids or ``(n_rank, C)`` multi-hot labels.
        gallery: ``None`` ranks the queries of all ranks against each other, each query's own
            row excluded (leave-one-out); or this rank's shard of the gallery
            (``gallery_sharded=True``), or the whole gallery, the same on every rank
            (``gallery_sharded=False``).
        gallery_labels: the gallery's labels, sharded like ``gallery``.
        gallery_sharded: whether ``gallery`` is a shard to all-gather.
        exclude_self: ``None`` (leave-one-out iff ``gallery`` is ``None``), a bool (``True``: the
            global query ``i`` is the global gallery row ``i``), or an ``(n_rank,)`` integer
            array with the global gallery row of each local query (``-1``: none).
        group: the process group (``None``: the default one).
        **kwargs: ``ks``, ``similarity``, ``ties``, ``chunk_size``, ``device``, ``backend`` as
            for :func:`~rankwise.metrics.retrieval_metrics`.

    Returns:
        The merged :class:`~rankwise.metrics.RetrievalReport` (on every rank).

    Raises:
        ValueError: bad input on any rank (the same error on every rank), or no query with a
            relevant item.

    Example:
        >>> import torch
        >>> from rankwise.metrics import distributed_retrieval_metrics
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> labels = torch.tensor([0, 0, 1, 1])
        >>> distributed_retrieval_metrics(emb, labels).map  # no process group: retrieval_metrics
        0.875
    """
    if not is_distributed(group):
        return retrieval_metrics(
            query, query_labels, gallery, gallery_labels, exclude_self=exclude_self, **kwargs
        )
    results, like = _sharded_results(
        retrieval_metrics,
        RetrievalReport,
        (query, query_labels, gallery, gallery_labels),
        gallery_sharded,
        exclude_self,
        group,
        kwargs,
    )
    filled = [r if isinstance(r, RetrievalReport) else _empty_report(like, r[1]) for r in results]
    return merge_retrieval_reports(filled)


def distributed_pr_curve(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    gallery_sharded: bool = True,
    exclude_self: Any = None,
    group: Any = None,
    **kwargs: Any,
) -> PRCurve:
    """:func:`~rankwise.metrics.pr_curve` of queries sharded across the ranks of a group.

    A collective with the arguments of :func:`distributed_retrieval_metrics`; ``kwargs`` are
    those of :func:`~rankwise.metrics.pr_curve` (``num_points``, ``similarity``, ``ties``, ...).

    Returns:
        The merged :class:`~rankwise.metrics.PRCurve` (on every rank).

    Example:
        >>> import torch
        >>> from rankwise.metrics import distributed_pr_curve
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> labels = torch.tensor([0, 0, 1, 1])
        >>> distributed_pr_curve(emb, labels, num_points=3).precision.tolist()  # no process group
        [0.875, 0.875, 0.875]
    """
    if not is_distributed(group):
        return pr_curve(
            query, query_labels, gallery, gallery_labels, exclude_self=exclude_self, **kwargs
        )
    keep = bool(kwargs.get("keep_per_query", False))
    results, like = _sharded_results(
        pr_curve,
        PRCurve,
        (query, query_labels, gallery, gallery_labels),
        gallery_sharded,
        exclude_self,
        group,
        {**kwargs, "keep_per_query": True},  # the rows that make the merge exact
    )
    filled = [r if isinstance(r, PRCurve) else _empty_curve(like, r[1]) for r in results]
    merged = merge_pr_curves(filled)
    return merged if keep else dataclasses.replace(merged, per_query_precision=None)


# -- the mergeable contract: every rank holds the whole split, ranks its share ---------------------


def _empty_report(like: RetrievalReport, n: int) -> RetrievalReport:
    """The report of ``n`` queries without a relevant item, shaped like ``like`` (for a merge)."""

    def nan() -> torch.Tensor:
        return torch.full((n,), math.nan, dtype=torch.float64)

    return dataclasses.replace(
        like,
        **{f.attribute: f.nan(like.ks) for f in like.FIELDS},
        per_query_ap=nan(),
        n_queries=n,
        n_queries_without_relevant=n,
        clamped_ks={},
        per_query={name: nan() for name in like.per_query},
        verification=None,
    )


def _empty_curve(like: PRCurve, n: int) -> PRCurve:
    """The curve of ``n`` queries without a relevant item, shaped like ``like``."""
    rows = None
    if like.per_query_precision is not None:
        rows = np.empty((0, like.recall.shape[0]), dtype=np.float64)
    return PRCurve(like.recall, np.zeros_like(like.precision), 0, n, rows)


def query_share(n_queries: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of the queries that ``rank`` ranks: contiguous, sizes within one.

    Args:
        n_queries: queries of the whole split.
        rank: this process's rank.
        world_size: number of ranks.

    Returns:
        ``(lo, hi)``; empty when there are fewer queries than ranks.

    Example:
        >>> from rankwise.metrics import query_share
        >>> [query_share(10, r, 3) for r in range(3)]
        [(0, 3), (3, 6), (6, 10)]
    """
    return n_queries * rank // world_size, n_queries * (rank + 1) // world_size


def _block_rows(exclude_self: Any, leave_one_out: bool, lo: int, hi: int, n_q: int, n_g: int):
    """``exclude_self`` of the block ``[lo, hi)``: gallery rows (int64 array) or ``False``."""
    if exclude_self is None:
        exclude_self = leave_one_out
    if isinstance(exclude_self, (bool, np.bool_)):
        if not exclude_self:
            return False
        if n_q != n_g:
            raise ValueError(
                f"`exclude_self=True` needs the query rows to be the gallery rows, but there are "
                f"{n_q} queries and {n_g} gallery rows; pass an index array (gallery row of each "
                "query, -1 for none) instead."
            )
        return np.arange(lo, hi, dtype=np.int64)
    index = check_self_index(
        exclude_self, n_q, n_g, torch.device("cpu"), "gallery row of each query"
    )
    return index[lo:hi].numpy()


def _any_relevant(query_labels: Any, gallery_labels: Any, rows: Any) -> bool:
    """Whether a query of the block has a relevant gallery item (its own row excluded).

    Labels the check cannot read (e.g. the features of a Euclidean affinity) count as relevant:
    the metric then decides (and raises if nothing is).
    """
    try:
        ql, gl = (
            torch.as_tensor(np.asarray(query_labels)),
            torch.as_tensor(np.asarray(gallery_labels)),
        )
        if ql.is_floating_point() and ql.ndim == 1:
            return True
        if ql.ndim == 2:
            ql, gl = ql != 0, gl != 0
        index = None if rows is False else torch.as_tensor(rows)
        return bool((_relevant_counts(ql, gl, index) > 0).any())
    except (TypeError, ValueError, RuntimeError, IndexError):
        return True


def _block_result(
    fn: Callable[..., Any],
    data: tuple[Any, Any, Any, Any],
    kwargs: dict[str, Any],
    share: tuple[int, int],
) -> Any:
    """This rank's block call, ``("empty", n)`` for a block without a relevant item, or its error."""
    query, query_labels, gallery, gallery_labels = data
    lo, hi = share
    try:
        kwargs = dict(kwargs)
        leave_one_out = gallery is None
        if leave_one_out:
            gallery, gallery_labels = query, query_labels
        rows = _block_rows(
            kwargs.pop("exclude_self", None), leave_one_out, lo, hi, len(query), len(gallery)
        )
        if hi == lo:
            return ("empty", 0)
        block_labels = query_labels[lo:hi]
        if not _any_relevant(block_labels, gallery_labels, rows):
            return ("empty", hi - lo)
        return fn(query[lo:hi], block_labels, gallery, gallery_labels, exclude_self=rows, **kwargs)
    except Exception as exc:  # every rank must hear of it, or the others wait in the gather
        return exc


_NOTED: set[str] = set()


def _note_unsharded(fn: Callable[..., Any], group: Any) -> None:
    """Say once per function (on rank 0) that an unmarked function ranks everything everywhere."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if name in _NOTED or rank_and_world_size(group)[0] != 0:
        return
    _NOTED.add(name)
    warnings.warn(
        f"{name} is not marked with rankwise.metrics.query_blocks, so every rank ranks all the "
        "queries (correct, no faster than one process). Mark a function that takes the block call "
        "(docs/metrics.md, 'Sharded evaluation') to rank each rank's share only.",
        UserWarning,
        stacklevel=3,
    )


def _sharded_call(
    fn: Callable[..., Any],
    data: tuple[Any, Any, Any, Any],
    kwargs: dict[str, Any],
    group: Any,
    result_type: type,
) -> tuple[list[Any], Any] | None:
    """Every rank's block result (a collective) and a real one; None: call ``fn`` unsharded."""
    if not is_distributed(group):
        return None
    if not supports_query_blocks(fn):
        _note_unsharded(fn, group)
        return None
    rank, world = rank_and_world_size(group)
    share = query_share(len(data[0]), rank, world)
    results = _merged(_block_result(fn, data, kwargs, share), group)
    present = [r for r in results if isinstance(r, result_type)]
    if not present:
        raise ValueError(retrieval.NO_RELEVANT_MESSAGE)
    return results, present[0]


def sharded_metric(
    metric_fn: Callable[..., RetrievalReport],
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    group: Any = None,
    **kwargs: Any,
) -> RetrievalReport:
    """``metric_fn(query, query_labels, gallery, gallery_labels, **kwargs)``, ranked in shares.

    A collective for a data-parallel evaluation: every rank of ``group`` passes the same whole
    split (the gathered embeddings a trainer's strategy gives) and gets the same report, equal
    field for field to the one-process call. Rank ``r`` ranks only the queries
    :func:`query_share` gives it, against the whole gallery, by the block call of
    :func:`~rankwise.metrics.query_blocks`::

        metric_fn(query[lo:hi], query_labels[lo:hi], gallery, gallery_labels,
                  exclude_self=rows, **kwargs)

    with ``gallery = query`` and ``rows = arange(lo, hi)`` for leave-one-out (``gallery=None``),
    ``rows = False`` for a separate gallery (or the block of an ``exclude_self`` index array);
    the reports are all-gathered and merged by :func:`merge_retrieval_reports`. A rank whose
    queries have no relevant item sends a placeholder; an error on any rank is raised on every
    rank. Without an initialized multi-rank group, or for a ``metric_fn`` not marked by
    ``query_blocks`` (a function written to the old signature), it is the plain call on every
    rank (the latter with a one-time ``UserWarning`` on rank 0).

    Args:
        metric_fn: e.g. :func:`~rankwise.metrics.retrieval_metrics`,
            :func:`~rankwise.metrics.hamming_retrieval_metrics`, a ``functools.partial`` of one,
            or any function marked by :func:`~rankwise.metrics.query_blocks`.
        query: ``(n_q, d)`` embeddings of the whole split (numpy or torch), the same on every rank.
        query_labels: their labels.
        gallery: ``(n_g, d)`` gallery embeddings, or ``None`` for leave-one-out.
        gallery_labels: the gallery's labels.
        group: the process group (``None``: the default one).
        **kwargs: passed to ``metric_fn`` (``ks``, ...); an ``exclude_self`` is taken as for
            :func:`~rankwise.metrics.retrieval_metrics` and given to each rank in its block.

    Returns:
        The merged report (on every rank).

    Raises:
        ValueError: bad input on any rank (on every rank), or no query with a relevant item.

    Example:
        >>> import torch
        >>> from rankwise.metrics import retrieval_metrics, sharded_metric
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> sharded_metric(retrieval_metrics, emb, torch.tensor([0, 0, 1, 1]), ks=(1,)).map
        0.875
    """
    data = (query, query_labels, gallery, gallery_labels)
    sharded = _sharded_call(metric_fn, data, kwargs, group, RetrievalReport)
    if sharded is None:
        return metric_fn(*data, **kwargs)
    results, like = sharded
    filled = [r if isinstance(r, RetrievalReport) else _empty_report(like, r[1]) for r in results]
    return merge_retrieval_reports(filled)


def sharded_curve(
    curve_fn: Callable[..., PRCurve],
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    group: Any = None,
    **kwargs: Any,
) -> PRCurve:
    """``curve_fn(query, query_labels, gallery, gallery_labels, **kwargs)``, ranked in shares.

    :func:`sharded_metric` for a mean PR curve: the block call adds ``keep_per_query=True``, and
    the curves are merged by :func:`merge_pr_curves`, equal to the one-process curve bit for bit
    (the per-query rows are dropped again unless ``keep_per_query=True`` was passed).

    Args:
        curve_fn: e.g. :func:`~rankwise.metrics.pr_curve` or a function marked by
            :func:`~rankwise.metrics.query_blocks` that takes ``keep_per_query``.
        query: as :func:`sharded_metric`.
        query_labels: as :func:`sharded_metric`.
        gallery: as :func:`sharded_metric`.
        gallery_labels: as :func:`sharded_metric`.
        group: as :func:`sharded_metric`.
        **kwargs: passed to ``curve_fn``.

    Returns:
        The merged :class:`~rankwise.metrics.PRCurve` (on every rank).

    Example:
        >>> import torch
        >>> from rankwise.metrics import pr_curve, sharded_curve
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> labels = torch.tensor([0, 0, 1, 1])
        >>> sharded_curve(pr_curve, emb, labels, num_points=3).precision.tolist()
        [0.875, 0.875, 0.875]
    """
    data = (query, query_labels, gallery, gallery_labels)
    keep = bool(kwargs.get("keep_per_query", False))
    block_kwargs = {**kwargs, "keep_per_query": True}
    sharded = _sharded_call(curve_fn, data, block_kwargs, group, PRCurve)
    if sharded is None:
        return curve_fn(*data, **kwargs)
    results, like = sharded
    merged = merge_pr_curves(
        [r if isinstance(r, PRCurve) else _empty_curve(like, r[1]) for r in results]
    )
    return merged if keep else dataclasses.replace(merged, per_query_precision=None)


def sharded_verification(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    *,
    fpr: Any = (),
    group: Any = None,
    **kwargs: Any,
) -> VerificationReport:
    """:func:`~rankwise.metrics.verification_metrics` of the whole split, counted in shares.

    A collective like :func:`sharded_metric`: every rank passes the same whole split and gets the
    same report, equal bit for bit to the one-process call. Each rank finds the keys of every
    positive pair (:func:`~rankwise.metrics.positive_pair_keys`, cheap: the relevant pairs
    only), counts the pairs of its :func:`query_share` of the queries against them
    (:func:`~rankwise.metrics.pair_counts`) and the integer counts are all-gathered and added:
    the pair counts merge, never per-shard AUCs. Without an initialized multi-rank group it is
    the plain call.

    Args:
        query: ``(n_q, d)`` embeddings of the whole split, the same on every rank.
        query_labels: their labels.
        gallery: ``(n_g, d)`` gallery embeddings, or ``None`` for leave-one-out.
        gallery_labels: the gallery's labels.
        fpr: the FPR budgets, each in (0, 1).
        group: the process group (``None``: the default one).
        **kwargs: ``similarity``, ``exclude_self``, ``chunk_size``, ``device`` as for
            :func:`~rankwise.metrics.verification_metrics`.

    Returns:
        The :class:`~rankwise.metrics.VerificationReport` (on every rank).

    Example:
        >>> import torch
        >>> from rankwise.metrics import sharded_verification
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> sharded_verification(emb, torch.tensor([0, 0, 1, 1]), fpr=[0.25]).roc_auc
        0.875
    """
    fprs = check_fprs(fpr)
    data = (query, query_labels, gallery, gallery_labels)
    if not is_distributed(group):
        return verification_metrics(*data, fpr=fprs, **kwargs)
    rank, world = rank_and_world_size(group)
    lo, hi = query_share(len(query), rank, world)
    exclude_self = kwargs.pop("exclude_self", None)
    leave_one_out = gallery is None

    def local() -> Any:
        try:
            keys = positive_pair_keys(*data, exclude_self=exclude_self, **kwargs)
            g, gl = (query, query_labels) if leave_one_out else (gallery, gallery_labels)
            rows = _block_rows(exclude_self, leave_one_out, lo, hi, len(query), len(g))
            if hi == lo:
                return None
            block = (query[lo:hi], query_labels[lo:hi], g, gl)
            return pair_counts(*block, exclude_self=rows, positive_keys=keys, **kwargs)
        except Exception as exc:  # every rank must hear of it, or the others wait in the gather
            return exc

    results = [r for r in _merged(local(), group) if isinstance(r, PairCounts)]
    if not results:
        raise ValueError("`query` is empty: there is no pair to count.")
    counts = functools.reduce(PairCounts.merge, results)
    excluded = exclude_self is not False and (leave_one_out or exclude_self is not None)
    return counts.report(fprs, pairs=pairs_description(leave_one_out, excluded))
