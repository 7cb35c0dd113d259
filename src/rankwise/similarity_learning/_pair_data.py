"""Shared plumbing of the pair-based similarity estimators.

:class:`BilinearSimilarity` and :class:`MMC` use: validated ``X, y``, the training pairs of Eq. (4)/(5) of Vogel, Bellet & Clémençon
(ICML 2018) -- every positive pair, and the negative pairs either complete or as an incomplete
U-statistic of Sec. 4 -- and the decision threshold read off the training ROC curve.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sklearn.utils.validation import check_array, check_X_y
from threadpoolctl import threadpool_limits

from .._validation import Interval, check_choice, check_scalar
from ..sampling.pairs import (
    class_structure,
    negative_pairs,
    sample_class_tuples,
    sample_negative_pairs,
)

__all__ = [
    "NEGATIVE_SCHEMES",
    "PairSet",
    "check_features",
    "check_training_data",
    "limited_threads",
    "training_pairs",
]

NEGATIVE_SCHEMES = ("complete", "pairs", "tuples")
_COUNT = Interval("integer", 1, None)


def _refuse_strings(X: Any, name: str) -> None:
    """Raise on text, which scikit-learn's float conversion would parse silently ("1.5" -> 1.5)."""
    if isinstance(X, torch.Tensor):
        return
    try:
        array = np.asarray(X)
    except (ValueError, TypeError):  # ragged input: check_array reports it
        return
    text = array.dtype.kind in "USV" or (
        array.dtype.kind == "O" and any(isinstance(v, (str, bytes)) for v in array.flat)
    )
    if text:
        raise ValueError(
            f"`{name}` holds strings; pass numbers (convert numeric text explicitly, e.g. "
            f"{name}.astype(float), after checking that it is what you meant)."
        )


def check_features(X: Any, name: str = "X", n_features: int | None = None) -> np.ndarray:
    """(n, d) finite float64 array; with ``n_features`` the width must match the fitted one."""
    _refuse_strings(X, name)
    try:
        array = check_array(X, dtype=np.float64, ensure_2d=True, ensure_min_samples=1)
    except ValueError as exc:
        raise ValueError(f"`{name}`: {exc}") from None
    if n_features is not None and array.shape[1] != n_features:
        raise ValueError(
            f"`{name}` has {array.shape[1]} features but the estimator was fitted with "
            f"{n_features}."
        )
    return array


