"""BlackBox-AP: average precision from exact ranks with a blackbox-differentiated ranking.

After Rolínek, Musil, Paulus, Vlastelica, Michaelis and Martius, "Optimizing Rank-based Metrics
with Blackbox Differentiation" (CVPR 2020), Sec. 3 and 4. The ranking ``rk(s) = argmin_π <s, π>``
is piecewise constant; its blackbox gradient (Vlastelica et al., "Differentiation of Blackbox
Combinatorial Solvers", ICLR 2020; Rolínek et al., Eq. 4) is ``-(rk(s) - rk(s + λ ∂L/∂rk)) / λ``,
the exact gradient of a piecewise-linear interpolation of the loss whose strength is the
hyper-parameter ``λ``. AP is computed from exact ranks (Sec. 4) as ``AP = mean_{i ∈ pos} rk_pos(i)
/ rk(i)``, with ``rk_pos(i)`` the rank among the positives only (a constant, as in the paper). Two
choices make the interpolation a descent direction of AP (:class:`BlackBoxAP`, docs/losses.md): the
rank is differentiated only through the negatives above the positive, and ``λ`` perturbs each
anchor's own AP. The score margin (Sec. 4) shifts positive scores by ``-α/2`` and negative ones by
``+α/2`` before ranking; ranks are normalised by the number of columns, as in ``rank_normalised``.
"""

from __future__ import annotations

import math

import torch

from .._validation import Interval, check_scalar
from .base import PairBatch, RankingLoss

__all__ = ["BlackBoxAPLoss", "BlackBoxAP", "BlackBoxRank", "normalized_ranks"]


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


def _ranks_and_positive_ranks(
    scores: torch.Tensor, pos_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks / M (the row length) among all columns, and among the positives (0 off them)."""
    rank_all = normalized_ranks(scores)
    # Rank among positives = rank of the positive's overall rank among the positives; the
    # non-positives get +inf keys and sink below every positive.
    key = torch.where(pos_mask, rank_all, torch.full_like(rank_all, math.inf))
    rank_pos = torch.where(pos_mask, normalized_ranks(-key), torch.zeros_like(rank_all))
    return rank_all, rank_pos


class BlackBoxRank(torch.autograd.Function):
    """Exact normalised ranks with the blackbox-differentiation backward pass.

    The authors' ``TrueRanker``, a building block for losses of the ranks.

    ``BlackBoxRank.apply(scores (B, M), lambda_val: float) -> ranks (B, M)``; the backward pass
    returns ``-(rk(s) - rk(s + λ · grad_output)) / λ`` for ``scores`` and nothing for ``λ``.
    The perturbation is ``λ · grad_output`` itself, so a loss that averages over rows shrinks the
    effective ``λ`` by the number of rows; :class:`BlackBoxAP` does not have that coupling.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, lambda_val: float) -> torch.Tensor:
        """The normalised ranks of ``scores`` (B, M) within each row."""
        ranks = normalized_ranks(scores)
        ctx.lambda_val = lambda_val
        ctx.save_for_backward(scores, ranks)
        return ranks

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """``-(rk(s) - rk(s + λ · grad_output)) / λ`` for the scores."""
        scores, ranks = ctx.saved_tensors
        perturbed_ranks = normalized_ranks(scores + ctx.lambda_val * grad_output)
        return -(ranks - perturbed_ranks) / ctx.lambda_val, None


