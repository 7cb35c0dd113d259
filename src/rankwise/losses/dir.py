"""DIR loss: average precision over a quantized, histogram-binned ranking.

After Revaud, Almazán, Rezende and de Souza, "Learning with Average Precision: Training Image
Retrieval with a Listwise Loss" (ICCV 2019), Sec. 3 (quantization function and quantized AP, AP_Q).
The score range is split into ``M`` bins with centres ``b_1 > ... > b_M`` and every score is spread
over its two nearest bins by the triangular kernel
``δ(s, m) = max(0, 1 - |s - b_m| (M - 1) / (hi - lo))``. Per anchor, with ``P_m = Σ_pos δ`` and
``N_m = Σ_{pos ∪ neg} δ``, the quantized precision and incremental recall are
``prec_m = Σ_{m' ≤ m} P_m' / Σ_{m' ≤ m} N_m'`` and ``r_m = P_m / |pos|``, and
``AP_Q = Σ_m prec_m r_m``; the loss is ``1 - mean AP_Q``. As in the authors' released ``APLoss``
(naver/deep-image-retrieval), the top and bottom bins are half-open, so a score above ``hi`` (below
``lo``) is counted fully in the top (bottom) bin and the kernel weights of every score sum to 1
whatever the similarity.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from .._validation import Interval, check_range_pair, check_scalar
from .base import PairBatch, RankingLoss

__all__ = ["DIRLoss", "quantized_average_precision", "triangular_bin_weights"]


def triangular_bin_weights(
    scores: torch.Tensor, num_bins: int, score_range: tuple[float, float]
) -> torch.Tensor:
    """Soft assignment of every score to ``num_bins`` bins, highest bin first.

    Args:
        scores: (B, M) float scores.
        num_bins: number of bins ``M >= 2``.
        score_range: ``(lo, hi)``; bin centres are ``hi, hi - Δ, ..., lo`` with
            ``Δ = (hi - lo) / (M - 1)``.

    Returns:
        (B, num_bins, M) weights in [0, 1]; along dim 1 they sum to 1 for every score.
    """
    lo, hi = float(score_range[0]), float(score_range[1])
    width = (hi - lo) / (num_bins - 1)
    centres = torch.linspace(hi, lo, num_bins, device=scores.device, dtype=scores.dtype)
    distance = scores.unsqueeze(1) - centres.view(1, -1, 1)  # (B, num_bins, M)
    weights = (1 - distance.abs() / width).clamp_min(0)
    # Half-open end bins: scores beyond the range stay entirely in the nearest end bin, so no
    # score is lost from the histogram (the authors' quantizer does the same).
    bin_index = torch.arange(num_bins, device=scores.device).view(1, -1, 1)
    beyond = ((bin_index == 0) & (distance >= 0)) | ((bin_index == num_bins - 1) & (distance <= 0))
    weights = torch.where(beyond, torch.ones_like(weights), weights)
    return weights


def _bin_histograms(
    scores: torch.Tensor,
    masks: tuple[torch.Tensor, ...],
    num_bins: int,
    score_range: tuple[float, float],
) -> tuple[torch.Tensor, ...]:
    """Σ_j mask[b, j] · δ(s[b, j], m) for every 0/1 float mask: (B, num_bins) each, O(B·M) memory."""
    stacked = torch.stack(masks)
    lo, hi = float(score_range[0]), float(score_range[1])
    return tuple(_TriangularHistograms.apply(scores, stacked, num_bins, lo, hi).unbind(0))


def _neighbour_bins(
    scores: torch.Tensor, num_bins: int, lo: float, hi: float, derivative: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(bin index, weight δ) of every score for its bins nearest − 1, nearest, nearest + 1.

    With ``derivative=True``, (bin index, dδ/ds) instead: the operations of
    :func:`triangular_bin_weights` and what autograd gives for them. Bins past the ends get 0.
    """
    width = (hi - lo) / (num_bins - 1)
    centres = torch.linspace(hi, lo, num_bins, device=scores.device, dtype=scores.dtype)
    nearest = ((hi - scores) / width).round().clamp(0, num_bins - 1).to(torch.int64)
    for offset in (-1, 0, 1):
        index = nearest + offset
        inside = (index >= 0) & (index < num_bins)
        index = index.clamp(0, num_bins - 1)
        distance = scores - centres[index]
        raw = 1 - distance.abs() / width
        beyond = ((index == 0) & (distance >= 0)) | ((index == num_bins - 1) & (distance <= 0))
        if derivative:
            value = torch.where(beyond | (raw < 0), 0.0, -distance.sign() / width)
        else:
            value = torch.where(beyond, 1.0, raw.clamp_min(0))
        yield index, torch.where(inside, value, 0.0)


