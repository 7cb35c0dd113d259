"""Data-parallel training with global-batch ranking losses on torch.distributed.

Listwise losses are functions of the whole batch (Wen et al., NeurIPS 2022, Eq. 8 and the moving
average ``v`` of Eq. 10; Gajić et al., Eq. 9), so under plain DistributedDataParallel each rank
would optimize a smaller-batch objective. Here every rank computes the loss of the *global* batch
(:class:`DistributedLoss`, :func:`all_gather_with_grad`) and buffered loss state evolves
identically on every rank (:func:`check_replicas_in_sync`). Launch with ``torchrun
--nproc-per-node N -m rankwise train -c CONFIG``; see docs/distributed.md. The process group's
set-up and shutdown live in :mod:`rankwise.training.launch` (re-exported here);
:class:`DistributedTrainer` is the :class:`~rankwise.training.Trainer` with a
:class:`~rankwise.training.strategy.DataParallelStrategy`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .._distributed import is_distributed, require_process_group
from .._validation import check_choice
from .launch import (
    DistributedContext,
    init_distributed,
    launched_by_torchrun,
    shutdown_distributed,
)
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
    """``Trainer(..., strategy=DataParallelStrategy(...))`` under its old name (a thin alias).

    The :class:`~rankwise.training.Trainer` on a torch.distributed process group (one per rank);
    ``Trainer.from_config`` under torchrun chooses the same strategy by itself. Every rank
    builds the same objects (same seed) after :func:`init_distributed` and calls :meth:`fit`;
    what changes from one process is said in
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

    strategy_class = DataParallelStrategy  # from_config: data-parallel even in a group of one

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
        return self.training_module
