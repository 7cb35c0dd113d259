"""Data-parallel training with global-batch ranking losses on torch.distributed.

Listwise losses are functions of the whole batch (Wen et al., NeurIPS 2022, Eq. 8 and the moving
average ``v`` of Eq. 10; Gajić et al., Eq. 9), so under plain DistributedDataParallel each rank
would optimize a smaller-batch objective. Here every rank computes the loss of the *global* batch
(:class:`DistributedLoss`, :func:`all_gather_with_grad`) and buffered loss state evolves
identically on every rank (:func:`check_replicas_in_sync`). Launch with ``torchrun
--nproc-per-node N -m rankwise train -c CONFIG``; see docs/distributed.md.
"""

from __future__ import annotations

import gc
import importlib
import os
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from .._distributed import (
    is_distributed,
    launch_rank,
    rank_and_world_size,
    require_process_group,
)
from .._validation import check_choice
from .build import resolve_device as config_device
from .errors import ConfigError
from .replicas import (
    GRADIENT_REDUCTIONS,
    ReplicaSync,
    all_gather_with_grad,
    check_replicas_in_sync,
    replica_checksums,
)
from .strategy import DataParallelStrategy
from .trainer import Trainer

__all__ = [
    "DistributedContext",
    "DistributedLoss",
    "DistributedTrainer",
    "ReplicaSync",
    "all_gather_with_grad",
    "check_replicas_in_sync",
    "init_distributed",
    "launched_by_torchrun",
    "replica_checksums",
    "shutdown_distributed",
]

