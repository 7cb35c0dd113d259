"""Pair-view ROC metrics checked against scikit-learn and brute-force loops written here."""

from __future__ import annotations

import itertools
import math
import re
from fractions import Fraction

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from sklearn.metrics import roc_curve as sklearn_roc_curve

from rankwise.metrics.curves import (
    operating_point,
    pair_scores,
    roc_auc,
    roc_curve,
    roc_curve_from_embeddings,
    tpr_at_fpr,
)


def _scored(seed: int, n: int, tied: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.random(n) < 0.3
    y[0], y[1] = True, False
    if tied:  # few distinct values: most positive/negative pairs are tied
        s = rng.integers(0, 6, n).astype(np.float64) + 0.5 * y * rng.integers(0, 2, n)
    else:
        s = rng.normal(size=n) + y
    return s, y


# --------------------------------------------------------------------------------------------
# roc_auc / roc_curve against scikit-learn
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_roc_auc_matches_sklearn(seed, tied):
    s, y = _scored(seed, 300, tied)
    assert roc_auc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    # tensors (float32 scores, 0/1 int targets) give the same value
    assert roc_auc(torch.tensor(s, dtype=torch.float32), torch.tensor(y.astype(np.int64))) == (
        pytest.approx(roc_auc_score(y, s.astype(np.float32)), abs=1e-12)
    )


def test_roc_auc_counts_ties_half():
    # one positive and one negative with the same score: AUC is exactly 1/2
    assert roc_auc([0.3, 0.3], [True, False]) == 0.5
    # brute force Mann-Whitney over all (positive, negative) pairs
    s, y = _scored(7, 60, tied=True)
    pos, neg = s[y], s[~y]
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    assert roc_auc(s, y) == pytest.approx(wins / (len(pos) * len(neg)), abs=1e-12)


@pytest.mark.parametrize("tied", [False, True])
def test_roc_curve_matches_sklearn_without_dropping(tied, device):
    s, y = _scored(11, 250, tied)
    curve = roc_curve(torch.tensor(s, device=device), torch.tensor(y, device=device))
    fpr, tpr, thr = sklearn_roc_curve(y, s, drop_intermediate=False)
    np.testing.assert_allclose(curve.fpr, fpr)
    np.testing.assert_allclose(curve.tpr, tpr)
    np.testing.assert_allclose(curve.thresholds, thr)
    assert len(curve) == len(np.unique(s)) + 1  # one point per distinct score, plus (0, 0)
    assert curve.auc == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert curve.exact and curve.n_positive == int(y.sum()) and curve.n_negative == int((~y).sum())


def test_roc_curve_drop_intermediate_matches_sklearn():
    s, y = _scored(3, 400, tied=True)
    curve = roc_curve(s, y, drop_intermediate=True)
    fpr, tpr, thr = sklearn_roc_curve(y, s, drop_intermediate=True)
    np.testing.assert_allclose(curve.fpr, fpr)
    np.testing.assert_allclose(curve.tpr, tpr)
    np.testing.assert_allclose(curve.thresholds, thr)
    assert curve.auc == pytest.approx(roc_auc_score(y, s), abs=1e-12)


def test_roc_curve_drop_intermediate_uses_exact_counts_and_keeps_the_first_point():
    # 11 distinct scores, the single positive on top: scikit-learn keeps (0,0), (0,1), (1,1);
    # rates like 3/10 - 2/10 != 2/10 - 1/10 in floating point kept collinear points before
    s, y = np.arange(11)[::-1].astype(np.float64), np.array([1] + [0] * 10, dtype=bool)
    curve = roc_curve(s, y, drop_intermediate=True)
    fpr, tpr, thr = sklearn_roc_curve(y, s, drop_intermediate=True)
    assert len(curve) == len(fpr) == 3
    np.testing.assert_array_equal(curve.fpr, fpr)
    np.testing.assert_array_equal(curve.tpr, tpr)
    np.testing.assert_array_equal(curve.thresholds, thr)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [3, 40, 700])
