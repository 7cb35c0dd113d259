"""The StopControl alone: the one signal handler of a run (stop after the step, abort on a second
signal, finish in peace once the outcome is saved) and the processes' agreement to stop, in one
process and against a fake two-process run."""

from __future__ import annotations

import io
import os
import signal

import pytest
from rich.console import Console

from rankwise.training import StopControl, TrainingInterrupted


def quiet():
    return Console(file=io.StringIO(), width=300)


def said(control):
    return " ".join(control.console.file.getvalue().split())


def test_a_requested_stop_is_agreed_by_one_process():
    control = StopControl()
    assert not control.requested and not control.agree()
    control.request()
    assert control.requested and control.agree()
    control.start()  # a new fit forgets it
    assert not control.requested


def test_the_ranks_stop_together_when_any_of_them_asks(two_ranks):
    strategy = two_ranks(0, other_stop=True)
    control = StopControl(strategy)
    assert control.agree() and control.requested  # rank 1's request reaches rank 0
    assert strategy.calls == [("any_rank", False)]
    calm = two_ranks(1)
    assert not StopControl(calm).agree() and calm.calls == [("any_rank", False)]


@pytest.mark.parametrize(
    ("signum", "hint"), [(signal.SIGINT, "Ctrl-C again"), (signal.SIGTERM, "another SIGTERM")]
)
def test_a_signal_during_the_steps_stops_after_the_step_and_a_second_aborts(signum, hint):
    before = signal.getsignal(signum)
    control = StopControl(console=quiet(), saving=True)
    with control.handling(), control.during_steps():
        os.kill(os.getpid(), signum)
        assert control.requested and control.signal == signum
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signum)
    text = said(control)
    assert "stopping after this step and saving a checkpoint" in text and hint in text
    assert signal.getsignal(signum) is before


def test_a_signal_outside_the_steps_raises_at_once():
    control = StopControl(console=quiet())
    with pytest.raises(KeyboardInterrupt), control.handling():
        os.kill(os.getpid(), signal.SIGTERM)
    assert not control.requested and said(control) == ""


def test_once_the_outcome_is_saved_a_signal_lets_the_work_finish(tmp_path):
    control = StopControl(console=quiet())
    finished = []
    with control.handling():
        control.saved("completed", tmp_path, 8)
        os.kill(os.getpid(), signal.SIGTERM)
        finished.append(True)  # the finishing work goes on
    assert finished and "SIGTERM after the run completed: nothing is lost" in said(control)


def test_a_second_signal_after_the_outcome_aborts_naming_what_is_kept(tmp_path):
    control = StopControl(console=quiet())
    with pytest.raises(TrainingInterrupted) as info, control.handling():
        control.saved("stopped", tmp_path, 4)
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
    exc = info.value
    assert exc.exit_code == 130 and exc.step == 4 and exc.checkpoint_step is None
    assert str(exc) == (
        f"Ctrl-C: aborted after the run stopped; what it saved is kept in {tmp_path} "
        "(plots may be missing)."
    )


def test_nested_blocks_share_one_handler():
    control = StopControl(console=quiet())
    with control.handling():
        outer = signal.getsignal(signal.SIGINT)
        with control.handling():
            assert signal.getsignal(signal.SIGINT) is outer
        assert signal.getsignal(signal.SIGINT) is outer  # the inner block restored nothing
