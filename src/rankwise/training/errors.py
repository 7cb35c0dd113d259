"""Why a training run stopped early: a bad config, an unreadable checkpoint, a diverged model.

Also a data file that could not be read during training (after a checkpoint), a full disk (the file being written keeps its content) or an interruption (after a
checkpoint). Messages name config keys (``optimizer.lr``) and Python arguments (`` `run_dir` ``),
never command-line flags: :mod:`rankwise.commands` rewrites them for the command line.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._disk import DiskFullError  # a checkpoint that did not fit stops a run too
from ..data.base import DataError

__all__ = [
    "CollapsedEmbeddingsError",
    "ConfigError",
    "CorruptCheckpointError",
    "DataError",
    "DiskFullError",
    "NonFiniteLossError",
    "ReplicaDivergenceError",
    "TrainingDataError",
    "TrainingInterrupted",
]


class ConfigError(ValueError):
    """A configuration problem, reported before any training with the offending key."""


class NonFiniteLossError(RuntimeError):
    """The loss (or the model's output) became NaN or infinite; that step was not applied.

    Attributes:
        step: the 1-based number of the step that failed.
        last_good_checkpoint: ``checkpoints/last.pt`` of the run, or ``None`` when none was
            written (or the trainer has no run directory).
        record: the ``{"kind": "error", ...}`` record logged for the failure.
    """

    def __init__(
        self,
        message: str,
        step: int,
        last_good_checkpoint: Path | None,
        record: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.last_good_checkpoint = last_good_checkpoint
        self.record = dict(record) if record is not None else {"kind": "error", "step": step}


class CollapsedEmbeddingsError(NonFiniteLossError):
    """Every score ties (the embeddings all point one way): the model collapsed, the run stopped.

    A :class:`NonFiniteLossError`, so every handler of a diverged run handles it too.

    Attributes:
        spread: the :func:`~rankwise.training.callbacks.embedding_spread` that triggered it.
        where: ``"training batch"`` or ``"validation split"``.
    """

    def __init__(
        self,
        message: str,
        step: int,
        last_good_checkpoint: Path | None,
        spread: float,
        where: str,
        record: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message, step, last_good_checkpoint, record)
        self.spread = spread
        self.where = where


class ReplicaDivergenceError(NonFiniteLossError):
    """The data-parallel processes no longer hold the same model, loss state or optimizer state.

    The ranks computed different updates (a non-deterministic kernel, a rank-dependent branch, a
    buffer updated from the local batch only); the run stops before checkpointing that state. A
    :class:`NonFiniteLossError`, so every handler of a failed run handles it too.

    Attributes:
        names: the tensors that differ (``model.``, ``loss.`` or ``optimizer.`` prefixed).
        ranks: the ranks whose copy differs from rank 0's.
    """

    def __init__(
        self,
        message: str,
        step: int,
        last_good_checkpoint: Path | None,
        names: list[str],
        ranks: list[int],
        record: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message, step, last_good_checkpoint, record)
        self.names = list(names)
        self.ranks = list(ranks)

    def keeping(self, last_good_checkpoint: Path | None, kept: str) -> ReplicaDivergenceError:
        """This error once training stopped, naming the checkpoint that is kept (``kept``)."""
        message = f"{self.args[0]} Training stopped and {kept}."
        return ReplicaDivergenceError(
            message, self.step, last_good_checkpoint, self.names, self.ranks, self.record
        )


class CorruptCheckpointError(ValueError):
    """A checkpoint file cannot be read: empty, truncated, junk or not a rankwise checkpoint.

    ``str()`` is ``checkpoint PATH is corrupt: <why>``, plus the older checkpoint that loads.

    Attributes:
        path: the unreadable file.
        reason: why it cannot be read.
        run_dir: the run directory it belongs to (``None``: not known).
        fallback: an older checkpoint of the run that loads (``None``: none).
        fallback_step: the step ``fallback`` holds.
        advice: what else to do (e.g. retrain), or ``None``.
    """

    def __init__(
        self,
        path: str | Path,
        reason: str,
        *,
        run_dir: Path | None = None,
        fallback: Path | None = None,
        fallback_step: int | None = None,
        advice: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.reason = reason
        self.run_dir = run_dir
        self.fallback = fallback
        self.fallback_step = fallback_step
        self.advice = advice
        super().__init__(self.describe())

    def describe(self, resume_with: str | None = None) -> str:
        """The full message, with ``resume_with`` (the call that resumes from :attr:`fallback`)."""
        if self.reason == "it is missing":
            text = f"checkpoint {self.path} is missing."
        else:
            text = f"checkpoint {self.path} is corrupt: {self.reason}."
        if self.fallback is not None:
            text += (
                f" The older checkpoint {self.fallback} (step {self.fallback_step}) is intact"
                + (f"; resume from it with: {resume_with}" if resume_with else "")
                + "."
            )
        if self.advice:
            text += f" {self.advice}"
        return text

    def with_context(
        self,
        *,
        run_dir: Path | None = None,
        fallback: Path | None = None,
        fallback_step: int | None = None,
        advice: str | None = None,
    ) -> CorruptCheckpointError:
        """A copy with the given attributes (see the class) replaced; the others kept."""
        return CorruptCheckpointError(
            self.path,
            self.reason,
            run_dir=run_dir if run_dir is not None else self.run_dir,
            fallback=fallback if fallback is not None else self.fallback,
            fallback_step=fallback_step if fallback_step is not None else self.fallback_step,
            advice=advice if advice is not None else self.advice,
        )


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (or a callback raising ``KeyboardInterrupt``) stopped the run.

    ``str()`` is the message followed by how to resume (when a checkpoint exists).

    Attributes:
        message: what happened and which checkpoint is kept.
        step: optimizer steps completed.
        run_dir: the run directory (``None`` for a trainer without one: nothing was saved).
        checkpoint_step: the step of the checkpoint to resume from (``None``: none was written).
        resume_hint: how to resume in Python, e.g. ``"Trainer.from_run_dir('runs/x')"``.
        signal_number: ``signal.SIGINT`` (Ctrl-C, a callback's ``KeyboardInterrupt``) or
            ``signal.SIGTERM``.
        resume_command: the shell command that resumes (set by the command line, e.g. for a
            sweep: ``rankwise bench --resume DIR``); ``None``: the command line derives it.
        detail: the message without its ``"<activity> interrupted (<signal>) "`` head, e.g.
            ``"at step 5/400: checkpoint saved at step 5"`` (``None``: not known), for a message
            that names the interruption in its own words (a sweep names the run too).
    """

    def __init__(
        self,
        message: str,
        step: int,
        run_dir: Path | None,
        checkpoint_step: int | None,
        resume_hint: str | None = None,
        *,
        signal_number: int = signal.SIGINT,
        resume_command: str | None = None,
        detail: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail
        self.step = step
        self.run_dir = run_dir
        self.checkpoint_step = checkpoint_step
        self.resume_hint = resume_hint
        self.signal_number = int(signal_number)
        self.resume_command = resume_command

    @property
    def exit_code(self) -> int:
        """The shell's exit status of a process stopped by the signal: 128 + its number."""
        return 128 + self.signal_number

    def __str__(self) -> str:
        if self.resume_hint and self.checkpoint_step is not None:
            return f"{self.message}. Resume with {self.resume_hint}."
        return f"{self.message}."


class TrainingDataError(DataError):
    """A data file could not be read during training or its evaluation; the state is saved.

    The files were checked before the first step (``dataset.preflight``), so one changed under
    the running job. The run stopped like an interruption: ``checkpoints/last.pt`` holds the state
    of the last complete step (an evaluation that the error cut short runs again on resume), and
    resuming once the file is fixed gives the result of an uninterrupted run. A
    :class:`~rankwise.data.DataError`.

    ``str()`` is one line: the file's message, where training stopped and what is kept.

    Attributes:
        file_message: the data error's message (the file, its list row and sample).
        step: optimizer steps completed.
        total_steps: the run's budget.
        run_dir: the run directory (``None``: nothing was saved).
        checkpoint_step: the step of the checkpoint to resume from (``None``: none).
        resume_hint: how to resume in Python, e.g. ``"Trainer.from_run_dir('runs/x')"``.
        during: what read the file: ``"training"``, ``"validation"`` or ``"test"``.
    """

    def __init__(
        self,
        file_message: str,
        *,
        step: int,
        total_steps: int,
        run_dir: Path | None,
        checkpoint_step: int | None,
        resume_hint: str | None,
        during: str,
    ) -> None:
        self.file_message = file_message
        self.step = step
        self.total_steps = total_steps
        self.run_dir = run_dir
        self.checkpoint_step = checkpoint_step
        self.resume_hint = resume_hint
        self.during = during
        super().__init__(self.describe(resume_hint))

    def describe(self, resume_with: str | None = None) -> str:
        """The one-line message, ending with ``resume_with`` (how to continue) when resumable."""
        stopped = (
            f"The run stopped at step {self.step}/{self.total_steps} reading the {self.during} data"
        )
        if self.run_dir is None:
            return f"{self.file_message} {stopped}; nothing was saved (the trainer has no run_dir)."
        if self.checkpoint_step is None:
            return f"{self.file_message} {stopped}; no checkpoint had been written yet."
        kept = f"{stopped} with a checkpoint at step {self.checkpoint_step}"
        if resume_with is None:
            return f"{self.file_message} {kept}; fix the file, then resume the run."
        return f"{self.file_message} {kept}; once the file is fixed, resume with: {resume_with}"
