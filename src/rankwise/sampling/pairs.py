"""Incomplete U-statistics for the negative-pair risk of a similarity.

In Vogel, Bellet & Clémençon (ICML 2018), the empirical negative risk of a similarity S on n
labelled points is the U-statistic of Eq. (5), R̂⁻(S) = (1/n⁻) Σ_{i<j, Y_i≠Y_j} S(X_i, X_j), a sum
over n⁻ = Σ_{k<l} n_k n_l pairs, far too many when n is large. Sec. 4 replaces it by an *incomplete*
U-statistic of B terms drawn with replacement, in one of two ways:

- pair-based, R̄_B: B pairs drawn uniformly among the negative pairs
  (:func:`sample_negative_pairs`, :func:`pair_based_negative_risk`);
- tuple-based, R̃_B: B K-tuples holding one random sample of each class, each tuple scored by
  h_S = (1/n⁻) Σ_{k<l} n_k n_l S(X_k, X_l), i.e. B·K(K−1)/2 pairs balanced across all class pairs
  (:func:`sample_class_tuples`, :func:`tuple_based_negative_risk`).

Both are unbiased estimates of R̂⁻ (:func:`complete_negative_risk` computes it exactly for small n);
their variances given the data, σ²_P / B and σ²_T / B, which converge to the two terms of Prop. 1,
are computed exactly by :func:`incomplete_variances`.

A ``similarity`` argument is either an (n, n) similarity matrix (numpy array or tensor) or a
callable ``similarity(first, second)`` that maps two (m,) integer index arrays to the (m,) scores
S(X_first[t], X_second[t]); S must be symmetric.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from .._validation import Interval, check_scalar

__all__ = [
    "ClassTupleSample",
    "NegativePairSample",
    "class_structure",
    "complete_negative_risk",
    "incomplete_variances",
    "IncompleteVariances",
    "negative_pairs",
    "pair_based_negative_risk",
    "sample_class_tuples",
    "sample_negative_pairs",
    "tuple_based_negative_risk",
]

Similarity = Union[np.ndarray, torch.Tensor, Callable[[np.ndarray, np.ndarray], Any]]
RandomState = Union[np.random.Generator, int, None]

# Pairs materialized at once by the complete statistic (about 160 MB of index arrays).
_DEFAULT_MAX_PAIRS = 10_000_000
_COUNT = Interval("integer", 1, None)


# -- labels --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Classes:
    """Samples grouped by class: ``order[starts[k] : starts[k] + sizes[k]]`` are class k's."""

    classes: np.ndarray  # (K,) the distinct labels, ascending
    sizes: np.ndarray  # (K,) int64 n_k
    starts: np.ndarray  # (K,) int64 offsets into ``order``
    order: np.ndarray  # (n,) int64 sample indices sorted by class (stable)
    codes: np.ndarray  # (n,) int64 class position of every sample

    @property
    def n_negative_pairs(self) -> int:
        n = int(self.sizes.sum())
        return (n * n - int((self.sizes * self.sizes).sum())) // 2

    @property
    def n_positive_pairs(self) -> int:
        return int((self.sizes * (self.sizes - 1)).sum()) // 2


def class_structure(labels: Any, name: str = "labels") -> _Classes:
    """Validate 1-D integer ``labels`` with at least two classes and group the samples by class.

    Args:
        labels: (n,) integer class ids (array, tensor or sequence).
        name: the argument the labels came in as, named by the errors (``"y"`` for an estimator).

    Raises:
        ValueError: labels that are not a 1-D array of integer class ids, or a single class (no
            negative pair exists).
    """
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"`{name}` must be a 1-D array of class ids, got shape {y.shape}.")
    if y.dtype.kind == "f":
        if not np.all(np.isfinite(y)) or not np.all(y == np.round(y)):
            raise ValueError(f"`{name}` must hold integer class ids, got non-integer floats.")
        y = y.astype(np.int64)
    elif y.dtype.kind not in "iu":
        raise ValueError(
            f"`{name}` must hold integer class ids, got dtype {y.dtype}; map class names to ids "
            f"first, e.g. np.unique({name}, return_inverse=True)[1]."
        )
    classes, codes, sizes = np.unique(y, return_inverse=True, return_counts=True)
    if classes.size < 2:
        raise ValueError(
            f"`{name}` holds a single class ({classes.size} distinct value(s) among {y.size} "
            "samples): there is no negative pair; pass samples of at least two classes."
        )
    order = np.argsort(codes, kind="stable").astype(np.int64)
    sizes = sizes.astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return _Classes(classes, sizes, starts, order, codes.astype(np.int64).reshape(-1))


