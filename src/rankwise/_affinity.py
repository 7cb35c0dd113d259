"""Affinity (graded relevance) between items: the one definition shared by metrics and losses.

He, Cakir, Bargal & Sclaroff, "Hashing as Tie-Aware Learning to Rank" (CVPR 2018), Sec. 3.1 and
5.2-5.3: binary from class labels or multi-hot labels (share at least one label), multi-level as
the number of shared labels (NUS-WIDE) or from thresholded Euclidean distances of the original
features (LabelMe: the 5 %, 1 %, 0.2 %, 0.1 % quantiles of the training pairs' distances give
affinities 1, 2, 5, 10), or any callable ``f(labels, ref_labels) -> (n, m)`` of levels >= 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ._validation import Interval, as_tensor, check_embeddings, check_labels, check_scalar

__all__ = [
    "AFFINITIES",
    "EuclideanThresholdAffinity",
    "IndexedAffinity",
    "affinity_labels",
    "affinity_levels",
    "check_affinity",
    "features_array",
]

AFFINITIES = ("labels", "shared_labels")
# relative rounding bound, per feature, of the squared distances |q|² + |g|² - 2 qᵀg (float64
# unit roundoff 1.1e-16, with a wide margin): pairs this close to a threshold are recomputed
_GRAM_SLACK = 1e-15


class EuclideanThresholdAffinity:
    """Multi-level affinity from Euclidean distances of the original features (LabelMe, Sec. 5.3).

    A pair at distance ``δ`` gets the level of the smallest threshold ``t_i >= δ``; pairs beyond
    every threshold get 0. The paper's LabelMe setting: thresholds at the 5 %, 1 %, 0.2 % and
    0.1 % quantiles of the training pairs' distances give levels 1, 2, 5 and 10
    (:meth:`from_quantiles`). A single threshold gives the binary "Euclidean neighbour" affinity.

    Args:
        thresholds: distances, one per level (any order; matched to ``levels`` by size: the
            largest threshold gets the smallest level).
        levels: positive integer affinities (at most 255), as many as thresholds.

    Called as ``affinity(query_features (n_q, F), database_features (n, F))`` it returns an
    ``(n_q, n)`` uint8 array of levels.

    Example:
        >>> import numpy as np
        >>> from rankwise.metrics import EuclideanThresholdAffinity
        >>> affinity = EuclideanThresholdAffinity(thresholds=[1.0, 2.0], levels=[2, 1])
        >>> affinity(np.zeros((1, 2)), np.array([[0.5, 0.0], [1.5, 0.0], [3.0, 0.0]])).tolist()
        [[2, 1, 0]]
    """

    def __init__(self, thresholds: Sequence[float], levels: Sequence[int] = (1, 2, 5, 10)) -> None:
        t = np.asarray(
            [check_scalar(v, "thresholds", Interval("real", 0, None)) for v in thresholds]
        )
        lv = np.asarray([check_scalar(v, "levels", Interval("integer", 1, 255)) for v in levels])
        if t.size == 0 or t.size != lv.size:
            raise ValueError(
                f"`thresholds` ({t.size}) and `levels` ({lv.size}) must be non-empty and of the "
                "same length."
            )
        if np.unique(t).size != t.size or np.unique(lv).size != lv.size:
            raise ValueError("`thresholds` and `levels` must each hold distinct values.")
        # decreasing thresholds <-> increasing levels
        self.thresholds = t[np.argsort(-t, kind="stable")].astype(np.float64)
        self.levels = lv[np.argsort(lv, kind="stable")].astype(np.uint8)

    @classmethod
    def from_quantiles(
        cls,
        features: Any,
        quantiles: Sequence[float] = (0.05, 0.01, 0.002, 0.001),
        levels: Sequence[int] = (1, 2, 5, 10),
        *,
        max_pairs: int = 20_000_000,
        seed: int = 0,
    ) -> EuclideanThresholdAffinity:
        """Thresholds at quantiles of the pairwise distances of ``features`` (the training set).

        Args:
            features: ``(n, F)`` original features.
            quantiles: fractions of the closest pairs, one per level (paper: 5 %, 1 %, 0.2 %,
                0.1 %).
            levels: the affinities of those quantiles (paper: 1, 2, 5, 10).
            max_pairs: above this many distinct pairs, the quantiles are taken over a uniform
                random sample of that many pairs (seeded); below it, over every pair exactly.
            seed: seed of the pair sample.
        """
        x = features_array(features, "features")
        n = x.shape[0]
        if n < 2:
            raise ValueError("`features` needs at least 2 rows to have pairwise distances.")
        q = [
            check_scalar(v, "quantiles", Interval("real", 0, 1, closed="neither"))
            for v in quantiles
        ]
        n_pairs = n * (n - 1) // 2
        if n_pairs <= max_pairs:
            rows, cols = np.triu_indices(n, 1)
        else:
            rng = np.random.default_rng(seed)
            rows = rng.integers(0, n, max_pairs)
            cols = rng.integers(0, n - 1, max_pairs)
            cols = cols + (cols >= rows)  # uniform over j != i
        dist = _pair_distances(x, x, rows, cols)
        return cls(np.quantile(dist, q), levels)

    def __call__(self, query_features: Any, database_features: Any) -> np.ndarray:
        """``(n_q, n)`` uint8 affinity levels."""
        return self.against(database_features)(query_features)

    def against(self, database_features: Any) -> Callable[[Any], np.ndarray]:
        """``levels(query_features) -> (n_q, n)`` for a fixed database, prepared once.

        Distances come from ``|q|² + |g|² - 2 qᵀg`` (one matrix product; the database is centred
        once, distances being translation-invariant, against the cancellation far from the origin).
        Its rounding differs from the pair distances :meth:`from_quantiles` takes the thresholds
        from, so a pair lying exactly at a quantile could fall on either side of its threshold:
        every pair within the formula's rounding bound of a threshold is recomputed by that same
        pair function (``√Σ (q - g)²``), and is then on the same side as in :meth:`from_quantiles`.
        """
        g = features_array(database_features, "database_labels")
        centre = g.mean(0)
        gc = g - centre
        g_sq = (gc * gc).sum(1)

        def levels(query_features: Any) -> np.ndarray:
            q = features_array(query_features, "query_labels")
            if q.shape[1] != gc.shape[1]:
                raise ValueError(
                    f"query features have {q.shape[1]} columns but database features {gc.shape[1]}."
                )
            qc = q - centre
            q_sq = (qc * qc).sum(1)
            sq = q_sq[:, None] + g_sq[None, :] - 2.0 * (qc @ gc.T)
            dist = np.sqrt(np.maximum(sq, 0.0))
            # rounding bound of sq (a dot product of F terms, plus the centring), generously
            slack = _GRAM_SLACK * (gc.shape[1] + 4) * (q_sq[:, None] + g_sq[None, :])
            near = np.zeros(sq.shape, dtype=bool)
            for threshold in self.thresholds:
                near |= np.abs(sq - threshold * threshold) <= slack
            rows, cols = np.nonzero(near)
            dist[rows, cols] = _pair_distances(q, g, rows, cols)
            out = np.zeros(dist.shape, dtype=np.uint8)
            for threshold, level in zip(self.thresholds, self.levels, strict=True):
                out[dist <= threshold] = level
            return out

        return levels

    @property
    def max_level(self) -> int:
        """Largest affinity value."""
        return int(self.levels.max())

    def to_dict(self) -> dict[str, list]:
        """JSON-safe form (``EuclideanThresholdAffinity(**d)`` rebuilds it)."""
        return {"thresholds": self.thresholds.tolist(), "levels": self.levels.tolist()}

    def __repr__(self) -> str:
        pairs = ", ".join(
            f"<= {t:.4g}: {lv}" for t, lv in zip(self.thresholds, self.levels, strict=True)
        )
        return f"EuclideanThresholdAffinity({pairs})"


class IndexedAffinity:
    """An affinity between items named by their row in a feature table.

    For training and evaluation code that passes integer item ids as labels (a batch sampler
    needs labels, the Euclidean affinity needs features): ``IndexedAffinity(features,
    affinity)(ids_a, ids_b) = affinity(features[ids_a], features[ids_b])``.

    Args:
        features: ``(N, F)`` original features of every item.
        affinity: an :class:`EuclideanThresholdAffinity` (or any callable of two feature
            matrices returning ``(n_a, n_b)`` integer levels with a ``max_level`` attribute).
    """

    def __init__(self, features: Any, affinity: EuclideanThresholdAffinity) -> None:
        self.features = features_array(features, "features")
        self.affinity = affinity
        self.max_level = int(affinity.max_level)

    def __call__(self, ids_a: Any, ids_b: Any) -> np.ndarray:
        """``(n_a, n_b)`` uint8 levels between the items ``ids_a`` and ``ids_b``."""
        a = np.asarray(ids_a.cpu() if isinstance(ids_a, torch.Tensor) else ids_a, dtype=np.int64)
        b = np.asarray(ids_b.cpu() if isinstance(ids_b, torch.Tensor) else ids_b, dtype=np.int64)
        return self.affinity(self.features[a.reshape(-1)], self.features[b.reshape(-1)])


def features_array(x: Any, name: str) -> np.ndarray:
    """``(n, F)`` finite float64 numpy array of original features (an affinity's labels)."""
    t = as_tensor(x, name)
    if t.ndim != 2:
        raise ValueError(
            f"`{name}` must be 2-D (n, n_features) original features, got {tuple(t.shape)}."
        )
    arr = t.detach().cpu().to(torch.float64).numpy()
    if not np.isfinite(arr).all():
        raise ValueError(f"`{name}` contains NaN or inf.")
    return arr


def _pair_distances(a: np.ndarray, b: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Euclidean distances of the pairs ``(a[rows[i]], b[cols[i]])``, each from its two rows only.

    So :meth:`EuclideanThresholdAffinity.from_quantiles` and a call agree on every pair's side.
    """
    out = np.empty(rows.size, dtype=np.float64)
    step = 1 << 20
    for lo in range(0, rows.size, step):
        diff = a[rows[lo : lo + step]] - b[cols[lo : lo + step]]
        out[lo : lo + step] = np.sqrt(np.einsum("ij,ij->i", diff, diff))
    return out


def check_affinity(affinity: Any) -> Any:
    """Validate an ``affinity`` argument: a name of :data:`AFFINITIES`, a Euclidean one, a callable."""
    if isinstance(affinity, str) and affinity in AFFINITIES:
        return affinity
    if isinstance(affinity, EuclideanThresholdAffinity) or (
        callable(affinity) and not isinstance(affinity, str)
    ):
        return affinity
    shown = repr(affinity) if isinstance(affinity, (str, int, float)) else type(affinity).__name__
    raise ValueError(
        f"`affinity` must be one of {AFFINITIES}, an EuclideanThresholdAffinity or a callable, "
        f"got {shown}."
    )


def affinity_labels(affinity: Any, labels: Any, n: int, name: str, device) -> torch.Tensor:
    """Validated labels for ``affinity``: class ids / multi-hot, features, or anything.

    ``affinity=None`` takes class ids only (the losses that index per-class state by label).
    """
    if affinity is None or isinstance(affinity, str):
        return check_labels(labels, n, name, device=device, allow_multi_hot=affinity is not None)
    if isinstance(affinity, EuclideanThresholdAffinity):
        out = check_embeddings(labels, name, device).to(torch.float64)
    else:
        out = torch.as_tensor(labels, device=device)
    if out.shape[0] != n:
        raise ValueError(f"`{name}` has {out.shape[0]} rows but the codes have {n}.")
    return out


def affinity_levels(affinity: Any, lab: torch.Tensor, ref_lab: torch.Tensor) -> torch.Tensor:
    """``(B, M)`` float64 affinity levels between anchors and references.

    Args:
        affinity: as :func:`check_affinity` accepts it: ``"labels"`` (binary), ``"shared_labels"``
            (number of shared labels), a Euclidean one (labels are features) or a callable.
        lab: anchor labels.
        ref_lab: reference labels.
    """
    if isinstance(affinity, str):
        if lab.ndim != ref_lab.ndim:
            raise ValueError("`labels` and `ref_labels` must be the same kind of labels.")
        if lab.ndim == 1:
            return (lab[:, None] == ref_lab[None, :]).to(torch.float64)
        shared = lab.to(torch.float64) @ ref_lab.to(torch.float64).T
        return shared.clamp_max(1.0) if affinity == "labels" else shared
    levels = affinity(lab.cpu().numpy(), ref_lab.cpu().numpy())
    levels = torch.as_tensor(np.asarray(levels), device=lab.device).to(torch.float64)
    if levels.shape != (lab.shape[0], ref_lab.shape[0]) or not bool((levels >= 0).all()):
        raise ValueError(
            "the affinity must return non-negative levels of shape (n_anchors, n_refs), got "
            f"{tuple(levels.shape)}."
        )
    return levels
