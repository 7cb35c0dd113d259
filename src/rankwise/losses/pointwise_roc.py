"""Pointwise ROC loss: maximize the TPR of a thresholded similarity subject to FPR ≤ α.

For neural similarities (Vogel, Bellet & Clémençon, *A Probabilistic Theory of Supervised
Similarity Learning for Pointwise ROC Curve Optimization*, ICML 2018, problem (1) and its empirical
form (6), with the Lagrangian of Eq. (2)).

The similarity of a pair is S(x, x') = 1{s(x, x') ≥ t}; over a batch its TPR R̂⁺ and FPR R̂⁻ are
the U-statistics of Eq. (4)/(5) over the pairs i < j. The loss is the negated Lagrangian
−(R̃⁺ − λ (R̃⁻ − α)) with the indicator replaced by a smooth surrogate ψ of u = (s − t)/τ
(:func:`surrogate_risks`); the multiplier λ ≥ 0 (a buffer) follows projected dual ascent
λ ← max(0, λ + η (R̂⁻ − α)) after every training batch. ``dual_update="indicator"`` (default)
steps on the indicator's FPR (the "proxy Lagrangian" of Cotter, Jiang & Sridharan, ALT 2019),
``"surrogate"`` on R̃⁻ (docs/pointwise_roc.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from .._validation import Interval, as_tensor, check_choice, check_scalar
from .base import BatchLayout, PairBatch, RankingLoss

__all__ = [
    "DUAL_UPDATES",
    "PointwiseROCLoss",
    "SURROGATES",
    "pair_score_sets",
    "pointwise_roc_lagrangian",
    "surrogate_risks",
]

SURROGATES = ("sigmoid", "softplus")
DUAL_UPDATES = ("indicator", "surrogate")

_OPEN_UNIT = Interval("real", 0, 1, closed="neither")
_POSITIVE = Interval("real", 0, None, closed="neither")
_NON_NEGATIVE = Interval("real", 0, None)
_SOFTPLUS_ONE = math.log1p(math.e)  # softplus(1), the normalizer of the softplus bounds


def surrogate_risks(
    pos_margins: torch.Tensor,
    neg_margins: torch.Tensor,
    surrogate: str = "sigmoid",
    *,
    neg_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Smooth surrogates (R̃⁺, R̃⁻) of the TPR and FPR of the indicator 1{u ≥ 0}.

    ``"sigmoid"``: ψ(u) = σ(u) for both; ψ → 1{u ≥ 0} as the temperature goes to 0, but its
    gradient vanishes for pairs far on the wrong side.

    ``"softplus"``: smoothed hinge bounds, R̃⁺ = mean(1 − softplus(1 − u)/softplus(1)) ≤ TPR and
    R̃⁻ = mean(softplus(1 + u)/softplus(1)) ≥ FPR (both exact bounds of the indicator, and linear,
    never flat, on the wrong side), the bounds of Eban et al., AISTATS 2017, made smooth.

    Args:
        pos_margins: (P,) u = (s − t)/τ of the positive pairs.
        neg_margins: (Q,) u of the negative pairs.
        surrogate: ``"sigmoid"`` or ``"softplus"``.
        neg_weight: optional (Q,) non-negative weights of the negative pairs: R̃⁻ is then their
            weighted mean (e.g. the n_k n_l / n⁻ weights of a tuple-based sample, Sec. 4).

    Returns:
        Two scalar tensors.
    """
    if surrogate == "sigmoid":
        positive, negative_terms = torch.sigmoid(pos_margins).mean(), torch.sigmoid(neg_margins)
    elif surrogate == "softplus":
        positive = 1 - F.softplus(1 - pos_margins).mean() / _SOFTPLUS_ONE
        negative_terms = F.softplus(1 + neg_margins) / _SOFTPLUS_ONE
    else:
        raise ValueError(f"`surrogate` must be one of {SURROGATES}, got {surrogate!r}.")
    if neg_weight is None:
        return positive, negative_terms.mean()
    weight = neg_weight.to(negative_terms.dtype)
    return positive, (negative_terms * weight).sum() / weight.sum()


