"""retrieval_metrics / pr_curve against naive sort-based references written here, brute-force
averages over every ordering of tied items, and the two counting kernels against each other."""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from rankwise.metrics import pr_curve, retrieval_metrics
from rankwise.metrics._kernels import (
    relevant_group_counts_numba,
    relevant_group_counts_torch,
    relevant_lists_from_classes,
)

# ---------------------------------------------------------------- naive references (one ordering)


def metrics_of_ranked_relevance(rel, ks):
    """AP, R@k, P@k, MAP@R, R-precision of one ranked 0/1 relevance list, straight from the
    definitions (Musgrave et al. 2020 for MAP@R and R-precision)."""
    rel = np.asarray(rel, dtype=float)
    R = int(rel.sum())
    cum = np.cumsum(rel)
    prec = cum / np.arange(1, len(rel) + 1)
    out = {
        "ap": float((prec * rel).sum() / R),
        "map_at_r": float((prec[:R] * rel[:R]).sum() / R),
        "r_precision": float(rel[:R].sum() / R),
    }
    for k in ks:
        out[f"R@{k}"] = float(rel[:k].any())
        out[f"P@{k}"] = float(rel[:k].sum() / k)
    return out


def naive_retrieval(scores, relevant, self_index, ks, order_fn=None):
    """Per-query naive metrics. ``order_fn(scores_row, rel_row)`` returns a list of orderings to
    average over (default: the unique stable descending sort)."""
    per_query = []
    for i in range(scores.shape[0]):
        keep = np.ones(scores.shape[1], dtype=bool)
        if self_index is not None and self_index[i] >= 0:
            keep[self_index[i]] = False
        s, r = scores[i, keep], relevant[i, keep]
        if not r.any():
            per_query.append(None)
            continue
        orders = [np.argsort(-s, kind="stable")] if order_fn is None else order_fn(s, r)
        runs = [metrics_of_ranked_relevance(r[o], ks) for o in orders]
        per_query.append({key: float(np.mean([m[key] for m in runs])) for key in runs[0]})
    return per_query


def all_tie_orderings(s, r):
    values = sorted(set(s.tolist()), reverse=True)
    groups = [[i for i in range(len(s)) if s[i] == v] for v in values]
    return [
        np.array([i for part in parts for i in part])
        for parts in itertools.product(*(itertools.permutations(g) for g in groups))
    ]


def assert_report_matches(report, per_query, ks):
    valid = [m for m in per_query if m is not None]
    assert report.n_queries_without_relevant == len(per_query) - len(valid)
    assert report.map == pytest.approx(np.mean([m["ap"] for m in valid]), abs=1e-12)
    assert report.map_at_r == pytest.approx(np.mean([m["map_at_r"] for m in valid]), abs=1e-12)
    assert report.r_precision == pytest.approx(
        np.mean([m["r_precision"] for m in valid]), abs=1e-12
    )
    for k in ks:
        assert report.recall_at[k] == pytest.approx(
            np.mean([m[f"R@{k}"] for m in valid]), abs=1e-12
        )
        assert report.precision_at[k] == pytest.approx(
            np.mean([m[f"P@{k}"] for m in valid]), abs=1e-12
        )
    ap = report.per_query_ap.numpy()
    for q, m in enumerate(per_query):
        if m is None:
            assert np.isnan(ap[q])
        else:
            assert ap[q] == pytest.approx(m["ap"], abs=1e-12)


def cosine(a, b):
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return a @ b.T


# ------------------------------------------------------------------------------------ tie-free


