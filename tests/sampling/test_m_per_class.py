"""Tests of MPerClassBatchSampler: batch composition, coverage, seeding, resume and validation.

References are written independently here: label counts per batch, a brute-force search for the
largest number of batches of distinct classes, and direct replays of the sequence.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from rankwise.sampling import MPerClassBatchSampler


def make_labels(class_sizes, shuffle_seed=0):
    labels = np.repeat(np.arange(len(class_sizes)), class_sizes)
    return np.random.default_rng(shuffle_seed).permutation(labels)


def build(labels, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return MPerClassBatchSampler(labels, **kwargs)


@functools.cache
def brute_force_max_batches(chunk_counts: tuple[int, ...], per_batch: int) -> int:
    """Most batches of `per_batch` distinct classes, by exhaustive search over class subsets."""
    best = 0
    present = [c for c, k in enumerate(chunk_counts) if k > 0]
    for subset in itertools.combinations(present, per_batch):
        rest = list(chunk_counts)
        for c in subset:
            rest[c] -= 1
        best = max(best, 1 + brute_force_max_batches(tuple(sorted(rest)), per_batch))
    return best


def check_batch(batch, labels, m, n_classes):
    """Each batch: n_classes blocks of m consecutive indices, one distinct class per block."""
    assert len(batch) == n_classes * m
    block_labels = labels[np.asarray(batch)].reshape(n_classes, m)
    assert (block_labels == block_labels[:, :1]).all(), block_labels
    assert len(set(block_labels[:, 0].tolist())) == n_classes, block_labels


layouts = st.tuples(
    st.lists(st.integers(1, 11), min_size=2, max_size=7),  # class sizes
    st.integers(1, 4),  # m
    st.integers(1, 4),  # classes per batch (clipped to the number of classes)
    st.integers(0, 2**31 - 1),  # seed
    st.booleans(),  # drop_last
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts)
def test_batches_hold_distinct_classes_len_matches_and_drops_are_counted(layout):
    sizes, m, per_batch, seed, drop_last = layout
    per_batch = min(per_batch, len(sizes))
    labels = make_labels(sizes, seed % 7)
    sampler = build(labels, m=m, batch_size=per_batch * m, seed=seed, drop_last=drop_last)
    batches = list(sampler)
    assert len(batches) == len(sampler)

    chunk_counts = tuple(sorted(max(1, -(-n // m)) for n in sizes))
    n_full = brute_force_max_batches(chunk_counts, per_batch)
    for batch in batches[:n_full]:
        check_batch(batch, labels, m, per_batch)
    has_leftover = sum(chunk_counts) > n_full * per_batch
    assert len(batches) == n_full + int(has_leftover and not drop_last)
    if len(batches) == n_full + 1:  # smaller final batch, still distinct classes
        assert not drop_last
        final = batches[-1]
        assert 0 < len(final) < per_batch * m and len(final) % m == 0
        check_batch(final, labels, m, len(final) // m)

    seen = {i for batch in batches for i in batch}
    assert sampler.n_samples_dropped_last_epoch == len(labels) - len(seen)
    # Coverage: a class none of whose chunks was dropped has every one of its samples yielded.
    blocks_per_class = np.bincount(
        [labels[b[0]] for batch in batches for b in np.asarray(batch).reshape(-1, m)],
        minlength=len(sizes),
    )
    for c, n in enumerate(sizes):
        assert blocks_per_class[c] <= max(1, -(-n // m))
        if blocks_per_class[c] == max(1, -(-n // m)):
            assert set(np.flatnonzero(labels == c).tolist()) <= seen
    stats = sampler.epoch_stats()
    assert stats["n_chunks"] == sum(chunk_counts)
    assert stats["n_chunks_dropped"] == sum(chunk_counts) - sum(len(b) // m for b in batches)
    assert stats["n_classes_undersized"] == sum(n < m for n in sizes)


def test_full_coverage_when_chunks_fill_whole_batches():
    # 12 classes: chunk counts sum to 24 = 6 batches x 4 classes, none has more than 6 chunks.
    sizes = [4, 8, 5, 3, 20, 7, 12, 6, 2, 8, 5, 4]
    labels = make_labels(sizes)
    for seed in range(5):
        sampler = build(labels, m=4, batch_size=16, seed=seed)
        batches = list(sampler)
        assert len(batches) == 6
        seen = np.zeros(len(labels), dtype=bool)
        for batch in batches:
            check_batch(batch, labels, 4, 4)
            seen[batch] = True
        assert seen.all()
        assert sampler.n_samples_dropped_last_epoch == 0


def test_every_sample_of_large_enough_classes_appears_when_nothing_is_dropped():
    rng = np.random.default_rng(3)
    sizes = rng.integers(4, 30, size=40).tolist()
    labels = make_labels(sizes)
    sampler = build(labels, m=4, batch_size=32, seed=11, drop_last=False)
    seen = {i for batch in sampler for i in batch}
    assert len(labels) - len(seen) == sampler.n_samples_dropped_last_epoch
    stats = sampler.epoch_stats()
    if stats["n_chunks_dropped"] == 0:
        assert len(seen) == len(labels)
    # At most one leftover chunk per class beyond the final batch can be lost.
    assert stats["n_samples_dropped"] <= 4 * stats["n_chunks_dropped"]


def test_padding_stays_inside_the_class_without_repeats_in_a_chunk():
    labels = make_labels([6, 9, 5, 7])  # every class needs padding with m = 4
    sampler = build(labels, m=4, batch_size=8, seed=0, drop_last=False)
    for batch in sampler:
        for block in np.asarray(batch).reshape(-1, 4):
            assert len(set(block.tolist())) == 4  # class has >= m samples: no duplicate
            assert len(set(labels[block].tolist())) == 1


def test_undersized_classes_are_counted_warned_and_drawn_with_replacement():
    sizes = [1, 2, 10, 12, 9]
    labels = make_labels(sizes)
    with pytest.warns(UserWarning, match="2 of 5 classes have fewer than m=4"):
        sampler = MPerClassBatchSampler(labels, m=4, batch_size=8, seed=0, drop_last=False)
    assert sampler.n_classes_undersized == 2
    assert sampler.epoch_stats()["n_classes_undersized"] == 2
    small = {0: np.flatnonzero(labels == 0), 1: np.flatnonzero(labels == 1)}
    draws = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is emitted once, at construction
        for epoch in range(6):
            sampler.set_epoch(epoch)
            for batch in sampler:
                for block in np.asarray(batch).reshape(-1, 4):
                    label = int(labels[block[0]])
                    if label in small:
                        assert set(block.tolist()) == set(small[label].tolist())
                        draws.add((label, tuple(sorted(block.tolist()))))
    # class 1 has 2 samples, 4 slots: the multiplicities vary across epochs (with replacement).
    assert len({d for d in draws if d[0] == 1}) > 1


def test_same_seed_same_batches_other_epoch_or_seed_differs():
    labels = make_labels([7, 12, 4, 9, 15, 6, 8, 5])
    first = list(build(labels, m=4, batch_size=16, seed=5))
    again = list(build(labels, m=4, batch_size=16, seed=5))
    assert first == again
    other_seed = list(build(labels, m=4, batch_size=16, seed=6))
    assert other_seed != first
    sampler = build(labels, m=4, batch_size=16, seed=5)
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != first
    sampler.set_epoch(0)
    assert list(sampler) == first
    # Without set_epoch a second pass repeats the epoch (like DistributedSampler).
    assert list(sampler) == first


def test_global_random_state_untouched():
    labels = make_labels([5, 9, 13, 4, 2])
    torch.manual_seed(123)
    # The legacy global numpy generator is exactly what the sampler must leave alone.
    np.random.seed(123)  # noqa: NPY002
    torch_state = torch.random.get_rng_state()
    np_state = np.random.get_state()  # noqa: NPY002
    sampler = build(labels, m=2, batch_size=6, seed=1)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        list(sampler)
    sampler.epoch_stats()
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    after = np.random.get_state()  # noqa: NPY002
    assert after[0] == np_state[0] and np.array_equal(after[1], np_state[1])
    assert after[2:] == np_state[2:]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("k", [0, 1, 4, "all"])
def test_resume_yields_exactly_the_remaining_batches_then_the_next_epoch(drop_last, k):
    labels = make_labels([6, 11, 4, 9, 3, 14, 8, 5, 7])
    reference = build(labels, m=3, batch_size=9, seed=42, drop_last=drop_last)
    reference.set_epoch(2)
    epoch2 = list(reference)
    reference.set_epoch(3)
    epoch3 = list(reference)
    k = len(epoch2) if k == "all" else k

    run = build(labels, m=3, batch_size=9, seed=42, drop_last=drop_last)
    run.set_epoch(2)
    iterator = iter(run)
    head = [next(iterator) for _ in range(k)]
    assert head == epoch2[:k]
    state = run.state_dict()
    assert state["epoch"] == 2 and state["batches_yielded"] == k

    resumed = build(labels, m=3, batch_size=9, seed=42, drop_last=drop_last)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # a trainer loop re-entering the saved epoch keeps the offset
    assert len(resumed) == len(epoch2) - k
    assert list(resumed) == epoch2[k:]
    resumed.set_epoch(3)
    assert len(resumed) == len(epoch3)
    assert list(resumed) == epoch3


def test_state_dict_batches_done_overrides_prefetch_and_config_mismatch_raises():
    labels = make_labels([6, 11, 4, 9, 3, 14])
    sampler = build(labels, m=2, batch_size=6, seed=0)
    full = list(sampler)
    state = sampler.state_dict(batches_done=2)  # loader workers prefetched the rest
    resumed = build(labels, m=2, batch_size=6, seed=0)
    resumed.load_state_dict(state)
    assert list(resumed) == full[2:]
    with pytest.raises(ValueError, match="seed"):
        build(labels, m=2, batch_size=6, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="batches_done"):
        sampler.state_dict(batches_done=len(full) + 1)


def test_distributed_replicas_split_each_global_batch():
    labels = make_labels([5, 9, 13, 4, 8, 6, 12, 7, 10, 4])
    global_sampler = build(labels, m=2, batch_size=8, seed=9)
    replicas = [build(labels, m=2, batch_size=8, seed=9, num_replicas=2, rank=r) for r in range(2)]
    assert len(replicas[0]) == len(replicas[1]) == len(global_sampler)
    for shard0, shard1 in zip(*(list(r) for r in replicas), strict=True):
        assert len(shard0) == len(shard1) == 4
        check_batch(shard0 + shard1, labels, 2, 4)  # 4 distinct classes over both replicas
    assert [a + b for a, b in zip(*(list(r) for r in replicas), strict=True)] == list(
        global_sampler
    )


def test_distributed_final_batch_has_equal_length_on_all_replicas():
    labels = make_labels([9, 2, 3, 2, 3, 2])  # one large class leaves chunks over
    samplers = [
        build(labels, m=2, batch_size=8, num_replicas=2, rank=r, drop_last=False) for r in range(2)
    ]
    runs = [list(s) for s in samplers]
    assert len(runs[0]) == len(runs[1]) == len(samplers[0])
    assert [len(b) for b in runs[0]] == [len(b) for b in runs[1]]


def test_works_as_dataloader_batch_sampler():
    labels = make_labels([6, 8, 5, 7, 9, 4])
    dataset = TensorDataset(torch.arange(len(labels)), torch.as_tensor(labels))
    sampler = build(torch.as_tensor(labels), m=2, batch_size=6, seed=3)
    loader = DataLoader(dataset, batch_sampler=sampler)
    assert len(loader) == len(sampler)
    n = 0
    for (index, label), expected in zip(loader, list(sampler), strict=True):
        assert index.tolist() == expected
        assert torch.equal(label, torch.as_tensor(labels)[index])
        assert label.view(3, 2).unique().numel() == 3
        n += 1
    assert n == len(sampler)


def test_accepts_list_numpy_and_tensor_labels():
    labels = make_labels([4, 6, 5])
    as_list = list(build(labels.tolist(), m=2, batch_size=4, seed=0))
    assert as_list == list(build(labels, m=2, batch_size=4, seed=0))
    assert as_list == list(build(torch.as_tensor(labels), m=2, batch_size=4, seed=0))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"m": 3, "batch_size": 8}, "`batch_size`.*multiple of `m`"),
        ({"m": 0, "batch_size": 8}, "`m` must be >= 1"),
        ({"m": 2, "batch_size": 12}, "`batch_size`.*more classes per batch than exist"),
        ({"m": 2, "batch_size": 4, "num_replicas": 3}, "`num_replicas`"),
        ({"m": 2, "batch_size": 4, "num_replicas": 2, "rank": 2}, "`rank`"),
        ({"m": 2, "batch_size": 4, "seed": -1}, "`seed`"),
        ({"m": 2.0, "batch_size": 4}, "`m` must be an integer"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, match):
    labels = make_labels([4, 4, 4, 4, 4])
    with pytest.raises(ValueError, match=match):
        MPerClassBatchSampler(labels, **kwargs)


@pytest.mark.parametrize(
    ("labels", "match"),
    [
        (np.zeros((4, 2), dtype=np.int64), "`labels` must be a 1-D"),
        (np.array([0.5, 1.0, 2.0, 1.5]), "`labels` must hold integer"),
        (np.array([True, False, True, False]), "`labels` must hold integer"),
        (np.zeros(10, dtype=np.int64), "`labels` must hold at least 2 distinct classes"),
        (np.zeros(0, dtype=np.int64), "`labels` must hold at least 2 distinct classes"),
    ],
)
def test_invalid_labels_name_the_argument(labels, match):
    with pytest.raises(ValueError, match=match):
        MPerClassBatchSampler(labels, m=1, batch_size=1)
