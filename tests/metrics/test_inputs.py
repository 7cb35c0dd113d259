"""Bad input to the embedding metrics: one check, one message naming the argument, on every entry
point (retrieval_metrics, pr_curve, pair_scores, roc_curve_from_embeddings, RetrievalMetric)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rankwise.metrics import (
    RetrievalMetric,
    batched_ndcg,
    ndcg,
    pair_scores,
    pr_curve,
    retrieval_metrics,
    roc_curve_from_embeddings,
)

X = np.random.default_rng(0).normal(size=(8, 3)).astype(np.float32)
Y = np.array([0, 0, 1, 1, 2, 2, 3, 3])

ENTRY_POINTS = {
    "retrieval_metrics": lambda **kw: retrieval_metrics(**kw),
    "pr_curve": lambda **kw: pr_curve(**kw),
    "pair_scores": lambda **kw: pair_scores(**kw),
    "roc_curve_from_embeddings": lambda **kw: roc_curve_from_embeddings(**kw),
    "roc_histogram": lambda **kw: roc_curve_from_embeddings(bins=10, **kw),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query_labels": np.array(list("aabbccdd"))}, r"`query_labels` holds strings.*np\.unique"),
        (
            {"query_labels": ["a", "a", "b", "b", "c", "c", "d", "d"]},
            "`query_labels` holds strings",
        ),
        ({"device": "cuda:0" if not torch.cuda.is_available() else "cuda:99"}, "`device`"),
        ({"device": "bogus"}, "`device`: unknown device 'bogus'"),
        ({"chunk_size": "x"}, "`chunk_size` must be an integer >= 1, got 'x'"),
        ({"chunk_size": 0}, "`chunk_size`"),
        ({"chunk_size": 2.0}, "`chunk_size`"),
        ({"query": np.zeros((8, 0), np.float32)}, r"`query` has shape \(8, 0\): 0 dimensions"),
        ({"query_labels": Y[:, None]}, r"shape \(8, 1\).*pass 1-D class ids"),
        ({"query_labels": np.eye(8, dtype=np.int64) * 2}, "multi-hot `query_labels`"),
        ({"similarity": "manhattan"}, "`similarity` must be one of 'cosine', 'dot' or 'euclidean'"),
        ({"gallery": X}, "`gallery_labels` is missing"),
        ({"gallery_labels": Y}, "`gallery` is missing"),
        ({"query": np.full((8, 3), np.nan)}, "`query` contains NaN"),
    ],
)
def test_every_entry_point_names_the_bad_argument(entry, kwargs, match):
    args = {"query": X, "query_labels": Y, **kwargs}
    with pytest.raises(ValueError, match=match):
        ENTRY_POINTS[entry](**args)


def test_zero_dimensional_gallery_is_refused():
    with pytest.raises(ValueError, match=r"`gallery` has shape \(4, 0\)"):
        retrieval_metrics(X, Y, np.zeros((4, 0)), Y[:4])


def test_neg_euclidean_is_an_alias_everywhere():
    want = retrieval_metrics(X, Y, similarity="euclidean")
    got = retrieval_metrics(X, Y, similarity="neg_euclidean")
    assert got.to_dict() == want.to_dict() and got.similarity == "euclidean"
    metric = RetrievalMetric(similarity="neg_euclidean")
    metric.update(torch.from_numpy(X), torch.from_numpy(Y))
    assert metric.similarity == "euclidean" and metric.compute().to_dict() == want.to_dict()
    assert torch.equal(
        pair_scores(X, Y, similarity="neg_euclidean")[0],
        pair_scores(X, Y, similarity="euclidean")[0],
    )
    assert roc_curve_from_embeddings(X, Y, similarity="neg_euclidean").auc == (
        roc_curve_from_embeddings(X, Y, similarity="euclidean").auc
    )


def test_empty_ks_is_refused_by_the_function_and_the_module_alike():
    for ks in ((), []):
        with pytest.raises(ValueError, match="`ks` is empty"):
            retrieval_metrics(X, Y, ks=ks)
        with pytest.raises(ValueError, match="`ks` is empty"):
            RetrievalMetric(ks=ks)
    for ks in ((0,), (1.5,), (True,), ("1",)):
        with pytest.raises(ValueError, match="`ks`"):
            retrieval_metrics(X, Y, ks=ks)
        with pytest.raises(ValueError, match="`ks`"):
            RetrievalMetric(ks=ks)


@pytest.mark.parametrize("ks", [(10**30,), 10**30, (1, 2**63), [np.uint64(2**63)]])
def test_a_cutoff_past_int64_is_refused_with_the_range_not_an_overflow(ks):
    # issue 19, item 8: ks=(10**30,) ended in "OverflowError: Python int too large to convert"
    match = r"`ks` must hold integers from 1 to 2\*\*63 - 1 \(9223372036854775807\)"
    with pytest.raises(ValueError, match=match):
        retrieval_metrics(X, Y, ks=ks)
    with pytest.raises(ValueError, match=match):
        RetrievalMetric(ks=ks)


def test_the_largest_cutoff_counts_the_whole_list():
    report = retrieval_metrics(X, Y, ks=(2**63 - 1,))
    assert report.recall_at[2**63 - 1] == 1.0


def test_retrieval_metric_update_applies_the_functions_label_rules():
    metric = RetrievalMetric()
    with pytest.raises(ValueError, match="multi-hot `labels` must contain only 0 and 1"):
        metric.update(torch.randn(4, 3), torch.tensor([[2, 0], [1, 0], [0, 1], [1, 1]]))
    with pytest.raises(ValueError, match=r"shape \(4, 1\).*1-D class ids"):
        metric.update(torch.randn(4, 3), torch.tensor([[3], [1], [0], [2]]))
    with pytest.raises(ValueError, match="holds strings"):
        metric.update(torch.randn(2, 3), np.array(["cat", "dog"]))
    with pytest.raises(ValueError, match="0 dimensions"):
        metric.update(torch.randn(2, 0), torch.tensor([0, 1]))
    assert metric.n_samples == 0


def test_ndcg_gains_that_overflow_say_so():
    for call in (
        lambda: ndcg([3.0, 2.0, 1.0], [2000, 1, 0]),
        lambda: batched_ndcg([[3.0, 2.0, 1.0]], [[1024, 1, 0]]),
    ):
        with pytest.raises(ValueError, match="`gains` up to .* overflow float64"):
            call()
    assert ndcg([3.0, 2.0, 1.0], [1000, 1, 0]) == 1.0  # 2^1000 - 1 is still finite
    with pytest.raises(ValueError, match="all 0"):
        ndcg([3.0, 2.0], [0, 0])


def test_float_precision_setting_is_honoured():
    # with reduced float32 matmul precision the approximation switches to float64 (still exact)
    want = retrieval_metrics(X, Y)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert retrieval_metrics(X, Y).to_dict() == want.to_dict()
    finally:
        torch.set_float32_matmul_precision(before)
