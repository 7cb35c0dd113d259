"""`rankwise train` and `rankwise bench` through typer's CliRunner on the bundled digits data:
exit codes, config errors naming their key, resume, and the exact bench.json schema."""

from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from rankwise.cli import app

runner = CliRunner()

BASE = {
    "dataset": {"name": "digits"},
    "model": {"backbone": "small_cnn", "embedding_dim": 16},
    "loss": {"name": "soprc", "params": {}},
    "sampler": {"m": 4, "batch_size": 20},
    "optimizer": {"name": "adam", "lr": 1e-3},
    "budget": {"iterations": 6},
    "eval_every": 3,
    "eval_ks": [1, 10],
    "threads": 1,
    "bench": {"quick": {"overrides": {"budget.iterations": 4, "eval_every": 2}}},
}


def write_config(tmp_path, data=BASE):
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_train_then_report(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            "--config",
            str(write_config(tmp_path)),
            "--output",
            str(out),
            "loss.name=triplet",
            "seed=1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "run directory" in result.output
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["loss"]["name"] == "triplet" and saved["seed"] == 1
    assert json.loads((out / "report.json").read_text())["steps"] == 6


def test_train_config_error_names_the_key_and_exits_2(tmp_path):
    result = runner.invoke(
        app,
        [
            "train",
            "--config",
            str(write_config(tmp_path)),
            "--output",
            str(tmp_path / "r"),
            "sampler.batch_size=30",
        ],
    )
    assert result.exit_code == 2
    assert "sampler.batch_size: 30 is not divisible by sampler.m=4" in result.output
    result = runner.invoke(
        app,
        [
            "train",
            "--config",
            str(write_config(tmp_path)),
            "--output",
            str(tmp_path / "r"),
            "loss.params.bta=1",
        ],
    )
    assert result.exit_code == 2 and "'bta'" in result.output
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_train_resume_refuses_overrides_and_finishes_a_completed_run(tmp_path):
    out = tmp_path / "run"
    assert (
        runner.invoke(
            app, ["train", "--config", str(write_config(tmp_path)), "--output", str(out)]
        ).exit_code
        == 0
    )
    refused = runner.invoke(app, ["train", "--resume", str(out), "seed=2"])
    assert refused.exit_code == 2 and "--resume" in refused.output
    again = runner.invoke(app, ["train", "--resume", str(out)])
    assert again.exit_code == 0, again.output
    # a finished run is tested again, and the command says so and how to train it on
    assert "completed its" in again.output and "--max-steps" in again.output


def test_bench_quick_writes_bench_json_with_the_exact_schema(tmp_path):
    out = tmp_path / "bench"
    result = runner.invoke(
        app,
        [
            "bench",
            "--config",
            str(write_config(tmp_path)),
            "--quick",
            "--losses",
            "triplet,soprc",
            "--seeds",
            "2",
            "--output",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "bench.json").read_text())
    assert set(summary) == {
        "dataset",
        "protocol",
        "seeds",
        "complete",
        "runs_finished",
        "runs_planned",
        "warm_up_seconds",
        "precision",
        "sub_batch_size",
        "rows",
        "reference_rows",
    }
    assert summary["precision"] == "32" and summary["sub_batch_size"] is None
    assert summary["complete"] is True and summary["runs_finished"] == 4
    assert summary["dataset"] == "digits" and summary["protocol"] == "open-set"
    assert summary["seeds"] == [0, 1]
    assert [row["loss"] for row in summary["rows"]] == ["triplet", "soprc"]
    types = {
        "loss": str,
        "map_mean": float,
        "map_std": float,
        "recall_at_1_mean": float,
        "recall_at_1_std": float,
        "seconds": float,
    }
    for row in summary["rows"]:
        for key, kind in types.items():
            assert isinstance(row[key], kind), key
        # the aggregate is the mean of the per-seed test reports written by each run
        per_seed = [
            json.loads((out / row["loss"] / f"seed{s}" / "report.json").read_text()) for s in (0, 1)
        ]
        maps = [r["test"]["map"] for r in per_seed]
        assert abs(row["map_mean"] - sum(maps) / 2) < 1e-12
        assert abs(row["map_std"] - abs(maps[0] - maps[1]) / 2**0.5) < 1e-12
        assert per_seed[0]["steps"] == 4  # the quick budget
    assert (out / "bench.md").is_file() and (out / "pr_curves.png").is_file()
    assert "pr_curves.png" in result.output


def test_bench_reports_a_bad_loss_before_training(tmp_path):
    out = tmp_path / "bench"
    result = runner.invoke(
        app,
        [
            "bench",
            "--config",
            str(write_config(tmp_path)),
            "--quick",
            "--losses",
            "triplet,nope",
            "--output",
            str(out),
        ],
    )
    assert result.exit_code == 2 and "loss.name: unknown loss 'nope'" in result.output
    assert not out.exists()


def test_bench_loss_param_override_reaches_every_run(tmp_path):
    out = tmp_path / "bench"
    result = runner.invoke(
        app,
        [
            "bench",
            "--config",
            str(write_config(tmp_path)),
            "--quick",
            "--losses",
            "auc",
            "--output",
            str(out),
            "loss.params.delta_s=0.1",
        ],
    )
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load((out / "auc" / "seed0" / "config.yaml").read_text())
    assert resolved["loss"] == {"name": "auc", "params": {"delta_s": 0.1}, "memory": None}
    # a parameter the loss does not take is a config error naming it, before training
    bad = runner.invoke(
        app,
        [
            "bench",
            "--config",
            str(write_config(tmp_path)),
            "--quick",
            "--losses",
            "auc",
            "--output",
            str(tmp_path / "b2"),
            "loss.params.lambda_val=3",
        ],
    )
    assert bad.exit_code == 2 and "lambda_val" in bad.output


def test_bench_command_line_budget_wins_over_quick(tmp_path):
    out = tmp_path / "bench"
    result = runner.invoke(
        app,
        [
            "bench",
            "--config",
            str(write_config(tmp_path)),
            "--quick",
            "--losses",
            "triplet",
            "--output",
            str(out),
            "budget.iterations=3",
            "eval_every=3",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "bench.json").read_text())
    assert summary["rows"][0]["steps"] == 3
    refused = runner.invoke(
        app,
        [
            "bench",
            "--config",
            str(write_config(tmp_path)),
            "--quick",
            "--losses",
            "triplet",
            "--output",
            str(out),
            "seed=4",
        ],
    )
    assert refused.exit_code == 2 and "--seeds" in refused.output


def test_train_stops_cleanly_when_the_model_diverges(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "train",
            "--config",
            str(write_config(tmp_path)),
            "--output",
            str(out),
            "optimizer.name=sgd",
            "optimizer.lr=1e30",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "step" in result.output and "optimizer.lr" in result.output
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["kind"] == "error"


def test_bench_losses_all_runs_every_loss_of_the_config(tmp_path):
    # `--losses all` (issue 21: "the demo, run with --losses all") is the config's bench.losses,
    # in its order; without --losses the same list runs
    data = {**BASE, "bench": {**BASE["bench"], "losses": ["ap", "contrastive"]}}
    out = tmp_path / "bench"
    args = ["bench", "--config", str(write_config(tmp_path, data)), "--quick", "--output", str(out)]
    result = runner.invoke(app, [*args, "--losses", "all"])
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "bench.json").read_text())
    assert [row["loss"] for row in summary["rows"]] == ["ap", "contrastive"]


def test_demo_config_bench_list_trains_a_triplet_baseline_that_learns():
    # batch-hard triplet stays collapsed in the demo's 150 steps (docs/losses.md): the demo's
    # bench list uses semi-hard mining; the Fashion-MNIST instance benchmark keeps batch-hard
    from pathlib import Path

    configs = Path(__file__).resolve().parents[1] / "configs"
    demo = yaml.safe_load((configs / "digits_instances.yaml").read_text())["bench"]["losses"]
    fashion = yaml.safe_load((configs / "fashion_mnist_instances.yaml").read_text())
    assert "triplet_semihard" in demo and "triplet" not in demo
    assert "triplet" in fashion["bench"]["losses"]