def _generator(random_state: RandomState) -> np.random.Generator:
    if isinstance(random_state, np.random.Generator):
        return random_state
    if random_state is None or (
        isinstance(random_state, (int, np.integer)) and not isinstance(random_state, bool)
    ):
        return np.random.default_rng(random_state)
    raise ValueError(
        f"`rng` must be a numpy Generator, an integer seed or None, got {random_state!r}."
    )


# -- samples ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NegativePairSample:
    """B negative pairs drawn uniformly with replacement (the pair-based scheme of Sec. 4).

    Attributes:
        first: (B,) int64 index of one sample of each pair.
        second: (B,) int64 index of the other sample; ``labels[first] != labels[second]`` and
            ``first < second``.
        n_negative_pairs: n⁻, the number of negative pairs of the labels sampled from.
        n_samples: n, the number of labels sampled from (``None``: not recorded).
    """

    first: np.ndarray
    second: np.ndarray
    n_negative_pairs: int
    n_samples: int | None = None

    @property
    def n_pairs(self) -> int:
        """Number of sampled pairs B."""
        return int(self.first.shape[0])

    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(first, second, weights)``; every weight is 1/B (they sum to 1)."""
        weights = np.full(self.n_pairs, 1.0 / self.n_pairs)
        return self.first, self.second, weights


@dataclass(frozen=True)
class ClassTupleSample:
    """B K-tuples, one uniformly drawn sample of every class each (the tuple-based scheme).

    Attributes:
        indices: (B, K) int64; column k holds samples of class ``classes[k]``.
        classes: (K,) the distinct labels, ascending.
        class_sizes: (K,) int64 n_k.
        pair_weights: (K, K) float64 with w_kl = n_k n_l / n⁻ above the diagonal and 0 elsewhere
            (they sum to 1): the weight of the class pair (k, l) in h_S.
    """

    indices: np.ndarray
    classes: np.ndarray
    class_sizes: np.ndarray
    pair_weights: np.ndarray

    @property
    def n_tuples(self) -> int:
        """Number of sampled tuples B."""
        return int(self.indices.shape[0])

    @property
    def n_pairs(self) -> int:
        """Number of pairs the tuples hold, B·K(K−1)/2."""
        k = self.indices.shape[1]
        return self.n_tuples * k * (k - 1) // 2

    def pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every pair of every tuple: ``(first, second, weights)``, (B·K(K−1)/2,) each.

        The weight of a pair of classes (k, l) is w_kl / B, so Σ weights·S(first, second) is
        R̃_B (the weights sum to 1).
        """
        k_idx, l_idx = np.triu_indices(self.indices.shape[1], 1)
        first = self.indices[:, k_idx].reshape(-1)
        second = self.indices[:, l_idx].reshape(-1)
        weights = np.tile(self.pair_weights[k_idx, l_idx] / self.n_tuples, self.n_tuples)
        return first, second, weights


def _pair_weight_matrix(sizes: np.ndarray) -> np.ndarray:
    n_minus = (float(sizes.sum()) ** 2 - float((sizes.astype(np.float64) ** 2).sum())) / 2
    return np.triu(np.outer(sizes, sizes).astype(np.float64), 1) / n_minus


