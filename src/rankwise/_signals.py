"""Ctrl-C and SIGTERM handled alike: what stops a run, a sweep or a command cleanly.

``timeout``, SLURM, Kubernetes and docker stop a process with SIGTERM (then SIGKILL after a grace
period); a person presses Ctrl-C (SIGINT). Both must leave the same thing behind: the last complete
step checkpointed, a message saying how to resume, and the exit status a shell expects of a process
stopped by that signal (128 + its number: 130 for SIGINT, 143 for SIGTERM). This module turns either
signal into a :class:`SignalInterrupt` (a ``KeyboardInterrupt``, so code that already handles Ctrl-C
handles SIGTERM too) that remembers which signal it was. No paper equation is implemented here.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = [
    "HANDLED_SIGNALS",
    "SignalInterrupt",
    "handle_signals",
    "signal_label",
    "signal_number_of",
]

HANDLED_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)


class SignalInterrupt(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` raised for a signal: Ctrl-C (SIGINT) or SIGTERM.

    Attributes:
        signal_number: the signal's number.
    """

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = int(signal_number)


def signal_number_of(exc: BaseException, default: int = signal.SIGINT) -> int:
    """The signal number behind the interruption ``exc`` (``default`` when it carries none)."""
    return int(getattr(exc, "signal_number", default))


def signal_label(number: int) -> str:
    """How messages name a signal: ``Ctrl-C`` for SIGINT, else its name (``SIGTERM``)."""
    return "Ctrl-C" if number == signal.SIGINT else signal.Signals(number).name


@contextlib.contextmanager
def handle_signals(on_signal: Callable[[int], bool] | None = None) -> Iterator[None]:
    """Handle SIGINT and SIGTERM alike while the block runs; restore the previous handlers after.

    Args:
        on_signal: called with the signal number; return ``True`` when the signal was taken
            care of (e.g. a stop was requested for the end of the current step), ``False`` to
            raise :class:`SignalInterrupt` at once. ``None`` raises at once.

    Outside the main thread (where Python cannot install handlers) the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if on_signal is not None and on_signal(signum):
            return
        raise SignalInterrupt(signum)

    previous = {sig: signal.signal(sig, handler) for sig in HANDLED_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
