"""Early stopping on a validation scalar: :class:`EarlyStopping`.

Patience-based stopping as in Prechelt, "Early Stopping - But When?" (Neural Networks: Tricks of
the Trade, 1998): the run ends once the monitored validation value has not improved by more than
``min_delta`` for ``patience`` evaluations in a row. The end is a normal one
(``RunResult.status == "stopped_early"``): the model selected on validation is tested and the
report written, and ``--resume`` says the run is finished.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..._validation import check_choice
from ..monitor import DEFAULT_MONITOR, check_monitor, monitor_label, monitor_value
from .base import Callback, TrainerView

if TYPE_CHECKING:
    from ...metrics import RetrievalReport

__all__ = ["EarlyStopping"]


class EarlyStopping(Callback):
    """Stop the run when the monitored validation value stops improving.

    Called after every validation; its state (best value, evaluations without improvement) is
    checkpointed, so a resumed run stops where an uninterrupted one would. Every process sees the
    same validation report, so every process asks for the same stop.

    Args:
        monitor: the validation scalar (:mod:`rankwise.training.monitor`: ``"map"``,
            ``"recall@1"``, ``"map_at_r"``, ...).
        patience: evaluations without improvement before the run stops (>= 1).
        min_delta: the smallest change that counts as an improvement (>= 0).
        mode: ``"max"`` (higher is better, every retrieval metric) or ``"min"``.

    Attributes:
        best_value: the best monitored value so far (``None`` before the first evaluation).
        best_step: its step.
        bad_evaluations: evaluations since the last improvement.
        stopped_step: the step the run stopped at (``None``: not stopped).

    Example:
        >>> stopper = EarlyStopping("recall@1", patience=2)
        >>> stopper.monitor, stopper.patience, stopper.mode
        ('recall@1', 2, 'max')
    """

    state_key = "early_stopping"

    def __init__(
        self,
        monitor: str = DEFAULT_MONITOR,
        patience: int = 5,
        min_delta: float = 0.0,
        mode: str = "max",
    ) -> None:
        self.monitor = check_monitor(monitor, argument="monitor")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"`patience` must be an integer >= 1, got {patience!r}.")
        if (
            isinstance(min_delta, bool)
            or not isinstance(min_delta, (int, float))
            or not math.isfinite(min_delta)
            or min_delta < 0
        ):
            raise ValueError(f"`min_delta` must be a finite number >= 0, got {min_delta!r}.")
        self.patience = patience
        self.min_delta = float(min_delta)
        self.mode = check_choice(mode, "mode", ("max", "min"))
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.bad_evaluations = 0
        self.stopped_step: int | None = None

    def _improved(self, value: float) -> bool:
        if self.best_value is None:
            return not math.isnan(value)
        if self.mode == "max":
            return value > self.best_value + self.min_delta
        return value < self.best_value - self.min_delta

    def on_validation_end(
        self, trainer: TrainerView, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Count the evaluation; after ``patience`` without improvement, ask the run to stop."""
        value = monitor_value(report, self.monitor)
        if self._improved(value):
            self.best_value, self.best_step, self.bad_evaluations = value, trainer.step, 0
            return
        self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience and self.stopped_step is None:
            self.stopped_step = trainer.step
            best = "none" if self.best_value is None else f"{self.best_value:.4f}"
            trainer.request_stop(
                reason=(
                    f"early stopping: validation {monitor_label(self.monitor)} did not improve "
                    f"by more than {self.min_delta:g} in {self.patience} evaluation(s) "
                    f"(best {best} at step {self.best_step})"
                )
            )

    def state_dict(self) -> dict[str, Any]:
        """The best value, its step, the evaluations since and the stop step."""
        return {
            "best_value": self.best_value,
            "best_step": self.best_step,
            "bad_evaluations": self.bad_evaluations,
            "stopped_step": self.stopped_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.best_value = state.get("best_value")
        self.best_step = state.get("best_step")
        self.bad_evaluations = int(state.get("bad_evaluations", 0))
        self.stopped_step = state.get("stopped_step")
