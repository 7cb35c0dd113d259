"""The device chunk loop of backend="torch" (rankwise.metrics._device): exact, bit for bit equal to
the numba backend, and a fixed, sync-free sequence of kernels per chunk (issue 31).

Operation counts come from rankwise._dispatch_count (a TorchDispatchMode) on the CPU: the loop is
the same code on every device, so they are the operations a GPU would run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rankwise import similarity as similarity_module
from rankwise._dispatch_count import DispatchCounter
from rankwise._similarity_kernels import lowest_bit_exponent, pair_keys
from rankwise.metrics import _device, pr_curve, retrieval_metrics
from rankwise.metrics._kernels import relevant_group_counts_from_lists, relevant_lists_from_mask
from rankwise.metrics._scores import LoopOperands
from rankwise.metrics.ranking import harmonic_table, harmonic_table_tensor
from rankwise.similarity import ExactOperands, sequential_column_sums, transposed_pair_keys

CHUNK = _device.CHUNK_RECORD
WINDOWS = _device.WINDOW_RECORD
PAIRS = _device.PAIRS_RECORD
GROUPS = _device.GROUP_RECORD
NEAR_TIE_LOOPS = (WINDOWS, PAIRS, GROUPS)
READBACK = _device.READBACK_RECORD
KERNEL_LIMIT = 64


# ------------------------------------------------------------------ counts against the kernel


def _numba_rows(scores, relevant, self_index):
    si = None if self_index is None else self_index.numpy()
    rel_ptr, rel_cols = relevant_lists_from_mask(relevant.numpy(), si)
    counts = relevant_group_counts_from_lists(scores.numpy(), rel_ptr, rel_cols, si)
    offsets = counts.offsets()
    return [
        list(
            zip(
                counts.greater[offsets[i] : offsets[i + 1]].tolist(),
                counts.size[offsets[i] : offsets[i + 1]].tolist(),
                counts.relevant[offsets[i] : offsets[i + 1]].tolist(),
                strict=True,
            )
        )
        for i in range(scores.shape[0])
    ]


def _device_rows(scores, relevant, self_index):
    """The loop's group table for an arbitrary score matrix: scores @ I is the block, exactly."""
    n_rows, n_items = scores.shape
    rows = torch.arange(n_rows)
    own = torch.zeros(n_rows, dtype=torch.bool)
    self_column = self_fill = None
    if self_index is not None:
        has = self_index >= 0
        own = has & relevant[rows, self_index.clamp_min(0)]
        self_column = self_index.clamp_min(0)[:, None]
        inf = torch.tensor(float("inf"), dtype=scores.dtype)
        self_fill = torch.where(has, -inf, inf)[:, None]
    n_rel = relevant.sum(1) - own.long()
    width = max(int(n_rel.max()), 1)
    prob = _device.DeviceProblem(
        operands=LoopOperands(
            scores,
            torch.eye(n_items, dtype=scores.dtype),
            torch.zeros(n_rows, dtype=scores.dtype),
            True,
        ),
        n_gallery=n_items,
        gallery_labels=torch.eye(n_items),
        query_labels=relevant.to(torch.float32),
        self_column=self_column,
        self_fill=self_fill,
        offset=own.to(torch.int32)[:, None],
        n_relevant_column=n_rel.to(torch.int32)[:, None],
        relevant_total=(n_rel + own.long())[:, None],
        cut=torch.zeros(2, 1, n_rows, dtype=torch.float64),
        n_relevant=n_rel.numpy(),
    )
    consts = _device._Consts.build(width, harmonic_table_tensor(n_items))
    items = _device._items(prob, consts, 0, n_rows, width)
    g, n, r, _, _ = _device._group_table(prob, consts, items.raw, 0, n_rows)
    return [
        [(int(g[s, i]), int(n[s, i]), int(r[s, i])) for s in range(int(n_rel[i])) if r[s, i] > 0]
        for i in range(n_rows)
    ]