def test_leave_one_out_matches_naive_reference_without_ties(device):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 6))
    y = rng.integers(0, 12, size=120)
    y[0] = 99  # a query whose class appears nowhere else: counted, not averaged
    ks = (1, 5, 20)
    report = retrieval_metrics(
        torch.tensor(x, device=device), torch.tensor(y, device=device), ks=ks
    )
    naive = naive_retrieval(cosine(x, x), y[:, None] == y[None, :], np.arange(120), ks)
    assert report.n_queries == 120 and report.n_gallery == 120
    assert report.n_queries_without_relevant == 1
    assert_report_matches(report, naive, ks)
    for ties in ("optimistic", "pessimistic"):  # no ties: every mode is the same number
        other = retrieval_metrics(x, y, ks=ks, ties=ties)
        assert other.map == report.map and other.recall_at == report.recall_at
        assert other.map_at_r == report.map_at_r


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_distinct_gallery_matches_naive_reference(similarity):
    rng = np.random.default_rng(1)
    q, g = rng.normal(size=(40, 5)), rng.normal(size=(150, 5))
    ql, gl = rng.integers(0, 8, size=40), rng.integers(0, 8, size=150)
    scores = {
        "cosine": cosine(q, g),
        "dot": q @ g.T,
        "euclidean": -((q[:, None, :] - g[None, :, :]) ** 2).sum(-1),
    }[similarity]
    ks = (1, 3, 150)
    report = retrieval_metrics(q, ql, g, gl, ks=ks, similarity=similarity)
    assert_report_matches(report, naive_retrieval(scores, ql[:, None] == gl[None, :], None, ks), ks)


def test_multi_hot_labels_relevant_when_any_label_is_shared():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(60, 4))
    y = (rng.random((60, 5)) < 0.25).astype(np.int64)
    ks = (1, 10)
    report = retrieval_metrics(x, y, ks=ks)
    shared = np.array([[bool((y[i] & y[j]).any()) for j in range(60)] for i in range(60)])
    assert_report_matches(report, naive_retrieval(cosine(x, x), shared, np.arange(60), ks), ks)
    assert report.n_queries_without_relevant == int(
        (~(shared & ~np.eye(60, dtype=bool)).any(1)).sum()
    )


# ----------------------------------------------------------------------------------- with ties


@pytest.mark.parametrize("ties", ["expected", "optimistic", "pessimistic"])
def test_tie_aware_metrics_equal_brute_force_over_tie_orderings(ties):
    rng = np.random.default_rng(3)
    ks = (1, 2, 4)
    for trial in range(6):
        n = 7
        x = rng.integers(-1, 2, size=(n, 2)).astype(np.float64)  # integer dot scores: many ties
        y = rng.integers(0, 2 + trial % 2, size=n)
        scores = x @ x.T
        relevant = y[:, None] == y[None, :]
        if ties == "expected":
            order_fn = all_tie_orderings
        else:
            sign = -1 if ties == "optimistic" else 1

            def order_fn(s, r, sign=sign):  # noqa: E306 - explicit tie break, relevance second
                return [np.lexsort((sign * r.astype(int), -s))]

        naive = naive_retrieval(scores, relevant, np.arange(n), ks, order_fn)
        if all(m is None for m in naive):
            continue
        report = retrieval_metrics(x, y, ks=ks, similarity="dot", ties=ties)
        assert_report_matches(report, naive, ks)


def test_recall_at_k_boundary_tie_closed_form():
    # one query; gallery: 1 irrelevant strictly above, then a tie of 4 with 1 relevant
    query = np.array([[1.0, 0.0]])
    gallery = np.array([[2.0, 0.0], [1.0, 5.0], [1.0, -5.0], [1.0, 1.0], [1.0, 2.0], [0.0, 1.0]])
    labels = np.array([0, 0, 0, 0, 1, 1])
    report = retrieval_metrics(query, [1], gallery, labels, ks=(1, 2, 3, 5), similarity="dot")
    # 1 - C(n - r, k - g) / C(n, k - g) with g = 1, n = 4, r = 1
    assert report.recall_at[1] == 0.0
    assert report.recall_at[2] == pytest.approx(1 - 3 / 4)
    assert report.recall_at[3] == pytest.approx(1 - 3 / 6)
    assert report.recall_at[5] == 1.0


