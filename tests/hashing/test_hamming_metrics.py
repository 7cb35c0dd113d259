"""hamming_retrieval_metrics (counting sort over Hamming distances, TALR Prop. 1 / App. A) against
brute force over every ordering of the tied items, against retrieval_metrics on the same codes, and
its affinities and error messages."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwise.hashing import pack_codes
from rankwise.metrics import (
    EuclideanThresholdAffinity,
    HammingRetrievalReport,
    RetrievalReport,
    hamming_retrieval_metrics,
    retrieval_metrics,
)
from rankwise.metrics.hamming import cumulative_discount, ndcg_from_histograms


def random_codes(n, bits, seed=0):
    return np.random.default_rng(seed).choice(np.array([-1, 1], dtype=np.int8), size=(n, bits))


def tie_orderings(distances):
    """Every ranking of the items consistent with increasing distance."""
    groups = [np.flatnonzero(distances == d).tolist() for d in np.unique(distances)]
    for parts in itertools.product(*(itertools.permutations(g) for g in groups)):
        yield [i for part in parts for i in part]


def ap_at(order, relevant, k):
    """(1/N+) sum_{t <= k} rel(t) P(t): AP for k = len(order), TALR App. A Eq. 15 otherwise."""
    hits, total = 0, 0.0
    for t, i in enumerate(order, start=1):
        if relevant[i]:
            hits += 1
            if t <= k:
                total += hits / t
    return total / hits


def ndcg_at(order, affinity, k):
    gains = 2.0 ** np.asarray(affinity, dtype=np.float64) - 1
    discount = [1 / math.log2(t + 1) for t in range(1, len(order) + 1)]
    dcg = sum(gains[i] * discount[t] for t, i in enumerate(order[:k]))
    ideal = sum(g * d for g, d in zip(sorted(gains, reverse=True)[:k], discount, strict=False))
    return dcg / ideal


def brute_force(distances, affinity, k):
    """Mean / min / max over every tie ordering of AP, AP@k, NDCG, NDCG@k."""
    relevant = np.asarray(affinity) > 0
    n = len(distances)
    rows = [
        (
            ap_at(o, relevant, n),
            ap_at(o, relevant, k),
            ndcg_at(o, affinity, n),
            ndcg_at(o, affinity, k),
        )
        for o in tie_orderings(np.asarray(distances))
    ]
    values = np.array(rows)
    return values.mean(0), values.min(0), values.max(0)


@st.composite
def one_query(draw):
    bits = draw(st.integers(1, 4))
    n = draw(st.integers(1, 7))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    query = rng.choice([-1, 1], size=(1, bits))
    database = rng.choice([-1, 1], size=(n, bits))
    levels = draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    if not any(levels):
        levels[draw(st.integers(0, n - 1))] = draw(st.integers(1, 3))
    k = draw(st.integers(1, n))
    return bits, query, database, np.array(levels), k


@settings(max_examples=120, deadline=None)
@given(case=one_query())
def test_counting_sort_metrics_equal_the_average_over_all_tie_orderings(case):
    bits, query, database, levels, k = case
    # affinity levels given by a callable: query label 0, database labels are the item indices
    report = hamming_retrieval_metrics(
        query,
        np.zeros(1, dtype=np.int64),
        database,
        np.arange(len(levels)),
        ks=(k,),
        affinity=lambda ql, dl: levels[np.asarray(dl)][None, :],
    )
    distances = (bits - database @ query[0]) // 2
    mean, low, high = brute_force(distances, levels, k)
    assert report.map == pytest.approx(mean[0], abs=1e-12)
    assert report.map_at[k] == pytest.approx(mean[1], abs=1e-12)
    assert report.ndcg == pytest.approx(mean[2], abs=1e-12)
    assert report.ndcg_at[k] == pytest.approx(mean[3], abs=1e-12)
    # the tie-breaking range is exactly the best / worst ordering
    assert report.map_range == pytest.approx((low[0], high[0]), abs=1e-12)
    assert report.ndcg_range == pytest.approx((low[2], high[2]), abs=1e-12)
    assert report.per_query_ap_range[0].tolist() == pytest.approx([low[0], high[0]], abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    bits=st.sampled_from([2, 3, 7, 10, 33, 64, 70]),
    ties=st.sampled_from(["expected", "optimistic", "pessimistic"]),
    similarity=st.sampled_from(["dot", "cosine"]),
)
def test_same_report_as_retrieval_metrics_on_the_same_codes(seed, bits, ties, similarity):
    rng = np.random.default_rng(seed)
    q, db = random_codes(13, bits, seed), random_codes(40, bits, seed + 1)
    ql, dl = rng.integers(0, 4, 13), rng.integers(0, 4, 40)
    if not np.isin(ql, dl).any():
        dl[0] = ql[0]
    ks = (1, 5, 40)
    ours = hamming_retrieval_metrics(q, ql, db, dl, ks=ks, ties=ties)
    # dot products of ±1 codes are exact integers, and every code has norm sqrt(bits), so the
    # exact keys of retrieval_metrics give the same ranking with the same ties for dot and cosine
    ref = retrieval_metrics(q, ql, db, dl, ks=ks, similarity=similarity, ties=ties)
    assert isinstance(ours, RetrievalReport) and isinstance(ours, HammingRetrievalReport)
    assert ours.n_queries_without_relevant == ref.n_queries_without_relevant
    np.testing.assert_allclose(ours.per_query_ap.numpy(), ref.per_query_ap.numpy(), atol=1e-12)
    for name in ("map", "map_at_r", "r_precision"):
        assert getattr(ours, name) == pytest.approx(getattr(ref, name), abs=1e-12)
    for k in ks:
        assert ours.recall_at[k] == pytest.approx(ref.recall_at[k], abs=1e-12)
        assert ours.precision_at[k] == pytest.approx(ref.precision_at[k], abs=1e-12)


def test_leave_one_out_multi_hot_and_packed_inputs():
    rng = np.random.default_rng(3)
    codes = random_codes(60, 16, seed=3)
    hot = rng.random((60, 5)) < 0.3
    loo = hamming_retrieval_metrics(codes, hot, ks=(10,))
    ref = retrieval_metrics(codes, hot, ks=(10,), similarity="dot")
    assert loo.n_gallery == 60 and loo.map == pytest.approx(ref.map, abs=1e-12)
    packed = hamming_retrieval_metrics(pack_codes(codes, "uint64"), hot, ks=(10,), bits=16)
    assert packed.map == loo.map and packed.ndcg == loo.ndcg
    torch_codes = hamming_retrieval_metrics(
        torch.from_numpy(codes).float(), torch.from_numpy(hot), ks=(10,)
    )
    assert torch_codes.map == loo.map


def test_shared_label_levels_give_graded_ndcg():
    rng = np.random.default_rng(5)
    q, db = random_codes(20, 12, 5), random_codes(80, 12, 6)
    qh, dh = rng.random((20, 6)) < 0.4, rng.random((80, 6)) < 0.4
    qh[:, 0] = True
    graded = hamming_retrieval_metrics(q, qh, db, dh, ks=(5,), affinity="shared_labels")
    binary = hamming_retrieval_metrics(q, qh, db, dh, ks=(5,), affinity="labels")
    shared = qh.astype(int) @ dh.T.astype(int)
    dist = (12 - q.astype(int) @ db.T.astype(int)) // 2
    from rankwise.metrics import batched_ndcg

    expected = batched_ndcg(
        torch.tensor(-dist, dtype=torch.float64), torch.tensor(shared, dtype=torch.float64)
    )
    assert graded.ndcg == pytest.approx(float(expected.mean()), abs=1e-12)
    assert graded.map == binary.map  # AP uses binary relevance (affinity > 0) either way
    assert graded.ndcg != binary.ndcg


def test_euclidean_threshold_affinity_levels():
    rng = np.random.default_rng(7)
    features = rng.normal(size=(300, 4))
    aff = EuclideanThresholdAffinity.from_quantiles(features)
    pair = np.sqrt(((features[:, None] - features[None]) ** 2).sum(-1))[np.triu_indices(300, 1)]
    np.testing.assert_allclose(
        aff.thresholds, np.quantile(pair, [0.05, 0.01, 0.002, 0.001]), rtol=1e-12
    )
    levels = aff(features[:10], features)
    d = np.sqrt(((features[:10, None] - features[None]) ** 2).sum(-1))
    expected = np.select(
        [
            d <= aff.thresholds[3],
            d <= aff.thresholds[2],
            d <= aff.thresholds[1],
            d <= aff.thresholds[0],
        ],
        [10, 5, 2, 1],
        0,
    )
    assert np.array_equal(levels, expected)
    # the levels are translation-invariant (no cancellation far from the origin)
    assert np.array_equal(aff(features[:10] + 1e6, features + 1e6), expected)
    codes = random_codes(300, 8, seed=7)
    report = hamming_retrieval_metrics(
        codes[:10], features[:10], codes, features, ks=(5,), affinity=aff
    )
    assert report.affinity == "euclidean_thresholds" and 0 < report.ndcg <= 1
    sampled = EuclideanThresholdAffinity.from_quantiles(features, max_pairs=2000, seed=1)
    assert sampled.thresholds.shape == (4,)


def test_ndcg_from_histograms_edge_cases():
    hist = np.zeros((2, 3, 2), dtype=np.int64)
    hist[0, 1, 1] = 2  # two relevant items tied at distance 1
    hist[0, 0, 0] = 1
    hist[1, 2, 0] = 3  # no relevant item: undefined
    out = ndcg_from_histograms(hist, np.array([0, 1]), None, "expected", cumulative_discount(3))
    d = [1 / math.log2(t + 1) for t in (1, 2, 3)]
    assert out[0] == pytest.approx((d[1] + d[2]) / (d[0] + d[1]))
    assert np.isnan(out[1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ks": (41,)}, r"`ks` holds k=41 but each query ranks only 40 database items"),
        ({"ks": (0,)}, "`ks` must hold positive integers"),
        ({"ties": "random"}, "`ties`"),
        ({"affinity": "euclid"}, "`affinity` must be one of"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_arguments_are_reported(kwargs, match):
    q, db = random_codes(3, 8), random_codes(40, 8, 1)
    with pytest.raises(ValueError, match=match):
        hamming_retrieval_metrics(q, [0, 1, 2], db, np.arange(40) % 3, **kwargs)


def test_bad_codes_and_labels_are_reported():
    q, db = random_codes(3, 8), random_codes(40, 8, 1)
    labels = np.arange(40) % 3
    with pytest.raises(
        ValueError, match="`query_codes` has 8-bit codes but `database_codes` has 12"
    ):
        hamming_retrieval_metrics(q, [0, 1, 2], random_codes(40, 12), labels)
    with pytest.raises(ValueError, match="`query_codes` must hold binary codes"):
        hamming_retrieval_metrics(q * 0.5, [0, 1, 2], db, labels)
    with pytest.raises(ValueError, match="`database_labels` must be"):
        hamming_retrieval_metrics(q, [0, 1, 2], db, labels[:5])
    with pytest.raises(ValueError, match="same kind"):
        hamming_retrieval_metrics(q, np.ones((3, 2), bool), db, labels)
    with pytest.raises(ValueError, match="no query has a relevant database item"):
        hamming_retrieval_metrics(q, [7, 7, 7], db, labels)
    with pytest.raises(ValueError, match="pass both"):
        hamming_retrieval_metrics(q, [0, 1, 2], db)
    with pytest.raises(ValueError, match="returned shape"):
        hamming_retrieval_metrics(q, [0, 1, 2], db, labels, affinity=lambda a, b: np.ones((2, 2)))


def test_chunking_does_not_change_anything():
    rng = np.random.default_rng(11)
    q, db = random_codes(37, 20, 11), random_codes(200, 20, 12)
    ql, dl = rng.integers(0, 5, 37), rng.integers(0, 5, 200)
    whole = hamming_retrieval_metrics(q, ql, db, dl, ks=(1, 50))
    parts = hamming_retrieval_metrics(q, ql, db, dl, ks=(1, 50), chunk_size=4)
    assert whole.to_dict() == parts.to_dict()
    text = str(whole)
    assert "Hamming retrieval (20 bits" in text and "tie-breaking range" in text


def test_empty_inputs_get_their_own_messages():
    q, db = random_codes(3, 8), random_codes(40, 8, 1)
    labels = np.arange(40) % 3
    with pytest.raises(ValueError, match="`query_codes` is empty") as info:
        hamming_retrieval_metrics(q[:0], np.zeros(0, np.int64), db, labels)
    assert "relevant" not in str(info.value)
    with pytest.raises(ValueError, match="`query_codes` is empty"):
        hamming_retrieval_metrics(q[:0], np.zeros(0, np.int64))
    with pytest.raises(ValueError, match="`database_codes` is empty") as info:
        hamming_retrieval_metrics(q, [0, 1, 2], db[:0], labels[:0])
    assert "itself" not in str(info.value)
    with pytest.raises(ValueError, match="a single code ranked against itself"):
        hamming_retrieval_metrics(q[:1], [0])


def test_unsigned_zero_one_codes_are_refused_not_read_as_packed_bytes():
    """torch.uint8 {0, 1} codes gave a report of 96 bits for 12-bit codes."""
    q = torch.from_numpy(random_codes(6, 12) > 0).to(torch.uint8)
    with pytest.raises(ValueError, match=r"`query_codes`.*only 0 and 1"):
        hamming_retrieval_metrics(q, np.arange(6) % 2)
    assert hamming_retrieval_metrics(q.bool(), np.arange(6) % 2).bits == 12


@pytest.mark.parametrize("offset", [0.0, 50.0])
def test_pairs_exactly_at_a_quantile_threshold_keep_their_level(offset):
    """from_quantiles puts a threshold exactly on a pair's distance (np.quantile at an integral
    position); calling the affinity must give that pair the threshold's level in every trial.
    The call used to compute distances by another formula (|q|² + |g|² - 2qᵀg), whose rounding
    dropped the pair at the quantile in about a third of the trials."""
    n = 42  # 861 pairs: the 0.5 and 0.25 quantiles are the distances of pairs 431 and 216
    rows, cols = np.triu_indices(n, 1)
    for seed in range(40):
        x = np.random.default_rng(seed).normal(size=(n, 6)) + offset
        aff = EuclideanThresholdAffinity.from_quantiles(x, (0.5, 0.25), (1, 2))
        levels = aff(x, x)
        for a, b in ((rows, cols), (cols, rows)):
            pair_levels = levels[a, b]
            assert ((pair_levels >= 1).sum(), (pair_levels == 2).sum()) == (431, 216), seed


def test_printed_report_rows_are_aligned_and_grouped():
    q, db = random_codes(20, 12), random_codes(300, 12, 1)
    rng = np.random.default_rng(0)
    report = hamming_retrieval_metrics(
        q, rng.integers(0, 3, 20), db, rng.integers(0, 3, 300), ks=(1, 10, 100)
    )
    lines = str(report).splitlines()
    rows = [line for line in lines[1:] if not line.lstrip().startswith("tie-breaking")]
    names = [line.split()[0] for line in rows]
    value_columns = {line.rindex(" ") for line in rows}
    assert len(value_columns) == 1, "\n".join(lines)  # every value starts in the same column
    for metric in ("AP", "recall", "precision", "NDCG"):
        at = [i for i, name in enumerate(names) if name.startswith(f"{metric}@")]
        assert [names[i] for i in at] == [f"{metric}@{k}" for k in (1, 10, 100)]
        assert at == list(range(at[0], at[0] + 3)), names  # a metric's cut-offs stay together
    assert {"mAP", "MAP@R", "R-precision", "NDCG"} <= set(names)
    assert lines[-1].lstrip().startswith("tie-breaking range")


def test_histograms_of_packed_codes_of_different_word_types_match_the_same_type():
    from rankwise.hashing import as_packed_codes
    from rankwise.metrics.hamming import _label_affinity, hamming_histograms

    rng = np.random.default_rng(0)
    codes = np.where(rng.random((30, 12)) < 0.5, -1, 1)
    labels = rng.integers(0, 3, 30)
    query = as_packed_codes(codes[:10])
    database = as_packed_codes(codes)
    aff = _label_affinity("labels", labels[:10], labels, 10, 30)
    skip = np.full(10, -1, dtype=np.int64)
    expected = hamming_histograms(query, database, aff, 0, 10, skip)
    for dtype in ("uint8", "uint16", "uint32", "uint64"):
        got = hamming_histograms(query, database.to(dtype), aff, 0, 10, skip)
        np.testing.assert_array_equal(got, expected)
