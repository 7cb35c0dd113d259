"""The callback protocol of the training loop: :class:`Callback`, its step record and a plain function as a callback."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..errors import NonFiniteLossError

if TYPE_CHECKING:
    from ...metrics import PRCurve, RetrievalReport
    from ..state import RunResult
    from ..trainer import Trainer

__all__ = ["Callback", "StepCallback", "StepOutput", "report_summary"]


@dataclass(frozen=True)
class StepOutput:
    """What one optimizer step produced.

    Attributes:
        step: steps completed, this one included (1-based).
        epoch: the sampler epoch the batch came from.
        position: the batch's index within that epoch.
        loss: the loss of the batch (before the step).
        lr: the learning rate the step used (of the first parameter group).
        batch_size: samples in the batch.
    """

    step: int
    epoch: int
    position: int
    loss: float
    lr: float
    batch_size: int


def report_summary(report: RetrievalReport) -> dict[str, Any]:
    """JSON-ready ``report.to_dict()`` without the per-query list (kept only in ``report.json``)."""
    out = report.to_dict()
    out.pop("per_query_ap", None)
    return out


class Callback:
    """Base class of the trainer's callbacks: every hook does nothing (see docs/training.md).

    Attributes:
        state_key: the key of this callback's state in a checkpoint (``None``: no state).
    """

    state_key: str | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step of a ``fit`` call (also after a resume)."""

    def on_train_batch(
        self, trainer: Trainer, embeddings: torch.Tensor, labels: torch.Tensor
    ) -> None:
        """After a training batch's forward pass, before its loss (raising: nothing is applied)."""

    def on_train_step_end(self, trainer: Trainer, output: StepOutput) -> None:
        """After an optimizer step."""

    def on_validation_end(
        self, trainer: Trainer, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """After an evaluation of the validation data (before the checkpoint)."""

    def on_step_end(self, trainer: Trainer) -> None:
        """After a complete step (records, evaluation, checkpoint): the safe point to stop."""

    def on_train_end(self, trainer: Trainer) -> None:
        """When the training loop is left, normally or by an exception."""

    def on_test_end(self, trainer: Trainer, report: RetrievalReport, curve: PRCurve) -> None:
        """After the selected model was evaluated on the test data."""

    def on_fit_end(self, trainer: Trainer, result: RunResult) -> None:
        """When ``fit`` returns its result."""

    def on_failure(self, trainer: Trainer, error: NonFiniteLossError) -> None:
        """When the run stops on a non-finite or collapsed model."""

    def state_dict(self) -> dict[str, Any]:
        """The state to checkpoint: plain values and tensors only (``weights_only`` loads)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""


class StepCallback(Callback):
    """A plain function ``fn(trainer)`` called after every complete step (``on_step_end``).

    Args:
        fn: the function; raising ``KeyboardInterrupt`` from it stops the run like Ctrl-C.
    """

    def __init__(self, fn: Callable[[Trainer], None]) -> None:
        self.fn = fn

    def on_step_end(self, trainer: Trainer) -> None:
        """Call the function."""
        self.fn(trainer)