def test_roc_curve_drop_intermediate_equals_sklearn_point_for_point(seed, n):
    rng = np.random.default_rng(seed)
    y = rng.random(n) < rng.uniform(0.05, 0.6)
    y[0], y[1] = True, False
    for s in (rng.integers(0, 7, n).astype(np.float32), rng.normal(size=n) + y):
        curve = roc_curve(s, y, drop_intermediate=True)
        fpr, tpr, thr = sklearn_roc_curve(y, s, drop_intermediate=True)
        np.testing.assert_array_equal(curve.fpr, fpr)
        np.testing.assert_array_equal(curve.tpr, tpr)
        np.testing.assert_array_equal(curve.thresholds, thr)


# --------------------------------------------------------------------------------------------
# TPR at FPR against a brute force over every threshold
# --------------------------------------------------------------------------------------------


def _brute_tpr_at_fpr(s: np.ndarray, y: np.ndarray, alpha: float) -> float:
    best = 0.0  # the threshold +inf (predict nothing) is always admissible
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    for t in np.unique(s):
        fp = sum(1 for v, p in zip(s, y, strict=True) if v >= t and not p)
        tp = sum(1 for v, p in zip(s, y, strict=True) if v >= t and p)
        if fp / n_neg <= alpha:
            best = max(best, tp / n_pos)
    return best


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("alpha", [0.001, 0.05, 0.1, 0.25, 0.5, 0.9])
def test_tpr_at_fpr_matches_brute_force(alpha, tied):
    s, y = _scored(5, 120, tied)
    expected = _brute_tpr_at_fpr(s, y, alpha)
    tpr, threshold = tpr_at_fpr(s, y, fpr=alpha, return_threshold=True)
    assert tpr == pytest.approx(expected, abs=1e-12)
    assert tpr_at_fpr(s, y, fpr=alpha) == tpr
    if math.isinf(threshold):
        assert tpr == 0.0
    else:  # the returned threshold realizes the TPR within the FPR budget
        predicted = s >= threshold
        assert predicted[~y].mean() <= alpha
        assert predicted[y].mean() == pytest.approx(tpr, abs=1e-12)
        assert threshold in set(s.tolist())


def test_tpr_at_fpr_moves_ties_together():
    # two negatives tied with the top positives: splitting the tie is not allowed, so at
    # alpha = 0.25 (1 of 4 negatives) the tied block (2 negatives) cannot be accepted
    s = [0.9, 0.9, 0.9, 0.9, 0.1, 0.1, 0.2]
    y = [True, True, False, False, False, False, True]
    point = operating_point(s, y, fpr=0.25)
    assert point == (0.0, 0.0, math.inf)
    point = operating_point(s, y, fpr=0.5)  # the tie at 0.9 fits, and so does the 0.2 positive
    assert point.tpr == 1.0 and point.fpr == 0.5 and point.threshold == 0.2
    point = operating_point(s, y, fpr=0.75)
    assert point.tpr == 1.0 and point.fpr == 0.5 and point.threshold == 0.2


def test_operating_point_never_returns_a_dominated_threshold():
    # threshold 2 reaches tpr 0.5 at fpr 0.5, but threshold 3 reaches the same tpr at fpr 0
    assert operating_point([3, 2, 1, 0], [1, 0, 0, 1], 0.5) == (0.5, 0.0, 3.0)
    assert tpr_at_fpr([3, 2, 1, 0], [1, 0, 0, 1], 0.5, return_threshold=True) == (0.5, 3.0)


