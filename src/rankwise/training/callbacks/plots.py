"""The convergence and test PR-curve plots of a completed run (Fig. 2 style): :class:`PlotCurves`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Callback, TrainerView

if TYPE_CHECKING:
    from ..result import RunResult

__all__ = ["PlotCurves"]


class PlotCurves(Callback):
    """Draw ``training_curves.png`` and ``pr_curve.png`` (test PR) in a completed run's directory.

    Args:
        title: title of the training-curves figure (default: the trainer's name).
        pr_title: title of the PR figure (default ``"test mean PR curve"``).
        label: the curve's legend label (default: the trainer's name).
    """

    def __init__(
        self, title: str | None = None, pr_title: str | None = None, label: str | None = None
    ) -> None:
        self.title = title
        self.pr_title = pr_title
        self.label = label

    def on_fit_end(self, trainer: TrainerView, result: RunResult) -> None:
        """Draw both figures."""
        if (
            trainer.run_dir is None
            or not trainer.is_main_process
            or result.status not in ("completed", "stopped_early")
        ):
            return
        from ...plots import plot_pr_curves  # noqa: PLC0415 - matplotlib: only when drawing
        from ..curves import plot_training_curves  # noqa: PLC0415 - idem

        plot_training_curves(
            trainer.history,
            trainer.paths.training_curves_plot,
            title=self.title or trainer.name,
            selected_step=result.best_step,
            monitor=trainer.monitor,
        )
        if result.pr_curve is None or result.test is None:
            return
        label = self.label or trainer.name
        plot_pr_curves(
            {label: result.pr_curve},
            trainer.paths.pr_curve_plot,
            title=self.pr_title or "test mean PR curve",
            labels={label: float(result.test.map)},
        )
