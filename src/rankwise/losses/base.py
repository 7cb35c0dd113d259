"""Common machinery of every rankwise loss: validation, score matrix, masks, skipped anchors.

Every loss follows the pytorch-metric-learning call ``loss(embeddings, labels, ref_embeddings=None,
ref_labels=None)``: each row of ``embeddings`` is a query (anchor) ranked against ``ref_embeddings``
(a memory bank, a gallery) or by default the other rows of the batch, scored by a similarity of
:mod:`rankwise.similarity` (cosine unless configured). Anchors without a positive or a negative are
skipped and counted in ``loss.last_stats``; a batch where none can be ranked raises ``ValueError``.
Half-precision embeddings are scored and the loss computed in float32 (docs/losses.md, "The common
contract" and "Half precision").

A step waits for the device nowhere (issue 31): everything that depends on the labels only (masks,
counts, the batch's positive pairs, which anchors are skipped) is computed on the host from the
labels, once per batch (:class:`BatchLayout`), and sent to the device in one copy; the values of
the embeddings are checked on the device (non-finite scores, a loss's own range checks) as one
flag. On the CPU, where reading it waits for nothing, a failed check raises the ``ValueError``
naming ``embeddings`` at the call; on an accelerator it is raised when ``loss.last_stats`` is read
(a :class:`~rankwise.losses._deferred.LossStats`), while the call returns NaN and changes no state.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from .._affinity import affinity_labels, affinity_levels
from .._dispatch import simulating_device, to_device
from .._validation import check_embeddings, check_finite
from ..similarity import SIMILARITIES, check_similarity, similarity_matrix
from ._deferred import DeferredCheck, LossStats

__all__ = [
    "SIMILARITIES",
    "BatchLayout",
    "DeferredCheck",
    "LossStats",
    "PairBatch",
    "RankingLoss",
    "anchor_statistics",
    "loss_scores",
    "raise_if_nothing_to_rank",
    "score_dtype",
    "similarity_matrix",
    "validate_pair_inputs",
]


def validate_pair_inputs(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    ref_embeddings: torch.Tensor | None = None,
    ref_labels: torch.Tensor | None = None,
    *,
    affinity: Any = None,
    check_rows: Callable[[Any, str], torch.Tensor] = check_embeddings,
    labels_on_host: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Checked ``(embeddings (B, d), labels (B,) int64, ref (M, d) | None, ref_labels | None)``.

    The reference set is cast to the embeddings' device and dtype. Every problem is a
    ``ValueError`` naming the argument (NaN/inf, shapes, label dtype, a lone ``ref_*``).
    ``affinity`` (:mod:`rankwise._affinity`; None: class ids) says what labels are accepted,
    ``check_rows(x, name)`` checks each embedding matrix (default: finite 2-D floats). The labels
    go to the embeddings' device, or with ``labels_on_host`` to the CPU (checked where they are
    given; a copy, the one host read of a step, only when that is not the CPU).
    """
    emb = check_rows(embeddings, "embeddings")
    labels_device = None if labels_on_host else emb.device
    lab = affinity_labels(affinity, labels, emb.shape[0], "labels", labels_device)
    if labels_on_host:
        lab = _host(lab)
    if (ref_embeddings is None) != (ref_labels is None):
        raise ValueError("pass both `ref_embeddings` and `ref_labels`, or neither.")
    if ref_embeddings is None:
        return emb, lab, None, None
    ref = check_rows(ref_embeddings, "ref_embeddings")
    if ref.shape[1] != emb.shape[1]:
        raise ValueError(
            f"`ref_embeddings` has dimension {ref.shape[1]} but `embeddings` has "
            f"{emb.shape[1]}; they must live in the same space."
        )
    ref = ref.to(device=emb.device, dtype=emb.dtype)
    ref_lab = affinity_labels(affinity, ref_labels, ref.shape[0], "ref_labels", labels_device)
    return emb, lab, ref, _host(ref_lab) if labels_on_host else ref_lab


