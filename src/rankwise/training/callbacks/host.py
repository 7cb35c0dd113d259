"""The Trainer's callbacks: the default ones, a user's replacing them, and calling their hooks.

:func:`default_callbacks` are the callbacks of every run, :func:`add_callback` puts a user's one
in (replacing the default of its type) and :func:`emit` calls one hook of each, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from .base import Callback, StepCallback
from .collapse import CollapseDetector
from .metrics_log import MetricsLogger
from .plots import PlotCurves
from .progress import ProgressBar
from .selection import BestCheckpoint

__all__ = ["CallbackLike", "add_callback", "as_callback", "default_callbacks", "emit", "find"]

CallbackLike = Callback | Callable[[Any], None]
_C = TypeVar("_C", bound=Callback)


def default_callbacks(
    log_every: int, progress: bool | None, detect_collapse: bool
) -> list[Callback]:
    """The callbacks of every run: collapse detector, metrics log, selection, progress, plots."""
    # the collapse detector first: a collapsed validation split is neither logged nor kept
    callbacks: list[Callback] = [CollapseDetector()] if detect_collapse else []
    callbacks += [
        MetricsLogger(log_every),
        BestCheckpoint(),
        ProgressBar(progress, log_every),
        PlotCurves(),
    ]
    return callbacks


def as_callback(callback: CallbackLike) -> Callback:
    """``callback`` as a :class:`Callback` (a plain function ``fn(trainer)``: a step callback)."""
    if isinstance(callback, Callback):
        return callback
    if callable(callback):
        return StepCallback(callback)
    raise ValueError(
        f"`callbacks` must hold Callback objects or functions fn(trainer), got "
        f"{type(callback).__name__}."
    )


def add_callback(callbacks: list[Callback], callback: Callback) -> None:
    """Put ``callback`` in ``callbacks``: in place of the one of its type, else at the end."""
    for i, existing in enumerate(callbacks):
        if type(existing) is not StepCallback and isinstance(callback, type(existing)):
            callbacks[i] = callback  # a user's ProgressBar replaces the default one
            return
    callbacks.append(callback)


def find(callbacks: Sequence[Callback], kind: type[_C]) -> _C | None:
    """The first callback of type ``kind`` (``None``: none)."""
    return next((c for c in callbacks if isinstance(c, kind)), None)


def emit(callbacks: Sequence[Callback], hook: str, trainer: Any, *args: Any) -> None:
    """Call ``hook(trainer, *args)`` of every callback, in order."""
    for callback in callbacks:
        getattr(callback, hook)(trainer, *args)