def _brute_operating_point(s, y, alpha):
    """Among the thresholds (and +inf) with FPR <= alpha: max TPR, then min FPR (exact counts)."""
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    candidates = [(0, 0, math.inf)]
    for t in np.unique(s):
        tp, fp = int((s[y] >= t).sum()), int((s[~y] >= t).sum())
        if Fraction(fp, n_neg) <= Fraction(alpha):
            candidates.append((tp, fp, float(t)))
    tp, fp, t = max(candidates, key=lambda c: (c[0], -c[1]))
    return (tp / n_pos, fp / n_neg, t) if tp else (0.0, 0.0, math.inf)


@pytest.mark.parametrize("seed", range(12))
def test_operating_point_is_maximal_tpr_then_minimal_fpr(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 60))
    y = rng.random(n) < 0.4
    y[0], y[1] = True, False
    s = rng.integers(0, int(rng.integers(2, 8)), n).astype(np.float64)  # heavy ties
    for alpha in (0.05, 0.1, 1 / 3, 0.5, 0.7):
        assert tuple(operating_point(s, y, alpha)) == _brute_operating_point(s, y, alpha)
    # a budget hit exactly: 1 negative of 10 at alpha 0.1 is admissible (no rounding of 1/10)
    y10 = np.array([False] * 10 + [True])
    s10 = np.r_[np.arange(10.0), 20.0]
    s10[9] = 30.0  # the top score is a negative
    assert operating_point(s10, y10, 0.1) == (1.0, 0.1, 20.0)


@pytest.mark.parametrize("alpha", [0.0, 1.0, -0.1, 1.5, "x", float("nan")])
def test_tpr_at_fpr_rejects_alpha_outside_open_unit_interval(alpha):
    with pytest.raises(ValueError, match="`fpr`"):
        tpr_at_fpr([0.1, 0.2], [True, False], fpr=alpha)


# --------------------------------------------------------------------------------------------
# pair_scores
# --------------------------------------------------------------------------------------------


def _brute_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a.double() @ b.double() / (a.double().norm() * b.double().norm()))


@pytest.mark.parametrize("chunk_size", [None, 1, 7])
def test_pair_scores_leave_one_out_is_each_unordered_pair_once(chunk_size, device):
    torch.manual_seed(0)
    n = 23
    x = torch.randn(n, 5, device=device)
    labels = torch.randint(0, 4, (n,), device=device)
    scores, positive = pair_scores(x, labels, chunk_size=chunk_size)
    assert scores.shape == positive.shape == (n * (n - 1) // 2,)
    assert scores.device == x.device and positive.dtype == torch.bool
    expected = [
        (_brute_cosine(x[i].cpu(), x[j].cpu()), bool(labels[i] == labels[j]))
        for i, j in itertools.combinations(range(n), 2)
    ]
    np.testing.assert_allclose(scores.cpu().numpy(), [e[0] for e in expected], atol=1e-6)
    assert positive.cpu().tolist() == [e[1] for e in expected]
    # keeping the self pairs adds exactly n positives
    s_all, p_all = pair_scores(x, labels, exclude_self=False, chunk_size=chunk_size)
    assert s_all.shape == (n * (n + 1) // 2,) and int(p_all.sum()) == int(positive.sum()) + n


def test_pair_scores_gallery_every_pair_and_similarities():
    torch.manual_seed(1)
    q, g = torch.randn(6, 3, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    ql, gl = torch.randint(0, 3, (6,)), torch.randint(0, 3, (9,))
    pairs = list(itertools.product(range(6), range(9)))
    for similarity, fn in [
        ("cosine", lambda a, b: _brute_cosine(a, b)),
        ("dot", lambda a, b: float(a @ b)),
        ("euclidean", lambda a, b: -float(((a - b) ** 2).sum().sqrt())),
    ]:
        scores, positive = pair_scores(q, ql, g, gl, similarity=similarity, chunk_size=4)
        assert scores.shape == (54,)
        np.testing.assert_allclose(scores.numpy(), [fn(q[i], g[j]) for i, j in pairs], atol=1e-9)
        assert positive.tolist() == [bool(ql[i] == gl[j]) for i, j in pairs]
    # exclude_self with the query set passed again as gallery: n^2 - n ordered pairs
    scores, _ = pair_scores(q, ql, q, ql, exclude_self=True)
    assert scores.shape == (30,)


def test_pair_scores_multi_hot_share_one_label():
    x = torch.randn(4, 2)
    multi_hot = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1]])
    _, positive = pair_scores(x, multi_hot)
    # pairs (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
    assert positive.tolist() == [True, False, False, True, False, False]


