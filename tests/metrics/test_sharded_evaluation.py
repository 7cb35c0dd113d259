"""The mergeable metric contract: query blocks merge into the one-call report, field for field.

In one process: blocks of the queries ranked against the whole gallery (each block's own rows
excluded by an index array) and merged with merge_retrieval_reports / merge_pr_curves equal the
call on every query bit for bit, on heavily tied data. With 2 gloo ranks (sharded_worker.py, run
once per session by conftest.py): sharded_metric / sharded_curve give every rank the one-process
report; a metric_fn written to the old signature still works, unsharded, with one note.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch
from sharded_worker import assert_identical, old_signature, tied

from rankwise.metrics import (
    RetrievalReport,
    hamming_retrieval_metrics,
    merge_pr_curves,
    merge_retrieval_reports,
    pr_curve,
    query_blocks,
    query_share,
    retrieval_metrics,
    sharded_curve,
    sharded_metric,
    supports_query_blocks,
)
from rankwise.workflows.hashing import hamming_curve_fn, hamming_metric_fn

BOUNDS = [(0, 1), (1, 40), (40, 41), (41, 203)]  # uneven blocks, two of a single query


def blocks(fn, x, y, gallery=None, gallery_labels=None, **kwargs):
    """fn of each block of BOUNDS by the block call (leave-one-out when gallery is None)."""
    loo = gallery is None
    g, gl = (x, y) if loo else (gallery, gallery_labels)
    return [
        fn(x[lo:hi], y[lo:hi], g, gl, exclude_self=np.arange(lo, hi) if loo else False, **kwargs)
        for lo, hi in BOUNDS
    ]


@pytest.mark.parametrize("similarity", ["dot", "cosine", "euclidean"])
@pytest.mark.parametrize("ties", ["expected", "optimistic", "pessimistic"])
def test_blocks_merge_into_the_single_report_bit_for_bit(similarity, ties):
    x, y = tied(203, 0)
    kwargs = {"ks": (1, 5, 202, 300), "similarity": similarity, "ties": ties}
    single = retrieval_metrics(x, y, **kwargs)
    merged = merge_retrieval_reports(blocks(retrieval_metrics, x, y, **kwargs))
    assert_identical(merged, single)
    assert single.clamped_ks == {300: 202} and set(single.per_query) >= {"recall@5", "r_prec"}


def test_blocks_against_a_gallery_and_multi_hot_merge_exactly():
    x, y = tied(203, 0)
    g, gl = tied(90, 2)
    single = retrieval_metrics(x, y, g, gl, ks=(1, 10))
    assert_identical(
        merge_retrieval_reports(blocks(retrieval_metrics, x, y, g, gl, ks=(1, 10))), single
    )
    hot = (torch.rand(203, 6, generator=torch.Generator().manual_seed(3)) < 0.3).to(torch.int64)
    single = retrieval_metrics(x, hot, ks=(1, 3))
    assert_identical(merge_retrieval_reports(blocks(retrieval_metrics, x, hot, ks=(1, 3))), single)


@pytest.mark.parametrize("ties", ["expected", "pessimistic"])
def test_curve_blocks_merge_exactly_and_the_curve_does_not_depend_on_chunks(ties):
    x, y = tied(203, 0)
    single = pr_curve(x, y, ties=ties, num_points=31)
    # the running sum in query order: any chunking gives the same bits
    assert_identical(pr_curve(x, y, ties=ties, num_points=31, chunk_size=7), single)
    parts = blocks(pr_curve, x, y, ties=ties, num_points=31, keep_per_query=True)
    merged = merge_pr_curves(parts)
    np.testing.assert_array_equal(merged.precision, single.precision)
    assert (merged.n_queries, merged.n_queries_without_relevant) == (
        single.n_queries,
        single.n_queries_without_relevant,
    )
    kept = pr_curve(x, y, ties=ties, num_points=31, keep_per_query=True)
    np.testing.assert_array_equal(merged.per_query_precision, kept.per_query_precision)
    assert kept.per_query_precision.shape == (single.n_queries, 31)


def test_hamming_blocks_merge_into_the_single_hamming_report():
    generator = torch.Generator().manual_seed(4)
    codes = torch.randn(203, 6, generator=generator)  # 6 bits: at most 7 tie groups per query
    labels = torch.randint(0, 4, (203,), generator=generator).numpy()
    single = hamming_metric_fn(codes, labels, ks=(1, 10, 202, 400))
    merged = merge_retrieval_reports(blocks(hamming_metric_fn, codes, labels, ks=(1, 10, 202, 400)))
    assert_identical(merged, single)  # NDCG, AP@k and the tie ranges too
    assert single.ks == (1, 10, 202)
    curve = hamming_curve_fn(codes, labels)
    parts = blocks(hamming_curve_fn, codes, labels, keep_per_query=True)
    np.testing.assert_array_equal(merge_pr_curves(parts).precision, curve.precision)


def test_hamming_exclude_self_rules():
    codes = torch.tensor([[1, 1, 1, 1], [1, 1, -1, -1], [1, -1, 1, -1], [-1, -1, -1, -1]])
    labels = torch.tensor([0, 0, 1, 1])
    loo = hamming_retrieval_metrics(codes, labels, ks=(1,))
    same = hamming_retrieval_metrics(codes, labels, codes, labels, ks=(1,), exclude_self=True)
    assert_identical(same, loo)
    with pytest.raises(ValueError, match="every query or of none"):
        hamming_retrieval_metrics(codes, labels, codes, labels, exclude_self=[0, -1, 2, 3])
    with pytest.raises(ValueError, match=r"`exclude_self` indices must lie in \[-1, 3\]"):
        hamming_retrieval_metrics(codes, labels, codes, labels, exclude_self=[0, 1, 2, 4])


def test_reports_without_per_query_values_merge_by_weighted_means():
    x, y = tied(203, 0)
    parts = blocks(retrieval_metrics, x, y, ks=(1,))
    bare = [dataclasses_replace(p) for p in parts]
    merged = merge_retrieval_reports(bare)
    single = retrieval_metrics(x, y, ks=(1,))
    assert merged.map == single.map and not merged.per_query
    assert merged.recall_at[1] == pytest.approx(single.recall_at[1], rel=1e-12, abs=0)


def dataclasses_replace(report: RetrievalReport) -> RetrievalReport:
    import dataclasses

    return dataclasses.replace(report, per_query={})


def test_which_functions_take_the_block_call():
    assert supports_query_blocks(retrieval_metrics) and supports_query_blocks(pr_curve)
    assert supports_query_blocks(hamming_metric_fn) and supports_query_blocks(hamming_curve_fn)
    assert supports_query_blocks(functools.partial(retrieval_metrics, similarity="dot"))
    # a preset exclude_self would be overridden by the block's rows: not blockable
    assert not supports_query_blocks(functools.partial(retrieval_metrics, exclude_self=False))
    assert not supports_query_blocks(old_signature)
    assert not supports_query_blocks(lambda *a, **k: retrieval_metrics(*a, **k))
    marked = query_blocks(lambda *a, **k: retrieval_metrics(*a, **k))
    assert supports_query_blocks(marked)
    assert [query_share(5, r, 2) for r in range(2)] == [(0, 2), (2, 5)]
    assert [query_share(1, r, 2) for r in range(2)] == [(0, 0), (0, 1)]


def test_without_a_process_group_sharded_calls_are_the_plain_calls():
    x, y = tied(60, 8)
    assert_identical(
        sharded_metric(retrieval_metrics, x, y, ks=(1, 2)), retrieval_metrics(x, y, ks=(1, 2))
    )
    assert_identical(sharded_curve(pr_curve, x, y), pr_curve(x, y))
    assert_identical(sharded_metric(old_signature, x, y), old_signature(x, y))


# -- 2 gloo ranks ----------------------------------------------------------------------------------

REPORT_CASES = [
    *(f"loo/{s}/{t}" for s in ("dot", "cosine", "euclidean") for t in ("expected", "pessimistic")),
    "gallery",
    "multi_hot",
    "numpy_labels",
    "partial",
    "index_array",
    "one_query",
    "ndcg_mrr/numba",
    "ndcg_mrr/torch",
]


@pytest.mark.parametrize("case", REPORT_CASES)
def test_two_ranks_give_every_rank_the_single_process_report(sharded_results, case):
    rank0, rank1 = (r["reports"][case] for r in sharded_results)
    assert_identical(rank0["sharded"], rank0["single"])
    assert_identical(rank1["sharded"], rank0["single"])
    if case == "gallery":  # rank 0's share held no query with a relevant item
        assert rank0["single"].n_queries_without_relevant == 31
    # the per-query metrics declared in RetrievalReport.FIELDS, NDCG@k and MRR among them
    report = rank1["sharded"]
    assert set(report.ndcg_at) == set(report.ks) and 0 < report.mrr <= 1
    assert set(report.per_query) >= {"mrr", *(f"ndcg@{k}" for k in report.ks)}


@pytest.mark.parametrize("case", ["loo", "loo_pessimistic", "gallery", "kept_rows"])
def test_two_ranks_give_every_rank_the_single_process_curve(sharded_results, case):
    rank0, rank1 = (r["curves"][case] for r in sharded_results)
    assert_identical(rank0["sharded"], rank0["single"])
    assert_identical(rank1["sharded"], rank0["single"])
    assert (rank0["single"].per_query_precision is None) == (case != "kept_rows")


@pytest.mark.parametrize("case", ["loo", "gallery", "curve"])
def test_two_ranks_shard_the_hamming_evaluation_exactly(sharded_results, case):
    rank0, rank1 = (r["hamming"][case] for r in sharded_results)
    assert_identical(rank0["sharded"], rank0["single"])
    assert_identical(rank1["sharded"], rank0["single"])


def test_an_old_signature_metric_fn_runs_unsharded_with_one_note(sharded_results):
    rank0, rank1 = (r["contract"] for r in sharded_results)
    for entry in (rank0["old"], rank1["old"]):
        assert_identical(entry["sharded"], entry["single"])
        assert_identical(entry["again"], entry["single"])
    assert len(rank0["old_warnings"]) == 1 and rank1["old_warnings"] == []
    assert (
        "old_signature is not marked with rankwise.metrics.query_blocks" in rank0["old_warnings"][0]
    )


def test_an_error_on_one_rank_is_raised_on_every_rank(sharded_results):
    rank0, rank1 = (r["contract"] for r in sharded_results)
    assert re.search(r"failed on other ranks: rank 1: ValueError: rank 1 could not", rank0["error"])
    assert rank1["error"] == "ValueError: rank 1 could not rank its block"
    for entry in (rank0, rank1):
        assert entry["no_relevant"].startswith("ValueError: no query has a relevant item")


VERIFICATION_CASES = [
    "loo/cosine",
    "loo/euclidean",
    "gallery",
    "multi_hot",
    "float",
    "index_array",
    "one_query",
]


@pytest.mark.parametrize("case", VERIFICATION_CASES)
def test_two_ranks_count_the_verification_pairs_exactly(sharded_results, case):
    """ROC AUC / TPR@FPR are pair-level: the ranks' pair counts add up to the one-process counts."""
    rank0, rank1 = (r["verification"][case] for r in sharded_results)
    assert_identical(rank0["sharded"], rank0["single"])
    assert_identical(rank1["sharded"], rank0["single"])
    assert_identical(rank0["sharded"].counts, rank0["single"].counts)
    assert 0 < rank0["single"].roc_auc < 1 and rank0["single"].n_negative_pairs > 0
