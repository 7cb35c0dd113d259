"""The shared command-line plumbing: one set of exit codes, library errors rewritten into flags,
`python -m rankwise` as the `rankwise` script, the sub-command registry, and a missing extra
reported with the install command."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from rankwise import cli
from rankwise._extras import MissingDependencyError, require
from rankwise.commands import COMMANDS
from rankwise.commands.common import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_MISSING_DEPENDENCY,
    cli_errors,
    to_flags,
)


def test_to_flags_rewrites_backticked_names_and_the_leading_key():
    flags = {"losses": "--losses", "run_dir": "--resume"}
    assert to_flags("bench: choose losses with `losses`.", flags) == (
        "bench: choose losses with --losses."
    )
    assert to_flags("run_dir: '/x' is not a run directory", flags) == (
        "--resume: '/x' is not a run directory"
    )
    # names the command has no flag for, and plain words, are left alone
    assert (
        to_flags("`tau1` must be > 0; losses differ", flags) == "`tau1` must be > 0; losses differ"
    )


def test_every_registered_command_is_in_the_app_in_order():
    app = cli.build_app()
    commands = [command.name for command in app.registered_commands]
    groups = [group.name for group in app.registered_groups]  # e.g. `rankwise experiment ...`
    assert sorted(commands + groups) == sorted(COMMANDS)
    assert commands == [name for name in COMMANDS if name not in groups]
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in COMMANDS:
        assert name in result.output


def test_python_dash_m_rankwise_is_the_rankwise_program():
    result = subprocess.run(
        [sys.executable, "-m", "rankwise", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "Usage: rankwise" in result.stdout
    for name in COMMANDS:
        assert name in result.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "rankwise", "train", "--config", "/nonexistent.yaml"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == EXIT_CONFIG
    assert "config error:" in bad.stderr and "'/nonexistent.yaml' does not exist" in bad.stderr


def run_handler(exc: BaseException, what: str = "training", flags=None):
    app = typer.Typer()

    @app.command()
    def boom() -> None:
        with cli_errors(what, flags):
            raise exc

    return CliRunner().invoke(app, [])


def test_errors_map_to_the_shared_exit_codes():
    from rankwise.training import ConfigError, NonFiniteLossError

    result = run_handler(ConfigError("`losses` names a loss twice"), flags={"losses": "--losses"})
    assert result.exit_code == EXIT_CONFIG
    assert "config error: --losses names a loss twice" in result.output
    result = run_handler(NonFiniteLossError("the loss is nan at step 3", 3, None), what="bench")
    assert result.exit_code == EXIT_FAILED and "bench failed: the loss is nan" in result.output
    missing = MissingDependencyError("x needs typer; pip install 'rankwise[cli]'", "cli", ["typer"])
    result = run_handler(missing)
    assert result.exit_code == EXIT_MISSING_DEPENDENCY and "rankwise[cli]" in result.output
    # a bug is not an exit code: its traceback propagates
    result = run_handler(RuntimeError("bug"))
    assert isinstance(result.exception, RuntimeError)


def test_interrupted_runs_exit_130_with_the_resume_command(tmp_path):
    from rankwise.training import TrainingInterrupted

    exc = TrainingInterrupted("training interrupted at step 3/6", 3, tmp_path, 3)
    result = run_handler(exc)
    assert result.exit_code == EXIT_INTERRUPTED
    assert f"rankwise train --resume {tmp_path}" in result.output.replace("\n", "")


def test_under_torchrun_the_resume_commands_are_torchrun_commands(tmp_path, monkeypatch):
    """Issue 19 item 9: a 2-process run resumes only with 2 processes, so a plain `rankwise
    train --resume` (refused: the checkpoint's world size differs) is the wrong advice."""
    from rankwise.training import TrainingInterrupted
    from rankwise.training.errors import CorruptCheckpointError

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    launcher = "torchrun --nproc-per-node 2 -m rankwise train --resume"
    exc = TrainingInterrupted("training interrupted (SIGTERM) at step 3/6", 3, tmp_path, 3)
    result = run_handler(exc)
    assert f"Resume with: {launcher} {tmp_path}" in result.output.replace("\n", "")
    previous = tmp_path / "checkpoints" / "previous.pt"
    corrupt = CorruptCheckpointError(
        tmp_path / "checkpoints" / "last.pt", "truncated", run_dir=tmp_path, fallback=previous
    )
    result = run_handler(corrupt)
    assert f"{launcher} {tmp_path} --from-checkpoint {previous}" in result.output.replace("\n", "")


def test_require_names_the_extra_to_install():
    with pytest.raises(
        MissingDependencyError, match=r"pip install 'rankwise\[baselines\]'"
    ) as info:
        require(("json", "no_such_module_xyz"), "baselines", "the baselines")
    assert info.value.extra == "baselines" and info.value.missing == ("no_such_module_xyz",)


def test_the_script_says_which_extra_to_install_when_typer_is_missing(monkeypatch, capsys):
    def missing() -> None:
        raise MissingDependencyError(
            "the rankwise command line needs typer; pip install 'rankwise[cli]'", "cli", ["typer"]
        )

    monkeypatch.setattr(cli, "_app", None)
    monkeypatch.setattr(cli, "build_app", missing)
    with pytest.raises(SystemExit) as info:
        cli.main(["--help"])
    assert info.value.code == EXIT_MISSING_DEPENDENCY
    assert "pip install 'rankwise[cli]'" in capsys.readouterr().err
