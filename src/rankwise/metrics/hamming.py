"""Tie-aware retrieval metrics of binary codes by counting sort: no ranking is ever sorted.

He, Cakir, Bargal & Sclaroff (CVPR 2018), Sec. 3.2 and Prop. 1: ranked by the integer Hamming
distance ``d ∈ {0, ..., b}``, a database splits into ``b + 1`` tie groups, and AP_T (Eq. 6,
per-position form of McSherry & Najork 2008) and DCG_T (Eq. 7) are sums of per-group terms that need
only the per-distance histograms ``n_{d,v}`` of the items of each affinity level ``v``. Per query
this module builds those histograms in one pass over the packed codes (XOR + popcount; the paper's
"counting sort", ``O(bN)``), then evaluates AP_T, AP_T@k (App. A, Eq. 15), MAP@R, R@k, P@k and
R-precision with the closed forms of :func:`rankwise.metrics.retrieval_metrics` (via
:class:`~rankwise.metrics._kernels.RelevantGroupCounts`), NDCG_T and NDCG_T@k (App. A, Eq. 18/19,
the ideal DCG from the per-level totals), and the **tie-breaking range** of the paper's Fig. 3: the
best and worst AP (and NDCG) attainable by reordering each query's ties (docs/hashing.md).

Affinities (Sec. 3.1, 5.2-5.3: labels, multi-hot, shared labels, Euclidean thresholds, callables)
are those of :mod:`rankwise._affinity`, shared with the binary-code losses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from numba import njit, prange

from .._affinity import (
    AFFINITIES,
    EuclideanThresholdAffinity,
    IndexedAffinity,
    check_affinity,
    features_array,
)
from .._packing import PackedCodes, as_packed_codes, check_same_bits, code_distance, popcount
from .._threads import keeps_torch_threads
from .._validation import Interval, as_tensor, check_labels, check_scalar
from ._blocks import query_blocks
from ._kernels import RelevantGroupCounts
from .ranking import average_precision_from_counts, check_ties, query_metrics_from_counts
from .retrieval import ReportField, RetrievalReport, check_self_index, with_fields

__all__ = [
    "AFFINITIES",
    "EuclideanThresholdAffinity",
    "HammingRetrievalReport",
    "IndexedAffinity",
    "hamming_histograms",
    "hamming_retrieval_metrics",
    "group_counts_from_histograms",
    "ndcg_from_histograms",
    "cumulative_discount",
]

# Working memory of one chunk of queries: its histograms and, for dense affinities, its
# (chunk, n_database) affinity block (one byte per pair).
_CHUNK_BYTES = 64 * 2**20


# -- histogram kernels -----------------------------------------------------------------------------


@njit(parallel=True, cache=True)
def _class_histograms(qw, dbw, q_class, db_class, self_index, out):  # pragma: no cover - numba
    n = dbw.shape[0]
    for i in prange(qw.shape[0]):
        c = q_class[i]
        skip = self_index[i]
        for j in range(n):
            if j == skip:
                continue
            d = code_distance(qw, i, dbw, j)
            if db_class[j] == c:
                out[i, d, 1] += 1
            else:
                out[i, d, 0] += 1


@njit(parallel=True, cache=True)
def _multi_hot_histograms(qw, dbw, q_lab, db_lab, max_level, self_index, out):  # pragma: no cover
    n = dbw.shape[0]
    for i in prange(qw.shape[0]):
        skip = self_index[i]
        for j in range(n):
            if j == skip:
                continue
            d = code_distance(qw, i, dbw, j)
            shared = 0
            for w in range(q_lab.shape[1]):
                shared += popcount(q_lab[i, w] & db_lab[j, w])  # type: ignore[call-arg]  # numba supplies typingctx
            out[i, d, min(shared, max_level)] += 1


@njit(parallel=True, cache=True)
def _dense_histograms(qw, dbw, levels, self_index, out):  # pragma: no cover - numba
    n = dbw.shape[0]
    for i in prange(qw.shape[0]):
        skip = self_index[i]
        for j in range(n):
            if j == skip:
                continue
            out[i, code_distance(qw, i, dbw, j), levels[i, j]] += 1


# -- counts -> metrics -----------------------------------------------------------------------------


def group_counts_from_histograms(total: np.ndarray, relevant: np.ndarray) -> RelevantGroupCounts:
    """Tie groups holding a relevant item, from per-distance counts.

    Args:
        total: ``(Q, b + 1)`` items at each distance ``n_d`` (ranked by increasing distance).
        relevant: ``(Q, b + 1)`` relevant items at each distance ``n_d^+``.

    Returns:
        :class:`RelevantGroupCounts` in the order of :mod:`rankwise.metrics._kernels`: per query,
        the groups with ``n_d^+ > 0`` by increasing distance (= decreasing score).
    """
    total = np.asarray(total, dtype=np.int64)
    relevant = np.asarray(relevant, dtype=np.int64)
    above = np.cumsum(total, axis=1) - total
    mask = relevant > 0
    return RelevantGroupCounts(
        n_groups=mask.sum(1).astype(np.int64),
        greater=above[mask],
        size=total[mask],
        relevant=relevant[mask],
    )


def cumulative_discount(n: int) -> np.ndarray:
    """``(n + 1,)`` float64: entry ``t`` is ``sum_{s=1}^{t} 1 / log2(s + 1)`` (entry 0 is 0)."""
    out = np.zeros(n + 1, dtype=np.float64)
    np.cumsum(1.0 / np.log2(np.arange(2, n + 2, dtype=np.float64)), out=out[1:])
    return out


def _span(cd: np.ndarray, lo: np.ndarray, hi: np.ndarray, k: int | None) -> np.ndarray:
    """Sum of the discounts of positions ``lo+1 .. hi``, truncated at ``k``."""
    if k is not None:
        lo, hi = np.minimum(lo, k), np.minimum(hi, k)
    return cd[hi] - cd[lo]


def _ordered_dcg(hist: np.ndarray, gains: np.ndarray, cd: np.ndarray, k, descending: bool):
    """DCG when every tie is ordered by gain (descending: best case; ascending: worst case)."""
    n = hist.sum(2)
    start = np.cumsum(n, axis=1) - n  # (Q, D) items above each group
    order = slice(None, None, -1) if descending else slice(None)
    h = hist[:, :, order]
    g = gains[order]
    within = np.cumsum(h, axis=2)  # items of the group up to and including this level
    hi = start[:, :, None] + within
    return (g * _span(cd, hi - h, hi, k)).sum(axis=(1, 2))


def ndcg_from_histograms(
    hist: np.ndarray,
    level_values: np.ndarray,
    k: int | None = None,
    ties: str = "expected",
    cd: np.ndarray | None = None,
) -> np.ndarray:
    """Tie-aware NDCG(@k) of every query from its per-distance, per-level histograms.

    Args:
        hist: ``(Q, b + 1, L)`` int, items at distance ``d`` with affinity level index ``l``.
        level_values: ``(L,)`` affinity value ``a`` of each level index (gain ``2^a - 1``).
        k: cutoff, or None for the whole ranking.
        ties: ``"expected"`` (App. A, Eq. 18: mean gain of a group times the discounts it spans),
            ``"optimistic"`` / ``"pessimistic"`` (higher / lower gains first within a tie).
        cd: :func:`cumulative_discount` table covering the list length (built when None).

    Returns:
        ``(Q,)`` float64; NaN where the ideal DCG is 0 (no item with a positive affinity).
    """
    hist = np.asarray(hist, dtype=np.int64)
    gains = np.exp2(np.asarray(level_values, dtype=np.float64)) - 1.0
    n = hist.sum(2)
    if cd is None:
        cd = cumulative_discount(int(n.sum(1).max()) if n.size else 0)
    totals = hist.sum(1)[:, ::-1]  # (Q, L) by decreasing level: the ideal order
    ideal_hi = np.cumsum(totals, axis=1)
    ideal = (gains[::-1] * _span(cd, ideal_hi - totals, ideal_hi, k)).sum(1)
    if ties == "expected":
        hi = np.cumsum(n, axis=1)
        gain_sum = hist @ gains
        mean_gain = np.divide(gain_sum, n, out=np.zeros(gain_sum.shape), where=n > 0)
        dcg = (mean_gain * _span(cd, hi - n, hi, k)).sum(1)
    else:
        dcg = _ordered_dcg(hist, gains, cd, k, descending=ties == "optimistic")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(ideal > 0, dcg / np.where(ideal > 0, ideal, 1.0), np.nan)


# -- inputs ----------------------------------------------------------------------------------------


@dataclass
class _Affinity:
    """How the histograms of a chunk of queries are built."""

    name: str
    level_values: np.ndarray  # (L,) affinity value of each level index
    kind: str  # "class" | "multi_hot" | "dense"
    query: Any = None
    database: Any = None
    func: Callable | None = None

    @property
    def n_levels(self) -> int:
        return int(self.level_values.shape[0])


def _label_array(labels: Any, n: int, name: str) -> np.ndarray:
    t = as_tensor(labels, name)
    if t.ndim not in (1, 2) or t.shape[0] != n:
        raise ValueError(
            f"`{name}` must be (n,) class ids or an (n, C) multi-hot matrix with one row per code "
            f"({n}), got shape {tuple(t.shape)}."
        )
    # the label rule of every metric and loss: int64 class ids, or bool multi-hot of 0/1 values
    return check_labels(t.detach(), n, name, device="cpu").numpy()


def _pack_labels(hot: np.ndarray) -> np.ndarray:
    n, c = hot.shape
    raw = np.packbits(hot, axis=1, bitorder="little")
    padded = np.zeros((n, -(-c // 64) * 8), dtype=np.uint8)
    padded[:, : raw.shape[1]] = raw
    return np.ascontiguousarray(padded.view("<u8").astype(np.uint64))


def _label_affinity(name: str, query_labels: Any, db_labels: Any, n_q: int, n_db: int) -> _Affinity:
    ql = _label_array(query_labels, n_q, "query_labels")
    dl = _label_array(db_labels, n_db, "database_labels")
    if ql.ndim != dl.ndim or (ql.ndim == 2 and ql.shape[1] != dl.shape[1]):
        raise ValueError(
            "`query_labels` and `database_labels` must be the same kind: both class ids or both "
            f"multi-hot with the same columns; got shapes {ql.shape} and {dl.shape}."
        )
    if ql.ndim == 1:
        return _Affinity(name, np.array([0, 1]), "class", ql, dl)
    max_level = 1 if name == "labels" else int(ql.shape[1])
    return _Affinity(
        name, np.arange(max_level + 1), "multi_hot", _pack_labels(ql), _pack_labels(dl)
    )


def _resolve_affinity(affinity: Any, query_labels, db_labels, n_q: int, n_db: int) -> _Affinity:
    affinity = check_affinity(affinity)
    if isinstance(affinity, str):
        return _label_affinity(affinity, query_labels, db_labels, n_q, n_db)
    if isinstance(affinity, EuclideanThresholdAffinity):
        q = features_array(query_labels, "query_labels")
        g = features_array(db_labels, "database_labels")
        if q.shape[0] != n_q or g.shape[0] != n_db:
            raise ValueError(
                "with a EuclideanThresholdAffinity the labels are the original features: pass "
                f"`query_labels` ({n_q}, F) and `database_labels` ({n_db}, F), got "
                f"{q.shape} and {g.shape}."
            )
        values = np.arange(affinity.max_level + 1)
        prepared = affinity.against(g)
        return _Affinity(
            "euclidean_thresholds", values, "dense", q, g, lambda query, _: prepared(query)
        )
    # a callable that states its largest level gets histograms of that many levels, not 256
    top = int(getattr(affinity, "max_level", 255))
    return _Affinity("callable", np.arange(top + 1), "dense", query_labels, db_labels, affinity)


def _dense_levels(aff: _Affinity, lo: int, hi: int) -> np.ndarray:
    query = aff.query[lo:hi]
    assert aff.func is not None  # every "dense" affinity has one
    levels = aff.func(query, aff.database)
    levels = np.asarray(levels.detach().cpu() if isinstance(levels, torch.Tensor) else levels)
    n_db = len(aff.database)
    if levels.shape != (hi - lo, n_db):
        raise ValueError(
            f"the affinity callable returned shape {levels.shape} for {hi - lo} queries and "
            f"{n_db} database items; it must return (n_queries, n_database)."
        )
    if levels.dtype.kind == "b":
        return levels.astype(np.uint8)
    if levels.dtype.kind == "f" and (
        not np.isfinite(levels).all() or not (levels == np.round(levels)).all()
    ):
        raise ValueError("the affinity callable must return integer affinities (no NaN).")
    top = aff.n_levels - 1
    if levels.size and (levels.min() < 0 or levels.max() > top):
        raise ValueError(
            f"affinities must be integers in [0, {top}] (gain 2^a - 1); got values in "
            f"[{levels.min():g}, {levels.max():g}]."
        )
    return np.ascontiguousarray(levels.astype(np.uint8))


def hamming_histograms(
    query: PackedCodes,
    database: PackedCodes,
    aff: _Affinity,
    lo: int,
    hi: int,
    self_index: np.ndarray,
) -> np.ndarray:
    """``(hi - lo, b + 1, L)`` int64 histograms of queries ``lo..hi-1`` (one pass, no sort).

    The kernels read both sets with the query's word size: a database packed in other words is
    repacked first (same bits), as reading it unconverted would index out of bounds.
    """
    if database.words.dtype != query.words.dtype:
        database = database.to(query.words.dtype)
    qw = query.words[lo:hi]
    dbw = database.words
    out = np.zeros((hi - lo, query.bits + 1, aff.n_levels), dtype=np.int64)
    skip = np.ascontiguousarray(self_index[lo:hi])
    if aff.kind == "class":
        _class_histograms(qw, dbw, aff.query[lo:hi], aff.database, skip, out)
    elif aff.kind == "multi_hot":
        max_level = aff.n_levels - 1
        _multi_hot_histograms(qw, dbw, aff.query[lo:hi], aff.database, max_level, skip, out)
    else:
        _dense_histograms(qw, dbw, _dense_levels(aff, lo, hi), skip, out)
    return out


# -- report ----------------------------------------------------------------------------------------


@dataclass
class HammingRetrievalReport(RetrievalReport):
    """:class:`~rankwise.metrics.RetrievalReport` of a Hamming ranking, with NDCG and tie ranges.

    The inherited fields (``map``, ``recall_at``, ``precision_at``, ``map_at_r``,
    ``r_precision``, ``per_query_ap``) use binary relevance (affinity > 0) and ``ties``;
    ``similarity`` is ``"hamming"``.

    Attributes:
        bits: code length.
        affinity: the affinity used (``"labels"``, ``"shared_labels"``,
            ``"euclidean_thresholds"`` or ``"callable"``).
        map_at: ``{k: mean AP_T@k}`` (App. A, Eq. 15: precision terms of positions ``<= k``
            summed over all ``N^+`` relevant items).
        ndcg: mean NDCG_T over the full ranking (gain ``2^a - 1`` of the affinity ``a``).
        ndcg_at: ``{k: mean NDCG_T@k}``.
        map_range: ``(worst, best)`` mAP attainable by reordering ties (the paper's Fig. 3).
        ndcg_range: ``(worst, best)`` mean NDCG attainable by reordering ties.
        per_query_ap_range: ``(n_queries, 2)`` float64 worst / best AP of each query.
        per_query_ndcg: ``(n_queries,)`` float64 NDCG (NaN without a relevant item).
    """

    _SETTINGS: ClassVar[tuple[str, ...]] = (*RetrievalReport._SETTINGS, "bits", "affinity")
    _NO_RELEVANT: ClassVar[str] = (
        "no query has a relevant database item (affinity > 0); the metrics are undefined. "
        "Check the labels / affinity, or pass a database that contains the query classes."
    )
    # AP_T@k after mAP; the graded NDCG (and NDCG@k, in place of the binary one) at the end
    FIELDS: ClassVar[tuple[ReportField, ...]] = with_fields(
        RetrievalReport.FIELDS,
        ("recall_at", ReportField("map_at", "ap@{k}", "AP@{k}", "map@{k}")),
        ("ndcg_at", ReportField("ndcg", "ndcg", "NDCG", "ndcg")),
        (None, ReportField("ndcg_at", "ndcg@{k}", "NDCG@{k}", "ndcg@{k}")),
    )

    bits: int = 0
    affinity: str = "labels"
    map_at: dict[int, float] = field(default_factory=dict)
    ndcg: float = math.nan
    ndcg_at: dict[int, float] = field(default_factory=dict)
    map_range: tuple[float, float] = (math.nan, math.nan)
    ndcg_range: tuple[float, float] = (math.nan, math.nan)
    per_query_ap_range: torch.Tensor | None = None
    per_query_ndcg: torch.Tensor | None = None

    @classmethod
    def _extra_from_per_query(cls, arrays: dict[str, np.ndarray], valid: np.ndarray) -> dict:
        """The tie ranges and per-query arrays of :meth:`from_per_query` (the means: FIELDS).

        ``arrays`` also hold ``"ap_best"``, ``"ap_worst"``, ``"ndcg_best"``, ``"ndcg_worst"``;
        ``clamped_ks`` is always empty here (a cut-off beyond the database is an error).
        """

        def mean(name: str) -> float:
            return float(arrays[name][valid].mean())

        return {
            "map_range": (mean("ap_worst"), mean("ap_best")),
            "ndcg_range": (mean("ndcg_worst"), mean("ndcg_best")),
            "per_query_ap_range": torch.from_numpy(
                np.stack([arrays["ap_worst"], arrays["ap_best"]], 1)
            ),
            "per_query_ndcg": torch.from_numpy(arrays["ndcg"]),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: per-query AP as a list (None for NaN), other per-query arrays left out."""
        out = super().to_dict()
        out.update(
            bits=self.bits,
            affinity=self.affinity,
            map_range=list(self.map_range),
            ndcg_range=list(self.ndcg_range),
        )
        return out

    def _title(self) -> str:
        return (
            f"Hamming retrieval ({self.bits} bits, affinity={self.affinity}, ties={self.ties}): "
            f"{self.n_queries} queries x {self.n_gallery} database items"
        )

    def __str__(self) -> str:
        lines = super().__str__().splitlines()
        lines.insert(
            1 + len(self.rows()),
            f"  tie-breaking range: mAP in [{self.map_range[0]:.4f}, {self.map_range[1]:.4f}], "
            f"NDCG in [{self.ndcg_range[0]:.4f}, {self.ndcg_range[1]:.4f}]",
        )
        return "\n".join(lines)


# -- the entry point -------------------------------------------------------------------------------


def _check_ks(ks: Any, n_ranked: int) -> tuple[int, ...]:
    if isinstance(ks, (int, np.integer)) and not isinstance(ks, bool):
        ks = (ks,)
    try:
        ks = tuple(ks)
    except TypeError:
        raise ValueError(f"`ks` must be a sequence of positive integers, got {ks!r}.") from None
    out = []
    for k in ks:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"`ks` must hold positive integers, got {k!r} in {ks!r}.")
        if k > n_ranked:
            raise ValueError(
                f"`ks` holds k={int(k)} but each query ranks only {n_ranked} database items; "
                f"pass cutoffs <= {n_ranked}."
            )
        out.append(int(k))
    return tuple(dict.fromkeys(out))


