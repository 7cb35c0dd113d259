"""Streamed verification metrics (ROC AUC, TPR at FPR) against brute force over the explicit pairs.

The reference is the explicit list of every counted (query, gallery) pair scored by its exact key
(rankwise.similarity.ranking_keys, the key the tie-aware retrieval metrics tie by): scikit-learn's
roc_auc_score and a brute-force scan of every threshold for TPR at FPR, ties moving together.
Streaming in chunks, blocks of queries merged against shared keys, and the report / JSON plumbing
must all give the same integers, hence the same bits.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from sharded_worker import assert_identical, tied
from sklearn.metrics import roc_auc_score

from rankwise.metrics import (
    PairCounts,
    RetrievalReport,
    merge_retrieval_reports,
    pair_counts,
    pair_scores,
    positive_pair_keys,
    retrieval_metrics,
    roc_auc,
    sharded_verification,
    verification_metrics,
)
from rankwise.metrics.verification import check_fprs
from rankwise.similarity import ranking_keys, similarity_from_keys

FPRS = (0.001, 0.01, 0.05, 0.2, 0.5)


def explicit_pairs(query, labels, gallery=None, gallery_labels=None, similarity="cosine"):
    """(keys, is_positive) of every counted pair: leave-one-out = ordered pairs i != j."""
    loo = gallery is None
    g, gl = (query, labels) if loo else (gallery, gallery_labels)
    keys = ranking_keys(query, g, similarity)
    labels, gl = torch.as_tensor(labels), torch.as_tensor(gl)
    if labels.ndim == 2:
        positive = (labels.float() @ gl.float().T) > 0
    else:
        positive = labels[:, None] == gl[None, :]
    keep = ~torch.eye(len(query), dtype=torch.bool) if loo else torch.ones_like(positive)
    return keys[keep].numpy(), positive[keep].numpy()


def brute_force_point(keys, positive, fpr, similarity):
    """Max TPR over thresholds t (predict key >= t) with FP / n_neg <= fpr; then min FP."""
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    thresholds = np.unique(keys)
    accepted = keys[None, :] >= thresholds[:, None]  # every threshold against every pair
    tp = (accepted & positive[None, :]).sum(1)
    fp = (accepted & ~positive[None, :]).sum(1)
    best = (0, 0, math.inf)  # (tp, -fp, threshold): nothing accepted
    for t, tp_t, fp_t in zip(thresholds, tp.tolist(), fp.tolist(), strict=True):
        if Fraction(fp_t, n_neg) <= Fraction(fpr) and (tp_t, -fp_t) > best[:2]:
            best = (tp_t, -fp_t, t)
    tp_best, neg_fp, t = best
    if tp_best == 0:
        return 0.0, 0.0, math.inf
    value = float(similarity_from_keys(torch.tensor([t], dtype=torch.float64), similarity)[0])
    return tp_best / n_pos, -neg_fp / n_neg, value


def float_with_ties(n=50, dim=6, seed=0):
    """Float embeddings (the approximate score path) with exact duplicate rows across classes."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=generator)
    y = torch.randint(0, 4, (n,), generator=generator)
    x[10], x[11], x[12] = x[3], x[3], x[4]  # same rows, other labels: positive and negative tie
    y[11] = (y[3] + 1) % 4
    return x, y


def check_against_brute_force(report, keys, positive, similarity):
    assert report.roc_auc == roc_auc(keys, positive)  # the same integers, the same division
    assert report.roc_auc == pytest.approx(roc_auc_score(positive, keys), abs=1e-12)
    assert report.n_positive_pairs == positive.sum()
    assert report.n_negative_pairs == (~positive).sum()
    for fpr in FPRS:
        point = report.operating_points[fpr]
        assert tuple(point) == brute_force_point(keys, positive, fpr, similarity), fpr


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
@pytest.mark.parametrize("data", ["tied", "float"])
def test_leave_one_out_equals_brute_force_over_the_pairs(similarity, data):
    x, y = tied(50, 1) if data == "tied" else float_with_ties()
    report = verification_metrics(x, y, fpr=FPRS, similarity=similarity, chunk_size=9)
    keys, positive = explicit_pairs(x, y, similarity=similarity)
    check_against_brute_force(report, keys, positive, similarity)
    assert report.n_excluded_pairs == len(x)


@pytest.mark.parametrize("similarity", ["cosine", "euclidean"])
def test_a_gallery_and_multi_hot_labels_equal_brute_force(similarity):
    q, ql = float_with_ties(30, seed=1)
    g, gl = float_with_ties(45, seed=2)
    report = verification_metrics(q, ql, g, gl, fpr=FPRS, similarity=similarity)
    check_against_brute_force(report, *explicit_pairs(q, ql, g, gl, similarity), similarity)
    assert report.n_excluded_pairs == 0 and report.pairs == "query x gallery pairs"
    hot = (torch.rand(60, 5, generator=torch.Generator().manual_seed(3)) < 0.3).to(torch.int64)
    x, _ = tied(60, 4)
    report = verification_metrics(x, hot, fpr=FPRS, similarity=similarity)
    check_against_brute_force(report, *explicit_pairs(x, hot, similarity=similarity), similarity)


def test_streamed_in_chunks_equals_unchunked():
    x, y = float_with_ties(60, seed=5)
    whole = pair_counts(x, y, chunk_size=60)
    for chunk in (4, 17, None):
        assert_identical(pair_counts(x, y, chunk_size=chunk), whole, f"chunk {chunk}")
    assert whole.n_positive + whole.n_negative == 60 * 59


