"""The Trainer's optimizer step: mixed precision and batches larger than memory.

:class:`OptimizerStep` owns what one step does between a batch and ``optimizer.step()``:

- **Precision** (``"32"``, ``"bf16"``, ``"16"``): ``torch.autocast`` around the model's forward
  pass (the device type of the trainer's device). The embeddings leave autocast cast to float32
  and the loss runs outside it, in float32 (what the losses require of half inputs anyway:
  docs/losses.md, "Half precision"), so a loss of yours sees float32 too. ``"16"`` scales the
  loss with a ``torch.amp.GradScaler`` (loss scaling, Micikevicius et al., "Mixed Precision
  Training", ICLR 2018): a step whose gradients overflow is skipped and counted
  (:attr:`OptimizerStep.overflow_steps`); the scaler's state is checkpointed, so a resumed run
  scales as an uninterrupted one. bfloat16 has float32's range and needs no scaling.
- **Sub-batches** (``sub_batch_size``): gradient caching (Gao et al., "Scaling Deep Contrastive
  Learning Batch Size under Memory Limited Setup", RepL4NLP 2021), as the Recall@k surrogate's
  code (Patel et al., CVPR 2022) embeds its batches of thousands: the batch is embedded in chunks
  without gradients, gathered (under data parallelism, the same gather as the one-pass step), the
  loss and its gradient with respect to the embeddings computed once, then each chunk is embedded
  again with gradients and its slice of that gradient back-propagated; one optimizer step. Only
  one chunk's activations are alive at a time. The parameters after the step equal those of the
  one-pass step up to float rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._validation import check_choice
from .arguments import positive_int
from .settings import PRECISIONS

__all__ = ["PRECISIONS", "OptimizerStep"]

_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16}

Gather = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _check_precision(precision: Any, device: torch.device) -> str:
    """``precision`` checked against :data:`PRECISIONS` and what ``device`` can autocast.

    Args:
        precision: ``"32"``, ``"bf16"`` or ``"16"`` (the integers 32 and 16 as YAML reads them
            are accepted).
        device: where the model trains.

    Returns:
        The precision as a string.

    Raises:
        ValueError: an unknown precision, or one the device cannot run (named, with the fix).
    """
    if isinstance(precision, int) and not isinstance(precision, bool):
        precision = str(precision)
    precision = check_choice(precision, "precision", PRECISIONS)
    if precision == "32":
        return precision
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        raise ValueError(
            f"`precision`: {precision!r} needs torch.autocast, which torch {torch.__version__} "
            f"does not offer on the device {str(device)!r}; use precision '32' there."
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"`precision`: the GPU {str(device)!r} ({torch.cuda.get_device_name(device)}) has no "
            "bfloat16 support; use precision '16' (float16 with loss scaling) or '32'."
        )
    return precision


def _batch_norm_in_training(model: nn.Module) -> list[str]:
    """The names of ``model``'s batch-norm layers in training mode (``"<model>"`` for the root).

    Their output depends on the rest of the batch, and they update their running statistics at
    every forward pass, so a batch embedded in sub-batches would not be the batch embedded once.
    """
    return [
        name or "<model>"
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training
    ]


def _refuse_batch_norm(names: list[str], sub_batch_size: int) -> None:
    if not names:
        return
    shown = ", ".join(repr(n) for n in names[:3]) + (
        f" and {len(names) - 3} more" if len(names) > 3 else ""
    )
    raise ValueError(
        f"`sub_batch_size` ({sub_batch_size}): the model's batch-norm layer(s) {shown} are in "
        "training mode, so each sub-batch would be normalised by its own statistics and the "
        "running statistics updated in both passes: the step would not be the one-pass step. "
        "Freeze them (eval-mode BatchNorm: `model.frozen_bn=true` for resnet50, or "
        "rankwise.models.backbones.freeze_batchnorm), replace them by GroupNorm / LayerNorm, or "
        "set `sub_batch_size` to None."
    )


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and, on CUDA, the device's (what dropout draws from)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _float32(embeddings: torch.Tensor) -> torch.Tensor:
    """Half embeddings as float32 (float32 and float64 ones unchanged)."""
    return embeddings.float() if embeddings.dtype in (torch.float16, torch.bfloat16) else embeddings


class OptimizerStep:
    """One optimizer step of the Trainer: precision, loss scaling and sub-batches.

    Args:
        precision: ``"32"`` (no autocast), ``"bf16"`` (bfloat16 autocast) or ``"16"`` (float16
            autocast and a ``GradScaler``). Autocast covers the model's forward pass only; the
            embeddings are cast to float32 before the gather and the loss, which runs outside
            autocast. ``"16"`` runs on the CPU too (torch's CPU autocast has float16).
        sub_batch_size: embed the batch in chunks of this many rows (``None``: in one pass).
            The two passes see the same inputs and the same random numbers: the CPU (and CUDA)
            generator state is saved before each chunk's first pass and restored for its second,
            so dropout draws the same masks in both (random numbers from generators of your own
            are not replayed). Batch-norm layers in training mode are refused (a ``ValueError``
            naming them and the fix): their per-chunk statistics would change the step. Under
            ``DistributedDataParallel`` every chunk but the last runs in ``no_sync()``, so the
            gradients are all-reduced once, in the last chunk's backward pass.
        device: where the model trains (autocast's device type).
        model: checked now for batch-norm layers that training mode would use, when
            ``sub_batch_size`` is set (and again at every step).

    Attributes:
        overflow_steps: steps skipped because the float16 gradients overflowed (``"16"``).
        scaler: the ``torch.amp.GradScaler`` (enabled for ``"16"`` only).

    Example:
        A step of a linear embedding in four chunks of 2 rows, in bfloat16 autocast:

        >>> from rankwise.losses import build_loss
        >>> _ = torch.manual_seed(0)
        >>> model, loss_fn = nn.Linear(6, 3), build_loss("ap")
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> step = OptimizerStep("bf16", 2, device=torch.device("cpu"))
        >>> x, y = torch.randn(8, 6), torch.arange(4).repeat_interleave(2)
        >>> loss = step.run(x, y, model, loss_fn, optimizer)
        >>> loss.dtype, step.record()
        (torch.float32, {})
    """

    def __init__(
        self,
        precision: Any = "32",
        sub_batch_size: int | None = None,
        *,
        device: torch.device,
        model: nn.Module | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.precision = _check_precision(precision, self.device)
        self.sub_batch_size = (
            None if sub_batch_size is None else positive_int(sub_batch_size, "sub_batch_size")
        )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "16")
        self.overflow_steps = 0
        if model is not None and self.sub_batch_size is not None:
            _refuse_batch_norm(_in_training_mode(model), self.sub_batch_size)

    # -- the forward pass ---------------------------------------------------------------------

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The autocast context of the forward pass (a no-op for ``"32"``)."""
        if self.precision == "32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=_DTYPES[self.precision])

    def embed(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` under the step's autocast, half outputs cast to float32."""
        with self.autocast():
            out = module(x)
        return _float32(out)

    # -- the step -----------------------------------------------------------------------------

    def run(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        module: nn.Module,
        loss_fn: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        gather: Gather | None = None,
        inspect: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
        non_finite: Callable[[torch.Tensor | None], None] | None = None,
    ) -> torch.Tensor:
        """One optimizer step on ``(x, y)``; every check runs before anything is applied.

        Args:
            x: the batch's inputs (moved to :attr:`device`).
            y: its labels (moved too, unless ``loss_fn.takes_host_labels``).
            module: what the forward pass calls (the model, or its DDP wrapper).
            loss_fn: ``loss_fn(embeddings, labels)``.
            optimizer: the optimizer (its gradients are zeroed first).
            gather: ``gather(embeddings, labels)``: the batch the loss sees (the strategy's
                ``gather_batch``; ``None``: this process's batch).
            inspect: called with the embeddings and labels the loss sees, before the loss
                (the Trainer's ``on_train_batch`` callbacks; raising stops the step).
            non_finite: called with ``None`` for non-finite embeddings and with the loss for a
                non-finite loss; it raises (default: a ``FloatingPointError``).

        Returns:
            The loss, detached.
        """
        x = x.to(self.device, non_blocking=True)
        if not getattr(loss_fn, "takes_host_labels", False):
            y = y.to(self.device, non_blocking=True)
        # else the labels stay on the host, where the data loader gives them: the loss takes the
        # batch's label structure there without waiting for the device (docs/losses.md)
        gather = gather if gather is not None else (lambda e, labels: (e, labels))
        if self.sub_batch_size is None or self.sub_batch_size >= x.shape[0]:
            embeddings, labels = gather(self.embed(module, x), y)
            loss = self._loss(loss_fn, embeddings, labels, inspect, non_finite)
            optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
        else:
            loss = self._sub_batches(x, y, module, loss_fn, optimizer, gather, inspect, non_finite)
        self._apply(optimizer)
        return loss.detach()

    def _loss(
        self,
        loss_fn: nn.Module,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        inspect: Callable[[torch.Tensor, torch.Tensor], None] | None,
        non_finite: Callable[[torch.Tensor | None], None] | None,
    ) -> torch.Tensor:
        """The checked loss of the batch (outside autocast: it computes in float32)."""
        raise_non_finite = non_finite if non_finite is not None else _raise_floating_point
        if not bool(torch.isfinite(embeddings).all()):
            # a diverged model: stop like a non-finite loss (the loss would only reject its
            # input), keeping the last good checkpoint
            raise_non_finite(None)
        if inspect is not None:
            inspect(embeddings, labels)
        loss = loss_fn(embeddings, labels)
        if not torch.isfinite(loss):
            raise_non_finite(loss)
        return loss

    def _sub_batches(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        module: nn.Module,
        loss_fn: nn.Module,
        optimizer: torch.optim.Optimizer,
        gather: Gather,
        inspect: Callable[[torch.Tensor, torch.Tensor], None] | None,
        non_finite: Callable[[torch.Tensor | None], None] | None,
    ) -> torch.Tensor:
        """The loss of the batch embedded in chunks, its gradient back-propagated chunk by chunk."""
        assert self.sub_batch_size is not None
        _refuse_batch_norm(_in_training_mode(module, now=True), self.sub_batch_size)
        chunks = x.split(self.sub_batch_size)
        states = []
        with torch.no_grad():
            outputs = []
            for chunk in chunks:
                states.append(_rng_state(self.device))
                outputs.append(self.embed(module, chunk))
        after = _rng_state(self.device)
        local = torch.cat(outputs).requires_grad_(True)
        del outputs
        embeddings, labels = gather(local, y)
        loss = self._loss(loss_fn, embeddings, labels, inspect, non_finite)
        optimizer.zero_grad(set_to_none=True)
        # the gradient of the (scaled) loss w.r.t. this process's embeddings, and the loss's own
        # parameters' gradients; under data parallelism the gather's backward scales it for DDP
        self.scaler.scale(loss).backward()
        grad = local.grad
        assert grad is not None
        start = 0
        for i, (chunk, state) in enumerate(zip(chunks, states, strict=True)):
            _set_rng_state(state, self.device)  # the same dropout masks as the first pass
            with self._no_sync(module, last=i == len(chunks) - 1):
                out = self.embed(module, chunk)
                out.backward(grad[start : start + chunk.shape[0]])
            start += chunk.shape[0]
        _set_rng_state(after, self.device)
        return loss

    @staticmethod
    def _no_sync(module: nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
        """DDP's ``no_sync()`` for every chunk but the last: one all-reduce per step."""
        no_sync = getattr(module, "no_sync", None)
        if last or no_sync is None:
            return contextlib.nullcontext()
        return no_sync()

    def _apply(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``, through the scaler for ``"16"`` (which skips an overflow)."""
        if not self.scaler.is_enabled():
            optimizer.step()
            return
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < scale:  # found inf/NaN: the step was skipped, scale backed off
            self.overflow_steps += 1

    # -- reports and checkpoints --------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """What a training record adds: ``overflow_steps`` and ``loss_scale`` for ``"16"``."""
        if not self.scaler.is_enabled():
            return {}
        return {"overflow_steps": self.overflow_steps, "loss_scale": self.scaler.get_scale()}

    def state_dict(self) -> dict[str, Any]:
        """The precision, the scaler's state and the overflow count (a checkpoint's key)."""
        return {
            "precision": self.precision,
            "scaler": self.scaler.state_dict(),
            "overflow_steps": self.overflow_steps,
        }

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Continue from :meth:`state_dict`'s output (``None``: a checkpoint from before it, in "32").

        Raises:
            ValueError: the checkpoint was trained in another precision.
        """
        state = state if state is not None else {"precision": "32"}
        trained = str(state.get("precision", "32"))
        if trained != self.precision:
            raise ValueError(
                f"`precision`: the checkpoint was trained with precision {trained!r} and this "
                f"trainer uses {self.precision!r}; resume with precision {trained!r} (the loss "
                "scaler's state belongs to it)."
            )
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(dict(state["scaler"]))
        self.overflow_steps = int(state.get("overflow_steps", 0))


def _in_training_mode(module: nn.Module, now: bool = False) -> list[str]:
    """Batch-norm layers in training mode: now, or once ``module.train()`` is called (``fit``)."""
    inner = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
    if now:
        return _batch_norm_in_training(inner)
    modes = {m: m.training for m in inner.modules()}
    try:
        inner.train()  # what fit() does; a frozen layer's train() keeps it in eval mode
        return _batch_norm_in_training(inner)
    finally:
        for m, mode in modes.items():
            m.training = mode


def _raise_floating_point(loss: torch.Tensor | None) -> None:
    what = "the embeddings contain NaN/inf" if loss is None else f"the loss is {float(loss)}"
    raise FloatingPointError(f"{what}; nothing was applied.")
