"""`fast-rates`: the construction of Vogel et al. Sec. 5.2 checked by numerical integration and
brute force, and the quick study."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from rankwise.experiments import fast_rates as fr


@pytest.mark.parametrize("a", [0.1, 0.5, 0.9])
def test_construction_is_a_density_with_q_star_one_half(a):
    problem = fr.NoiseProblem(a).check()
    x = (np.arange(200_000) + 0.5) / 200_000
    mu1 = problem.mu1(x)
    assert 0 <= mu1.min() and mu1.max() <= 2
    assert mu1.mean() == pytest.approx(1.0, abs=1e-9)  # ∫μ₁ = 1 for every C (point symmetry)
    tpr, fpr = problem.rates(np.array([0.5]))
    assert fpr[0] == pytest.approx(0.26, abs=1e-12)  # Q*_α = 1/2 at α = 0.26
    assert tpr[0] == pytest.approx(0.74, abs=1e-12) and problem.roc_star == pytest.approx(0.74)


@pytest.mark.parametrize("a", [0.1, 0.5, 0.9])
def test_analytic_rates_match_numerical_integration(a):
    problem = fr.NoiseProblem(a)
    grid = (np.arange(1500) + 0.5) / 1500
    e = problem.e(grid)
    eta = 0.5 + 2 * e[:, None] * e[None, :]  # pairwise posterior η(x, x')
    level = np.minimum(np.maximum.outer(grid, grid), np.maximum.outer(1 - grid, 1 - grid))
    for t in (0.2, 0.45, 0.5, 0.55, 0.8):
        inside = level < t
        tpr = (eta * inside).mean() / eta.mean()
        fpr = ((1 - eta) * inside).mean() / (1 - eta).mean()
        exact_tpr, exact_fpr = problem.rates(np.array([t]))
        assert exact_tpr[0] == pytest.approx(tpr, abs=2e-3), t
        assert exact_fpr[0] == pytest.approx(fpr, abs=2e-3), t
    # the integral E(t) against a Riemann sum of e
    t = 0.42
    assert problem.integral(np.array([t]))[0] == pytest.approx(
        problem.e((np.arange(100_000) + 0.5) / 100_000 * t).mean() * t, abs=1e-6
    )


def _brute_threshold(x, y, alpha):
    levels = sorted(
        min(max(x[i], x[j]), max(1 - x[i], 1 - x[j]))
        for i, j in itertools.combinations(range(len(x)), 2)
        if y[i] != y[j]
    )
    allowed = math.floor(alpha * len(levels) + 1e-9)
    return levels[allowed] if allowed < len(levels) else 1.0


@pytest.mark.parametrize("seed", range(6))
def test_empirical_threshold_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    problem = fr.NoiseProblem([0.1, 0.5, 0.9][seed % 3])
    x, y = fr.sample(problem, 70, rng)
    assert fr.empirical_threshold(x, y, 0.26) == _brute_threshold(x, y, 0.26)
    # the solution is feasible and the largest feasible one
    t = fr.empirical_threshold(x, y, 0.26)
    level = np.minimum(np.maximum.outer(x, x), np.maximum.outer(1 - x, 1 - x))
    negative = np.triu(y[:, None] != y[None, :], 1)
    assert (negative & (level < t)).sum() <= 0.26 * negative.sum() < (negative & (level <= t)).sum()


def test_quick_study():
    result = fr.run(quick=True, seed=3, repeats=60, bootstrap=50)
    studies = result.data["studies"]
    assert [s["a"] for s in studies] == [0.1, 0.5, 0.9]
    for study in studies:
        assert [r["n"] for r in study["rows"]] == list(fr.QUICK_SIZES)
        assert -0.8 < study["speed"] < -0.3  # about n^(-1/2): the constraint slack dominates
        low, high = study["speed_interval"]
        assert low < high
        assert study["theory_speed"] == pytest.approx(-(2 + study["a"]) / 4)
        assert all(0.3 < r["constraint_violated_fraction"] < 0.7 for r in study["rows"])
    assert isinstance(result.data["trend"]["downward"], bool)
    assert result.verdict.startswith("fast-rates: fitted speed C_a")


def test_full_means_the_papers_repetitions():
    # full=True is 1,000 repetitions; checked on the smallest problem to stay fast
    result = fr.run(full=True, a_values=(0.5,), sizes=(20, 40), bootstrap=10)
    assert result.data["settings"]["repeats"] == 1000 and result.data["settings"]["full"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"a_values": (0.5, 1.0)}, "`a` must be a finite number in (0, 1)"),
        ({"alpha": 0.6}, "`alpha` must be a finite number in (0, 0.5)"),
        ({"m": 0.1}, "no C in (0, 1/2) gives Q*_α = 1/2"),
        ({"sizes": (100,)}, "at least two sample sizes"),
        ({"quantile": 1.0}, "`quantile` must be a finite number in (0, 1)"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError) as info:
        fr.run(quick=True, **options)
    assert message in str(info.value)
