"""`rankwise experiment list` and `rankwise experiment NAME` through typer's CliRunner."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.experiments import REGISTRY, get_experiment

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["experiment", *map(str, args)])


def test_list_names_every_experiment():
    result = _run("list")
    assert result.exit_code == 0, result.output
    for name in REGISTRY:
        assert name in result.output


def test_help_lists_the_options():
    result = _run("auc-slope", "--help")
    assert result.exit_code == 0
    for flag in ("--output", "--overwrite", "--quick", "--seed", "--delta-s", "--figure-delta-s"):
        assert flag in result.output


def test_help_says_what_an_interruption_keeps_before_it_starts():
    for name in REGISTRY:
        said = " ".join(_run(name, "--help").output.split())
        assert "Ctrl-C / SIGTERM (exit 130 / 143) keep nothing" in said, name
        assert "a line at least every 10 s" in said, name


def test_long_experiments_report_their_parts_as_lines(tmp_path, monkeypatch):
    """Without a terminal, a line each time a part finishes 10 s after the previous line; here
    every part (interval 0), through the command line's display of hash-euclidean-ndcg."""
    from rankwise.commands import experiment as command

    original = command.ProgressDisplay.__init__

    def every_part(self, name, console, every=10.0):
        original(self, name, console, every=0.0)

    monkeypatch.setattr(command.ProgressDisplay, "__init__", every_part)
    result = _run("hash-euclidean-ndcg", "--quick", "--dataset", "digits", "-o", tmp_path)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "parts done" in line]
    # one code length x 6 methods; the last part is followed by the verdict, not a line
    assert [line.split(" parts done")[0] for line in lines] == [
        f"hash-euclidean-ndcg: {k}/6" for k in range(1, 6)
    ]
    assert "last dpsh 16 bits;" in lines[2]


def test_run_writes_json_and_png_and_prints_one_verdict_line(tmp_path):
    out = tmp_path / "res.json"
    result = _run("auc-slope", "--quick", "--delta-s", "0.1,0.2", "--output", out)
    assert result.exit_code == 0, result.output
    # first, at once (stderr): what runs and where (issue 40)
    first = f"rankwise experiment auc-slope: {get_experiment('auc-slope').spec.summary} -> {out}"
    lines = result.output.strip().splitlines()
    assert " ".join(lines[0].split()) == " ".join(first.split())
    assert lines[1].startswith("auc-slope: Table 1 within 1% for Δs 0.1")
    assert lines[2] == f"wrote {out} and {out.with_suffix('.png')}"
    payload = json.loads(out.read_text())
    assert [row["delta_s"] for row in payload["rows"]] == [0.1, 0.2]
    assert payload["verdict"] == lines[1]

    again = _run("auc-slope", "--quick", "--delta-s", "0.2", "--output", out)
    assert again.exit_code == 2
    # the command line names its flags (the Python names were shown beside them: issue 30)
    assert again.output.strip().splitlines()[-1] == (
        f"error: {out} exists; pass --overwrite to replace it, or choose another --output."
    )
    assert json.loads(out.read_text()) == payload  # untouched
    replaced = _run("auc-slope", "--quick", "--delta-s", "0.2", "--output", out, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert [row["delta_s"] for row in json.loads(out.read_text())["rows"]] == [0.2]


def test_negative_values_of_a_list_option_parse(tmp_path):
    result = _run(
        "auc-slope", "--quick", "--delta-s", "0.5", "--score-range", "-2,2", "-o", tmp_path
    )
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "auc-slope.json").read_text())["score_range"] == [-2.0, 2.0]


def test_bad_options_are_one_line_errors_with_exit_2(tmp_path):
    cases = [
        (
            ("--delta-s", "0.1,abc"),
            "error: --delta-s must be comma-separated numbers, got '0.1,abc'.",
        ),
        (("--delta-s", "3"), "error: --delta-s must be a finite number in (0, 2), got 3.0."),
        (("--seed", "-1"), "error: --seed must be an integer >= 0, got -1."),
        (("--score-range", "1,0"), "error: --score-range must be a pair (low, high)"),
    ]
    for args, message in cases:
        result = _run("auc-slope", "--quick", *args, "--output", tmp_path)
        assert result.exit_code == 2, (args, result.output)
        # the line saying what runs (issue 40), then the one-line error
        announced, error = result.output.strip().splitlines()
        assert announced.startswith("rankwise experiment auc-slope: ")
        assert error.startswith(message), result.output
    assert not list(tmp_path.iterdir())  # nothing written by failed runs
    assert _run("auc-slope", "--output", tmp_path / "x.png").exit_code == 2


def test_unknown_experiment_and_option_exit_2():
    assert _run("nope").exit_code == 2
    result = _run("auc-slope", "--bogus", "1")
    assert result.exit_code == 2 and "--bogus" in result.output


def test_sigterm_is_an_interrupt_with_exit_143_and_nothing_written(tmp_path):
    import os
    import signal

    import typer

    from rankwise.commands.experiment import _make_command
    from rankwise.experiments import ExperimentResult, experiment

    @experiment("terminated", summary="Sends itself SIGTERM.", reference="none")
    def run(*, quick: bool = False, seed: int = 0):
        """Toy.

        Args:
            quick: Unused.
            seed: Unused.
        """
        os.kill(os.getpid(), signal.SIGTERM)
        return ExperimentResult("terminated", {}, "terminated: never", True)

    import rankwise.commands.experiment as module

    app = typer.Typer()
    original = module.get_experiment
    module.get_experiment = lambda name: run
    try:
        app.command("terminated")(_make_command(run.spec))
        app.command("other")(lambda: None)  # two commands: typer keeps the sub-command name
    finally:
        module.get_experiment = original
    previous = signal.getsignal(signal.SIGTERM)
    result = runner.invoke(app, ["terminated", "--output", str(tmp_path)])
    assert result.exit_code == 143, result.output  # 128 + SIGTERM, as a shell reports it
    assert "experiment terminated interrupted (SIGTERM); nothing written." in result.output
    assert not list(tmp_path.iterdir())
    assert signal.getsignal(signal.SIGTERM) is previous  # the handler is restored
