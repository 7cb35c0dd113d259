"""The Trainer's callbacks: the default ones, a user's replacing them, and calling their hooks.

:func:`default_callbacks` are the callbacks of every run, :func:`add_callback` puts a user's one
in (replacing the default of its type) and :func:`emit` calls one hook of each, in order.
:class:`CallbackHost` holds a run's callbacks: those of the run, those active in one ``fit``,
their hooks, their checkpointed states and what the Trainer reports of them (the history, the
selection).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from ..monitor import DEFAULT_MONITOR
from .base import Callback, StepCallback
from .collapse import CollapseDetector
from .metrics_log import MetricsLogger
from .plots import PlotCurves
from .progress import ProgressBar
from .selection import BestCheckpoint

__all__ = [
    "CallbackHost",
    "CallbackLike",
    "add_callback",
    "as_callback",
    "default_callbacks",
    "emit",
    "find",
]

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


class CallbackHost:
    """The callbacks of a run: the defaults and the given ones, and those active in one ``fit``.

    Args:
        log_every: the metrics log's and the progress bar's cadence.
        progress: show a progress bar (``None``: only on a terminal).
        detect_collapse: add the :class:`CollapseDetector`.
        callbacks: the run's own callbacks (a plain function: a step callback); one of the
            type of a default replaces that default.

    Attributes:
        callbacks: the run's callbacks, in order.

    Example:
        >>> host = CallbackHost(10, False, True, [lambda trainer: None])
        >>> [type(c).__name__ for c in host.callbacks][-1], host.monitor, host.history
        ('StepCallback', 'map', [])
    """

    def __init__(
        self,
        log_every: int,
        progress: bool | None,
        detect_collapse: bool,
        callbacks: Sequence[CallbackLike] = (),
    ) -> None:
        self.callbacks = default_callbacks(log_every, progress, detect_collapse)
        for callback in callbacks:
            add_callback(self.callbacks, as_callback(callback))
        self._active: list[Callback] = list(self.callbacks)

    def add(self, callback: Callback) -> None:
        """Put ``callback`` among the run's callbacks (:func:`add_callback`); all are active."""
        add_callback(self.callbacks, callback)
        self._active = list(self.callbacks)

    def start_fit(self, extra: Sequence[CallbackLike] = ()) -> None:
        """A ``fit`` starts: the run's callbacks and ``extra`` (for this call only) are active."""
        self._active = self.callbacks + [as_callback(c) for c in extra]

    def emit(self, hook: str, trainer: Any, *args: Any) -> None:
        """Call ``hook(trainer, *args)`` of every active callback, in order."""
        emit(self._active, hook, trainer, *args)

    def state_dict(self) -> dict[str, Any]:
        """The active callbacks' states by ``state_key`` (what a checkpoint holds)."""
        return {c.state_key: c.state_dict() for c in self._active if c.state_key is not None}

    def load_state_dict(self, states: Mapping[str, Any]) -> None:
        """Restore the run's callbacks from :meth:`state_dict`'s output (missing keys: none)."""
        for callback in self.callbacks:
            if callback.state_key is not None and callback.state_key in states:
                callback.load_state_dict(states[callback.state_key])

    @property
    def selection(self) -> BestCheckpoint | None:
        """The active model selection (``None``: the final model is tested)."""
        return find(self._active, BestCheckpoint)

    @property
    def best_step(self) -> int | None:
        """Step of the best validation score so far (``None``: none, or no selection)."""
        return None if self.selection is None else self.selection.best_step

    @property
    def best_val(self) -> dict[str, Any] | None:
        """Validation report summary of the best step so far."""
        return None if self.selection is None else self.selection.best_val

    @property
    def history(self) -> list[dict[str, Any]]:
        """The records of the run so far (the :class:`MetricsLogger`'s)."""
        logger = find(self._active, MetricsLogger)
        return logger.records if logger is not None else []

    @property
    def monitor(self) -> str:
        """The validation scalar that selects the model."""
        best = self.selection
        return DEFAULT_MONITOR if best is None else best.monitor
