"""MMC, Mahalanobis metric learning by projected gradient ascent.

The algorithm of Xing, Ng, Jordan & Russell (NIPS 2002), in the form of Vogel, Bellet & Clémençon
(ICML 2018), Sec. 5.3:

    max_A  (1/n⁻) Σ_{i<j, Y_i≠Y_j} d_A(X_i, X_j)
    s.t.   (1/n⁺) Σ_{i<j, Y_i=Y_j} d_A²(X_i, X_j) ≤ 1,   A ⪰ 0,

with d_A(x, x') = √((x − x')ᵀ A (x − x')), the empirical problem (3) with α = 0 for an unbounded
distance (Sec. 2.2). The objective is concave in A and the feasible set convex.

:class:`MMC` solves it by the spectral projected gradient of Birgin, Martínez & Raydan (SIAM J.
Optim., 2000) in the coordinates whitened by M⁺ (A = W B Wᵀ, W = M⁺^(-1/2), the feasible set the
spectraplex {B ⪰ 0, tr B ≤ 1}), stops on a certified Frank-Wolfe gap, and computes the negative
term on every negative pair or on an incomplete U-statistic (Sec. 4, the scalability study of
Fig. 4); docs/pointwise_roc.md explains the solver and its certificate.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from scipy.sparse import coo_matrix
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.exceptions import ConvergenceWarning
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
    groups = class_structure(y, "y")
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


def _whitening(scatter: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W, V₀): W = M⁺^(-1/2) on the range of M⁺ (d × r, Wᵀ M⁺ W = I) and its null space (d × k).

    Eigenvalues below d·ε·λ_max are rounding noise of ``eigh`` and count as zero.
    """
    values, vectors = np.linalg.eigh((scatter + scatter.T) / 2)
    keep = values > scatter.shape[0] * np.finfo(np.float64).eps * values.max()
    return vectors[:, keep] / np.sqrt(values[keep]), vectors[:, ~keep]


def _project_spectraplex(Z: np.ndarray) -> np.ndarray:
    """Euclidean projection onto {B ⪰ 0, tr B ≤ 1}: the eigenvalues projected on the capped simplex.

    Eigenvalues λ of the symmetric part of Z become max(λ − θ, 0), θ ≥ 0 the smallest value that
    makes them sum to at most 1 (found by sorting).
    """
    values, vectors = np.linalg.eigh((Z + Z.T) / 2)
    clipped = np.clip(values, 0.0, None)
    if clipped.sum() > 1.0:
        ordered = np.sort(values)[::-1]
        excess = (np.cumsum(ordered) - 1.0) / np.arange(1, ordered.size + 1)
        last = int(np.flatnonzero(ordered > excess)[-1])
        clipped = np.clip(values - excess[last], 0.0, None)
    return (vectors * clipped) @ vectors.T


def _frank_wolfe_gap(B: np.ndarray, gradient: np.ndarray) -> float:
    """The maximum over the spectraplex of ⟨G, S − B⟩ = λ_max(G)₊ − ⟨G, B⟩ ≥ g(B*) − g(B) (g concave)."""
    top = float(np.linalg.eigvalsh((gradient + gradient.T) / 2)[-1])
    return max(top, 0.0) - float((gradient * B).sum())


class _NegativeTerm:
    """The weighted mean Σ w_t d_A(pair t) over the negative pairs used, and its gradient.

    Both cost O(T d + n d²) for T pairs, not O(T d²): the distances are norms of differences of
    Z = X Lᵀ (A = LᵀL, one eigendecomposition of the d × d matrix), and the gradient
    Σ_t c_t (x_i − x_j)(x_i − x_j)ᵀ is Xᵀ(D − W − Wᵀ)X with W the sparse (n, n) matrix of the
    pair coefficients c_t and D the diagonal of their sums per point (a graph Laplacian).
    """

    def __init__(self, X: np.ndarray, first: np.ndarray, second: np.ndarray, w: np.ndarray):
        self.X, self.first, self.second, self.weights = X, first, second, w
        self._distinct: np.ndarray | None = None  # pairs whose two points differ
        self.kinked = False  # the last gradient met a pair at d_A = 0 with distinct points

    def _at_kink(self, distance: np.ndarray) -> bool:
        """Whether a pair of distinct points has d_A = 0, where d_A has no (super)gradient."""
        if not (distance == 0).any():
            return False
        if self._distinct is None:
            self._distinct = self._distances(np.eye(self.X.shape[1])) > 0
        return bool(((distance == 0) & self._distinct).any())

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
        distance = self._distances(A)
        self.kinked = self._at_kink(distance)
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


