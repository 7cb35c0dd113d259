"""Slow: exact agreement of the counting kernels with a sort-based reference at a realistic size
(20,000-item leave-one-out gallery, both many-class and few-class layouts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rankwise.metrics import retrieval_metrics

pytestmark = pytest.mark.slow


def _sorted_ap(scores: np.ndarray, relevant: np.ndarray) -> float:
    order = np.argsort(-scores, kind="stable")
    rel = relevant[order]
    hits = np.cumsum(rel)
    return float((hits[rel] / (np.flatnonzero(rel) + 1)).mean())


@pytest.mark.parametrize("n_classes", [4000, 10])
def test_large_leave_one_out_matches_sorting_reference(n_classes):
    rng = np.random.default_rng(7)
    n, dim = 20_000, 64
    labels = rng.integers(0, n_classes, n)
    centers = rng.normal(size=(n_classes, dim))
    x = centers[labels] + 1.5 * rng.normal(size=(n, dim))
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    report = retrieval_metrics(x, labels, ks=(1, 10))
    # cosine in float64 (products of float32 entries are exact): accurate to ~1e-16, so it
    # orders these tie-free scores like rankwise's exact keys
    xd = torch.from_numpy(x).double()
    unit = xd / xd.norm(dim=1, keepdim=True)
    queries = rng.choice(n, 300, replace=False)
    scores = (unit[queries] @ unit.T).numpy()
    for row, q in enumerate(queries):
        keep = np.arange(n) != q
        rel = labels[keep] == labels[q]
        if not rel.any():
            assert np.isnan(float(report.per_query_ap[q]))
            continue
        ref = _sorted_ap(scores[row, keep], rel)
        assert float(report.per_query_ap[q]) == pytest.approx(ref, abs=1e-12)
