"""Exact retrieval metrics over query shards: merged reports equal the single-process ones.

Shards are ranked against the whole gallery (each query's own row excluded through an index
array) and merged with merge_retrieval_reports / merge_pr_curves; the 2-rank torch.distributed
form runs in tests/distributed_worker.py (case "metrics"). Integer embeddings with the dot
similarity make every score exact (many ties), so per-query APs, hence mAP, must be equal bit for
bit; the other means are query-weighted means of shard means (float64 rounding, <= 1e-12).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from rankwise.metrics import (
    merge_pr_curves,
    merge_retrieval_reports,
    pr_curve,
    retrieval_metrics,
)

MEAN_RTOL = 1e-12


def integer_data(n=53, seed=0, classes=6):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, 5), generator=generator).to(torch.float64)
    y = torch.randint(0, classes, (n,), generator=generator)
    return x, y


def assert_reports_equal(merged, single):
    a, b = merged.to_dict(), single.to_dict()
    assert a["per_query_ap"] == b["per_query_ap"]
    assert a["map"] == b["map"]  # same per-query values, same mean: bit for bit
    for key in ("n_queries", "n_queries_without_relevant", "n_gallery", "ties", "similarity"):
        assert a[key] == b[key], key
    assert a["ks"] == b["ks"] and a["clamped_ks"] == b["clamped_ks"]
    for key in ("map_at_r", "r_precision"):
        assert a[key] == pytest.approx(b[key], rel=MEAN_RTOL, abs=0), key
    for key in ("recall_at", "precision_at"):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            assert a[key][k] == pytest.approx(b[key][k], rel=MEAN_RTOL, abs=0), (key, k)


def shard_bounds(n, n_shards):
    return [(n * s // n_shards, n * (s + 1) // n_shards) for s in range(n_shards)]


@pytest.mark.parametrize("ties", ["expected", "optimistic", "pessimistic"])
@pytest.mark.parametrize("n_shards", [2, 3, 7])
def test_merged_leave_one_out_shards_equal_the_single_process_report(ties, n_shards):
    x, y = integer_data()
    single = retrieval_metrics(x, y, similarity="dot", ties=ties, ks=(1, 4, 60))
    reports = [
        retrieval_metrics(
            x[lo:hi], y[lo:hi], x, y, similarity="dot", ties=ties, ks=(1, 4, 60),
            exclude_self=torch.arange(lo, hi),
        )
        for lo, hi in shard_bounds(x.shape[0], n_shards)
    ]  # fmt: skip
    assert_reports_equal(merge_retrieval_reports(reports), single)
    curves = [
        pr_curve(x[lo:hi], y[lo:hi], x, y, similarity="dot", ties=ties,
                 exclude_self=torch.arange(lo, hi))
        for lo, hi in shard_bounds(x.shape[0], n_shards)
    ]  # fmt: skip
    merged = merge_pr_curves(curves)
    reference = pr_curve(x, y, similarity="dot", ties=ties)
    np.testing.assert_allclose(merged.precision, reference.precision, rtol=MEAN_RTOL, atol=0)
    assert (merged.n_queries, merged.n_queries_without_relevant) == (
        reference.n_queries,
        reference.n_queries_without_relevant,
    )


@pytest.mark.parametrize("similarity", ["cosine", "euclidean"])
def test_shards_are_exact_for_every_similarity_despite_ties(similarity):
    """Integer vectors tie under cosine / euclidean too; exact keys rank them alike in any shard."""
    x, y = integer_data()
    single = retrieval_metrics(x, y, similarity=similarity, ks=(1, 4))
    reports = [
        retrieval_metrics(x[lo:hi], y[lo:hi], x, y, similarity=similarity, ks=(1, 4),
                          exclude_self=torch.arange(lo, hi), chunk_size=3)
        for lo, hi in shard_bounds(x.shape[0], 3)
    ]  # fmt: skip
    assert_reports_equal(merge_retrieval_reports(reports), single)


def test_closed_set_shards_with_queries_without_relevant_items():
    x, y = integer_data(40, seed=1)
    gallery, gallery_labels = integer_data(30, seed=2, classes=4)  # classes 4, 5: no relevant item
    single = retrieval_metrics(x, y, gallery, gallery_labels, similarity="dot", ks=(1, 50))
    assert single.n_queries_without_relevant > 0
    reports = [
        retrieval_metrics(x[lo:hi], y[lo:hi], gallery, gallery_labels, similarity="dot", ks=(1, 50))
        for lo, hi in shard_bounds(40, 4)
    ]
    merged = merge_retrieval_reports(reports)
    assert_reports_equal(merged, single)
    assert merged.clamped_ks == {50: 30}


def test_merging_refuses_mismatched_or_empty_shards():
    x, y = integer_data()
    a = retrieval_metrics(x[:20], y[:20], x, y, ks=(1, 5), exclude_self=torch.arange(20))
    b = retrieval_metrics(x[20:], y[20:], x, y, ks=(1, 10), exclude_self=torch.arange(20, 53))
    with pytest.raises(ValueError, match="ks differ"):
        merge_retrieval_reports([a, b])
    with pytest.raises(ValueError, match="`reports` is empty"):
        merge_retrieval_reports([])
    with pytest.raises(ValueError, match="`curves` is empty"):
        merge_pr_curves([])
    c = pr_curve(x[:20], y[:20], x, y, num_points=11, exclude_self=torch.arange(20))
    d = pr_curve(x[20:], y[20:], x, y, num_points=21, exclude_self=torch.arange(20, 53))
    with pytest.raises(ValueError, match="different recall levels"):
        merge_pr_curves([c, d])


@pytest.mark.parametrize(
    "setting",
    [
        "leave_one_out_dot",
        "leave_one_out_cosine",
        "leave_one_out_euclidean",
        "pessimistic",
        "no_relevant_on_rank0",
        "multi_hot",
        "gallery_sharded",
    ],
)
def test_two_ranks_give_the_single_process_report_on_every_rank(distributed_results, setting):
    rank0, rank1 = distributed_results("metrics", 0), distributed_results("metrics", 1)
    entry = rank0[setting]
    assert entry["report"] == rank1[setting]["report"]  # the same merged report everywhere
    a, b = entry["report"], entry["single"]
    assert a["per_query_ap"] == b["per_query_ap"] and a["map"] == b["map"]
    for key in ("n_queries", "n_queries_without_relevant", "n_gallery", "clamped_ks"):
        assert a[key] == b[key], key
    for key in ("map_at_r", "r_precision"):
        assert a[key] == pytest.approx(b[key], rel=MEAN_RTOL, abs=0)
    for key in ("recall_at", "precision_at"):
        for k in b[key]:
            assert a[key][k] == pytest.approx(b[key][k], rel=MEAN_RTOL, abs=0)
    torch.testing.assert_close(entry["curve"], entry["single_curve"], rtol=MEAN_RTOL, atol=0)
    assert entry["curve_n"] == entry["single_curve_n"]
    if setting == "no_relevant_on_rank0":  # rank 0's 18 queries have no relevant item
        assert a["n_queries_without_relevant"] == 18


def test_a_whole_gallery_on_every_rank_equals_the_gathered_one(distributed_results):
    rank0 = distributed_results("metrics", 0)
    everywhere = rank0["gallery_everywhere"]["report"]
    assert everywhere == distributed_results("metrics", 1)["gallery_everywhere"]["report"]
    assert everywhere["map"] == rank0["gallery_sharded"]["report"]["map"]


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [
        ("nan_on_rank1", r"`query` contains NaN.*\(on rank 1\)"),
        ("label_length_on_rank0", r"`query_labels` has length 17 .*\(on rank 0\)"),
        ("similarity_everywhere", r"^`similarity` must be .*got 'l2'\.? \(on every rank\)$"),
        ("exclude_self_on_rank1", r"failed on other ranks: rank 1: .*`exclude_self` indices"),
        ("dtype_differs", r"differ in dimensions or dtype across ranks"),
    ],
)
def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank(
    distributed_results, attempt, expected
):
    """The shared query/gallery check runs before any gather; nobody waits for a failed rank."""
    mine = distributed_results("metrics", 0)["errors"][attempt]
    theirs = distributed_results("metrics", 1)["errors"][attempt]
    assert re.search(expected, mine), mine
    if attempt != "exclude_self_on_rank1":  # there rank 1 names its own error, rank 0 the other's
        assert mine == theirs
    else:
        assert "`exclude_self` indices" in theirs
