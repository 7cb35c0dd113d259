"""Tie-aware NDCG@k and MRR of the retrieval report (issue 37 item 8).

Brute force: every ordering of the tied items enumerated (the product of the permutations of each
tie group) and the metric averaged exactly (fractions), against both backends; scikit-learn's
``ndcg_score(..., ignore_ties=False)`` for the tie-averaged NDCG; the closed form of the expected
reciprocal rank when nothing lies above the tie; the two backends bit for bit; query blocks merged
against the one call; the names a monitor selects by. The 2-rank form is in
tests/metrics/sharded_worker.py (every field of the report, these included).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from sharded_worker import assert_identical  # tests/metrics is on sys.path (conftest)

from rankwise.metrics import RetrievalReport, merge_retrieval_reports, retrieval_metrics
from rankwise.metrics.ranking import discount_table, reciprocal_rank

KS = (1, 2, 3, 5, 9)


def orderings(scores: list[int]):
    """Every ranking (item indices, best first) of ``scores``, ties in every order."""
    values = sorted(set(scores), reverse=True)
    groups = [[i for i, s in enumerate(scores) if s == v] for v in values]
    for parts in itertools.product(*(itertools.permutations(g) for g in groups)):
        yield [i for part in parts for i in part]


def discount(t: int) -> float:
    return 1.0 / math.log2(t + 1)


def brute_force(scores: list[int], relevant: list[bool], ks, ties: str = "expected"):
    """{"ndcg@k": ..., "mrr": ...} of one query, averaged over every ordering of its ties (or the
    best / worst ordering for optimistic / pessimistic)."""
    n_rel = sum(relevant)
    values: dict[str, list[float]] = {f"ndcg@{k}": [] for k in ks}
    values["mrr"] = []
    for order in orderings(scores):
        rel = [relevant[i] for i in order]
        for k in ks:
            dcg = math.fsum(discount(t + 1) for t in range(min(k, len(rel))) if rel[t])
            ideal = math.fsum(discount(t + 1) for t in range(min(k, n_rel)))
            values[f"ndcg@{k}"].append(dcg / ideal)
        values["mrr"].append(1.0 / (rel.index(True) + 1))
    if ties == "optimistic":
        return {name: max(v) for name, v in values.items()}
    if ties == "pessimistic":
        return {name: min(v) for name, v in values.items()}
    return {name: float(sum(Fraction(x) for x in v) / len(v)) for name, v in values.items()}


def one_list_problem(seed: int, n: int):
    """Gallery scores with many ties (1-D embeddings, dot similarity: score = value) and classes;
    queries [1.0] / [-1.0] of every class (the ranking and its reverse)."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 3, n)
    classes = rng.integers(0, 3, n)
    query = torch.tensor([[1.0]] * 3 + [[-1.0]] * 3, dtype=torch.float64)
    query_labels = torch.tensor([0, 1, 2, 0, 1, 2])
    gallery = torch.tensor(values, dtype=torch.float64)[:, None]
    return query, query_labels, gallery, torch.from_numpy(classes), values, classes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("ties", ["expected", "optimistic", "pessimistic"])
def test_ndcg_and_mrr_equal_the_average_over_every_ordering_of_the_ties(seed, ties):
    n = 7
    query, query_labels, gallery, gallery_labels, values, classes = one_list_problem(seed, n)
    reports = {
        backend: retrieval_metrics(
            query,
            query_labels,
            gallery,
            gallery_labels,
            ks=KS,
            similarity="dot",
            ties=ties,
            backend=backend,
        )
        for backend in ("numba", "torch")
    }
    checked = 0
    for q in range(query.shape[0]):
        sign = int(query[q, 0])
        scores = [sign * int(v) for v in values]
        relevant = [bool(c == int(query_labels[q])) for c in classes]
        for report in reports.values():
            if not any(relevant):
                assert math.isnan(report.per_query["mrr"][q])
                continue
            expected = brute_force(scores, relevant, KS, ties)
            for name, value in expected.items():
                assert float(report.per_query[name][q]) == pytest.approx(value, rel=1e-13, abs=0)
            checked += 1
    assert checked >= 6
    for report in reports.values():  # the means over the queries with a relevant item
        per_query = {name: values.numpy() for name, values in report.per_query.items()}
        valid = ~np.isnan(per_query["mrr"])
        assert report.mrr == float(per_query["mrr"][valid].mean())
        assert report.ndcg_at == {k: float(per_query[f"ndcg@{k}"][valid].mean()) for k in KS}


