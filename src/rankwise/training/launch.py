"""How a run's processes start and end: torchrun's variables, the process group, the strategy.

A process started by ``torchrun --nproc-per-node N`` (its ``RANK`` / ``WORLD_SIZE`` variables)
joins the process group (:func:`init_distributed`: the backend, the local rank's GPU) and trains
data-parallel (:class:`~rankwise.training.strategy.DataParallelStrategy`, the global-batch losses
of Wen et al., NeurIPS 2022, Eq. 8); any other trains alone. :func:`choose_strategy` makes that
choice for the factory, so ``Trainer.from_config`` / ``build_trainer`` under torchrun need no set-up
of their own; :func:`leave_process_group` ends such a process. See docs/distributed.md.
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

from .._distributed import is_distributed, launch_rank, rank_and_world_size
from .._validation import check_choice
from .build import resolve_device as config_device
from .errors import ConfigError
from .strategy import DataParallelStrategy, SingleProcess

__all__ = [
    "DistributedContext",
    "choose_strategy",
    "init_distributed",
    "launched_by_torchrun",
    "leave_process_group",
    "shutdown_distributed",
]


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


def leave_process_group(failure: BaseException | None = None) -> None:
    """The end of a process :func:`choose_strategy` may have joined to torchrun's process group.

    :func:`shutdown_distributed` (``failure``: the exception that ends the process) when this
    process was launched by torchrun; nothing otherwise.
    """
    if launched_by_torchrun():
        shutdown_distributed(failure)


def choose_strategy(
    *,
    backend: str = "auto",
    device: str | torch.device = "auto",
    check_every: int | None = None,
    sync_batchnorm: bool = True,
    data_parallel: bool = False,
) -> tuple[SingleProcess, torch.device | None]:
    """The strategy of a run started in this environment, and the device once it is chosen.

    Under torchrun, in a process group of several processes, or with ``data_parallel``: the
    process joins the group (:func:`init_distributed`; a group already joined is kept) and trains
    with a :class:`~rankwise.training.strategy.DataParallelStrategy` on the local rank's device.
    Otherwise one process trains (:class:`~rankwise.training.strategy.SingleProcess`) and the
    device is left to the caller (``None``).

    Args:
        backend: the process group's backend (``"auto"``, ``"gloo"``, ``"nccl"``).
        device: the run's device setting.
        check_every: steps between replica checks (``None``: at checkpoints).
        sync_batchnorm: BatchNorm layers become SyncBatchNorm on CUDA.
        data_parallel: train data-parallel even in a group of one process
            (:class:`~rankwise.training.distributed.DistributedTrainer`).

    Returns:
        ``(strategy, device)``.
    """
    if not (data_parallel or launched_by_torchrun() or is_distributed()):
        return SingleProcess(), None
    context = init_distributed(backend=backend, device=device)
    strategy = DataParallelStrategy(check_every=check_every, sync_batchnorm=sync_batchnorm)
    return strategy, context.device