def _host(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` on the CPU (no copy when they are there already)."""
    return labels if labels.device.type == "cpu" else labels.cpu()


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the losses score and compute in: float32 for half-precision inputs, else ``dtype``."""
    return torch.promote_types(dtype, torch.float32)


def loss_scores(
    emb: torch.Tensor, ref: torch.Tensor, similarity: str, self_reference: bool
) -> torch.Tensor:
    """The (B, M) differentiable score matrix of a loss, in :func:`score_dtype`, checked finite.

    Half-precision rows are upcast (the gradient flows back in their own dtype) and autocast is
    switched off for the product, which it would otherwise run in half precision again. The check
    reads a value (a host sync); :class:`RankingLoss` defers it instead.

    Raises:
        ValueError: a score is not finite (only possible for ``"dot"`` / ``"euclidean"``, whose
            scores grow with the norms), naming ``embeddings`` and the fix.
    """
    scores = _score_matrix(emb, ref, similarity, self_reference)
    if similarity != "cosine" and not bool(torch.isfinite(scores).all()):
        _raise_non_finite_scores(emb, similarity, scores.dtype)
    return scores


def _score_matrix(
    emb: torch.Tensor, ref: torch.Tensor, similarity: str, self_reference: bool
) -> torch.Tensor:
    """:func:`loss_scores` without the check."""
    dtype = score_dtype(emb.dtype)
    with torch.autocast(emb.device.type, enabled=False):
        emb_c = emb.to(dtype)
        # `refs is queries` lets cosine normalise the batch once
        ref_c = emb_c if self_reference else ref.to(dtype)
        return similarity_matrix(emb_c, ref_c, similarity)


def _raise_non_finite_scores(emb: torch.Tensor, similarity: str, dtype: torch.dtype) -> None:
    norm = float(emb.detach().to(torch.float64).norm(dim=1).max())
    raise ValueError(
        f"`embeddings` give non-finite {similarity} similarities in {dtype} (largest row norm "
        f"{norm:.3g}); scale the embeddings down, L2-normalise them, or use "
        "similarity='cosine'."
    )


def anchor_statistics(
    pos_mask: torch.Tensor, neg_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Which anchors can be ranked, and the counts every loss reports in ``last_stats``.

    Args:
        pos_mask: (B, M) bool mask of each anchor's positives.
        neg_mask: (B, M) bool mask of each anchor's negatives.

    Returns:
        ``valid`` (B,) bool (at least one positive and one negative) and the dict
        ``n_anchors, n_anchors_used, n_skipped_no_positive, n_skipped_no_negative,
        n_positive_pairs, n_negative_pairs`` (pairs of the valid anchors only).
    """
    positives_per_anchor = pos_mask.sum(1)
    negatives_per_anchor = neg_mask.sum(1)
    has_pos = positives_per_anchor > 0
    has_neg = negatives_per_anchor > 0
    valid = has_pos & has_neg
    # every count in one tensor: a single device-to-host transfer
    counts = torch.stack(
        [
            valid.sum(),
            (~has_pos).sum(),
            (has_pos & ~has_neg).sum(),
            (positives_per_anchor * valid).sum(),
            (negatives_per_anchor * valid).sum(),
        ]
    ).tolist()
    return valid, {
        "n_anchors": int(pos_mask.shape[0]),
        "n_anchors_used": counts[0],
        "n_skipped_no_positive": counts[1],
        "n_skipped_no_negative": counts[2],
        "n_positive_pairs": counts[3],
        "n_negative_pairs": counts[4],
    }


def raise_if_nothing_to_rank(owner: str, n_valid: int, labels: torch.Tensor) -> None:
    """The error of a batch in which no anchor has both a positive and a negative."""
    if n_valid == 0:
        raise ValueError(
            f"{owner}: no anchor in this batch has both a positive and a negative "
            f"(batch of {labels.shape[0]} with {int(torch.unique(labels).numel())} distinct "
            "labels); sample at least 2 classes with at least 2 samples each, e.g. with "
            "rankwise.sampling.MPerClassBatchSampler(labels, m=4, batch_size=...)."
        )


class BatchLayout:
    """The label-only structure of one batch, on the host: CPU tensors and Python ints.

    Built from the labels (the data loader gives them on the host, so nothing here waits for the
    device): the positive / negative masks, the per-anchor counts, which anchors can be ranked,
    the anchor counts of ``last_stats``, and, computed on demand and cached, the index tensors a
    loss needs (:meth:`valid_index`, :meth:`positive_pairs`, or a loss's own through
    :meth:`cached` / :meth:`pattern_cached`). A loss sends what it needs to the device with
    :meth:`PairBatch.send`.

    Batches of class ids whose labels have the same *pattern* (equal where the labels are equal:
    a P x K sampler gives the same pattern at every step) share one structure
    (:meth:`from_labels` keeps the last few): only the label values, used by a few lookups per
    step, change. :attr:`classes` numbers the classes of such a batch by first appearance.

    Args:
        pos_mask: (B, M) bool, each anchor's positives (itself excluded).
        neg_mask: (B, M) bool, each anchor's negatives.
        self_reference: the references are the batch itself.
        labels: (B,) host labels (None when unknown: a batch built from masks).
        ref_labels: (M,) host reference labels (or None).
        valid: (B,) bool anchors that can be ranked (default: a positive and a negative).

    Attributes:
        pos_mask, neg_mask, valid, labels, ref_labels, self_reference: as given.
        positives_per_anchor, negatives_per_anchor: (B,) int64.
        n_anchors, n_valid: ints.
        stats: ``n_anchors, n_anchors_used, n_skipped_no_positive, n_skipped_no_negative,
            n_positive_pairs, n_negative_pairs`` (pairs of the valid anchors), ints.
        classes: (B,) int64 class index of every anchor, by first appearance (None unless built
            by :meth:`from_labels` from class ids against the batch itself).
    """

    def __init__(
        self,
        pos_mask: torch.Tensor,
        neg_mask: torch.Tensor,
        self_reference: bool,
        labels: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> None:
        self.pos_mask, self.neg_mask = pos_mask, neg_mask
        self.self_reference = self_reference
        self.labels, self.ref_labels = labels, ref_labels
        self.classes: torch.Tensor | None = None
        # numpy on the host tensors' memory: a few microseconds per step instead of torch's
        # dispatch per operation
        positives, negatives = pos_mask.numpy().sum(1), neg_mask.numpy().sum(1)
        has_pos, has_neg = positives > 0, negatives > 0
        valid_rows = has_pos & has_neg if valid is None else valid.numpy()
        self.positives_per_anchor = torch.from_numpy(positives)
        self.negatives_per_anchor = torch.from_numpy(negatives)
        self.valid = torch.from_numpy(valid_rows) if valid is None else valid
        self.n_anchors = int(pos_mask.shape[0])
        self.n_valid = int(np.count_nonzero(valid_rows))
        self.stats: dict[str, Any] = {
            "n_anchors": self.n_anchors,
            "n_anchors_used": self.n_valid,
            "n_skipped_no_positive": int(np.count_nonzero(~has_pos)),
            "n_skipped_no_negative": int(np.count_nonzero(has_pos & ~has_neg)),
            "n_positive_pairs": int(positives[valid_rows].sum()),
            "n_negative_pairs": int(negatives[valid_rows].sum()),
        }
        self._cache: dict[str, Any] = {}
        self._pattern_cache: dict[Any, Any] = {}

    @classmethod
    def from_labels(
        cls,
        labels: torch.Tensor,
        ref_labels: torch.Tensor,
        self_reference: bool,
        levels: torch.Tensor | None = None,
        leads_with_batch: bool = False,
    ) -> BatchLayout:
        """The layout of class ids (same id: positive) or of affinity ``levels`` (> 0: positive).

        ``leads_with_batch``: the first B references are the batch itself (a memory's reference
        set, :mod:`rankwise.losses.memory`), so anchor i's own column i is neither a positive
        nor a negative, as without a reference set.
        """
        pattern = None
        if levels is None and self_reference and labels.ndim == 1:
            pattern, classes = _label_pattern(labels.numpy())
            shared = _LAYOUTS.get(pattern)
            if shared is not None:
                return shared._with_labels(labels, ref_labels, classes)
        if levels is None:
            same = labels.numpy()[:, None] == ref_labels.numpy()[None, :]
        else:
            same = levels.numpy() > 0
        negative = ~same
        if self_reference or leads_with_batch:
            # (B, M) with M >= B: fills (i, i) for i < B only
            np.fill_diagonal(same, False)
            np.fill_diagonal(negative, False)  # (already False for class ids)
        layout = cls(
            torch.from_numpy(same), torch.from_numpy(negative), self_reference, labels, ref_labels
        )
        if pattern is None:
            return layout
        if labels.numel() ** 2 <= _LAYOUT_CACHE_ENTRIES:
            _LAYOUTS[pattern] = layout
            while len(_LAYOUTS) > _LAYOUT_CACHE_SIZE:
                del _LAYOUTS[next(iter(_LAYOUTS))]
        return layout._with_labels(labels, ref_labels, classes)

    def _with_labels(
        self, labels: torch.Tensor, ref_labels: torch.Tensor, classes: np.ndarray
    ) -> BatchLayout:
        """This structure for a batch of the same pattern.

        It gets its own labels, per-batch cache and copies of the masks (a loss may write into
        the batch's masks); the pattern's cache is shared.
        """
        out = copy.copy(self)
        out.labels, out.ref_labels, out.classes = labels, ref_labels, torch.from_numpy(classes)
        # numpy copies, on the calling thread: a torch copy of a (B, B) mask of 2**15 entries or
        # more wakes the intra-op thread pool, whose threads then spin on the host's cores
        out.pos_mask, out.neg_mask, out.valid = (
            torch.from_numpy(t.numpy().copy()) for t in (self.pos_mask, self.neg_mask, self.valid)
        )
        out._cache = {}
        return out

    @property
    def all_valid(self) -> bool:
        """Every anchor can be ranked."""
        return self.n_valid == self.n_anchors

    def cached(self, key: str, build: Callable[[BatchLayout], Any]) -> Any:
        """``build(self)``, computed once per batch (host structure a loss derives from labels)."""
        if key not in self._cache:
            self._cache[key] = build(self)
        return self._cache[key]

    def pattern_cached(self, key: Any, build: Callable[[BatchLayout], Any]) -> Any:
        """``build(self)``, shared by the batches of this label pattern.

        ``build`` may read the masks, counts, ``valid`` and :attr:`classes`, never the label
        values (another batch of the pattern has other classes); ``key`` names everything else
        it depends on (e.g. a dtype).
        """
        if key not in self._pattern_cache:
            self._pattern_cache[key] = build(self)
        return self._pattern_cache[key]

    def valid_index(self) -> torch.Tensor:
        """(N,) int64 rows of the valid anchors, increasing."""
        return self.pattern_cached(
            "valid_index", lambda s: torch.from_numpy(np.flatnonzero(s.valid.numpy()))
        )

    def positive_pairs(self, valid_only: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(anchor, reference) int64 (P,) each: the positive pairs, row-major (by anchor).

        ``valid_only`` keeps the pairs of valid anchors (what the losses average over); False
        gives every positive pair (anchors without a negative too).
        """
        if not valid_only or self.all_valid:
            return self.pattern_cached("positive_pairs", lambda s: _nonzero(s.pos_mask.numpy()))
        return self.pattern_cached(
            "valid_positive_pairs",
            lambda s: _nonzero(s.pos_mask.numpy() & s.valid.numpy()[:, None]),
        )

    def restricted(self) -> BatchLayout:
        """The layout of the valid anchors only (rows :meth:`valid_index`)."""
        if self.all_valid:
            return self

        def build(s: BatchLayout) -> BatchLayout:
            rows = s.valid_index()
            labels = None if s.labels is None else s.labels[rows]
            return BatchLayout(
                s.pos_mask[rows], s.neg_mask[rows], s.self_reference, labels, s.ref_labels
            )

        return self.cached("restricted", build)


# Layouts of recent label patterns (self-reference class ids, at most this many mask entries
# each: 2 bytes per entry), oldest first
_LAYOUTS: dict[bytes, BatchLayout] = {}
_LAYOUT_CACHE_SIZE = 8
_LAYOUT_CACHE_ENTRIES = 2**18


def _label_pattern(labels: np.ndarray) -> tuple[bytes, np.ndarray]:
    """(key, classes): the labels renumbered by first appearance, and the bytes of that."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty_like(first)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)
    classes = rank[inverse.reshape(-1)].astype(np.int64, copy=False)
    return classes.tobytes(), classes


def _nonzero(mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column (int64 tensors) of the True entries of a 2-D host mask, row-major."""
    rows, cols = np.nonzero(mask)
    as_int64 = (torch.from_numpy(a.astype(np.int64, copy=False)) for a in (rows, cols))
    return tuple(as_int64)  # type: ignore[return-value]


@dataclass
class PairBatch:
    """Everything a ranking loss needs about one batch.

    Attributes:
        scores: (B, M) similarity of every anchor to every reference item.
        pos_mask: (B, M) bool, True where the reference shares the anchor's label (self excluded),
            or, for a loss with an ``affinity``, where their affinity is positive.
        neg_mask: (B, M) bool, True where the reference has a different label (affinity 0).
        labels: (B,) int64 anchor labels (or what the loss's ``affinity`` takes as labels).
        ref_labels: (M,) int64 reference labels.
        valid: (B,) bool, anchors with at least one positive and one negative.
        self_reference: True when the references are the batch itself.
        levels: (B, M) float64 multi-level affinities (None: binary, from the class ids).
        embeddings: the checked (B, d) embeddings the scores come from, in the scores' dtype.
        ref_embeddings: the same of the (M, d) references (``embeddings`` if self).
        layout: the same structure on the host (:class:`BatchLayout`; see :attr:`host`).
        inputs_ok: 0-dim bool tensor on the device, False when the values of the embeddings
            failed the loss's checks (the call then returns NaN, and raises when ``last_stats``
            is read); a loss with state updates it only where this is True (``torch.where``),
            so a refused call changes nothing. None: unchecked (a batch built by hand).

    Everything above is on the scores' device. Shapes that depend on the labels (how many pairs,
    which anchors) come from :attr:`host` without a device sync; tensors derived there go to the
    device with :meth:`send`.
    """

    scores: torch.Tensor
    pos_mask: torch.Tensor
    neg_mask: torch.Tensor
    labels: torch.Tensor
    ref_labels: torch.Tensor
    valid: torch.Tensor
    self_reference: bool
    levels: torch.Tensor | None = None
    embeddings: torch.Tensor | None = None
    ref_embeddings: torch.Tensor | None = None
    layout: BatchLayout | None = field(default=None, repr=False)
    inputs_ok: torch.Tensor | None = None
    _derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def host(self) -> BatchLayout:
        """The batch's :class:`BatchLayout` (built from the masks for a batch made by hand)."""
        if self.layout is None:
            self.layout = BatchLayout(
                self.pos_mask.cpu(),
                self.neg_mask.cpu(),
                self.self_reference,
                self.labels.cpu(),
                self.ref_labels.cpu(),
                self.valid.cpu(),
            )
        return self.layout

    def cached(self, key: str, build: Callable[[PairBatch], Any]) -> Any:
        """``build(self)`` once per batch: a device tensor several parts of a loss use."""
        if key not in self._derived:
            self._derived[key] = build(self)
        return self._derived[key]

    def negative_weights(self) -> torch.Tensor:
        """``neg_mask`` as 0/1 in the scores' dtype (a bool factor would be cast at every use)."""
        return self.cached("negative_weights", lambda b: b.neg_mask.to(b.scores.dtype))

    def send(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host tensors on the scores' device, in one copy (the same tensors on the CPU)."""
        return to_device(list(tensors), self.scores.device)

    def restrict_to_valid(self) -> PairBatch:
        """The same batch with only the valid anchors kept (rows of scores, masks, levels)."""
        host = self.host
        if host.all_valid:
            return self
        (rows,) = self.send(host.valid_index())
        levels, embeddings = (
            None if t is None else t.index_select(0, rows) for t in (self.levels, self.embeddings)
        )
        return PairBatch(
            self.scores.index_select(0, rows),
            self.pos_mask.index_select(0, rows),
            self.neg_mask.index_select(0, rows),
            self.labels.index_select(0, rows),
            self.ref_labels,
            torch.ones(host.n_valid, dtype=torch.bool, device=self.scores.device),
            self.self_reference,
            levels,
            embeddings,
            self.ref_embeddings,
            host.restricted(),
            self.inputs_ok,
        )


def _check_leads_with_batch(labels: torch.Tensor, ref_labels: torch.Tensor) -> None:
    """Host labels: the reference set has the batch's rows first (checked on its labels)."""
    n = labels.shape[0]
    if ref_labels.shape[0] < n or not torch.equal(ref_labels[:n], labels):
        raise ValueError(
            "`ref_embeddings` must begin with the batch itself inside "
            "reference_leads_with_batch(): pass ref_embeddings=torch.cat([embeddings, memory]) "
            "and ref_labels=torch.cat([labels, memory_labels])."
        )


class RankingLoss(nn.Module):
    """Base class: subclasses implement :meth:`compute` on a validated :class:`PairBatch`.

    Args:
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"euclidean"`` (negative Euclidean
            distance; alias ``"neg_euclidean"``).

    A subclass whose labels are more than class ids sets ``self.affinity`` (see
    :mod:`rankwise._affinity`): positives are then the references of positive affinity, and the
    batch carries the affinity levels. It may refine :meth:`check_rows` (what embeddings it
    takes), :meth:`value_flag` / :meth:`check_values` (checks of their values, on the device) and
    :meth:`check_batch` (when a batch has nothing to learn from).

    Without host syncs: take label-dependent shapes and indices from ``batch.host`` (a
    :class:`BatchLayout`) and send them with ``batch.send``; record ``last_stats`` values as
    detached tensors (``self.last_stats["x"] = t.detach()``), read when somebody reads them;
    guard state updates with ``batch.inputs_ok``.

    Example:
        >>> import torch
        >>> from rankwise.losses import RankingLoss
        >>> class HardestNegative(RankingLoss):  # a new loss implements compute() only
        ...     def compute(self, batch):
        ...         hardest = batch.scores.masked_fill(~batch.neg_mask, -1.0).amax(1)
        ...         return hardest[batch.valid].mean()
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> round(HardestNegative()(emb, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.6881
    """

    #: None (labels are class ids) or an affinity of :mod:`rankwise._affinity`
    affinity: Any = None
    #: the loss takes labels on the host beside device embeddings (the Trainer then leaves the
    #: data loader's labels there: no copy to the device and back)
    takes_host_labels: bool = True
    #: set inside :meth:`reference_leads_with_batch`: the reference set begins with the batch
    _leads_with_batch: bool = False

    def __init__(self, similarity: str = "cosine") -> None:
        super().__init__()
        self.similarity = check_similarity(similarity)  # "neg_euclidean" -> "euclidean"
        self.last_stats: dict[str, Any] = LossStats()

    @contextlib.contextmanager
    def reference_leads_with_batch(self) -> Iterator[None]:
        """Within it, a call's ``ref_embeddings`` begin with the batch itself (rows 0..B-1).

        Each anchor's own reference row is then neither a positive nor a negative, exactly as
        without a reference set; the other rows (a memory of past batches,
        :class:`~rankwise.losses.memory.RankingMemory`) are ranked as usual.
        """
        self._leads_with_batch = True
        try:
            yield
        finally:
            self._leads_with_batch = False

    # -- subclasses override -------------------------------------------------------------------
    def compute(self, batch: PairBatch) -> torch.Tensor:  # pragma: no cover - abstract
        """The loss of a validated batch (implemented by every subclass)."""
        raise NotImplementedError

    def check_rows(self, x: Any, name: str) -> torch.Tensor:
        """Check one embedding matrix (``embeddings`` / ``ref_embeddings``): 2-D floats.

        Only the shape and dtype: the values are checked on the device (:meth:`value_flag`,
        finite scores) without a host read.
        """
        return check_embeddings(x, name, finite=False)

    def value_flag(self, x: torch.Tensor) -> torch.Tensor | None:
        """0-dim bool tensor, False when the values of ``x`` break a rule of this loss, or None.

        Finite values need no flag: every loss checks that its scores are finite. Computed on
        the device; read only when ``last_stats`` is.
        """
        return None

    def check_values(self, x: torch.Tensor, name: str) -> None:
        """Raise the ``ValueError`` naming ``name`` for values this loss refuses (error path)."""
        check_finite(x, name)

    def check_batch(self, batch: PairBatch) -> None:
        """Refuse a batch with nothing to learn from: no anchor with a positive and a negative."""
        host = batch.host
        labels = batch.labels if host.labels is None else host.labels
        raise_if_nothing_to_rank(type(self).__name__, host.n_valid, labels)

    # -- shared path -----------------------------------------------------------------------------
    def prepare(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> PairBatch:
        """Validate inputs, build the score matrix and masks, count skipped anchors.

        Labels are read on the host (a copy of them when they are on an accelerator); the
        embeddings' values are checked on the device, and a failure raises here for CPU
        embeddings, when ``last_stats`` is read on an accelerator (see the module docstring).
        """
        emb, lab, ref, ref_lab = validate_pair_inputs(
            embeddings,
            labels,
            ref_embeddings,
            ref_labels,
            affinity=self.affinity,
            check_rows=self.check_rows,
            labels_on_host=True,
        )
        self_reference = ref is None
        if ref is None or ref_lab is None:  # validate_pair_inputs gives both or neither
            ref, ref_lab = emb, lab
        leads = self._leads_with_batch and not self_reference
        if leads:
            _check_leads_with_batch(lab, ref_lab)
        levels = None if self.affinity is None else affinity_levels(self.affinity, lab, ref_lab)
        layout = BatchLayout.from_labels(lab, ref_lab, self_reference, levels, leads)
        ok = self._values_flag(emb, None if self_reference else ref)
        # one upcast of half-precision rows, whose gradient gathers every use in float32
        rows = emb.to(score_dtype(emb.dtype))
        ref_rows = rows if self_reference else ref.to(rows.dtype)
        scores = _score_matrix(rows, ref_rows, self.similarity, self_reference)
        # s − s is 0 exactly when s is finite (NaN and ±inf give NaN): cheaper than isfinite
        finite = (scores - scores).eq(0).all()
        ok = finite if ok is None else finite & ok
        check = DeferredCheck(ok, self._explain(emb, ref, self_reference))
        if emb.device.type == "cpu" and not simulating_device():
            # reading a CPU value waits for nothing: refuse at the call, before any state changes
            check.raise_if_failed()
        self.last_stats = LossStats(layout.stats, check=check)
        sent = to_device(
            [layout.pos_mask, layout.neg_mask, lab, ref_lab, layout.valid]
            + ([] if levels is None else [levels]),
            emb.device,
        )
        pos_mask, neg_mask, lab, ref_lab, valid = sent[:5]
        batch = PairBatch(
            scores,
            pos_mask,
            neg_mask,
            lab,
            ref_lab,
            valid,
            self_reference,
            sent[5] if levels is not None else None,
            rows,
            ref_rows,
            layout,
            ok,
        )
        self.check_batch(batch)
        return batch

    def _values_flag(self, emb: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor | None:
        flags = (self.value_flag(emb), None if ref is None else self.value_flag(ref))
        present = [f for f in flags if f is not None]
        if not present:
            return None
        return present[0] if len(present) == 1 else present[0] & present[1]

    def _explain(
        self, emb: torch.Tensor, ref: torch.Tensor, self_reference: bool
    ) -> Callable[[], None]:
        """The error path of the deferred check: the eager checks, on the call's inputs."""
        emb, ref = emb.detach(), ref.detach()

        def explain() -> None:
            self.check_values(emb, "embeddings")
            if not self_reference:
                self.check_values(ref, "ref_embeddings")
            _raise_non_finite_scores(emb, self.similarity, score_dtype(emb.dtype))

        return explain

    @staticmethod
    def finish(value: torch.Tensor, batch: PairBatch) -> torch.Tensor:
        """``value``, or NaN when the batch's values failed their check (no host read)."""
        if batch.inputs_ok is None:
            return value
        return torch.where(batch.inputs_ok, value, math.nan)

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss of one batch.

        Args:
            embeddings: (B, d) float tensor, one row per anchor.
            labels: (B,) integer class ids.
            ref_embeddings: optional (M, d) reference set to rank against (memory bank, gallery).
            ref_labels: (M,) integer class ids of the reference set.

        Returns:
            A scalar tensor (float32 for float16 / bfloat16 embeddings, see the module docstring).
            Refused values of the embeddings raise a ``ValueError`` naming them (on an
            accelerator: NaN is returned and the error raised when ``last_stats`` is read).
        """
        batch = self.prepare(embeddings, labels, ref_embeddings, ref_labels)
        return self.finish(self.compute(batch), batch)

    def extra_repr(self) -> str:
        """The similarity, shown in the module's repr."""
        return f"similarity={self.similarity!r}"