def test_pair_scores_refuses_too_many_pairs():
    x, labels = torch.randn(100, 4), torch.randint(0, 3, (100,))
    with pytest.raises(ValueError, match="bins="):
        pair_scores(x, labels, max_pairs=4949)
    assert pair_scores(x, labels, max_pairs=4950)[0].shape == (4950,)


# --------------------------------------------------------------------------------------------
# ROC from embeddings: exact vs streaming histogram
# --------------------------------------------------------------------------------------------


def _clustered(n: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=gen)
    centers = torch.randn(classes, 16, generator=gen)
    return centers[labels] + 1.5 * torch.randn(n, 16, generator=gen), labels


@pytest.mark.parametrize("similarity", ["cosine", "dot"])
def test_histogram_roc_close_to_exact(similarity):
    x, labels = _clustered(300, 8, seed=2)
    exact = roc_curve_from_embeddings(x, labels, similarity=similarity)
    scores, positive = pair_scores(x, labels, similarity=similarity)
    assert exact.auc == pytest.approx(roc_auc_score(positive.numpy(), scores.numpy()), abs=1e-9)
    hist = roc_curve_from_embeddings(x, labels, similarity=similarity, bins=2000, chunk_size=37)
    assert not hist.exact and hist.n_positive == exact.n_positive
    assert 0 < hist.max_auc_error < 1e-3
    assert abs(hist.auc - exact.auc) <= hist.max_auc_error + 1e-12
    # every histogram point is the exact (FPR, TPR) of the threshold "score >= lower bin edge"
    s, p = scores.double().numpy(), positive.numpy()
    for k in range(1, len(hist), max(1, len(hist) // 50)):
        accepted = s >= hist.thresholds[k]
        assert hist.tpr[k] == pytest.approx(accepted[p].mean(), abs=2e-3)
        assert hist.fpr[k] == pytest.approx(accepted[~p].mean(), abs=2e-3)
    assert hist.fpr[-1] == hist.tpr[-1] == 1.0


def test_histogram_roc_with_gallery_counts_every_pair():
    q, ql = _clustered(40, 4, seed=3)
    g, gl = _clustered(70, 4, seed=4)
    hist = roc_curve_from_embeddings(q, ql, g, gl, bins=64)
    assert hist.n_positive + hist.n_negative == 40 * 70
    assert hist.n_positive == int((ql[:, None] == gl[None, :]).sum())


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scores", "targets", "match"),
    [
        ([0.1, 0.2, 0.3], [True, False], "length"),
        ([0.1, float("nan"), 0.3], [True, False, True], "`scores` contains 1 NaN"),
        ([0.1, 0.2], [False, False], "no positive"),
        ([0.1, 0.2], [True, True], "no negative"),
        ([[0.1, 0.2]], [[True, False]], "`scores` must be 1-D"),
        ([0.1, 0.2], [2, 0], "`is_positive` must be boolean"),
    ],
)
@pytest.mark.parametrize("fn", [roc_auc, roc_curve, lambda s, y: tpr_at_fpr(s, y, fpr=0.1)])
def test_score_validation_errors(fn, scores, targets, match):
    with pytest.raises(ValueError, match=match):
        fn(scores, targets)


def test_embedding_validation_errors():
    x, labels = torch.randn(10, 3), torch.randint(0, 2, (10,))
    with pytest.raises(ValueError, match="both `gallery` and `gallery_labels`"):
        pair_scores(x, labels, gallery=x)
    with pytest.raises(ValueError, match="same kind"):
        pair_scores(x, labels, x, torch.ones(10, 2))
    with pytest.raises(ValueError, match="`similarity`"):
        pair_scores(x, labels, similarity="manhattan")
    with pytest.raises(ValueError, match="`query` contains NaN"):
        pair_scores(torch.full((3, 2), float("nan")), torch.zeros(3))
    with pytest.raises(ValueError, match="`bins`"):
        roc_curve_from_embeddings(x, labels, bins=1)
    with pytest.raises(ValueError, match="no positive"):
        roc_curve_from_embeddings(x, torch.arange(10), bins=10)
    with pytest.raises(ValueError, match="no positive"):
        roc_curve_from_embeddings(x, torch.arange(10))


# --------------------------------------------------------------------------------------------
# plots of the curves
# --------------------------------------------------------------------------------------------


def test_plot_roc_and_pr_curves_write_pngs(tmp_path):
    from PIL import Image

    from rankwise.metrics.retrieval import pr_curve
    from rankwise.plots import plot_pr_curves, plot_roc_curves

    x, labels = _clustered(120, 6, seed=8)
    curves = {
        "exact": roc_curve_from_embeddings(x, labels),
        "histogram": roc_curve_from_embeddings(x, labels, bins=50),
    }
    for log_fpr in (True, False):
        path = plot_roc_curves(curves, tmp_path / f"roc_{log_fpr}.png", title="t", log_fpr=log_fpr)
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 300
    pr = plot_pr_curves(
        {"a": pr_curve(x, labels), "b": pr_curve(x, labels, ties="pessimistic")},
        tmp_path / "sub" / "pr.png",
        labels={"a": 0.5, "b": "b (custom)"},
    )
    assert pr == tmp_path / "sub" / "pr.png" and pr.stat().st_size > 0
    with pytest.raises(ValueError, match=".png"):
        plot_roc_curves(curves, tmp_path / "roc.pdf")
    with pytest.raises(ValueError, match="empty"):
        plot_pr_curves({}, tmp_path / "x.png")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_euclidean_pair_scores_accept_half_precision_on_cpu(dtype):
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]], dtype=dtype)
    scores, is_positive = pair_scores(x, torch.tensor([0, 0, 1]), similarity="euclidean")
    # float64, exact: rounding the scores to the input's half precision would invent ties
    assert scores.dtype == torch.float64
    # pairs (0,1), (0,2), (1,2): distances 5, 1, sqrt(18)
    assert scores.tolist() == [-5.0, -1.0, -math.sqrt(18.0)]
    assert is_positive.tolist() == [True, False, False]