def sample_negative_pairs(labels: Any, B: int, rng: RandomState = None) -> NegativePairSample:
    """Draw B pairs uniformly with replacement among the negative pairs {i < j: Y_i ≠ Y_j}.

    Exact and O(n + B): the first sample i is drawn with probability proportional to its number
    of negative partners n − n_{Y_i}, the second uniformly among the samples of the other
    classes, so every negative pair has probability 1/n⁻.

    Args:
        labels: (n,) integer class ids with at least two classes.
        B: number of pairs, ≥ 1.
        rng: numpy ``Generator``, integer seed or None.

    Returns:
        :class:`NegativePairSample`.
    """
    n_draws = check_scalar(B, "B", _COUNT)
    groups = class_structure(labels)
    gen = _generator(rng)
    n = int(groups.sizes.sum())
    partners = (n - groups.sizes[groups.codes]).astype(np.float64)
    first = gen.choice(n, size=n_draws, p=partners / partners.sum())
    code = groups.codes[first]
    # uniform position among the n − n_k samples outside class k: skip over class k's block
    offset = np.floor(gen.random(n_draws) * (n - groups.sizes[code])).astype(np.int64)
    offset = np.minimum(offset, n - groups.sizes[code] - 1)
    position = np.where(offset < groups.starts[code], offset, offset + groups.sizes[code])
    second = groups.order[position]
    low, high = np.minimum(first, second), np.maximum(first, second)
    return NegativePairSample(
        low.astype(np.int64), high.astype(np.int64), groups.n_negative_pairs, n
    )


def sample_class_tuples(labels: Any, B: int, rng: RandomState = None) -> ClassTupleSample:
    """Draw B K-tuples with replacement, one uniformly drawn sample of every class each.

    Args:
        labels: (n,) integer class ids with K ≥ 2 classes.
        B: number of tuples, ≥ 1 (they hold B·K(K−1)/2 pairs).
        rng: numpy ``Generator``, integer seed or None.

    Returns:
        :class:`ClassTupleSample` with the weights n_k n_l / n⁻ of Sec. 4.
    """
    n_draws = check_scalar(B, "B", _COUNT)
    groups = class_structure(labels)
    gen = _generator(rng)
    draws = np.floor(gen.random((n_draws, groups.sizes.size)) * groups.sizes).astype(np.int64)
    draws = np.minimum(draws, groups.sizes - 1)
    indices = groups.order[groups.starts + draws]
    return ClassTupleSample(
        indices, groups.classes, groups.sizes.copy(), _pair_weight_matrix(groups.sizes)
    )


def negative_pairs(labels: Any, *, max_pairs: int = _DEFAULT_MAX_PAIRS) -> tuple[np.ndarray, ...]:
    """Every negative pair i < j, Y_i ≠ Y_j, as ``(first, second)`` (n⁻,) int64 arrays.

    Raises:
        ValueError: a single class, or more than ``max_pairs`` negative pairs (use
            :func:`sample_negative_pairs` / :func:`sample_class_tuples`).
    """
    groups = class_structure(labels)
    limit = check_scalar(max_pairs, "max_pairs", _COUNT)
    if groups.n_negative_pairs > limit:
        raise ValueError(
            f"{groups.n_negative_pairs:,} negative pairs exceed `max_pairs`={limit:,}; use an "
            "incomplete U-statistic (sample_negative_pairs / sample_class_tuples) or raise "
            "`max_pairs`."
        )
    codes = groups.codes
    n = codes.size
    first_parts, second_parts = [], []
    for i in range(n - 1):  # one row of the upper triangle at a time: O(n) memory per row
        j = np.arange(i + 1, n)
        j = j[codes[j] != codes[i]]
        first_parts.append(np.full(j.size, i, dtype=np.int64))
        second_parts.append(j)
    if not first_parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(first_parts), np.concatenate(second_parts)


