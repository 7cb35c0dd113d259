"""The torch counting path (rankwise.metrics._sorted) against the numba counting kernel, exactly."""

import numpy as np
import pytest
import torch

from rankwise.metrics import _sorted
from rankwise.metrics._kernels import relevant_group_counts_from_lists, relevant_lists_from_mask
from rankwise.metrics._scores import BlockScorer
from rankwise.metrics._sorted import (
    STRATEGIES,
    RelevantLists,
    class_relevant_lists,
    mask_relevant_lists,
    sorted_row_counts,
)
from rankwise.metrics.retrieval import _ClassIndex, pr_curve, retrieval_metrics


@pytest.fixture(params=["flat_key", "row_wise"])
def row_sort(request, monkeypatch):
    """Both row sorts: the CPU's flat int64-key sort in small parts, and torch's row-wise sort
    (the one CUDA takes)."""
    if request.param == "flat_key":
        monkeypatch.setattr(_sorted, "FLAT_SORT_PART", 700)  # several parts, some of one row
    else:
        monkeypatch.setattr(_sorted, "FLAT_KEY_SORT_DEVICES", frozenset())
    return request.param


def _assert_same_counts(a, b):
    for name in ("n_groups", "greater", "size", "relevant"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def _numba_counts(scores, relevant, self_index):
    si = None if self_index is None else self_index.numpy()
    rel_ptr, rel_cols = relevant_lists_from_mask(relevant.numpy(), si)
    return relevant_group_counts_from_lists(scores.numpy(), rel_ptr, rel_cols, si)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("kind", ["float32", "float64", "codes", "few_values", "adjacent_ulps"])
def test_sorted_row_counts_equal_the_numba_kernel(row_sort, strategy, kind):
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
    lists = mask_relevant_lists(relevant, self_index)
    ours = sorted_row_counts(scores, lists, self_index, strategy=strategy)
    _assert_same_counts(ours, _numba_counts(scores, relevant, self_index))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_approximate_blocks_count_the_exact_keys(row_sort, strategy, similarity):
    # near-duplicate float64 embeddings: the float32 approximation cannot order or tie them
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(1, 16, generator=gen, dtype=torch.float64)
    steps = torch.randint(-2, 3, (120, 16), generator=gen).to(torch.float64)
    x = torch.cat([base + 1e-9 * steps, torch.randn(80, 16, generator=gen, dtype=torch.float64)])
    labels = torch.randint(0, 4, (200,), generator=gen)
    scorer = BlockScorer(x, x, similarity, approximate=True)
    assert scorer.mode == "approximate"
    block = scorer.block(0, 200)
    self_index = torch.arange(200)
    relevant = labels[:, None] == labels[None, :]
    lists = mask_relevant_lists(relevant, self_index)
    ours = sorted_row_counts(
        block.values,
        lists,
        self_index,
        bound=torch.from_numpy(block.bound),
        exact_keys=scorer.pair_keys_tensor,
        strategy=strategy,
    )
    exact = scorer.keys(0, 200)
    _assert_same_counts(ours, _numba_counts(exact, relevant, self_index))


@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("part", [1, 5, 700, 2**20])
def test_flat_key_sort_orders_rows_like_torch_sort(monkeypatch, descending, part):
    # signed zeros, infinities, subnormals, the float32 extremes, heavy ties and random values
    special = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), 1e-45, -1e-45, 1.2e-38, -1.2e-38, 3.4e38,
         -3.4e38, 1.0, -1.0, 1.0000001, -1.0000001],
        dtype=torch.float32,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    picks = special[torch.randint(0, special.numel(), (9, 120), generator=gen)]
    values = torch.cat([picks, torch.randn(4, 120, generator=gen)]).t().contiguous().t()
    monkeypatch.setattr(_sorted, "FLAT_SORT_PART", part)
    ours, columns = _sorted._sort_rows(values, descending=descending)
    expected = torch.sort(values, dim=1, descending=descending).values
    assert torch.equal(ours, expected)  # == on floats: -0.0 and 0.0 tie, as in torch.sort
    assert torch.equal(values.gather(1, columns), ours)
    assert torch.equal(torch.sort(columns, dim=1).values, torch.arange(120).expand(13, 120))


@pytest.mark.parametrize(("fraction", "expected"), [(0.002, "sort"), (0.3, "segment")])
def test_auto_strategy_follows_the_relevant_fraction(monkeypatch, fraction, expected):
    import rankwise.metrics._sorted as sorted_module

    taken = []
    original = sorted_module._relevant_item_counts

    def spy(*args):
        taken.append(args[-1])
        return original(*args)

    monkeypatch.setattr(sorted_module, "_relevant_item_counts", spy)
    gen = torch.Generator().manual_seed(8)
    scores = torch.randn(20, 1000, generator=gen)
    relevant = torch.rand(20, 1000, generator=gen) < fraction
    lists = mask_relevant_lists(relevant, None)
    ours = sorted_row_counts(scores, lists)
    assert taken == [expected]
    _assert_same_counts(ours, _numba_counts(scores, relevant, None))


def test_class_lists_equal_the_mask_lists():
    gen = torch.Generator().manual_seed(5)
    gallery_labels = torch.randint(0, 6, (50,), generator=gen)
    query_labels = torch.cat([gallery_labels[:20], torch.tensor([99])])  # 99: not in the gallery
    self_index = torch.cat([torch.arange(20), torch.tensor([-1])])
    index = _ClassIndex.build(query_labels, gallery_labels)
    lists = class_relevant_lists(
        *(torch.from_numpy(a) for a in (index.query_class, index.class_ptr, index.members)),
        self_index,
    )
    mask = mask_relevant_lists(query_labels[:, None] == gallery_labels[None, :], self_index)
    assert torch.equal(lists.rows, mask.rows) and torch.equal(lists.cols, mask.cols)


def test_sorted_row_counts_rejects_bad_arguments():
    lists = RelevantLists(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="strategy"):
        sorted_row_counts(torch.zeros(1, 3), lists, strategy="bubble")
    with pytest.raises(ValueError, match="exact_keys"):
        sorted_row_counts(torch.zeros(1, 3), lists, bound=torch.zeros(1, dtype=torch.float64))


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_take_the_torch_path_and_match_the_cpu():
    gen = torch.Generator().manual_seed(7)
    x, labels = _codes(500, 12, gen), torch.randint(0, 5, (500,), generator=gen)
    cpu = retrieval_metrics(x, labels).to_dict()
    cuda = retrieval_metrics(x.cuda(), labels.cuda()).to_dict()
    assert cuda == cpu