def exact_cosine_ranks(a, b):
    """Cosine similarities of every (a_i, b_j) in exact rational arithmetic, replaced by their rank
    among all distinct values: equal cosines get equal numbers, the order is kept. (A float32
    BLAS cosine is no oracle: it rounds duplicated rows differently depending on their position.)
    """
    af = [[Fraction(float(v)) for v in row] for row in a]
    bf = [[Fraction(float(v)) for v in row] for row in b]

    def key(u, v):  # cos * |cos| = dot |dot| / (|u|^2 |v|^2), exact and monotone in cos
        d = sum(p * q for p, q in zip(u, v, strict=True))
        return d * abs(d) / (sum(p * p for p in u) * sum(q * q for q in v))

    keys = [[key(u, v) for v in bf] for u in af]
    rank = {k: r for r, k in enumerate(sorted({k for row in keys for k in row}))}
    return np.array([[float(rank[k]) for k in row] for row in keys])


def test_float16_embeddings_keep_their_ties():
    rng = np.random.default_rng(4)
    base = rng.normal(size=(30, 8)).astype(np.float16)
    x = np.concatenate([base, base[:10]])  # exact duplicates: tied scores with every query
    y = rng.integers(0, 5, size=40)
    ks = (1, 5)
    report = retrieval_metrics(torch.tensor(x), y, ks=ks)
    scores = exact_cosine_ranks(x, x)
    assert (scores[:, :10] == scores[:, 30:]).all()
    naive = naive_retrieval(
        scores,
        y[:, None] == y[None, :],
        np.arange(40),
        ks,
        lambda s, r: [np.lexsort((-r.astype(int), -s))],
    )
    optimistic = retrieval_metrics(torch.tensor(x), y, ks=ks, ties="optimistic")
    assert_report_matches(optimistic, naive, ks)
    assert report.map < optimistic.map  # the duplicates really tie


# ------------------------------------------------------------------- implementation invariance


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numba_bucket_table_binary_search_and_torch_path_give_identical_counts(dtype):
    rng = np.random.default_rng(5)
    scores = rng.integers(0, 6, size=(25, 80)).astype(dtype)
    relevant = rng.random((25, 80)) < np.linspace(0.0, 0.6, 25)[:, None]
    self_index = rng.integers(-1, 80, size=25)
    a = relevant_group_counts_numba(scores, relevant, self_index)
    b = relevant_group_counts_numba(scores, relevant, self_index, buckets_per_value=0)
    c = relevant_group_counts_torch(
        torch.tensor(scores), torch.tensor(relevant), torch.tensor(self_index)
    )
    for other in (b, c):
        for field in ("n_groups", "greater", "size", "relevant"):
            np.testing.assert_array_equal(getattr(a, field), getattr(other, field))
    # and the counts are right: brute force for one row
    i = 7
    keep = np.arange(80) != self_index[i]
    s, r = scores[i, keep], relevant[i, keep]
    values = sorted(set(s[r].tolist()), reverse=True)
    start = a.offsets()[i]
    for j, v in enumerate(values):
        assert a.greater[start + j] == (s > v).sum()
        assert a.size[start + j] == (s == v).sum()
        assert a.relevant[start + j] == (r & (s == v)).sum()


