"""Smooth-AP: average precision with sigmoid-relaxed ranks (Brown et al., ECCV 2020).

Smooth-AP of Brown, Xie, Kalogeiton and Zisserman, *Smooth-AP: Smoothing the Path Towards
Large-Scale Image Retrieval* (ECCV 2020): the average precision of each anchor's ranking, AP_q =
(1/|P_q|) Σ_{i∈P_q} R(i, P_q) / R(i, Ω_q) (Eq. 3), with the indicator of "j ranked above i" in both
ranks replaced by the sigmoid G(s_j − s_i; τ) = sigmoid((s_j − s_i)/τ) (Eq. 5–6). This version is
label based: it reads positives and negatives from the masks of :class:`RankingLoss`, so it works for
any batch layout (labels in any order, any and uneven numbers of samples per class, a reference
set); the implementation in pytorch-metric-learning 2.9.0 assumes sorted blocks whose count equals
the samples per class and includes each query in its own ranking.
"""

from __future__ import annotations

import torch

from .._validation import Interval, check_scalar
from .base import PairBatch, RankingLoss

__all__ = ["SmoothAPLoss"]


class SmoothAPLoss(RankingLoss):
    """Smooth-AP loss: 1 − mean over valid anchors q of the sigmoid-relaxed AP of q's ranking.

    For anchor q with positives P_q and negatives N_q (self excluded without a reference set) and
    each positive i:

        R_P(i) = 1 + Σ_{j∈P_q, j≠i} sigmoid((s_qj − s_qi) / τ)
        R_all(i) = R_P(i) + Σ_{j∈N_q} sigmoid((s_qj − s_qi) / τ)
        AP_q = (1 / |P_q|) Σ_{i∈P_q} R_P(i) / R_all(i)

    As τ → 0, AP_q tends to the exact average precision of q's ranking (for tie-free scores).

    Memory: one (n_positive_pairs, M) block of sigmoids (plus autograd's copy), M the reference
    items, instead of the original implementation's (B, B, B) tensor (docs/losses.md).

    Args:
        temperature: τ > 0; 0.01 in the paper.
        similarity: ``"cosine"`` (default, as in the paper), ``"dot"`` or ``"neg_euclidean"``.

    ``last_stats["mean_smooth_ap"]`` holds mean_q AP_q.

    Example:
        >>> import torch
        >>> from rankwise.losses import SmoothAPLoss
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> round(SmoothAPLoss(temperature=0.01)(emb, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.1291
    """

    def __init__(self, temperature: float = 0.01, similarity: str = "cosine") -> None:
        super().__init__(similarity)
        self.temperature = check_scalar(
            temperature, "temperature", Interval("real", 0, None, closed="neither")
        )

    def smooth_average_precision(self, batch: PairBatch) -> torch.Tensor:
        """(N,) relaxed AP of each valid anchor, in the order of ``batch.valid``'s True entries."""
        valid = batch.restrict_to_valid()
        scores, pos_mask, neg_mask = valid.scores, valid.pos_mask, valid.neg_mask
        # One row per (anchor q, positive i) pair, from the labels (host).
        anchor_idx, pos_idx = valid.send(*valid.host.positive_pairs())
        n_pairs = anchor_idx.numel()
        pair_score = scores[anchor_idx, pos_idx]
        # above[p, j] ≈ 1 when reference j scores above positive i for anchor q (pair p = (q, i)).
        rows = scores.index_select(0, anchor_idx)
        above = torch.sigmoid((rows - pair_score[:, None]) / self.temperature)
        other_pos = pos_mask.index_select(0, anchor_idx)
        # The positive itself is not ranked above itself (sigmoid(0) = ½ would be added otherwise).
        other_pos[torch.arange(n_pairs, device=scores.device), pos_idx] = False
        zero = above.new_zeros(())
        rank_pos = 1.0 + torch.where(other_pos, above, zero).sum(dim=1)
        rank_all = rank_pos + torch.where(neg_mask.index_select(0, anchor_idx), above, zero).sum(
            dim=1
        )
        precision = rank_pos / rank_all
        ap_sum = scores.new_zeros(scores.shape[0]).index_add(0, anchor_idx, precision)
        return ap_sum / pos_mask.sum(dim=1).to(scores.dtype)

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """The loss of a validated batch (see the class docstring)."""
        ap = self.smooth_average_precision(batch)
        mean_ap = ap.mean()
        self.last_stats["mean_smooth_ap"] = mean_ap.detach()
        return 1.0 - mean_ap

    def extra_repr(self) -> str:
        """The constructor arguments, shown by ``repr``."""
        return f"temperature={self.temperature:g}, similarity={self.similarity!r}"
