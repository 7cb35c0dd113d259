"""Data-parallel training with global-batch ranking losses on torch.distributed.

Listwise ranking losses are functions of the whole batch: the stochastic AUPRC estimator of Wen et
al. (NeurIPS 2022, Eq. 8) ranks every positive of an anchor against every negative of the batch,
and its auxiliary vector ``v`` is a moving average over batches (Eq. 10); the AUC loss of Gajić et
al. (Eq. 9) compares every positive pair with every negative pair. Under plain
DistributedDataParallel each rank would compute the loss of its own slice, a different (and
smaller-batch) objective. Here every rank computes the loss of the *global* batch instead:

* :class:`DistributedLoss` (and :func:`all_gather_with_grad`) all-gathers the embeddings and labels
  of every rank (local sizes may differ), computes the wrapped loss on their concatenation in rank
  order, and lets the gradient flow back to the local slice only, multiplied by the world size, so
  that DDP's averaging of the parameter gradients yields exactly the gradient of the loss of the
  concatenated batch in one process. Memory per rank: the global batch ``B x d`` of embeddings
  (and its gradient) plus whatever the loss itself builds from ``B`` rows (a ``B x B`` score
  matrix and its masks for every rankwise loss; more for the pair-based ones, see
  docs/losses.md).
* Buffered loss state (SOPRC's ``v``, the XBM queue, any multiplier) is updated by the loss from
  the global batch, so it evolves identically on every rank; :func:`check_replicas_in_sync`
  compares checksums of every weight, buffer and optimizer tensor across ranks and names what
  diverged.
* :class:`DistributedTrainer` is :class:`~rankwise.training.Trainer` on a process group: the model
  in DDP, the batch gathered right after the forward pass (the finite check, the collapse
  detector and the loss see the global batch), a
  :class:`~rankwise.sampling.DistributedMPerClassBatchSampler` shard of every global P x K batch,
  sharded evaluation with exactly merged metrics (:mod:`rankwise.metrics.distributed`), rank 0
  alone writing the run directory, and checkpoints that resume bit for bit with the same world
  size.

Launch with ``torchrun --nproc-per-node N -m rankwise train -c CONFIG`` (see docs/distributed.md).
"""

from __future__ import annotations

import gc
import importlib
import os
import traceback
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, Subset

from .._distributed import (
    DTYPE_CODES,
    all_gather_rows,
    all_gather_small,
    comm_device,
    is_distributed,
    padded_all_gather,
    rank_and_world_size,
    require_process_group,
)
from .._validation import Interval, check_choice, check_scalar
from .build import seed_everything
from .callbacks import Callback
from .checkpoint import capture_rng_state, restore_rng_state
from .errors import ConfigError, DiskFullError, ReplicaDivergenceError
from .loader import BatchSampler, mix_seed
from .lock import RunDirLock
from .trainer import Trainer

if TYPE_CHECKING:
    from ..metrics import PRCurve, RetrievalReport

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

GRADIENT_REDUCTIONS = ("mean", "sum")


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


# -- the gathered batch ----------------------------------------------------------------------------


