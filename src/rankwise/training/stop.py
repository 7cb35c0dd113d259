"""How a run stops early: Ctrl-C and SIGTERM handled between steps, agreed by every process.

SIGTERM (what ``timeout``, SLURM, Kubernetes and docker send) is handled exactly like Ctrl-C, so a
scheduler's stop leaves ``last.pt`` at the last complete step. :class:`StopControl` is the one
signal handler of a run: during the steps the first signal stops the loop after the current step
(with a checkpoint), a second aborts at once; once the run's outcome is saved a signal is noted and
the finishing work (plots, the caller's closing lines) goes on, a second aborts, saying what is
kept. Under data parallelism the processes agree, after every step, to stop together (through the
strategy).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._signals import handle_signals, signal_label, signal_number_of
from .errors import TrainingInterrupted
from .strategy import SingleProcess

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["StopControl", "graceful_stop"]


class StopControl:
    """The stop of a run: a request (a signal, a callback, another process) and its agreement.

    Args:
        strategy: the processes of the run (default: one process).
        console: where the signal messages go (default: stderr).
        saving: the run writes checkpoints (the message says one is saved).

    Example:
        A stop asked for by code (as Ctrl-C asks for it) is agreed after the step:

        >>> stop = StopControl()
        >>> stop.request()
        >>> stop.requested, stop.agree()
        (True, True)
    """

    def __init__(
        self,
        strategy: SingleProcess | None = None,
        console: Console | None = None,
        *,
        saving: bool = False,
    ) -> None:
        self.strategy = strategy if strategy is not None else SingleProcess()
        self.console = console
        self.saving = saving
        self._requested = False
        self._reason: str | None = None
        self._signal: int | None = None
        self._looping = False
        self._outcome: tuple[str, Path, int] | None = None
        self._noted = False
        self._handling = False

    @property
    def requested(self) -> bool:
        """Whether the run stops after the current step."""
        return self._requested

    @property
    def reason(self) -> str | None:
        """Why code asked for a normal end (``None``: no reason given, or a signal came)."""
        return None if self._signal is not None else self._reason

    @property
    def signal(self) -> int | None:
        """The signal that asked for the stop (``None``: none came)."""
        return self._signal

    @property
    def outcome(self) -> str | None:
        """``"completed"``, ``"stopped_early"`` or ``"stopped"`` once the run's outcome is saved, else ``None``."""
        return None if self._outcome is None else self._outcome[0]

    def request(self, reason: str | None = None) -> None:
        """Stop after the current step, with a checkpoint.

        Args:
            reason: why (e.g. early stopping): the run then ends normally, its selected model
                tested (``"stopped_early"``); ``None``: an interruption, as Ctrl-C. Under data
                parallelism every process gives it (each sees the same validation report).
        """
        self._requested = True
        if reason is not None:
            self._reason = str(reason)

    def start(self) -> None:
        """A new ``fit``: forget an earlier request, signal and outcome."""
        self._requested = False
        self._reason = None
        self._signal = None
        self._outcome = None
        self._noted = False

    def agree(self) -> bool:
        """Whether the run stops now: any process asked for it (a collective on many).

        Returns:
            The agreed request (every process then stops after the same step).
        """
        if self.strategy.world_size > 1:
            self._requested = self.strategy.any_rank(self._requested)
        return self._requested

    def saved(self, outcome: str, run_dir: Path, step: int) -> None:
        """The run's outcome is saved in ``run_dir``: from now on a signal loses nothing.

        Args:
            outcome: ``"completed"``, ``"stopped_early"`` or ``"stopped"``.
            run_dir: where it is saved.
            step: the run's step.
        """
        self._outcome = (outcome, run_dir, step)

    @contextlib.contextmanager
    def during_steps(self) -> Iterator[None]:
        """The training steps run inside: a first signal stops the loop after the current step."""
        self._looping = True
        try:
            yield
        finally:
            self._looping = False

    @contextlib.contextmanager
    def handling(self) -> Iterator[None]:
        """Handle Ctrl-C and SIGTERM inside the block (re-entrant: one handler for nested blocks).

        A second signal after the outcome was saved raises :class:`TrainingInterrupted` naming
        what is kept.
        """
        if self._handling:
            yield
            return
        self._handling = True
        try:
            with handle_signals(self._on_signal):
                try:
                    yield
                except KeyboardInterrupt as exc:
                    if self._outcome is None or isinstance(exc, TrainingInterrupted):
                        raise
                    raise self._aborted(exc) from None
        finally:
            self._handling = False

    def _print(self, text: str) -> None:
        if self.console is not None:
            self.console.print(f"[yellow]{text}[/yellow]", soft_wrap=True)

    def _on_signal(self, signum: int) -> bool:
        name = signal_label(signum)
        # the hint names the signal that came: a scheduler sends SIGTERM, a person Ctrl-C
        again = "Ctrl-C again" if signum == signal.SIGINT else f"another {name}"
        if self._outcome is not None:
            if self._noted:
                return False  # the second signal: abort the finishing work
            self._noted = True
            self._print(
                f"{name} after the run {self._outcome[0]}: nothing is lost; finishing "
                f"({again} aborts at once)."
            )
            return True
        if not self._looping or self._signal is not None:
            return False  # outside the steps, or the second signal: raise at once
        self._signal = signum
        self._requested = True
        saving = " and saving a checkpoint" if self.saving else ""
        self._print(f"{name}: stopping after this step{saving} ({again} aborts at once).")
        return True

    def _aborted(self, exc: KeyboardInterrupt) -> TrainingInterrupted:
        assert self._outcome is not None
        outcome, run_dir, step = self._outcome
        number = signal_number_of(exc)
        message = (
            f"{signal_label(number)}: aborted after the run {outcome}; what it saved is kept in "
            f"{run_dir} (plots may be missing)"
        )
        return TrainingInterrupted(message, step, run_dir, None, signal_number=number)


@contextlib.contextmanager
def graceful_stop(trainer: Any) -> Iterator[None]:
    """Ctrl-C or SIGTERM: finish the current step, then checkpoint and stop; a second: abort now.

    The steps of ``trainer`` run inside (its :class:`StopControl`; kept for old callers).
    """
    control: StopControl = trainer.stop_control
    with control.handling(), control.during_steps():
        yield