def test_leave_one_out_counts_each_unordered_pair_twice_with_the_same_rates():
    x, y = tied(50, 6)
    report = verification_metrics(x, y, fpr=FPRS, similarity="dot")
    scores, positive = pair_scores(x, y, similarity="dot")  # each unordered pair once
    assert report.n_positive_pairs == 2 * int(positive.sum())
    assert report.n_negative_pairs == 2 * int((~positive).sum())
    assert report.roc_auc == roc_auc(scores, positive)
    for fpr in FPRS:
        assert report.operating_points[fpr] == brute_force_point(
            scores.numpy(), positive.numpy(), fpr, "dot"
        )


def test_query_blocks_counted_against_shared_keys_merge_exactly():
    x, y = float_with_ties(60, seed=7)
    keys = positive_pair_keys(x, y)
    parts = [
        pair_counts(x[lo:hi], y[lo:hi], x, y, exclude_self=np.arange(lo, hi), positive_keys=keys)
        for lo, hi in ((0, 1), (1, 45), (45, 60))
    ]
    merged = parts[0].merge(parts[1]).merge(parts[2])
    assert_identical(merged, pair_counts(x, y))
    # a block counted against its own keys cannot be merged: its negatives sit in other cells
    own = pair_counts(x[:45], y[:45], x, y, exclude_self=np.arange(45))
    with pytest.raises(ValueError, match="same positive keys"):
        own.merge(parts[2])
    with pytest.raises(ValueError, match="lacks the key of a positive pair"):
        pair_counts(x, y, positive_keys=keys[1:])


def test_report_json_scalars_rows_and_exact_report_merge():
    x, y = tied(60, 8)
    single = retrieval_metrics(x, y, ks=(1,)).with_verification(
        verification_metrics(x, y, fpr=(1e-3, 0.1))
    )
    data = single.to_dict()
    assert set(data["verification"]) >= {"roc_auc", "tpr_at_fpr", "operating_points"}
    assert data["verification"]["tpr_at_fpr"].keys() == {"0.001", "0.1"}
    point = data["verification"]["operating_points"]["0.1"]
    assert point["fnmr"] == 1 - point["tpr"] and point["fpr"] <= 0.1
    back = RetrievalReport.from_dict(data)
    assert back.to_dict() == data and back.verification.roc_auc == single.verification.roc_auc
    assert single.scalars()["roc_auc"] == single.verification.roc_auc
    assert "tpr@fpr=0.001" in single.scalars() and ("ROC AUC", single.verification.roc_auc) in (
        single.rows()
    )
    assert "verification" not in retrieval_metrics(x, y, ks=(1,)).to_dict()  # unchanged default

    keys = positive_pair_keys(x, y)
    blocks = []
    for lo, hi in ((0, 30), (30, 60)):
        rows = np.arange(lo, hi)
        report = retrieval_metrics(x[lo:hi], y[lo:hi], x, y, ks=(1,), exclude_self=rows)
        counts = pair_counts(x[lo:hi], y[lo:hi], x, y, exclude_self=rows, positive_keys=keys)
        blocks.append(
            report.with_verification(counts.report((1e-3, 0.1), pairs=single.verification.pairs))
        )
    merged = merge_retrieval_reports(blocks)
    assert_identical(merged.verification, single.verification)
    with pytest.raises(ValueError, match="only some of `reports` carry"):
        merge_retrieval_reports([blocks[0], blocks[1].with_verification(None)])


def test_no_false_positive_allowed_and_nothing_accepted():
    scores_x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    labels = torch.tensor([0, 0, 1, 1])  # the top pair score (1.0) is shared by a negative pair
    report = verification_metrics(scores_x, labels, fpr=(0.01,), similarity="dot")
    assert report.operating_points[0.01] == (0.0, 0.0, math.inf)
    assert report.to_dict()["operating_points"]["0.01"]["threshold"] is None


@pytest.mark.parametrize(
    ("fpr", "message"),
    [
        (0.0, "`fpr`"),
        (1.0, "`fpr`"),
        ((1e-3, -0.5), "`fpr`"),
        (float("nan"), "`fpr`"),
        ("1e-3", "numbers in"),
        ((True,), "`fpr`"),
    ],
)
def test_bad_fprs_are_refused_by_name(fpr, message):
    with pytest.raises(ValueError, match=message):
        check_fprs(fpr)
    with pytest.raises(ValueError, match=message):
        verification_metrics(torch.eye(3), torch.tensor([0, 0, 1]), fpr=fpr)


def test_without_a_positive_or_negative_pair_the_metrics_are_undefined():
    with pytest.raises(ValueError, match="no positive"):
        verification_metrics(torch.eye(3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="no negative"):
        verification_metrics(torch.eye(3), torch.tensor([0, 0, 0]))


def test_pair_counts_hold_what_they_say():
    counts = PairCounts(np.array([0.5]), np.array([2]), np.array([1, 1, 3]), "dot")
    assert (counts.n_positive, counts.n_negative) == (2, 5)
    assert counts.roc_auc() == (2 * 1 + 0.5 * 2 * 1) / (2 * 5)
    assert sharded_verification(torch.eye(3), torch.tensor([0, 0, 1])).roc_auc == (
        verification_metrics(torch.eye(3), torch.tensor([0, 0, 1])).roc_auc
    )
