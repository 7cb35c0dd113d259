"""Callbacks of the training loop: progress, metrics log, model selection, plots, collapse.

Everything around the training loop that is not the loop: the progress bar, the
``metrics.jsonl`` log, the selection of the best checkpoint by validation mAP (tie-aware mAUPRC,
the model selection of Wen et al., NeurIPS 2022, Sec. 5.1), the convergence and PR-curve plots
(Fig. 2 style), and the collapse detector. Each is a :class:`Callback` that
:class:`~rankwise.training.trainer.Trainer` calls at fixed points of :meth:`Trainer.fit`.

The points, in the order they happen:

* ``on_fit_start(trainer)``: before the first step of a ``fit`` call (also after a resume);
* ``on_train_batch(trainer, embeddings, labels)``: in :meth:`Trainer.train_step`, after the
  forward pass and before the loss; raising here stops the step before anything is applied;
* ``on_train_step_end(trainer, output)``: the optimizer step is applied (:class:`StepOutput`);
* ``on_validation_end(trainer, report, embeddings)``: at every evaluation, before the checkpoint;
* ``on_step_end(trainer)``: the step, its records, its evaluation and its checkpoint are complete —
  the safe point to stop (raising ``KeyboardInterrupt`` here behaves like Ctrl-C);
* ``on_train_end(trainer)``: the loop is left, normally or by an exception;
* ``on_test_end(trainer, report, curve)``: the selected model was tested;
* ``on_fit_end(trainer, result)``: the run's :class:`RunResult` is ready;
* ``on_failure(trainer, error)``: the run stopped on a non-finite or collapsed model.

A callback with state to resume (the logged loss window, the best-so-far) sets ``state_key`` and
implements ``state_dict`` / ``load_state_dict`` with plain values: the trainer stores it in every
checkpoint, so a resumed run continues exactly.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .checkpoint import atomic_save, atomic_write_text, load_checkpoint
from .errors import CollapsedEmbeddingsError, ConfigError, NonFiniteLossError

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from ..metrics import PRCurve, RetrievalReport
    from .config import Config
    from .trainer import RunResult, Trainer

__all__ = [
    "COLLAPSE_SPREAD",
    "BestCheckpoint",
    "Callback",
    "CollapseDetector",
    "MetricsLogger",
    "PlotCurves",
    "ProgressBar",
    "StepCallback",
    "StepOutput",
    "config_collapse_advice",
    "embedding_spread",
    "optimizer_collapse_advice",
    "report_summary",
]

# embedding_spread below which a run counts as collapsed: every cosine score then lies within
# 2 * spread**2 = 2e-6 of every other (a few float32 ulps near 1), i.e. every score ties
COLLAPSE_SPREAD = 1e-3


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
    """``report.to_dict()`` without the per-query list (kept only in ``report.json``).

    Args:
        report: a retrieval report.

    Returns:
        A JSON-ready dict.
    """
    out = report.to_dict()
    out.pop("per_query_ap", None)
    return out


class Callback:
    """Base class of the trainer's callbacks: every hook does nothing (see the module docstring).

    Attributes:
        state_key: the key of this callback's state in a checkpoint (``None``: no state).
    """

    state_key: str | None = None

    def on_fit_start(self, trainer: Trainer) -> None:
        """Before the first step of a ``fit`` call."""

    def on_train_batch(
        self, trainer: Trainer, embeddings: torch.Tensor, labels: torch.Tensor
    ) -> None:
        """After the forward pass of a training batch, before its loss."""

    def on_train_step_end(self, trainer: Trainer, output: StepOutput) -> None:
        """After an optimizer step."""

    def on_validation_end(
        self, trainer: Trainer, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """After an evaluation of the validation data (before the checkpoint)."""

    def on_step_end(self, trainer: Trainer) -> None:
        """After a complete step (records, evaluation and checkpoint written)."""

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


# -- metrics.jsonl ---------------------------------------------------------------------------------


class MetricsLogger(Callback):
    """The run's records: ``trainer.history`` and, with a run directory, ``metrics.jsonl``.

    One JSON record per line: ``{"kind": "train", "step", "epoch", "loss", "lr",
    "samples_per_s", "loss_stats"}`` every ``log_every`` steps and at the last step (``loss`` is
    the mean over the steps since the previous record, ``loss_stats`` the numeric
    ``loss_fn.last_stats``), ``{"kind": "val", "step", ...report}`` at every evaluation, the final
    ``{"kind": "test", ...}`` and ``{"kind": "error", ...}`` when the run fails.

    The losses of the steps since the last record are checkpointed, so a run resumed between two
    records logs the same mean as an uninterrupted run. On resume the file is cut back to the
    records of the checkpoint's step (a crash between checkpoints leaves later ones; they are
    replayed) and the test record is dropped (the final test runs again). A last line cut short
    (the run was killed while appending it; its step came after the checkpoint) is dropped with
    a note; any other line that is not a JSON record is corruption (a ``ConfigError``).

    Args:
        log_every: steps between training records.
    """

    state_key = "metrics_logger"

    def __init__(self, log_every: int = 10) -> None:
        from .._validation import Interval, check_scalar

        self.log_every = check_scalar(log_every, "log_every", Interval("integer", 1, None))
        self.records: list[dict[str, Any]] = []
        self._window_losses: list[float] = []
        self._window_steps = 0
        self._window_start = time.perf_counter()
        self._path: Path | None = None

    def _read(self) -> tuple[list[dict[str, Any]], bool]:
        """The records of the file, and whether a torn last line was dropped."""
        if self._path is None or not self._path.is_file():
            return [], False
        lines = self._path.read_text(encoding="utf-8", errors="replace").splitlines()
        numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
        records: list[dict[str, Any]] = []
        for n, line in numbered:
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if isinstance(record, dict):
                records.append(record)
            elif record is None and n == numbered[-1][0]:
                return records, True  # cut short by a kill while it was appended
            else:
                raise ConfigError(
                    f"run_dir: {self._path} line {n} is not a JSON record, so the file is "
                    "corrupt (a killed run cuts short its last line only); repair or delete "
                    "that line, then resume."
                )
        return records, False

    def _rewrite(self) -> None:
        if self._path is not None:
            atomic_write_text("".join(json.dumps(r) + "\n" for r in self.records), self._path)

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the history (and to ``metrics.jsonl``).

        Args:
            record: a JSON-ready dict with at least ``kind`` and ``step``.
        """
        self.records.append(record)
        if self._path is not None:
            with open(self._path, "a") as handle:
                handle.write(json.dumps(record) + "\n")

    def on_fit_start(self, trainer: Trainer) -> None:
        """Start (or, after a resume, cut back) the history."""
        writes = trainer.run_dir is not None and trainer.is_main_process
        self._path = trainer.run_dir / "metrics.jsonl" if writes else None
        if trainer.step == 0:
            self.records = []
        elif self._path is not None:
            saved, torn = self._read()
            if torn:
                trainer.console.print(
                    f"note: dropped a torn last record in {self._path} (written when the run "
                    "was killed; its step is after the checkpoint and runs again).",
                    soft_wrap=True,
                    markup=False,
                    highlight=False,
                )
            self.records = [
                r
                for r in saved
                if int(r.get("step", 0)) <= trainer.step and r.get("kind") != "test"
            ]
        else:
            self.records = [r for r in self.records if r.get("kind") != "test"]
        self._rewrite()
        self._window_steps = len(self._window_losses)
        self._window_start = time.perf_counter()

    def on_train_step_end(self, trainer: Trainer, output: StepOutput) -> None:
        """Add the step's loss to the window; write a training record every ``log_every``."""
        self._window_steps += 1
        self._window_losses.append(output.loss)
        if output.step % self.log_every and output.step != trainer.total_steps:
            return
        now = time.perf_counter()
        rate = self._window_steps * output.batch_size / max(now - self._window_start, 1e-9)
        stats = {
            k: v
            for k, v in getattr(trainer.loss_fn, "last_stats", {}).items()
            if isinstance(v, (int, float))
        }
        self.log(
            {
                "kind": "train",
                "step": output.step,
                "epoch": output.epoch,
                "loss": float(np.mean(self._window_losses)),
                "lr": output.lr,
                "samples_per_s": rate,
                "loss_stats": stats,
            }
        )
        self._window_start, self._window_steps, self._window_losses = now, 0, []

    def on_validation_end(
        self, trainer: Trainer, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Write the validation record."""
        self.log({"kind": "val", "step": trainer.step, **report_summary(report)})

    def on_test_end(self, trainer: Trainer, report: RetrievalReport, curve: PRCurve) -> None:
        """Write the test record."""
        self.log({"kind": "test", "step": trainer.step, **report_summary(report)})

    def on_failure(self, trainer: Trainer, error: NonFiniteLossError) -> None:
        """Write the error record of a failed run."""
        self.log(dict(error.record))

    def state_dict(self) -> dict[str, Any]:
        """The losses of the steps since the last training record."""
        return {"window_losses": list(self._window_losses)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the loss window."""
        self._window_losses = [float(v) for v in state.get("window_losses", [])]


# -- model selection -------------------------------------------------------------------------------


class BestCheckpoint(Callback):
    """Keep the model with the best validation score; the final test evaluates it.

    With a run directory the best model is written (atomically) to ``checkpoints/best.pt``
    (``{"format", "step", "val", "config", "model", "loss"}``); without one its weights are kept
    in memory. Without validation data nothing is selected and the final model is tested.

    Args:
        monitor: the :class:`~rankwise.metrics.RetrievalReport` attribute to maximize:
            ``"map"`` (tie-aware mAP = mAUPRC, the paper's selection), ``"map_at_r"`` or
            ``"r_precision"``.

    Attributes:
        best_value: the best score so far (``None`` before the first evaluation).
        best_step: its step.
        best_val: its validation report (``report_summary``).
    """

    state_key = "best_checkpoint"

    def __init__(self, monitor: str = "map") -> None:
        from .._validation import check_choice

        self.monitor = check_choice(monitor, "monitor", ("map", "map_at_r", "r_precision"))
        self.best_value: float | None = None
        self.best_step: int | None = None
        self.best_val: dict[str, Any] | None = None
        self._in_memory: dict[str, torch.Tensor] | None = None

    def on_validation_end(
        self, trainer: Trainer, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Save the model when its score beats the best so far."""
        value = float(getattr(report, self.monitor))
        if self.best_value is not None and not value > self.best_value:
            return
        metrics = report_summary(report)
        self.best_value, self.best_step, self.best_val = value, trainer.step, metrics
        if trainer.run_dir is None:
            self._in_memory = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            return
        if not trainer.is_main_process:  # rank 0 writes best.pt (and hands it over for the test)
            return
        atomic_save(
            {
                "format": trainer.CHECKPOINT_FORMAT,
                "step": trainer.step,
                "val": metrics,
                "config": None if trainer.config is None else trainer.config.to_dict(),
                "model": trainer.model.state_dict(),
                "loss": trainer.loss_fn.state_dict(),
            },
            trainer.checkpoint_dir / "best.pt",
        )

    def best_model_state(self, trainer: Trainer) -> dict[str, torch.Tensor] | None:
        """The selected model's ``state_dict`` (``None``: nothing was selected).

        Args:
            trainer: the trainer (its run directory and device).

        Returns:
            The weights, mapped to the trainer's device.
        """
        if trainer.run_dir is not None:
            path = trainer.checkpoint_dir / "best.pt"
            if path.is_file():
                return load_checkpoint(path, trainer.device)["model"]
            return None
        return self._in_memory

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


# -- progress bar ----------------------------------------------------------------------------------


class ProgressBar(Callback):
    """Progress of the training steps: a bar in a terminal, plain log lines otherwise.

    In a terminal: a rich bar with steps, elapsed and remaining time, the mean loss and
    samples / s of the last ``log_every`` steps, and the last validation mAP. Without one (a
    log file, a pipe, a batch job): one plain line at every evaluation and at least every
    ``line_every`` seconds in between, e.g. ``soprc on digits: step 50/150 (33%)  loss 0.2143
    val mAP 0.9012 (best 0.9012 at 50)  12.3 s elapsed, ~24.6 s left``.

    Args:
        enabled: ``None``: the bar in a terminal, lines otherwise; ``True``: always the bar;
            ``False``: nothing.
        log_every: steps between updates of the loss and rate fields.
        line_every: the longest silence, in seconds, between two plain lines.
    """

    def __init__(
        self, enabled: bool | None = None, log_every: int = 10, line_every: float = 30.0
    ) -> None:
        self.enabled = enabled
        self.log_every = log_every
        self.line_every = float(line_every)
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._lines = False
        self._losses: list[float] = []
        self._steps = 0
        self._start = time.perf_counter()
        self._fit_start = self._start
        self._first_step = 0
        self._last_line = self._start
        self._loss = math.nan
        self._val: float | None = None
        self._evaluated_step: int | None = None

    def _mode(self, trainer: Trainer) -> str:
        if self.enabled is not None:
            return "bar" if self.enabled else "off"
        if bool(trainer.console.is_terminal) and sys.stdout.isatty():
            return "bar"
        return "lines"

    def on_fit_start(self, trainer: Trainer) -> None:
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
                "val mAP {task.fields[val]}"
            ),
            console=trainer.console,
            disable=mode != "bar",
            transient=False,
        )
        self._progress.start()
        self._val = trainer.best_val["map"] if trainer.best_val else None
        self._task = self._progress.add_task(
            trainer.name,
            total=trainer.total_steps,
            completed=trainer.step,
            loss=math.nan,
            rate=0.0,
            val=self._val_text(),
        )
        now = time.perf_counter()
        self._losses, self._steps, self._start = [], 0, now
        self._fit_start, self._last_line, self._first_step = now, now, trainer.step
        self._loss = math.nan

    def _val_text(self) -> str:
        return "—" if self._val is None else f"{self._val:.4f}"

    def line(self, trainer: Trainer, step: int) -> str:
        """The plain progress line at ``step``.

        Args:
            trainer: the trainer.
            step: steps completed.

        Returns:
            The line (no trailing newline).
        """
        total = trainer.total_steps
        elapsed = time.perf_counter() - self._fit_start
        done = step - self._first_step
        text = f"{trainer.name}: step {step}/{total} ({100 * step / max(total, 1):.0f}%)"
        if not math.isnan(self._loss):
            text += f"  loss {self._loss:.4f}"
        if self._val is not None:
            text += f"  val mAP {self._val:.4f}"
            if trainer.best_val is not None:
                text += f" (best {trainer.best_val['map']:.4f} at {trainer.best_step})"
        text += f"  {elapsed:.1f} s elapsed"
        if 0 < done and step < total:
            text += f", ~{elapsed / done * (total - step):.1f} s left"
        return text

    def _print_line(self, trainer: Trainer, step: int) -> None:
        # one log line per print, never wrapped at the console width (logs are grepped)
        trainer.console.print(
            self.line(trainer, step), markup=False, highlight=False, soft_wrap=True
        )
        self._last_line = time.perf_counter()

    def on_train_step_end(self, trainer: Trainer, output: StepOutput) -> None:
        """Advance the bar; refresh loss and rate every ``log_every`` steps."""
        if self._progress is None:
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
        self, trainer: Trainer, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Show the new validation mAP (a plain line without a terminal)."""
        self._val = float(report.map)
        self._evaluated_step = trainer.step
        if self._progress is not None:
            self._progress.update(self._task, val=self._val_text())

    def on_step_end(self, trainer: Trainer) -> None:
        """A plain line after each evaluation (the best-so-far is then up to date)."""
        if self._lines and self._evaluated_step == trainer.step:
            self._print_line(trainer, trainer.step)

    def on_train_end(self, trainer: Trainer) -> None:
        """Stop the bar."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


# -- plots -----------------------------------------------------------------------------------------


class PlotCurves(Callback):
    """Draw the figures of a completed run with a run directory.

    ``training_curves.png`` (training loss and validation mAP against the step) and
    ``pr_curve.png`` (the test mean PR curve).

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

    def on_fit_end(self, trainer: Trainer, result: RunResult) -> None:
        """Draw both figures."""
        if trainer.run_dir is None or not trainer.is_main_process or result.status != "completed":
            return
        from ..plots import plot_pr_curves
        from .curves import plot_training_curves

        plot_training_curves(
            trainer.history,
            trainer.run_dir / "training_curves.png",
            title=self.title or trainer.name,
            selected_step=result.best_step,
        )
        if result.pr_curve is None or result.test is None:
            return
        label = self.label or trainer.name
        plot_pr_curves(
            {label: result.pr_curve},
            trainer.run_dir / "pr_curve.png",
            title=self.pr_title or "test mean PR curve",
            labels={label: float(result.test.map)},
        )


# -- collapse --------------------------------------------------------------------------------------


def embedding_spread(embeddings: torch.Tensor) -> float:
    """Largest distance of an L2-normalized row of ``embeddings`` (N, d) from the first one.

    Cosine scores are ranked by direction only, and for unit vectors 1 - u_i.u_j = |u_i - u_j|^2 / 2,
    so a spread ``r`` puts every pairwise score within 2 r^2 of every other. 0 means every row has
    the same direction (or every row is zero); ``inf`` for fewer than 2 rows (nothing to compare).
    O(N d), no score matrix.

    Args:
        embeddings: (N, d) tensor.

    Returns:
        The spread, a Python float.
    """
    if embeddings.shape[0] < 2:
        return math.inf
    unit = torch.nn.functional.normalize(embeddings.detach().float(), dim=1)
    return float((unit - unit[:1]).norm(dim=1).max())


def config_collapse_advice(config: Config) -> str:
    """Likely causes of a collapse under ``config`` and the settings that fix them.

    Args:
        config: the run configuration.

    Returns:
        ``"Likely cause: ... Fix: ..."``, in config keys.
    """
    oc = config.optimizer
    causes, fixes = [], []
    if oc.weight_decay > 0 and oc.name != "adamw":
        how = (
            "Adam divides the decay term by the gradient's scale, so it moves every weight by a "
            "full lr-sized step towards 0"
            if oc.name == "adam"
            else "it shrinks the weights towards 0"
        )
        causes.append(
            f"weight decay coupled to the gradient (optimizer.name={oc.name}, weight_decay="
            f"{oc.weight_decay:g}) outweighing a tiny loss gradient: {how}"
        )
        fixes.append("optimizer.name=adamw (decoupled weight decay) or optimizer.weight_decay=0")
    causes.append(f"a learning rate too high for this loss (optimizer.lr={oc.lr:g})")
    fixes.append("a lower optimizer.lr")
    params = config.loss.params
    if config.loss.name == "soprc" and "prior_scale" in params and params["prior_scale"] is None:
        causes.append(
            "SOPRC's gradient shrinks with the class prior, and the raw priors of a many-class "
            "dataset (prior_scale=null, ~1e-4) leave almost none"
        )
        fixes.append("the default loss.params.prior_scale=0.1 (see docs/losses.md, SOPRC)")
    return f"Likely cause: {'; or '.join(causes)}. Fix: {'; '.join(fixes)}."


def optimizer_collapse_advice(optimizer: torch.optim.Optimizer) -> str:
    """Likely causes of a collapse for a trainer built from objects, in terms of its optimizer.

    Args:
        optimizer: the trainer's optimizer.

    Returns:
        ``"Likely cause: ... Fix: ..."``.
    """
    name = type(optimizer).__name__
    decay = max(float(g.get("weight_decay", 0.0) or 0.0) for g in optimizer.param_groups)
    lr = float(optimizer.param_groups[0].get("lr", math.nan))
    causes, fixes = [], []
    if decay > 0 and not isinstance(optimizer, torch.optim.AdamW):
        causes.append(
            f"weight decay coupled to the gradient ({name} with weight_decay={decay:g}) "
            "outweighing a tiny loss gradient"
        )
        fixes.append("torch.optim.AdamW (decoupled weight decay) or weight_decay=0")
    causes.append(f"a learning rate too high for this loss (lr={lr:g})")
    fixes.append("a lower learning rate")
    return f"Likely cause: {'; or '.join(causes)}. Fix: {'; '.join(fixes)}."


class CollapseDetector(Callback):
    """Stop a run whose scores all tie.

    That is when the embeddings of a training batch (checked every step, before the loss) or of
    the validation split (at every evaluation) all point in one direction.

    Raises :class:`~rankwise.training.errors.CollapsedEmbeddingsError` (a
    :class:`~rankwise.training.errors.NonFiniteLossError`) with the likely cause and fix; the
    step is not applied (training batch) or not checkpointed (validation), so the last good
    checkpoint is kept.

    Args:
        threshold: the :func:`embedding_spread` at or below which the run counts as collapsed.
        advice: the cause-and-fix sentence for the trainer (default: from ``trainer.config``, or
            from the optimizer of a trainer built from objects).
    """

    def __init__(
        self,
        threshold: float = COLLAPSE_SPREAD,
        advice: Callable[[Trainer], str] | None = None,
    ) -> None:
        from .._validation import Interval, check_scalar

        self.threshold = check_scalar(threshold, "threshold", Interval("real", 0, None))
        self.advice = advice

    def _advice(self, trainer: Trainer) -> str:
        if self.advice is not None:
            return self.advice(trainer)
        if trainer.config is not None:
            return config_collapse_advice(trainer.config)
        return optimizer_collapse_advice(trainer.optimizer)

    def check(self, trainer: Trainer, embeddings: torch.Tensor, where: str, step: int) -> None:
        """Raise when every score of ``embeddings`` ties.

        Args:
            trainer: the trainer.
            embeddings: (N, d) embeddings.
            where: ``"training batch"`` or ``"validation split"``.
            step: the step the embeddings belong to (for the message).
        """
        spread = embedding_spread(embeddings)
        if spread > self.threshold:
            return
        message = (
            f"every score ties at step {step} (epoch {trainer.next_epoch}, loss "
            f"{trainer.loss_name}): the {embeddings.shape[0]} embeddings of the {where} all "
            f"point in the same direction (spread {spread:.2e} <= {self.threshold:g}), so the "
            f"model has collapsed and cannot rank; training stopped and "
            f"{trainer.kept_checkpoint_message()}. " + self._advice(trainer)
        )
        record = {
            "kind": "error",
            "step": step,
            "error": "collapsed embeddings",
            "where": where,
            "spread": spread,
        }
        raise CollapsedEmbeddingsError(
            message, step, trainer.last_good_checkpoint, spread, where, record
        )

    def on_train_batch(
        self, trainer: Trainer, embeddings: torch.Tensor, labels: torch.Tensor
    ) -> None:
        """Check the training batch before its loss."""
        self.check(trainer, embeddings, "training batch", trainer.step + 1)

    def on_validation_end(
        self, trainer: Trainer, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Check the validation split (the step is applied but not checkpointed)."""
        self.check(trainer, embeddings, "validation split", trainer.step)
