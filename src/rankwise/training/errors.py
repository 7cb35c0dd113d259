"""Why a training run stopped early.

Why a training run stopped early: a configuration problem found before the first step, a
non-finite or collapsed model (the run failed, the last good checkpoint is kept), or an
interruption (Ctrl-C, after a checkpoint).

Messages name config keys (``optimizer.lr``) and Python arguments (in backticks, `` `run_dir` ``),
never command-line flags: :mod:`rankwise.commands` rewrites them for the command line.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "CollapsedEmbeddingsError",
    "ConfigError",
    "NonFiniteLossError",
    "ReplicaDivergenceError",
    "TrainingInterrupted",
]


class ConfigError(ValueError):
    """A configuration problem, reported before any training with the offending key."""


class NonFiniteLossError(RuntimeError):
    """The loss (or the model's output) became NaN or infinite.

    The run stopped without applying that step.

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
    """Every score ties: the model collapsed and the run stopped.

    The embeddings of a training batch or of the validation split all point in the same
    direction, so nothing can be ranked any more.

    A subclass of :class:`NonFiniteLossError` so every handler of a diverged run (the command
    line, ``tune`` recording a failed trial) handles a collapsed one too.

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

    Every rank of a data-parallel run must hold bit-identical weights, loss buffers (SOPRC's
    ``v``, the XBM queue) and optimizer state; a difference means the ranks computed different
    updates (a non-deterministic kernel, a rank-dependent branch, a buffer updated from the local
    batch only). The run stops before the diverged state is checkpointed, so the last good
    checkpoint is kept. A subclass of :class:`NonFiniteLossError` so every handler of a failed
    run (the command line, ``tune``) handles it too.

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


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (or a callback raising ``KeyboardInterrupt``) stopped the run.

    ``str()`` is the message followed by how to resume (when a checkpoint exists).

    Attributes:
        message: what happened and which checkpoint is kept.
        step: optimizer steps completed.
        run_dir: the run directory (``None`` for a trainer without one: nothing was saved).
        checkpoint_step: the step of the checkpoint to resume from (``None``: none was written).
        resume_hint: how to resume in Python, e.g. ``"Trainer.from_run_dir('runs/x')"``.
    """

    def __init__(
        self,
        message: str,
        step: int,
        run_dir: Path | None,
        checkpoint_step: int | None,
        resume_hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.step = step
        self.run_dir = run_dir
        self.checkpoint_step = checkpoint_step
        self.resume_hint = resume_hint

    def __str__(self) -> str:
        if self.resume_hint and self.checkpoint_step is not None:
            return f"{self.message}. Resume with {self.resume_hint}."
        return f"{self.message}."
