"""How many processes train one model: the strategy the Trainer asks for what differs.

Who a process is, the collectives, the sharding of sampler and evaluation data, and who writes:
:class:`SingleProcess` without communication, :class:`DataParallelStrategy` on a torch.distributed
group with the global-batch loss of Wen et al. (NeurIPS 2022, Eq. 8;
:func:`~rankwise.training.replicas.all_gather_with_grad`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, Subset

from .._distributed import all_gather_rows, all_gather_small, comm_device, rank_and_world_size
from .._validation import resolve_device
from ..sampling import DistributedMPerClassBatchSampler, MPerClassBatchSampler
from .arguments import device_of, resolved_device
from .build import seed_everything
from .callbacks import Callback
from .checkpoint import capture_rng_state, restore_rng_state
from .errors import ConfigError
from .loader import BatchSampler, mix_seed
from .lock import RunDirLock
from .replicas import ReplicaSync, all_gather_with_grad, check_replicas_in_sync

__all__ = ["DataParallelStrategy", "SingleProcess", "Strategy"]

_T = TypeVar("_T")
Embedder = Callable[[Dataset], tuple[torch.Tensor, np.ndarray]]


class SingleProcess:
    """One process trains the model: every collective is the identity, and it writes everything.

    Attributes:
        rank: 0.
        world_size: 1.
        group: ``None`` (no process group).
    """

    rank = 0
    world_size = 1
    group: Any = None

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes the run directory and prints (rank 0)."""
        return self.rank == 0

    def device(self, device: str | torch.device | None) -> str | torch.device | None:
        """The device this process trains on, from the trainer's ``device`` argument."""
        return device

    def prepare_model(self, model: nn.Module, device: torch.device | None) -> nn.Module:
        """The model to train (before it is moved to its device)."""
        return model

    def place(
        self, model: nn.Module, device: str | torch.device | None
    ) -> tuple[nn.Module, torch.device]:
        """The model to train (:meth:`prepare_model`) and this process's device.

        A ``torch.device`` already resolved (the factory's, with its CUDA index) is the one
        resolution of the run; else :meth:`device`, ``None`` meaning where the model is.
        """
        given = resolved_device(device)
        wanted = given if given is not None else self.device(device)
        model = self.prepare_model(model, wanted)  # type: ignore[arg-type]
        return model, given if given is not None else device_of(model, wanted)

    def training_module(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The module the training forward pass calls (e.g. a DDP wrapper); ``model`` here."""
        return model

    def shard_sampler(self, sampler: BatchSampler, from_config: bool = False) -> BatchSampler:
        """This process's part of every batch of ``sampler`` (all of it here)."""
        return sampler

    def join(self, *, steps_per_epoch: int, total_steps: int, seed: int, resume: bool) -> None:
        """Agree with the other processes on a new run (nothing to agree on here).

        Args:
            steps_per_epoch: this process's batches per epoch.
            total_steps: the run's budget.
            seed: the run's seed.
            resume: the run resumes a checkpoint (every process read the same one).
        """

    def callbacks(self) -> list[Callback]:
        """The callbacks the run needs for its processes (none here)."""
        return []

    def console(self, console: Console | None, progress: bool | None) -> tuple[Any, bool | None]:
        """The console and progress setting of this process."""
        return console, progress

    def gather_batch(
        self, embeddings: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch the loss sees: this process's (here: the whole batch)."""
        return embeddings, labels

    def embed_split(self, data: Dataset, embed: Embedder) -> tuple[torch.Tensor, np.ndarray]:
        """Embeddings and labels of the whole of ``data``, in order, on every process."""
        return embed(data)

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any process."""
        return bool(flag)

    def worst_code(self, code: int) -> int:
        """The largest of every process's ``code`` (an agreed outcome of a write)."""
        return code

    def from_main_process(self, read: Callable[[], _T]) -> _T:
        """What ``read()`` returns on the main process, on every process."""
        return read()

    def barrier(self) -> None:
        """Wait for every process (nothing to wait for here)."""

    def check_replicas(
        self, model: nn.Module, loss_fn: nn.Module, optimizer: Any, step: int
    ) -> None:
        """Raise unless every process holds the same state (one process always does)."""

    def gather_rng(self) -> None:
        """Collect every process's RNG state for the next checkpoint (this one's is enough)."""

    def rng_state(self) -> dict[str, Any]:
        """The random state a checkpoint holds besides this process's ``rng``."""
        return {}

    def lock(self, take: Callable[[], RunDirLock], run_dir: Path) -> RunDirLock:
        """Take the lock of the run directory ``run_dir`` with ``take()``.

        Args:
            take: locks the folder and checks it (raises on a refusal).
            run_dir: the run directory.

        Returns:
            The hold of the lock.
        """
        return take()

    def restore_rng(self, state: dict[str, Any]) -> None:
        """Restore this process's random streams from a checkpoint."""
        restore_rng_state(state["rng"])


class DataParallelStrategy(SingleProcess):
    """One model trained by every rank of a torch.distributed process group (one per process).

    The model runs in ``DistributedDataParallel`` (SyncBatchNorm on CUDA); each rank draws its
    shard of every global P x K batch and the embeddings are all-gathered after the forward pass,
    so checks and loss see the global batch; rank 0 alone writes and prints.

    Args:
        group: the process group (``None``: the default one).
        check_every: steps between replica checks (``None``: only at checkpoints).
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm on CUDA.
        find_unused_parameters: passed to ``DistributedDataParallel``.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        check_every: int | None = None,
        sync_batchnorm: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        self.group = group
        self.rank, self.world_size = rank_and_world_size(group)
        self.check_every = check_every
        self.sync_batchnorm = bool(sync_batchnorm)
        self.find_unused_parameters = bool(find_unused_parameters)
        self._rng_states: list[Any] | None = None

    def device(self, device: str | torch.device | None) -> str | torch.device | None:
        """``cuda`` without an index becomes the current CUDA device (the local rank's)."""
        if device is None:
            return None
        dev = resolve_device(device)
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def prepare_model(self, model: nn.Module, device: torch.device | None) -> nn.Module:
        """SyncBatchNorm on CUDA; on the CPU per-rank BatchNorm statistics, with a warning."""
        has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
        if not has_batchnorm or self.world_size == 1:
            return model
        on_cuda = (device is not None and device.type == "cuda") or (
            device is None and next(model.parameters()).is_cuda
        )
        if self.sync_batchnorm and on_cuda:
            return nn.SyncBatchNorm.convert_sync_batchnorm(model, self.group)
        if self.rank == 0:
            warnings.warn(
                "the model has BatchNorm layers whose batch statistics are computed per rank "
                f"(on {100 // self.world_size} % of the global batch"
                + (", SyncBatchNorm needs CUDA)" if self.sync_batchnorm else ")")
                + ", so the gradient is not exactly the global batch's; freeze them "
                "(model.frozen_bn=true) or train on CUDA with distributed.sync_batchnorm=true.",
                UserWarning,
                stacklevel=4,
            )
        return model

    def training_module(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The model in ``DistributedDataParallel``."""
        return DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=self.group,
            find_unused_parameters=self.find_unused_parameters,
        )

    def shard_sampler(self, sampler: BatchSampler, from_config: bool = False) -> BatchSampler:
        """An unsharded :class:`~rankwise.sampling.MPerClassBatchSampler` becomes this rank's shard.

        Args:
            sampler: the sampler of the global batches (a user's own must shard itself).
            from_config: name the config keys in the error.

        Returns:
            The sampler of this rank.
        """
        if not isinstance(sampler, MPerClassBatchSampler):
            return sampler  # the user's own sampler must shard by rank itself
        if sampler.num_replicas == self.world_size and sampler.rank == self.rank:
            return sampler
        if sampler.num_replicas != 1:
            raise ValueError(
                f"`sampler` is sharded for {sampler.num_replicas} replicas (rank {sampler.rank}) "
                f"but this process is rank {self.rank} of {self.world_size}; pass an unsharded "
                "sampler (its batch_size is the global batch) or one built for this rank."
            )
        try:
            return DistributedMPerClassBatchSampler.from_sampler(
                sampler, self.world_size, self.rank
            )
        except ValueError as exc:
            if not from_config:
                raise ValueError(f"`sampler`: {exc}") from None
            raise ConfigError(
                f"sampler.batch_size: {sampler.batch_size} / sampler.m={sampler.m} = "
                f"{sampler.classes_per_batch} classes per global batch must be divisible by the "
                f"world size {self.world_size} (each rank gets whole classes); use a batch_size "
                f"that is a multiple of m x {self.world_size}."
            ) from None

    def join(self, *, steps_per_epoch: int, total_steps: int, seed: int, resume: bool) -> None:
        """Check the ranks run the same schedule; start every rank from one state.

        Args:
            steps_per_epoch: this rank's batches per epoch.
            total_steps: the run's budget.
            seed: the run's seed (of the random layers of the ranks after 0).
            resume: the run resumes a checkpoint (every rank read the same one).
        """
        rows = all_gather_small([steps_per_epoch, total_steps], self.group)
        if len({tuple(r) for r in rows}) > 1:
            raise ValueError(
                "the ranks disagree on the batches per epoch / total steps "
                f"({[tuple(r) for r in rows]}); every rank must use the same data, sampler "
                "settings and budget."
            )
        if not resume and self.rank > 0:
            # every rank starts from rank 0's weights (DDP broadcasts them); random layers
            # (dropout) get a stream of their own per rank
            seed_everything(mix_seed(seed, self.rank) % 2**63)

    def callbacks(self) -> list[Callback]:
        """``[ReplicaSync]``: the replicas are checked every ``check_every`` steps."""
        return [ReplicaSync(self.check_every)]

    def console(self, console: Console | None, progress: bool | None) -> tuple[Any, bool | None]:
        """Ranks other than 0 print nothing (errors are raised)."""
        if self.rank != 0:
            return Console(stderr=True, quiet=True), False
        return console, progress

    def gather_batch(
        self, embeddings: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch: every rank's rows in rank order, the gradient to the local slice.

        The labels are gathered on the embeddings' device and come back where they were given
        (host labels: one copy to the host per step, the only wait for the device it adds).
        """
        global_embeddings, global_labels, _ = all_gather_with_grad(
            embeddings, labels.to(embeddings.device, non_blocking=True), self.group, "mean"
        )
        return global_embeddings, global_labels.to(labels.device)

    def embed_split(self, data: Dataset, embed: Embedder) -> tuple[torch.Tensor, np.ndarray]:
        """Ranks embed contiguous shards (all, if fewer items than ranks), gathered in order."""
        n = len(data)  # type: ignore[arg-type]
        if n < self.world_size:
            return embed(data)
        lo, hi = n * self.rank // self.world_size, n * (self.rank + 1) // self.world_size
        embeddings, labels = embed(Subset(data, range(lo, hi)))
        local_labels = torch.from_numpy(labels).to(embeddings.device)
        gathered_labels = all_gather_rows(local_labels, self.group)[0]
        return all_gather_rows(embeddings, self.group)[0], gathered_labels.cpu().numpy()

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank (a collective)."""
        return self.worst_code(int(flag)) > 0

    def worst_code(self, code: int) -> int:
        """The largest ``code`` of every rank (a collective)."""
        tensor = torch.tensor([code], device=comm_device(self.group))
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return int(tensor.item())

    def from_main_process(self, read: Callable[[], _T]) -> _T:
        """Rank 0 calls ``read``; every rank gets its value (tensors on the CPU)."""
        payload: list[Any] = [None]
        if self.is_main_process:
            value = read()
            payload[0] = (
                {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
                if isinstance(value, dict)
                else value
            )
        source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(payload, src=source, group=self.group)
        return payload[0]

    def barrier(self) -> None:
        """Wait for every rank."""
        dist.barrier(group=self.group)

    def check_replicas(
        self, model: nn.Module, loss_fn: nn.Module, optimizer: Any, step: int
    ) -> None:
        """Raise ReplicaDivergenceError unless every rank holds the same state (a collective)."""
        check_replicas_in_sync(model, loss_fn, optimizer, group=self.group, step=step)

    def lock(self, take: Callable[[], RunDirLock], run_dir: Path) -> RunDirLock:
        """Rank 0 alone (it writes the run directory) takes the lock; every rank learns the outcome.

        A collective: a refusal is raised on every rank (none waits for one that gave up); the
        other ranks get an empty hold.
        """
        if self.world_size == 1:
            return take()
        lock, failure = RunDirLock(Path(run_dir), held=False), None
        refusal: list[str | None] = [None]
        if self.rank == 0:
            try:
                lock = take()
            except Exception as exc:  # told to every rank below
                failure, refusal = exc, [str(exc)]
        source = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(refusal, src=source, group=self.group)
        if failure is not None:
            raise failure
        if refusal[0] is not None:
            raise ConfigError(refusal[0])
        return lock

    def gather_rng(self) -> None:
        """Collect every rank's RNG state for the checkpoint about to be written (a collective)."""
        states: list[Any] = [None] * self.world_size
        dist.all_gather_object(states, capture_rng_state(), group=self.group)
        self._rng_states = states

    def rng_state(self) -> dict[str, Any]:
        """``rng_per_rank``: every rank's streams once gathered (this rank's alone otherwise)."""
        states, self._rng_states = self._rng_states, None
        return {"rng_per_rank": states if states is not None else [capture_rng_state()]}

    def restore_rng(self, state: dict[str, Any]) -> None:
        """Restore this rank's streams; the checkpoint must come from a run of this world size."""
        per_rank = state.get("rng_per_rank")
        if per_rank is None and self.world_size == 1:  # a one-process Trainer's checkpoint
            per_rank = [state["rng"]]
        if not per_rank or len(per_rank) != self.world_size:
            raise ConfigError(
                "run_dir: the checkpoint holds no random state for each of the "
                f"{self.world_size} ranks; it was not written by a run of this world size."
            )
        restore_rng_state(per_rank[self.rank])


Strategy = SingleProcess
