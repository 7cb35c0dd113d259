"""torch.distributed plumbing shared by the training and the metrics code.

Ranking losses such as the AUPRC estimator of Wen et al. (NeurIPS 2022, Eq. 8) are functions of the
whole batch, so data-parallel training gathers the batch before the loss
(:mod:`rankwise.training.distributed`), and exact metrics over sharded queries need the whole
gallery on every rank (:mod:`rankwise.metrics.distributed`). Here: rank, world size, the backend's
device, and an all-gather of tensors whose first dimension differs between ranks (padded, gathered,
trimmed). Only :mod:`torch.distributed` is used, so :mod:`rankwise.metrics` may import it. Every
function is a collective: all ranks of the group must call it, in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DTYPE_CODES",
    "all_gather_rows",
    "all_gather_small",
    "comm_device",
    "is_distributed",
    "launch_rank",
    "padded_all_gather",
    "rank_and_world_size",
    "require_process_group",
]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launch_rank() -> int | None:
    """This process's global rank as ``torchrun`` set it (``RANK``); ``None`` outside torchrun.

    Read from the environment, so it is known before (and without) a process group: a message
    every rank would print is printed by rank 0 alone.
    """
    if not all(key in os.environ for key in TORCHRUN_VARIABLES):
        return None
    try:
        return int(os.environ["RANK"])
    except ValueError:
        return None


# dtypes that may cross ranks, by a small integer code (the metadata of a gather is an int64 vector)
DTYPE_CODES: tuple[torch.dtype, ...] = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def is_distributed(group: Any = None) -> bool:
    """Whether ``group`` (``None``: the default group) is initialized and has several ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_and_world_size(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` of this process in ``group`` (``(0, 1)`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def require_process_group(what: str) -> None:
    """Raise a clear error, naming ``what`` needs one, when no process group is initialized."""
    if not dist.is_available():
        raise RuntimeError(f"{what} needs torch.distributed, which this torch build lacks.")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs an initialized process group: launch with `torchrun --nproc-per-node N` "
            "and call rankwise.training.distributed.init_distributed() (or "
            "torch.distributed.init_process_group) first."
        )


def comm_device(group: Any = None, like: torch.Tensor | None = None) -> torch.device:
    """The device tensors must be on for collectives of ``group``'s backend.

    NCCL communicates CUDA tensors (on the current CUDA device); gloo CPU tensors. A backend serving
    both (``"cpu:gloo,cuda:nccl"``) keeps ``like`` (the tensor to communicate, if any) where it is.
    """
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend and "nccl" in backend:
        return like.device if like is not None else torch.device("cpu")
    if "nccl" in backend:
        if like is not None and like.device.type == "cuda":
            return like.device
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_small(values: Sequence[int], group: Any = None) -> list[list[int]]:
    """One list per rank, in rank order, of every rank's short vector of integers (row counts).

    Every rank passes the same number of ``values``.
    """
    local = torch.tensor(list(values), dtype=torch.int64, device=comm_device(group))
    world = dist.get_world_size(group)
    out = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(out, local, group=group)
    return [[int(v) for v in t.tolist()] for t in out]


def padded_all_gather(local: torch.Tensor, sizes: Sequence[int], group: Any = None) -> torch.Tensor:
    """Concatenation, in rank order, of every rank's ``local`` whose row counts are ``sizes``.

    ``local`` is ``(sizes[rank], ...)``, the trailing dimensions equal on every rank, and
    ``sizes`` comes from :func:`all_gather_small`. Rows are padded to ``max(sizes)`` for the one
    ``all_gather``; the ``(sum(sizes), ...)`` result has ``local``'s device and dtype. No autograd
    (see :mod:`rankwise.training.distributed`).
    """
    largest = max(sizes)
    device = comm_device(group, local)
    block = local.detach().to(device)
    if block.dtype == torch.bool:  # not every backend reduces bools; bytes travel everywhere
        block = block.to(torch.uint8)
    if block.shape[0] < largest:
        pad = block.new_zeros((largest - block.shape[0], *block.shape[1:]))
        block = torch.cat([block, pad])
    block = block.contiguous()
    out = [torch.empty_like(block) for _ in sizes]
    dist.all_gather(out, block, group=group)
    rows = torch.cat([piece[:n] for piece, n in zip(out, sizes, strict=True)])
    return rows.to(device=local.device, dtype=local.dtype)


def all_gather_rows(local: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, list[int]]:
    """All-gather tensors whose first dimension may differ between ranks (no autograd).

    Returns ``(rows, sizes)``: the ``(sum n, ...)`` concatenation in rank order of every rank's
    ``(n_rank, ...)`` ``local`` and every rank's count. The trailing dimensions and the dtype must
    agree on every rank; a mismatch raises the same ``ValueError`` on every rank (never a hang).
    """
    if local.dtype not in DTYPE_CODES:
        raise ValueError(f"cannot gather a tensor of dtype {local.dtype} across ranks.")
    meta = [local.ndim, DTYPE_CODES.index(local.dtype), *local.shape[1:]]
    width = 8  # ndim, dtype, then up to 6 trailing dimensions
    if len(meta) > width:
        raise ValueError(f"cannot gather a {local.ndim}-D tensor across ranks (at most 7-D).")
    gathered = all_gather_small(
        [local.shape[0] if local.ndim else 1, *meta, *[-1] * (width - len(meta))], group
    )
    signatures = {tuple(row[1:]) for row in gathered}
    if len(signatures) > 1:
        shapes = [
            f"rank {r}: {row[1]}-D {DTYPE_CODES[row[2]]} with trailing dims "
            f"{tuple(d for d in row[3:] if d >= 0)}"
            for r, row in enumerate(gathered)
        ]
        raise ValueError(
            "the tensors to gather differ in dimensions or dtype across ranks ("
            + "; ".join(shapes)
            + "); every rank must pass the same kind of tensor."
        )
    sizes = [row[0] for row in gathered]
    if local.ndim == 0:
        return padded_all_gather(local.reshape(1), sizes, group), sizes
    return padded_all_gather(local, sizes, group), sizes
