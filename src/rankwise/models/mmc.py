"""MMC, Mahalanobis metric learning by projected gradient ascent.

The algorithm of Xing, Ng, Jordan & Russell (NIPS 2002), in the form of Vogel, Bellet & Clémençon, *A Probabilistic Theory of Supervised Similarity Learning for Pointwise
ROC Curve Optimization* (ICML 2018), Sec. 5.3:

    max_A  (1/n⁻) Σ_{i<j, Y_i≠Y_j} d_A(X_i, X_j)
    s.t.   (1/n⁺) Σ_{i<j, Y_i=Y_j} d_A²(X_i, X_j) ≤ 1,   A ⪰ 0,

with d_A(x, x') = √((x − x')ᵀ A (x − x')), the empirical problem (3) with α = 0 for an unbounded
distance (Sec. 2.2). The objective is concave in A and the feasible set convex. :class:`MMC`
solves it by projected gradient ascent: a gradient step, then the exact Euclidean projection onto
{A ⪰ 0} ∩ {⟨A, M⁺⟩ ≤ 1} (M⁺ the mean outer product of the positive-pair differences), which is
Π_PSD(Z − μM⁺) for the smallest μ ≥ 0 that satisfies the constraint (a root found by Brent's method; Π_PSD
clips the negative eigenvalues of an eigendecomposition). The negative term is computed on every
negative pair or on an incomplete U-statistic (pair- or tuple-based sampling, Sec. 4), the
scalability study of Fig. 4.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.utils.validation import check_is_fitted

from .._validation import Interval, check_choice, check_scalar
from ..sampling.pairs import class_structure
from ._pair_data import (
    NEGATIVE_SCHEMES,
    check_features,
    check_training_data,
    limited_threads,
    training_pairs,
)

__all__ = ["MMC", "mmc_objective", "positive_scatter", "project_psd"]

_COUNT = Interval("integer", 1, None)
_POSITIVE = Interval("real", 0, None, closed="neither")
_CHUNK = 200_000  # negative pairs per block of the distances (d x chunk doubles of memory)


def positive_scatter(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """M⁺ = (1/n⁺) Σ_{i<j, Y_i=Y_j} (X_i − X_j)(X_i − X_j)ᵀ, so the constraint is ⟨A, M⁺⟩ ≤ 1.

    Per class, Σ_{i<j} (x_i − x_j)(x_i − x_j)ᵀ = n_k Σ_i x_i x_iᵀ − s_k s_kᵀ (s_k the class sum):
    O(n d²), no pair is enumerated.
    """
    groups = class_structure(y)
    scatter = np.zeros((X.shape[1], X.shape[1]))
    for start, size in zip(groups.starts, groups.sizes, strict=True):
        members = X[groups.order[start : start + size]]
        class_sum = members.sum(0)
        scatter += size * (members.T @ members) - np.outer(class_sum, class_sum)
    return scatter / groups.n_positive_pairs


def project_psd(Z: np.ndarray) -> np.ndarray:
    """Nearest positive semidefinite matrix in Frobenius norm: negative eigenvalues set to 0."""
    symmetric = (Z + Z.T) / 2
    values, vectors = np.linalg.eigh(symmetric)
    return (vectors * np.clip(values, 0.0, None)) @ vectors.T


def _project_feasible(Z: np.ndarray, scatter: np.ndarray, rtol: float = 1e-12) -> np.ndarray:
    """Projection onto {A ⪰ 0, ⟨A, M⁺⟩ ≤ 1}: Π_PSD(Z − μM⁺), μ ≥ 0 the smallest feasible.

    f(μ) = ⟨Π_PSD(Z − μM⁺), M⁺⟩ is continuous and non-increasing in μ (the projection is a
    monotone map), so μ is the root of f(μ) = 1 when f(0) > 1; Brent's method finds it in a few
    eigendecompositions. The root is then nudged to the feasible side (A/f(μ) when f(μ) exceeds
    1 by rounding, a relative change below ``rtol``).
    """
    from scipy.optimize import brentq

    projected = project_psd(Z)
    if float((projected * scatter).sum()) <= 1.0:
        return projected

    def excess(mu: float) -> float:
        return float((project_psd(Z - mu * scatter) * scatter).sum()) - 1.0

    high = max(1.0, float(np.linalg.norm(Z)) / max(float(np.linalg.norm(scatter)), 1e-300))
    while excess(high) > 0:
        high *= 2.0
    mu = brentq(excess, 0.0, high, xtol=1e-300, rtol=max(rtol, 4 * np.finfo(float).eps))
    result = project_psd(Z - mu * scatter)
    value = float((result * scatter).sum())
    return result / value if value > 1.0 else result


class _NegativeTerm:
    """The weighted mean Σ w_t d_A(pair t) over the negative pairs used, and its gradient.

    Both cost O(T d + n d²) for T pairs, not O(T d²): the distances are norms of differences of
    Z = X Lᵀ (A = LᵀL, one eigendecomposition of the d × d matrix), and the gradient
    Σ_t c_t (x_i − x_j)(x_i − x_j)ᵀ is Xᵀ(D − W − Wᵀ)X with W the sparse (n, n) matrix of the
    pair coefficients c_t and D the diagonal of their sums per point (a graph Laplacian).
    """

    def __init__(self, X: np.ndarray, first: np.ndarray, second: np.ndarray, w: np.ndarray):
        self.X, self.first, self.second, self.weights = X, first, second, w

    def _distances(self, A: np.ndarray) -> np.ndarray:
        values, vectors = np.linalg.eigh((A + A.T) / 2)
        Z = self.X @ (vectors * np.sqrt(np.clip(values, 0.0, None)))
        distance = np.empty(self.first.shape[0])
        for start in range(0, distance.size, _CHUNK):
            stop = start + _CHUNK
            diff = Z[self.first[start:stop]] - Z[self.second[start:stop]]
            distance[start:stop] = np.sqrt(np.einsum("td,td->t", diff, diff))
        return distance

    def value(self, A: np.ndarray) -> float:
        return float(self.weights @ self._distances(A))

    def value_and_gradient(self, A: np.ndarray) -> tuple[float, np.ndarray]:
        """g(A) and ∇g(A) = Σ w_t d_t d_tᵀ / (2 d_A(pair t)); pairs at distance 0 add nothing."""
        from scipy.sparse import coo_matrix

        distance = self._distances(A)
        coefficient = np.divide(
            self.weights, 2 * distance, out=np.zeros_like(distance), where=distance > 0
        )
        n = self.X.shape[0]
        W = coo_matrix((coefficient, (self.first, self.second)), shape=(n, n)).tocsr()
        degree = np.bincount(self.first, coefficient, n) + np.bincount(self.second, coefficient, n)
        laplacian_X = degree[:, None] * self.X - W @ self.X - W.T @ self.X
        gradient = self.X.T @ laplacian_X
        return float(self.weights @ distance), (gradient + gradient.T) / 2


def mmc_objective(X: Any, y: Any, A: np.ndarray, *, chunk_rows: int = 512) -> tuple[float, float]:
    """The MMC objective and constraint of A on (X, y), over every pair i < j (complete).

    Returns:
        ``(objective, constraint)``: the mean d_A over the negative pairs and the mean d_A² over
        the positive pairs. The distances are computed block by block through the factor
        L (A = LᵀL): memory O(chunk_rows · n), time O(n² d).
    """
    features, labels = check_training_data(X, y)
    groups = class_structure(labels)
    values, vectors = np.linalg.eigh((A + A.T) / 2)
    factor = (vectors * np.sqrt(np.clip(values, 0.0, None))).T
    Z = features @ factor.T
    codes = groups.codes
    squared_norms = (Z * Z).sum(1)
    negative_sum = 0.0
    for start in range(0, Z.shape[0], chunk_rows):
        block = Z[start : start + chunk_rows]
        sq = squared_norms[start : start + chunk_rows, None] + squared_norms - 2 * block @ Z.T
        distance = np.sqrt(np.clip(sq, 0.0, None))
        different = codes[start : start + chunk_rows, None] != codes[None, :]
        negative_sum += float(distance[different].sum())
    objective = negative_sum / 2 / groups.n_negative_pairs  # every pair was seen twice
    constraint = float((positive_scatter(features, labels) * A).sum())
    return objective, constraint


class MMC(BaseEstimator, TransformerMixin):
    """Mahalanobis metric learning for clustering (Xing et al. 2002) by projected gradient ascent.

    Maximizes the mean Mahalanobis distance d_A over the negative pairs subject to a mean squared
    distance of at most 1 over the positive pairs, A ⪰ 0 (Vogel et al., Sec. 5.3). Each iteration
    takes a gradient step of size η and projects exactly onto the feasible set (eigendecompositions,
    see the module docstring); a step that lowers the objective is retried with η/2, an accepted
    one lets η grow by 10 %. Stops when the relative gain of an accepted step is below ``tol``.

    Args:
        negatives: ``"complete"`` (every negative pair), ``"pairs"`` (B pairs drawn uniformly) or
            ``"tuples"`` (B K-tuples, one sample per class, weighted n_k n_l / n⁻), the incomplete
            U-statistics of Sec. 4 (:mod:`rankwise.sampling.pairs`).
        n_negative_samples: B; ``None`` = n pairs or ⌈0.15 n⌉ tuples (the paper's Fig. 4 budget).
        max_iter: gradient steps (accepted or not), ≥ 1.
        tol: relative objective gain below which the ascent stops, > 0.
        max_pairs: refuse ``negatives="complete"`` above this many negative pairs.
        random_state: seed / ``numpy.random.Generator`` of the sampled pairs.
        n_threads: BLAS threads used by :meth:`fit` (``None``: leave them as they are).

    Attributes:
        A_: (d, d) positive semidefinite matrix.
        components_: (d, d) L with A = LᵀL; :meth:`transform` maps x to Lx.
        objective_: training objective (on the negative pairs used).
        constraint_: training constraint ⟨A, M⁺⟩ (1 at the optimum).
        objective_history_: objective after every accepted step.
        n_iter_: steps taken; converged_: whether ``tol`` was reached.
        n_negative_pairs_: negative pairs used (B·K(K−1)/2 for tuples).
        n_features_in_: d.
    """

    def __init__(
        self,
        *,
        negatives: str = "complete",
        n_negative_samples: int | None = None,
        max_iter: int = 200,
        tol: float = 1e-5,
        max_pairs: int = 5_000_000,
        random_state: Any = None,
        n_threads: int | None = None,
    ) -> None:
        self.negatives = negatives
        self.n_negative_samples = n_negative_samples
        self.max_iter = max_iter
        self.tol = tol
        self.max_pairs = max_pairs
        self.random_state = random_state
        self.n_threads = n_threads

    def _check_params(self) -> None:
        check_choice(self.negatives, "negatives", NEGATIVE_SCHEMES)
        if self.n_negative_samples is not None:
            check_scalar(self.n_negative_samples, "n_negative_samples", _COUNT)
        check_scalar(self.max_iter, "max_iter", _COUNT)
        check_scalar(self.tol, "tol", _POSITIVE)
        check_scalar(self.max_pairs, "max_pairs", _COUNT)
        if self.n_threads is not None:
            check_scalar(self.n_threads, "n_threads", _COUNT)

    def fit(self, X: Any, y: Any) -> MMC:
        """Learn A from labelled points.

        Args:
            X: (n, d) features.
            y: (n,) class ids: two classes and a class with two samples.

        Returns:
            self.
        """
        self._check_params()
        with limited_threads(self.n_threads):
            return self._fit(X, y)

    def _fit(self, X: Any, y: Any) -> MMC:
        features, labels = check_training_data(X, y)
        rng = np.random.default_rng(self.random_state)
        pairs = training_pairs(
            labels,
            self.negatives,
            self.n_negative_samples,
            self.max_pairs,
            rng,
            with_positives=False,  # the constraint is computed in closed form
        )
        scatter = positive_scatter(features, labels)
        if float(np.trace(scatter)) <= 0:
            raise ValueError(
                "every positive pair has distance 0 (each class is a single repeated point): the "
                "constraint does not bound A."
            )
        term = _NegativeTerm(features, pairs.neg_first, pairs.neg_second, pairs.neg_weight)
        self._ascend(term, scatter, np.eye(features.shape[1]) / float(np.trace(scatter)))
        values, vectors = np.linalg.eigh(self.A_)
        self.components_ = (vectors * np.sqrt(np.clip(values, 0.0, None))).T
        self.constraint_ = float((scatter * self.A_).sum())
        self.n_negative_pairs_ = int(pairs.neg_first.shape[0])
        self.n_features_in_ = features.shape[1]
        return self

    def _ascend(self, term: _NegativeTerm, scatter: np.ndarray, A: np.ndarray) -> None:
        value, gradient = term.value_and_gradient(A)
        step = float(np.linalg.norm(A)) / max(float(np.linalg.norm(gradient)), 1e-300)
        history = [value]
        converged = False
        iteration = 0
        for iteration in range(1, self.max_iter + 1):  # noqa: B007 - n_iter_ reads it
            candidate = _project_feasible(A + step * gradient, scatter)
            candidate_value, candidate_gradient = term.value_and_gradient(candidate)
            if candidate_value < value:
                step /= 2
                if step < 1e-12 * float(np.linalg.norm(A)):
                    converged = True  # no ascent direction left at machine precision
                    break
                continue
            gain = (candidate_value - value) / max(abs(value), 1e-300)
            A, value, gradient = candidate, candidate_value, candidate_gradient
            history.append(value)
            step *= 1.1
            if gain < self.tol:
                converged = True
                break
        self.A_ = A
        self.objective_ = value
        self.objective_history_ = history
        self.n_iter_ = iteration
        self.converged_ = converged

    # -- metric --------------------------------------------------------------------------------
    def transform(self, X: Any) -> np.ndarray:
        """Map x to Lx: (n, d) features to (n, d) points whose Euclidean distance is d_A."""
        check_is_fitted(self, "A_")
        return check_features(X, "X", self.n_features_in_) @ self.components_.T

    def pair_distance(self, X1: Any, X2: Any) -> np.ndarray:
        """d_A(X1[i], X2[i]) for every row i: (m,)."""
        first, second = self.transform(X1), self.transform(X2)
        if first.shape[0] != second.shape[0]:
            raise ValueError(
                f"`X1` has {first.shape[0]} rows but `X2` has {second.shape[0]}; pass one row of "
                "each per pair."
            )
        return np.linalg.norm(first - second, axis=1)

    def pair_score(self, X1: Any, X2: Any) -> np.ndarray:
        """−d_A(X1[i], X2[i]): a similarity, higher for more similar pairs."""
        return -self.pair_distance(X1, X2)

    def score_pairs(self, pairs: Any) -> np.ndarray:
        """−d_A of an (m, 2, d) array of pairs (the metric-learn convention for similarities)."""
        array = np.asarray(pairs, dtype=np.float64)
        if array.ndim != 3 or array.shape[1] != 2:
            raise ValueError(
                f"`pairs` must have shape (n_pairs, 2, n_features), got {array.shape}."
            )
        return self.pair_score(array[:, 0], array[:, 1])

    def score(self, X: Any, y: Any) -> float:
        """Scale-free MMC criterion on (X, y): objective / √constraint over every pair i < j.

        This is the objective A would reach after rescaling it to meet the constraint on (X, y)
        exactly (d_A scales as the square root of A), so greater is better.
        """
        check_is_fitted(self, "A_")
        objective, constraint = mmc_objective(X, y, self.A_)
        return objective / math.sqrt(constraint) if constraint > 0 else math.inf
