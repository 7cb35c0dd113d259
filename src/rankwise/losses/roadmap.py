"""ROADMAP: the SupAP rank surrogate plus the calibration loss (Ramzi et al., NeurIPS 2021).

Ramzi, Thome, Rambour, Audebert and Bitot, *Robust and Decomposable Average Precision for Image
Retrieval* (NeurIPS 2021), Sec. 3: the average precision of each anchor's ranking, AP_q =
(1/|P_q|) Σ_{i∈P_q} rank⁺(i) / (rank⁺(i) + rank⁻(i)), where rank⁺ counts the positives scored at or
above i with the true Heaviside step (a constant: no gradient) and rank⁻ sums over the negatives
the SupAP surrogate H⁻ of the step, which upper-bounds it: a sigmoid of temperature τ below the
positive's score, σ(t/τ) + ½ up to a margin δ above it, and a line of slope ρ beyond, so a negative
scored far above a positive keeps a gradient instead of saturating. The decomposability half is a
calibration loss pushing positive pair scores above one margin and negative ones below another (a
contrastive loss). The exact forms, reductions and defaults are those of the authors' released code
(``roadmap/losses/smooth_rank_ap.py`` and ``calibration_loss.py``, configuration
``config/loss/roadmap.yaml``; docs/losses.md names the commit and where this departs from it).
"""

from __future__ import annotations

from typing import Any

import torch

from .._validation import Interval, check_scalar
from ._pair_ranks import pair_sums
from .base import PairBatch, RankingLoss

__all__ = ["ROADMAPLoss"]

_POSITIVE = Interval("real", 0, None, closed="neither")
_NON_NEGATIVE = Interval("real", 0, None)
_REAL = Interval("real")


def _heaviside(diff: torch.Tensor) -> torch.Tensor:
    """1 where a positive scores at or above positive i (ties count, as torch.heaviside(·, 1))."""
    return (diff >= 0).to(diff.dtype)


def _mean_of_nonzero(losses: torch.Tensor) -> torch.Tensor:
    """Mean of the positive entries (0 when there are none).

    pytorch-metric-learning's ``AvgNonZeroReducer``, which the released calibration loss uses;
    the count stays a tensor, so nothing is read back to the host.
    """
    count = (losses > 0).sum().clamp(min=1).to(losses.dtype)
    return losses.sum() / count