def test_exact_curve_auc_is_roc_auc_bit_for_bit():
    # the docs' example (docs/metrics.md): the trapezoidal sum of the rounded rates differed from
    # the exact Mann-Whitney value in the last bit (0.8810621700530188 vs ...187)
    torch.manual_seed(0)
    labels = torch.randint(0, 10, (300,))
    emb = torch.randn(300, 16) + 3.0 * torch.nn.functional.one_hot(labels, 16).float()
    scores, is_positive = pair_scores(emb, labels)
    for drop in (False, True):
        assert roc_curve(scores, is_positive, drop_intermediate=drop).auc == roc_auc(
            scores, is_positive
        )
    assert roc_curve_from_embeddings(emb, labels).auc == roc_auc(scores, is_positive)
    rng = np.random.default_rng(1)
    for _ in range(20):
        s = rng.integers(0, 7, 200).astype(np.float64)  # many ties
        y = rng.random(200) < 0.3
        assert roc_curve(s, y).auc == roc_auc(s, y)


# --------------------------------------------------------------------------------------------
# operating_point with sample weights
# --------------------------------------------------------------------------------------------


def _brute_weighted_operating_point(s, y, w, alpha):
    """Among the thresholds (and +inf) with weighted FPR <= alpha: max weighted TPR, then min FPR.

    Exact rational sums of the (binary) float weights, so the budget is checked without rounding.
    """
    weights = [Fraction(float(v)) for v in w]
    pos_total = sum(v for v, p in zip(weights, y, strict=True) if p)
    neg_total = sum(v for v, p in zip(weights, y, strict=True) if not p)
    candidates = [(Fraction(0), Fraction(0), math.inf)]
    for t in np.unique(s):
        tp = sum(v for v, p, x in zip(weights, y, s, strict=True) if p and x >= t)
        fp = sum(v for v, p, x in zip(weights, y, s, strict=True) if not p and x >= t)
        if fp <= Fraction(alpha) * neg_total:
            candidates.append((tp, fp, float(t)))
    tp, fp, t = max(candidates, key=lambda c: (c[0], -c[1]))
    if tp == 0:
        return 0.0, 0.0, math.inf
    return float(tp / pos_total), float(fp / neg_total), t


