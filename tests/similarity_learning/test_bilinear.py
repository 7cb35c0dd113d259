"""BilinearSimilarity (Vogel et al., ICML 2018, problem (6) and Sec. 5.1): the closed form against
projected gradient ascent and scipy's SLSQP on the same problem, the constraint at the returned λ,
the minimality of λ, the moment matrices against brute force, the indicator risk, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.metrics import roc_curve

from rankwise.metrics import tpr_at_fpr
from rankwise.sampling import incomplete_variances
from rankwise.similarity_learning import MMC, BilinearSimilarity
from rankwise.similarity_learning.bilinear import (
    pair_moment_matrices,
    projected_gradient_bilinear,
    solve_lambda,
)


def sphere_data(n, seed=0):
    """Fig. 1 of the paper: 3 classes on the unit sphere of R³ (caps of angle π/4)."""
    rng = np.random.default_rng(seed)
    centroids = np.array(
        [[np.cos(np.pi / 3), np.sin(np.pi / 3), 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    )
    labels = rng.integers(0, 3, n)
    points = centroids[labels] + 0.35 * rng.normal(size=(n, 3))
    return points / np.linalg.norm(points, axis=1, keepdims=True), labels


def brute_moments(X, y):
    d = X.shape[1]
    P, N = np.zeros((d, d)), np.zeros((d, d))
    n_pos = n_neg = 0
    for i in range(len(y)):
        for j in range(i + 1, len(y)):
            outer = np.outer(X[i], X[j]) + np.outer(X[j], X[i])
            if y[i] == y[j]:
                P += outer
                n_pos += 1
            else:
                N += outer
                n_neg += 1
    return P / (2 * n_pos), N / (2 * n_neg)


def brute_mean_risks(A, X, y):
    pos, neg = [], []
    for i in range(len(y)):
        for j in range(i + 1, len(y)):
            (pos if y[i] == y[j] else neg).append(0.5 * (1 + X[i] @ A @ X[j]))
    return np.mean(pos), np.mean(neg)


def test_moment_matrices_match_the_pair_sums_of_sec_5_1():
    X, y = sphere_data(40)
    P, N = pair_moment_matrices(X, y)
    P_ref, N_ref = brute_moments(X, y)
    np.testing.assert_allclose(P, P_ref, atol=1e-13)
    np.testing.assert_allclose(N, N_ref, atol=1e-13)


@pytest.mark.parametrize("alpha", [0.33, 0.4, 0.5])
def test_closed_form_matches_projected_gradient_ascent_and_slsqp(alpha):
    X, y = sphere_data(300)
    model = BilinearSimilarity(alpha).fit(X, y)
    A_pga, _ = projected_gradient_bilinear(model.P_, model.N_, alpha)
    np.testing.assert_allclose(model.A_, A_pga, atol=1e-8)

    # an independent solver on the flattened problem
    P, N = model.P_.ravel(), model.N_.ravel()
    result = minimize(
        lambda a: -a @ P,
        -N / np.linalg.norm(N),  # the most feasible point: both constraints hold
        jac=lambda a: -P,
        method="SLSQP",
        constraints=[
            {"type": "ineq", "fun": lambda a: 1 - a @ a, "jac": lambda a: -2 * a},
            {"type": "ineq", "fun": lambda a: (2 * alpha - 1) - a @ N, "jac": lambda a: -N},
        ],
        options={"ftol": 1e-13, "maxiter": 500},
    )
    assert result.success
    assert model.positive_risk_ == pytest.approx(0.5 * (1 + result.x @ P), abs=1e-7)
    np.testing.assert_allclose(model.A_.ravel(), result.x, atol=1e-4)


def test_constraint_holds_at_lambda_and_lambda_is_the_smallest_such_value():
    X, y = sphere_data(300)
    alpha = 0.35
    model = BilinearSimilarity(alpha).fit(X, y)
    assert model.lambda_ > 0 and model.constraint_active_
    _, neg = brute_mean_risks(model.A_, X, y)
    assert neg == pytest.approx(model.negative_risk_, abs=1e-12)
    assert neg <= alpha + 1e-12
    assert neg == pytest.approx(alpha, abs=1e-9)  # active
    smaller = model.lambda_ * (1 - 1e-6)
    A = model.P_ - smaller * model.N_
    assert 0.5 * (1 + (A / np.linalg.norm(A) * model.N_).sum()) > alpha
    assert np.linalg.norm(model.A_) == pytest.approx(1.0)
    np.testing.assert_allclose(model.A_, model.A_.T)


def test_bisection_agrees_with_the_quadratic_for_lambda():
    """⟨P − λN, N⟩ = c‖P − λN‖ squared is a quadratic in λ: its feasible root is λ."""
    X, y = sphere_data(200, seed=3)
    P, N = pair_moment_matrices(X, y)
    bound = 0.4
    c = 2 * bound - 1
    pn, nn, pp = (P * N).sum(), (N * N).sum(), (P * P).sum()
    # (pn − λ nn)² = c² (pp − 2λ pn + λ² nn)
    roots = np.roots([nn * nn - c * c * nn, -2 * pn * nn + 2 * c * c * pn, pn * pn - c * c * pp])
    feasible = [
        r.real for r in roots if abs(r.imag) < 1e-12 and r.real >= 0 and pn - r.real * nn < 0
    ]
    assert solve_lambda(P, N, bound) == pytest.approx(min(feasible), rel=1e-9)


def test_slack_constraint_gives_lambda_zero():
    X, y = sphere_data(200)
    model = BilinearSimilarity(0.95).fit(X, y)
    assert model.lambda_ == 0.0 and not model.constraint_active_
    np.testing.assert_allclose(model.A_, model.P_ / np.linalg.norm(model.P_))


def test_tolerance_relaxes_the_constraint():
    X, y = sphere_data(200)
    tight = BilinearSimilarity(0.35).fit(X, y)
    loose = BilinearSimilarity(0.35, tolerance=0.05).fit(X, y)
    assert loose.negative_risk_ == pytest.approx(0.40, abs=1e-9)
    assert loose.lambda_ < tight.lambda_ and loose.positive_risk_ > tight.positive_risk_


def test_infeasible_alpha_names_the_feasible_range():
    X, y = sphere_data(200)
    with pytest.raises(ValueError, match=r"infeasible.*below 0\.\d+.*`risk`='indicator'"):
        BilinearSimilarity(0.05).fit(X, y)


def test_threshold_meets_alpha_on_training_pairs_and_scoring_is_consistent():
    X, y = sphere_data(200)
    model = BilinearSimilarity(0.4).fit(X, y)
    i, j = np.triu_indices(len(y), 1)
    scores = model.pair_score(X[i], X[j])
    negatives = y[i] != y[j]
    assert np.mean(scores[negatives] >= model.threshold_) <= 0.4
    np.testing.assert_allclose(model.score_pairs(np.stack([X[i], X[j]], 1)), scores)
    np.testing.assert_allclose(model.similarity_matrix(X)[i, j], scores)
    assert np.array_equal(model.predict_pairs(X[i], X[j]), scores >= model.threshold_)
    fpr, tpr, _ = roc_curve(~negatives, scores)
    assert model.score(X, y) == pytest.approx(tpr[fpr <= 0.4].max())
    assert np.all((scores >= 0) & (scores <= 1))


@pytest.mark.parametrize("negatives", ["pairs", "tuples"])
def test_incomplete_negatives_estimate_N_without_bias(negatives):
    X, y = sphere_data(120)
    _, N = pair_moment_matrices(X, y)
    estimates = [
        BilinearSimilarity(0.45, negatives=negatives, n_negative_samples=30, random_state=s)
        .fit(X, y)
        .N_
        for s in range(300)
    ]
    mean = np.mean(estimates, 0)
    standard_error = np.std(estimates, 0, ddof=1) / np.sqrt(len(estimates))
    assert np.all(np.abs(mean - N) < 4.5 * standard_error + 1e-12)


def test_indicator_risk_meets_alpha_on_training_pairs_and_beats_the_closed_form_at_alpha():
    X, y = sphere_data(300, seed=1)
    X_test, y_test = sphere_data(1000, seed=2)
    alpha = 0.05
    model = BilinearSimilarity(alpha, risk="indicator", max_iter=150, n_threads=1).fit(X, y)
    assert model.negative_risk_ <= alpha
    i, j = np.triu_indices(len(y), 1)
    train_scores = model.pair_score(X[i], X[j])
    assert np.mean(train_scores[y[i] != y[j]] >= model.threshold_) <= alpha
    # the closed form at the smallest feasible mean risk, the best of its family at low FPR
    closed = BilinearSimilarity(model.min_negative_risk_ + 0.01).fit(X, y)
    i, j = np.triu_indices(len(y_test), 1)
    same = y_test[i] == y_test[j]
    learned = tpr_at_fpr(model.pair_score(X_test[i], X_test[j]), same, alpha)
    assert learned > tpr_at_fpr(closed.pair_score(X_test[i], X_test[j]), same, alpha) + 0.02
    assert learned > tpr_at_fpr((X_test[i] * X_test[j]).sum(1), same, alpha) + 0.02  # cosine
    assert np.linalg.norm(model.A_) == pytest.approx(1.0)


def test_sklearn_conventions():
    X, y = sphere_data(100)
    model = BilinearSimilarity(0.4, tolerance=0.01)
    assert model.get_params()["alpha"] == 0.4
    model.set_params(alpha=0.45)
    copy = clone(model)
    assert copy.alpha == 0.45 and not hasattr(copy, "A_")
    with pytest.raises(NotFittedError):
        model.pair_score(X, X)
    assert model.fit(X, y) is model and model.n_features_in_ == 3
    with pytest.raises(ValueError, match="3"):
        model.pair_score(X[:, :2], X[:, :2])


@pytest.mark.parametrize("alpha", [0, 1, -0.1, 1.5, np.nan, True, "0.1", None])
def test_alpha_outside_the_open_unit_interval_is_refused(alpha):
    X, y = sphere_data(50)
    with pytest.raises(ValueError, match=r"`alpha` must be a finite number in \(0, 1\)"):
        BilinearSimilarity(alpha).fit(X, y)


def test_bad_input_gives_clear_errors():
    X, y = sphere_data(50)
    with pytest.raises(ValueError, match="single class"):
        BilinearSimilarity(0.4).fit(X, np.zeros(50, int))
    with pytest.raises(ValueError, match=r"L2-normalized rows.*normalize=True"):
        BilinearSimilarity(0.4).fit(3 * X, y)
    assert BilinearSimilarity(0.4, normalize=True).fit(3 * X, y).score(3 * X, y) > 0
    with pytest.raises(ValueError, match="all-zero"):
        BilinearSimilarity(0.4, normalize=True).fit(np.vstack([X[:-1], np.zeros(3)]), y)
    bad = X.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        BilinearSimilarity(0.4).fit(bad, y)
    with pytest.raises(ValueError, match="no class with two samples"):
        BilinearSimilarity(0.4).fit(X[:3], [0, 1, 2])
    with pytest.raises(ValueError, match="`risk` must be one of"):
        BilinearSimilarity(0.4, risk="auc").fit(X, y)
    with pytest.raises(ValueError, match="`negatives` must be one of"):
        BilinearSimilarity(0.4, negatives="some").fit(X, y)
    with pytest.raises(ValueError, match="`tolerance` must be"):
        BilinearSimilarity(0.4, tolerance=-1).fit(X, y)
    with pytest.raises(ValueError, match="inconsistent numbers of samples|`y`"):
        BilinearSimilarity(0.4).fit(X, y[:-1])


def imbalanced_sphere_data(sizes=(300, 30, 30), seed=0):
    """The sphere classes of :func:`sphere_data` with class sizes ``sizes`` (issue 19: 300/30/30)."""
    rng = np.random.default_rng(seed)
    centroids = np.array(
        [[np.cos(np.pi / 3), np.sin(np.pi / 3), 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    )
    labels = np.repeat(np.arange(3), sizes)
    points = centroids[labels] + 0.35 * rng.normal(size=(labels.size, 3))
    return points / np.linalg.norm(points, axis=1, keepdims=True), labels


@pytest.mark.parametrize("risk, alpha", [("indicator", 0.05), ("mean", 0.45)])
def test_tuple_negatives_keep_the_fpr_over_every_negative_pair_within_alpha(risk, alpha):
    """Tuples of 300/30/30 classes hold each class pair equally often, but the class pair (1, 2)
    is only 900 of the 18 900 negative pairs: unweighted, the threshold and the reported FPR
    describe the wrong mixture (true FPR 0.085 at α = 0.05, 0.529 at α = 0.45 before the fix).

    Tolerance: at a fixed threshold t the tuple estimate of the FPR is the mean of B i.i.d. terms
    h_t with variance σ²_T (exact, :func:`incomplete_variances` of the indicator 1{S ≥ t}), so
    its error is σ_T/√B; the threshold is chosen on the same sample, so allow 4 σ_T/√B.
    """
    X, y = imbalanced_sphere_data()
    B = 2000
    model = BilinearSimilarity(
        alpha, risk=risk, negatives="tuples", n_negative_samples=B, random_state=0, max_iter=150,
        n_threads=1,
    ).fit(X, y)  # fmt: skip
    S = model.similarity_matrix(X)
    i, j = np.triu_indices(len(y), 1)
    negative = y[i] != y[j]
    true_fpr = np.mean(S[i, j][negative] >= model.threshold_)
    sigma = np.sqrt(incomplete_variances((S >= model.threshold_) * 1.0, y).tuple_variance)
    tolerance = 4 * sigma / np.sqrt(B)
    assert tolerance < 0.02
    assert true_fpr <= alpha + tolerance
    assert model.threshold_fpr_ <= alpha  # the reported training FPR: the weighted estimate
    assert abs(model.threshold_fpr_ - true_fpr) <= tolerance
    true_tpr = np.mean(S[i, j][~negative] >= model.threshold_)
    assert model.threshold_tpr_ == pytest.approx(true_tpr)  # every positive pair is used
    if risk == "indicator":
        assert model.negative_risk_ == model.threshold_fpr_


def test_tuple_negatives_train_the_indicator_on_the_weighted_surrogate():
    """The smoothed FPR of the Lagrangian is a mean over the negative pairs too: the tuple sample
    must weight it n_k n_l / n⁻, or the (1, 2) class pair, 1/21 of the negative pairs, gets 1/3
    of the gradient. The multiplier λ that balances it then lands near the complete statistic's
    (measured: 2.82-2.90 against 2.45 over three seeds, 4.71-4.83 unweighted)."""
    X, y = imbalanced_sphere_data()
    options = dict(risk="indicator", max_iter=150, n_threads=1)
    complete = BilinearSimilarity(0.05, **options).fit(X, y)
    sampled = [
        BilinearSimilarity(
            0.05, negatives="tuples", n_negative_samples=2000, random_state=seed, **options
        )
        .fit(X, y)
        .lambda_
        for seed in range(3)
    ]
    assert np.mean(sampled) == pytest.approx(complete.lambda_, rel=0.35)


@pytest.mark.parametrize("estimator", [BilinearSimilarity(0.45), MMC()], ids=["bilinear", "mmc"])
def test_input_errors_name_y_and_refuse_strings_and_column_vectors(estimator):
    """Issue 19: label errors named `labels` (not the `y` of fit), numeric strings in X were
    converted silently, and y of shape (n, 1) passed with a DataConversionWarning."""
    X, y = sphere_data(60)
    with pytest.raises(ValueError, match=r"^`y` must hold integer class ids, got non-integer"):
        clone(estimator).fit(X, y + 0.5)
    with pytest.raises(ValueError, match=r"^`y` must hold integer class ids, got dtype <U"):
        clone(estimator).fit(X, np.array(["a", "b", "c"])[y])
    with pytest.raises(ValueError, match=r"^`y` must be 1-D .* shape \(60, 1\); pass y\.ravel\(\)"):
        clone(estimator).fit(X, y[:, None])
    for strings in (X.astype(str), X.astype(str).astype(object)):
        with pytest.raises(ValueError, match=r"^`X` holds strings; pass numbers"):
            clone(estimator).fit(strings, y)
    fitted = clone(estimator).fit(X, y)
    with pytest.raises(ValueError, match=r"^`X1` holds strings; pass numbers"):
        fitted.pair_score(X[:3].astype(str), X[:3])


def test_alpha_exactly_at_the_feasibility_floor_is_feasible():
    """½(1 − ‖N‖_F) is reached by A = −N/‖N‖_F (the only feasible point there); just below it
    nothing is feasible."""
    X, y = sphere_data(200)
    floor = BilinearSimilarity(0.45).fit(X, y).min_negative_risk_
    model = BilinearSimilarity(floor).fit(X, y)
    np.testing.assert_allclose(model.A_, -model.N_ / np.linalg.norm(model.N_), atol=1e-12)
    assert model.negative_risk_ == pytest.approx(floor, abs=1e-12)
    assert model.lambda_ == np.inf and model.constraint_active_
    _, brute_negative = brute_mean_risks(model.A_, X, y)
    assert brute_negative <= floor + 1e-12
    split = BilinearSimilarity(floor - 0.01, tolerance=0.01).fit(X, y)  # α + Φ at the floor
    np.testing.assert_allclose(split.A_, model.A_, atol=1e-12)
    with pytest.raises(ValueError, match="infeasible"):
        BilinearSimilarity(np.nextafter(floor, 0)).fit(X, y)


def test_callback_reports_every_primal_dual_iteration():
    X, y = sphere_data(60)
    calls = []
    model = BilinearSimilarity(
        0.1, risk="indicator", max_iter=7, callback=lambda *a: calls.append(a)
    )
    model.fit(X, y)
    assert calls == [(k, 7) for k in range(1, 8)]
    with pytest.raises(ValueError, match="`callback` must be callable"):
        BilinearSimilarity(0.1, callback="print").fit(X, y)


def test_the_old_module_paths_keep_working():
    from rankwise.models import bilinear as old_bilinear
    from rankwise.models import mmc as old_mmc
    from rankwise.similarity_learning import bilinear, mmc

    for old, new in ((old_bilinear, bilinear), (old_mmc, mmc)):
        assert old.__all__ == new.__all__
        assert all(getattr(old, name) is getattr(new, name) for name in new.__all__)