@pytest.mark.parametrize("kind", ["float32", "float64", "codes", "few_values", "adjacent_ulps"])
def test_group_counts_equal_the_numba_kernel(kind):
    gen = torch.Generator().manual_seed(3)
    n_rows, n_items = 40, 300
    if kind == "float32":
        scores = torch.randn(n_rows, n_items, generator=gen)
    elif kind == "float64":
        scores = torch.randn(n_rows, n_items, generator=gen, dtype=torch.float64)
    elif kind == "codes":  # inner products of 8-bit codes: heavy ties
        scores = torch.randint(-8, 9, (n_rows, n_items), generator=gen).to(torch.float32)
    elif kind == "few_values":  # every row tied into two values
        scores = torch.randint(0, 2, (n_rows, n_items), generator=gen).to(torch.float64)
    else:  # float64 values a few ulps apart: distinct, but equal once rounded to float32
        steps = torch.randint(0, 5, (n_rows, n_items), generator=gen).to(torch.float64)
        scores = 0.75 + steps * 2.0**-52
    relevant = torch.rand(n_rows, n_items, generator=gen) < 0.2
    relevant[0] = False  # a row without relevant items
    relevant[1] = True  # a row where every item is relevant
    self_index = torch.randint(-1, n_items, (n_rows,), generator=gen)
    for si in (self_index, None):
        assert _device_rows(scores, relevant, si) == _numba_rows(scores, relevant, si)


# ------------------------------------------------------------------ the two backends, bit for bit


def _codes(n, bits, gen):
    return torch.sign(torch.randn(n, bits, generator=gen))


@pytest.mark.parametrize(
    "case", ["many_classes_float", "few_classes_float", "few_classes_codes", "multi_hot"]
)
@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_torch_and_numba_backends_agree_bit_for_bit(case, similarity):
    gen = torch.Generator().manual_seed(6)
    n = 300
    if case == "many_classes_float":
        x, labels = torch.randn(n, 24, generator=gen), torch.randint(0, 200, (n,), generator=gen)
    elif case == "few_classes_float":
        x, labels = torch.randn(n, 24, generator=gen), torch.randint(0, 3, (n,), generator=gen)
    elif case == "few_classes_codes":
        x, labels = _codes(n, 10, gen), torch.randint(0, 3, (n,), generator=gen)
    else:
        x = torch.randn(n, 24, generator=gen)
        labels = (torch.rand(n, 5, generator=gen) < 0.3).long()
    kwargs = dict(similarity=similarity, ks=(1, 7, 100), chunk_size=123)
    for ties in (
        ("expected", "optimistic", "pessimistic") if case == "few_classes_codes" else ("expected",)
    ):
        numba = retrieval_metrics(x, labels, backend="numba", ties=ties, **kwargs).to_dict()
        torch_path = retrieval_metrics(x, labels, backend="torch", ties=ties, **kwargs).to_dict()
        assert torch_path == numba
    a = pr_curve(x, labels, similarity=similarity, backend="numba")
    b = pr_curve(x, labels, similarity=similarity, backend="torch")
    np.testing.assert_array_equal(a.precision, b.precision)


