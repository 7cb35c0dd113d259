"""Resumable, seeded batches for the training loop and what a dataset must provide for them.

A P x K batch sampler (Wen et al., NeurIPS 2022, App. D: ``batch_size / m`` classes with exactly
``m`` samples each) started at any (epoch, batch) position; an item's random transform is seeded
by ``(seed, epoch, batch, slot)``, so a resumed run sees exactly the batches of an uninterrupted
one, whatever ``num_workers`` is.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

if TYPE_CHECKING:
    from ..sampling import MPerClassBatchSampler

__all__ = [
    "BatchSampler",
    "LoaderBatches",
    "PositionedBatches",
    "SeededItems",
    "dataset_labels",
    "default_sampler",
    "mix_seed",
    "training_loader",
    "worker_init",
]


@runtime_checkable
class BatchSampler(Protocol):
    """What the trainer needs of a batch sampler: an iterable of index lists with a length.

    A ``set_epoch(epoch)`` method (as :class:`~rankwise.sampling.MPerClassBatchSampler` has)
    makes each epoch's batches reproducible, which bit-for-bit resumption needs.
    """

    def __iter__(self) -> Iterator[list[int]]: ...

    def __len__(self) -> int: ...


def mix_seed(*parts: int) -> int:
    """splitmix64 over the parts: decorrelated 63-bit seeds from small integers.

    Args:
        *parts: integers, e.g. ``(seed, epoch, batch, slot)``.

    Returns:
        A non-negative seed below 2**63.
    """
    mask = (1 << 64) - 1
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state + (int(part) & mask) + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        state = z ^ (z >> 31)
    return state >> 1


def dataset_labels(dataset: Dataset, name: str = "train_data") -> np.ndarray:
    """The (N,) int64 class ids of a dataset, without loading its items.

    From a ``labels`` attribute, or the second tensor of ``TensorDataset(inputs, labels)``.

    Args:
        dataset: the dataset.
        name: the argument it was passed as, for the error message.

    Returns:
        The labels as a numpy array.
    """
    labels: Any = getattr(dataset, "labels", None)
    if labels is None and isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        labels = dataset.tensors[1]
    if labels is None:
        raise ValueError(
            f"`{name}` ({type(dataset).__name__}) has no `labels` attribute: the trainer needs "
            "the (N,) class id of every item, without loading the items, to draw P x K batches "
            "and to evaluate. Give the dataset a `labels` array (or use "
            "TensorDataset(inputs, labels)), or pass your own `sampler`."
        )
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    array = np.asarray(labels)
    if array.ndim != 1 or array.shape[0] != len(dataset):  # type: ignore[arg-type]
        raise ValueError(
            f"`{name}.labels` must hold one class id per item ({len(dataset)}), got shape "  # type: ignore[arg-type]
            f"{array.shape}."
        )
    if array.dtype.kind not in "iu":
        raise ValueError(f"`{name}.labels` must hold integer class ids, got dtype {array.dtype}.")
    return array.astype(np.int64, copy=False)


def default_sampler(labels: np.ndarray, seed: int) -> MPerClassBatchSampler:
    """The trainer's default sampler: ``m = 4`` per class, ``min(32, 4 x classes)`` per batch.

    Args:
        labels: (N,) class ids of the training data.
        seed: the trainer's seed.

    Returns:
        A :class:`~rankwise.sampling.MPerClassBatchSampler`.
    """
    from ..sampling import MPerClassBatchSampler

    n_classes = int(np.unique(labels).size)
    if n_classes < 2:
        raise ValueError(
            f"`train_data` holds {n_classes} class(es); ranking losses need at least 2 classes "
            "(a query's negatives come from the other classes)."
        )
    return MPerClassBatchSampler(labels, m=4, batch_size=4 * min(8, n_classes), seed=seed)


class PositionedBatches:
    """Batch sampler yielding ``(index, item_seed, epoch, position)`` tuples forever.

    Starts at batch ``position`` of ``epoch``; epoch and position travel with the items, so the
    trainer knows which batch it consumed even when DataLoader workers prefetch ahead.

    Args:
        sampler: the batch sampler.
        seed: seed of the items' transform seeds.
        epoch: the epoch to start in.
        position: the batch of that epoch to start at.
    """

    def __init__(self, sampler: Iterable[list[int]], seed: int, epoch: int, position: int) -> None:
        self.sampler = sampler
        self.seed = seed
        self.epoch = epoch
        self.position = position

    def __iter__(self) -> Iterator[list[tuple[int, int, int, int]]]:
        """Yield the batches from the start position on, epoch after epoch."""
        epoch, skip = self.epoch, self.position
        # a data-parallel shard seeds its items by their slot in the global batch, so the
        # augmentations do not depend on the number of ranks
        offset = int(getattr(self.sampler, "slot_offset", 0))
        while True:
            set_epoch = getattr(self.sampler, "set_epoch", None)
            if set_epoch is not None:
                set_epoch(epoch)
            produced = 0
            for position, batch in enumerate(self.sampler):
                produced += 1
                if position < skip:
                    continue
                yield [
                    (int(index), mix_seed(self.seed, epoch, position, slot), epoch, position)
                    for slot, index in enumerate(batch, start=offset)
                ]
            if produced == 0:
                raise RuntimeError("the batch sampler produced no batch in an epoch.")
            epoch, skip = epoch + 1, 0


class SeededItems(Dataset):
    """Wraps a dataset so every item's random transform is seeded by its batch coordinates.

    Args:
        dataset: the training data; ``dataset[i]`` returns ``(x, label)``.
        reseed: seed the global RNGs per item (off for datasets whose ``transform`` is ``None``:
            nothing random happens, and forking the RNG state per item would cost time).
    """

    def __init__(self, dataset: Dataset, reseed: bool) -> None:
        self.dataset = dataset
        self.reseed = reseed

    def __len__(self) -> int:
        """The wrapped dataset's length."""
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int, int, int]) -> tuple[Any, Any, torch.Tensor]:
        """``(x, label, tensor([epoch, position]))`` of ``key = (index, seed, epoch, position)``."""
        return self.__getitems__([key])[0]

    def __getitems__(
        self, keys: Sequence[tuple[int, int, int, int]]
    ) -> list[tuple[Any, Any, torch.Tensor]]:
        """The items of a batch of keys, as :meth:`__getitem__` gives them one by one.

        The global RNG states are saved and restored once per batch, not per item (half the
        loader time of an augmented 224-item batch).

        Args:
            keys: ``(index, seed, epoch, position)`` tuples.

        Returns:
            One ``(x, label, tensor([epoch, position]))`` per key.
        """
        if not self.reseed:
            return [self._item(key) for key in keys]
        np_state, py_state = np.random.get_state(), random.getstate()  # noqa: NPY002
        with torch.random.fork_rng(devices=[]):
            try:
                return [self._item(key, seeded=True) for key in keys]
            finally:
                np.random.set_state(np_state)  # noqa: NPY002
                random.setstate(py_state)

    def _item(
        self, key: tuple[int, int, int, int], seeded: bool = False
    ) -> tuple[Any, Any, torch.Tensor]:
        index, item_seed, epoch, position = key
        if seeded:
            # the CPU generator only: torch.manual_seed would also (lazily) seed accelerator
            # generators, which fork_rng(devices=[]) does not restore, at ~1 ms per item
            torch.default_generator.manual_seed(item_seed)
            np.random.seed(item_seed % (2**32))  # noqa: NPY002
            random.seed(item_seed)
        # a dataset that takes the seed explicitly (ImageFolderDataset) draws its views from it
        # alone; others read the global RNGs seeded above
        seeded_item = getattr(self.dataset, "seeded_item", None)
        x, label = self.dataset[index] if seeded_item is None else seeded_item(index, item_seed)
        return x, label, torch.tensor([epoch, position], dtype=torch.int64)