def check_training_data(X: Any, y: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validated (n, d) float64 features and (n,) labels with two classes and a positive pair."""
    _refuse_strings(X, "X")
    shape = np.shape(y)
    if len(shape) != 1:
        raise ValueError(
            f"`y` must be 1-D (one class id per row of `X`), got shape {shape}; pass y.ravel()."
        )
    try:
        features, labels = check_X_y(X, y, dtype=np.float64, ensure_min_samples=2)
    except ValueError as exc:
        raise ValueError(f"`X`, `y`: {exc}") from None
    groups = class_structure(labels, "y")  # raises on a single class
    if int(groups.sizes.max()) < 2:
        raise ValueError(
            "`y` has no class with two samples: there is no positive pair, so the positive risk "
            "of Eq. (4) is undefined; pass at least two samples of some class."
        )
    return features, labels


def check_unit_rows(X: np.ndarray, name: str = "X", atol: float = 1e-4) -> None:
    """Raise unless every row of ``X`` has Euclidean norm 1 (within ``atol``)."""
    norms = np.linalg.norm(X, axis=1)
    bad = np.abs(norms - 1.0) > atol
    if bad.any():
        example = float(norms[bad][0])
        raise ValueError(
            f"`{name}` must hold L2-normalized rows (S_A(x, x') = (1 + x^T A x')/2 lies in [0, 1] "
            f"only for unit vectors): {int(bad.sum())} of {X.shape[0]} rows have a norm other than "
            f"1 (e.g. {example:.4g}). Normalize them with sklearn.preprocessing.normalize(X) or "
            "pass normalize=True."
        )


def normalize_rows(X: np.ndarray, name: str = "X") -> np.ndarray:
    """Rows scaled to unit norm; a zero row has no direction and raises."""
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    if (norms == 0).any():
        raise ValueError(
            f"`{name}` has {int((norms == 0).sum())} all-zero row(s), which cannot be normalized; "
            "drop them or add a constant feature."
        )
    return X / norms


@dataclass(frozen=True)
class PairSet:
    """Training pairs with weights: ``Σ weight·f(pair)`` is the (incomplete) mean of Eq. (4)/(5).

    Attributes:
        pos_first, pos_second: (P,) index arrays of the positive pairs used.
        pos_weight: (P,) weights summing to 1.
        neg_first, neg_second: (Q,) index arrays of the negative pairs used.
        neg_weight: (Q,) weights summing to 1.
        n_positive_pairs, n_negative_pairs: the counts n⁺, n⁻ of the complete statistics.
    """

    pos_first: np.ndarray
    pos_second: np.ndarray
    pos_weight: np.ndarray
    neg_first: np.ndarray
    neg_second: np.ndarray
    neg_weight: np.ndarray
    n_positive_pairs: int
    n_negative_pairs: int


def _all_positive_pairs(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair i < j of the same class, class by class (no n x n intermediate)."""
    groups = class_structure(labels)
    firsts, seconds = [], []
    for start, size in zip(groups.starts, groups.sizes, strict=True):
        members = np.sort(groups.order[start : start + size])
        a, b = np.triu_indices(int(size), 1)
        firsts.append(members[a])
        seconds.append(members[b])
    return np.concatenate(firsts).astype(np.int64), np.concatenate(seconds).astype(np.int64)


def _positive_pairs(
    labels: np.ndarray, max_pairs: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Every positive pair, or ``max_pairs`` of them drawn uniformly (Remark 4 of the paper)."""
    groups = class_structure(labels)
    if groups.n_positive_pairs <= max_pairs:
        return _all_positive_pairs(labels)
    weights = (groups.sizes * (groups.sizes - 1)).astype(np.float64)
    classes = rng.choice(groups.sizes.size, size=max_pairs, p=weights / weights.sum())
    sizes = groups.sizes[classes]
    a = np.minimum(np.floor(rng.random(max_pairs) * sizes).astype(np.int64), sizes - 1)
    b = np.minimum(np.floor(rng.random(max_pairs) * (sizes - 1)).astype(np.int64), sizes - 2)
    b = np.where(b >= a, b + 1, b)  # a different member of the same class
    first = groups.order[groups.starts[classes] + a]
    second = groups.order[groups.starts[classes] + b]
    return np.minimum(first, second), np.maximum(first, second)


def training_pairs(
    labels: np.ndarray,
    negatives: str,
    n_negative_samples: int | None,
    max_pairs: int,
    rng: np.random.Generator,
    with_positives: bool = True,
) -> PairSet:
    """The pairs a pair-based estimator trains on.

    Args:
        labels: (n,) validated class ids.
        negatives: ``"complete"`` (refused above ``max_pairs`` pairs), ``"pairs"`` or
            ``"tuples"``, as in :class:`MMC`.
        n_negative_samples: B; ``None`` picks B = n pairs or ⌈0.15 n⌉ tuples (Fig. 4's budget).
        max_pairs: at most this many positive pairs (uniformly subsampled beyond) and complete
            negative pairs.
        rng: the generator of every draw.
        with_positives: False leaves the positive pairs out (empty arrays), for estimators that
            compute the positive term in closed form.
    """
    check_choice(negatives, "negatives", NEGATIVE_SCHEMES)
    groups = class_structure(labels)
    if with_positives:
        pos_first, pos_second = _positive_pairs(labels, max_pairs, rng)
        pos_weight = np.full(pos_first.shape[0], 1.0 / pos_first.shape[0])
    else:
        pos_first = pos_second = np.zeros(0, np.int64)
        pos_weight = np.zeros(0)
    n = labels.shape[0]
    if negatives == "complete":
        if groups.n_negative_pairs > max_pairs:
            raise ValueError(
                f"negatives='complete' needs all {groups.n_negative_pairs:,} negative pairs, more "
                f"than max_pairs={max_pairs:,}; use negatives='tuples' or 'pairs' (an incomplete "
                "U-statistic) or raise max_pairs."
            )
        neg_first, neg_second = negative_pairs(labels, max_pairs=max_pairs)
        neg_weight = np.full(neg_first.shape[0], 1.0 / neg_first.shape[0])
    else:
        default = n if negatives == "pairs" else int(np.ceil(0.15 * n))
        budget = default if n_negative_samples is None else n_negative_samples
        budget = check_scalar(budget, "n_negative_samples", _COUNT)
        sampler = sample_negative_pairs if negatives == "pairs" else sample_class_tuples
        neg_first, neg_second, neg_weight = sampler(labels, budget, rng).pairs()
    return PairSet(
        pos_first,
        pos_second,
        pos_weight,
        neg_first,
        neg_second,
        neg_weight,
        groups.n_positive_pairs,
        groups.n_negative_pairs,
    )


@contextmanager
def limited_threads(n_threads: int | None) -> Iterator[None]:
    """Run a fit with at most ``n_threads`` BLAS / OpenMP and torch intra-op threads.

    ``None`` leaves both as they are. One thread is often the fastest choice for the small
    matrices of these estimators on a busy machine, where idle BLAS threads spin.
    """
    if n_threads is None:
        yield
        return
    count = check_scalar(n_threads, "n_threads", _COUNT)
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        with threadpool_limits(limits=count):
            yield
    finally:
        torch.set_num_threads(before)
