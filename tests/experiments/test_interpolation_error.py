"""`interpolation-error`: Prop. 3's bound, the exact expectation of φ, the score models' p''."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from rankwise.experiments import interpolation_error as ie
from rankwise.experiments._scores import DISTRIBUTIONS, score_model
from rankwise.losses.soprc import score_interpolation


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
def test_quantile_second_derivative_matches_finite_differences(name):
    model = score_model(name)
    u = np.linspace(0.05, 0.95, 19)
    h = 1e-4
    numeric = (
        model.positive_quantile(u + h)
        - 2 * model.positive_quantile(u)
        + model.positive_quantile(u - h)
    ) / h**2
    np.testing.assert_allclose(model.positive_quantile_d2(u), numeric, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", list(DISTRIBUTIONS))
@pytest.mark.parametrize("n", [2, 3, 8, 50, 300])
def test_prop3_bound_holds(name, n):
    model = score_model(name)
    paper, local = ie.interpolation_bound(model, n)
    error = ie.prop3_error(model, n)
    assert error <= local + 1e-12 and local <= paper + 1e-12
    assert (
        ie.prop3_error(model, n, ie.CENTRAL)
        <= ie.interpolation_bound(model, n, ie.CENTRAL)[0] + 1e-12
    )


def test_prop3_error_decays_as_n_squared_on_the_central_quantiles():
    model = score_model("binormal")
    errors = [ie.prop3_error(model, n, ie.CENTRAL) for n in (32, 64, 128, 256)]
    slope = np.polyfit(np.log([32, 64, 128, 256]), np.log(errors), 1)[0]
    assert slope == pytest.approx(-2.0, abs=0.1)
    assert ie.prop3_error(score_model("offset-uniform"), 64) < 1e-12  # p is linear


def test_expected_order_statistics_enumerate_all_subsets():
    population = np.sort(np.random.default_rng(0).normal(size=9))
    subsets = np.array([np.sort(population[list(c)]) for c in itertools.combinations(range(9), 4)])
    np.testing.assert_allclose(
        ie.expected_order_statistics(population, 4), subsets.mean(0), rtol=1e-12
    )


@pytest.mark.parametrize("score_range", [None, (-5.0, 5.0)])
def test_expected_phi_interior_is_the_mean_of_the_library_phi(score_range):
    population = np.sort(np.random.default_rng(1).normal(size=10))
    n, k = 4, 23
    phis = [
        score_interpolation(torch.from_numpy(population[list(c)]), k, score_range).numpy()
        for c in itertools.combinations(range(10), n)
    ]
    index, exact = ie.expected_phi_interior(population, n, k)
    positions = (index + 1) / (k + 1)
    assert positions.min() >= 1 / (n + 1) and positions.max() <= n / (n + 1)
    np.testing.assert_allclose(exact, np.mean(phis, axis=0)[index], rtol=1e-12)


def test_quick_run_verdict_and_schema():
    result = ie.run(quick=True, seed=4, distributions=("binormal", "offset-uniform"), repeats=20)
    assert result.consistent, result.verdict
    assert "Prop. 3 bound ‖p″‖∞/(8n⁺²) holds" in result.verdict
    studies = result.data["distributions"]
    assert [s["distribution"] for s in studies] == ["binormal", "offset-uniform"]
    rows = studies[0]["rows"]
    assert [r["batch_positives"] for r in rows] == list(ie.QUICK_SIZES)
    assert all(r["bound_holds"] for s in studies for r in s["rows"])
    # one batch errs like sampling noise, n^(-1/2); E[φ] errs less and less
    assert studies[0]["slopes"]["batch_rms_error"] == pytest.approx(-0.5, abs=0.1)
    assert (
        rows[-1]["bias_rms_central_exact"]
        < rows[3]["bias_rms_central_exact"]
        < rows[3]["batch_rms_error"]
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"distributions": ("binormal", "cauchy")}, "`distribution` must be one of"),
        ({"sizes": (1, 4)}, "`sizes` must be an integer >= 2"),
        ({"sizes": (4, 8), "figure_size": 16}, "`figure_size` 16 must be one of `sizes`"),
        ({"sizes": (4, 5000)}, "has only 2000 positives"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError) as info:
        ie.run(quick=True, **options)
    assert message in str(info.value)