# -- estimators ------------------------------------------------------------------------------------
def _pair_values(similarity: Similarity, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """S(X_first, X_second) as a float64 numpy array, from a matrix or a callable."""
    if callable(similarity):
        values = similarity(first, second)
    else:
        matrix = similarity
        if isinstance(matrix, torch.Tensor):
            index = torch.as_tensor(first), torch.as_tensor(second)
            values = matrix[index[0].to(matrix.device), index[1].to(matrix.device)]
        else:
            matrix = np.asarray(matrix)
            if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
                raise ValueError(
                    f"`similarity` must be an (n, n) matrix or a callable, got shape "
                    f"{matrix.shape}."
                )
            values = matrix[first, second]
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    if values.shape[0] != first.shape[0]:
        raise ValueError(
            f"`similarity` returned {values.shape[0]} scores for {first.shape[0]} pairs."
        )
    if not np.all(np.isfinite(values)):
        raise ValueError("`similarity` returned NaN or inf scores.")
    return values


def _check_matrix_size(similarity: Similarity, n: int) -> None:
    if callable(similarity):
        return
    shape = tuple(similarity.shape)
    if shape != (n, n):
        raise ValueError(
            f"`similarity` has shape {shape} but `labels` has {n} entries; pass the (n, n) "
            "similarity matrix of the labelled samples."
        )


def _finite_matrix(similarity: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(similarity, torch.Tensor):
        similarity = similarity.detach().cpu().numpy()
    matrix = np.asarray(similarity, dtype=np.float64)
    if not np.all(np.isfinite(matrix)):
        raise ValueError("`similarity` contains NaN or inf scores.")
    return matrix


def complete_negative_risk(
    similarity: Similarity, labels: Any, *, max_pairs: int = _DEFAULT_MAX_PAIRS
) -> float:
    """R̂⁻(S) of Eq. (5): the mean of S over every negative pair i < j (the complete statistic).

    With an (n, n) matrix the sum is taken class block by class block (no pair list); with a
    callable the pairs are enumerated, at most ``max_pairs`` of them.
    """
    groups = class_structure(labels)
    n = int(groups.sizes.sum())
    _check_matrix_size(similarity, n)
    if callable(similarity):
        first, second = negative_pairs(labels, max_pairs=max_pairs)
        return float(_pair_values(similarity, first, second).mean())
    matrix = _finite_matrix(similarity)
    total = 0.0
    for k in range(groups.sizes.size - 1):
        rows = groups.order[groups.starts[k] : groups.starts[k] + groups.sizes[k]]
        cols = groups.order[groups.starts[k] + groups.sizes[k] :]
        total += float(matrix[np.ix_(rows, cols)].sum())
    return total / groups.n_negative_pairs


def _check_sample_matrix(similarity: Similarity, n: int | None, largest_index: int) -> None:
    """An (n, n) matrix for a sample of n labelled points (before indexing it out of bounds)."""
    if callable(similarity):
        return
    shape = tuple(similarity.shape)
    square = len(shape) == 2 and shape[0] == shape[1]
    if n is not None and shape != (n, n):
        raise ValueError(
            f"`similarity` has shape {shape} but the sample is of {n} labelled samples; pass the "
            "(n, n) similarity matrix of the samples the pairs were drawn from."
        )
    if n is None and (not square or shape[0] <= largest_index):
        raise ValueError(
            f"`similarity` has shape {shape} but the sample holds sample index {largest_index}; "
            "pass the (n, n) similarity matrix of the samples the pairs were drawn from."
        )


def pair_based_negative_risk(similarity: Similarity, sample: NegativePairSample) -> float:
    """R̄_B(S): the mean of S over the sampled negative pairs (unbiased for R̂⁻(S))."""
    _check_sample_matrix(similarity, sample.n_samples, int(sample.second.max(initial=0)))
    return float(_pair_values(similarity, sample.first, sample.second).mean())


def tuple_based_negative_risk(similarity: Similarity, sample: ClassTupleSample) -> float:
    """R̃_B(S) = (1/B) Σ_tuples h_S(tuple), h_S = Σ_{k<l} (n_k n_l / n⁻) S(X_k, X_l) (unbiased)."""
    _check_sample_matrix(similarity, int(sample.class_sizes.sum()), int(sample.indices.max()))
    first, second, weights = sample.pairs()
    return float((_pair_values(similarity, first, second) * weights).sum())


# -- Prop. 1 ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IncompleteVariances:
    """Conditional variances of one term of each incomplete estimator, given the data.

    Attributes:
        negative_risk: R̂⁻(S), the complete statistic both estimators are unbiased for.
        pair_variance: σ²_P, the variance of S over the negative pairs: Var(R̄_B | data) = σ²_P/B.
        tuple_variance: σ²_T, the variance of h_S over all K-tuples: Var(R̃_B | data) = σ²_T/B.
        n_classes: K.
    """

    negative_risk: float
    pair_variance: float
    tuple_variance: float
    n_classes: int

    def for_pair_budget(self, n_pairs: int) -> tuple[float, float]:
        """(Var R̄, Var R̃) given the data when both schemes sample ``n_pairs`` = B₀ pairs.

        Pair-based: σ²_P / B₀. Tuple-based: B₀ / (K(K−1)/2) tuples, σ²_T · K(K−1) / (2 B₀),
        the two terms of Prop. 1.
        """
        budget = check_scalar(n_pairs, "n_pairs", _COUNT)
        per_tuple = self.n_classes * (self.n_classes - 1) / 2
        return self.pair_variance / budget, self.tuple_variance * per_tuple / budget


def incomplete_variances(similarity: np.ndarray | torch.Tensor, labels: Any) -> IncompleteVariances:
    """Exact σ²_P and σ²_T of the two sampling schemes on one dataset (Prop. 1).

    σ²_T is computed without enumerating the Π_k n_k tuples: with h_S = Σ_{k<l} w_kl S_kl and the
    X_k independent, Var(h_S) = Σ_{k<l} w_kl² Var(S_kl) + Σ_c Σ_{a≠b; a,b≠c} w_ca w_cb Cov(S_ca,
    S_cb), where pairs of class pairs sharing one class c covary through E[m_a(X_c) m_b(X_c)],
    m_a(x) the mean similarity of x to class a. Cost O(n² + n K² + K³).

    Args:
        similarity: (n, n) symmetric similarity matrix of the samples.
        labels: (n,) integer class ids, K ≥ 2 classes.
    """
    groups = class_structure(labels)
    n = int(groups.sizes.sum())
    _check_matrix_size(similarity, n)
    matrix = _finite_matrix(similarity)
    k_classes = groups.sizes.size
    onehot = np.zeros((n, k_classes))
    onehot[np.arange(n), groups.codes] = 1.0
    sizes = groups.sizes.astype(np.float64)
    # class means of S and of S², and every sample's mean similarity to every class
    block_sum = onehot.T @ matrix @ onehot
    block_sq = onehot.T @ (matrix * matrix) @ onehot
    to_class = matrix @ onehot / sizes  # (n, K): m_a(x_i)
    mean = block_sum / np.outer(sizes, sizes)
    mean_sq = block_sq / np.outer(sizes, sizes)
    weights = _pair_weight_matrix(groups.sizes)
    weights = weights + weights.T  # symmetric, zero diagonal
    negative_mask = ~np.eye(k_classes, dtype=bool)
    risk = float((weights * mean).sum() / 2)
    n_neg = groups.n_negative_pairs
    pair_var = float((block_sq[negative_mask].sum() / 2) / n_neg - risk**2)

    tuple_var = float((np.triu(weights, 1) ** 2 * (mean_sq - mean**2)).sum())
    for c in range(k_classes):
        members = to_class[groups.codes == c]  # (n_c, K)
        second_moment = members.T @ members / sizes[c]  # E[m_a(X_c) m_b(X_c)]
        cov = second_moment - np.outer(mean[c], mean[c])
        w = weights[c].copy()
        w[c] = 0.0
        outer = np.outer(w, w) * cov
        tuple_var += float(outer.sum() - np.trace(outer))
    return IncompleteVariances(risk, max(pair_var, 0.0), max(tuple_var, 0.0), k_classes)
