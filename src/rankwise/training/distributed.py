"""Data-parallel training with global-batch ranking losses on torch.distributed.

Listwise ranking losses are functions of the whole batch: the stochastic AUPRC estimator of Wen et
al. (NeurIPS 2022, Eq. 8) ranks every positive of an anchor against every negative of the batch,
and its auxiliary vector ``v`` is a moving average over batches (Eq. 10); the AUC loss of Gajić et
al. (Eq. 9) compares every positive pair with every negative pair. Under plain
DistributedDataParallel each rank would compute the loss of its own slice, a different (and
smaller-batch) objective. Here every rank computes the loss of the *global* batch instead
(:class:`DistributedLoss`, :func:`all_gather_with_grad`), so buffered loss state (SOPRC's ``v``,
the XBM queue) evolves identically on every rank, which :func:`check_replicas_in_sync` verifies;
:class:`DistributedTrainer` is the :class:`~rankwise.training.Trainer` on a process group.

Launch with ``torchrun --nproc-per-node N -m rankwise train -c CONFIG`` (see docs/distributed.md).
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

from .._distributed import is_distributed, rank_and_world_size, require_process_group
from .._validation import check_choice
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
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


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
    """Join the process group ``torchrun`` set up (environment rendezvous) and pick the device.

    With ``device`` ``"cuda"`` (or ``"auto"`` on a CUDA machine) each process uses the GPU of
    its local rank (``torch.cuda.set_device(LOCAL_RANK)``). An already initialized process group
    is kept. Without ``torchrun`` variables a one-process group is not created: the context
    says world size 1.

    Args:
        backend: ``"auto"`` (nccl for CUDA, gloo for the CPU), ``"gloo"`` or ``"nccl"``.
        device: ``"auto"``, ``"cpu"``, ``"cuda"`` or a ``torch.device``.
        timeout_s: collective timeout in seconds (default: torch's).

    Returns:
        The :class:`DistributedContext`.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device) if not (isinstance(device, str) and device == "auto") else None
    if dev is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device: 'cuda' requested but no CUDA device is available.")
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
        # torch.distributed.nn.functional stores the default group as the default argument of
        # its functions when it is first imported (DistributedDataParallel imports it): imported
        # after the group exists, it keeps the group, its gloo threads and its TCPStore alive
        # for good, past destroy_process_group, until they die with the interpreter (see
        # shutdown_distributed). Imported before, it stores None.
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

    A process group's threads (gloo's workers and transport loop, the TCPStore server on rank 0)
    must end before the interpreter does: one still running while the interpreter shuts down
    can release a tensor of the last collective there and abort the process ("terminate called
    without an active exception", exit code -6, seen under load). The group ends only when
    nothing holds it any more, so the objects that do (a :class:`DistributedTrainer` and its
    ``DistributedDataParallel`` wrapper) must be unreachable: reference cycles are collected
    here, and the frames of ``failure`` (which hold the trainer that raised it) are cleared.

    On success (``failure`` ``None``) every rank first waits for the others (a barrier), so no
    rank tears down connections, or the store rank 0 serves, under a rank still communicating.
    After a failure there is no barrier: the other ranks may never get there. Nothing happens
    without a process group.

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

    ``DistributedLoss(loss)(embeddings, labels)`` all-gathers every rank's embeddings and labels
    (:func:`all_gather_with_grad`), calls ``loss`` on their concatenation in rank order, and
    returns the same value on every rank: the value one process computes on the concatenated
    batch. The gradient flows back to the local slice, scaled so that DDP's gradient averaging
    gives the single-process gradient of the global batch (``gradient_reduction="sum"`` when you
    sum the gradients yourself). Stateful losses (SOPRC's ``v``, the XBM queue) are updated from
    the global batch, identically on every rank. A reference set (``ref_embeddings``), when
    given, is gathered the same way. Outside a multi-rank process group it is ``loss`` itself.

    Memory per rank: the global batch of ``B x d`` embeddings and its gradient, plus what the
    loss builds from ``B`` rows (the ``B x B`` score matrix and masks of every rankwise loss;
    more for the pair-based ones, see docs/losses.md).

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

    Every rank builds the same objects (same seed) and calls :meth:`fit`; the process group must
    be initialized first (:func:`init_distributed`). It is a :class:`~rankwise.training.Trainer`
    with a :class:`~rankwise.training.strategy.DataParallelStrategy`, which says what changes
    from the one-process loop (an :class:`~rankwise.sampling.MPerClassBatchSampler`'s
    ``batch_size`` is the global batch, sharded by rank; every rank sees the batch a one-process
    run with the same seed sees, in the same order). Every rank reads ``last.pt`` on resume (the
    run directory must be visible to every node), which requires the world size of the run that
    wrote it; the ranks check they hold the same state (:func:`check_replicas_in_sync`) before
    every checkpoint and every ``check_every`` steps, and agree on stopping (:class:`ReplicaSync`).

    Args:
        model: as :class:`~rankwise.training.Trainer`.
        loss_fn: as :class:`~rankwise.training.Trainer`; may be a :class:`DistributedLoss` (it
            is unwrapped: the strategy gathers the batch itself).
        train_data: as :class:`~rankwise.training.Trainer`.
        group: the process group (``None``: the default one).
        check_every: steps between replica checks (default: only at checkpoints;
            :meth:`from_config`: ``config.distributed.check_every``).
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm on CUDA (default ``True``;
            :meth:`from_config`: ``config.distributed.sync_batchnorm``).
        find_unused_parameters: passed to ``DistributedDataParallel``.
        strategy: the strategy itself (instead of ``group`` ... ``find_unused_parameters``).
        **kwargs: as :class:`~rankwise.training.Trainer`.
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
