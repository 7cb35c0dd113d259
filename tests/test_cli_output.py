"""What a long command shows without a terminal (issue 40, item 8): `rankwise train` says what it
runs and its run folder first, before torch loads; a status line at least every 10 s; a warning
as one `warning: ...` line without a file and line number; a result table readable at 80 columns.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from rich.console import Console

from rankwise.metrics import retrieval_metrics
from rankwise.reporting import report_table
from rankwise.training.callbacks import ProgressBar
from rankwise.training.callbacks.base import StepOutput

SRC = Path(__file__).resolve().parents[1] / "src"


def test_train_through_a_pipe_says_what_runs_and_where_first_and_warnings_in_one_line(
    tmp_path, tiny_config
):
    # the tiny run with m = 200: more than any class holds (the sampler warns)
    # (no output_dir: the default folder, runs/<dataset>/<loss>-seed<seed>)
    data = tiny_config.data(
        **{"sampler.m": 200, "sampler.batch_size": 400, "budget.iterations": 2, "eval_every": 2},
        progress=None,  # as a user runs it: lines without a terminal
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "80"}
    env.pop("PYTHONWARNINGS", None)
    done = subprocess.run(
        [sys.executable, "-m", "rankwise", "train", "-c", "c.yaml", "seed=3"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=600,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout
    # first: the loss, the data, the budget and the run folder, before any step or warning
    loss, dataset = data["loss"]["name"], data["dataset"]["name"]
    folder = Path("runs") / dataset / f"{loss}-seed3"
    assert (
        lines[0] == f"rankwise train: {loss} on {dataset}, 2 steps, seed 3 -> run folder {folder}"
    )
    assert lines[-3] == f"run directory: {folder}"  # the folder it announced is the real one
    steps = [i for i, line in enumerate(lines) if ": step " in line]
    assert steps and steps[0] > 0
    # the sampler's warning: one line, the message only (no path, line number or category)
    (warning,) = [line for line in lines if "fewer than m=200" in line]
    assert warning.startswith("warning: MPerClassBatchSampler: ")
    assert "UserWarning" not in done.stdout and ".py:" not in done.stdout


def test_a_status_line_comes_at_least_every_10_s_without_a_terminal(monkeypatch):
    out = io.StringIO()
    trainer = SimpleNamespace(
        console=Console(file=out, force_terminal=False, width=200),
        name="soprc on digits",
        total_steps=100,
        step=0,
        best_val=None,
        best_step=None,
        monitor="map",  # the TrainerView field the progress line names (issue 37)
    )
    clock = {"now": 0.0}
    monkeypatch.setattr(
        "rankwise.training.callbacks.progress.time.perf_counter", lambda: clock["now"]
    )
    bar = ProgressBar(log_every=10)
    bar.on_fit_start(trainer)
    for step in range(1, 101):
        clock["now"] = step * 1.0  # a step a second, no evaluation: only the timer prints
        bar.on_train_step_end(trainer, StepOutput(step, 0, step - 1, 0.5, 1e-3, 20))
    bar.on_train_end(trainer)
    printed = [line for line in out.getvalue().splitlines() if line.strip()]
    assert all(line.startswith("soprc on digits: step ") for line in printed)  # plain, no bar
    seen = [int(line.split("step ")[1].split("/")[0]) for line in printed]
    assert seen[0] <= 10 and max(b - a for a, b in zip([0, *seen], seen, strict=False)) <= 10


def test_the_test_table_reads_at_80_columns():
    torch.manual_seed(0)
    report = retrieval_metrics(torch.randn(300, 8), torch.randint(0, 200, (300,)), ks=(1, 10))
    title = "Test results of the model selected on validation mAP (step 300 of 400)"
    out = io.StringIO()
    Console(file=out, width=80, force_terminal=False).print(report_table(report, title=title))
    lines = out.getvalue().splitlines()
    assert lines[0] == title  # one line, not wrapped to the two-column table's width
    caption = lines[lines.index(next(x for x in lines if x.startswith("└"))) + 1 :]
    assert caption[0].startswith("300 queries x 300 gallery items; ")
    assert len([x for x in caption if x.strip()]) <= 2
    assert max(len(x) for x in lines) <= 80


def test_bench_and_tune_say_what_runs_and_where_first(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rankwise.cli import app

    monkeypatch.chdir(tmp_path)
    args = ["bench", "--dataset", "digits", "--ablation", "--seeds", "1", "budget.iterations=2"]
    result = CliRunner().invoke(app, [*args, "eval_every=2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    folder = Path("runs") / "bench" / "digits-ablation"
    assert lines[0] == f"rankwise bench: SOPRC ablation (Table 2) on digits -> {folder}"
    assert f"results: {folder / 'bench.json'}" in result.output  # the folder it announced
    # a sweep that fails on its options has said what it was to run first
    args = ["tune", "--dataset", "digits", "--grid", "optimizer.lr=0.001", "--losses", "nope"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = result.output.splitlines()
    assert lines[
        0
    ] == "rankwise tune: hyper-parameter selection on validation mAP on digits -> " + str(
        Path("runs") / "tune" / "digits"
    )