class BlackBoxAP(torch.autograd.Function):
    """Exact per-row average precision with a blackbox-differentiated backward pass.

    ``BlackBoxAP.apply(scores (B, M), pos_mask (B, M) bool, lambda_val: float) -> ap (B,)``.
    ``scores`` are already margin-shifted; excluded columns hold ``-inf``; every row needs a
    positive. ``AP_b = 1/|P_b| Σ_{i ∈ P_b} rp_i / r_i`` with normalised ranks ``r`` (all columns)
    and ``rp`` (positives only).

    Backward, per row ``b``: write ``r_i = rp_i + n_i`` with ``n_i`` the (normalised) count of
    negatives above positive ``i``. AP only depends on where the negatives lie between the
    positives, not on which positive is which, so ``rp`` is a constant and the rank is
    differentiated through ``n`` only. Its linearisation ``g_i = d(1 - AP_b)/dn_i =
    rp_i / (|P_b| r_i²)`` perturbs the row, ``s' = s + λ g``, and the blackbox gradient of
    ``1 - AP_b`` is ``-(m(s) - m(s')) / λ`` with ``m = n`` on positives and ``m = r`` (the rank,
    whose change counts the positives that crossed it) elsewhere. Differentiating the full rank
    ``r`` instead (the authors' ``TrueRanker`` on ``rp / r``) credits a positive for jumping over
    other positives, which the frozen ``rp`` makes look profitable (``1/r_i - 1/r_j > 0`` per
    swap) although AP is unchanged: that gradient only equalises the positives' scores and drives
    a network to a collapsed embedding. ``λ`` applies to each row's own ``1 - AP_b``; the row's
    gradient is then scaled by ``-grad_ap[b]`` (chain rule through the outer average), so the
    interpolation strength does not shrink with the number of rows.
    """

    @staticmethod
    def forward(
        ctx, scores: torch.Tensor, pos_mask: torch.Tensor, lambda_val: float
    ) -> torch.Tensor:
        """Per-row AP of the margin-shifted ``scores`` with positives ``pos_mask``."""
        rank_all, rank_pos = _ranks_and_positive_ranks(scores, pos_mask)
        n_pos = pos_mask.sum(1).to(scores.dtype)
        precision_at_positive = torch.where(pos_mask, rank_pos / rank_all, 0)
        ctx.lambda_val = lambda_val
        ctx.save_for_backward(scores, pos_mask, rank_all, rank_pos)
        return precision_at_positive.sum(1) / n_pos

    @staticmethod
    def backward(ctx, grad_ap: torch.Tensor):
        """The blackbox gradient of each row's ``1 - AP`` (see the class docstring)."""
        scores, pos_mask, rank_all, rank_pos = ctx.saved_tensors
        lam = ctx.lambda_val
        n_pos = pos_mask.sum(1, keepdim=True).to(scores.dtype)
        # d(1 - AP_b)/d n_i for positives; negatives and excluded columns are not perturbed.
        dloss_dnegatives_above = torch.where(pos_mask, rank_pos / (n_pos * rank_all**2), 0)
        perturbed_all, perturbed_pos = _ranks_and_positive_ranks(
            scores + lam * dloss_dnegatives_above, pos_mask
        )
        # rank_pos is 0 off the positives, so this is n on positives and r elsewhere.
        moved = rank_all - rank_pos
        perturbed_moved = perturbed_all - perturbed_pos
        grad_one_minus_ap = -(moved - perturbed_moved) / lam
        return -grad_ap[:, None] * grad_one_minus_ap, None, None


class BlackBoxAPLoss(RankingLoss):
    """``1 - mean AP`` with exact ranks and blackbox-differentiated ranking (Rolínek et al. 2020).

    Args:
        lambda_val: interpolation strength ``λ > 0`` of the blackbox gradient, applied to each
            anchor's ``1 - AP`` (the paper's 4). At λ = 1 a from-scratch start (cosines inside the
            margin) gets no gradient at batch 224 (docs/losses.md).
        margin: score margin ``α >= 0``; positives are ranked with ``s - α/2``, negatives with
            ``s + α/2`` (paper: 0.02 for cosine scores). The reported loss is the AP of these
            shifted scores, which equals the exact AP of the raw scores when ``margin=0``. Keep
            it > 0 when training: AP of exact ranks ignores the scale of the scores, and without
            a margin nothing resists weight decay shrinking the embedding to a collapse.
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"neg_euclidean"``.

    ``last_stats`` holds the anchor / pair counts of :class:`~rankwise.losses.base.RankingLoss`
    plus ``"mean_ap"`` (of the margin-shifted scores). Ties are broken by reference index; the
    gradient is a surrogate (see :class:`BlackBoxAP`), so ``gradcheck`` does not apply.

    Example:
        >>> import torch
        >>> from rankwise.losses import BlackBoxAPLoss
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> loss_fn = BlackBoxAPLoss()
        >>> loss_fn(emb, torch.tensor([0, 0, 1, 1])).item(), loss_fn.last_stats["mean_ap"]
        (0.125, 0.875)
    """

    def __init__(
        self, lambda_val: float = 4.0, margin: float = 0.02, similarity: str = "cosine"
    ) -> None:
        super().__init__(similarity)
        self.lambda_val = float(
            check_scalar(lambda_val, "lambda_val", Interval("real", 0, None, closed="neither"))
        )
        self.margin = float(check_scalar(margin, "margin", Interval("real", 0, None)))

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """The loss of a validated batch (see the class docstring)."""
        b = batch.restrict_to_valid()
        ranked = b.pos_mask | b.neg_mask
        scores = b.scores
        if scores.dtype in (torch.float16, torch.bfloat16):
            # Half precision cannot hold ranks above 2048 (fp16) / 256 (bf16) exactly.
            scores = scores.float()
        shifted = scores - self.margin * (b.pos_mask.to(scores.dtype) - 0.5)
        # Excluded entries (the anchor itself) go to -inf: they sink below every reference and do
        # not move any rank, and they are never perturbed; masked_fill's backward sends them no
        # gradient.
        shifted = shifted.masked_fill(~ranked, float("-inf"))
        ap = BlackBoxAP.apply(shifted, b.pos_mask, self.lambda_val)
        self.last_stats["mean_ap"] = ap.detach().mean()
        return 1 - ap.mean()

    def extra_repr(self) -> str:
        """The constructor arguments, shown by ``repr``."""
        return f"lambda_val={self.lambda_val}, margin={self.margin}, similarity={self.similarity!r}"