def brute_force_group_counts(scores, relevant, self_index):
    """(n_groups, greater, size, relevant) straight from the definition, one row at a time."""
    n_groups, greater, size, n_rel = [], [], [], []
    for i in range(scores.shape[0]):
        keep = np.arange(scores.shape[1]) != self_index[i]
        s, r = scores[i, keep], relevant[i, keep]
        values = sorted(set(s[r].tolist()), reverse=True)
        n_groups.append(len(values))
        for v in values:
            greater.append(int((s > v).sum()))
            size.append(int((s == v).sum()))
            n_rel.append(int((r & (s == v)).sum()))
    return [np.array(x, dtype=np.int64) for x in (n_groups, greater, size, n_rel)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_many_relevant_items_with_ties_and_outliers_count_exactly_on_every_path(dtype):
    # Rows with 10-90 % relevant items, heavy ties, values packed near the bucket edges and far
    # outliers (one bucket then holds almost every value), plus signed zeros and subnormal spreads.
    rng = np.random.default_rng(11)
    n_rows, n_items = 12, 400
    scores = np.round(rng.normal(size=(n_rows, n_items)), 2).astype(dtype)
    scores[1] = rng.integers(0, 3, size=n_items)  # three values only
    scores[2, :5] = [1e6, -1e6, 1e-3, -1e-3, 0.0]  # outliers stretch the table
    scores[3] = np.where(rng.random(n_items) < 0.5, 0.0, -0.0)  # every item tied (+0 == -0)
    tiny = np.finfo(dtype).smallest_subnormal
    scores[4] = rng.integers(-3, 4, size=n_items) * tiny  # a value span of a few subnormals
    scores[5] = np.linspace(-1, 1, n_items).astype(dtype)  # all distinct, evenly spread
    relevant = rng.random((n_rows, n_items)) < np.linspace(0.1, 0.9, n_rows)[:, None]
    relevant[6] = True  # every item relevant
    relevant[7] = False  # none
    self_index = rng.integers(-1, n_items, size=n_rows)
    expected = brute_force_group_counts(scores, relevant, self_index)
    torch_counts = relevant_group_counts_torch(
        torch.tensor(scores), torch.tensor(relevant), torch.tensor(self_index)
    )
    paths = [
        relevant_group_counts_numba(scores, relevant, self_index, buckets_per_value=b)
        for b in (0, 1, 4, 64)
    ]
    for counts in [torch_counts, *paths]:
        for name, want in zip(("n_groups", "greater", "size", "relevant"), expected, strict=True):
            np.testing.assert_array_equal(getattr(counts, name), want, err_msg=name)


def test_class_member_lists_equal_the_relevance_mask():
    rng = np.random.default_rng(12)
    gallery_labels = rng.integers(0, 7, size=60)
    query_labels = rng.integers(0, 9, size=20)  # classes 7 and 8 are absent from the gallery
    self_index = rng.integers(-1, 60, size=20)
    classes = np.unique(gallery_labels)
    members = np.argsort(np.searchsorted(classes, gallery_labels), kind="stable")
    class_ptr = np.concatenate([[0], np.cumsum(np.bincount(gallery_labels, minlength=7))])
    query_class = np.where(np.isin(query_labels, classes), query_labels, -1)
    rel_ptr, rel_cols = relevant_lists_from_classes(query_class, class_ptr, members, self_index)
    for i in range(20):
        want = [j for j in range(60) if gallery_labels[j] == query_labels[i] and j != self_index[i]]
        assert sorted(rel_cols[rel_ptr[i] : rel_ptr[i + 1]].tolist()) == want


def test_negative_buckets_per_value_raises():
    with pytest.raises(ValueError, match="buckets_per_value"):
        relevant_group_counts_numba(
            np.zeros((1, 3)), np.ones((1, 3), dtype=bool), buckets_per_value=-1
        )


def test_numba_and_torch_backends_and_chunk_sizes_agree_exactly():
    # integer embeddings with dot scores are exact in float32, so every chunking scores alike
    rng = np.random.default_rng(6)
    x = rng.integers(-2, 3, size=(90, 3)).astype(np.float32)
    y = rng.integers(0, 6, size=90)
    ref = retrieval_metrics(x, y, ks=(1, 7), similarity="dot", backend="numba")
    assert ref.map != retrieval_metrics(x, y, similarity="dot", ties="optimistic").map
    for backend, chunk in (("torch", None), ("numba", 1), ("numba", 13), ("torch", 7)):
        other = retrieval_metrics(
            x, y, ks=(1, 7), similarity="dot", backend=backend, chunk_size=chunk
        )
        assert other.to_dict() == ref.to_dict()
    # cosine scores: a last chunk of a single row is scored like the others (no gemv rounding)
    cos_ref = retrieval_metrics(x, y, backend="numba")
    for backend, chunk in (("numba", 89), ("torch", 89), ("torch", None)):
        assert (
            retrieval_metrics(x, y, backend=backend, chunk_size=chunk).to_dict()
            == cos_ref.to_dict()
        )


def test_exclude_self_with_explicit_gallery_equals_leave_one_out():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(50, 4))
    y = rng.integers(0, 5, size=50)
    loo = retrieval_metrics(x, y)
    explicit = retrieval_metrics(x, y, x, y, exclude_self=True)
    index = retrieval_metrics(x[:20], y[:20], x, y, exclude_self=np.arange(20))
    assert explicit.to_dict() == loo.to_dict()
    np.testing.assert_array_equal(index.per_query_ap.numpy(), loo.per_query_ap.numpy()[:20])
    kept = retrieval_metrics(x, y, x, y)  # no exclusion: each query finds itself first
    assert kept.recall_at[1] == 1.0


