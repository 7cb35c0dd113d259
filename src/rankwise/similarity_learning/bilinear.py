"""Bilinear similarities for pointwise ROC optimization.

Vogel, Bellet & Clémençon (ICML 2018, Sec. 5.1): S_A(x, x') = ½(1 + xᵀAx') with ‖A‖_F ≤ 1 on
L2-normalized inputs, so that S_A ∈ [0, 1].

:class:`BilinearSimilarity` solves the empirical problem (6), max R̂⁺(S_A) subject to
R̂⁻(S_A) ≤ α + Φ, in closed form, A ∝ P − λN with λ found by bisection
(:func:`projected_gradient_bilinear` solves it iteratively, the check of the closed form). Its risks
are *mean* similarities, so α bounds the average score of the negative pairs, not an FPR;
``risk="indicator"`` solves problem (1) for 1{S_A ≥ t} instead, by the smoothed Lagrangian of
:mod:`rankwise.losses.pointwise_roc` (docs/pointwise_roc.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.utils.validation import check_is_fitted

from .._validation import Interval, check_bool, check_choice, check_scalar
from ..losses.pointwise_roc import SURROGATES, pointwise_roc_lagrangian
from ..metrics import operating_point, tpr_at_fpr
from ..sampling.pairs import class_structure
from ._pair_data import (
    NEGATIVE_SCHEMES,
    PairSet,
    check_features,
    check_training_data,
    check_unit_rows,
    limited_threads,
    normalize_rows,
    training_pairs,
)

__all__ = ["BilinearSimilarity", "RISKS", "pair_moment_matrices", "projected_gradient_bilinear"]

RISKS = ("mean", "indicator")
_OPEN_UNIT = Interval("real", 0, 1, closed="neither")
_NON_NEGATIVE = Interval("real", 0, None)
_POSITIVE = Interval("real", 0, None, closed="neither")
_COUNT = Interval("integer", 1, None)


# -- the matrices P and N of Sec. 5.1 --------------------------------------------------------------
def pair_moment_matrices(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """P = (1/2n⁺) Σ_{i<j, Y_i=Y_j} (X_i X_jᵀ + X_j X_iᵀ) and N, the same over Y_i ≠ Y_j.

    Computed from class sums in O(n d²): Σ_{i≠j} X_i X_jᵀ = s sᵀ − Σ_i X_i X_iᵀ for the sum s of
    a set of points, applied to every class (positive pairs) and to the whole set (all pairs).
    With them, the empirical risks of Eq. (4)/(5) of S_A are ½(1 + ⟨A, P⟩) and ½(1 + ⟨A, N⟩).

    Args:
        X: (n, d) features.
        y: (n,) class ids with two classes and a class of two samples.

    Returns:
        (P, N), two symmetric (d, d) float64 matrices.
    """
    groups = class_structure(y, "y")
    X = np.asarray(X, dtype=np.float64)
    total = X.sum(0)
    all_pairs = np.outer(total, total) - X.T @ X
    positive = np.zeros_like(all_pairs)
    for start, size in zip(groups.starts, groups.sizes, strict=True):
        members = X[groups.order[start : start + size]]
        class_sum = members.sum(0)
        positive += np.outer(class_sum, class_sum) - members.T @ members
    negative = all_pairs - positive
    return positive / (2 * groups.n_positive_pairs), negative / (2 * groups.n_negative_pairs)


def _weighted_moment(
    X: np.ndarray, first: np.ndarray, second: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """Σ_t w_t (X_a X_bᵀ + X_b X_aᵀ)/2 over the pairs (a, b) = (first[t], second[t])."""
    left = X[first] * weights[:, None]
    product = left.T @ X[second]
    return (product + product.T) / 2


# -- the closed form -------------------------------------------------------------------------------
def _direction(P: np.ndarray, N: np.ndarray, lam: float) -> np.ndarray:
    if math.isinf(lam):  # the limit λ → ∞: A = −N/‖N‖_F, the smallest negative risk
        return -N / np.linalg.norm(N)
    matrix = P - lam * N
    norm = np.linalg.norm(matrix)
    if norm == 0:
        raise ValueError(
            f"P − λN vanishes at λ = {lam:g}: the positive and negative pairs have proportional "
            "second moments, so no bilinear similarity separates them."
        )
    return matrix / norm


def _mean_risk(A: np.ndarray, M: np.ndarray) -> float:
    return 0.5 * (1.0 + float((A * M).sum()))


def solve_lambda(P: np.ndarray, N: np.ndarray, bound: float, rtol: float = 1e-12) -> float:
    """Smallest λ ≥ 0 with ½(1 + ⟨A_λ, N⟩) ≤ ``bound``, A_λ = (P − λN)/‖P − λN‖_F, by bisection.

    ⟨A_λ, N⟩ is non-increasing in λ (its derivative is −(‖N‖² − ⟨A_λ, N⟩²)/‖P − λN‖ ≤ 0) and
    tends to −‖N‖_F, so a finite λ exists iff ``bound`` > ½(1 − ‖N‖_F). At ``bound`` = ½(1 − ‖N‖_F)
    the only feasible point is A = −N/‖N‖_F, the limit λ → ∞: ``inf`` is returned.

    Raises:
        ValueError: ``bound`` below the smallest reachable negative risk.
    """
    if _mean_risk(_direction(P, N, 0.0), N) <= bound:
        return 0.0
    floor = 0.5 * (1.0 - float(np.linalg.norm(N)))
    if bound == floor:
        return math.inf
    if bound < floor:
        raise ValueError(
            f"`alpha` + `tolerance` = {bound:.4g} is infeasible: no bilinear similarity with "
            f"‖A‖_F ≤ 1 has a mean negative-pair similarity below {floor!r} on these data "
            "(the limit ½(1 − ‖N‖_F) as λ → ∞). Raise `alpha` to at least that, or use "
            "`risk`='indicator' to bound the false positive rate of a threshold instead."
        )
    high = 1.0
    while _mean_risk(_direction(P, N, high), N) > bound:
        high *= 2.0
        if high > 1e300:  # pragma: no cover - excluded by the feasibility check
            raise ValueError("the bisection on λ found no feasible multiplier.")
    low = 0.0
    while high - low > rtol * max(1.0, high):
        middle = 0.5 * (low + high)
        if _mean_risk(_direction(P, N, middle), N) > bound:
            low = middle
        else:
            high = middle
    return high  # the feasible end of the bracket


def _project_ball_halfspace(Z: np.ndarray, N: np.ndarray, bound: float) -> np.ndarray:
    """Euclidean projection onto {‖A‖_F ≤ 1} ∩ {⟨A, N⟩ ≤ bound} (assumed non-empty)."""
    in_ball = Z / max(1.0, float(np.linalg.norm(Z)))
    if float((in_ball * N).sum()) <= bound:
        return in_ball
    n_sq = float((N * N).sum())
    on_plane = Z - (float((Z * N).sum()) - bound) / n_sq * N
    if np.linalg.norm(on_plane) <= 1.0:
        return on_plane
    # both constraints active: the nearest point of the sphere within the hyperplane
    center = bound / n_sq * N
    radius = math.sqrt(max(0.0, 1.0 - bound * bound / n_sq))
    offset = on_plane - center
    return center + radius * offset / np.linalg.norm(offset)


def projected_gradient_bilinear(
    P: np.ndarray,
    N: np.ndarray,
    bound: float,
    *,
    step: float = 0.5,
    max_iter: int = 20_000,
    tol: float = 1e-13,
) -> tuple[np.ndarray, int]:
    """Solve max ⟨A, P⟩ s.t. ⟨A, N⟩ ≤ 2·bound − 1, ‖A‖_F ≤ 1 by projected gradient ascent.

    The reference solver for the closed form of :class:`BilinearSimilarity` (problem (6) with
    the mean risks): ascent steps A ← Π(A + step·P) with Π the exact projection onto the
    intersection of the Frobenius ball and the half-space, from A = 0, until A moves less than
    ``tol``.

    Returns:
        (A, number of iterations).
    """
    limit = 2.0 * bound - 1.0
    if limit < -float(np.linalg.norm(N)):
        raise ValueError(f"bound {bound:g} is infeasible for this N.")
    A = np.zeros_like(P)
    for iteration in range(1, max_iter + 1):
        updated = _project_ball_halfspace(A + step * P, N, limit)
        moved = float(np.linalg.norm(updated - A))
        A = updated
        if moved < tol:
            return A, iteration
    return A, max_iter


# -- the indicator risk ----------------------------------------------------------------------------
def _pair_scorer(data: torch.Tensor, first: np.ndarray, second: np.ndarray):
    """A ↦ xᵀAx' over the pairs (first[t], second[t]): X A Xᵀ indexed, or rows gathered if few."""
    n, d = data.shape
    rows, cols = torch.as_tensor(first), torch.as_tensor(second)
    if rows.numel() * d > n * n:
        return lambda A: ((data @ A) @ data.T)[rows, cols]
    return lambda A: ((data @ A)[rows] * data[cols]).sum(1)


