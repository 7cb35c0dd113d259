"""No lost work (issue 14, items 7, 9, 10, 12, 17): SIGTERM is handled like Ctrl-C, a corrupt
checkpoint is reported as such (with the older good one and the command that resumes from it,
never torch's advice to unpickle unsafely), a run directory holding results is never written
into silently, a folder holding one run resumes it, and result files get the user's umask."""

from __future__ import annotations

import io
import json
import os
import signal
import stat

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.commands.common import cli_errors
from rankwise.training import (
    ConfigError,
    PlotCurves,
    Trainer,
    TrainingInterrupted,
    load_checkpoint,
)
from rankwise.training.errors import CorruptCheckpointError

runner = CliRunner()


@pytest.fixture
def stopped_run(tmp_path, tiny_config):
    """A run stopped at step 6: last.pt at step 6, previous.pt at step 4."""
    run_dir = tmp_path / "runs" / "digits" / "auc-seed0"
    result = Trainer.from_config(tiny_config(run_dir)).fit(max_steps=6)
    assert result.status == "stopped"
    return run_dir


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_exit_143(tmp_path, tiny_config):
    run_dir = tmp_path / "run"

    def terminate(trainer):
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # what timeout, SLURM and docker send

    with pytest.raises(TrainingInterrupted) as info:
        Trainer.from_config(tiny_config(run_dir)).fit(callbacks=[terminate])
    exc = info.value
    assert exc.signal_number == signal.SIGTERM and exc.exit_code == 143
    assert "SIGTERM" in str(exc) and exc.checkpoint_step == 3
    # without the handler, last.pt would be the periodic checkpoint of step 2
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 3
    assert Trainer.from_run_dir(run_dir).fit().status == "completed"


@pytest.mark.parametrize(
    ("signum", "said", "not_said"),
    [
        (signal.SIGTERM, "another SIGTERM aborts at once", "Ctrl-C"),
        (signal.SIGINT, "Ctrl-C again", ""),
    ],
    ids=["sigterm", "ctrl-c"],
)
def test_the_stop_message_offers_the_signal_that_was_sent(
    tmp_path, signum, said, not_said, tiny_config
):
    """Issue 19 item 9: "Ctrl-C again aborts" is the hint of Ctrl-C, not of a scheduler's SIGTERM."""
    console = Console(file=io.StringIO(), width=300)

    def stop(trainer):
        if trainer.step == 1:
            os.kill(os.getpid(), signum)

    with pytest.raises(TrainingInterrupted):
        Trainer.from_config(tiny_config(tmp_path / "run"), console=console).fit(callbacks=[stop])
    text = console.file.getvalue()
    assert "stopping after this step" in text and said in text, text
    assert not_said == "" or not_said not in text, text