def test_a_tie_straddling_the_cutoff_counts_its_positions_up_to_k():
    # ranked: 1 irrelevant above, then a tie of 4 items holding 2 relevant ones (positions 2-5)
    query = torch.tensor([[1.0]], dtype=torch.float64)
    gallery = torch.tensor([[2.0], [1.0], [1.0], [1.0], [1.0]], dtype=torch.float64)
    labels = torch.tensor([1, 0, 0, 1, 1])
    report = retrieval_metrics(query, torch.tensor([0]), gallery, labels, ks=(3,), similarity="dot")
    # E[DCG@3] = (2 / 4) (D(2) + D(3)); IDCG@3 = D(1) + D(2)
    ndcg = 0.5 * (discount(2) + discount(3)) / (discount(1) + discount(2))
    assert report.ndcg_at[3] == pytest.approx(ndcg, rel=1e-15)
    # first relevant at 1 + J, P(J = j) = C(4 - j, 1) / C(4, 2) = 3/6, 2/6, 1/6
    assert report.mrr == pytest.approx(3 / 6 / 2 + 2 / 6 / 3 + 1 / 6 / 4, rel=1e-15)


@pytest.mark.parametrize("seed", range(4))
def test_ndcg_matches_scikit_learn_tie_averaged_ndcg(seed):
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(100 + seed)
    n = 30
    gallery = torch.from_numpy(rng.integers(0, 5, (n, 1)).astype(np.float64))
    gallery_labels = torch.from_numpy(rng.integers(0, 3, n))
    query = torch.tensor([[1.0], [-1.0], [1.0]], dtype=torch.float64)
    query_labels = torch.tensor([0, 1, 2])
    report = retrieval_metrics(
        query, query_labels, gallery, gallery_labels, ks=(1, 4, 10, 30), similarity="dot"
    )
    for q in range(3):
        y_true = (gallery_labels == query_labels[q]).to(torch.float64).numpy()[None]
        y_score = (query[q, 0] * gallery[:, 0]).numpy()[None]
        for k in (1, 4, 10, 30):
            ours = float(report.per_query[f"ndcg@{k}"][q])
            theirs = sklearn_metrics.ndcg_score(y_true, y_score, k=k, ignore_ties=False)
            assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)


def harmonic(n: int) -> Fraction:
    return sum((Fraction(1, i) for i in range(1, n + 1)), Fraction(0))


@pytest.mark.parametrize(("n", "r"), [(1, 1), (2, 1), (5, 2), (40, 3), (300, 1), (300, 299)])
def test_expected_reciprocal_rank_of_a_tie_at_the_top_has_the_harmonic_closed_form(n, r):
    # nothing above the tie: E[1/J] = r / (n - r + 1) (H(n) - H(r - 1)), exactly
    exact = Fraction(r, n - r + 1) * (harmonic(n) - harmonic(r - 1))
    value = reciprocal_rank(np.array([0]), np.array([n]), np.array([r]), "expected")[0]
    assert abs(Fraction(float(value)) - exact) <= exact * Fraction(2, 2**53)


def test_expected_reciprocal_rank_below_items_is_the_exact_sum_to_an_ulp():
    g, n, r = 1000, 2000, 3
    exact = sum(
        Fraction(math.comb(n - j, r - 1), math.comb(n, r)) / (g + j) for j in range(1, n - r + 2)
    )
    value = reciprocal_rank(np.array([g]), np.array([n]), np.array([r]), "expected")[0]
    assert abs(Fraction(float(value)) - exact) <= exact * Fraction(2, 2**53)
    # optimistic / pessimistic: the first relevant item first / last possible in the tie
    assert reciprocal_rank(np.array([g]), np.array([n]), np.array([r]), "optimistic")[0] == 1 / 1001
    assert (
        reciprocal_rank(np.array([g]), np.array([n]), np.array([r]), "pessimistic")[0] == 1 / 2998
    )