def _fit_indicator(
    X: np.ndarray, pairs: PairSet, estimator: BilinearSimilarity
) -> tuple[np.ndarray, float, float]:
    """Primal-dual training of (A, t) for problem (1) with S = 1{xᵀAx' ≥ t}; returns (A, t, λ).

    A is free during training (its scale sets the sharpness of the surrogate) and starts at the
    cosine similarity scaled to spread the training scores over a few units; t starts at the
    (1 − α) negative-score quantile. Each iteration: an Adam step on (A, t), then a projected dual
    step on λ with the indicator's FPR. The rule is invariant to a positive rescaling of (A, t).
    """
    dtype = torch.float64
    data = torch.as_tensor(X, dtype=dtype)
    positive = _pair_scorer(data, pairs.pos_first, pairs.pos_second)
    negative = _pair_scorer(data, pairs.neg_first, pairs.neg_second)
    neg_weight = torch.as_tensor(pairs.neg_weight, dtype=dtype)
    identity = torch.eye(X.shape[1], dtype=dtype)
    cosine_neg = negative(identity)
    spread = float(torch.cat([positive(identity), cosine_neg]).std().clamp_min(1e-12))
    scale = 4.0 / spread
    weights = identity.clone().requires_grad_(True)
    start = _weighted_quantile(cosine_neg.numpy(), pairs.neg_weight, 1.0 - estimator.alpha)
    bias = torch.tensor(start, dtype=dtype, requires_grad=True)
    optimizer = torch.optim.Adam([weights, bias], lr=estimator.learning_rate)
    lam = 1.0
    for iteration in range(estimator.max_iter):
        A = scale * (weights + weights.T) / 2
        neg_scores = negative(A)
        loss, _, _ = pointwise_roc_lagrangian(
            positive(A),
            neg_scores,
            lam,
            estimator.alpha,
            scale * bias,
            1.0,
            estimator.surrogate,
            neg_weight=neg_weight,  # the sample stands for every negative pair (tuples: n_k n_l/n⁻)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            fpr = float(((neg_scores >= scale * bias).to(dtype) * neg_weight).sum())
        lam = max(0.0, lam + estimator.dual_lr * (fpr - estimator.alpha))
        if estimator.callback is not None:
            estimator.callback(iteration + 1, estimator.max_iter)
    final = (scale * (weights + weights.T) / 2).detach().numpy()
    norm = float(np.linalg.norm(final))
    return final / norm, float(scale * bias.detach()) / norm, lam


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    index = int(np.searchsorted(cumulative, q * cumulative[-1]))
    return float(values[order][min(index, values.size - 1)])


# -- the estimator ----------------------------------------------------------------------------------
class BilinearSimilarity(BaseEstimator):
    """Bilinear similarity S_A(x, x') = ½(1 + xᵀAx'), ‖A‖_F = 1, for pointwise ROC optimization.

    ``risk="mean"`` (default) solves problem (6) in closed form, A = (P − λN)/‖P − λN‖_F (module
    docstring); feasible α lie above ½(1 − ‖N‖_F), reported as ``min_negative_risk_``.
    ``risk="indicator"`` maximizes the TPR of 1{S_A ≥ t} subject to its training FPR ≤ α by the
    smoothed Lagrangian of :class:`~rankwise.losses.PointwiseROCLoss` and projected dual ascent
    on λ, starting from the cosine similarity.

    In both cases ``threshold_``, the rule of :meth:`predict_pairs`, is the largest-TPR threshold
    on S_A whose FPR on the training pairs is at most α (a tuple-based sample weights each pair
    n_k n_l / n⁻, so that this FPR estimates the FPR over every negative pair without bias).

    Parameters are validated by :meth:`fit` (scikit-learn convention).

    Args:
        alpha: α in (0, 1): the bound on the negative risk (mean risk) or on the FPR (indicator).
        risk: ``"mean"`` or ``"indicator"``.
        tolerance: Φ ≥ 0 added to α in the constraint (problem (6)); mean risk only.
        normalize: L2-normalize the rows of every input (otherwise unnormalized rows raise).
        negatives, n_negative_samples, random_state: the negative pairs (complete or an
            incomplete U-statistic of Sec. 4), as in :class:`~rankwise.similarity_learning.MMC`.
        max_pairs: cap on the positive pairs (uniformly subsampled beyond, Remark 4) and on the
            complete negative pairs materialized for the indicator risk and the threshold.
        surrogate: ``"sigmoid"`` or ``"softplus"`` (indicator risk).
        learning_rate: Adam step size (indicator risk; 2e-3 learned fastest without diverging on
            digits, 1e-2 diverged).
        dual_lr: dual step size η (indicator risk).
        max_iter: primal-dual iterations (indicator risk).
        n_threads: BLAS and torch threads used by :meth:`fit` (``None``: leave them as they are).
        callback: called as ``callback(iteration, max_iter)`` after every primal-dual iteration
            (indicator risk), e.g. to show progress; ``None``: nothing.

    Attributes:
        A_: (d, d) symmetric matrix with ‖A_‖_F = 1.
        lambda_: the Lagrange multiplier λ of the solution (``inf`` for α + Φ exactly at the
            feasibility floor, where A = −N/‖N‖_F is the only feasible point).
        positive_risk_, negative_risk_: the training risks of the solution (mean similarities
            for the mean risk; TPR and FPR of ``threshold_`` for the indicator risk).
        threshold_: decision threshold on S_A (training FPR ≤ α).
        threshold_tpr_, threshold_fpr_: the training TPR and FPR of ``threshold_`` (weighted
            like the pairs; for the indicator risk the same as the training risks).
        min_negative_risk_: ½(1 − ‖N‖_F), the smallest feasible mean negative risk.
        constraint_active_: whether λ > 0 (the constraint binds).
        P_, N_: the moment matrices of Sec. 5.1 (N_ from the pairs used).
        n_positive_pairs_, n_negative_pairs_: pairs used for training.
        n_features_in_: d.

    Example:
        >>> import numpy as np
        >>> from rankwise.similarity_learning import BilinearSimilarity
        >>> X = np.array([[1.0, 0.0, 0.1], [0.9, 0.2, 0.0], [0.0, 1.0, 0.2], [0.1, 0.9, 0.0],
        ...               [0.1, 0.0, 1.0], [0.0, 0.2, 0.9]])
        >>> model = BilinearSimilarity(alpha=0.4, normalize=True).fit(X, [0, 0, 1, 1, 2, 2])
        >>> model.A_.shape, round(float(np.linalg.norm(model.A_)), 6), model.constraint_active_
        ((3, 3), 1.0, True)
        >>> model.predict_pairs(X[[0, 0]], X[[1, 2]]).tolist()  # same class, different classes
        [True, False]
    """

    def __init__(
        self,
        alpha: float = 0.05,
        *,
        risk: str = "mean",
        tolerance: float = 0.0,
        normalize: bool = False,
        negatives: str = "complete",
        n_negative_samples: int | None = None,
        random_state: Any = None,
        max_pairs: int = 5_000_000,
        surrogate: str = "sigmoid",
        learning_rate: float = 2e-3,
        dual_lr: float = 1.0,
        max_iter: int = 500,
        n_threads: int | None = None,
        callback: Callable[[int, int], None] | None = None,
    ) -> None:
        self.alpha = alpha
        self.risk = risk
        self.tolerance = tolerance
        self.normalize = normalize
        self.negatives = negatives
        self.n_negative_samples = n_negative_samples
        self.random_state = random_state
        self.max_pairs = max_pairs
        self.surrogate = surrogate
        self.learning_rate = learning_rate
        self.dual_lr = dual_lr
        self.max_iter = max_iter
        self.n_threads = n_threads
        self.callback = callback

    # -- validation ----------------------------------------------------------------------------
    def _check_params(self) -> None:
        check_scalar(self.alpha, "alpha", _OPEN_UNIT)
        check_choice(self.risk, "risk", RISKS)
        check_scalar(self.tolerance, "tolerance", _NON_NEGATIVE)
        check_bool(self.normalize, "normalize")
        check_choice(self.negatives, "negatives", NEGATIVE_SCHEMES)
        if self.n_negative_samples is not None:
            check_scalar(self.n_negative_samples, "n_negative_samples", _COUNT)
        check_scalar(self.max_pairs, "max_pairs", _COUNT)
        check_choice(self.surrogate, "surrogate", SURROGATES)
        check_scalar(self.learning_rate, "learning_rate", _POSITIVE)
        check_scalar(self.dual_lr, "dual_lr", _NON_NEGATIVE)
        check_scalar(self.max_iter, "max_iter", _COUNT)
        if self.n_threads is not None:
            check_scalar(self.n_threads, "n_threads", _COUNT)
        if self.callback is not None and not callable(self.callback):
            raise ValueError(f"`callback` must be callable or None, got {self.callback!r}.")

    def _prepare(self, X: Any, name: str = "X") -> np.ndarray:
        check_is_fitted(self, "A_")
        features = check_features(X, name, self.n_features_in_)
        return self._unit(features, name)

    def _unit(self, features: np.ndarray, name: str) -> np.ndarray:
        if self.normalize:
            return normalize_rows(features, name)
        check_unit_rows(features, name)
        return features

    # -- fit -------------------------------------------------------------------------------------
    def fit(self, X: Any, y: Any) -> BilinearSimilarity:
        """Learn A from labelled points.

        Args:
            X: (n, d) features; unit rows unless ``normalize=True``.
            y: (n,) class ids: at least two classes and one class with two samples.

        Returns:
            self.

        Raises:
            ValueError: a bad parameter, bad input (NaN, a single class, unnormalized rows), or an
                infeasible α for the mean risk (the message gives the feasible range).
        """
        self._check_params()
        with limited_threads(self.n_threads):
            return self._fit(X, y)

    def _fit(self, X: Any, y: Any) -> BilinearSimilarity:
        features, labels = check_training_data(X, y)
        features = self._unit(features, "X")
        rng = np.random.default_rng(self.random_state)
        P, N = pair_moment_matrices(features, labels)
        pairs = None
        if self.risk == "indicator" or self.negatives != "complete":
            pairs = training_pairs(
                labels, self.negatives, self.n_negative_samples, self.max_pairs, rng
            )
        if pairs is not None and self.negatives != "complete":
            N = _weighted_moment(features, pairs.neg_first, pairs.neg_second, pairs.neg_weight)
        self.P_, self.N_ = P, N
        self.min_negative_risk_ = 0.5 * (1.0 - float(np.linalg.norm(N)))
        if self.risk == "mean":
            self.lambda_ = solve_lambda(P, N, float(self.alpha) + float(self.tolerance))
            self.A_ = _direction(P, N, self.lambda_)
        else:
            assert pairs is not None  # drawn for the indicator risk
            self.A_, _, self.lambda_ = _fit_indicator(features, pairs, self)
        self.n_features_in_ = features.shape[1]
        self.constraint_active_ = self.lambda_ > 0
        self._set_threshold(features, labels, pairs, rng)
        return self

    def _set_threshold(
        self, X: np.ndarray, y: np.ndarray, pairs: PairSet | None, rng: np.random.Generator
    ) -> None:
        """``threshold_`` at training FPR ≤ α, and the training risks of the solution."""
        if pairs is None:  # mean risk on the complete statistic: no pair list was needed so far
            complete = class_structure(y).n_negative_pairs <= self.max_pairs
            scheme = "complete" if complete else "pairs"
            pairs = training_pairs(y, scheme, self.max_pairs, self.max_pairs, rng)
        pos = self._scores(X[pairs.pos_first], X[pairs.pos_second])
        neg = self._scores(X[pairs.neg_first], X[pairs.neg_second])
        self.n_positive_pairs_ = int(pos.size)
        self.n_negative_pairs_ = int(neg.size)
        scores = np.concatenate([pos, neg])
        is_positive = np.r_[np.ones(pos.size, bool), np.zeros(neg.size, bool)]
        weights = None
        if np.ptp(pairs.neg_weight) > 0:  # tuples of unequal classes: weighted n_k n_l / n⁻
            weights = np.r_[pairs.pos_weight, pairs.neg_weight]
        point = operating_point(scores, is_positive, float(self.alpha), sample_weight=weights)
        self.threshold_ = point.threshold
        self.threshold_tpr_, self.threshold_fpr_ = point.tpr, point.fpr
        if self.risk == "mean":
            self.positive_risk_ = _mean_risk(self.A_, self.P_)
            self.negative_risk_ = _mean_risk(self.A_, self.N_)
        else:
            self.positive_risk_, self.negative_risk_ = point.tpr, point.fpr

    # -- scoring -------------------------------------------------------------------------------
    def _scores(self, X1: np.ndarray, X2: np.ndarray) -> np.ndarray:
        return 0.5 * (1.0 + ((X1 @ self.A_) * X2).sum(1))

    def pair_score(self, X1: Any, X2: Any) -> np.ndarray:
        """S_A(X1[i], X2[i]) for every row i: (m,) values in [0, 1].

        Args:
            X1: (m, d) features (unit rows unless ``normalize=True``).
            X2: (m, d) features, one row per pair.
        """
        first = self._prepare(X1, "X1")
        second = self._prepare(X2, "X2")
        if first.shape[0] != second.shape[0]:
            raise ValueError(
                f"`X1` has {first.shape[0]} rows but `X2` has {second.shape[0]}; pass one row of "
                "each per pair."
            )
        return self._scores(first, second)

    def score_pairs(self, pairs: Any) -> np.ndarray:
        """S_A of an (m, 2, d) array of pairs (the metric-learn convention): (m,) values."""
        array = np.asarray(pairs, dtype=np.float64)
        if array.ndim != 3 or array.shape[1] != 2:
            raise ValueError(
                f"`pairs` must have shape (n_pairs, 2, n_features), got {array.shape}."
            )
        return self.pair_score(array[:, 0], array[:, 1])

    def similarity_matrix(self, X: Any, Y: Any = None) -> np.ndarray:
        """(n, m) matrix of S_A(X[i], Y[j]); ``Y=None`` uses ``X``."""
        first = self._prepare(X, "X")
        second = first if Y is None else self._prepare(Y, "Y")
        return 0.5 * (1.0 + first @ self.A_ @ second.T)

    def predict_pairs(self, X1: Any, X2: Any) -> np.ndarray:
        """(m,) bool: S_A(X1[i], X2[i]) ≥ ``threshold_`` ("same class")."""
        return self.pair_score(X1, X2) >= self.threshold_

    def score(self, X: Any, y: Any) -> float:
        """TPR at FPR ≤ α over all pairs i < j of (X, y) (greater is better)."""
        features = self._prepare(X, "X")
        labels = check_training_data(features, y)[1]
        n = labels.shape[0]
        if n * (n - 1) // 2 > self.max_pairs:
            raise ValueError(
                f"`X` has {n * (n - 1) // 2:,} pairs, more than max_pairs={self.max_pairs:,}; "
                "score a subsample."
            )
        first, second = np.triu_indices(n, 1)
        scores = self._scores(features[first], features[second])
        return float(tpr_at_fpr(scores, labels[first] == labels[second], float(self.alpha)))