def worker_init(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a distinct, reproducible numpy / python stream per worker.

    Args:
        worker_id: the worker's index (unused: ``torch.initial_seed()`` already differs).
    """
    worker_seed = torch.initial_seed() % (2**32)
    np.random.seed(worker_seed)  # noqa: NPY002
    random.seed(worker_seed)


def training_loader(
    dataset: Dataset,
    sampler: Iterable[list[int]],
    *,
    seed: int,
    epoch: int,
    position: int,
    num_workers: int,
    pin_memory: bool,
) -> DataLoader:
    """The DataLoader of a ``fit`` call, starting at batch ``position`` of ``epoch``.

    Args:
        dataset: the training data (see :class:`SeededItems`).
        sampler: the batch sampler.
        seed: the trainer's seed.
        epoch: see :class:`PositionedBatches`.
        position: see :class:`PositionedBatches`.
        num_workers: DataLoader worker processes (batches do not depend on it).
        pin_memory: pin host memory (for CUDA).

    Returns:
        A loader of ``(x, y, meta)`` batches, ``meta[:, 0]`` the epoch, ``meta[:, 1]`` the batch.
    """
    reseed = getattr(dataset, "transform", True) is not None
    return DataLoader(
        SeededItems(dataset, reseed),
        batch_sampler=PositionedBatches(sampler, seed, epoch, position),
        num_workers=num_workers,
        worker_init_fn=worker_init,
        generator=torch.Generator().manual_seed(mix_seed(seed, epoch, position)),
        pin_memory=pin_memory,
    )


class LoaderBatches:
    """A Trainer's batches when it is given no ``batch_source``: the loader of its sampler.

    A :class:`~rankwise.training.options.BatchSource`; each call starts a
    :func:`training_loader` at the given position.

    Args:
        dataset: the training data.
        sampler: the batch sampler.
        seed: the trainer's seed.
        num_workers: DataLoader worker processes (batches do not depend on it).
        device: where the batches go (host memory is pinned for CUDA).
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: Iterable[list[int]],
        seed: int,
        num_workers: int,
        device: torch.device,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.seed = seed
        self.num_workers = num_workers
        self.pin_memory = device.type == "cuda"

    def batches(self, step: int, epoch: int, position: int) -> Iterator[Any]:
        """The ``(x, y, meta)`` batches from batch ``position`` of ``epoch`` on (``step`` unused)."""
        del step  # the sampler's position says where the batches continue
        loader = training_loader(
            self.dataset,
            self.sampler,
            seed=self.seed,
            epoch=epoch,
            position=position,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )
        return iter(loader)
