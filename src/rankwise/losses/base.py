"""Common machinery of every rankwise loss: validation, score matrix, masks, skipped anchors.

Input validation, the score matrix, positive / negative masks and the bookkeeping of skipped
anchors shared by the losses. All ranking losses in rankwise follow the pytorch-metric-learning call signature
``loss(embeddings, labels, ref_embeddings=None, ref_labels=None)``. Each row of ``embeddings`` is a
query (anchor); it is ranked against ``ref_embeddings`` (a memory bank, a gallery) or, by default,
against the other rows of the batch (its own row excluded). Scores are cosine similarities of the
L2-normalized embeddings unless ``similarity="dot"`` or ``"euclidean"`` (alias ``"neg_euclidean"``)
is configured; the names and the score matrix come from :mod:`rankwise.similarity`.
Anchors without a positive or without a negative cannot be ranked; they are skipped and counted in
``loss.last_stats``, and a batch where no anchor can be ranked raises ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._validation import check_embeddings, check_labels
from ..similarity import SIMILARITIES, check_similarity, similarity_matrix

__all__ = [
    "SIMILARITIES",
    "PairBatch",
    "RankingLoss",
    "anchor_statistics",
    "raise_if_nothing_to_rank",
    "similarity_matrix",
    "validate_pair_inputs",
]


def validate_pair_inputs(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    ref_embeddings: torch.Tensor | None = None,
    ref_labels: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Checked ``(embeddings (B, d), labels (B,) int64, ref (M, d) | None, ref_labels | None)``.

    The reference set is cast to the embeddings' device and dtype. Every problem is a
    ``ValueError`` naming the argument (NaN/inf, shapes, label dtype, a lone ``ref_*``).
    """
    emb = check_embeddings(embeddings, "embeddings")
    lab = check_labels(labels, emb.shape[0], "labels", device=emb.device, allow_multi_hot=False)
    if (ref_embeddings is None) != (ref_labels is None):
        raise ValueError("pass both `ref_embeddings` and `ref_labels`, or neither.")
    if ref_embeddings is None:
        return emb, lab, None, None
    ref = check_embeddings(ref_embeddings, "ref_embeddings")
    if ref.shape[1] != emb.shape[1]:
        raise ValueError(
            f"`ref_embeddings` has dimension {ref.shape[1]} but `embeddings` has "
            f"{emb.shape[1]}; they must live in the same space."
        )
    ref = ref.to(device=emb.device, dtype=emb.dtype)
    ref_lab = check_labels(
        ref_labels, ref.shape[0], "ref_labels", device=emb.device, allow_multi_hot=False
    )
    return emb, lab, ref, ref_lab


def anchor_statistics(
    pos_mask: torch.Tensor, neg_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, int]]:
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
        pos_mask: (B, M) bool, True where the reference shares the anchor's label (self excluded).
        neg_mask: (B, M) bool, True where the reference has a different label.
        labels: (B,) int64 anchor labels.
        ref_labels: (M,) int64 reference labels.
        valid: (B,) bool, anchors with at least one positive and one negative.
        self_reference: True when the references are the batch itself.
    """

    scores: torch.Tensor
    pos_mask: torch.Tensor
    neg_mask: torch.Tensor
    labels: torch.Tensor
    ref_labels: torch.Tensor
    valid: torch.Tensor
    self_reference: bool

    def restrict_to_valid(self) -> PairBatch:
        """The same batch with only the valid anchors kept (rows of scores and masks)."""
        v = self.valid
        return PairBatch(
            self.scores[v],
            self.pos_mask[v],
            self.neg_mask[v],
            self.labels[v],
            self.ref_labels,
            torch.ones(int(v.sum()), dtype=torch.bool, device=v.device),
            self.self_reference,
        )


class RankingLoss(nn.Module):
    """Base class: subclasses implement :meth:`compute` on a validated :class:`PairBatch`.

    Args:
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"euclidean"`` (negative Euclidean
            distance; alias ``"neg_euclidean"``).
    """

    def __init__(self, similarity: str = "cosine") -> None:
        super().__init__()
        self.similarity = check_similarity(similarity)  # "neg_euclidean" -> "euclidean"
        self.last_stats: dict[str, float] = {}

    # -- subclasses override -------------------------------------------------------------------
    def compute(self, batch: PairBatch) -> torch.Tensor:  # pragma: no cover - abstract
        """The loss of a validated batch (implemented by every subclass)."""
        raise NotImplementedError

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
            embeddings, labels, ref_embeddings, ref_labels
        )
        self_reference = ref is None
        if self_reference:
            ref, ref_lab = emb, lab
        scores = similarity_matrix(emb, ref, self.similarity)
        same = lab[:, None] == ref_lab[None, :]
        pos_mask = same.clone()
        if self_reference:
            pos_mask.fill_diagonal_(False)
        neg_mask = ~same
        valid, self.last_stats = anchor_statistics(pos_mask, neg_mask)
        raise_if_nothing_to_rank(type(self).__name__, self.last_stats["n_anchors_used"], lab)
        return PairBatch(scores, pos_mask, neg_mask, lab, ref_lab, valid, self_reference)

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
            A scalar tensor.
        """
        batch = self.prepare(embeddings, labels, ref_embeddings, ref_labels)
        return self.compute(batch)

    def extra_repr(self) -> str:
        """The similarity, shown in the module's repr."""
        return f"similarity={self.similarity!r}"
