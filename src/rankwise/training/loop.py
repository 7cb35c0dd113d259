"""The fit loop: the steps of a run, its progress state and the explicit end it returns.

The loop of Wen et al. (NeurIPS 2022), Sec. 5.1 and App. D.1: one optimizer step per P x K batch,
a validation (and checkpoint) every ``eval_every`` steps and at the budget. :class:`FitLoop` owns
the progress (step, the sampler position of the next batch, the seconds spent), checkpointed as
plain values so a resumed run continues bit for bit; it receives what it uses (the step
function, the callback dispatch, the validation-and-checkpoint writer, the
:class:`~rankwise.training.stop.StopControl`, the batches) and never imports the Trainer. It
returns a :class:`LoopEnd` saying why it stopped; no exception carries a normal stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .callbacks import StepOutput
from .errors import DataError
from .stop import StopControl

__all__ = ["LoopEnd", "FitLoop"]


@dataclass(frozen=True)
class LoopEnd:
    """Why the loop stopped.

    Attributes:
        kind: ``"budget"`` (the run's steps are done), ``"max_steps"`` (the ``max_steps`` of
            this ``fit``), ``"stopped_early"`` (a callback asked for a normal end with a reason)
            or ``"signal"`` (Ctrl-C / SIGTERM, or a stop asked for without a reason).
        reason: the reason of a ``"stopped_early"`` end.
        signal: the signal of a ``"signal"`` end (``None``: asked for by code).

    Example:
        >>> LoopEnd("stopped_early", reason="no improvement").kind
        'stopped_early'
    """

    kind: str
    reason: str | None = None
    signal: int | None = None


class FitLoop:
    """The steps of a run from its current progress to a :class:`LoopEnd`.

    Args:
        steps_per_epoch: batches per sampler epoch.
        total_steps: the run's budget.
        eval_every: steps between validations (and at ``total_steps``).
        step_fn: ``step_fn(x, y) -> loss``: one optimizer step at the learning rate of
            :attr:`step` (the Trainer's ``train_step``).
        learning_rate: ``learning_rate(step) -> lr`` of a 0-based step (for the record).
        emit: ``emit(hook, *args)``: the callbacks' dispatch.
        validate: the validation and checkpoint of the current step.
        stop_control: the run's stop (signals, a callback's request, the processes' agreement).

    Attributes:
        step: optimizer steps completed.
        next_epoch: the sampler epoch of the next batch.
        next_position: the next batch's index within that epoch.
        seconds: wall-clock seconds spent, summed over resumptions.
        in_step: a step is under way (an interruption now keeps the previous checkpoint).

    Example:
        Four steps of a constant loss, with nothing around them:

        >>> batches = iter((torch.zeros(2, 1), torch.zeros(2), torch.tensor([[0, i]])) for i in range(9))
        >>> loop = FitLoop(9, 4, 2, lambda x, y: torch.tensor(1.0), lambda step: 0.1,
        ...                lambda hook, *args: None, lambda: None, StopControl())
        >>> loop.run(batches), loop.step, loop.state_dict()["next_position"]
        (LoopEnd(kind='budget', reason=None, signal=None), 4, 4)
    """

    def __init__(
        self,
        steps_per_epoch: int,
        total_steps: int,
        eval_every: int,
        step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        learning_rate: Callable[[int], float],
        emit: Callable[..., None],
        validate: Callable[[], None],
        stop_control: StopControl,
    ) -> None:
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = total_steps
        self.eval_every = eval_every
        self._step_fn = step_fn
        self._learning_rate = learning_rate
        self._emit = emit
        self._validate = validate
        self.stop_control = stop_control
        self.step = 0
        self.next_epoch = 0
        self.next_position = 0
        self.seconds = 0.0
        self.in_step = False
        self._tick = time.perf_counter()

    # -- progress -----------------------------------------------------------------------------

    def start_clock(self) -> None:
        """Count the seconds from now (a ``fit`` starts)."""
        self._tick = time.perf_counter()

    def account_time(self) -> None:
        """Add the seconds since the last account to :attr:`seconds`."""
        now = time.perf_counter()
        self.seconds += now - self._tick
        self._tick = now

    def add_seconds(self, seconds: float) -> None:
        """Count ``seconds`` spent outside the steps (the end of the run) as the run's time."""
        self.seconds += seconds

    def state_dict(self) -> dict[str, Any]:
        """The progress after :attr:`step` (keys of the checkpoint, in its order)."""
        return {
            "step": self.step,
            "next_epoch": self.next_epoch,
            "next_position": self.next_position,
            "seconds": self.seconds,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (a checkpoint's)."""
        self.step = int(state["step"])
        self.next_epoch = int(state["next_epoch"])
        self.next_position = int(state["next_position"])
        self.seconds = float(state["seconds"])

    # -- the steps ----------------------------------------------------------------------------

    def run(self, batches: Iterator[Any], max_steps: int | None = None) -> LoopEnd:
        """Run steps from :attr:`step` until the budget, ``max_steps`` or a stop.

        Args:
            batches: the ``(x, y, meta)`` batches from the current position (``meta[0]``:
                the batch's ``(epoch, position)``).
            max_steps: stop after this many total steps.

        Returns:
            The :class:`LoopEnd`.

        Raises:
            DataError: a data file could not be read; the state of :attr:`step` is complete
                (nothing of the step being loaded was applied; a validation cut short runs
                again on resume), so :attr:`in_step` is ``False``.
        """
        try:
            while True:
                if self.step >= self.total_steps:
                    return LoopEnd("budget")
                if max_steps is not None and self.step >= max_steps:
                    return LoopEnd("max_steps")
                end = self.run_step(batches)
                if end is not None:
                    return end
        except DataError:
            self.in_step = False
            raise

    def run_step(self, batches: Iterator[Any]) -> LoopEnd | None:
        """One complete step: the batch, its records, its validation; the end it asked for.

        Returns:
            ``None`` to go on, else the :class:`LoopEnd` of an agreed stop.
        """
        self.in_step = True
        x, y, meta = next(batches)
        lr = self._learning_rate(self.step)
        loss = self._step_fn(x, y)
        self.step += 1
        epoch, position = int(meta[0, 0]), int(meta[0, 1])
        if position + 1 >= self.steps_per_epoch:
            self.next_epoch, self.next_position = epoch + 1, 0
        else:
            self.next_epoch, self.next_position = epoch, position + 1
        output = StepOutput(self.step, epoch, position, float(loss), lr, int(y.shape[0]))
        self._emit("on_train_step_end", output)
        if self.step % self.eval_every == 0 or self.step == self.total_steps:
            self._validate()
        # the step, its records and its evaluation are complete: a safe stop point
        self.in_step = False
        self._emit("on_step_end")
        if not self.stop_control.agree():  # every process stops after the same step
            return None
        reason = self.stop_control.reason
        if reason is not None:
            return LoopEnd("stopped_early", reason=reason)
        return LoopEnd("signal", signal=self.stop_control.signal)
