"""P x K ("m per class") batch sampler for ranking losses.

Every ranking loss in rankwise needs, for each anchor, positives and negatives inside the batch; the
stochastic AUPRC estimator of Wen et al. (NeurIPS 2022, Sec. 4 and App. D) and the batch-hard /
batch-all AUC loss of Gajić et al. (Sec. 4) are trained on batches of ``P`` classes with ``m``
samples each. This module builds such batches reproducibly: each epoch, every class's shuffled
indices are cut into chunks of ``m`` (a last, incomplete chunk padded with other samples of the
class, a class with fewer than ``m`` samples completed by draws with replacement), and the chunks
are grouped by weighted sampling into the largest possible number of batches of
``P = batch_size / m`` distinct classes (:func:`_max_full_batches`: ``len()`` depends only on the
class sizes); the leftover chunks are dropped or form a smaller final batch (``drop_last``,
docs/losses.md). All randomness comes from a private ``numpy.random.Generator`` seeded by
``(seed, epoch)``; the global torch / numpy generators are never touched.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from .._validation import as_tensor, check_labels

__all__ = ["MPerClassBatchSampler"]

_STATE_CONFIG_KEYS = ("seed", "m", "batch_size", "num_samples", "drop_last", "num_replicas")


def _check_int(value: Any, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    return int(value)


def _max_full_batches(chunks_per_class: np.ndarray, classes_per_batch: int) -> int:
    """Largest B with sum_c min(k_c, B) >= P * B: the most batches of P distinct classes.

    The condition is necessary (a class fills at most one slot per batch) and sufficient (see
    :meth:`MPerClassBatchSampler._plan_epoch`). ``sum_c min(k_c, B) - P * B`` is concave in B and
    0 at B = 0, so the feasible B form an interval [0, B*] and a bisection finds B*.
    """
    lo, hi = 0, int(chunks_per_class.sum()) // classes_per_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int(np.minimum(chunks_per_class, mid).sum()) >= classes_per_batch * mid:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _weighted_top_k(
    rng: np.random.Generator, candidates: np.ndarray, weights: np.ndarray, k: int
) -> np.ndarray:
    """Draw k ``candidates`` without replacement ∝ ``weights`` (Gumbel top-k, Plackett-Luce)."""
    if k == 0:
        return candidates[:0]
    if k == candidates.size:
        return candidates
    keys = np.log(weights.astype(np.float64)) + rng.gumbel(size=candidates.size)
    return candidates[np.argpartition(-keys, k - 1)[:k]]


class MPerClassBatchSampler(Sampler[list[int]]):
    """Batch sampler yielding ``batch_size / m`` distinct classes x ``m`` samples per batch.

    Use it as ``DataLoader(dataset, batch_sampler=sampler)``; call :meth:`set_epoch` at the start
    of every epoch (as with ``DistributedSampler``), otherwise every pass repeats the same epoch.

    Args:
        labels: (N,) integer class id of every dataset item (numpy array, list or tensor).
        m: samples per class in a batch, >= 1.
        batch_size: global batch size (summed over replicas); a multiple of ``m`` with
            ``batch_size / m`` <= number of classes.
        seed: non-negative int; batches depend only on ``(seed, epoch)`` and the labels.
        drop_last: drop the chunks that fit in no full batch (default). When False, one smaller
            final batch holds one leftover chunk of each class that still has one (it can have
            a single class, i.e. no negatives).
        num_replicas: number of distributed processes sharing each global batch; each replica
            gets ``batch_size / m / num_replicas`` of the batch's classes (all ``m`` samples of
            a class stay on one replica). Every replica must use the same seed and labels.
        rank: this process's replica index in ``[0, num_replicas)``.

    Attributes:
        classes_per_batch: ``batch_size // m`` (global, over all replicas).
        num_classes: number of distinct labels.
        n_classes_undersized: classes with fewer than ``m`` samples (drawn with replacement).
        epoch: the epoch the next iteration plans.

    Yields:
        lists of ``batch_size // num_replicas`` (fewer for a final ``drop_last=False`` batch)
        dataset indices, class-contiguous (``m`` consecutive indices share a label).

    Resuming: save :meth:`state_dict` with the checkpoint; after :meth:`load_state_dict` the
    batches, this epoch's remaining ones and every later epoch's, are those of an uninterrupted run.
    """

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray | torch.Tensor,
        m: int,
        batch_size: int,
        seed: int = 0,
        drop_last: bool = True,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        self.m = _check_int(m, "m", 1)
        self.batch_size = _check_int(batch_size, "batch_size", 1)
        self.seed = _check_int(seed, "seed", 0)
        self.num_replicas = _check_int(num_replicas, "num_replicas", 1)
        self.rank = _check_int(rank, "rank", 0)
        if not isinstance(drop_last, (bool, np.bool_)):
            raise ValueError(f"`drop_last` must be a bool, got {drop_last!r}.")
        self.drop_last = bool(drop_last)
        if self.rank >= self.num_replicas:
            raise ValueError(
                f"`rank` must be in [0, num_replicas={self.num_replicas}), got {self.rank}."
            )
        if self.batch_size % self.m != 0:
            raise ValueError(
                f"`batch_size` ({self.batch_size}) must be a multiple of `m` ({self.m}); "
                f"use e.g. batch_size={max(1, self.batch_size // self.m) * self.m}."
            )
        self.classes_per_batch = self.batch_size // self.m
        if self.classes_per_batch % self.num_replicas != 0:
            raise ValueError(
                f"`num_replicas` ({self.num_replicas}) must divide the classes per batch "
                f"(batch_size / m = {self.classes_per_batch}) so every replica gets whole classes."
            )

        label_tensor = as_tensor(labels, "labels")
        if label_tensor.ndim != 1:
            raise ValueError(
                f"`labels` must be a 1-D array of integer class ids, got shape "
                f"{tuple(label_tensor.shape)}."
            )
        label_array = (
            check_labels(label_tensor, label_tensor.shape[0], "labels", allow_multi_hot=False)
            .cpu()
            .numpy()
        )
        self.num_samples = int(label_array.shape[0])
        self.class_ids, class_codes, class_sizes = np.unique(
            label_array, return_inverse=True, return_counts=True
        )
        self.num_classes = int(self.class_ids.size)
        if self.num_classes < 2:
            raise ValueError(
                f"`labels` must hold at least 2 distinct classes, got {self.num_classes} "
                f"(over {self.num_samples} samples); ranking needs negatives."
            )
        if self.classes_per_batch > self.num_classes:
            raise ValueError(
                f"`batch_size` / m = {self.batch_size} / {self.m} = {self.classes_per_batch} "
                f"classes per batch, more classes per batch than exist ({self.num_classes} in "
                f"`labels`); lower batch_size to at most {self.num_classes * self.m} or raise m."
            )

        self._indices_by_class = np.argsort(class_codes, kind="stable")
        self._class_sizes = class_sizes.astype(np.int64)
        self._class_starts = np.concatenate([[0], np.cumsum(self._class_sizes)[:-1]])
        self._codes_sorted = class_codes[self._indices_by_class]

        self.n_classes_undersized = int((self._class_sizes < self.m).sum())
        if self.n_classes_undersized:
            warnings.warn(
                f"MPerClassBatchSampler: {self.n_classes_undersized} of {self.num_classes} "
                f"classes have fewer than m={self.m} samples; their chunks are completed by "
                "drawing with replacement (duplicate samples in a batch).",
                UserWarning,
                stacklevel=2,
            )

        # Chunk counts depend only on the class sizes, so the epoch length does too.
        self._chunks_per_class = np.maximum(1, -(-self._class_sizes // self.m))
        self._n_full_batches = _max_full_batches(self._chunks_per_class, self.classes_per_batch)
        n_over_cap = int((self._chunks_per_class > self._n_full_batches).sum())
        self._excess_slots = (
            int(np.minimum(self._chunks_per_class, self._n_full_batches).sum())
            - self.classes_per_batch * self._n_full_batches
        )
        # Classes with a chunk left after the full batches: every over-cap class plus one class
        # per excess slot (the excess is taken from distinct classes, see _plan_epoch). Fewer
        # than classes_per_batch, otherwise one more full batch would exist.
        self._n_leftover_classes = n_over_cap + self._excess_slots
        self._final_chunks_per_replica = (
            0 if self.drop_last else self._n_leftover_classes // self.num_replicas
        )
        self._batches_per_epoch = self._n_full_batches + int(self._final_chunks_per_replica > 0)

        self.epoch = 0
        self._position = 0  # batches of `epoch` already handed out
        self._skip = 0  # batches of `epoch` the next iteration skips (set by load_state_dict)
        self._cached_plan: tuple[int, list[np.ndarray], dict[str, int]] | None = None

    # -- epoch planning ------------------------------------------------------------------------
    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))

    def _make_chunks(self, rng: np.random.Generator) -> np.ndarray:
        """(total_chunks, m) dataset indices; class c's chunks are consecutive rows."""
        # A random permutation followed by a stable sort by class shuffles within each class.
        perm = rng.permutation(self.num_samples)
        order = self._indices_by_class[perm[np.argsort(self._codes_sorted[perm], kind="stable")]]
        chunk_class = np.repeat(np.arange(self.num_classes), self._chunks_per_class)
        first_chunk = np.concatenate([[0], np.cumsum(self._chunks_per_class)[:-1]])
        chunk_rank = np.arange(chunk_class.size) - first_chunk[chunk_class]
        size = self._class_sizes[chunk_class][:, None]
        position = chunk_rank[:, None] * self.m + np.arange(self.m)[None, :]
        # Padding of a class with >= m samples wraps around to the start of its shuffled order:
        # a uniformly random set of distinct samples, none of them already in the last chunk.
        # A class with < m samples is completed by uniform draws with replacement.
        with_replacement = rng.integers(0, np.broadcast_to(size, position.shape))
        position = np.where(
            position < size, position, np.where(size >= self.m, position - size, with_replacement)
        )
        return order[self._class_starts[chunk_class][:, None] + position]

    def _plan_epoch(self, epoch: int) -> tuple[list[np.ndarray], dict[str, int]]:
        if self._cached_plan is not None and self._cached_plan[0] == epoch:
            return self._cached_plan[1], self._cached_plan[2]
        rng = self._rng(epoch)
        chunks = self._make_chunks(rng)
        first_chunk = np.concatenate([[0], np.cumsum(self._chunks_per_class)[:-1]])
        n_batches, per_batch = self._n_full_batches, self.classes_per_batch

        # Chunks each class contributes to the full batches: min(k_c, B), minus one for
        # `excess_slots` distinct classes among those not already capped (so the number of
        # classes with leftovers, hence len(), does not depend on the draw).
        use = np.minimum(self._chunks_per_class, n_batches)
        if self._excess_slots:
            uncapped = np.flatnonzero(self._chunks_per_class <= n_batches)
            reduced = _weighted_top_k(rng, uncapped, use[uncapped], self._excess_slots)
            use[reduced] -= 1

        # Fill the batches one by one. Invariant before each batch, with b batches left:
        # use_c <= b and sum(use) = P * b. Classes with use_c == b must be in this batch; the
        # rest of the batch is a weighted draw among the other classes that have chunks left.
        taken = np.zeros(self.num_classes, dtype=np.int64)
        batches = np.empty((n_batches, per_batch), dtype=np.int64)  # chunk row ids
        active = np.flatnonzero(use > 0)
        for step in range(n_batches):
            remaining = n_batches - step
            active = active[use[active] > 0]
            must = use[active] == remaining
            forced = active[must]
            optional = active[~must]
            drawn = _weighted_top_k(rng, optional, use[optional], per_batch - forced.size)
            chosen = np.concatenate([forced, drawn])
            batches[step] = rng.permutation(first_chunk[chosen] + taken[chosen])
            taken[chosen] += 1
            use[chosen] -= 1
        batches = batches[rng.permutation(n_batches)]

        shard = per_batch // self.num_replicas
        own = slice(self.rank * shard, (self.rank + 1) * shard)
        plan = [chunks[row[own]].reshape(-1) for row in batches]
        yielded_rows = [batches.reshape(-1)]

        leftover_classes = np.flatnonzero(taken < self._chunks_per_class)
        if self._final_chunks_per_replica:
            final = rng.permutation(first_chunk[leftover_classes] + taken[leftover_classes])
            final = final[: self._final_chunks_per_replica * self.num_replicas]
            k = self._final_chunks_per_replica
            plan.append(chunks[final[self.rank * k : (self.rank + 1) * k]].reshape(-1))
            yielded_rows.append(final)

        used_rows = np.concatenate(yielded_rows)
        seen = np.zeros(self.num_samples, dtype=bool)
        seen[chunks[used_rows].reshape(-1)] = True  # over all replicas
        stats = {
            "n_batches": len(plan),
            "n_chunks": int(chunks.shape[0]),
            "n_chunks_dropped": int(chunks.shape[0] - used_rows.size),
            "n_samples_dropped": int(self.num_samples - seen.sum()),
            "n_classes_undersized": self.n_classes_undersized,
        }
        self._cached_plan = (epoch, plan, stats)
        return plan, stats

    # -- public API ----------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration plays (call once per epoch, before iterating).

        Setting the epoch a resumed state points at keeps the pending resume offset.
        """
        epoch = _check_int(epoch, "epoch", 0)
        if epoch != self.epoch:
            self.epoch = epoch
            self._position = 0
            self._skip = 0

    def __len__(self) -> int:
        """Batches the next iteration yields: the epoch's batches minus a pending resume offset."""
        return self._batches_per_epoch - self._skip

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self._skip
        plan, _ = self._plan_epoch(epoch)
        self._skip = 0
        self._position = start
        for index in range(start, len(plan)):
            self._position = index + 1
            yield plan[index].tolist()

    def epoch_stats(self) -> dict[str, int]:
        """Bookkeeping of the current epoch (planned on demand; global over replicas).

        Keys: ``n_batches`` (this replica), ``n_chunks``, ``n_chunks_dropped`` (chunks in no
        batch), ``n_samples_dropped`` (dataset indices in no batch of any replica),
        ``n_classes_undersized``.
        """
        return dict(self._plan_epoch(self.epoch)[1])

    @property
    def n_samples_dropped_last_epoch(self) -> int:
        """Dataset indices that appear in no batch of the current epoch (over all replicas)."""
        return self.epoch_stats()["n_samples_dropped"]

    def state_dict(self, batches_done: int | None = None) -> dict[str, int | bool]:
        """Position to resume from: the epoch and the batches of it already handed out.

        Args:
            batches_done: batches of the current epoch the trainer has consumed. Pass it when a
                ``DataLoader`` with workers prefetches batches (the sampler is then ahead of the
                training loop); by default the number of batches this sampler has yielded.
        """
        position = self._position if batches_done is None else batches_done
        position = _check_int(position, "batches_done", 0)
        if position > self._batches_per_epoch:
            raise ValueError(
                f"`batches_done` ({position}) exceeds the {self._batches_per_epoch} batches of "
                "an epoch."
            )
        config = {key: getattr(self, key) for key in _STATE_CONFIG_KEYS}
        return {"epoch": self.epoch, "batches_yielded": position, **config}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state['epoch']`` skips the batches already yielded.

        Raises ValueError when the state was saved with another seed, m, batch_size, dataset
        size, drop_last or num_replicas, since the batch sequence would then differ.
        """
        missing = [k for k in ("epoch", "batches_yielded", *_STATE_CONFIG_KEYS) if k not in state]
        if missing:
            raise ValueError(f"`state` lacks the keys {missing}; pass a dict from state_dict().")
        for key in _STATE_CONFIG_KEYS:
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"`state` was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; build the sampler with the same settings."
                )
        epoch = _check_int(state["epoch"], "state['epoch']", 0)
        position = _check_int(state["batches_yielded"], "state['batches_yielded']", 0)
        if position > self._batches_per_epoch:
            raise ValueError(
                f"`state['batches_yielded']` ({position}) exceeds the {self._batches_per_epoch} "
                "batches of an epoch."
            )
        self.epoch = epoch
        self._position = position
        self._skip = position
