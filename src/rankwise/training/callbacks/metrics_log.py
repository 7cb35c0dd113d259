"""``metrics.jsonl``: one record per logged step, evaluation, test and failure (:class:`MetricsLogger`)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..._validation import Interval, check_scalar
from ..checkpoint import atomic_write_text
from ..errors import ConfigError, NonFiniteLossError
from .base import Callback, StepOutput, TrainerView, report_summary

if TYPE_CHECKING:
    from ...metrics import PRCurve, RetrievalReport

__all__ = ["MetricsLogger"]


class MetricsLogger(Callback):
    """The run's records: ``trainer.history`` and, with a run directory, ``metrics.jsonl``.

    One JSON record per line: ``{"kind": "train", "step", "epoch", "loss", "lr",
    "samples_per_s", "loss_stats"}`` every ``log_every`` steps and at the last step (``loss`` is
    the mean over the steps since the previous record, ``loss_stats`` the numeric
    ``loss_fn.last_stats``; with precision ``"16"`` also ``overflow_steps``, the steps skipped
    so far, and ``loss_scale``), ``{"kind": "val", "step", ...report}`` at every evaluation, the final
    ``{"kind": "test", ...}`` and ``{"kind": "error", ...}`` when the run fails.

    The loss window is checkpointed (a resumed run logs the same means). On resume the file is
    cut back to the checkpoint's step and the test record dropped; a last line cut short is
    dropped with a note, any other non-JSON line is corruption (a ``ConfigError``).

    Args:
        log_every: steps between training records.
    """

    state_key = "metrics_logger"

    def __init__(self, log_every: int = 10) -> None:
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

    def on_fit_start(self, trainer: TrainerView) -> None:
        """Start (or, after a resume, cut back) the history."""
        writes = trainer.run_dir is not None and trainer.is_main_process
        self._path = trainer.paths.metrics if writes else None
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

    def on_train_step_end(self, trainer: TrainerView, output: StepOutput) -> None:
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
                **trainer.optimizer_step.record(),  # precision "16": overflow steps, loss scale
            }
        )
        self._window_start, self._window_steps, self._window_losses = now, 0, []

    def on_validation_end(
        self, trainer: TrainerView, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Write the validation record."""
        self.log({"kind": "val", "step": trainer.step, **report_summary(report)})

    def on_test_end(self, trainer: TrainerView, report: RetrievalReport, curve: PRCurve) -> None:
        """Write the test record."""
        self.log({"kind": "test", "step": trainer.step, **report_summary(report)})

    def on_failure(self, trainer: TrainerView, error: NonFiniteLossError) -> None:
        """Write the error record of a failed run."""
        self.log(dict(error.record))

    def state_dict(self) -> dict[str, Any]:
        """The losses of the steps since the last training record."""
        return {"window_losses": list(self._window_losses)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the loss window."""
        self._window_losses = [float(v) for v in state.get("window_losses", [])]
