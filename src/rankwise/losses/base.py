"""Common machinery of every rankwise loss: validation, score matrix, masks, skipped anchors.

Every loss follows the pytorch-metric-learning call ``loss(embeddings, labels, ref_embeddings=None,
ref_labels=None)``: each row of ``embeddings`` is a query (anchor) ranked against ``ref_embeddings``
(a memory bank, a gallery) or by default the other rows of the batch, scored by a similarity of
:mod:`rankwise.similarity` (cosine unless configured). Anchors without a positive or a negative are
skipped and counted in ``loss.last_stats``; a batch where none can be ranked raises ``ValueError``.
Half-precision embeddings are scored and the loss computed in float32 (docs/losses.md, "The common
contract" and "Half precision"); non-finite scores raise a ``ValueError`` naming ``embeddings``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._affinity import affinity_labels, affinity_levels
from .._validation import check_embeddings
from ..similarity import SIMILARITIES, check_similarity, similarity_matrix

__all__ = [
    "SIMILARITIES",
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Checked ``(embeddings (B, d), labels (B,) int64, ref (M, d) | None, ref_labels | None)``.

    The reference set is cast to the embeddings' device and dtype. Every problem is a
    ``ValueError`` naming the argument (NaN/inf, shapes, label dtype, a lone ``ref_*``).
    ``affinity`` (:mod:`rankwise._affinity`; None: class ids) says what labels are accepted,
    ``check_rows(x, name)`` checks each embedding matrix (default: finite 2-D floats).
    """
    emb = check_rows(embeddings, "embeddings")
    lab = affinity_labels(affinity, labels, emb.shape[0], "labels", emb.device)
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
    ref_lab = affinity_labels(affinity, ref_labels, ref.shape[0], "ref_labels", emb.device)
    return emb, lab, ref, ref_lab


def score_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the losses score and compute in: float32 for half-precision inputs, else ``dtype``."""
    return torch.promote_types(dtype, torch.float32)


def loss_scores(
    emb: torch.Tensor, ref: torch.Tensor, similarity: str, self_reference: bool
) -> torch.Tensor:
    """The (B, M) differentiable score matrix of a loss, in :func:`score_dtype`, checked finite.

    Half-precision rows are upcast (the gradient flows back in their own dtype) and autocast is
    switched off for the product, which it would otherwise run in half precision again.

    Raises:
        ValueError: a score is not finite (only possible for ``"dot"`` / ``"euclidean"``, whose
            scores grow with the norms), naming ``embeddings`` and the fix.
    """
    dtype = score_dtype(emb.dtype)
    with torch.autocast(emb.device.type, enabled=False):
        emb_c = emb.to(dtype)
        # `refs is queries` lets cosine normalise the batch once
        ref_c = emb_c if self_reference else ref.to(dtype)
        scores = similarity_matrix(emb_c, ref_c, similarity)
    if similarity != "cosine" and not bool(torch.isfinite(scores).all()):
        norm = float(emb.detach().to(torch.float64).norm(dim=1).max())
        raise ValueError(
            f"`embeddings` give non-finite {similarity} similarities in {dtype} (largest row norm "
            f"{norm:.3g}); scale the embeddings down, L2-normalise them, or use "
            "similarity='cosine'."
        )
    return scores


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

    def restrict_to_valid(self) -> PairBatch:
        """The same batch with only the valid anchors kept (rows of scores, masks, levels)."""
        v = self.valid
        rows = [None if t is None else t[v] for t in (self.levels, self.embeddings)]
        return PairBatch(
            self.scores[v],
            self.pos_mask[v],
            self.neg_mask[v],
            self.labels[v],
            self.ref_labels,
            torch.ones(int(v.sum()), dtype=torch.bool, device=v.device),
            self.self_reference,
            rows[0],
            rows[1],
            self.ref_embeddings,
        )


class RankingLoss(nn.Module):
    """Base class: subclasses implement :meth:`compute` on a validated :class:`PairBatch`.

    Args:
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"euclidean"`` (negative Euclidean
            distance; alias ``"neg_euclidean"``).

    A subclass whose labels are more than class ids sets ``self.affinity`` (see
    :mod:`rankwise._affinity`): positives are then the references of positive affinity, and the
    batch carries the affinity levels. It may refine :meth:`check_rows` (what embeddings it
    takes) and :meth:`check_batch` (when a batch has nothing to learn from).

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

    def __init__(self, similarity: str = "cosine") -> None:
        super().__init__()
        self.similarity = check_similarity(similarity)  # "neg_euclidean" -> "euclidean"
        self.last_stats: dict[str, float] = {}

    # -- subclasses override -------------------------------------------------------------------
    def compute(self, batch: PairBatch) -> torch.Tensor:  # pragma: no cover - abstract
        """The loss of a validated batch (implemented by every subclass)."""
        raise NotImplementedError

    def check_rows(self, x: Any, name: str) -> torch.Tensor:
        """Check one embedding matrix (``embeddings`` / ``ref_embeddings``): finite, 2-D."""
        return check_embeddings(x, name)

    def check_batch(self, batch: PairBatch) -> None:
        """Refuse a batch with nothing to learn from: no anchor with a positive and a negative."""
        raise_if_nothing_to_rank(
            type(self).__name__, int(self.last_stats["n_anchors_used"]), batch.labels
        )

    # -- shared path -----------------------------------------------------------------------------
    def prepare(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> PairBatch:
        """Validate inputs, build the score matrix and masks, count skipped anchors."""
        emb, lab, ref, ref_lab = validate_pair_inputs(
            embeddings,
            labels,
            ref_embeddings,
            ref_labels,
            affinity=self.affinity,
            check_rows=self.check_rows,
        )
        self_reference = ref is None
        if ref is None or ref_lab is None:  # validate_pair_inputs gives both or neither
            ref, ref_lab = emb, lab
        # one upcast of half-precision rows, whose gradient gathers every use in float32
        emb = emb.to(score_dtype(emb.dtype))
        ref = emb if self_reference else ref.to(emb.dtype)
        scores = loss_scores(emb, ref, self.similarity, self_reference)
        levels = None if self.affinity is None else affinity_levels(self.affinity, lab, ref_lab)
        same = lab[:, None] == ref_lab[None, :] if levels is None else levels > 0
        pos_mask = same.clone()
        neg_mask = ~same
        if self_reference:
            pos_mask.fill_diagonal_(False)
            neg_mask.fill_diagonal_(False)  # (already False for class ids)
        valid, self.last_stats = anchor_statistics(pos_mask, neg_mask)
        batch = PairBatch(
            scores, pos_mask, neg_mask, lab, ref_lab, valid, self_reference, levels, emb, ref
        )
        self.check_batch(batch)
        return batch

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
        """
        batch = self.prepare(embeddings, labels, ref_embeddings, ref_labels)
        return self.compute(batch)

    def extra_repr(self) -> str:
        """The similarity, shown in the module's repr."""
        return f"similarity={self.similarity!r}"
