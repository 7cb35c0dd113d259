"""P x K batches for data-parallel training: each rank draws a disjoint shard of every global batch.

The stochastic AUPRC estimator of Wen et al. (NeurIPS 2022, Sec. 4, App. D) and the other listwise
losses need the *global* batch (the all-gathered embeddings) to hold ``P`` classes with ``m``
samples each. :class:`DistributedMPerClassBatchSampler` plans every epoch exactly as
:class:`~rankwise.sampling.MPerClassBatchSampler` does with the same seed and hands each rank
whole classes of every batch, so that per-rank statistics (batch norm without synchronisation,
diagnostics) still see P x K data.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from .._distributed import rank_and_world_size, require_process_group
from .m_per_class import MPerClassBatchSampler

__all__ = ["DistributedMPerClassBatchSampler"]


class DistributedMPerClassBatchSampler(MPerClassBatchSampler):
    """:class:`~rankwise.sampling.MPerClassBatchSampler` sharded across data-parallel ranks.

    Rank ``r`` yields the r-th of ``num_replicas`` equal slices of the classes of each global
    batch, all ``m`` samples of a class together. The shards of one batch are disjoint, their
    union in rank order is the batch :class:`MPerClassBatchSampler` yields with the same
    arguments, and every rank yields the same number of batches per epoch. ``set_epoch``,
    ``state_dict`` and ``load_state_dict`` behave as in the parent class (the position is global;
    a state saved on one rank resumes every rank).

    Args:
        labels, m, seed: as in :class:`MPerClassBatchSampler`, the same on every rank.
        batch_size: the global batch size (over all ranks); ``batch_size / m`` classes per batch
            must be divisible by ``num_replicas``.
        drop_last: as in :class:`MPerClassBatchSampler`; with ``False`` the final smaller batch
            keeps a multiple of ``num_replicas`` leftover classes.
        num_replicas: the number of ranks (default: the world size of the process group).
        rank: this process's rank (default: its rank in the process group).

    Attributes:
        local_batch_size: indices per full batch on this rank, ``batch_size / num_replicas``.
        slot_offset: position of this rank's first index within the global batch,
            ``rank * local_batch_size``; the trainer seeds per-item data transforms by the global
            slot, so augmentations do not depend on the number of ranks.
    """

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray | torch.Tensor,
        m: int,
        batch_size: int,
        seed: int = 0,
        drop_last: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if num_replicas is None or rank is None:
            require_process_group("DistributedMPerClassBatchSampler without num_replicas/rank")
            group_rank, world = rank_and_world_size()
            num_replicas = world if num_replicas is None else num_replicas
            rank = group_rank if rank is None else rank
        super().__init__(labels, m, batch_size, seed, drop_last, num_replicas, rank)
        self.local_batch_size = self.batch_size // self.num_replicas
        self.slot_offset = self.rank * self.local_batch_size

    @classmethod
    def from_sampler(
        cls, sampler: MPerClassBatchSampler, num_replicas: int, rank: int
    ) -> DistributedMPerClassBatchSampler:
        """The shard of ``rank`` of the batches of a single-process sampler.

        Args:
            sampler: an unsharded :class:`MPerClassBatchSampler` (``num_replicas == 1``); its
                ``batch_size`` becomes the global batch size.
            num_replicas: the number of ranks.
            rank: this process's rank.

        Returns:
            A sampler with the same labels, ``m``, ``batch_size``, ``seed`` and ``drop_last``,
            at the same epoch.
        """
        if sampler.num_replicas != 1:
            raise ValueError(
                f"`sampler` is already sharded (num_replicas={sampler.num_replicas}); pass an "
                "unsharded MPerClassBatchSampler or build the distributed one directly."
            )
        labels = np.empty(sampler.num_samples, dtype=np.int64)
        labels[sampler._indices_by_class] = sampler.class_ids[sampler._codes_sorted]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # `sampler` already warned about undersized classes
            shard = cls(
                labels,
                sampler.m,
                sampler.batch_size,
                seed=sampler.seed,
                drop_last=sampler.drop_last,
                num_replicas=num_replicas,
                rank=rank,
            )
        shard.set_epoch(sampler.epoch)
        return shard
