"""Tie-aware AP and NDCG (He et al. CVPR 2018, Prop. 1 / App. A) against brute force over every
ordering of the tied items, explicit tie-breaking orders and scikit-learn."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import average_precision_score

from rankwise.metrics import average_precision, batched_average_precision, batched_ndcg, ndcg
from rankwise.metrics.ranking import harmonic_difference


def orderings_consistent_with(scores):
    """Every ranking (list of item indices) that sorts the scores in non-increasing order."""
    values = sorted(set(scores), reverse=True)
    groups = [[i for i, s in enumerate(scores) if s == v] for v in values]
    for parts in itertools.product(*(itertools.permutations(g) for g in groups)):
        yield [i for part in parts for i in part]


def ap_of_ordering(order, relevance):
    hits, total = 0, 0.0
    for t, i in enumerate(order, start=1):
        if relevance[i]:
            hits += 1
            total += hits / t
    return total / hits


def dcg_of_ordering(order, gains, k):
    return sum(
        (2.0 ** gains[i] - 1) / math.log2(t + 1) for t, i in enumerate(order, start=1) if t <= k
    )


def explicit_tie_break(scores, secondary, descending_secondary):
    sign = -1 if descending_secondary else 1
    return sorted(range(len(scores)), key=lambda i: (-scores[i], sign * secondary[i]))


tied_lists = (
    st.integers(1, 7)
    .flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 2), min_size=n, max_size=n),
            st.lists(st.booleans(), min_size=n, max_size=n),
        )
    )
    .filter(lambda t: any(t[1]))
)


@settings(max_examples=60, deadline=None)
@given(tied_lists)
def test_expected_ap_equals_mean_over_all_tie_orderings(data):
    scores, relevance = data
    brute = [ap_of_ordering(o, relevance) for o in orderings_consistent_with(scores)]
    got = average_precision(np.array(scores, dtype=float), np.array(relevance))
    assert got == pytest.approx(sum(brute) / len(brute), abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(tied_lists)
def test_optimistic_and_pessimistic_ap_match_explicit_orders(data):
    scores, relevance = data
    s = torch.tensor(scores, dtype=torch.float64)
    best = ap_of_ordering(explicit_tie_break(scores, relevance, True), relevance)
    worst = ap_of_ordering(explicit_tie_break(scores, relevance, False), relevance)
    assert average_precision(s, relevance, ties="optimistic") == pytest.approx(best, abs=1e-12)
    assert average_precision(s, relevance, ties="pessimistic") == pytest.approx(worst, abs=1e-12)


graded_lists = (
    st.integers(1, 7)
    .flatmap(
        lambda n: st.tuples(
            st.lists(st.integers(0, 2), min_size=n, max_size=n),
            st.lists(st.integers(0, 3), min_size=n, max_size=n),
            st.one_of(st.none(), st.integers(1, 8)),
        )
    )
    .filter(lambda t: any(t[1]))
)


@settings(max_examples=60, deadline=None)
@given(graded_lists)
def test_expected_ndcg_equals_mean_over_all_tie_orderings(data):
    scores, gains, k = data
    cut = len(scores) if k is None else k
    ideal = dcg_of_ordering(sorted(range(len(gains)), key=lambda i: -gains[i]), gains, cut)
    brute = [dcg_of_ordering(o, gains, cut) for o in orderings_consistent_with(scores)]
    got = ndcg(np.array(scores, dtype=float), np.array(gains), k=k)
    assert got == pytest.approx(sum(brute) / len(brute) / ideal, abs=1e-12)
    best = dcg_of_ordering(explicit_tie_break(scores, gains, True), gains, cut) / ideal
    worst = dcg_of_ordering(explicit_tie_break(scores, gains, False), gains, cut) / ideal
    assert ndcg(scores, gains, k=k, ties="optimistic") == pytest.approx(best, abs=1e-12)
    assert ndcg(scores, gains, k=k, ties="pessimistic") == pytest.approx(worst, abs=1e-12)


def test_ap_matches_sklearn_without_ties_and_all_tie_modes_agree():
    rng = np.random.default_rng(0)
    for n in (1, 2, 10, 300):
        scores = rng.normal(size=n)
        relevance = rng.random(n) < 0.3
        relevance[rng.integers(n)] = True
        want = average_precision_score(relevance, scores)
        for ties in ("expected", "optimistic", "pessimistic"):
            assert average_precision(scores, relevance, ties) == pytest.approx(want, abs=1e-12)


def test_ap_on_a_hand_computed_tie():
    # relevant a tied with b at the top, relevant c tied with d below:
    # E[AP] = (E[1 or 1/2] + E[2/3 or 2/4]) / 2 = (3/4 + 7/12) / 2 = 2/3
    assert average_precision([1, 1, 0, 0], [1, 0, 1, 0]) == pytest.approx(2 / 3, abs=1e-15)


def test_harmonic_difference_long_spans_match_exact_sums():
    lo = np.array([0, 5, 1000, 59_000, 3])
    hi = np.array([40, 500, 1017, 60_000, 3])
    for a, b, got in zip(lo, hi, harmonic_difference(lo, hi), strict=True):
        exact = float(sum(Fraction(1, t) for t in range(a + 1, b + 1)))
        assert got == pytest.approx(exact, rel=1e-11, abs=1e-300)


def test_batched_equals_single_and_nan_for_rows_without_relevant(device):
    rng = np.random.default_rng(1)
    scores = torch.tensor(rng.integers(0, 4, size=(6, 30)), dtype=torch.float32, device=device)
    relevance = torch.tensor(rng.random((6, 30)) < 0.2, device=device)
    relevance[3] = False
    gains = torch.tensor(rng.integers(0, 3, size=(6, 30)), device=device)
    gains[4] = 0
    for ties in ("expected", "optimistic", "pessimistic"):
        ap = batched_average_precision(scores, relevance, ties)
        nd = batched_ndcg(scores, gains, k=5, ties=ties)
        assert ap.shape == (6,) and ap.device.type == device.type
        assert torch.isnan(ap[3]) and torch.isnan(nd[4])
        for q in (0, 1, 2, 4, 5):
            assert float(ap[q]) == pytest.approx(
                average_precision(scores[q].cpu(), relevance[q].cpu(), ties), abs=1e-12
            )
        for q in (0, 1, 2, 3, 5):
            assert float(nd[q]) == pytest.approx(
                ndcg(scores[q].cpu(), gains[q].cpu(), k=5, ties=ties), abs=1e-12
            )


def test_ndcg_without_ties_matches_sklearn():
    from sklearn.metrics import ndcg_score

    rng = np.random.default_rng(2)
    scores = rng.normal(size=40)
    gains = rng.integers(0, 4, size=40)
    # sklearn uses linear gains: pass 2^a - 1 as its relevance to get the exponential gain
    for k in (None, 1, 7, 40, 100):
        want = ndcg_score([2.0**gains - 1], [scores], k=k)
        assert ndcg(scores, gains, k=k) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: average_precision([0.1, 0.2], [0, 0]), "relevance"),
        (lambda: average_precision([0.1, 0.2], [1, 0, 1]), "relevance"),
        (lambda: average_precision([0.1, 0.2], [1, 2]), "relevance"),
        (lambda: average_precision([0.1, float("nan")], [1, 0]), "scores"),
        (lambda: average_precision([[0.1, 0.2]], [[1, 0]]), "scores"),
        (lambda: average_precision([0.1, 0.2], [1, 0], ties="random"), "ties"),
        (lambda: ndcg([0.1, 0.2], [0, 0]), "gains"),
        (lambda: ndcg([0.1, 0.2], [1, -1]), "gains"),
        (lambda: ndcg([0.1, 0.2], [1, 0], k=0), "k"),
        (lambda: batched_ndcg([[0.1, 0.2]], [[1, 0, 0]]), "gains"),
        (lambda: batched_average_precision([0.1, 0.2], [1, 0]), "scores"),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