def pointwise_roc_lagrangian(
    pos_scores: torch.Tensor,
    neg_scores: torch.Tensor,
    multiplier: float | torch.Tensor,
    alpha: float,
    threshold: float | torch.Tensor = 0.0,
    temperature: float = 1.0,
    surrogate: str = "sigmoid",
    *,
    neg_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The negated Lagrangian −(R̃⁺ − λ(R̃⁻ − α)) of problem (1) on given pair scores.

    Args:
        pos_scores: (P,) scores of the positive pairs (differentiable).
        neg_scores: (Q,) scores of the negative pairs.
        multiplier: λ ≥ 0 (not differentiated).
        alpha: the FPR budget α.
        threshold: t, a float or a scalar tensor (which may require grad).
        temperature: τ > 0; the margins are u = (s − t)/τ.
        surrogate: see :func:`surrogate_risks`.
        neg_weight: optional (Q,) weights of the negative pairs, see :func:`surrogate_risks`.

    Returns:
        ``(loss, positive_risk, negative_risk)``, the last two the surrogate risks R̃⁺, R̃⁻.
    """
    # a copy: the buffer is updated in place after the call, autograd must keep this value
    lam = multiplier.detach().clone() if isinstance(multiplier, torch.Tensor) else multiplier
    positive, negative = surrogate_risks(
        (pos_scores - threshold) / temperature,
        (neg_scores - threshold) / temperature,
        surrogate,
        neg_weight=neg_weight,
    )
    if isinstance(lam, torch.Tensor):
        lam = lam.to(positive.dtype)
    return -(positive - lam * (negative - alpha)), positive, negative


def pair_score_sets(batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) positive and (Q,) negative pair scores of a batch, the pairs of Eq. (4)/(5).

    Without a reference set every unordered pair {i, j} of the batch counts once (i < j, the
    U-statistics of the paper); with one, every (anchor, reference) pair counts once.
    """
    pos_index, neg_index = batch.send(*batch.host.pattern_cached("pair_set_index", _pair_set_index))
    flat = batch.scores.reshape(-1)
    return flat.index_select(0, pos_index), flat.index_select(0, neg_index)


def _pair_set_index(host: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major flat positions of :func:`pair_score_sets`' pairs, from the labels (host)."""
    pos, neg = host.pos_mask, host.neg_mask
    if host.self_reference:
        upper = torch.ones(pos.shape, dtype=torch.bool).triu_(1)
        pos, neg = pos & upper, neg & upper
    return pos.reshape(-1).nonzero().squeeze(1), neg.reshape(-1).nonzero().squeeze(1)


class PointwiseROCLoss(RankingLoss):
    """Maximize the TPR at FPR ≤ α of the thresholded similarity 1{s(x, x') ≥ t} (problem (1)).

    The value and the dual step are those of the module docstring, over the pairs i < j of the
    batch (or the anchor–reference pairs); a training call's loss uses λ from before its step.
    Eval mode never changes a buffer, and a call that raises changes none either.

    Deploy with "same class" iff s(x, x') ≥ ``threshold`` (check the FPR on held-out pairs with
    :func:`rankwise.metrics.roc_curve_from_embeddings`).

    Args:
        alpha: the FPR budget α in (0, 1).
        threshold: t, in the units of the similarity (cosine: in (−1, 1); default 0.5).
        temperature: τ > 0 of the surrogate (default 0.05 for cosine).
        surrogate: ``"sigmoid"`` (default) or ``"softplus"`` (smoothed hinge bounds).
        dual_lr: η ≥ 0, the dual step size (0 freezes λ).
        initial_multiplier: λ₀ ≥ 0.
        dual_update: ``"indicator"`` (default) or ``"surrogate"``.
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"euclidean"`` (negative Euclidean
            distance; alias ``"neg_euclidean"``), see :mod:`rankwise.similarity`.

    Buffers (``state_dict()``, ``.to()``): ``multiplier`` (λ, float64 scalar), ``n_dual_steps``
    (int64 scalar).

    ``last_stats`` after a call: ``tpr`` and ``fpr`` (indicator, on the batch pairs),
    ``positive_risk`` / ``negative_risk`` (surrogates), ``multiplier`` (λ used by the call),
    ``n_positive_pairs``, ``n_negative_pairs`` and the anchor counts of :class:`RankingLoss`.

    Example:
        >>> import torch
        >>> from rankwise.losses import PointwiseROCLoss
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> loss_fn = PointwiseROCLoss(alpha=0.1, threshold=0.5)
        >>> round(loss_fn(emb, torch.tensor([0, 0, 1, 1])).item(), 4), loss_fn.last_stats["fpr"]
        (-0.5954, 0.5)
        >>> float(loss_fn.multiplier)  # one dual step: 1 + 0.5 * (0.5 - 0.1)
        1.2
    """

    multiplier: torch.Tensor
    n_dual_steps: torch.Tensor

    def __init__(
        self,
        alpha: float = 0.05,
        threshold: float = 0.5,
        temperature: float = 0.05,
        surrogate: str = "sigmoid",
        dual_lr: float = 0.5,
        initial_multiplier: float = 1.0,
        dual_update: str = "indicator",
        similarity: str = "cosine",
    ) -> None:
        super().__init__(similarity)
        self.alpha = check_scalar(alpha, "alpha", _OPEN_UNIT)
        self.threshold = check_scalar(threshold, "threshold", Interval("real"))
        if similarity == "cosine" and not -1 < self.threshold < 1:
            raise ValueError(
                f"`threshold` must lie in (-1, 1) for cosine similarity, got {threshold!r}."
            )
        self.temperature = check_scalar(temperature, "temperature", _POSITIVE)
        self.surrogate = check_choice(surrogate, "surrogate", SURROGATES)
        self.dual_lr = check_scalar(dual_lr, "dual_lr", _NON_NEGATIVE)
        self.dual_update = check_choice(dual_update, "dual_update", DUAL_UPDATES)
        start = check_scalar(initial_multiplier, "initial_multiplier", _NON_NEGATIVE)
        self.register_buffer("multiplier", torch.tensor(start, dtype=torch.float64))
        self.register_buffer("n_dual_steps", torch.tensor(0, dtype=torch.long))

    @classmethod
    def from_labels(cls, train_labels: Any, **kwargs: Any) -> PointwiseROCLoss:
        """Build the loss after checking that the training labels can form both kinds of pairs.

        No class prior enters the loss: the labels only need two classes and a class of two.

        Args:
            train_labels: (N,) integer class ids of the training set.
            **kwargs: the arguments of :class:`PointwiseROCLoss`.

        Raises:
            ValueError: labels that are not 1-D integers, a single class, or no class with two
                samples.
        """
        labels = as_tensor(train_labels, "train_labels")
        if labels.ndim != 1 or labels.is_floating_point() or labels.dtype == torch.bool:
            raise ValueError(
                "`train_labels` must be a 1-D array of integer class ids, got shape "
                f"{tuple(labels.shape)} and dtype {labels.dtype}."
            )
        _, counts = torch.unique(labels, return_counts=True)
        if counts.numel() < 2:
            raise ValueError(
                "`train_labels` holds a single class: there is no negative pair, so the FPR "
                "constraint is undefined; train on at least two classes."
            )
        if int(counts.max()) < 2:
            raise ValueError(
                "`train_labels` has no class with two samples: there is no positive pair, so the "
                "TPR is undefined."
            )
        return cls(**kwargs)

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """Negated Lagrangian of the batch; one dual step on λ in training mode (see the class)."""
        if self.multiplier.device != batch.scores.device:
            raise ValueError(
                f"PointwiseROCLoss buffers are on {self.multiplier.device} but `embeddings` are "
                f"on {batch.scores.device}; move the loss with loss.to(device)."
            )
        pos_scores, neg_scores = pair_score_sets(batch)
        if pos_scores.numel() == 0 or neg_scores.numel() == 0:  # pragma: no cover - prepare checks
            raise ValueError("PointwiseROCLoss: the batch has no positive or no negative pair.")
        used = self.multiplier.detach().clone()  # λ of this call: the buffer is stepped below
        loss, positive, negative = pointwise_roc_lagrangian(
            pos_scores,
            neg_scores,
            used,
            self.alpha,
            self.threshold,
            self.temperature,
            self.surrogate,
        )
        with torch.no_grad():
            tpr = (pos_scores >= self.threshold).double().mean()
            fpr = (neg_scores >= self.threshold).double().mean()
        self.last_stats.update(
            tpr=tpr,
            fpr=fpr,
            positive_risk=positive.detach(),
            negative_risk=negative.detach(),
            multiplier=used,
            n_positive_pairs=int(pos_scores.numel()),
            n_negative_pairs=int(neg_scores.numel()),
        )
        if self.training and self.dual_lr > 0:
            self._dual_step(fpr if self.dual_update == "indicator" else negative.detach(), batch)
        return loss

    @torch.no_grad()
    def _dual_step(self, risk: torch.Tensor, batch: PairBatch) -> None:
        """One dual step λ ← max(0, λ + η (risk − α)), on the device.

        A refused call (``batch.inputs_ok`` False: non-finite scores, so a non-finite risk) keeps
        λ and the step count.
        """
        # the violation as a float, the step rounded to λ's dtype, as Python numbers would be
        violation = risk.to(torch.float64) - self.alpha
        stepped = (self.multiplier + (self.dual_lr * violation).to(self.multiplier.dtype)).clamp(
            min=0.0
        )
        ok = batch.inputs_ok if batch.inputs_ok is not None else torch.isfinite(violation)
        self.multiplier.copy_(torch.where(ok, stepped, self.multiplier))
        self.n_dual_steps.add_(ok.to(self.n_dual_steps.dtype))

    def extra_repr(self) -> str:
        """The hyper-parameters and the current multiplier, for ``repr``."""
        return (
            f"alpha={self.alpha}, threshold={self.threshold}, temperature={self.temperature}, "
            f"surrogate={self.surrogate!r}, dual_lr={self.dual_lr}, "
            f"dual_update={self.dual_update!r}, multiplier={float(self.multiplier):.4g}, "
            + super().extra_repr()
        )
