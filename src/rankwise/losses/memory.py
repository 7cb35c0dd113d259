"""A cross-batch memory for the ranking losses: past embeddings as extra references.

Wang, Zhang, Huang and Scott, *Cross-Batch Memory for Embedding Learning* (XBM, CVPR 2020): the
embeddings of a network drift slowly, so the embeddings of the last few batches, kept detached
in a queue, are nearly what the network would give them now and serve as extra references for
the current batch. ROADMAP's released code (Ramzi et al., NeurIPS 2021) keeps such a memory for
its ranking losses; :class:`RankingMemory` gives it to every rankwise ranking loss (SOPRC, AP,
Smooth-AP, ROADMAP, Recall@k, AUC) through their ``ref_embeddings`` / ``ref_labels``.

At every training call from ``start_step`` on, each anchor of the batch is ranked against the
other rows of the batch (its own row excluded, as without a reference set;
:meth:`~rankwise.losses.base.RankingLoss.reference_leads_with_batch`) and every item of the
memory; then the batch is enqueued (detached), overwriting the oldest items. Before
``start_step`` the loss is the plain loss of the batch, and the batch is enqueued all the same,
so the memory is full when it starts. The gradient flows through the batch only. Eval mode
computes the plain loss and leaves the memory alone, so validation losses compare across runs.
docs/losses.md says what each loss does with the memory.

The queue, its labels, the write position, the fill count and the training calls seen are
registered buffers: ``state_dict()``, ``.to(device)`` and checkpoints carry them, and a resumed
run continues exactly. Labels and positions are mirrored on the host (read back once after a
``load_state_dict`` or a move), so a step reads nothing back from the device. Under data
parallelism the Trainer gives the loss the gathered global batch: every process enqueues the
same rows and holds the same memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._dispatch import to_device
from .._validation import Interval, check_scalar
from .auc import AUCLoss
from .base import RankingLoss, score_dtype
from .recall_at_k import RecallAtKLoss
from .roadmap import ROADMAPLoss
from .smooth_ap import SmoothAPLoss
from .soprc import APLoss, SOPRCLoss

__all__ = ["MEMORY_LOSSES", "RankingMemory"]

#: registry names of the losses a memory can serve (``build_loss(..., memory=...)``)
MEMORY_LOSSES = ("soprc", "ap", "smooth_ap", "roadmap", "recall_at_k", "auc")
_MEMORY_CLASSES = (SOPRCLoss, APLoss, SmoothAPLoss, ROADMAPLoss, RecallAtKLoss, AUCLoss)


class RankingMemory(nn.Module):
    """A ranking loss whose reference set is the batch plus a queue of past batches.

    Args:
        loss: the wrapped loss, one of ``SOPRCLoss``, ``APLoss``, ``SmoothAPLoss``,
            ``ROADMAPLoss``, ``RecallAtKLoss`` (without SiMix) or ``AUCLoss``.
        size: items the memory holds, at least the batch size (a few batches: XBM's paper
            keeps up to the whole training set on large datasets).
        embedding_dim: dimension of the embeddings.
        start_step: the training call (0-based) from which the memory is used; before it the
            plain loss (the memory fills meanwhile).

    Buffers: ``memory_embeddings`` (size, embedding_dim) float32 (follows ``.double()``),
    ``memory_labels`` (size,) int64, ``memory_position``, ``memory_count`` and ``steps_seen``
    (0-dim int64). ``last_stats`` is the wrapped loss's, plus ``n_memory_items`` (references
    taken from the memory in that call).

    Example:
        >>> import torch
        >>> from rankwise.losses import APLoss, RankingMemory
        >>> loss_fn = RankingMemory(APLoss(), size=8, embedding_dim=2)
        >>> labels = torch.tensor([0, 0, 1, 1])
        >>> first = loss_fn(torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]]), labels)
        >>> round(first.item(), 4), int(loss_fn.memory_count)  # empty memory: the plain loss
        (0.243, 4)
        >>> second = loss_fn(torch.tensor([[1.0, 0.1], [0.8, 0.5], [0.1, 1.0], [0.5, 0.9]]), labels)
        >>> loss_fn.last_stats["n_memory_items"], int(loss_fn.memory_count)
        (4, 8)
    """

    memory_embeddings: torch.Tensor
    memory_labels: torch.Tensor
    memory_position: torch.Tensor
    memory_count: torch.Tensor
    steps_seen: torch.Tensor
    #: the wrapped losses take their labels on the host (the Trainer leaves them there)
    takes_host_labels: bool = True

    def __init__(self, loss: nn.Module, size: int, embedding_dim: int, start_step: int = 0) -> None:
        super().__init__()
        if not isinstance(loss, _MEMORY_CLASSES):
            raise ValueError(
                f"`loss`: a memory serves the ranking losses {', '.join(MEMORY_LOSSES)}, not "
                f"{type(loss).__name__}; use that loss without a memory (the contrastive "
                "baseline has its own, 'xbm')."
            )
        if isinstance(loss, RecallAtKLoss) and loss.simix:
            raise ValueError(
                "`loss`: RecallAtKLoss(simix=True) mixes pairs of the batch ranked against "
                "itself and takes no reference set; build it with simix=False to use a memory."
            )
        self.loss: RankingLoss = loss
        self.size = check_scalar(size, "size", Interval("integer", 1, None))
        dim = check_scalar(embedding_dim, "embedding_dim", Interval("integer", 1, None))
        self.start_step = check_scalar(start_step, "start_step", Interval("integer", 0, None))
        self.register_buffer("memory_embeddings", torch.zeros(self.size, dim))
        self.register_buffer("memory_labels", torch.zeros(self.size, dtype=torch.int64))
        for name in ("memory_position", "memory_count", "steps_seen"):
            self.register_buffer(name, torch.zeros((), dtype=torch.int64))

    @property
    def last_stats(self) -> dict[str, Any]:
        """The wrapped loss's ``last_stats`` of the last call (with ``n_memory_items``)."""
        return self.loss.last_stats

    # -- the host mirror of the labels and positions -------------------------------------------
    def _buffers_key(self) -> tuple[Any, ...]:
        buffers = (self.memory_labels, self.memory_position, self.memory_count, self.steps_seen)
        return tuple((b._version, b.data_ptr(), b.device) for b in buffers)

    def _host(self) -> dict[str, Any]:
        """Labels (CPU tensor), position, count and steps on the host, read once after a change.

        The memory's own writes keep the mirror current; a ``load_state_dict``, a move or an
        edit from outside changes a buffer's version or storage, and the mirror is read again.
        """
        cached = self.__dict__.get("_mirror")
        if cached is None or cached[0] != self._buffers_key():
            labels = self.memory_labels.detach().to("cpu", copy=True)
            position, count, steps = torch.stack(
                [self.memory_position, self.memory_count, self.steps_seen]
            ).tolist()
            state = {"labels": labels, "position": position, "count": count, "steps": steps}
            cached = (self._buffers_key(), state)
            self.__dict__["_mirror"] = cached
        return cached[1]

    def reset(self) -> None:
        """Empty the memory and restart the step count (device and dtype kept)."""
        for buffer in (self.memory_embeddings, self.memory_labels, self.memory_position,
                       self.memory_count, self.steps_seen):  # fmt: skip
            buffer.zero_()

    # -- the call --------------------------------------------------------------------------------
    def _check(self, embeddings: torch.Tensor) -> None:
        if embeddings.ndim != 2:
            return  # the wrapped loss raises its own error about the shape
        if embeddings.shape[1] != self.memory_embeddings.shape[1]:
            raise ValueError(
                f"`embeddings` has dimension {embeddings.shape[1]} but the memory holds "
                f"{self.memory_embeddings.shape[1]}; build it with "
                f"embedding_dim={embeddings.shape[1]}."
            )
        if embeddings.shape[0] > self.size:
            raise ValueError(
                f"`embeddings` has {embeddings.shape[0]} rows, more than the memory's size="
                f"{self.size}; use a memory of at least the batch size (a few batches)."
            )
        if embeddings.device != self.memory_embeddings.device:
            raise ValueError(
                f"the memory is on {self.memory_embeddings.device} but `embeddings` are on "
                f"{embeddings.device}; move the loss with loss.to(device)."
            )

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss of one batch against itself and the memory, then the batch enqueued.

        Args:
            embeddings: (B, embedding_dim) float tensor, B <= size.
            labels: (B,) integer class ids (on the host, as the data loader gives them).
            ref_embeddings: refused (the batch and the memory are the reference set).
            ref_labels: refused, as ``ref_embeddings``.

        Returns:
            The wrapped loss's scalar (see the class docstring for which references it sees).
        """
        if ref_embeddings is not None or ref_labels is not None:
            raise ValueError(
                "RankingMemory takes no `ref_embeddings` / `ref_labels`: the batch and the "
                "memory are its reference set; call the wrapped loss (`.loss`) to rank against "
                "another one."
            )
        if not self.training:
            return self.loss(embeddings, labels)
        self._check(embeddings)
        host = self._host()
        if host["steps"] < self.start_step:
            value = self.loss(embeddings, labels)
            n_memory = 0
        else:
            value, n_memory = self._memory_call(embeddings, labels, host)
        # after the loss: a call that raises leaves the memory as it was
        self._enqueue(embeddings, labels, host, value)
        self.loss.last_stats["n_memory_items"] = n_memory
        return value

    def _memory_call(
        self, embeddings: torch.Tensor, labels: torch.Tensor, host: dict[str, Any]
    ) -> tuple[torch.Tensor, int]:
        """The loss with the reference set ``[batch; memory rows 0 .. count-1]``."""
        n_memory = host["count"]
        # half-precision rows are scored in float32 anyway: upcast them rather than round the
        # memory down to their dtype
        dtype = torch.promote_types(score_dtype(embeddings.dtype), self.memory_embeddings.dtype)
        rows = embeddings.to(dtype)
        memory = self.memory_embeddings[:n_memory].to(dtype)
        host_labels = labels if labels.device.type == "cpu" else labels.cpu()
        ref_labels = torch.cat([host_labels.to(torch.int64), host["labels"][:n_memory]])
        with self.loss.reference_leads_with_batch():
            value = self.loss(rows, host_labels, torch.cat([rows, memory]), ref_labels)
        return value, n_memory

    @torch.no_grad()
    def _enqueue(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        host: dict[str, Any],
        value: torch.Tensor,
    ) -> None:
        """Write the batch (detached) into the next slots; positions advance on the host."""
        batch_size = embeddings.shape[0]
        position = host["position"]
        slots = (position + torch.arange(batch_size)) % self.size
        host_labels = (labels if labels.device.type == "cpu" else labels.cpu()).to(torch.int64)
        device = self.memory_embeddings.device
        slots_device, labels_device = to_device([slots, host_labels], device)
        rows = embeddings.detach().to(self.memory_embeddings.dtype)
        # a call refused on an accelerator returns NaN (its error raised when last_stats is
        # read): its rows are not written, so the memory never holds them
        old = self.memory_embeddings.index_select(0, slots_device)
        rows = torch.where(torch.isfinite(value), rows, old)
        self.memory_embeddings.index_copy_(0, slots_device, rows)
        self.memory_labels.index_copy_(0, slots_device, labels_device)
        host["labels"][slots] = host_labels
        host["position"] = (position + batch_size) % self.size
        host["count"] = min(self.size, host["count"] + batch_size)
        host["steps"] += 1
        self.memory_position.fill_(host["position"])
        self.memory_count.fill_(host["count"])
        self.steps_seen.fill_(host["steps"])
        self.__dict__["_mirror"] = (self._buffers_key(), host)

    def extra_repr(self) -> str:
        """The memory's settings, shown by ``repr``."""
        return (
            f"size={self.size}, embedding_dim={self.memory_embeddings.shape[1]}, "
            f"start_step={self.start_step}"
        )