class _AllGatherWithGrad(torch.autograd.Function):
    """Concatenate every rank's rows; backward returns this rank's slice of the gradient, scaled.

    The backward is local (no collective): every rank computes the same loss from the same
    gathered batch, so the gradient w.r.t. the gathered tensor is the same on every rank and the
    slice of this rank is all it needs.
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
        else [
            int(embeddings.shape[1]),
            DTYPE_CODES.index(embeddings.dtype),
        ]
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

    A collective (every rank calls it at the same point). Local batch sizes may differ between
    ranks; the embedding dimension and dtype must not (the same ``ValueError`` is raised on
    every rank otherwise). Without a multi-rank process group the inputs come back unchanged.

    Args:
        embeddings: this rank's ``(B_r, d)`` embeddings (with autograd history).
        labels: its ``(B_r,)`` class ids (or ``(B_r, C)`` multi-hot).
        group: the process group (``None``: the default one).
        gradient_reduction: how the parameter gradients are reduced across ranks afterwards:
            ``"mean"`` (DistributedDataParallel): the gradient reaching the local embeddings is
            multiplied by the world size, so the averaged parameter gradient is the gradient of
            the global-batch loss; ``"sum"`` (you all-reduce-sum the gradients yourself): no
            scaling.

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
    loss builds from ``B`` rows (the ``B x B`` score matrix and masks of every rankwise loss).

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
    """Two position-weighted sums (mod a prime) of the 16-bit halves of a tensor's bytes: (2,).

    Exact integer arithmetic, so the result depends only on the bits and not on the reduction
    order of the device: equal tensors give equal checksums on every rank, and changing any
    16-bit half-word (e.g. one float in its last bit) changes both sums.
    """
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

    A collective: every rank computes :func:`replica_checksums` (exact, on its device; only the
    checksums travel) and compares them with rank 0's. Every rank raises the same error, naming
    the tensors that differ and the ranks that hold another copy. Without a multi-rank process
    group it does nothing.

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
    """Keeps the ranks of a :class:`DistributedTrainer` in step with each other.

    After every step the ranks agree on stopping (a Ctrl-C that reached one rank
    stops every rank after the same step, with one checkpoint), and every ``check_every`` steps
    they compare their weights, loss buffers and optimizer state
    (:func:`check_replicas_in_sync`; the trainer also checks before every checkpoint).

    Args:
        check_every: steps between replica checks (``None``: only at checkpoints).
    """

    def __init__(self, check_every: int | None = None) -> None:
        self.check_every = (
            None
            if check_every is None
            else check_scalar(check_every, "check_every", Interval("integer", 1, None))
        )

    def on_step_end(self, trainer: Any) -> None:
        """Agree on stopping; check the replicas every ``check_every`` steps."""
        group = getattr(trainer, "group", None)
        if not is_distributed(group):
            return
        flag = torch.tensor([int(trainer._stop_requested)], device=comm_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        trainer._stop_requested = bool(flag.item())
        due = self.check_every is not None and trainer.step % self.check_every == 0
        if due and trainer.last_checkpoint_step != trainer.step:
            trainer.check_replicas()


# -- the trainer -----------------------------------------------------------------------------------


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class DistributedTrainer(Trainer):
    """:class:`~rankwise.training.Trainer` on a torch.distributed process group (one per rank).

    Every rank builds the same objects (same seed) and calls :meth:`fit`; the process group must
    be initialized first (:func:`init_distributed`). What changes from the one-process loop:

    * the model is wrapped in ``DistributedDataParallel`` (SyncBatchNorm on CUDA when the model
      has BatchNorm layers; on the CPU their statistics stay per rank, with a warning);
    * each rank embeds its shard of every global P x K batch (an
      :class:`~rankwise.sampling.MPerClassBatchSampler` is sharded with
      :class:`~rankwise.sampling.DistributedMPerClassBatchSampler`; its ``batch_size`` is the
      global batch), and the embeddings and labels are all-gathered right after the forward
      pass, so the finite check, the collapse detector and the loss see the global batch — the
      batch a one-process run with the same seed sees, in the same order;
    * evaluation embeds a contiguous shard of the data on each rank, gathers the embeddings and
      ranks each rank's queries against all of them; the per-query results are merged exactly
      (:func:`rankwise.metrics.distributed_retrieval_metrics`), so every rank gets the same
      report;
    * rank 0 alone writes ``metrics.jsonl``, the checkpoints, the report and the plots, and
      prints; every rank reads ``last.pt`` on resume (the run directory must be visible to every
      node), which requires the world size of the run that wrote it;
    * before every checkpoint (and every ``check_every`` steps) the ranks compare checksums of
      their weights, loss buffers and optimizer state (:func:`check_replicas_in_sync`), and after
      every step they agree on stopping (:class:`ReplicaSync`).

    Args:
        *args: as :class:`~rankwise.training.Trainer`.
        group: the process group (``None``: the default one).
        check_every: steps between replica checks (default: ``config.distributed.check_every``,
            else only at checkpoints).
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm on CUDA (default:
            ``config.distributed.sync_batchnorm``, else ``True``).
        find_unused_parameters: passed to ``DistributedDataParallel``.
        **kwargs: as :class:`~rankwise.training.Trainer`. ``loss_fn`` may be a
            :class:`DistributedLoss` (it is unwrapped: the trainer gathers the batch itself).
    """

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
        sampler: BatchSampler | None = None,
        device: str | torch.device | None = None,
        console: Any = None,
        progress: bool | None = None,
        resume: bool = False,
        **kwargs: Any,
    ) -> None:
        require_process_group("DistributedTrainer")
        self.group = group
        self._process_rank, self._world = rank_and_world_size(group)
        self._pending_rng: list[Any] | None = None
        config = kwargs.get("config")
        settings = getattr(config, "distributed", None)
        if check_every is None and settings is not None:
            check_every = settings.check_every
        if sync_batchnorm is None:
            sync_batchnorm = True if settings is None else settings.sync_batchnorm
        if isinstance(loss_fn, DistributedLoss):
            loss_fn = loss_fn.loss
        if self._process_rank != 0:
            from rich.console import Console

            console, progress = Console(stderr=True, quiet=True), False
        device = self._rank_device(model, device)
        model = self._prepare_batchnorm(model, device, bool(sync_batchnorm))
        if sampler is not None:
            sampler = self._shard_sampler(sampler, config)
        super().__init__(
            model,
            loss_fn,
            train_data,
            sampler=sampler,
            device=device,
            console=console,
            progress=progress,
            resume=resume,
            **kwargs,
        )
        try:
            self._join_replicas(group, bool(find_unused_parameters), resume, check_every)
        except BaseException:
            self._release_run_dir()  # rank 0 took the run directory's lock
            raise

    def _join_replicas(
        self, group: Any, find_unused_parameters: bool, resume: bool, check_every: int | None
    ) -> None:
        """Check the ranks agree, wrap the model in DDP, and start every rank from one state."""
        self._check_same_schedule()
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(
            self.model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=group,
            find_unused_parameters=find_unused_parameters,
        )
        if not resume and self._process_rank > 0:
            # every rank starts from rank 0's weights (DDP broadcasts them); random layers
            # (dropout) get a stream of their own per rank
            seed_everything(mix_seed(self.seed, self._process_rank) % 2**63)
        self._add_callback(ReplicaSync(check_every))
        self._active = list(self.callbacks)
        self.check_replicas()

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def _lock_run_dir(
        cls,
        run_dir: Path,
        key: str,
        *,
        resume: bool = False,
        check: Callable[[], None] | None = None,
        group: Any = None,
    ) -> RunDirLock:
        """Rank 0 alone (it writes the run directory) takes the lock; every rank learns the outcome.

        A refusal (the folder in use, or ``check`` failing) is raised on every rank, so no
        rank waits in a collective for one that gave up. A collective. Arguments as
        :meth:`Trainer._lock_run_dir <rankwise.training.Trainer._lock_run_dir>`.

        Returns:
            The hold of the lock on rank 0, an empty one on the others.
        """
        if not is_distributed(group):
            return super()._lock_run_dir(run_dir, key, resume=resume, check=check)
        lock, failure, refusal = RunDirLock(Path(run_dir), held=False), None, [None]
        if rank_and_world_size(group)[0] == 0:
            try:
                lock = super()._lock_run_dir(run_dir, key, resume=resume, check=check)
            except Exception as exc:  # told to every rank below
                failure, refusal = exc, [str(exc)]
        source = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(refusal, src=source, group=group)
        if failure is not None:
            raise failure
        if refusal[0] is not None:
            raise ConfigError(refusal[0])
        return lock

    @staticmethod
    def _rank_device(model: nn.Module, device: str | torch.device | None) -> torch.device | None:
        """``cuda`` without an index becomes the current CUDA device (the local rank's)."""
        if device is None:
            return None
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    def _prepare_batchnorm(
        self, model: nn.Module, device: torch.device | None, sync: bool
    ) -> nn.Module:
        if not _has_batchnorm(model) or self._world == 1:
            return model
        on_cuda = (device is not None and device.type == "cuda") or (
            device is None and next(model.parameters()).is_cuda
        )
        if sync and on_cuda:
            return nn.SyncBatchNorm.convert_sync_batchnorm(model, self.group)
        if self._process_rank == 0:
            warnings.warn(
                "the model has BatchNorm layers whose batch statistics are computed per rank "
                f"(on {100 // self._world} % of the global batch"
                + (", SyncBatchNorm needs CUDA)" if sync else ")")
                + ", so the gradient is not exactly the global batch's; freeze them "
                "(model.frozen_bn=true) or train on CUDA with distributed.sync_batchnorm=true.",
                UserWarning,
                stacklevel=3,
            )
        return model

    def _shard_sampler(self, sampler: BatchSampler, config: Any) -> BatchSampler:
        from ..sampling import DistributedMPerClassBatchSampler, MPerClassBatchSampler

        if not isinstance(sampler, MPerClassBatchSampler):
            return sampler  # the user's own sampler must shard by rank itself
        if sampler.num_replicas == self._world and sampler.rank == self._process_rank:
            return sampler
        if sampler.num_replicas != 1:
            raise ValueError(
                f"`sampler` is sharded for {sampler.num_replicas} replicas (rank {sampler.rank}) "
                f"but this process is rank {self._process_rank} of {self._world}; pass an unsharded "
                "sampler (its batch_size is the global batch) or one built for this rank."
            )
        try:
            return DistributedMPerClassBatchSampler.from_sampler(
                sampler, self._world, self._process_rank
            )
        except ValueError as exc:
            if config is None:
                raise ValueError(f"`sampler`: {exc}") from None
            raise ConfigError(
                f"sampler.batch_size: {sampler.batch_size} / sampler.m={sampler.m} = "
                f"{sampler.classes_per_batch} classes per global batch must be divisible by the "
                f"world size {self._world} (each rank gets whole classes); use a batch_size that "
                f"is a multiple of m x {self._world}."
            ) from None
        return sampler

    def _default_sampler(self) -> BatchSampler:
        return self._shard_sampler(super()._default_sampler(), None)

    def _check_same_schedule(self) -> None:
        rows = all_gather_small([self.steps_per_epoch, self.total_steps], self.group)
        if len({tuple(r) for r in rows}) > 1:
            raise ValueError(
                "the ranks disagree on the batches per epoch / total steps "
                f"({[tuple(r) for r in rows]}); every rank must use the same data, sampler "
                "settings and budget."
            )

    # -- identity -------------------------------------------------------------------------------

    @property
    def is_main_process(self) -> bool:
        """Rank 0 writes the run directory and prints."""
        return self._process_rank == 0

    @property
    def world_size(self) -> int:
        """The number of data-parallel processes."""
        return self._world

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self._process_rank

    def check_replicas(self) -> None:
        """Raise :class:`ReplicaDivergenceError` unless every rank holds the same state.

        A collective (see :func:`check_replicas_in_sync`): weights, loss buffers, optimizer state.
        """
        try:
            check_replicas_in_sync(
                self.model, self.loss_fn, self.optimizer, group=self.group, step=self.step
            )
        except ReplicaDivergenceError as exc:
            exc.last_good_checkpoint = self.last_good_checkpoint
            exc.args = (f"{exc.args[0]} Training stopped and {self.kept_checkpoint_message()}.",)
            raise

    # -- training -------------------------------------------------------------------------------

    def _forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings = self.ddp(x.to(self.device, non_blocking=True))
        labels = y.to(self.device, non_blocking=True)
        global_embeddings, global_labels, _ = all_gather_with_grad(
            embeddings, labels, self.group, "mean"
        )
        return global_embeddings, global_labels

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The complete state (see :meth:`Trainer.state_dict`), with every rank's RNG streams.

        Inside :meth:`save_checkpoint` the RNG states of all ranks are gathered (a collective);
        called alone it holds this rank's only.
        """
        state = super().state_dict()
        state["rng_per_rank"] = (
            self._pending_rng if self._pending_rng is not None else [capture_rng_state()]
        )
        return state

    def save_checkpoint(self) -> Any:
        """Check the replicas, gather every rank's RNG state; rank 0 writes ``last.pt``.

        A collective: every rank calls it at the same step.

        Returns:
            The checkpoint's path.
        """
        self.check_replicas()
        states: list[Any] = [None] * self._world
        dist.all_gather_object(states, capture_rng_state(), group=self.group)
        self._pending_rng = states
        failure: BaseException | None = None
        try:
            path = super().save_checkpoint()
        except Exception as exc:  # rank 0 could not write: every rank must learn it
            failure, path = exc, self.checkpoint_dir / "last.pt"
        finally:
            self._pending_rng = None
        # no rank goes on (and, say, resumes from last.pt) before rank 0 has written it;
        # 1: rank 0 failed, 2: its disk is full (every rank then ends the same way)
        code = 0 if failure is None else 2 if isinstance(failure, DiskFullError) else 1
        flag = torch.tensor([code], device=comm_device(self.group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if failure is not None:
            raise failure
        if int(flag.item()) == 2:
            raise DiskFullError(
                path,
                None,
                None,
                run_dir=self.run_dir,
                kept=self.kept_checkpoint_message(),
                resumable=self.last_checkpoint_step is not None,
                detail="rank 0 found no space left; see its message",
            )
        if int(flag.item()):
            raise RuntimeError(
                f"rank 0 could not write the checkpoint {path}; see its error message."
            )
        return path

    def _restore_rng(self, state: dict[str, Any]) -> None:
        per_rank = state.get("rng_per_rank")
        if per_rank is None and self._world == 1:  # a one-process Trainer's checkpoint
            per_rank = [state["rng"]]
        if not per_rank or len(per_rank) != self._world:
            raise ConfigError(
                "run_dir: the checkpoint holds no random state for each of the "
                f"{self._world} ranks; it was not written by a run of this world size."
            )
        restore_rng_state(per_rank[self._process_rank])

    def _selected_weights(self) -> dict[str, torch.Tensor] | None:
        if self.run_dir is None:  # every rank kept the same selected weights in memory
            return super()._selected_weights()
        payload: list[Any] = [None]
        if self.is_main_process:
            weights = super()._selected_weights()
            payload[0] = None if weights is None else {k: v.cpu() for k, v in weights.items()}
        dist.broadcast_object_list(payload, src=self._global_rank(0), group=self.group)
        return payload[0]

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    # -- evaluation -----------------------------------------------------------------------------

    def _shard_bounds(self, n: int) -> tuple[int, int]:
        return n * self._process_rank // self._world, n * (self._process_rank + 1) // self._world

    def _embed_shard(self, data: Dataset) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's contiguous shard of ``data``: embeddings, labels, first global index."""
        lo, hi = self._shard_bounds(len(data))  # type: ignore[arg-type]
        embeddings, labels = self.embed(Subset(data, range(lo, hi)))
        return embeddings, torch.from_numpy(labels).to(embeddings.device), lo

    def _rank(
        self, split: str, with_curve: bool = False
    ) -> tuple[RetrievalReport, torch.Tensor, PRCurve | None]:
        from ..metrics.distributed import distributed_pr_curve, distributed_retrieval_metrics

        data = self._data(split)
        gallery_data = self.gallery_data if split == "test" else None
        smallest = min(len(d) for d in (data, gallery_data) if d is not None)  # type: ignore[arg-type]
        if smallest < self._world:  # fewer items than ranks: every rank ranks everything
            return super()._rank(split, with_curve)
        query, labels, lo = self._embed_shard(data)
        everything = all_gather_rows(query, self.group)[0]
        if gallery_data is None:
            gallery = everything, all_gather_rows(labels, self.group)[0]
            own = torch.arange(lo, lo + query.shape[0], device=query.device)
        else:
            gallery_rows, gallery_labels, _ = self._embed_shard(gallery_data)
            gallery = (
                all_gather_rows(gallery_rows, self.group)[0],
                all_gather_rows(gallery_labels, self.group)[0],
            )
            own = None
        options = {"gallery_sharded": False, "exclude_self": own, "group": self.group}
        report = distributed_retrieval_metrics(query, labels, *gallery, ks=self.eval_ks, **options)
        curve = distributed_pr_curve(query, labels, *gallery, **options) if with_curve else None
        return report, everything, curve