@dataclass
class _Accumulator:
    """Per-query results, filled chunk by chunk (an array per name, NaN until written)."""

    n: int
    ks: tuple[int, ...]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)

    def put(self, name: str, lo: int, values: np.ndarray) -> None:
        if name not in self.arrays:
            self.arrays[name] = np.full(self.n, np.nan)
        self.arrays[name][lo : lo + values.shape[0]] = values


def _ap_metrics(acc: _Accumulator, lo: int, counts: RelevantGroupCounts, ties: str, n_ranked: int):
    """AP_T, its tie range, AP_T@k, MAP@R, R-precision, R@k and P@k of a chunk."""
    list_length = np.full(counts.n_rows, n_ranked, dtype=np.int64)
    metrics = query_metrics_from_counts(counts, ties, acc.ks, list_length, ap_at_k=True)
    for name, values in metrics.items():
        acc.put(name, lo, values)
    acc.put("ap_best", lo, average_precision_from_counts(counts, "optimistic"))
    acc.put("ap_worst", lo, average_precision_from_counts(counts, "pessimistic"))


def _ndcg_metrics(acc: _Accumulator, lo: int, hist: np.ndarray, values, ties: str, cd) -> None:
    acc.put("ndcg", lo, ndcg_from_histograms(hist, values, None, ties, cd))
    acc.put("ndcg_best", lo, ndcg_from_histograms(hist, values, None, "optimistic", cd))
    acc.put("ndcg_worst", lo, ndcg_from_histograms(hist, values, None, "pessimistic", cd))
    for k in acc.ks:
        acc.put(f"ndcg@{k}", lo, ndcg_from_histograms(hist, values, k, ties, cd))