class ROADMAPLoss(RankingLoss):
    """ROADMAP loss: 1 − mean_q SupAP_q + λ · calibration loss.

    For anchor q with positives P_q and negatives N_q (itself excluded without a reference set),
    each positive i and t = s_qz − s_qi:

        rank⁺(i) = 1 + Σ_{z∈P_q, z≠i} H(t)                      H: 1 for t ≥ 0, else 0
        rank⁻(i) = Σ_{z∈N_q} H⁻(t)
        H⁻(t) = σ(t/τ)                 for t ≤ 0
                σ(t/τ) + ½             for 0 < t ≤ δ
                ρ (t − δ) + offset     for t > δ
        SupAP_q = (1/|P_q|) Σ_{i∈P_q} rank⁺(i) / (rank⁺(i) + rank⁻(i))

    rank⁺ is a constant (the step has no gradient): only negatives move the ranks. H⁻ ≥ H for
    t ≠ 0 (with offset >= 1), so SupAP_q is at most the AP of q's ranking and 1 − SupAP_q bounds
    the AP loss from above. The calibration loss over every positive pair (q, z) and negative pair of the
    batch is mean⁺ [α − s_qz]₊ + mean⁺ [s_qz − β]₊, each mean taken over the pairs whose hinge is
    not zero (the released code's reducer), α = ``pos_margin``, β = ``neg_margin``.

    Memory: the (B, M) scores plus blocks of at most 2²² (anchor-positive pair, reference)
    differences, recomputed in the backward pass (``rankwise.losses._pair_ranks``).

    Args:
        tau: sigmoid temperature τ > 0 of H⁻; 0.01 in the released configuration.
        rho: slope ρ >= 0 of H⁻ beyond the margin; 100.
        delta: margin δ >= 0 where H⁻ turns linear; 0.05.
        offset: H⁻ just beyond δ, >= 0; 1.44 in the released configuration (σ(δ/τ) + ½ = 1.4933
            would make H⁻ continuous at δ; the code's own default when no offset is given).
        pos_margin: α, positive pair scores below it are penalised; 0.9 (cosine scale).
        neg_margin: β <= α, negative pair scores above it are penalised; 0.6.
        calibration_weight: λ >= 0 multiplying the calibration loss; 1 (the released
            configuration gives both terms weight 1.0); 0 leaves SupAP alone.
        similarity: ``"cosine"`` (default, the paper's L2-normalised embeddings), ``"dot"`` or
            ``"neg_euclidean"`` (then choose margins on that scale).

    ``last_stats`` adds ``mean_supap`` (mean_q SupAP_q) and ``calibration`` (the calibration
    loss), as detached 0-d tensors (nothing is read back to the host during the step).

    Example:
        >>> import torch
        >>> from rankwise.losses import ROADMAPLoss
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> loss_fn = ROADMAPLoss()
        >>> round(loss_fn(emb, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.5748
        >>> round(float(loss_fn.last_stats["mean_supap"]), 4), loss_fn.last_stats["n_anchors_used"]
        (0.7984, 4)
    """

    def __init__(
        self,
        tau: float = 0.01,
        rho: float = 100.0,
        delta: float = 0.05,
        offset: float = 1.44,
        pos_margin: float = 0.9,
        neg_margin: float = 0.6,
        calibration_weight: float = 1.0,
        similarity: str = "cosine",
    ) -> None:
        super().__init__(similarity)
        self.tau = check_scalar(tau, "tau", _POSITIVE)
        self.rho = check_scalar(rho, "rho", _NON_NEGATIVE)
        self.delta = check_scalar(delta, "delta", _NON_NEGATIVE)
        self.offset = check_scalar(offset, "offset", _NON_NEGATIVE)
        self.pos_margin = check_scalar(pos_margin, "pos_margin", _REAL)
        self.neg_margin = check_scalar(neg_margin, "neg_margin", _REAL)
        if self.neg_margin > self.pos_margin:
            raise ValueError(
                f"`neg_margin` ({self.neg_margin:g}) must not exceed `pos_margin` "
                f"({self.pos_margin:g}): negatives are pushed below neg_margin, positives above "
                "pos_margin."
            )
        self.calibration_weight = check_scalar(
            calibration_weight, "calibration_weight", _NON_NEGATIVE
        )

    # -- the rank surrogate ---------------------------------------------------------------------
    def upper_step(self, diff: torch.Tensor) -> torch.Tensor:
        """H⁻(t) of the class docstring, elementwise: the surrogate of the step for negatives."""
        sig = torch.sigmoid(diff / self.tau)
        linear = self.rho * (diff - self.delta) + self.offset
        return torch.where(diff > self.delta, linear, torch.where(diff > 0, sig + 0.5, sig))

    def _upper_step_grad(self, diff: torch.Tensor) -> torch.Tensor:
        """dH⁻/dt: ρ beyond δ, σ'(t/τ)/τ elsewhere (the jumps at 0 and δ have no gradient)."""
        sig = torch.sigmoid(diff / self.tau)
        slope = torch.full_like(diff, self.rho)
        return torch.where(diff > self.delta, slope, sig * (1 - sig) / self.tau)

    def average_precision(self, batch: PairBatch) -> torch.Tensor:
        """(B,) SupAP_q of every anchor (0 for anchors that cannot be ranked)."""
        scores = batch.scores
        # the pairs come from the labels, on the host: no device sync sizes the blocks
        anchors, positives = batch.send(*batch.host.positive_pairs())
        rank_pos = 1.0 + pair_sums(scores, anchors, positives, batch.pos_mask, _heaviside)
        rank_neg = pair_sums(
            scores, anchors, positives, batch.neg_mask, self.upper_step, self._upper_step_grad
        )
        precision = rank_pos / (rank_pos + rank_neg)
        ap_sum = scores.new_zeros(scores.shape[0]).index_add(0, anchors, precision)
        return ap_sum / batch.pos_mask.sum(dim=1).clamp(min=1).to(scores.dtype)

    # -- the calibration loss -------------------------------------------------------------------
    def calibration(self, batch: PairBatch) -> torch.Tensor:
        """The calibration loss over every positive and negative pair of the batch (scalar)."""
        scores = batch.scores
        zero = scores.new_zeros(())
        pos = torch.where(batch.pos_mask, torch.relu(self.pos_margin - scores), zero)
        neg = torch.where(batch.neg_mask, torch.relu(scores - self.neg_margin), zero)
        return _mean_of_nonzero(pos) + _mean_of_nonzero(neg)

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """The loss of a validated batch (see the class docstring)."""
        ap = self.average_precision(batch)
        valid = batch.valid.to(ap.dtype)
        mean_ap = (ap * valid).sum() / valid.sum()
        calibration = self.calibration(batch)
        stats: dict[str, Any] = self.last_stats  # detached tensors, read when logged
        stats["mean_supap"] = mean_ap.detach()
        stats["calibration"] = calibration.detach()
        return (1.0 - mean_ap) + self.calibration_weight * calibration

    def extra_repr(self) -> str:
        """The constructor arguments, shown by ``repr``."""
        return (
            f"tau={self.tau:g}, rho={self.rho:g}, delta={self.delta:g}, offset={self.offset:g}, "
            f"pos_margin={self.pos_margin:g}, neg_margin={self.neg_margin:g}, "
            f"calibration_weight={self.calibration_weight:g}, similarity={self.similarity!r}"
        )
