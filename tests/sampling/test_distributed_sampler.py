"""DistributedMPerClassBatchSampler: disjoint whole-class shards that cover every global batch."""

from __future__ import annotations

import numpy as np
import pytest

from rankwise.sampling import DistributedMPerClassBatchSampler, MPerClassBatchSampler


def labels_with_uneven_classes(seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(3, 19, size=23)  # some classes below m (drawn with replacement)
    return np.repeat(np.arange(23), sizes)[rng.permutation(sizes.sum())]


def shards(labels, world, epoch=0, **kwargs):
    samplers = [
        DistributedMPerClassBatchSampler(labels, num_replicas=world, rank=r, **kwargs)
        for r in range(world)
    ]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return samplers, [list(s) for s in samplers]


@pytest.mark.filterwarnings("ignore:MPerClassBatchSampler")
@pytest.mark.parametrize("world", [2, 3, 6])
@pytest.mark.parametrize("drop_last", [True, False])
def test_shards_are_disjoint_whole_classes_and_cover_the_global_batch(world, drop_last):
    labels = labels_with_uneven_classes()
    settings = {"m": 4, "batch_size": 24, "seed": 9, "drop_last": drop_last}
    single = MPerClassBatchSampler(labels, **settings)
    single.set_epoch(1)
    global_batches = list(single)
    samplers, per_rank = shards(labels, world, epoch=1, **settings)
    assert len({len(batches) for batches in per_rank}) == 1  # every rank: as many batches
    assert all(len(s) == len(per_rank[0]) for s in samplers)
    for position, batch_shards in enumerate(zip(*per_rank, strict=True)):
        concatenated = [i for shard in batch_shards for i in shard]
        full_batch = position < len(global_batches) - (0 if drop_last else 1)
        if full_batch:
            # the union, in rank order, is the one-process batch in its order
            assert concatenated == global_batches[position]
        else:  # the final smaller batch keeps a multiple of `world` leftover classes
            assert set(concatenated) <= set(global_batches[position])
        classes = [set(labels[shard]) for shard in batch_shards]
        for r, shard in enumerate(batch_shards):
            assert len(shard) == len(batch_shards[0])
            assert all(np.sum(labels[shard] == c) == 4 for c in classes[r])  # m per class
            for other in range(r + 1, world):
                assert not classes[r] & classes[other]  # a class lives on one rank only
    offsets = [s.slot_offset for s in samplers]
    assert offsets == [r * 24 // world for r in range(world)]


@pytest.mark.filterwarnings("ignore:MPerClassBatchSampler")
def test_resume_state_is_global_and_continues_every_shard():
    labels = labels_with_uneven_classes(1)
    settings = {"m": 4, "batch_size": 16, "seed": 3}
    _, per_rank = shards(labels, 2, epoch=2, **settings)
    for rank in (0, 1):
        fresh = DistributedMPerClassBatchSampler(labels, num_replicas=2, rank=rank, **settings)
        fresh.set_epoch(2)
        it = iter(fresh)
        done = [next(it) for _ in range(3)]
        state = fresh.state_dict()
        assert state["epoch"] == 2 and state["batches_yielded"] == 3
        # a state saved on rank 0 resumes rank 1 too: the position is global
        restored = DistributedMPerClassBatchSampler(
            labels, num_replicas=2, rank=1 - rank, **settings
        )
        restored.load_state_dict(state)
        restored.set_epoch(2)
        assert list(restored) == per_rank[1 - rank][3:]
        assert done == per_rank[rank][:3]


@pytest.mark.filterwarnings("ignore:MPerClassBatchSampler")
def test_from_sampler_keeps_every_setting_and_bad_worlds_are_named():
    labels = labels_with_uneven_classes(2)
    single = MPerClassBatchSampler(labels, m=4, batch_size=16, seed=5, drop_last=False)
    single.set_epoch(3)
    shard = DistributedMPerClassBatchSampler.from_sampler(single, num_replicas=2, rank=1)
    assert (shard.m, shard.batch_size, shard.seed, shard.drop_last, shard.epoch) == (
        4,
        16,
        5,
        False,
        3,
    )
    assert shard.local_batch_size == 8 and shard.slot_offset == 8
    with pytest.raises(ValueError, match="must divide the classes per batch"):
        DistributedMPerClassBatchSampler(labels, m=4, batch_size=12, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="already sharded"):
        DistributedMPerClassBatchSampler.from_sampler(shard, num_replicas=2, rank=0)
    with pytest.raises(RuntimeError, match="initialized process group"):
        DistributedMPerClassBatchSampler(labels, m=4, batch_size=16)
    with pytest.raises(ValueError, match=r"`rank` must be in \[0, num_replicas=2\)"):
        DistributedMPerClassBatchSampler(labels, m=4, batch_size=16, num_replicas=2, rank=2)