def _check_bounded(X: np.ndarray, null_space: np.ndarray, pairs: Any) -> None:
    """Refuse data on which the objective is unbounded: negatives that differ where positives don't.

    Along a direction v with vᵀM⁺v = 0 (every class constant along v) the constraint costs
    nothing, so if the negative pairs differ along v, A + t·vvᵀ raises the objective without
    bound.
    """
    if null_space.shape[1] == 0:
        return
    ones = np.full(pairs.neg_first.shape[0], 1.0)
    spread = _NegativeTerm(X, pairs.neg_first, pairs.neg_second, ones)
    outside = _NegativeTerm(X @ null_space, pairs.neg_first, pairs.neg_second, ones)
    total = spread.value(np.eye(X.shape[1]))
    if outside.value(np.eye(null_space.shape[1])) > 1e-9 * total:
        raise ValueError(
            f"`X` has {null_space.shape[1]} direction(s) along which every class is constant but "
            "the classes differ, so the MMC objective is unbounded (A can grow there at no cost "
            "to the constraint); drop those features, or give each class more than one value "
            "along them."
        )


class MMC(BaseEstimator, TransformerMixin):
    """Mahalanobis metric learning for clustering (Xing et al. 2002) by projected gradient ascent.

    Maximizes the mean Mahalanobis distance d_A over the negative pairs subject to a mean squared
    distance of at most 1 over the positive pairs, A ⪰ 0 (Vogel et al., Sec. 5.3), by the spectral
    projected gradient in whitened coordinates of the module docstring. It stops when the
    Frank-Wolfe gap is at most ``tol`` × objective (``converged_`` = True), after ``max_iter``
    iterations, or when no step raises the objective in floating point; the last two leave
    ``converged_`` False and emit a :class:`~sklearn.exceptions.ConvergenceWarning` with the gap.

    Args:
        negatives: ``"complete"`` (every negative pair), ``"pairs"`` (B pairs drawn uniformly) or
            ``"tuples"`` (B K-tuples, one sample per class, weighted n_k n_l / n⁻), the incomplete
            U-statistics of Sec. 4 (:mod:`rankwise.sampling.pairs`).
        n_negative_samples: B; ``None`` = n pairs or ⌈0.15 n⌉ tuples (the paper's Fig. 4 budget).
        max_iter: ascent iterations, ≥ 1.
        tol: the certified relative distance to the optimum of the training objective at which
            the ascent stops, > 0.
        max_pairs: refuse ``negatives="complete"`` above this many negative pairs.
        random_state: seed / ``numpy.random.Generator`` of the sampled pairs.
        n_threads: BLAS threads used by :meth:`fit` (``None``: leave them as they are).

    Attributes:
        A_: (d, d) positive semidefinite matrix.
        components_: (d, d) L with A = LᵀL; :meth:`transform` maps x to Lx.
        objective_: training objective (on the negative pairs used).
        constraint_: training constraint ⟨A, M⁺⟩ (1 at the optimum).
        duality_gap_: the Frank-Wolfe gap at ``A_``: the optimum of the training objective is at
            most ``objective_ + duality_gap_`` (``inf`` where the gradient is undefined).
        objective_history_: objective at the start and after every iteration (non-decreasing).
        n_iter_: iterations taken; converged_: whether ``duality_gap_ <= tol * objective_``.
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
        whitening, null_space = _whitening(scatter)
        _check_bounded(features, null_space, pairs)
        term = _NegativeTerm(
            features @ whitening, pairs.neg_first, pairs.neg_second, pairs.neg_weight
        )
        B = self._ascend(term, whitening.shape[1])
        self.A_ = whitening @ B @ whitening.T
        self.A_ = (self.A_ + self.A_.T) / 2
        values, vectors = np.linalg.eigh(self.A_)
        self.components_ = (vectors * np.sqrt(np.clip(values, 0.0, None))).T
        self.constraint_ = float((scatter * self.A_).sum())
        self.n_negative_pairs_ = int(pairs.neg_first.shape[0])
        self.n_features_in_ = features.shape[1]
        return self

    def _ascend(self, term: _NegativeTerm, rank: int) -> np.ndarray:
        """Spectral projected gradient ascent on {B ⪰ 0, tr B ≤ 1} from B = I/r; returns B."""
        B = np.eye(rank) / rank
        value, gradient = term.value_and_gradient(B)
        step = float(np.linalg.norm(B)) / max(float(np.linalg.norm(gradient)), 1e-300)
        history = [value]
        stalled = False
        iteration = 0
        gap = self._gap(term, B, gradient)
        while gap > self.tol * value and iteration < self.max_iter:
            iteration += 1
            direction = _project_spectraplex(B + step * gradient) - B
            slope = float((gradient * direction).sum())  # ≥ 0: an ascent direction
            fraction = 1.0
            while True:
                candidate = B + fraction * direction  # feasible: the set is convex
                candidate_value, candidate_gradient = term.value_and_gradient(candidate)
                if candidate_value >= value + 1e-4 * fraction * slope:
                    break
                fraction /= 2
                if fraction < 1e-12:  # no step raises the objective in floating point
                    stalled = True
                    break
            if stalled:
                break
            moved, turned = candidate - B, candidate_gradient - gradient
            B, value, gradient = candidate, candidate_value, candidate_gradient
            history.append(value)
            # Barzilai-Borwein: ⟨s, s⟩ / −⟨s, Δ∇g⟩, the inverse curvature along the last move
            curvature = -float((moved * turned).sum())
            step = float((moved * moved).sum()) / curvature if curvature > 0 else 10.0 * step
            step = min(max(step, 1e-12), 1e12)
            gap = self._gap(term, B, gradient)
        self.objective_ = value
        self.objective_history_ = history
        self.n_iter_ = iteration
        self.duality_gap_ = gap
        self.converged_ = gap <= self.tol * value
        if not self.converged_:
            why = "stalled in floating point" if stalled else f"reached max_iter={self.max_iter}"
            warnings.warn(
                f"MMC {why} with a duality gap of {gap:.3g} ({gap / max(value, 1e-300):.3g} of "
                f"the objective) above tol={self.tol:g}: the objective is within that gap of the "
                "optimum; raise max_iter or tol.",
                ConvergenceWarning,
                stacklevel=4,
            )
        return B

    @staticmethod
    def _gap(term: _NegativeTerm, B: np.ndarray, gradient: np.ndarray) -> float:
        # at a pair of distinct points with d = 0 the objective has no gradient: nothing certified
        return math.inf if term.kinked else _frank_wolfe_gap(B, gradient)

    # -- metric --------------------------------------------------------------------------------
    def transform(self, X: Any) -> np.ndarray:
        """Map x to Lx: (n, d) features to (n, d) points whose Euclidean distance is d_A."""
        return self._map(X, "X")

    def _map(self, X: Any, name: str) -> np.ndarray:
        check_is_fitted(self, "A_")
        return check_features(X, name, self.n_features_in_) @ self.components_.T

    def pair_distance(self, X1: Any, X2: Any) -> np.ndarray:
        """d_A(X1[i], X2[i]) for every row i: (m,)."""
        first, second = self._map(X1, "X1"), self._map(X2, "X2")
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
