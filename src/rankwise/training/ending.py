"""How a run ends: its :class:`RunResult`, or the error that says what is kept and how to resume.

:class:`RunEnding` owns the end of a run besides its policy: the reason of a normal early end
(checkpointed, so a resumed run knows it is finished), the result of the steps done, and the three
abnormal ends, each stopping with the state of the last complete step saved where that state is
whole: an interruption (Ctrl-C / SIGTERM, :class:`TrainingInterrupted`), a data file that could
not be read (:class:`TrainingDataError`) and a non-finite loss or model
(:class:`NonFiniteLossError`). It reads the progress of the :class:`~rankwise.training.loop.FitLoop`
and the checkpoints of the :class:`~rankwise.training.store.RunStore`, and is given the
checkpoint writer; it never imports the Trainer. The loop it ends is the one of Wen et al.
(NeurIPS 2022), Sec. 5.1.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._signals import signal_label, signal_number_of
from .errors import DataError, NonFiniteLossError, TrainingDataError, TrainingInterrupted
from .loop import FitLoop, LoopEnd
from .result import RunResult, per_category_map
from .stop import StopControl
from .store import RunStore

if TYPE_CHECKING:
    from ..metrics import PRCurve, RetrievalReport

__all__ = ["RunEnding"]


class RunEnding:
    """The end of one run: the result, the early end's reason, and the abnormal ends.

    Args:
        loop: the run's steps (their progress is read: ``step``, ``in_step``, ...).
        store: the run's store (its folder, checkpoints and record are read).
        stop_control: the run's stop (told when the outcome is saved).
        save_checkpoint: writes ``last.pt`` with the state after the current step.
        world_size: the run's processes (with several, a data error keeps the last checkpoint).
        loss_name: the loss's name in messages.
        activity: what messages call the run (``"training"``, ``"pretraining"``).
        resume_hint: how messages say to resume in Python (default: from the store).

    Attributes:
        stopped_early: the reason of a normal early end (``None``: none), also once resumed.

    Example:
        An interruption of a run without a folder says that nothing was saved:

        >>> loop = FitLoop(4, 4, 2, None, None, None, None, StopControl())
        >>> ending = RunEnding(loop, RunStore(None), StopControl(), lambda: Path())
        >>> str(ending.interrupted()).split(":")[0]
        'training interrupted (Ctrl-C) at step 0/4'
    """

    def __init__(
        self,
        loop: FitLoop,
        store: RunStore,
        stop_control: StopControl,
        save_checkpoint: Callable[[], Path],
        *,
        world_size: int = 1,
        loss_name: str = "loss",
        activity: str = "training",
        resume_hint: str | None = None,
        step_record: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.loop = loop
        self.store = store
        self.stop_control = stop_control
        self._save_checkpoint = save_checkpoint
        self.world_size = world_size
        self.loss_name = loss_name
        self.activity = activity
        self._resume_hint = resume_hint
        self._step_record = step_record  # the optimizer step's counts (skipped fp16 steps)
        self.stopped_early: str | None = None

    # -- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{"stopped_early": reason}`` after a normal early end, else ``{}`` (checkpoint keys)."""
        return {} if self.stopped_early is None else {"stopped_early": self.stopped_early}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a checkpoint's state (:meth:`state_dict`'s keys, absent when none)."""
        self.stopped_early = state.get("stopped_early")

    @property
    def resume_hint(self) -> str:
        """How to resume in Python (the interruption's ``resume_hint``)."""
        if self._resume_hint is not None:
            return self._resume_hint
        if self.store.record is not None:
            return f"Trainer.from_run_dir({str(self.store.root)!r})"
        return "Trainer(<the same objects>, run_dir=..., resume=True)"

    def resumed_end(self) -> LoopEnd | None:
        """The end a resumed run already reached (``None``: it has steps to train)."""
        if self.stopped_early is None:
            return None
        return LoopEnd("stopped_early", reason=self.stopped_early)

    # -- the normal ends ------------------------------------------------------------------------

    def result(
        self,
        status: str,
        selection: Any = None,
        test: RetrievalReport | None = None,
        curve: PRCurve | None = None,
        test_data: Any = None,
    ) -> RunResult:
        """The :class:`RunResult` of the steps done (``"completed"`` after an early end: ``"stopped_early"``).

        ``selection`` is the model selection (its ``best_step`` / ``best_val``; ``None``: none);
        ``test_data`` with ``categories`` (a table's column) adds the test mAP per category.
        """
        if status == "completed" and self.stopped_early is not None:
            status = "stopped_early"
        categories = getattr(test_data, "categories", None)
        per_category = (
            None
            if test is None or categories is None
            else per_category_map(test.per_query_ap, categories)
        )
        return RunResult(
            run_dir=self.store.root,
            status=status,
            stop_reason=self.stopped_early,
            steps=self.loop.step,
            seconds=self.loop.seconds,
            best_step=None if selection is None else selection.best_step,
            best_val=None if selection is None else selection.best_val,
            test=test,
            pr_curve=curve,
            config={} if self.store.record is None else dict(self.store.record),
            test_per_category=per_category,
            overflow_steps=None
            if self._step_record is None
            else self._step_record().get("overflow_steps"),
        )

    def stop_early(self, reason: str | None) -> None:
        """A callback ended the run normally: note why and checkpoint it (a resumed run is finished)."""
        self.stopped_early = reason
        if self.store.root is not None:
            self._save_checkpoint()

    def stopped(self, selection: Any = None) -> RunResult:
        """The ``max_steps`` of a ``fit`` were reached: checkpoint, ``status="stopped"``.

        Args:
            selection: the model selection (see :meth:`result`).

        Returns:
            The result.
        """
        if self.store.root is not None and self.store.last_step != self.loop.step:
            self._save_checkpoint()
        result = self.result("stopped", selection)
        if self.store.root is not None:
            self.stop_control.saved("stopped", self.store.root, self.loop.step)
        return result

    def completed(self) -> None:
        """The run is complete (its outcome saved or being saved): a signal now loses nothing."""
        if self.store.root is not None:
            outcome = "completed" if self.stopped_early is None else "stopped_early"
            self.stop_control.saved(outcome, self.store.root, self.loop.step)

    # -- the abnormal ends ----------------------------------------------------------------------

    @contextlib.contextmanager
    def failures(
        self, on_failure: Callable[[NonFiniteLossError], None], during: Callable[[], str]
    ) -> Iterator[None]:
        """Turn what stops the steps inside into the run's errors.

        A ``KeyboardInterrupt`` (a second signal, a callback's raise) becomes
        :meth:`interrupted`, a :class:`DataError` :meth:`data_failed` (``during()`` names the
        part of the run); a :class:`NonFiniteLossError` is passed to ``on_failure`` and raised.
        """
        try:
            yield
        except KeyboardInterrupt as exc:
            signum = signal_number_of(exc, self.stop_control.signal or signal.SIGINT)
            raise self.interrupted(signum) from None
        except DataError as exc:
            raise self.data_failed(exc, during()) from None
        except NonFiniteLossError as exc:
            on_failure(exc)
            raise

    def interrupted(self, signal_number: int = signal.SIGINT) -> TrainingInterrupted:
        """The interruption by ``signal_number``, after saving the state of a complete step.

        Returns:
            The :class:`TrainingInterrupted` to raise, saying what is kept.
        """
        step, last = self.loop.step, self.store.last_step
        if self.store.root is None:
            detail = "nothing was saved (the trainer has no run_dir)"
        elif not self.loop.in_step:
            if last != step:
                self._save_checkpoint()
            detail = f"checkpoint saved at step {step}"
        elif last is not None:
            detail = f"step {step + 1} was cut short, so the checkpoint of step {last} is kept"
        else:
            detail = "no checkpoint had been written yet; start the run again"
        where = f"at step {step}/{self.loop.total_steps}: {detail}"
        return TrainingInterrupted(
            f"{self.activity} interrupted ({signal_label(signal_number)}) {where}",
            step,
            self.store.root,
            self.store.last_step,
            self.resume_hint,
            signal_number=signal_number,
            detail=where,
        )

    def data_failed(self, exc: DataError, during: str) -> TrainingDataError:
        """A data file could not be read: stop like an interruption, with the state saved.

        Nothing of the step being loaded was applied, and an evaluation cut short is marked to
        run again on resume, so the state of the loop's step is complete: it is checkpointed (in
        one process; with several, the other ranks are not at this point, so the last
        checkpoint is kept and torchrun ends the job).

        Returns:
            The :class:`TrainingDataError` to raise (``during``: ``"training"``, ...).
        """
        step = self.loop.step
        if self.store.root is not None and self.world_size == 1 and self.store.last_step != step:
            self._save_checkpoint()
        return TrainingDataError(
            DataError.one_line(exc),
            step=step,
            total_steps=self.loop.total_steps,
            run_dir=self.store.root,
            checkpoint_step=self.store.last_step,
            resume_hint=self.resume_hint,
            during=during,
        )

    def non_finite(self, loss: torch.Tensor | None) -> NonFiniteLossError:
        """The loss (``None``: the model's embeddings) of the next step is NaN/inf; not applied.

        Returns:
            The :class:`NonFiniteLossError` to raise.
        """
        what = (
            f"the loss is {float(loss.detach())}"
            if loss is not None
            else "the model's embeddings contain NaN/inf"
        )
        fix = "optimizer.lr" if self.store.record is not None else "the learning rate"
        step = self.loop.step + 1
        message = (
            f"{what} at step {step} (epoch {self.loop.next_epoch}, loss {self.loss_name}); "
            f"training stopped without applying that step and {self.store.kept_message()}. "
            f"Lower {fix} or check the loss parameters."
        )
        error = "non-finite loss" if loss is not None else "non-finite embeddings"
        record = {"kind": "error", "step": step, "error": error}
        return NonFiniteLossError(message, step, self.store.last_good_checkpoint, record)
