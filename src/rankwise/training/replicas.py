"""The collectives of data-parallel training: the gathered batch and replicas kept in sync.

:func:`all_gather_with_grad` lets every rank compute the loss of the global batch (Wen et al.,
NeurIPS 2022, Eq. 8); :func:`check_replicas_in_sync` compares exact checksums across ranks;
:class:`ReplicaSync` agrees on stopping. Re-exported by :mod:`rankwise.training.distributed`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._distributed import (
    DTYPE_CODES,
    all_gather_rows,
    all_gather_small,
    is_distributed,
    padded_all_gather,
    rank_and_world_size,
)
from .._validation import Interval, check_choice, check_scalar
from .callbacks.base import Callback, TrainerView
from .errors import ReplicaDivergenceError

__all__ = [
    "GRADIENT_REDUCTIONS",
    "ReplicaSync",
    "all_gather_with_grad",
    "check_replicas_in_sync",
    "replica_checksums",
]

GRADIENT_REDUCTIONS = ("mean", "sum")


# -- the gathered batch ----------------------------------------------------------------------------


class _AllGatherWithGrad(torch.autograd.Function):
    """Concatenate every rank's rows; backward returns this rank's slice of the gradient, scaled.

    No collective in backward: every rank's loss, hence gradient w.r.t. the gathered rows, is equal.
    """

    @staticmethod
    def forward(
        ctx: Any, local: torch.Tensor, sizes: list[int], rank: int, group: Any, scale: float
    ) -> torch.Tensor:
        ctx.start = sum(sizes[:rank])
        ctx.stop = ctx.start + sizes[rank]
        ctx.scale = scale
        return padded_all_gather(local, sizes, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        local = grad[ctx.start : ctx.stop]
        if ctx.scale != 1:
            local = local * ctx.scale
        return local, None, None, None, None


def _check_local_batch(embeddings: Any, labels: Any) -> str | None:
    """A problem with this rank's inputs that would break the gather (``None``: fine)."""
    if not isinstance(embeddings, torch.Tensor) or embeddings.ndim != 2:
        shape = tuple(getattr(embeddings, "shape", ()))
        return f"`embeddings` must be a 2-D (B, d) tensor, got {type(embeddings).__name__} {shape}"
    if not embeddings.is_floating_point():
        return f"`embeddings` must be a floating tensor, got {embeddings.dtype}"
    if not isinstance(labels, torch.Tensor) or labels.ndim not in (1, 2):
        return "`labels` must be a (B,) tensor of class ids (or (B, C) multi-hot)"
    if labels.shape[0] != embeddings.shape[0]:
        return (
            f"`labels` has {labels.shape[0]} rows but `embeddings` has {embeddings.shape[0]}; "
            "pass one label per embedding"
        )
    return None


def _agree_on_local_inputs(embeddings: Any, labels: Any, group: Any) -> None:
    """Raise the same error on every rank when any rank's inputs cannot be gathered."""
    problem = _check_local_batch(embeddings, labels)
    if problem is None and embeddings.dtype not in DTYPE_CODES:
        problem = f"`embeddings` has dtype {embeddings.dtype}, which cannot cross ranks"
    signature = (
        [-1, -1]
        if problem is not None
        else [int(embeddings.shape[1]), DTYPE_CODES.index(embeddings.dtype)]
    )
    rows = all_gather_small([0 if problem is None else 1, *signature], group)
    bad = [r for r, row in enumerate(rows) if row[0]]
    if problem is not None:
        raise ValueError(f"{problem} (rank {rank_and_world_size(group)[0]}).")
    if bad:
        raise ValueError(
            f"rank(s) {bad} passed unusable embeddings or labels to the distributed loss; see "
            "their error message."
        )
    if len({tuple(row[1:]) for row in rows}) > 1:
        kinds = [f"rank {r}: d={row[1]}, {DTYPE_CODES[row[2]]}" for r, row in enumerate(rows)]
        raise ValueError(
            "the ranks' embeddings differ in dimension or dtype (" + "; ".join(kinds) + "); "
            "every rank must run the same model in the same precision."
        )


def all_gather_with_grad(
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    group: Any = None,
    gradient_reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """The global batch: every rank's embeddings and labels, concatenated in rank order.

    A collective. Local batch sizes may differ; dimension and dtype must not (the same
    ``ValueError`` on every rank). Without a multi-rank group the inputs come back unchanged.

    Args:
        embeddings: this rank's ``(B_r, d)`` embeddings (with autograd history).
        labels: its ``(B_r,)`` class ids (or ``(B_r, C)`` multi-hot).
        group: the process group (``None``: the default one).
        gradient_reduction: how parameter gradients are reduced across ranks afterwards:
            ``"mean"`` (DDP; the local gradient is multiplied by the world size) or ``"sum"``
            (your own all-reduce-sum; no scaling); either way the global-batch gradient.

    Returns:
        ``(global_embeddings (B, d), global_labels (B, ...), local)`` with ``local`` the slice
        of this rank's rows in the global batch.
    """
    reduction = check_choice(gradient_reduction, "gradient_reduction", GRADIENT_REDUCTIONS)
    if not is_distributed(group):
        return embeddings, labels, slice(0, int(embeddings.shape[0]))
    _agree_on_local_inputs(embeddings, labels, group)
    rank, world = rank_and_world_size(group)
    global_labels, sizes = all_gather_rows(labels, group)
    scale = float(world) if reduction == "mean" else 1.0
    global_embeddings = _AllGatherWithGrad.apply(embeddings, sizes, rank, group, scale)
    start = sum(sizes[:rank])
    return global_embeddings, global_labels, slice(start, start + sizes[rank])


# -- replicas in sync ------------------------------------------------------------------------------

_MODULUS = 2**31 - 1  # a prime; every product below stays far inside int64
_CHUNK = 1 << 22


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8)


