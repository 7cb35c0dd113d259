"""BlackBox-AP: average precision from exact ranks, differentiated with blackbox differentiation of
the ranking function, after Rolínek, Musil, Paulus, Vlastelica, Michaelis and Martius, "Optimizing
Rank-based Metrics with Blackbox Differentiation" (CVPR 2020), Sec. 3 and 4. The ranking
``rk(s) = argmin_π <s, π>`` is piecewise constant; its blackbox gradient (Vlastelica et al.,
"Differentiation of Blackbox Combinatorial Solvers", ICLR 2020; Rolínek et al., Sec. 3) is
``-(rk(s) - rk(s + λ ∂L/∂rk)) / λ``, the exact gradient of a
piecewise-linear interpolation of the loss whose strength is the hyper-parameter ``λ``. AP is
computed from exact ranks as ``AP = mean_{i ∈ pos} rk_pos(i) / rk(i)`` (Sec. 4), with ``rk(i)`` the
rank of positive ``i`` among all the anchor's references and ``rk_pos(i)`` its rank among the
positives only (treated as a constant, as in the paper). The score margin (Sec. 4) lowers every
positive score by ``α/2`` and raises every negative score by ``α/2`` before ranking, so a positive
only counts as ranked above a negative when it beats it by ``α``. Ranks are normalised by the
number of columns of the score matrix, as in the authors' ``rank_normalised``, which fixes the
scale on which ``λ`` (default 4, the paper's retrieval setting) acts.
"""

from __future__ import annotations

import math

import torch

from .base import PairBatch, RankingLoss

__all__ = ["BlackBoxAPLoss", "BlackBoxRank", "normalized_ranks"]


def normalized_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of every entry within its row, highest score first, divided by the row length.

    Args:
        scores: (B, M) float scores; ``-inf`` entries sink to the bottom and do not change the
            ranks of the finite ones.

    Returns:
        (B, M) tensor of ranks ``1/M, 2/M, ..., 1`` in the dtype of ``scores``; ties are broken by
        column index (a stable sort), so equal scores get distinct ranks.
    """
    order = torch.argsort(scores, dim=1, descending=True, stable=True)
    positions = torch.arange(1, scores.shape[1] + 1, device=scores.device, dtype=scores.dtype)
    ranks = torch.empty_like(scores)
    ranks.scatter_(1, order, positions.expand_as(scores).contiguous())
    return ranks / scores.shape[1]


class BlackBoxRank(torch.autograd.Function):
    """Exact normalised ranks with the blackbox-differentiation backward pass.

    ``BlackBoxRank.apply(scores (B, M), lambda_val: float) -> ranks (B, M)``; the backward pass
    returns ``-(rk(s) - rk(s + λ · grad_output)) / λ`` for ``scores`` and nothing for ``λ``.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, lambda_val: float) -> torch.Tensor:
        ranks = normalized_ranks(scores)
        ctx.lambda_val = lambda_val
        ctx.save_for_backward(scores, ranks)
        return ranks

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        scores, ranks = ctx.saved_tensors
        perturbed_ranks = normalized_ranks(scores + ctx.lambda_val * grad_output)
        return -(ranks - perturbed_ranks) / ctx.lambda_val, None


class BlackBoxAPLoss(RankingLoss):
    """``1 - mean AP`` with exact ranks and blackbox-differentiated ranking (Rolínek et al. 2020).

    Args:
        lambda_val: interpolation strength ``λ > 0`` of the blackbox gradient (paper: 4).
        margin: score margin ``α >= 0``; positives are ranked with ``s - α/2``, negatives with
            ``s + α/2`` (paper: 0.02 for cosine scores). The reported loss is the AP of these
            shifted scores, which equals the exact AP of the raw scores when ``margin=0``.
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"neg_euclidean"``.

    Call as ``loss(embeddings (B, d), labels (B,), ref_embeddings=None (M, d),
    ref_labels=None (M,))``; returns a scalar. ``last_stats`` holds the anchor / pair counts of
    :class:`~rankwise.losses.base.RankingLoss` plus ``"mean_ap"`` (of the margin-shifted scores).
    Ties are broken by reference index; the gradient is a surrogate, so ``gradcheck`` does not
    apply.
    """

    def __init__(
        self, lambda_val: float = 4.0, margin: float = 0.02, similarity: str = "cosine"
    ) -> None:
        super().__init__(similarity)
        if not (isinstance(lambda_val, (int, float)) and math.isfinite(lambda_val)
                and lambda_val > 0):
            raise ValueError(f"`lambda_val` must be a finite number > 0, got {lambda_val!r}.")
        if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 0):
            raise ValueError(f"`margin` must be a finite number >= 0, got {margin!r}.")
        self.lambda_val = float(lambda_val)
        self.margin = float(margin)

    def compute(self, batch: PairBatch) -> torch.Tensor:
        b = batch.restrict_to_valid()
        ranked = b.pos_mask | b.neg_mask
        scores = b.scores
        if scores.dtype in (torch.float16, torch.bfloat16):
            # Half precision cannot hold ranks above 2048 (fp16) / 256 (bf16) exactly.
            scores = scores.float()
        shifted = scores - self.margin * (b.pos_mask.to(scores.dtype) - 0.5)
        # Excluded entries (the anchor itself) go to -inf: they sink below every reference and do
        # not move any rank; masked_fill's backward sends them no gradient.
        shifted = shifted.masked_fill(~ranked, float("-inf"))
        rank_all = BlackBoxRank.apply(shifted, self.lambda_val)
        with torch.no_grad():
            # Rank among positives = rank of the positive's overall rank among the positives.
            key = torch.where(b.pos_mask, rank_all, torch.full_like(rank_all, math.inf))
            rank_pos = normalized_ranks(-key)
        precision_at_positive = torch.where(b.pos_mask, rank_pos / rank_all, 0)
        ap = precision_at_positive.sum(1) / b.pos_mask.sum(1).to(scores.dtype)
        self.last_stats["mean_ap"] = float(ap.detach().mean())
        return 1 - ap.mean()

    def extra_repr(self) -> str:
        return (
            f"lambda_val={self.lambda_val}, margin={self.margin}, similarity={self.similarity!r}"
        )
