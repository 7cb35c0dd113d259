"""The Trainer's callbacks: the default ones, a user's replacing them, and calling their hooks.

:class:`CallbackHost` (a mixin of :class:`~rankwise.training.Trainer`) holds them, calls their
hooks in order, and reads the history and the selection back from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .base import Callback, StepCallback
from .collapse import CollapseDetector
from .metrics_log import MetricsLogger
from .plots import PlotCurves
from .progress import ProgressBar
from .selection import BestCheckpoint

__all__ = ["CallbackHost", "CallbackLike"]

CallbackLike = Callback | Callable[[Any], None]
_C = TypeVar("_C", bound=Callback)


class CallbackHost:
    """The callbacks of a trainer (a mixin of Trainer).

    Attributes:
        callbacks: the trainer's callbacks (defaults, then the user's).
    """

    callbacks: list[Callback]
    _active: list[Callback]

    def _default_callbacks(
        self, log_every: int, progress: bool | None, detect_collapse: bool
    ) -> list[Callback]:
        # the collapse detector first: a collapsed validation split is neither logged nor kept
        callbacks: list[Callback] = [CollapseDetector()] if detect_collapse else []
        callbacks += [
            MetricsLogger(log_every),
            BestCheckpoint(),
            ProgressBar(progress, log_every),
            PlotCurves(),
        ]
        return callbacks

    @staticmethod
    def _as_callback(callback: CallbackLike) -> Callback:
        if isinstance(callback, Callback):
            return callback
        if callable(callback):
            return StepCallback(callback)
        raise ValueError(
            f"`callbacks` must hold Callback objects or functions fn(trainer), got "
            f"{type(callback).__name__}."
        )

    def _add_callback(self, callback: Callback) -> None:
        for i, existing in enumerate(self.callbacks):
            if type(existing) is not StepCallback and isinstance(callback, type(existing)):
                self.callbacks[i] = callback  # a user's ProgressBar replaces the default one
                return
        self.callbacks.append(callback)

    def _callback(self, kind: type[_C]) -> _C | None:
        return next((c for c in self._active if isinstance(c, kind)), None)

    def _emit(self, hook: str, *args: Any) -> None:
        for callback in self._active:
            getattr(callback, hook)(self, *args)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The records of the run so far (train, val, test, error), as in ``metrics.jsonl``."""
        logger = self._callback(MetricsLogger)
        return logger.records if logger is not None else []

    @property
    def best_step(self) -> int | None:
        """Step of the best validation score so far."""
        best = self._callback(BestCheckpoint)
        return None if best is None else best.best_step

    @property
    def best_val(self) -> dict[str, Any] | None:
        """Validation report summary of the best step so far."""
        best = self._callback(BestCheckpoint)
        return None if best is None else best.best_val