def _tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """(2,) position-weighted sums mod a prime of a tensor's 16-bit words: exact, order-free."""
    raw = _as_bytes(tensor)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    words = raw.view(torch.int16) if raw.numel() else raw.new_zeros(0, dtype=torch.int16)
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        block = words[start : start + _CHUNK].to(torch.int64) & 0xFFFF
        position = torch.arange(start, start + block.numel(), device=block.device) % _MODULUS
        weight_a = (position * 48271 + 11) % _MODULUS
        weight_b = (position * 69621 + 7) % _MODULUS
        sums[0] += ((block * weight_a) % _MODULUS).sum()
        sums[1] += ((block * weight_b) % _MODULUS).sum()
    return sums % _MODULUS


def _named_state(
    model: nn.Module | None, loss_fn: nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> Iterable[tuple[str, torch.Tensor]]:
    for prefix, module in (("model", model), ("loss", loss_fn)):
        if module is not None:
            for name, tensor in module.state_dict(keep_vars=False).items():
                if isinstance(tensor, torch.Tensor):
                    yield f"{prefix}.{name}", tensor
    if optimizer is not None:
        for index, slots in optimizer.state_dict()["state"].items():
            for key, value in slots.items():
                if isinstance(value, torch.Tensor):
                    yield f"optimizer.state.{index}.{key}", value


def replica_checksums(
    model: nn.Module | None = None,
    loss_fn: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, tuple[str, str, int, int]]:
    """Exact checksums of every weight, buffer and optimizer tensor of this process.

    Args:
        model: the model (its ``state_dict``: parameters and buffers).
        loss_fn: the loss (its buffers: SOPRC's ``v`` and ``v_updates``, the XBM memory, ...).
        optimizer: the optimizer (its per-parameter state, e.g. Adam's moments and step).

    Returns:
        ``{name: (dtype, shape, checksum_a, checksum_b)}``, names prefixed ``model.``, ``loss.``
        or ``optimizer.state.<param index>.``.
    """
    names, meta, sums = [], [], []
    for name, tensor in _named_state(model, loss_fn, optimizer):
        names.append(name)
        meta.append((str(tensor.dtype), str(tuple(tensor.shape))))
        sums.append(_tensor_checksum(tensor).cpu())
    values = torch.stack(sums).tolist() if sums else []
    return {
        name: (dtype, shape, int(a), int(b))
        for name, (dtype, shape), (a, b) in zip(names, meta, values, strict=True)
    }


def check_replicas_in_sync(
    model: nn.Module | None = None,
    loss_fn: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    group: Any = None,
    step: int | None = None,
) -> None:
    """Raise :class:`~rankwise.training.errors.ReplicaDivergenceError` unless all ranks agree.

    A collective comparing every rank's :func:`replica_checksums` with rank 0's; every rank
    raises the same error, naming the tensors and ranks that differ. A no-op on one process.

    Args:
        model: the model (the unwrapped module, not the DDP wrapper).
        loss_fn: the loss.
        optimizer: the optimizer.
        group: the process group.
        step: the training step, for the message.
    """
    if not is_distributed(group):
        return
    mine = replica_checksums(model, loss_fn, optimizer)
    _, world = rank_and_world_size(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    differing: dict[str, list[int]] = {}
    for rank, theirs in enumerate(everyone[1:], start=1):
        for name in sorted(set(reference) | set(theirs)):
            if reference.get(name) != theirs.get(name):
                differing.setdefault(name, []).append(rank)
    if not differing:
        return
    names = sorted(differing)
    ranks = sorted({r for rs in differing.values() for r in rs})
    shown = ", ".join(f"{n} (ranks {differing[n]})" for n in names[:10])
    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
    at = f" at step {step}" if step is not None else ""
    message = (
        f"the data-parallel replicas diverged{at}: {len(names)} tensor(s) differ from rank 0's "
        f"copy: {shown}{more}. Every rank must apply the same update: check for "
        "non-deterministic kernels (deterministic=true), rank-dependent code, or loss state "
        "updated from the local instead of the global batch."
    )
    record = {"kind": "error", "step": step, "error": "replicas diverged", "tensors": names[:50]}
    raise ReplicaDivergenceError(message, step or 0, None, names, ranks, record)


class ReplicaSync(Callback):
    """Checks the replicas of a data-parallel run every ``check_every`` steps.

    :func:`check_replicas_in_sync` (a collective) after the steps that are no checkpoint's (a
    checkpoint checks them itself). The ranks agree on stopping through the trainer's
    :class:`~rankwise.training.stop.StopControl`.

    Args:
        check_every: steps between replica checks (``None``: only at checkpoints).
    """

    def __init__(self, check_every: int | None = None) -> None:
        self.check_every = (
            None
            if check_every is None
            else check_scalar(check_every, "check_every", Interval("integer", 1, None))
        )

    def on_step_end(self, trainer: TrainerView) -> None:
        """Check the replicas every ``check_every`` steps."""
        if trainer.strategy.world_size == 1:
            return
        due = self.check_every is not None and trainer.step % self.check_every == 0
        if due and trainer.store.last_step != trainer.step:
            trainer.check_replicas()
