"""The progress of the training steps: a rich bar in a terminal, plain lines otherwise (:class:`ProgressBar`)."""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..monitor import DEFAULT_MONITOR, monitor_label, monitor_value
from .base import Callback, StepOutput, TrainerView

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from ...metrics import RetrievalReport

__all__ = ["ProgressBar"]


class ProgressBar(Callback):
    """Progress of the training steps: a bar in a terminal, plain log lines otherwise.

    The bar shows steps, times, the mean loss and samples / s of the last ``log_every`` steps
    and the last validation mAP; a plain line comes at every evaluation and at least every
    ``line_every`` seconds, e.g. ``soprc on digits: step 50/150 (33%)  loss 0.2143
    val mAP 0.9012 (best 0.9012 at 50)  12.3 s elapsed, ~24.6 s left``.

    Args:
        enabled: ``None``: the bar in a terminal, lines otherwise; ``True``: always the bar;
            ``False``: nothing.
        log_every: steps between updates of the loss and rate fields.
        line_every: the longest silence, in seconds, between two plain lines.
    """

    def __init__(
        self, enabled: bool | None = None, log_every: int = 10, line_every: float = 10.0
    ) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.line_every = float(line_every)
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._lines = False
        self._monitor = DEFAULT_MONITOR
        self._losses: list[float] = []
        self._steps = 0
        self._start = time.perf_counter()
        self._fit_start = self._start
        self._first_step = 0
        self._last_line = self._start
        self._loss = math.nan
        self._val: float | None = None
        self._evaluated_step: int | None = None

    def _mode(self, trainer: TrainerView) -> str:
        if self.enabled is not None:
            return "bar" if self.enabled else "off"
        if bool(trainer.console.is_terminal) and sys.stdout.isatty():
            return "bar"
        return "lines"

    def on_fit_start(self, trainer: TrainerView) -> None:
        """Start the bar (or the plain lines) at the trainer's current step."""
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        mode = self._mode(trainer)
        self._lines = mode == "lines"
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn(
                "loss {task.fields[loss]:.4f}  {task.fields[rate]:.0f} samples/s  "
                "val {task.fields[monitor]} {task.fields[val]}"
            ),
            console=trainer.console,
            disable=mode != "bar",
            transient=False,
        )
        self._progress.start()
        self._monitor = trainer.monitor
        self._val = monitor_value(trainer.best_val, self._monitor) if trainer.best_val else None
        self._task = self._progress.add_task(
            trainer.name,
            total=trainer.total_steps,
            completed=trainer.step,
            loss=math.nan,
            rate=0.0,
            val=self._val_text(),
            monitor=monitor_label(self._monitor),
        )
        now = time.perf_counter()
        self._losses, self._steps, self._start = [], 0, now
        self._fit_start, self._last_line, self._first_step = now, now, trainer.step
        self._loss = math.nan

    def _val_text(self) -> str:
        return "—" if self._val is None else f"{self._val:.4f}"

    def line(self, trainer: TrainerView, step: int) -> str:
        """The plain progress line (no newline) of ``trainer`` after ``step`` steps."""
        total = trainer.total_steps
        elapsed = time.perf_counter() - self._fit_start
        done = step - self._first_step
        text = f"{trainer.name}: step {step}/{total} ({100 * step / max(total, 1):.0f}%)"
        if not math.isnan(self._loss):
            text += f"  loss {self._loss:.4f}"
        if self._val is not None:
            text += f"  val {monitor_label(self._monitor)} {self._val:.4f}"
            if trainer.best_val is not None:
                best = monitor_value(trainer.best_val, self._monitor)
                text += f" (best {best:.4f} at {trainer.best_step})"
        text += f"  {elapsed:.1f} s elapsed"
        if 0 < done and step < total:
            text += f", ~{elapsed / done * (total - step):.1f} s left"
        return text

    def _print_line(self, trainer: TrainerView, step: int) -> None:
        # one log line per print, never wrapped at the console width (logs are grepped)
        trainer.console.print(
            self.line(trainer, step), markup=False, highlight=False, soft_wrap=True
        )
        self._last_line = time.perf_counter()

    def on_train_step_end(self, trainer: TrainerView, output: StepOutput) -> None:
        """Advance the bar; refresh loss and rate every ``log_every`` steps."""
        if self._progress is None or self._task is None:
            return
        self._losses.append(output.loss)
        self._steps += 1
        if output.step % self.log_every == 0 or output.step == trainer.total_steps:
            now = time.perf_counter()
            rate = self._steps * output.batch_size / max(now - self._start, 1e-9)
            self._loss = float(np.mean(self._losses))
            self._progress.update(self._task, loss=self._loss, rate=rate)
            self._losses, self._steps, self._start = [], 0, now
        self._progress.update(self._task, completed=output.step)
        if self._lines and time.perf_counter() - self._last_line >= self.line_every:
            self._print_line(trainer, output.step)

    def on_validation_end(
        self, trainer: TrainerView, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Show the new monitored validation value (a plain line without a terminal)."""
        self._val = monitor_value(report, self._monitor)
        self._evaluated_step = trainer.step
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, val=self._val_text())

    def on_step_end(self, trainer: TrainerView) -> None:
        """A plain line after each evaluation (the best-so-far is then up to date)."""
        if self._lines and self._evaluated_step == trainer.step:
            self._print_line(trainer, trainer.step)

    def on_train_end(self, trainer: TrainerView) -> None:
        """Stop the bar."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