def test_sigterm_after_the_run_completed_keeps_its_results_and_exits_0(
    tmp_path, monkeypatch, tiny_config
):
    """Issue 19 item 9: a SIGTERM that arrives once report.json says "completed" (while the plots
    are drawn, or the table printed) does not turn a finished run into an interrupted one."""
    run_dir = tmp_path / "run"
    config_path = tmp_path / "c.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config.data(budget={"iterations": 2})))
    draw = PlotCurves.on_fit_end

    def sigterm_while_plotting(self, trainer, result):
        os.kill(os.getpid(), signal.SIGTERM)
        draw(self, trainer, result)

    monkeypatch.setattr(PlotCurves, "on_fit_end", sigterm_while_plotting)
    args = ["train", "-c", str(config_path), "--output", str(run_dir)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((run_dir / "report.json").read_text())["status"] == "completed"
    assert (run_dir / "pr_curve.png").is_file()  # the plots were finished
    text = " ".join(result.output.split())
    assert "SIGTERM after the run completed: nothing is lost" in text and "Test results" in text

    # the same signal while the result table is printed, after fit returned
    monkeypatch.undo()
    from rankwise import reporting

    table = reporting.report_table

    def sigterm_while_printing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return table(*args, **kwargs)

    def fail(signum, frame):  # without the fix the default handler would end pytest itself
        raise RuntimeError("SIGTERM reached no handler of the command")

    monkeypatch.setattr(reporting, "report_table", sigterm_while_printing)
    previous = signal.signal(signal.SIGTERM, fail)
    try:
        result = runner.invoke(app, [*args, "--overwrite"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.exit_code == 0, (result.output, result.exception)
    text = " ".join(result.output.split())
    assert "SIGTERM after the run completed" in text and "run directory" in text


def test_sigterm_outside_training_ends_a_command_with_143():
    import typer

    with pytest.raises(typer.Exit) as info, cli_errors("bench"):
        os.kill(os.getpid(), signal.SIGTERM)
    assert info.value.exit_code == 143


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "truncated"),
        (lambda p: p.write_bytes(b"\x80\x04junk" * 50), "not a"),
        (lambda p: p.write_bytes(b""), "empty"),
    ],
    ids=["truncated", "junk", "empty"],
)
def test_a_corrupt_last_checkpoint_names_the_older_one_and_how_to_resume(stopped_run, damage, why):
    damage(stopped_run / "checkpoints" / "last.pt")
    with pytest.raises(CorruptCheckpointError) as info:
        Trainer.from_run_dir(stopped_run)
    message = str(info.value)
    assert f"checkpoint {stopped_run / 'checkpoints' / 'last.pt'} is corrupt" in message
    assert why in message and "weights_only" not in message
    assert info.value.fallback == stopped_run / "checkpoints" / "previous.pt"
    assert info.value.fallback_step == 4

    # the command line prints the command that resumes from the older checkpoint; it works
    result = runner.invoke(app, ["train", "--resume", str(stopped_run)])
    assert result.exit_code == 2, result.output
    command = f"rankwise train --resume {stopped_run} --from-checkpoint {info.value.fallback}"
    assert command in " ".join(result.output.split())
    assert "Traceback" not in result.output and "weights_only" not in result.output
    resumed = Trainer.from_run_dir(stopped_run, checkpoint=info.value.fallback)
    assert resumed.step == 4
    assert resumed.fit().status == "completed"


def test_a_corrupt_best_checkpoint_of_a_finished_run_is_reported(stopped_run):
    Trainer.from_run_dir(stopped_run).fit()
    (stopped_run / "checkpoints" / "best.pt").write_bytes(b"junk")
    with pytest.raises(CorruptCheckpointError, match=r"best\.pt is corrupt.*Train the run again"):
        Trainer.from_run_dir(stopped_run)


def test_a_run_with_deleted_checkpoints_still_keeps_its_results(stopped_run, tiny_config):
    Trainer.from_run_dir(stopped_run).fit()
    report = (stopped_run / "report.json").read_text()
    for path in (stopped_run / "checkpoints").iterdir():
        path.unlink()
    with pytest.raises(ConfigError, match=r"already holds a run \(report\.json, metrics\.jsonl"):
        Trainer.from_config(tiny_config(stopped_run))
    config_path = stopped_run.parent / "c.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config.data()))
    result = runner.invoke(
        app, ["train", "--config", str(config_path), "--output", str(stopped_run)]
    )
    assert result.exit_code == 2 and "--overwrite" in result.output
    assert (stopped_run / "report.json").read_text() == report
    # --resume and --overwrite contradict each other: refused, not one silently ignored
    result = runner.invoke(app, ["train", "--resume", str(stopped_run), "--overwrite"])
    assert result.exit_code == 2 and "pass one of them" in result.output


def test_resume_accepts_a_folder_holding_one_run_and_lists_several(stopped_run, tiny_config):
    parent = stopped_run.parent  # runs/digits, as in the README
    assert Trainer.from_run_dir(parent).run_dir == stopped_run
    Trainer.from_config(tiny_config(parent / "auc-seed1", seed=1)).fit(max_steps=2)
    with pytest.raises(ConfigError, match="holds 2 runs") as info:
        Trainer.from_run_dir(parent)
    assert str(stopped_run) in str(info.value) and str(parent / "auc-seed1") in str(info.value)


def test_result_files_get_the_users_umask(tmp_path, tiny_config):
    old = os.umask(0o022)
    try:
        run_dir = tmp_path / "run"
        Trainer.from_config(tiny_config(run_dir, **{"budget": {"iterations": 2}})).fit()
    finally:
        os.umask(old)
    for name in ("config.yaml", "metrics.jsonl", "report.json", "checkpoints/last.pt"):
        mode = stat.S_IMODE((run_dir / name).stat().st_mode)
        assert mode == 0o644, (name, oct(mode))
    assert json.loads((run_dir / "report.json").read_text())["status"] == "completed"
