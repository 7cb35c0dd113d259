"""The callback protocol of the training loop: :class:`Callback`, its step record and a plain function as a callback.

:class:`TrainerView` is the part of :class:`rankwise.training.Trainer` the built-in callbacks
read (a protocol: the callbacks sit below the trainer and never import it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..errors import NonFiniteLossError

if TYPE_CHECKING:
    from rich.console import Console

    from ...metrics import PRCurve, RetrievalReport
    from ..result import RunResult
    from ..rundir import RunPaths

__all__ = ["Callback", "StepCallback", "StepOutput", "TrainerView", "report_summary"]


class ModelStore(Protocol):
    """What a callback asks of the run's store (:class:`~rankwise.training.store.RunStore`)."""

    @property
    def record(self) -> Mapping[str, Any] | None:
        """The run's config as ``config.yaml`` holds it (``None``: built from objects)."""

    def save_best(
        self,
        step: int,
        val: Mapping[str, Any],
        model_state: Mapping[str, torch.Tensor],
        loss_state: Mapping[str, Any],
    ) -> None:
        """Keep the model selected on validation."""

    def best_weights(self, device: str | torch.device) -> dict[str, torch.Tensor] | None:
        """This process's copy of the selected weights."""

    @property
    def last_step(self) -> int | None:
        """The step of ``checkpoints/last.pt`` (``None``: none written or read yet)."""

    @property
    def last_good_checkpoint(self) -> Path | None:
        """``checkpoints/last.pt`` once written in this run."""

    def kept_message(self) -> str:
        """A clause for error messages naming the checkpoint that is kept."""


class StepRecord(Protocol):
    """What a callback reads of the trainer's optimizer step (:mod:`rankwise.training.step`)."""

    def record(self) -> dict[str, Any]:
        """The fields a training record adds (loss scaling: ``overflow_steps``, ``loss_scale``)."""


class TrainerView(Protocol):
    """What the built-in callbacks read of :class:`rankwise.training.Trainer` (and may call)."""

    @property
    def step(self) -> int:
        """Optimizer steps completed."""

    @property
    def total_steps(self) -> int:
        """The budget."""

    @property
    def next_epoch(self) -> int:
        """The sampler epoch of the next batch."""

    @property
    def name(self) -> str:
        """The run's name."""

    @property
    def loss_name(self) -> str:
        """The loss's name in messages."""

    @property
    def console(self) -> Console:
        """The run's console."""

    @property
    def run_dir(self) -> Path | None:
        """The run folder (``None``: no file)."""

    @property
    def paths(self) -> RunPaths:
        """Its file names."""

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes and prints."""

    @property
    def model(self) -> nn.Module:
        """The model."""

    @property
    def loss_fn(self) -> nn.Module:
        """The loss."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer."""

    @property
    def device(self) -> torch.device:
        """Where the model is."""

    @property
    def optimizer_step(self) -> StepRecord:
        """The optimizer step: precision, loss scaling, sub-batches."""

    @property
    def store(self) -> ModelStore:
        """The run's store (its checkpoints: ``last_step``, ``last_good_checkpoint``, ...)."""

    @property
    def strategy(self) -> Any:
        """The processes of the run."""

    @property
    def history(self) -> list[dict[str, Any]]:
        """The records of the run so far."""

    @property
    def monitor(self) -> str:
        """The validation scalar that selects the model (e.g. ``"map"``, ``"recall@1"``)."""

    @property
    def best_step(self) -> int | None:
        """Step of the best validation score so far."""

    @property
    def best_val(self) -> dict[str, Any] | None:
        """Validation report summary of the best step so far."""

    def request_stop(self, reason: str | None = None) -> None:
        """Stop after the current step (with a ``reason``: a normal end, ``"stopped_early"``)."""

    def check_replicas(self) -> None:
        """Raise unless every process holds the same state."""


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

    def on_fit_start(self, trainer: TrainerView) -> None:
        """Before the first step of a ``fit`` call (also after a resume)."""

    def on_train_batch(
        self, trainer: TrainerView, embeddings: torch.Tensor, labels: torch.Tensor
    ) -> None:
        """After a training batch's forward pass, before its loss (raising: nothing is applied)."""

    def on_train_step_end(self, trainer: TrainerView, output: StepOutput) -> None:
        """After an optimizer step."""

    def on_validation_end(
        self, trainer: TrainerView, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """After an evaluation of the validation data (before the checkpoint)."""

    def on_step_end(self, trainer: TrainerView) -> None:
        """After a complete step (records, evaluation, checkpoint): the safe point to stop."""

    def on_train_end(self, trainer: TrainerView) -> None:
        """When the training loop is left, normally or by an exception."""

    def on_test_end(self, trainer: TrainerView, report: RetrievalReport, curve: PRCurve) -> None:
        """After the selected model was evaluated on the test data."""

    def on_fit_end(self, trainer: TrainerView, result: RunResult) -> None:
        """When ``fit`` returns its result."""

    def on_failure(self, trainer: TrainerView, error: NonFiniteLossError) -> None:
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

    def __init__(self, fn: Callable[[TrainerView], None]) -> None:
        self.fn = fn

    def on_step_end(self, trainer: TrainerView) -> None:
        """Call the function."""
        self.fn(trainer)
