"""Sweeps lose no work (issue 14, items 7, 8, 14, 19): `bench` / `tune` refuse an output that
holds results unless resumed or overwritten, an interrupted sweep keeps its partial table and
resumes (finished runs kept, the interrupted one from its checkpoint), progress shows as plain
lines without a terminal, and one-seed tables print no spread."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.reporting import bench_table_markdown
from rankwise.training import ConfigError, Trainer, TrainingInterrupted, config_from_dict
from rankwise.training.bench import run_bench
from rankwise.training.tune import tune

BASE = {
    "dataset": {"name": "digits"},
    "model": {"backbone": "small_cnn", "embedding_dim": 8},
    "loss": {"name": "auc", "params": {}},
    "sampler": {"m": 4, "batch_size": 20},
    "optimizer": {"name": "adam", "lr": 1e-3},
    "budget": {"iterations": 4},
    "eval_every": 2,
    "eval_ks": [1, 10],
    "threads": 1,
    "progress": False,
}


def quiet():
    return Console(file=io.StringIO(), width=200)


def interrupt_run(monkeypatch, run_number, at_step):
    """Make the `run_number`-th run of the sweep (1-based) raise Ctrl-C after `at_step`."""
    original = Trainer.fit

    def fit(self, **kwargs):
        if self.name.startswith(f"[{run_number}/"):

            def ctrl_c(trainer):
                if trainer.step == at_step:
                    raise KeyboardInterrupt

            kwargs["callbacks"] = [*kwargs.get("callbacks", ()), ctrl_c]
        return original(self, **kwargs)

    monkeypatch.setattr(Trainer, "fit", fit)


def test_bench_refuses_an_output_with_results_and_resumes_an_interrupted_sweep(
    tmp_path, monkeypatch
):
    out = tmp_path / "bench"
    options = dict(losses=["auc", "triplet"], seeds=[0], output=out, console=quiet())
    interrupt_run(monkeypatch, 2, 2)
    with pytest.raises(TrainingInterrupted) as info:
        run_bench(BASE, **options)
    assert "1 of 2 runs finished" in str(info.value)
    partial = json.loads((out / "bench.json").read_text())  # the finished run is kept
    assert partial["complete"] is False and partial["runs_finished"] == 1
    assert [row["loss"] for row in partial["rows"]] == ["auc"]
    assert "PARTIAL: 1 of 2 runs finished" in (out / "bench.md").read_text()
    first_report = (out / "auc" / "seed0" / "report.json").read_text()
    assert json.loads((out / "triplet" / "seed0" / "metrics.jsonl").read_text().splitlines()[0])

    # a fresh sweep into the same folder is refused: nothing is replaced silently
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="already holds results.*`resume`.*`overwrite`"):
        run_bench(BASE, **options)
    assert json.loads((out / "bench.json").read_text()) == partial

    console = Console(file=io.StringIO(), width=200)
    summary = run_bench(BASE, **{**options, "console": console}, resume=True)
    assert summary["complete"] is True and summary["runs_finished"] == 2
    assert (out / "auc" / "seed0" / "report.json").read_text() == first_report  # kept
    log = console.file.getvalue()
    assert "kept" in log and "resumed" in log
    metrics = (out / "triplet" / "seed0" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in metrics if json.loads(r)["kind"] == "val"] == [2, 4]

    # --overwrite starts afresh: the previous runs are gone before the new sweep writes
    summary = run_bench(BASE, **{**options, "losses": ["auc"]}, overwrite=True)
    assert [row["loss"] for row in summary["rows"]] == ["auc"]
    assert not (out / "triplet").exists()


def test_bench_command_names_overwrite_and_resume(tmp_path):
    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(BASE))
    out = tmp_path / "b"
    args = ["bench", "--config", str(config), "--losses", "auc", "--seeds", "1", "-o", str(out)]
    assert runner_invoke(args).exit_code == 0
    result = runner_invoke(args)
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "--resume" in text and "--overwrite" in text
    result = runner_invoke(["bench", "--resume", str(out)])
    assert result.exit_code == 0, result.output
    assert "kept" in result.output


def runner_invoke(args):
    return CliRunner().invoke(app, args)


def test_tune_refuses_an_output_with_results(tmp_path):
    out = tmp_path / "tune"
    options = dict(losses=["auc"], grid={"optimizer.lr": [1e-3]}, seeds=[0], output=out)
    tune(BASE, **options, console=quiet())
    before = (out / "tune.json").read_text()
    with pytest.raises(ConfigError, match="already holds results"):
        tune(BASE, **options, console=quiet())
    assert (out / "tune.json").read_text() == before
    again = tune(BASE, **options, console=quiet(), resume=True)
    assert again["complete"] is True and "tie_rule" in again


def test_progress_prints_plain_lines_without_a_terminal(tmp_path):
    buffer = io.StringIO()
    console = Console(file=buffer, width=200, force_terminal=False)
    config = config_from_dict({**BASE, "progress": None, "output_dir": str(tmp_path / "r")})
    Trainer.from_config(config, console=console).fit()
    lines = [line for line in buffer.getvalue().splitlines() if ": step " in line]
    assert any("step 2/4" in line and "val mAP" in line for line in lines), buffer.getvalue()
    assert any("step 4/4" in line for line in lines)


def test_one_seed_tables_print_no_spread():
    row = {
        "loss": "auc",
        "label": "auc",
        "seeds": [0],
        "seconds": 1.0,
        **{f"{k}_mean": 0.5 for k in ("map", "recall_at_1", "recall_at_10", "map_at_r")},
        **{f"{k}_std": 0.0 for k in ("map", "recall_at_1", "recall_at_10", "map_at_r")},
    }
    reference = {**row, "loss": "input (no training)", "label": "input (no training)", "seeds": []}
    summary = {
        "dataset": "digits",
        "protocol": "open-set",
        "seeds": [0],
        "rows": [row],
        "reference_rows": [reference],
    }
    text = bench_table_markdown(summary)
    assert "±" not in text.split("|---")[1] and "one seed, so no spread is shown" in text


def test_an_interrupted_bench_says_what_was_interrupted_once(tmp_path, monkeypatch):
    """Issue 30: the message read `bench interrupted: bench interrupted in run ...: training
    interrupted (Ctrl-C) ...; 0 of 2 runs finished (their rows are in bench.json ...)`."""
    import yaml

    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(BASE))
    interrupt_run(monkeypatch, 1, 2)
    args = ["bench", "--config", str(config), "--losses", "auc,triplet", "--seeds", "1"]
    result = CliRunner().invoke(app, [*args, "--output", str(tmp_path / "out")])
    assert result.exit_code == 130, result.output
    said = " ".join(result.output.split())
    assert (
        "bench interrupted (Ctrl-C) in run auc seed 0 at step 2/4: checkpoint saved at step 2; "
        "no run had finished. Resume with: rankwise bench --resume"
    ) in said, said
    assert said.count(" interrupted") == 1 and "interrupted:" not in said, said