class _TriangularHistograms(torch.autograd.Function):
    """(k, B, num_bins) histograms Σ_j masks[i, b, j] · δ(s[b, j], m) of (B, M) scores.

    Each score is scattered into its neighbouring bins only, and backward recomputes the weights'
    derivatives (autograd's intermediates took 3x the memory of the scores and masks). Values
    equal the dense form up to the order of the sums. Not twice differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any, scores: torch.Tensor, masks: torch.Tensor, num_bins: int, lo: float, hi: float
    ) -> torch.Tensor:
        out = scores.new_zeros(masks.shape[0], scores.shape[0], num_bins)
        for index, weight in _neighbour_bins(scores, num_bins, lo, hi):
            for i in range(masks.shape[0]):
                out[i].scatter_add_(1, index, weight * masks[i])
        ctx.save_for_backward(scores, masks)
        ctx.bins = (num_bins, lo, hi)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        scores, masks = ctx.saved_tensors
        grad_scores = torch.zeros_like(scores)
        num_bins, lo, hi = ctx.bins
        for index, slope in _neighbour_bins(scores, num_bins, lo, hi, derivative=True):
            upstream = masks[0] * grad[0].gather(1, index)
            for i in range(1, masks.shape[0]):
                upstream += masks[i] * grad[i].gather(1, index)
            grad_scores += slope * upstream
        return grad_scores, None, None, None, None


def quantized_average_precision(
    scores: torch.Tensor,
    pos_mask: torch.Tensor,
    neg_mask: torch.Tensor,
    num_bins: int = 20,
    score_range: tuple[float, float] = (-1.0, 1.0),
) -> torch.Tensor:
    """Histogram-binned AP_Q of every anchor (Revaud et al., Sec. 3).

    Args:
        scores: (B, M) float scores of each anchor against its references.
        pos_mask: (B, M) bool, the anchor's positives; every row needs at least one.
        neg_mask: (B, M) bool, the anchor's negatives; entries in neither mask are ignored.
        num_bins: number of bins.
        score_range: ``(lo, hi)`` covered by the bins.

    Returns:
        (B,) AP_Q per anchor, differentiable w.r.t. ``scores``.
    """
    pos = pos_mask.to(scores.dtype)
    ranked = (pos_mask | neg_mask).to(scores.dtype)
    pos_per_bin, all_per_bin = _bin_histograms(scores, (pos, ranked), num_bins, score_range)
    cum_pos = pos_per_bin.cumsum(-1)
    cum_all = all_per_bin.cumsum(-1)
    # Where nothing has been ranked yet (cum_all == 0) the bin holds no positive either, so its
    # term is 0; guard the division so that 0/0 does not turn into NaN gradients.
    nonempty = cum_all > 0
    precision = torch.where(nonempty, cum_pos / torch.where(nonempty, cum_all, 1), 0)
    n_pos = pos_mask.sum(-1, keepdim=True).to(scores.dtype)
    incremental_recall = pos_per_bin / n_pos
    return (precision * incremental_recall).sum(-1)


class DIRLoss(RankingLoss):
    """``1 - mean AP_Q``: the quantized listwise AP loss of Revaud et al. (ICCV 2019).

    Args:
        num_bins: number of histogram bins ``M`` (>= 2; the paper uses 20 for cosine scores).
        score_range: ``(lo, hi)`` spanned by the bin centres; ``(-1, 1)`` suits cosine scores.
            Scores outside it fall into the end bins.
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"neg_euclidean"``.

    Memory O(B·M): each score is added to its (at most two) neighbouring bins, never a
    (B, num_bins, M) block.

    ``last_stats`` holds the anchor / pair counts of :class:`~rankwise.losses.base.RankingLoss`
    plus ``"mean_ap_q"``.

    Example:
        >>> import torch
        >>> from rankwise.losses import DIRLoss
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> round(DIRLoss(num_bins=20)(emb, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.2254
    """

    def __init__(
        self,
        num_bins: int = 20,
        score_range: tuple[float, float] = (-1.0, 1.0),
        similarity: str = "cosine",
    ) -> None:
        super().__init__(similarity)
        self.num_bins = check_scalar(num_bins, "num_bins", Interval("integer", 2, None))
        self.score_range = check_range_pair(score_range, "score_range")

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """The loss of a validated batch (see the class docstring)."""
        b = batch.restrict_to_valid()
        ap = quantized_average_precision(
            b.scores, b.pos_mask, b.neg_mask, self.num_bins, self.score_range
        )
        self.last_stats["mean_ap_q"] = ap.detach().mean()
        return 1 - ap.mean()

    def extra_repr(self) -> str:
        """The constructor arguments, shown by ``repr``."""
        return (
            f"num_bins={self.num_bins}, score_range={self.score_range}, "
            f"similarity={self.similarity!r}"
        )