# ---------------------------------------------------------------------------------- reporting


def test_report_counts_clamps_and_serialises():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(12, 3))
    y = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 6, 6])
    report = retrieval_metrics(x, y, ks=(1, 11, 50))
    assert report.n_queries_without_relevant == 2
    assert report.ks == (1, 11, 50) and report.clamped_ks == {50: 11}
    assert report.recall_at[50] == report.recall_at[11] == 1.0
    assert report.precision_at[50] == report.precision_at[11]
    json.dumps(report.to_dict())
    text = str(report)
    assert "2 queries without any relevant" in text and "k=50" in text


def test_printed_report_uses_the_command_lines_names():
    # `rankwise evaluate` and `rankwise train` say mAP / recall@k / precision@k; print(report)
    # said MAP / R@k / P@k (and MAP reads as MAP@R's abbreviation)
    y = np.repeat(np.arange(4), 3)
    report = retrieval_metrics(np.random.default_rng(0).normal(size=(12, 3)), y, ks=(1, 5))
    names = [line.split()[0] for line in str(report).splitlines()[1:]]
    assert names == [
        "mAP",
        "recall@1",
        "recall@5",
        "precision@1",
        "precision@5",
        "MAP@R",
        "R-precision",
        "NDCG@1",
        "NDCG@5",
        "MRR",
    ]


# ----------------------------------------------------------------------------------- PR curve


def naive_pr_curve(scores, relevant, self_index, num_points, order=None):
    levels = np.linspace(0, 1, num_points)
    curves = []
    for i in range(scores.shape[0]):
        keep = np.ones(scores.shape[1], dtype=bool)
        if self_index is not None:
            keep[self_index[i]] = False
        s, r = scores[i, keep], relevant[i, keep]
        if not r.any():
            continue
        o = np.argsort(-s, kind="stable") if order is None else order(s, r)
        rr = r[o]
        prec = np.cumsum(rr) / np.arange(1, len(rr) + 1)
        rec = np.cumsum(rr) / rr.sum()
        curves.append([prec[(rec >= lv - 1e-12)].max() for lv in levels])
    return np.mean(curves, axis=0), len(curves)


def test_pr_curve_matches_naive_interpolated_precision(device):
    rng = np.random.default_rng(9)
    x = rng.normal(size=(70, 4))
    y = rng.integers(0, 7, size=70)
    curve = pr_curve(
        torch.tensor(x, device=device), torch.tensor(y, device=device), num_points=11, chunk_size=16
    )
    want, n = naive_pr_curve(cosine(x, x), y[:, None] == y[None, :], np.arange(70), 11)
    assert curve.n_queries == n
    np.testing.assert_allclose(curve.recall, np.linspace(0, 1, 11))
    np.testing.assert_allclose(curve.precision, want, atol=1e-12)
    # with ties, optimistic / pessimistic are the explicit orders
    xi = rng.integers(-1, 2, size=(40, 2)).astype(float)
    yi = rng.integers(0, 3, size=40)
    for ties, sign in (("optimistic", -1), ("pessimistic", 1)):
        got = pr_curve(xi, yi, similarity="dot", ties=ties, num_points=7)
        want, _ = naive_pr_curve(
            xi @ xi.T,
            yi[:, None] == yi[None, :],
            np.arange(40),
            7,
            lambda s, r, sign=sign: np.lexsort((sign * r.astype(int), -s)),
        )
        np.testing.assert_allclose(got.precision, want, atol=1e-12)


def test_pr_curve_expected_uses_expected_positions():
    # one query, a tie of 3 items holding 1 relevant at the top: expected position 2, precision 1/2
    query = np.array([[1.0]])
    gallery = np.array([[1.0], [1.0], [1.0], [0.5]])
    curve = pr_curve(query, [0], gallery, [0, 1, 1, 1], similarity="dot", num_points=3)
    np.testing.assert_allclose(curve.precision, [0.5, 0.5, 0.5])