def _problems():
    """(name, query, query_labels, gallery, gallery_labels, exclude_self) of the agreement test."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(260, 16, generator=gen)
    y = torch.randint(0, 9, (260,), generator=gen)
    ints = torch.randint(-3, 4, (260, 6), generator=gen).to(torch.float32)  # heavy exact ties
    q, g = torch.randn(50, 16, generator=gen), torch.randn(140, 16, generator=gen)
    ql, gl = torch.randint(0, 6, (50,), generator=gen), torch.randint(0, 6, (140,), generator=gen)
    return [
        ("continuous, leave-one-out", x, y, None, None, None),
        ("tied integers, leave-one-out", ints, y, None, None, None),
        ("continuous, gallery", q, ql, g, gl, None),
        ("tied integers, gallery", ints[:50], ql, ints[100:240], gl, None),
        ("gallery with excluded rows", q, ql, g, gl, torch.randint(-1, 140, (50,), generator=gen)),
    ]


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
@pytest.mark.parametrize("problem", _problems(), ids=lambda p: p[0])
def test_torch_equals_numba_within_1e_12_and_to_the_bit(problem, similarity):
    _, q, ql, g, gl, exclude = problem
    kwargs = dict(ks=(1, 5, 60), similarity=similarity, exclude_self=exclude)
    numba = retrieval_metrics(q, ql, g, gl, backend="numba", **kwargs)
    ours = retrieval_metrics(q, ql, g, gl, backend="torch", **kwargs)
    np.testing.assert_allclose(
        ours.per_query_ap.numpy(), numba.per_query_ap.numpy(), rtol=0, atol=1e-12
    )
    for name in ("map", "map_at_r", "r_precision"):
        assert getattr(ours, name) == pytest.approx(getattr(numba, name), abs=1e-12)
    assert ours.to_dict() == numba.to_dict()  # the closed forms are shared: the same bits


# ------------------------------------------------------------------ near ties: the pair pass


def _near_duplicates(dtype=torch.float64):
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(1, 16, generator=gen, dtype=torch.float64)
    steps = torch.randint(-2, 3, (120, 16), generator=gen).to(torch.float64)
    x = torch.cat([base + 1e-9 * steps, torch.randn(80, 16, generator=gen, dtype=torch.float64)])
    return x.to(dtype), torch.randint(0, 4, (200,), generator=gen)


def _spy_runs(monkeypatch):
    runs = []
    original = _device._run

    def spy(*args, **kwargs):
        runs.append(original(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(_device, "_run", spy)
    return runs


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_near_ties_are_resolved_by_exact_keys_of_compacted_pairs(monkeypatch, similarity):
    # near-duplicate float64 embeddings: the float64 approximation cannot order or tie them
    x, labels = _near_duplicates()
    runs = _spy_runs(monkeypatch)
    for chunk in (None, 37):
        ours = retrieval_metrics(
            x, labels, ks=(1, 5, 50), similarity=similarity, chunk_size=chunk, backend="torch"
        )
        assert runs[-1].near_tie_queries > 0 and runs[-1].near_tie_pairs > 0
        want = retrieval_metrics(
            x, labels, ks=(1, 5, 50), similarity=similarity, chunk_size=chunk, backend="numba"
        )
        assert ours.to_dict() == want.to_dict()
        a = pr_curve(x, labels, similarity=similarity, chunk_size=chunk, backend="torch")
        b = pr_curve(x, labels, similarity=similarity, chunk_size=chunk, backend="numba")
        np.testing.assert_array_equal(a.precision, b.precision)


def test_exact_duplicates_tie_exactly_without_the_near_tie_pass(monkeypatch):
    # copies of one row have one exact key: their windows are their tie groups (issue 36)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(100, 8, generator=gen)
    x = torch.cat([x, x[:50], x[:20]])  # exact duplicates: tied keys, tied approximations
    y = torch.randint(0, 6, (170,), generator=gen)
    runs = _spy_runs(monkeypatch)
    for similarity in ("cosine", "dot", "euclidean"):
        ours = retrieval_metrics(x, y, similarity=similarity, ks=(1, 5), backend="torch")
        assert runs[-1].near_tie_queries == 0
        assert (
            ours.to_dict()
            == retrieval_metrics(x, y, similarity=similarity, ks=(1, 5), backend="numba").to_dict()
        )


def test_a_short_pair_buffer_is_detected_and_the_chunk_run_again(monkeypatch):
    x, labels = _near_duplicates()
    want = retrieval_metrics(x, labels, ks=(1, 5), similarity="euclidean", backend="numba")
    runs = _spy_runs(monkeypatch)
    # buffers a tenth of what the main loop counted: every near-tie row chunk overflows once
    monkeypatch.setattr(_device, "PAIR_SLACK", 0.1)
    monkeypatch.setattr(_device, "PAIR_PAD", 0)
    with DispatchCounter("rankwise.retrieval.") as counter:
        got = retrieval_metrics(
            x, labels, ks=(1, 5), similarity="euclidean", chunk_size=50, backend="torch"
        )
    assert got.to_dict() == want.to_dict()
    near = runs[-1].near_ties
    first_pass = math.ceil(near.queries / 50)
    # each row chunk sorted and evaluated again with a large enough buffer
    assert near.window_chunks == near.group_chunks == 2 * first_pass
    assert len(counter.named(WINDOWS)) == len(counter.named(GROUPS)) == 2 * first_pass
    assert len(counter.named(READBACK)) == 3  # main loop, near-tie pass, the reruns


def test_pairs_beyond_the_memory_budget_take_several_chunks(monkeypatch):
    # a zero query row under cosine: every item ties with every relevant one (R x N pairs)
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(60, 5, generator=gen, dtype=torch.float64)
    x[[3, 17]] = 0
    y = torch.randint(0, 4, (60,), generator=gen)
    want = retrieval_metrics(x, y, ks=(1, 5), backend="numba")
    budget = _device.memory_budget(torch.device("cpu"))
    runs = _spy_runs(monkeypatch)
    monkeypatch.setattr(_device, "BYTES_PER_STORED_PAIR", budget // 4 // 120)  # 120 per buffer
    monkeypatch.setattr(_device, "BYTES_PER_PAIR", budget // 4 // 50)  # about 50 per key chunk
    with DispatchCounter("rankwise.retrieval.") as counter:
        got = retrieval_metrics(x, y, ks=(1, 5), backend="torch")
    assert got.to_dict() == want.to_dict()
    near = runs[-1].near_ties
    assert near.pairs > 2 * 120  # the zero rows alone have R x N pairs
    # one row chunk, its pairs enumerated by several window chunks, each keyed in several chunks
    assert near.group_chunks == 1 and near.window_chunks > 2
    assert near.pair_chunks > near.window_chunks
    for name in (CHUNK, *NEAR_TIE_LOOPS):
        assert len({r.kernels for r in counter.named(name)}) == 1, name


# ------------------------------------------------------------------ degenerate data (issue 36)


def _degenerate(case, gen):
    """(query, query labels, gallery, gallery labels, exclude_self) of a degenerate case."""
    n = 90
    labels = torch.randint(0, 9, (n,), generator=gen)
    if case == "identical":  # a collapsed model: one row n times
        return torch.randn(1, 12, generator=gen).expand(n, 12), labels, None, None, None
    if case == "few_rows_repeated":
        rows = torch.randn(6, 12, generator=gen)
        return rows[torch.randint(0, 6, (n,), generator=gen)], labels, None, None, None
    if case == "copies_with_near_neighbours":
        # copies of 5 rows, and near copies (one entry a few ulps off): mixed windows
        rows = torch.randn(5, 12, generator=gen, dtype=torch.float64)
        x = rows[torch.arange(n) % 5].clone()
        x[::4, 0] += 2.0**-50 * torch.randint(1, 3, (len(x[::4]),), generator=gen)
        return x, labels, None, None, None
    if case == "binary_codes":  # exact values: heavy ties between different rows
        return torch.sign(torch.randn(n, 6, generator=gen)), labels, None, None, None
    if case == "quantised":
        # a non-dyadic grid: approximate values, and exact ties between different rows
        x = 0.1 * torch.randint(-2, 3, (n, 4), generator=gen).to(torch.float64)
        return x, labels, None, None, None
    if case == "multi_hot_copies":
        rows = torch.randn(4, 12, generator=gen)
        hot = (torch.rand(n, 5, generator=gen) < 0.4).long()
        return rows[torch.randint(0, 4, (n,), generator=gen)], hot, None, None, None
    # a gallery of copies; queries that are copies of gallery rows, each excluding a copy of
    # its own row, a copy of another row or nothing
    rows = torch.randn(4, 12, generator=gen)
    which = torch.randint(0, 4, (n,), generator=gen)
    q_which = torch.randint(0, 4, (40,), generator=gen)
    own_copy = torch.stack([torch.nonzero(which == w)[0, 0] for w in q_which.tolist()])
    exclude = torch.where(
        torch.arange(40) % 3 == 0,
        own_copy,
        torch.where(torch.arange(40) % 3 == 1, torch.randint(0, n, (40,), generator=gen), -1),
    )
    q_labels = torch.randint(0, 9, (40,), generator=gen)
    return rows[q_which], q_labels, rows[which], labels, exclude


DEGENERATE = [
    "identical",
    "few_rows_repeated",
    "copies_with_near_neighbours",
    "binary_codes",
    "quantised",
    "multi_hot_copies",
    "gallery_copies_excluded",
]


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
@pytest.mark.parametrize("case", DEGENERATE)
def test_degenerate_embeddings_equal_the_numba_backend_bit_for_bit(monkeypatch, case, similarity):
    gen = torch.Generator().manual_seed(36)
    q, ql, g, gl, exclude = _degenerate(case, gen)
    runs = _spy_runs(monkeypatch)
    for chunk in (None, 7):
        kwargs = dict(similarity=similarity, chunk_size=chunk, exclude_self=exclude)
        ours = retrieval_metrics(q, ql, g, gl, ks=(1, 5), backend="torch", **kwargs)
        if case in ("identical", "few_rows_repeated", "multi_hot_copies"):
            assert runs[-1].near_tie_queries == 0  # copies of one row: no exact key needed
        if case == "copies_with_near_neighbours":
            assert runs[-1].near_tie_pairs > 0  # the pass runs, its windows hold copies too
        want = retrieval_metrics(q, ql, g, gl, ks=(1, 5), backend="numba", **kwargs)
        assert ours.to_dict() == want.to_dict()
        a = pr_curve(q, ql, g, gl, backend="torch", **kwargs)
        b = pr_curve(q, ql, g, gl, backend="numba", **kwargs)
        np.testing.assert_array_equal(a.precision, b.precision)


def test_gallery_row_copies_treat_signed_zeros_alike_and_count_copies():
    g = torch.tensor([[1.0, 0.0], [2.0, 1.0], [1.0, -0.0], [1.0, 2.0**-60], [2.0, 1.0], [1.0, 0.0]])
    copies, row = _device.gallery_row_copies(g.to(torch.float64)).unbind(1)
    assert copies.tolist() == [3, 2, 3, 1, 2, 3]
    assert row[0] == row[2] == row[5] and row[1] == row[4]
    assert len({int(row[0]), int(row[1]), int(row[3])}) == 3


@pytest.mark.parametrize("n", [60, 120])
def test_copies_of_one_row_run_the_kernels_of_distinct_rows(n):
    # all rows identical (a collapsed model) or 10 rows repeated: the kernels of the whole call
    # are those of distinct rows of the same shape, not (relevant item x window) pairs of keys
    # (before issue 36 the near-tie pass gave every query R x N pairs: kernels grew with N^3)
    gen = torch.Generator().manual_seed(37)
    y = torch.randint(0, 6, (n,), generator=gen)
    distinct = torch.randn(n, 16, generator=gen)
    identical = distinct[:1].expand(n, 16)
    repeated = distinct[torch.arange(n) % 10]

    def kernels(x):
        counter = _count(x, y, ks=(1, 5), chunk_size=25)
        assert not any(counter.named(name) for name in NEAR_TIE_LOOPS)
        return sum(r.kernels for r in counter.ranges)

    assert kernels(identical) == kernels(repeated) == kernels(distinct)


# ------------------------------------------------------------------ kernels and syncs per chunk


def _count(*args, **kwargs):
    with DispatchCounter("rankwise.retrieval.", watch_host=True) as counter:
        retrieval_metrics(*args, backend="torch", **kwargs)
    return counter


def _kernels_per_chunk(counter, name=CHUNK):
    return {r.kernels for r in counter.named(name)}


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_chunks_run_a_fixed_number_of_kernels_whatever_the_data(similarity):
    gen = torch.Generator().manual_seed(12)
    n = 400

    def counts(x, y):
        counter = _count(x, y, ks=(1, 10), similarity=similarity, chunk_size=100)
        assert len(counter.named(CHUNK)) == 4
        per_chunk = _kernels_per_chunk(counter)
        assert len(per_chunk) == 1  # every chunk the same, the last (smaller) one too
        return per_chunk.pop()

    many = torch.randint(0, 100, (n,), generator=gen)
    few = torch.randint(0, 2, (n,), generator=gen)
    # approximate values (continuous embeddings): the dimension, the relevant items, exact ties
    small_d = torch.randn(n, 8, generator=gen)
    approximate = {
        counts(small_d, many),
        counts(torch.randn(n, 256, generator=gen), many),
        counts(small_d, few),
        counts(torch.cat([small_d[:200], small_d[:200]]), many),  # every item twice: ties
    }
    # exact values (+-1 codes): heavy ties (6 bits) vs far fewer (64 bits), few vs many relevant
    codes = torch.sign(torch.randn(n, 6, generator=gen))
    exact = {
        counts(codes, many),
        counts(codes, few),
        counts(torch.sign(torch.randn(n, 64, generator=gen)), many),
    }
    assert len(approximate) == 1 and len(exact) == 1
    # integer embeddings: exact too; for cosine, norms differ, so the block becomes cosine keys
    ints = torch.randint(-(10**4), 10**4, (n, 8), generator=gen).to(torch.float32)
    extra = 4 if similarity == "cosine" else 0
    assert counts(ints, many) == counts(ints, few) == exact.pop() + extra
    assert max(approximate) <= KERNEL_LIMIT and counts(ints, many) <= KERNEL_LIMIT


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_near_tie_loops_run_a_fixed_number_of_kernels_whatever_the_data(similarity):
    # near duplicates send queries through the near-tie pass; each of its three loops runs
    # the same kernels per chunk for another dimension, other relevant sets, more ties
    gen = torch.Generator().manual_seed(15)
    n = 240

    def counts(x, y):
        with DispatchCounter("rankwise.retrieval.", watch_host=True) as counter:
            retrieval_metrics(x, y, ks=(1, 10), similarity=similarity, backend="torch")
        per_loop = []
        for name in NEAR_TIE_LOOPS:
            ranges = counter.named(name)
            assert ranges, name
            assert all(r.syncs == [] and r.host_calls == [] for r in ranges)
            per_chunk = {r.kernels for r in ranges}
            assert len(per_chunk) == 1 and max(per_chunk) <= KERNEL_LIMIT, (name, per_chunk)
            per_loop.append(per_chunk.pop())
        return tuple(per_loop)

    def twice(d, copies=2):
        # near copies: one float64 entry moved by a few ulps, so the rows (and their exact keys)
        # differ by far less than the error bound (exact copies would need no pass)
        x = torch.randn(n // copies, d, generator=gen, dtype=torch.float64)
        step = torch.zeros(d, dtype=torch.float64)
        step[0] = 2.0**-50
        return torch.cat([x + k * step for k in range(copies)])

    many = torch.randint(0, 60, (n,), generator=gen)
    few = torch.randint(0, 2, (n,), generator=gen)
    seen = {
        counts(twice(8), many),
        counts(twice(96), many),
        counts(twice(8), few),
        counts(twice(8, copies=6), few),  # every item six times: wider windows, more pairs
    }
    assert len(seen) == 1


def test_no_sync_and_no_numpy_or_numba_inside_the_loop():
    x, labels = _near_duplicates(torch.float32)  # also runs the near-tie pass
    hot = (torch.rand(200, 4, generator=torch.Generator().manual_seed(1)) < 0.4).long()
    for y in (labels, hot):
        for call in (retrieval_metrics, pr_curve):
            with DispatchCounter("rankwise.retrieval.", watch_host=True) as counter:
                call(x, y, chunk_size=64, backend="torch", similarity="euclidean")
            for name in (CHUNK, *NEAR_TIE_LOOPS):
                loop = counter.named(name)
                assert loop, name
                assert all(r.syncs == [] and r.host_calls == [] for r in loop)
                assert max(r.kernels for r in loop) <= KERNEL_LIMIT, name


def test_results_are_read_back_once_per_call():
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(300, 12, generator=gen), torch.randint(0, 7, (300,), generator=gen)
    counter = _count(x, y, chunk_size=40)
    assert len(counter.named(CHUNK)) == 8
    assert not any(counter.named(name) for name in NEAR_TIE_LOOPS)
    (readback,) = counter.named(READBACK)
    assert readback.host_calls == ["Tensor.numpy"]  # the one copy of the per-query buffer


def test_the_counter_sees_syncs_and_host_calls():
    with DispatchCounter("test.", watch_host=True) as counter:
        x = torch.arange(6.0)
        with torch.profiler.record_function("test.range"):
            float(x.sum())
            torch.nonzero(x > 2)
            _ = x[x > 2]
            x.numpy()
            lowest_bit_exponent(np.ones((2, 2)))
            torch.repeat_interleave(torch.tensor([1, 2]))
            torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)
        x.numpy()  # outside every counted range: not seen
    (rng,) = counter.ranges
    names = [s.split(".")[1] for s in rng.syncs]
    assert names == ["_local_scalar_dense", "nonzero", "index", "repeat_interleave"]
    assert rng.host_calls == ["Tensor.numpy", "numba:lowest_bit_exponent"]
    assert torch.Tensor.numpy is torch._C.TensorBase.numpy  # the spies are gone


# ------------------------------------------------------------------ chunks and memory


def test_an_explicit_chunk_size_is_honoured(monkeypatch):
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(230, 10, generator=gen), torch.randint(0, 9, (230,), generator=gen)
    rows = []
    original = LoopOperands.block

    def spy(self, lo, hi):
        rows.append(hi - lo)
        return original(self, lo, hi)

    monkeypatch.setattr(LoopOperands, "block", spy)
    for chunk in (1, 7, 100, 1000):
        rows.clear()
        retrieval_metrics(x, y, chunk_size=chunk, backend="torch")
        assert len(rows) == math.ceil(230 / chunk) and max(rows) == min(chunk, 230)


def test_chunks_are_planned_from_the_memory_budget(monkeypatch):
    n_rel = np.array([3, 5, 9, 2, 4] * 40)
    per_row = 1000 * _device.BYTES_PER_SCORE + 9 * (
        _device.BYTES_PER_SLOT + 5 * _device.BYTES_PER_SLOT_AND_CUTOFF
    )
    plan = _device.plan_chunks(n_rel, 1000, 5, None, 30 * per_row)
    assert [hi - lo for lo, hi, _ in plan] == [30] * 6 + [20]
    assert [w for _, _, w in plan] == [9] * 7
    assert _device.plan_chunks(n_rel, 1000, 5, 64, 1) == [
        (lo, min(lo + 64, 200), 9) for lo in range(0, 200, 64)
    ]
    # CUDA: a fraction of the free memory, capped; read before the loop
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * 2**30, 80 * 2**30))
    assert _device.memory_budget(torch.device("cuda")) == 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    assert _device.memory_budget(torch.device("cuda")) == _device.CUDA_MEMORY_CAP
    monkeypatch.setattr(_device, "_available_ram", lambda: 2**29)
    assert _device.memory_budget(torch.device("cpu")) == 2**27
    # a smaller budget: more, smaller chunks, the same metrics
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(200, 8, generator=gen), torch.randint(0, 5, (200,), generator=gen)
    want = retrieval_metrics(x, y, backend="torch").to_dict()
    monkeypatch.setattr(_device, "memory_budget", lambda device: 200 * _device.BYTES_PER_SCORE * 20)
    counter = _count(x, y)
    assert len(counter.named(CHUNK)) > 1
    assert retrieval_metrics(x, y, backend="torch").to_dict() == want


def test_leave_one_out_prepares_the_float64_operands_once(monkeypatch):
    calls = {"norms": 0, "bits": 0}
    norms, bits = similarity_module._sequential_norms2, similarity_module._lowest_bit_exponent

    def count_norms(x):
        calls["norms"] += 1
        return norms(x)

    def count_bits(x):
        calls["bits"] += 1
        return bits(x)

    monkeypatch.setattr(similarity_module, "_sequential_norms2", count_norms)
    monkeypatch.setattr(similarity_module, "_lowest_bit_exponent", count_bits)
    codes = torch.randint(0, 2, (80, 12), generator=torch.Generator().manual_seed(3)).float()
    y = torch.arange(80) % 7
    for gallery in (None, codes):  # omitted, or the very same tensor
        calls.update(norms=0, bits=0)
        kwargs = {} if gallery is None else dict(gallery=codes, gallery_labels=y, exclude_self=True)
        retrieval_metrics(codes, y, backend="torch", **kwargs)
        assert calls == {"norms": 1, "bits": 1}
    calls.update(norms=0, bits=0)
    retrieval_metrics(codes, y, codes.clone(), y, exclude_self=True, backend="torch")
    assert calls == {"norms": 2, "bits": 2}  # a copy is another tensor: both sides


def test_leave_one_out_scales_the_euclidean_approximation_once(monkeypatch):
    from rankwise.metrics import _scores

    calls = []
    original = _scores.safe_row_norms

    def spy(x):
        calls.append(x.shape[0])
        return original(x)

    monkeypatch.setattr(_scores, "safe_row_norms", spy)
    gen = torch.Generator().manual_seed(16)
    x, y = torch.randn(90, 6, generator=gen), torch.randint(0, 5, (90,), generator=gen)
    kwargs = dict(similarity="euclidean", ks=(1, 5), backend="torch")
    two_sides = retrieval_metrics(x, y, x.clone(), y, exclude_self=True, **kwargs)
    n_two_sides = len(calls)
    calls.clear()
    shared = retrieval_metrics(x, y, **kwargs)
    # the centred and the scaled rows' norms once, not once per side
    assert len(calls) == n_two_sides - 2
    assert shared.to_dict() == two_sides.to_dict()


# ------------------------------------------------------------------ the pieces


@pytest.mark.parametrize("sim", ["cosine", "dot", "euclidean"])
def test_pair_keys_of_the_loop_equal_the_numba_keys_bitwise(sim):
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(30, 37, generator=gen, dtype=torch.float64)
    g = torch.randn(50, 37, generator=gen, dtype=torch.float64) * 3
    q[3] = 0  # a zero row: cosine 0
    ops = ExactOperands.build(q, g, sim)
    rows = torch.randint(0, 30, (500,), generator=gen)
    cols = torch.randint(0, 50, (500,), generator=gen)
    want = np.empty(500)
    pair_keys(
        ops.code,
        ops.query.numpy(),
        ops.gallery.numpy(),
        rows.numpy(),
        cols.numpy(),
        ops.query_norm2.numpy(),
        ops.gallery_norm2.numpy(),
        want,
    )
    q_t, g_t = ops.transposed_operands()
    np.testing.assert_array_equal(
        transposed_pair_keys(ops.code, q_t, g_t, rows, cols).numpy(), want
    )
    got = similarity_module._torch_keys(
        ops.code,
        ops.query[rows],
        ops.gallery[cols],
        ops.query_norm2[rows],
        ops.gallery_norm2[cols],
        pairs=True,
    )
    np.testing.assert_array_equal(got.numpy(), want)


def test_sequential_column_sums_add_in_order():
    gen = torch.Generator().manual_seed(9)
    terms = torch.randn(200, 7, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -8, 8, (200, 7), generator=gen
    )
    want = torch.zeros(7, dtype=torch.float64)
    for k in range(200):
        want = want + terms[k]
    assert torch.equal(sequential_column_sums(terms), want)
    assert torch.equal(sequential_column_sums(terms[:, :1]), want[:1])


def test_device_lowest_bit_scan_equals_the_kernel():
    gen = torch.Generator().manual_seed(10)
    for x in (
        torch.randn(20, 9, generator=gen, dtype=torch.float64),
        torch.tensor([[0.5, 0.25], [3.0, 0.0]], dtype=torch.float64),
        torch.tensor([[5e-324, -1.0]], dtype=torch.float64),
        torch.randint(-50, 50, (6, 6), generator=gen).to(torch.float64) * 2.0**-7,
        torch.zeros(2, 3, dtype=torch.float64),
    ):
        assert int(similarity_module._lowest_bit_exponent_torch(x)) == int(
            lowest_bit_exponent(x.numpy())
        )


def test_harmonic_table_prefixes_do_not_change_when_it_grows():
    small = harmonic_table(1000).copy()
    harmonic_table(50_000)
    np.testing.assert_array_equal(harmonic_table(1000), small)
    assert not harmonic_table(10).flags.writeable


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_take_the_torch_path_and_match_the_cpu():
    gen = torch.Generator().manual_seed(7)
    x, labels = _codes(500, 12, gen), torch.randint(0, 5, (500,), generator=gen)
    cpu = retrieval_metrics(x, labels).to_dict()
    cuda = retrieval_metrics(x.cuda(), labels.cuda()).to_dict()
    assert cuda == cpu
    xf = torch.randn(400, 32, generator=gen)
    assert (
        retrieval_metrics(xf.cuda(), labels[:400].cuda()).to_dict()
        == retrieval_metrics(xf, labels[:400]).to_dict()
    )


def test_reduced_float32_matmul_precision_never_scores_exact_blocks_in_it():
    # integer codes are scored by an exact matmul; TF32 / bf16 passes (a GPU's "medium") would
    # round a float32 one, so the exact block is then float64 (this CPU ignores the setting)
    from rankwise.metrics._scores import BlockScorer

    gen = torch.Generator().manual_seed(13)
    codes = torch.randint(-300, 300, (150, 40), generator=gen).to(torch.float32)
    y = torch.randint(0, 5, (150,), generator=gen)
    want = retrieval_metrics(codes, y, similarity="dot", backend="torch").to_dict()
    assert BlockScorer(codes, codes, "dot").loop_operands().dtype == torch.float32
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        assert BlockScorer(codes, codes, "dot").loop_operands().dtype == torch.float64
        assert retrieval_metrics(codes, y, similarity="dot", backend="torch").to_dict() == want
    finally:
        torch.set_float32_matmul_precision(before)
