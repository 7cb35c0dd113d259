"""How a run stops early: Ctrl-C and SIGTERM handled between steps, and the failures' messages.

:func:`graceful_stop` stops the loop after the current step with a checkpoint; :class:`Failures`
(a mixin of the Trainer) turns an interruption, a non-finite loss or model into errors that say
what was kept and how to continue.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from .._signals import handle_signals
from .errors import NonFiniteLossError, TrainingInterrupted
from .state import RunState

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["Failures", "graceful_stop"]


_SIGNAL_NAMES: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@contextlib.contextmanager
def graceful_stop(trainer: Trainer) -> Iterator[None]:
    """Ctrl-C or SIGTERM: finish the current step, then checkpoint and stop; a second: abort now.

    SIGTERM (what ``timeout``, SLURM, Kubernetes and docker send) is handled exactly like
    Ctrl-C, so a scheduler's stop leaves ``last.pt`` at the last complete step.
    """

    def on_signal(signum: int) -> bool:
        if trainer._stop_signal is not None:
            return False  # the second signal: raise at once (the last checkpoint is kept)
        trainer._stop_signal = signum
        trainer._stop_requested = True
        saving = " and saving a checkpoint" if trainer.run_dir is not None else ""
        name = _SIGNAL_NAMES.get(signum, signal.Signals(signum).name)
        # the hint names the signal that came: a scheduler sends SIGTERM, a person Ctrl-C
        again = "Ctrl-C again" if signum == signal.SIGINT else f"another {name}"
        trainer.console.print(
            f"[yellow]{name}: stopping after this step{saving} ({again} aborts at once).[/yellow]",
            soft_wrap=True,
        )
        return True

    with handle_signals(on_signal):
        yield


class Failures(RunState):
    """The Trainer's errors for an interrupted or diverged run (a mixin of Trainer).

    Attributes:
        activity: what the messages call the run (``"training"``; a subclass training something
            else names it, e.g. ``"pretraining"``).
    """

    activity = "training"
    total_steps: int
    loss_name: str
    _in_step: bool

    def _resume_hint(self) -> str:
        """How to resume in Python (the interruption's ``resume_hint``)."""
        if self.config is not None:
            return f"Trainer.from_run_dir({str(self.run_dir)!r})"
        return "Trainer(<the same objects>, run_dir=..., resume=True)"

    def _interrupted(self, signal_number: int = signal.SIGINT) -> TrainingInterrupted:
        if self.run_dir is None:
            detail = "nothing was saved (the trainer has no run_dir)"
        elif not self._in_step:
            if self.last_checkpoint_step != self.step:
                self.save_checkpoint()
            detail = f"checkpoint saved at step {self.step}"
        elif self.last_checkpoint_step is not None:
            detail = (
                f"step {self.step + 1} was cut short, so the checkpoint of step "
                f"{self.last_checkpoint_step} is kept"
            )
        else:
            detail = "no checkpoint had been written yet; start the run again"
        by = _SIGNAL_NAMES.get(signal_number, signal.Signals(signal_number).name)
        where = f"at step {self.step}/{self.total_steps}: {detail}"
        return TrainingInterrupted(
            f"{self.activity} interrupted ({by}) {where}",
            self.step,
            self.run_dir,
            self.last_checkpoint_step,
            self._resume_hint(),
            signal_number=signal_number,
            detail=where,
        )

    def _raise_non_finite(self, loss: torch.Tensor | None) -> None:
        what = (
            f"the loss is {float(loss.detach())}"
            if loss is not None
            else "the model's embeddings contain NaN/inf"
        )
        fix = "optimizer.lr" if self.config is not None else "the learning rate"
        message = (
            f"{what} at step {self.step + 1} (epoch {self.next_epoch}, loss {self.loss_name}); "
            f"training stopped without applying that step and {self.kept_checkpoint_message()}. "
            f"Lower {fix} or check the loss parameters."
        )
        record = {
            "kind": "error",
            "step": self.step + 1,
            "error": "non-finite loss" if loss is not None else "non-finite embeddings",
        }
        raise NonFiniteLossError(message, self.step + 1, self.last_good_checkpoint, record)
