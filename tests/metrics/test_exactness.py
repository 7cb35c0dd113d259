"""Exact to the last tie: scores that neither invent nor destroy ties, whatever the chunking, the
gallery order, the backend or the offset of the data (issue "Exact to the last tie, everywhere").

Oracles here are exact: rational arithmetic (fractions), or float64 sums that are exact for the
data at hand (small integers, float32 differences), never a float32 BLAS product.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankwise.metrics import pair_scores, retrieval_metrics
from rankwise.metrics._kernels import (
    relevant_group_counts_from_lists,
    relevant_group_counts_numba,
    relevant_lists_from_mask,
)
from rankwise.metrics._scores import BlockScorer
from rankwise.metrics.curves import roc_curve_from_embeddings
from rankwise.similarity import ExactOperands, _torch_keys, ranking_keys


def _report(report) -> dict:
    out = report.to_dict()
    out.pop("similarity")
    return out


def _codes(seed: int, n: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return np.sign(rng.normal(size=(n, bits))).astype(np.float32), rng.integers(0, 30, n)


# ------------------------------------------------------------------ cosine of binary codes


def test_cosine_of_the_issue_example_is_exact_for_every_chunk_size():
    e = np.array([[1, -1, -1], [1, 1, 1], [-1, 1, -1], [1, -1, -1]], np.float32)
    labels = np.array([0, 0, 0, 1])
    # +-1 codes: every norm is sqrt(3), so cosine ties exactly where the inner product ties
    dot = retrieval_metrics(e, labels, ks=(1,), similarity="dot")
    for chunk in (None, 1, 2, 3):
        for backend in ("numba", "torch"):
            cos = retrieval_metrics(e, labels, ks=(1,), chunk_size=chunk, backend=backend)
            assert _report(cos) == _report(dot)
    assert dot.map == pytest.approx(79 / 108, abs=1e-15)  # 0.731481..., as the issue states


@pytest.mark.parametrize("bits", [32, 48])
def test_cosine_of_binary_codes_ties_like_the_inner_product(bits):
    codes, labels = _codes(bits, 200, bits)
    keys = ranking_keys(codes, similarity="cosine").numpy()
    dots = codes.astype(np.int64) @ codes.astype(np.int64).T
    for row in range(0, 200, 17):  # equal inner products <=> equal keys, same order
        np.testing.assert_array_equal(
            np.argsort(keys[row], kind="stable"), np.argsort(dots[row], kind="stable")
        )
        assert len(np.unique(keys[row])) == len(np.unique(dots[row]))
    reference = _report(retrieval_metrics(codes, labels, ks=(1, 10), similarity="dot"))
    for chunk, backend in itertools.product((None, 1, 7, 64), ("numba", "torch")):
        got = retrieval_metrics(codes, labels, ks=(1, 10), chunk_size=chunk, backend=backend)
        assert _report(got) == reference
    for chunk in (None, 1, 13):  # the pair view: one value per distinct inner product
        scores, _ = pair_scores(codes, labels, chunk_size=chunk)
        assert len(torch.unique(scores)) == len(np.unique(dots[np.triu_indices(200, 1)]))


def test_cosine_of_integer_codes_with_different_norms_ties_exactly():
    # 0/1 codes: cos = dot / sqrt(|q| |g|); e.g. 1 / sqrt(1 * 2) == 3 / sqrt(3 * 6): one value
    x = np.array(
        [[1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]],
        dtype=np.float32,
    )
    keys = ranking_keys(x, similarity="cosine").numpy()
    exact = [
        [Fraction(int(a @ b)) ** 2 / (int(a @ a) * int(b @ b)) for b in x.astype(int)]
        for a in x.astype(int)
    ]
    for i, j, k, m in itertools.product(range(4), repeat=4):
        assert (keys[i, j] == keys[k, m]) == (exact[i][j] == exact[k][m])
        assert (keys[i, j] < keys[k, m]) == (exact[i][j] < exact[k][m])


# ------------------------------------------------------------------ euclidean


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_euclidean_of_offset_points_is_accurate(dtype):
    x = np.array([[1000.0], [1000.01], [1000.3], [1000.31]], dtype=dtype)
    report = retrieval_metrics(x, [0, 0, 1, 1], ks=(1,), similarity="euclidean")
    assert report.map == 1.0 and report.recall_at[1] == 1.0


def _naive_euclidean_map(q: np.ndarray, g: np.ndarray, ql, gl) -> np.ndarray:
    """Per-query AP from float64 differences of float32 data (exact: no cancellation)."""
    d = ((q[:, None, :].astype(np.float64) - g[None, :, :].astype(np.float64)) ** 2).sum(-1)
    out = []
    for i in range(q.shape[0]):
        rel = gl == ql[i]
        order = np.argsort(d[i], kind="stable")
        hits = np.cumsum(rel[order])
        out.append(float((hits[rel[order]] / (np.flatnonzero(rel[order]) + 1)).mean()))
    return np.array(out)


def test_euclidean_is_translation_invariant():
    rng = np.random.default_rng(3)
    base = rng.normal(size=(60, 8)) * 0.05
    labels = rng.integers(0, 6, 60)
    q, g = base[:20].astype(np.float32), base[20:].astype(np.float32)
    for offset in (0.0, 1000.0):
        qo, go = (q + np.float32(offset)), (g + np.float32(offset))
        report = retrieval_metrics(qo, labels[:20], go, labels[20:], similarity="euclidean")
        want = _naive_euclidean_map(qo, go, labels[:20], labels[20:])
        np.testing.assert_allclose(report.per_query_ap.numpy(), want, rtol=0, atol=1e-14)
    # an offset that is exact in float32 moves no point: the reports are identical
    grid = np.round(base * 2**12) / 2**12
    moved = []
    for shift in (0.0, 1000.0, -1500.0):
        x = (grid + shift).astype(np.float32)
        assert (x.astype(np.float64) - shift == grid).all()  # the float32 points moved exactly
        moved.append(retrieval_metrics(x, labels, similarity="euclidean"))
    assert moved[0].to_dict() == moved[1].to_dict() == moved[2].to_dict()


def test_euclidean_pair_scores_are_exact_distances_of_offset_data():
    rng = np.random.default_rng(5)
    x = (1000 + rng.normal(size=(30, 4)) * 1e-2).astype(np.float32)
    scores, _ = pair_scores(x, rng.integers(0, 3, 30), similarity="euclidean")
    i, j = np.triu_indices(30, 1)
    diff = x[i].astype(np.float64) - x[j].astype(np.float64)  # exact, and so are the squares
    want = -np.sqrt((diff * diff).sum(1))
    np.testing.assert_array_equal(scores.numpy(), want)


# ------------------------------------------------------------------ finite inputs, huge scores


@pytest.mark.parametrize("similarity", ["dot", "euclidean", "cosine"])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_scores_that_overflow_float32_are_exact_on_both_backends(similarity, backend):
    # 2^66 k: the inner products (2^132) and squared distances overflow float32
    small = np.array([[1.0], [2.0], [3.0], [4.0]], dtype=np.float32)
    labels = [0, 1, 0, 1]
    big = small * np.float32(2.0**66)
    want = retrieval_metrics(small, labels, ks=(1,), similarity=similarity, backend=backend)
    got = retrieval_metrics(big, labels, ks=(1,), similarity=similarity, backend=backend)
    assert got.to_dict() == want.to_dict()
    # truth by hand for dot: query 1 ranks 4, 3 (rel), 2; query 2 ranks 4 (rel), 3, 1; query 3
    # ranks 4, 2, 1 (rel); query 4 ranks 3, 2 (rel), 1
    if similarity == "dot":
        np.testing.assert_allclose(want.per_query_ap.numpy(), [1 / 2, 1, 1 / 3, 1 / 2])


def test_float64_scores_that_overflow_float64_raise_a_clear_error():
    x = np.array([[1e200], [2e200], [3e200]])
    for similarity in ("dot", "euclidean"):
        with pytest.raises(ValueError, match="overflow float64.*rescale"):
            retrieval_metrics(x, [0, 0, 1], similarity=similarity)
        with pytest.raises(ValueError, match="overflow float64"):
            pair_scores(x, [0, 0, 1], similarity=similarity)
    # cosine is scale-free: computed on rows rescaled by powers of two
    assert retrieval_metrics(x, [0, 0, 1], similarity="cosine").map == 1.0


# ------------------------------------------------------------------ the keys themselves


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_numba_and_torch_keys_are_bitwise_equal_and_blockwise_invariant(dtype, similarity):
    rng = np.random.default_rng(6)
    scale = rng.lognormal(0, 2, (50, 1))
    q = torch.tensor(rng.normal(size=(50, 13)) * scale, dtype=dtype)
    g = torch.tensor(rng.normal(size=(80, 13)), dtype=dtype)
    ops = ExactOperands.build(q, g, similarity)
    keys = ops.keys()
    torch_keys = _torch_keys(ops.code, ops.query, ops.gallery, ops.query_norm2, ops.gallery_norm2)
    assert torch.equal(keys, torch_keys)
    for lo, hi, col in ((0, 1, 0), (7, 30, 11), (49, 50, 79)):
        assert torch.equal(ops.keys(lo, hi, col), keys[lo:hi, col:])
    rows, cols = torch.randint(0, 50, (300,)), torch.randint(0, 80, (300,))
    assert torch.equal(ops.pair_keys(rows, cols), keys[rows, cols])


def _random_embeddings(seed: int, kind: str, dtype=np.float32):
    rng = np.random.default_rng(seed)
    if kind == "offset":
        return (1000 + rng.normal(size=(70, 6)) * 0.01).astype(dtype)
    if kind == "scaled":
        return (rng.normal(size=(70, 6)) * rng.lognormal(0, 3, (70, 1))).astype(dtype)
    return (rng.normal(size=(70, 6))).astype(dtype)


@pytest.mark.parametrize("float64", [False, True])
@pytest.mark.parametrize("kind", ["plain", "offset", "scaled"])
@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_approximation_bound_holds_for_every_pair(kind, similarity, dtype, float64):
    x = torch.from_numpy(_random_embeddings(11, kind, dtype))
    scorer = BlockScorer(x[:30], x, similarity, float64_approximation=float64)
    if kind == "offset" and dtype == np.float32:
        # float32 numbers near 1000 are multiples of 2^-14: the float64 matmul is exact
        assert scorer.mode == "exact_matmul"
        assert torch.equal(scorer.block(0, 30, keys=True).values, scorer.exact.keys(0, 30))
        return
    assert scorer.mode == "approximate"
    block = scorer.block(0, 30, keys=True)
    low, high = scorer.value_interval(block)
    from rankwise.similarity import similarity_from_keys

    exact = similarity_from_keys(scorer.keys(0, 30), similarity)
    assert bool(((low <= exact) & (exact <= high)).all())
    tight = 1e-11 if float64 else 1e-2  # relative width of the intervals
    scale = float(exact.abs().max() + 1e-300)
    # -sqrt(-key) widens an interval of the key near distance 0: judge the width away from it
    away = exact.abs() > 1e-3 * scale if similarity == "euclidean" else exact == exact
    assert float((high - low)[away].max()) < tight * scale


def test_codes_take_the_exact_matmul_and_floats_the_approximation():
    codes, _ = _codes(0, 50, 32)
    assert BlockScorer(torch.from_numpy(codes), torch.from_numpy(codes), "cosine").mode == (
        "exact_matmul"
    )
    x = torch.randn(20, 5)
    assert BlockScorer(x, x, "dot").mode == "approximate"
    assert BlockScorer(x, x, "dot", approximate=False).mode == "keys"


# ------------------------------------------------------------------ verified counting kernel


@pytest.mark.parametrize("levels", [3, 40, 10_000])
def test_verified_counts_equal_the_counts_of_the_exact_keys(levels):
    rng = np.random.default_rng(levels)
    n_rows, n_items, e = 25, 600, 1e-3
    keys = rng.integers(0, levels, size=(n_rows, n_items)) / levels
    keys = keys + rng.normal(size=keys.shape) * 1e-9 * (rng.random(keys.shape) < 0.3)
    approx = (keys + rng.uniform(-e, e, size=keys.shape)).astype(np.float32)
    bound = np.full(n_rows, e + 2**-23)  # the noise and the float32 rounding
    relevant = rng.random(keys.shape) < np.linspace(0.002, 0.6, n_rows)[:, None]
    self_index = rng.integers(-1, n_items, n_rows)
    rel_ptr, rel_cols = relevant_lists_from_mask(relevant, self_index)
    asked = []

    def exact_keys(rows, cols):
        asked.append(len(rows))
        return keys[rows, cols]

    for buckets in (0, 4):
        got = relevant_group_counts_from_lists(
            approx, rel_ptr, rel_cols, self_index, buckets, bound=bound, exact_keys=exact_keys
        )
        want = relevant_group_counts_numba(keys, relevant, self_index)
        for name in ("n_groups", "greater", "size", "relevant"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    assert 0 < asked[0] < n_rows * n_items  # only the uncertain pairs were computed exactly


def test_verified_counts_rescan_rows_with_many_uncertain_items():
    # one relevant item per row and hundreds of items within the bound: more than the listed
    # capacity (4 R + 64), so the rows are scanned a second time
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2, size=(4, 2000)).astype(np.float64)
    approx = keys + rng.uniform(-0.1, 0.1, size=keys.shape)
    relevant = np.zeros(keys.shape, dtype=bool)
    relevant[:, 5] = True
    rel_ptr, rel_cols = relevant_lists_from_mask(relevant)
    got = relevant_group_counts_from_lists(
        approx, rel_ptr, rel_cols, bound=np.full(4, 0.1), exact_keys=lambda r, c: keys[r, c]
    )
    want = relevant_group_counts_numba(keys, relevant)
    np.testing.assert_array_equal(got.size, want.size)
    np.testing.assert_array_equal(got.greater, want.greater)


# ------------------------------------------------------------------ histogram ROC


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_histogram_points_are_the_exact_rates_of_their_thresholds(similarity):
    rng = np.random.default_rng(8)
    labels = rng.integers(0, 5, 120)
    x = (rng.normal(size=(5, 6))[labels] + rng.normal(size=(120, 6))).astype(np.float32)
    scores, positive = pair_scores(x, labels, similarity=similarity)
    s, p = scores.numpy(), positive.numpy()
    curves = [
        roc_curve_from_embeddings(x, labels, similarity=similarity, bins=300, chunk_size=c)
        for c in (None, 1, 17)
    ]
    for other in curves[1:]:  # no pair changes bin with the chunking
        np.testing.assert_array_equal(other.tpr, curves[0].tpr)
        np.testing.assert_array_equal(other.fpr, curves[0].fpr)
    hist = curves[0]
    for k in range(1, len(hist)):
        accepted = s >= hist.thresholds[k]
        assert hist.tpr[k] == accepted[p].sum() / p.sum()
        assert hist.fpr[k] == accepted[~p].sum() / (~p).sum()


# ------------------------------------------------------------------ property: order and chunks


_settings = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _problem(draw):
    kind = draw(st.sampled_from(["codes", "small_ints", "offset"]))
    n_q = draw(st.integers(1, 12))
    n_g = draw(st.integers(2, 30))
    d = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "codes":
        q, g = (np.sign(rng.normal(size=(n, d))) for n in (n_q, n_g))
    elif kind == "small_ints":
        q, g = (rng.integers(-2, 3, size=(n, d)) for n in (n_q, n_g))
    else:
        q, g = (1000.0 + rng.normal(size=(n, d)) * 0.01 for n in (n_q, n_g))
    q, g = q.astype(np.float32), g.astype(np.float32)
    n_classes = draw(st.integers(1, 4))
    ql, gl = rng.integers(0, n_classes, n_q), rng.integers(0, n_classes, n_g)
    gl[0] = ql[0]  # at least one query has a relevant item
    return q, ql, g, gl, rng.permutation(n_g)


@_settings
@given(
    problem=_problem(),
    similarity=st.sampled_from(["cosine", "dot", "euclidean"]),
    chunk=st.one_of(st.none(), st.integers(1, 13)),
    backend=st.sampled_from(["numba", "torch"]),
)
def test_metrics_ignore_gallery_order_chunk_size_and_backend(problem, similarity, chunk, backend):
    q, ql, g, gl, perm = problem
    ref = retrieval_metrics(q, ql, g, gl, ks=(1, 3), similarity=similarity, backend="numba")
    got = retrieval_metrics(
        q,
        ql,
        g[perm],
        gl[perm],
        ks=(1, 3),
        similarity=similarity,
        chunk_size=chunk,
        backend=backend,
    )
    assert got.to_dict() == ref.to_dict()
