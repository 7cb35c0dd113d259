"""Incomplete U-statistics of the negative risk (Vogel et al., ICML 2018, Sec. 4 and Prop. 1):
samplers against exact enumeration, unbiasedness over many draws, the conditional variances σ²/B,
Prop. 1's asymptotic variances on synthetic data and a case where tuple-based sampling wins."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch

from rankwise.sampling import (
    complete_negative_risk,
    incomplete_variances,
    negative_pairs,
    pair_based_negative_risk,
    sample_class_tuples,
    sample_negative_pairs,
    tuple_based_negative_risk,
)

LABELS = np.array([3, 3, 3, 3, 7, 7, 7, 1, 1, 1, 1, 1, 9, 9])


def brute_negative_pairs(labels):
    n = len(labels)
    return [(i, j) for i in range(n) for j in range(i + 1, n) if labels[i] != labels[j]]


def random_similarity(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    return X @ X.T


# -- samplers ---------------------------------------------------------------------------------------
def test_negative_pairs_lists_every_negative_pair_once():
    first, second = negative_pairs(LABELS)
    assert sorted(zip(first.tolist(), second.tolist(), strict=True)) == brute_negative_pairs(LABELS)


def test_sampled_pairs_are_negative_ordered_and_uniform():
    sample = sample_negative_pairs(LABELS, 140_000, np.random.default_rng(0))
    assert sample.n_pairs == 140_000
    assert np.all(LABELS[sample.first] != LABELS[sample.second])
    assert np.all(sample.first < sample.second)
    counts = Counter(zip(sample.first.tolist(), sample.second.tolist(), strict=True))
    pairs = brute_negative_pairs(LABELS)
    assert sample.n_negative_pairs == len(pairs) and set(counts) == set(pairs)
    observed = np.array([counts[p] for p in pairs])
    expected = 140_000 / len(pairs)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    # chi-square with len(pairs) - 1 = 70 degrees of freedom: mean 70, sd ~12
    assert chi2 < 70 + 6 * 12


def test_tuples_hold_one_sample_per_class_uniformly_and_the_paper_weights():
    sample = sample_class_tuples(LABELS, 20_000, 1)
    assert sample.indices.shape == (20_000, 4)
    assert np.array_equal(sample.classes, [1, 3, 7, 9])
    for k, label in enumerate(sample.classes):
        column = sample.indices[:, k]
        assert np.all(LABELS[column] == label)
        counts = np.bincount(column, minlength=LABELS.size)[LABELS == label]
        assert counts.min() > 0.8 * 20_000 / counts.size  # every member drawn about equally
    sizes = np.array([5, 4, 3, 2])
    n_minus = len(brute_negative_pairs(LABELS))
    for k, l in itertools.combinations(range(4), 2):
        assert sample.pair_weights[k, l] == pytest.approx(sizes[k] * sizes[l] / n_minus)
    assert sample.pair_weights.sum() == pytest.approx(1.0)
    assert np.all(np.tril(sample.pair_weights) == 0)
    first, second, weights = sample.pairs()
    assert first.shape == (20_000 * 6,) and weights.sum() == pytest.approx(1.0)
    assert sample.n_pairs == 120_000


def test_samplers_are_reproducible_and_accept_a_seed_or_generator():
    a = sample_class_tuples(LABELS, 50, 5)
    b = sample_class_tuples(LABELS, 50, np.random.default_rng(5))
    assert np.array_equal(a.indices, b.indices)
    c = sample_negative_pairs(LABELS, 50, 5)
    d = sample_negative_pairs(LABELS, 50, 5)
    assert np.array_equal(c.first, d.first) and np.array_equal(c.second, d.second)


@pytest.mark.parametrize("sampler", [sample_negative_pairs, sample_class_tuples])
def test_bad_input_gives_clear_errors(sampler):
    with pytest.raises(ValueError, match="single class"):
        sampler(np.zeros(5, int), 3)
    with pytest.raises(ValueError, match=r"`B` must be an integer >= 1"):
        sampler(LABELS, 0)
    with pytest.raises(ValueError, match=r"`B` must be an integer"):
        sampler(LABELS, 2.0)
    with pytest.raises(ValueError, match=r"`B` must be an integer"):
        sampler(LABELS, True)
    with pytest.raises(ValueError, match="1-D"):
        sampler(LABELS.reshape(2, -1), 3)
    with pytest.raises(ValueError, match="integer class ids"):
        sampler(LABELS + 0.5, 3)
    with pytest.raises(ValueError, match="`rng`"):
        sampler(LABELS, 3, rng="seed")


def test_complete_statistic_refuses_too_many_pairs():
    with pytest.raises(ValueError, match="max_pairs"):
        negative_pairs(LABELS, max_pairs=10)


# -- estimators -------------------------------------------------------------------------------------
def test_complete_risk_from_a_matrix_a_tensor_or_a_callable_matches_brute_force():
    S = random_similarity(LABELS.size)
    brute = np.mean([S[i, j] for i, j in brute_negative_pairs(LABELS)])
    assert complete_negative_risk(S, LABELS) == pytest.approx(brute, rel=1e-12)
    assert complete_negative_risk(torch.from_numpy(S), LABELS) == pytest.approx(brute, rel=1e-12)
    assert complete_negative_risk(lambda a, b: S[a, b], LABELS) == pytest.approx(brute, rel=1e-12)
    with pytest.raises(ValueError, match="shape"):
        complete_negative_risk(S[:5, :5], LABELS)
    S[0, 5] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        complete_negative_risk(S, LABELS)


@pytest.mark.parametrize(
    "estimator, sampler",
    [
        (pair_based_negative_risk, sample_negative_pairs),
        (tuple_based_negative_risk, sample_class_tuples),
    ],
)
@pytest.mark.parametrize("to_tensor", [False, True])
def test_a_similarity_matrix_of_the_wrong_size_is_refused_by_name(estimator, sampler, to_tensor):
    """Issue 19: a matrix smaller than the labels ended in a bare IndexError (a larger one was
    silently read in its top-left corner)."""
    sample = sampler(LABELS, 40, rng=0)
    S = random_similarity(LABELS.size)
    convert = torch.from_numpy if to_tensor else np.asarray
    expected = r"`similarity` has shape \(5, 5\) but the sample is of 14 labelled samples"
    with pytest.raises(ValueError, match=expected):
        estimator(convert(S[:5, :5]), sample)
    with pytest.raises(ValueError, match=r"shape \(15, 15\) but the sample is of 14"):
        estimator(convert(random_similarity(15)), sample)
    assert estimator(convert(S), sample) == pytest.approx(estimator(lambda a, b: S[a, b], sample))


@pytest.mark.parametrize("scheme", ["pairs", "tuples"])
def test_incomplete_estimators_are_unbiased(scheme):
    """The mean of 4000 independent estimates lies within 4 standard errors of R̂⁻."""
    S = random_similarity(LABELS.size, seed=3)
    exact = complete_negative_risk(S, LABELS)
    rng = np.random.default_rng(11)
    if scheme == "pairs":
        draws = [
            pair_based_negative_risk(S, sample_negative_pairs(LABELS, 7, rng)) for _ in range(4000)
        ]
    else:
        draws = [
            tuple_based_negative_risk(S, sample_class_tuples(LABELS, 2, rng)) for _ in range(4000)
        ]
    draws = np.array(draws)
    standard_error = draws.std(ddof=1) / np.sqrt(draws.size)
    assert abs(draws.mean() - exact) < 4 * standard_error


def test_variances_match_enumeration_of_pairs_and_tuples():
    S = random_similarity(LABELS.size, seed=4)
    result = incomplete_variances(S, LABELS)
    values = np.array([S[i, j] for i, j in brute_negative_pairs(LABELS)])
    assert result.negative_risk == pytest.approx(values.mean(), rel=1e-12)
    assert result.pair_variance == pytest.approx(values.var(), rel=1e-10)
    members = [np.flatnonzero(LABELS == c) for c in np.unique(LABELS)]
    sizes = np.array([m.size for m in members])
    h = []
    for tup in itertools.product(*members):
        h.append(
            sum(
                sizes[k] * sizes[l] / values.size * S[tup[k], tup[l]]
                for k, l in itertools.combinations(range(len(members)), 2)
            )
        )
    assert result.tuple_variance == pytest.approx(np.var(h), rel=1e-10)
    assert result.n_classes == 4


@pytest.mark.parametrize("scheme", ["pairs", "tuples"])
def test_conditional_variance_of_the_estimators_is_sigma_squared_over_B(scheme):
    S = random_similarity(LABELS.size, seed=5)
    result = incomplete_variances(S, LABELS)
    rng = np.random.default_rng(2)
    B = 5
    if scheme == "pairs":
        draws = [
            pair_based_negative_risk(S, sample_negative_pairs(LABELS, B, rng)) for _ in range(6000)
        ]
        expected = result.pair_variance / B
    else:
        draws = [
            tuple_based_negative_risk(S, sample_class_tuples(LABELS, B, rng)) for _ in range(6000)
        ]
        expected = result.tuple_variance / B
    # the sample variance of 6000 draws has a relative standard error of about 2 %
    assert np.var(draws, ddof=1) == pytest.approx(expected, rel=0.1)


# -- Prop. 1 on synthetic data ------------------------------------------------------------------
CENTROIDS = np.array(
    [[np.cos(np.pi / 3), np.sin(np.pi / 3), 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
)


def sphere_caps(n, rng):
    """The data of Fig. 1: K = 3 uniform caps of angle π/4; classes 1 and 2 are 30° apart."""
    labels = rng.integers(0, 3, n)
    z = rng.uniform(np.cos(np.pi / 4), 1.0, n)
    phi = rng.uniform(0, 2 * np.pi, n)
    r = np.sqrt(1 - z**2)
    local = np.stack([r * np.cos(phi), r * np.sin(phi), z], 1)
    points = np.empty_like(local)
    for k, c in enumerate(CENTROIDS):
        # an orthonormal basis whose third vector is the centroid
        helper = np.array([1.0, 0, 0]) if abs(c[0]) < 0.9 else np.array([0, 1.0, 0])
        u = np.cross(c, helper)
        u /= np.linalg.norm(u)
        v = np.cross(c, u)
        rows = labels == k
        points[rows] = local[rows] @ np.stack([u, v, c])
    return points, labels


def close_pair_clusters(n, rng, k=5, noise=0.05):
    """K tight clusters on the unit sphere of R^K at the basis vectors, except that class 1 sits
    20° from class 0: the class pair (0, 1) is consistently much more similar than the others."""
    centers = np.eye(k)
    centers[1] = np.cos(np.radians(20)) * centers[0] + np.sin(np.radians(20)) * centers[1]
    labels = rng.integers(0, k, n)
    points = centers[labels] + noise * rng.normal(size=(n, k))
    return points / np.linalg.norm(points, axis=1, keepdims=True), labels


def prop1_check(generator, budget, repeats, rng):
    """Population Prop. 1 terms (from a large sample) and the empirical Var(estimate − R̂⁻)."""
    big, big_labels = generator(3000, rng)
    population = incomplete_variances(0.5 * (1 + big @ big.T), big_labels)
    pair_term, tuple_term = population.for_pair_budget(budget)
    per_tuple = population.n_classes * (population.n_classes - 1) // 2
    errors_pairs, errors_tuples = [], []
    for _ in range(repeats):
        X, y = generator(200, rng)
        S = 0.5 * (1 + X @ X.T)
        exact = complete_negative_risk(S, y)
        errors_pairs.append(
            pair_based_negative_risk(S, sample_negative_pairs(y, budget, rng)) - exact
        )
        errors_tuples.append(
            tuple_based_negative_risk(S, sample_class_tuples(y, budget // per_tuple, rng)) - exact
        )
    return pair_term, tuple_term, np.var(errors_pairs), np.var(errors_tuples)


@pytest.mark.parametrize("case", ["sphere", "close_pair"])
def test_prop1_asymptotic_variances(case):
    """Var(estimate − R̂⁻) over datasets and draws = E[Var(estimate | data)] ≈ the Prop. 1 terms
    for a budget of B₀ pairs (300 repeats: a variance has a relative standard error of ~8 %)."""
    generator = sphere_caps if case == "sphere" else close_pair_clusters
    pair_term, tuple_term, var_pairs, var_tuples = prop1_check(
        generator, 150, 300, np.random.default_rng(0)
    )
    assert var_pairs == pytest.approx(pair_term, rel=0.3)
    assert var_tuples == pytest.approx(tuple_term, rel=0.3)


def test_tuple_sampling_wins_when_one_class_pair_is_much_more_similar():
    """Prop. 1's example: the negative pairs of classes (0, 1) score consistently higher than the
    rest, so S over negative pairs is spread out while h_S, which holds every class pair once, is
    nearly constant."""
    pair_term, tuple_term, var_pairs, var_tuples = prop1_check(
        close_pair_clusters, 150, 100, np.random.default_rng(1)
    )
    assert tuple_term < 0.2 * pair_term
    assert var_tuples < 0.3 * var_pairs