def test_discount_table_holds_the_cumulative_discounts():
    table = discount_table(1000)
    exact = math.fsum(discount(t) for t in range(1, 1001))
    assert table[1000, 0] + table[1000, 1] == pytest.approx(exact, rel=2e-16)
    assert table[1, 0] == 1.0 and table[0, 0] == 0.0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtypes and values bit for bit, NaN (no relevant item) equal to NaN."""
    return a.dtype == b.dtype and np.array_equal(a.numpy(), b.numpy(), equal_nan=True)


def tied_embeddings(n: int, seed: int, dim: int = 3):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (n, dim), generator=generator).to(torch.float32)
    return x, torch.randint(0, 4, (n,), generator=generator)


@pytest.mark.parametrize("similarity", ["dot", "cosine", "euclidean"])
@pytest.mark.parametrize("ties", ["expected", "optimistic", "pessimistic"])
def test_both_backends_give_the_same_bits(similarity, ties):
    x, y = tied_embeddings(90, 1)
    x[40:50] = x[0]  # exact duplicates: near-tied pairs for the torch path's exact-key pass
    kwargs = dict(ks=(1, 4, 30, 200), similarity=similarity, ties=ties)
    numba = retrieval_metrics(x, y, backend="numba", **kwargs)
    device = retrieval_metrics(x, y, backend="torch", chunk_size=16, **kwargs)
    for name in ("mrr", *(f"ndcg@{k}" for k in kwargs["ks"])):
        assert same_bits(numba.per_query[name], device.per_query[name]), name
    assert numba.ndcg_at == device.ndcg_at and numba.mrr == device.mrr


def test_both_backends_give_the_same_bits_with_multi_hot_labels_and_a_gallery():
    x, _ = tied_embeddings(60, 2)
    hot = (torch.rand(60, 5, generator=torch.Generator().manual_seed(3)) < 0.3).to(torch.int64)
    kwargs = dict(ks=(1, 2, 7), similarity="dot")
    numba = retrieval_metrics(x[:20], hot[:20], x[20:], hot[20:], backend="numba", **kwargs)
    device = retrieval_metrics(x[:20], hot[:20], x[20:], hot[20:], backend="torch", **kwargs)
    for name in ("mrr", "ndcg@1", "ndcg@2", "ndcg@7"):
        assert same_bits(numba.per_query[name], device.per_query[name]), name


def test_query_blocks_merge_to_the_one_call_bit_for_bit():
    x, y = tied_embeddings(101, 4)
    single = retrieval_metrics(x, y, ks=(1, 5, 100))
    rows = (np.arange(0, 33), np.arange(33, 34), np.arange(34, 101))
    parts = [retrieval_metrics(x[r], y[r], x, y, ks=(1, 5, 100), exclude_self=r) for r in rows]
    merged = merge_retrieval_reports(parts)
    assert merged.ndcg_at == single.ndcg_at and merged.mrr == single.mrr
    assert_identical(merged, single)


def test_the_report_names_them_for_monitors_json_and_the_table():
    x, y = tied_embeddings(50, 5)
    report = retrieval_metrics(x, y, ks=(1, 10))
    scalars = report.scalars()
    assert scalars["ndcg@10"] == report.ndcg_at[10] and scalars["mrr"] == report.mrr
    assert list(scalars)[-3:] == ["ndcg@1", "ndcg@10", "mrr"]
    data = report.to_dict()
    assert data["ndcg_at"] == {"1": report.ndcg_at[1], "10": report.ndcg_at[10]}
    assert data["mrr"] == report.mrr
    assert_identical(RetrievalReport.from_dict(data), dataclasses.replace(report, per_query={}))
    assert [name for name, _ in report.rows()][-3:] == ["NDCG@1", "NDCG@10", "MRR"]
    assert "NDCG@10" in str(report) and "MRR" in str(report)
    # a report.json written before the fields existed still loads (their defaults)
    old = {key: value for key, value in data.items() if key not in ("ndcg_at", "mrr")}
    loaded = RetrievalReport.from_dict(old)
    assert loaded.ndcg_at == {} and math.isnan(loaded.mrr) and loaded.map == report.map


def test_ndcg_at_1_is_precision_at_1_and_a_perfect_ranking_scores_one():
    x, y = tied_embeddings(70, 6)
    report = retrieval_metrics(x, y, ks=(1, 3))
    assert torch.allclose(
        report.per_query["ndcg@1"], report.per_query["precision@1"], equal_nan=True
    )
    perfect = torch.eye(3)[torch.tensor([0, 0, 1, 1, 2, 2])]
    ideal = retrieval_metrics(perfect, torch.tensor([0, 0, 1, 1, 2, 2]), ks=(1, 3))
    assert ideal.mrr == 1.0 and ideal.ndcg_at == {1: 1.0, 3: 1.0}


def test_hamming_reports_carry_the_same_mrr_and_ndcg_for_label_affinity():
    from rankwise.metrics import hamming_retrieval_metrics

    generator = torch.Generator().manual_seed(9)
    codes = torch.sign(torch.randn(120, 6, generator=generator))  # 7 distances: heavy ties
    labels = torch.randint(0, 4, (120,), generator=generator)
    hamming = hamming_retrieval_metrics(codes, labels, ks=(1, 5, 30))
    dot = retrieval_metrics(codes, labels, ks=(1, 5, 30), similarity="dot")
    assert hamming.mrr == dot.mrr  # the same tie groups, the same host function
    for k in (1, 5, 30):  # the graded NDCG of the Hamming report, binary for label affinity
        assert hamming.ndcg_at[k] == pytest.approx(dot.ndcg_at[k], rel=1e-12)
    assert hamming.scalars()["mrr"] == hamming.mrr and "map@5" in hamming.scalars()


def test_a_saved_run_result_reads_ndcg_and_mrr_back(tmp_path):
    from rankwise.metrics import pr_curve
    from rankwise.training import RunResult

    x, y = tied_embeddings(40, 7)
    report, curve = retrieval_metrics(x, y, ks=(1, 5)), pr_curve(x, y)
    RunResult(tmp_path, "completed", 3, 0.1, 3, {"map": report.map}, report, curve).save(tmp_path)
    loaded = RunResult.load(tmp_path)
    assert loaded is not None and loaded.test is not None
    assert loaded.test.ndcg_at == report.ndcg_at and loaded.test.mrr == report.mrr
    assert loaded.test.scalars() == report.scalars()