# ------------------------------------------------------------------------------------ bad input


GOOD_X = np.random.default_rng(10).normal(size=(6, 3))
GOOD_Y = np.array([0, 0, 1, 1, 2, 2])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"query": np.full((6, 3), np.nan)}, "query"),
        ({"query": np.where(np.eye(6, 3) > 0, np.inf, GOOD_X)}, "query"),
        ({"query_labels": GOOD_Y[:5]}, "query_labels"),
        ({"query_labels": GOOD_Y + 0.5}, "query_labels"),
        ({"query_labels": np.eye(6, dtype=np.int64) * 2}, "query_labels"),
        ({"gallery": np.zeros((0, 3)), "gallery_labels": np.zeros(0, dtype=int)}, "gallery"),
        ({"gallery": GOOD_X[:, :2], "gallery_labels": GOOD_Y}, "gallery"),
        ({"gallery": GOOD_X, "gallery_labels": np.eye(6, dtype=int)}, "gallery_labels"),
        ({"gallery": GOOD_X}, "gallery_labels"),
        ({"ties": "random"}, "ties"),
        ({"similarity": "manhattan"}, "similarity"),
        ({"ks": (0, 5)}, "ks"),
        ({"ks": (1.5,)}, "ks"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"query": GOOD_X[:1], "query_labels": GOOD_Y[:1]}, "gallery"),
        ({"query_labels": np.arange(6)}, "query_labels"),
        (
            {"gallery": GOOD_X[:3], "gallery_labels": GOOD_Y[:3], "exclude_self": True},
            "exclude_self",
        ),
    ],
)
def test_bad_input_raises_value_error_naming_the_argument(kwargs, match):
    args = {"query": GOOD_X, "query_labels": GOOD_Y, **kwargs}
    with pytest.raises(ValueError, match=match):
        retrieval_metrics(**args)


def test_one_hot_multi_hot_labels_equal_class_ids_and_absent_classes_are_counted():
    # class ids take the class-list kernel input, multi-hot the mask input: same numbers
    rng = np.random.default_rng(11)
    q, g = rng.normal(size=(30, 4)), rng.normal(size=(80, 4))
    ql, gl = rng.integers(0, 6, size=30), rng.integers(0, 5, size=80)  # class 5: no gallery item
    by_id = retrieval_metrics(q, ql, g, gl, ks=(1, 5))
    by_hot = retrieval_metrics(q, np.eye(6, dtype=int)[ql], g, np.eye(6, dtype=int)[gl], ks=(1, 5))
    assert by_id.to_dict() == by_hot.to_dict()
    assert by_id.n_queries_without_relevant == int((ql == 5).sum()) > 0


def test_embeddings_that_require_grad_are_accepted():
    x = torch.randn(20, 3, requires_grad=True)
    y = torch.arange(20) % 4
    report = retrieval_metrics(x, y)
    assert 0.0 < report.map <= 1.0


def test_exclude_self_index_array_clamps_each_query_to_its_own_list_length():
    # Query 0 keeps its 3-item list (-1), query 1 loses gallery row 0 (2 items). k = 3 is within
    # query 0's list, so its P@3 is 1/3 (one relevant item in all three), not P@2 = 1/2.
    gallery = torch.tensor([[3.0], [2.0], [1.0]])
    gallery_labels = torch.tensor([0, 1, 1])
    query = torch.tensor([[1.0], [1.0]])
    query_labels = torch.tensor([0, 1])
    report = retrieval_metrics(
        query,
        query_labels,
        gallery,
        gallery_labels,
        ks=(3,),
        similarity="dot",
        exclude_self=np.array([-1, 0]),
    )
    # by hand: query 0 ranks [0 (rel), 1, 2] -> P@3 = 1/3; query 1 ranks [1 (rel), 2 (rel)] -> 1
    assert report.precision_at[3] == pytest.approx((1 / 3 + 1.0) / 2)
    assert report.recall_at[3] == pytest.approx(1.0)
    assert report.clamped_ks == {3: 2}
