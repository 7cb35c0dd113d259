"""`pointwise-roc-sphere` (Vogel et al., Sec. 5.1, Fig. 1): the cap sampler against the geometry
of the paper, the TPR read-out against rankwise.metrics, the quick study's checks, bad options."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rankwise.experiments import pointwise_roc_sphere as sphere
from rankwise.metrics import roc_curve, tpr_at_fpr


def test_caps_are_uniform_on_their_caps():
    X, y = sphere.sample_caps(30_000, np.random.default_rng(0))
    assert X.shape == (30_000, 3) and y.dtype == np.int64
    np.testing.assert_allclose(np.linalg.norm(X, axis=1), 1.0, atol=1e-12)
    assert np.bincount(y, minlength=3) / y.size == pytest.approx([1 / 3] * 3, abs=0.015)
    low = math.cos(sphere.CAP_ANGLE)
    for k, center in enumerate(sphere.CENTROIDS):
        height = X[y == k] @ center
        # inside the cap, and the height uniform on [cos π/4, 1] (Archimedes): its mean and
        # variance are those of that uniform law
        assert height.min() >= low - 1e-12 and height.max() <= 1 + 1e-12
        assert height.mean() == pytest.approx((1 + low) / 2, abs=4e-3)
        assert height.var() == pytest.approx((1 - low) ** 2 / 12, rel=0.05)
        # the azimuth around the centroid is uniform: the mean offset from the centroid is ~0
        offset = X[y == k] - height[:, None] * center
        assert np.abs(offset.mean(0)).max() < 0.01


def test_tpr_read_out_is_the_rule_of_tpr_at_fpr():
    rng = np.random.default_rng(1)
    scores = np.round(rng.normal(size=400), 1)  # many ties
    same = rng.random(400) < 0.3
    levels = np.array([0.01, 0.05, 0.1, 0.3, 0.9])
    expected = [float(tpr_at_fpr(scores, same, level)) for level in levels]
    got = sphere._tpr_at(roc_curve(scores, same), levels)
    np.testing.assert_allclose(got, expected, atol=1e-12)


@pytest.fixture(scope="module")
def quick():
    return sphere.run(quick=True, seed=0)


def test_quick_study_closed_form_and_constraint(quick):
    data = quick.data
    checks = data["checks"]
    assert checks["closed_form_equals_pga"]
    assert checks["constraint_holds_on_training_pairs"]
    assert checks["lambda_decreases_in_alpha"]
    assert checks["fpr_target_beats_cosine"]
    floor, ceiling = data["mean_risk_feasible_range"]
    rows = data["mean_risk_solutions"]
    assert len(rows) == 3 and all(floor < r["alpha"] < ceiling for r in rows)
    for row in rows:
        assert row["train_negative_risk"] <= row["alpha"] + 1e-12
        assert row["train_negative_risk"] == pytest.approx(row["alpha"], abs=1e-9)  # λ > 0: tight
        assert 0.5 < row["auc"] <= 1
    assert data["n_test_pairs"] == 600 * 599 // 2


def test_quick_study_fpr_targets(quick):
    rows = quick.data["fpr_target_solutions"]
    assert [r["alpha"] for r in rows] == [0.02, 0.05, 0.1]
    for row in rows:
        # the training FPR of the learned threshold meets the target; on test pairs it is close
        assert row["train_fpr"] <= row["alpha"] + 1e-9
        assert abs(row["test_fpr_at_threshold"] - row["alpha"]) < 0.05
        assert row["tpr_at_alpha"] > row["cosine_tpr_at_alpha"]
    assert quick.verdict.startswith("pointwise-roc-sphere: closed form = PGA")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"alphas": "0.3,1.5"}, "`alphas` must be"),
        ({"alphas": (0.01,)}, "outside the feasible range"),
        ({"fpr_targets": "0"}, "`fpr_targets` must be"),
        ({"n_train": 5}, "`n_train`"),
        ({"n_alphas": 1}, "`n_alphas`"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        sphere.run(quick=True, **options)