def _chunks(
    n_q: int, n_db: int, bits: int, aff: _Affinity, chunk_size: int | None
) -> Iterator[tuple[int, int]]:
    if chunk_size is None:
        # histograms (and their reductions), plus a dense affinity block: one byte per pair, and
        # for Euclidean thresholds the float64 distances, their rounding slack and temporaries
        per_query = (bits + 1) * aff.n_levels * 8 * 6
        if aff.kind == "dense":
            per_query += n_db * (50 if aff.name == "euclidean_thresholds" else 1)
        chunk_size = max(1, _CHUNK_BYTES // per_query)
    else:
        chunk_size = check_scalar(chunk_size, "chunk_size", Interval("integer", 1, None))
    for lo in range(0, n_q, chunk_size):
        yield lo, min(n_q, lo + chunk_size)


def _self_index(exclude_self: Any, leave_one_out: bool, n_q: int, n_db: int) -> np.ndarray:
    """The database row of each query left out of its ranking (-1: none), every query alike."""
    if exclude_self is None:
        exclude_self = leave_one_out
    if isinstance(exclude_self, (bool, np.bool_)):
        if exclude_self and n_q != n_db:
            raise ValueError(
                f"`exclude_self=True` needs the query codes to be the database codes, but there "
                f"are {n_q} queries and {n_db} database codes; pass an index array instead."
            )
        return np.arange(n_q, dtype=np.int64) if exclude_self else np.full(n_q, -1, dtype=np.int64)
    rows = f"database row of each of the {n_q} queries"
    index = check_self_index(exclude_self, n_q, n_db, torch.device("cpu"), rows).numpy()
    if n_q and (index >= 0).any() and not (index >= 0).all():
        raise ValueError(
            "`exclude_self` must leave out a row of every query or of none (all indices >= 0 or "
            "all -1): the Hamming metrics rank lists of one length."
        )
    return index


@query_blocks
@keeps_torch_threads
def hamming_retrieval_metrics(
    query_codes: Any,
    query_labels: Any,
    database_codes: Any = None,
    database_labels: Any = None,
    *,
    ks: Any = None,
    affinity: Any = "labels",
    ties: str = "expected",
    bits: int | None = None,
    chunk_size: int | None = None,
    exclude_self: Any = None,
) -> HammingRetrievalReport:
    """Exact tie-aware retrieval metrics of binary codes ranked by Hamming distance, by counting.

    One pass over the packed database per query (module docstring): ``O(N)``, bounded memory.

    Args:
        query_codes: ``(n_q, b)`` codes in ``{-1, +1}`` / ``{0, 1}`` (numpy / torch, any numeric
            dtype) or packed unsigned words (see :func:`rankwise.hashing.pack_codes`).
        query_labels: ``(n_q,)`` class ids or ``(n_q, C)`` multi-hot labels; for a
            :class:`EuclideanThresholdAffinity`, the ``(n_q, F)`` original features; for a
            callable affinity, whatever it takes.
        database_codes: ``(n, b)`` codes or packed words; None = rank the queries against each
            other, each query's own row excluded (leave-one-out).
        database_labels: labels of the database (same kind); None with ``database_codes=None``.
        ks: cutoffs of AP@k, NDCG@k, R@k and P@k; each must be at most the number of ranked
            database items. None: those of 1, 10 and 100 that fit.
        affinity: ``"labels"`` (binary), ``"shared_labels"`` (number of shared labels), an
            :class:`EuclideanThresholdAffinity`, or a callable giving ``(chunk, n)`` integer
            affinities in ``[0, 255]`` (:mod:`rankwise._affinity`). AP-type metrics use binary
            relevance (affinity > 0); NDCG uses gains ``2^a - 1``.
        ties: ``"expected"`` (tie-aware, default), ``"optimistic"`` or ``"pessimistic"``; the
            tie-breaking ranges are always reported.
        bits: code length of packed input (default every bit of the words).
        chunk_size: queries per chunk (default: about 64 MB of working memory per chunk).
        exclude_self: ``None`` (leave-one-out iff ``database_codes`` is None), a bool (True:
            query ``i`` is database row ``i``), or an ``(n_q,)`` integer array with the
            database row of each query, every one ``>= 0`` or every one ``-1`` (the block call
            of :func:`~rankwise.metrics.sharded_metric`).

    Returns:
        :class:`HammingRetrievalReport` (a :class:`~rankwise.metrics.RetrievalReport`).

    Raises:
        ValueError: codes not binary, code lengths that differ, labels of the wrong shape or
            kind, a cutoff larger than the database, or no query with a relevant item.

    Example:
        >>> import torch
        >>> from rankwise.metrics import hamming_retrieval_metrics
        >>> codes = torch.tensor([[1, 1, 1, 1], [1, 1, -1, -1], [1, -1, 1, -1], [-1, -1, -1, -1]])
        >>> report = hamming_retrieval_metrics(codes, torch.tensor([0, 0, 1, 1]), ks=(1,))
        >>> round(report.map, 4), tuple(round(ap, 4) for ap in report.map_range)  # tie range
        (0.6806, (0.4167, 1.0))
    """
    check_ties(ties)
    q = as_packed_codes(query_codes, "query_codes", bits)
    if len(q) == 0:
        raise ValueError("`query_codes` is empty (0 codes); pass at least one query code.")
    leave_one_out = database_codes is None
    if leave_one_out:
        if database_labels is not None:
            raise ValueError("`database_labels` was given without `database_codes`; pass both.")
        db, database_labels = q, query_labels
    else:
        if database_labels is None:
            raise ValueError("`database_codes` was given without `database_labels`; pass both.")
        db = as_packed_codes(database_codes, "database_codes", bits)
        if len(db) == 0:
            raise ValueError(
                "`database_codes` is empty (0 codes); pass at least one database code, or "
                "database_codes=None to rank the queries against each other."
            )
        check_same_bits(q, db, "query_codes", "database_codes")
        if db.words.dtype != q.words.dtype:
            db = db.to(q.words.dtype)
    n_q, n_db = len(q), len(db)
    self_index = _self_index(exclude_self, leave_one_out, n_q, n_db)
    n_ranked = n_db - 1 if bool((self_index >= 0).any()) else n_db
    if n_ranked < 1:  # leave-one-out over a single code
        raise ValueError(
            "`query_codes` holds a single code and no database was given: leave-one-out ranks "
            "nothing (a single code ranked against itself); pass more codes or database_codes."
        )
    if ks is None:
        ks = tuple(k for k in (1, 10, 100) if k <= n_ranked)
    ks = _check_ks(ks, n_ranked)
    aff = _resolve_affinity(affinity, query_labels, database_labels, n_q, n_db)
    cd = cumulative_discount(n_ranked)
    acc = _Accumulator(n_q, ks)
    for lo, hi in _chunks(n_q, n_db, q.bits, aff, chunk_size):
        hist = hamming_histograms(q, db, aff, lo, hi, self_index)
        if aff.name == "callable":
            used = np.flatnonzero(hist.any(axis=(0, 1)))
            top = int(used.max()) + 1 if used.size else 1
            hist, values = hist[:, :, :top], aff.level_values[:top]
        else:
            values = aff.level_values
        counts = group_counts_from_histograms(hist.sum(2), hist[:, :, 1:].sum(2))
        _ap_metrics(acc, lo, counts, ties, n_ranked)
        _ndcg_metrics(acc, lo, hist, values, ties, cd)
    settings = {
        "n_gallery": n_db,
        "ties": ties,
        "similarity": "hamming",
        "ks": ks,
        "bits": q.bits,
        "affinity": aff.name,
    }
    return HammingRetrievalReport.from_per_query(acc.arrays, settings, {})
