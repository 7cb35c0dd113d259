"""Model selection on a validation scalar (default the tie-aware mAP = mAUPRC of Wen et al., NeurIPS 2022, Sec. 5.1): :class:`BestCheckpoint`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..monitor import DEFAULT_MONITOR, check_monitor, monitor_value
from .base import Callback, TrainerView, report_summary

if TYPE_CHECKING:
    from ...metrics import RetrievalReport

__all__ = ["BestCheckpoint"]


class BestCheckpoint(Callback):
    """Keep the model with the best validation score; the final test evaluates it.

    The run's store keeps it (:meth:`~rankwise.training.store.RunStore.save_best`): written
    atomically to ``checkpoints/best.pt`` (``{"format", "step", "val", "config", "model",
    "loss"}``), or kept in memory without a run directory; without validation data, none.

    Args:
        monitor: the validation scalar to maximize (:mod:`rankwise.training.monitor`):
            ``"map"`` (tie-aware mAP = mAUPRC, the paper's selection), ``"map_at_r"``,
            ``"r_precision"``, ``"recall@1"``, ... (the config key ``selection.monitor``).

    Attributes:
        best_value: the best score so far (``None`` before the first evaluation).
        best_step: its step.
        best_val: its validation report (``report_summary``).
    """

    state_key = "best_checkpoint"

    def __init__(self, monitor: str = DEFAULT_MONITOR) -> None:
        self.monitor = check_monitor(monitor, argument="monitor")
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.best_val: dict[str, Any] | None = None

    def on_validation_end(
        self, trainer: TrainerView, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Save the model when its score beats the best so far."""
        value = monitor_value(report, self.monitor)
        if self.best_value is not None and not value > self.best_value:
            return
        metrics = report_summary(report)
        self.best_value, self.best_step, self.best_val = value, trainer.step, metrics
        trainer.store.save_best(
            trainer.step, metrics, trainer.model.state_dict(), trainer.loss_fn.state_dict()
        )

    def state_dict(self) -> dict[str, Any]:
        """The best score, its step and its validation report."""
        return {
            "best_value": self.best_value,
            "best_step": self.best_step,
            "best_val": self.best_val,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the best-so-far."""
        self.best_value = state.get("best_value")
        self.best_step = state.get("best_step")
        self.best_val = state.get("best_val")