@pytest.mark.parametrize("seed", range(8))
def test_weighted_operating_point_matches_a_brute_force_weighted_count(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(6, 50))
    y = rng.random(n) < 0.4
    y[0], y[1] = True, False
    s = rng.integers(0, 6, n).astype(np.float64)  # ties
    w = rng.random(n) + 0.05
    for alpha in (0.05, 0.2, 1 / 3, 0.5, 0.8):
        got = operating_point(s, y, alpha, sample_weight=w)
        want = _brute_weighted_operating_point(s, y, w, alpha)
        assert got.threshold == want[2]
        assert got.tpr == pytest.approx(want[0], rel=1e-12)
        assert got.fpr == pytest.approx(want[1], rel=1e-12)


def test_integer_weights_count_as_repeated_examples_and_unit_weights_change_nothing():
    rng = np.random.default_rng(3)
    s = rng.normal(size=40).round(1)
    y = rng.random(40) < 0.5
    y[0], y[1] = True, False
    w = rng.integers(1, 5, 40)
    for alpha in (0.1, 0.25, 0.3, 0.5):
        repeated = operating_point(np.repeat(s, w), np.repeat(y, w), alpha)
        assert operating_point(s, y, alpha, sample_weight=w) == repeated
        assert operating_point(s, y, alpha, sample_weight=w / 7) == pytest.approx(repeated)
        assert operating_point(s, y, alpha, sample_weight=np.ones(40)) == operating_point(
            s, y, alpha
        )
    # the budget is met exactly by weights whose float sums round (10 x 0.1 = 1, 3 x 0.1 = 0.3)
    s10 = np.r_[30.0, 29.0, 28.0, np.arange(7.0), 20.0]
    y10 = np.array([False] * 10 + [True])
    assert operating_point(s10, y10, 0.3, sample_weight=np.full(11, 0.1)) == pytest.approx(
        (1.0, 0.3, 20.0)
    )
    assert (
        tpr_at_fpr(s, y, 0.25, sample_weight=w) == operating_point(s, y, 0.25, sample_weight=w).tpr
    )


@pytest.mark.parametrize(
    "weights, message",
    [
        ([1.0, 1.0, 1.0], "`sample_weight` has 3 entries but `scores` has 4"),
        ([1.0, -1.0, 1.0, 1.0], "`sample_weight` must hold finite, non-negative"),
        ([1.0, np.nan, 1.0, 1.0], "`sample_weight` must hold finite, non-negative"),
        ([1.0, 0.0, 1.0, 0.0], "`sample_weight` gives the negatives a total weight of 0"),
        ([0.0, 1.0, 0.0, 1.0], "`sample_weight` gives the positives a total weight of 0"),
        ([[1.0, 1.0, 1.0, 1.0]], "`sample_weight` must be 1-D"),
    ],
)
def test_bad_sample_weight_is_refused_by_name(weights, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        operating_point([3.0, 2.0, 1.0, 0.0], [1, 0, 1, 0], 0.5, sample_weight=weights)