# -- process group ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the data-parallel run.

    Attributes:
        rank: global rank (0 is the process that writes and prints).
        world_size: number of processes.
        local_rank: rank on this node (the CUDA device index).
        backend: the process-group backend (``"gloo"`` or ``"nccl"``).
        device: the device this process trains on.
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def launched_by_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (its ``RANK`` / ``WORLD_SIZE`` are set)."""
    return launch_rank() is not None


def _resolve_backend(backend: str, device: torch.device) -> str:
    backend = check_choice(backend, "backend", ("auto", "gloo", "nccl"))
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "distributed.backend: nccl communicates CUDA tensors only, but the device is "
            f"{device.type}; use backend gloo (or auto) on the CPU."
        )
    return backend


def init_distributed(
    backend: str = "auto", device: str | torch.device = "auto", timeout_s: float | None = None
) -> DistributedContext:
    """Join the process group ``torchrun`` set up and pick the device (CUDA: the local rank's GPU).

    An initialized group is kept; without ``torchrun`` variables none is created (world size 1).

    Args:
        backend: ``"auto"`` (nccl for CUDA, gloo for the CPU), ``"gloo"`` or ``"nccl"``.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or a ``torch.device``.
        timeout_s: collective timeout in seconds (default: torch's).

    Returns:
        The :class:`DistributedContext`.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = config_device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else local_rank % torch.cuda.device_count()
        dev = torch.device("cuda", index)
        torch.cuda.set_device(dev)
    chosen = _resolve_backend(backend, dev)
    if not dist.is_initialized():
        if not launched_by_torchrun():
            return DistributedContext(0, 1, 0, chosen, dev)
        kwargs: dict[str, Any] = {"backend": chosen}
        if timeout_s is not None:
            kwargs["timeout"] = timedelta(seconds=float(timeout_s))
        if chosen == "nccl":
            kwargs["device_id"] = dev
        # torch.distributed.nn.functional binds the default group as a default argument on
        # first import: imported after the group exists, it keeps the group and its threads
        # alive past destroy_process_group (see shutdown_distributed); imported before, None.
        importlib.import_module("torch.distributed.nn.functional")
        dist.init_process_group(**kwargs)
    rank, world = rank_and_world_size()
    return DistributedContext(rank, world, local_rank, str(dist.get_backend()), dev)


def _release_frames(failure: BaseException) -> None:
    """Drop the local variables of the finished frames of ``failure`` (and of its causes)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [failure]
    while pending:
        exc = pending.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)  # frames still running are left alone
        pending += [exc.__cause__, exc.__context__]


def shutdown_distributed(failure: BaseException | None = None) -> None:
    """Leave the process group and stop its threads; the last call of a data-parallel process.

    The group's threads (gloo, rank 0's TCPStore) must end before the interpreter, or the
    process can abort at exit (code -6); the group ends only when nothing holds it, so reference
    cycles are collected and the frames of ``failure`` (holding the trainer) are cleared. On
    success every rank first waits at a barrier; after a failure not (the others may never
    arrive). Nothing happens without a process group.

    Args:
        failure: the exception that ends the process, if any.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if failure is None and is_distributed():
            dist.barrier()
    finally:
        if failure is not None:
            _release_frames(failure)
        gc.collect()  # the trainers and their DDP wrappers: reference cycles that hold the group
        dist.destroy_process_group()  # the last reference: the group joins its threads


class DistributedLoss(nn.Module):
    """Any rankwise loss, computed on the global batch of a data-parallel run.

    Every rank's embeddings and labels (and ``ref_embeddings``) are all-gathered
    (:func:`all_gather_with_grad`) and ``loss`` is called on their concatenation in rank order:
    every rank gets the one-process value of the global batch, stateful losses update
    identically, and the gradient reaches the local slice scaled for DDP's averaging. Outside a
    multi-rank group it is ``loss`` itself. Memory per rank: the global ``B x d`` batch and its
    gradient plus the loss's ``B x B`` matrices (see docs/losses.md).

    Args:
        loss: the loss module (every name of :data:`rankwise.losses.LOSSES`).
        group: the process group (``None``: the default one).
        gradient_reduction: ``"mean"`` (DDP, default) or ``"sum"``; see
            :func:`all_gather_with_grad`.

    Attributes:
        loss: the wrapped loss (its ``state_dict`` is the one to checkpoint).
    """

    def __init__(
        self, loss: nn.Module, group: Any = None, gradient_reduction: str = "mean"
    ) -> None:
        super().__init__()
        if not isinstance(loss, nn.Module):
            raise ValueError(
                f"`loss` must be a torch.nn.Module called as loss(embeddings, labels), got "
                f"{type(loss).__name__}."
            )
        if isinstance(loss, DistributedLoss):
            raise ValueError("`loss` is already a DistributedLoss; wrap the plain loss once.")
        self.loss = loss
        self.group = group
        self.gradient_reduction = check_choice(
            gradient_reduction, "gradient_reduction", GRADIENT_REDUCTIONS
        )

    @property
    def last_stats(self) -> dict[str, Any]:
        """The wrapped loss's ``last_stats`` (of the global batch)."""
        return getattr(self.loss, "last_stats", {})

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss of the global batch.

        Args:
            embeddings: this rank's ``(B_r, d)`` embeddings.
            labels: their ``(B_r,)`` class ids.
            ref_embeddings: optional ``(M_r, d)`` reference rows of this rank (gathered too).
            ref_labels: their ``(M_r,)`` class ids.

        Returns:
            The scalar loss of the concatenated batch, the same on every rank.
        """
        if not is_distributed(self.group):
            if ref_embeddings is None and ref_labels is None:
                return self.loss(embeddings, labels)
            return self.loss(embeddings, labels, ref_embeddings, ref_labels)
        emb, lab, _ = all_gather_with_grad(
            embeddings, torch.as_tensor(labels), self.group, self.gradient_reduction
        )
        if ref_embeddings is None and ref_labels is None:
            return self.loss(emb, lab)
        if ref_embeddings is None or ref_labels is None:
            raise ValueError("pass both `ref_embeddings` and `ref_labels`, or neither.")
        ref, ref_lab, _ = all_gather_with_grad(
            ref_embeddings, torch.as_tensor(ref_labels), self.group, self.gradient_reduction
        )
        return self.loss(emb, lab, ref, ref_lab)

    def extra_repr(self) -> str:
        """The reduction mode, in ``repr``."""
        return f"gradient_reduction={self.gradient_reduction!r}"


# -- the trainer -----------------------------------------------------------------------------------


class DistributedTrainer(Trainer):
    """:class:`~rankwise.training.Trainer` on a torch.distributed process group (one per rank).

    Every rank builds the same objects (same seed) after :func:`init_distributed` and calls
    :meth:`fit`; what changes from one process is said in
    :class:`~rankwise.training.strategy.DataParallelStrategy` (the sampler's ``batch_size`` is
    the global batch, sharded by rank). Resuming needs the run directory on every node and the
    same world size; replicas are checked (:func:`check_replicas_in_sync`) at every checkpoint
    and every ``check_every`` steps. See docs/distributed.md.

    Args:
        model, train_data, **kwargs: as :class:`~rankwise.training.Trainer`.
        loss_fn: as there; a :class:`DistributedLoss` is unwrapped (the strategy gathers).
        group, check_every, sync_batchnorm, find_unused_parameters: as for
            :class:`~rankwise.training.strategy.DataParallelStrategy` (:meth:`from_config`: from
            ``config.distributed``).
        strategy: the strategy itself (instead of ``group`` ... ``find_unused_parameters``).
    """

    strategy_class = DataParallelStrategy

    def __init__(
        self,
        model: nn.Module,
        loss_fn: nn.Module,
        train_data: Dataset,
        *,
        group: Any = None,
        check_every: int | None = None,
        sync_batchnorm: bool | None = None,
        find_unused_parameters: bool = False,
        strategy: DataParallelStrategy | None = None,
        **kwargs: Any,
    ) -> None:
        require_process_group("DistributedTrainer")
        if strategy is None:
            strategy = DataParallelStrategy(
                group,
                check_every=check_every,
                sync_batchnorm=True if sync_batchnorm is None else sync_batchnorm,
                find_unused_parameters=find_unused_parameters,
            )
        if isinstance(loss_fn, DistributedLoss):
            loss_fn = loss_fn.loss  # the strategy gathers the batch itself
        super().__init__(model, loss_fn, train_data, strategy=strategy, **kwargs)

    @property
    def group(self) -> Any:
        """The process group (``None``: the default one)."""
        return self.strategy.group

    @property
    def ddp(self) -> nn.Module:
        """The model in ``DistributedDataParallel`` (what the training forward pass calls)."""
        return self._training_module
