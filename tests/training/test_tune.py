"""`rankwise tune` on the bundled digits data with a tiny budget: the winners are the argmax of the
validation mAP read back from each run's own metrics log, test metrics are never read (ranking
the test data fails the test; the runs' reports hold no test), tuned.yaml reproduces the winning runs
through `plan_bench`, loss parameters a loss does not take are skipped and recorded, and every
grid error is reported before any training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.training import ConfigError, Evaluator, NonFiniteLossError, RunResult, Trainer
from rankwise.training.bench import plan_bench
from rankwise.training.config import config_from_dict
from rankwise.training.tune import parse_grid_values, tune

runner = CliRunner()


@pytest.fixture(scope="module")
def base(tiny_config):
    """The tiny run of tests/conftest.py with SOPRC on 16 dimensions, 10 steps."""
    return tiny_config.data(
        **{
            "model.embedding_dim": 16,
            "loss.name": "soprc",
            "budget.iterations": 10,
            "eval_every": 5,
            "eval_ks": [1, 10],
            "progress": None,
            # an existing per-loss override that tuning must keep
            "bench": {"overrides": {"triplet": {"optimizer.weight_decay": 1e-4}}},
        }
    )


GRID = {"optimizer.lr": [3e-4, 3e-3], "loss.params.margin": [0.1]}


class ReadTestReportError(AssertionError):
    pass


real_rank = Evaluator.rank_split


def rank_without_test(self, model, device, split, **kwargs):
    """Evaluator.rank_split (every ranking of a run's split), failing the test on the test data."""
    if split == "test":
        raise ReadTestReportError("tuning evaluated the test data")
    return real_rank(self, model, device, split, **kwargs)


@pytest.fixture(scope="module")
def tuned_sweep(tmp_path_factory, base):
    out = tmp_path_factory.mktemp("tune") / "sweep"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Evaluator, "rank_split", rank_without_test)
        summary = tune(base, losses=["triplet", "auc"], grid=GRID, seeds=(0, 1), output=out)
    return out, summary


def best_val_map_from_log(run_dir):
    """The validation mAP of the selected checkpoint, re-read from the run's metrics log."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return max(r["map"] for r in records if r["kind"] == "val")


def test_winner_is_the_argmax_of_the_logged_validation_map(tuned_sweep):
    out, summary = tuned_sweep
    on_disk = json.loads((out / "tune.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["complete"] is True and on_disk["seeds"] == [0, 1]
    trials = on_disk["trials"]
    assert [t["loss"] for t in trials] == ["triplet", "triplet", "auc", "auc"]
    means = {}
    for trial in trials:
        logged = [
            best_val_map_from_log(
                out / "trials" / f"trial{trial['trial']:03d}" / trial["loss"] / f"seed{s}"
            )
            for s in (0, 1)
        ]
        assert trial["val_map_per_seed"] == pytest.approx(logged, abs=1e-12)
        assert trial["val_map_mean"] == pytest.approx(np.mean(logged), abs=1e-12)
        assert trial["seconds"] > 0 and len(trial["seconds_per_seed"]) == 2
        means.setdefault(trial["loss"], []).append((float(np.mean(logged)), trial))
    for loss, scored in means.items():
        best = max(scored, key=lambda pair: pair[0])[1]
        assert on_disk["winners"][loss]["trial"] == best["trial"]
        assert on_disk["winners"][loss]["params"] == best["params"]


def test_overrides_reach_the_runs_and_unknown_params_are_skipped(tuned_sweep, base):
    out, summary = tuned_sweep
    for trial in summary["trials"]:
        for run_dir in trial["run_dirs"]:
            report = json.loads(open(f"{run_dir}/report.json").read())
            assert report["status"] == "completed" and report["test"] is None
            used = yaml.safe_load(open(f"{run_dir}/config.yaml"))
            assert used["optimizer"]["lr"] == trial["params"]["optimizer.lr"]
            assert used["loss"]["name"] == trial["loss"]
            if trial["loss"] == "triplet":
                assert used["loss"]["params"] == {"margin": 0.1}
                assert used["optimizer"]["weight_decay"] == 1e-4  # base bench override kept
                assert trial["skipped"] == {}
            else:
                # auc has no margin: the key is left out (not crossed into duplicate trials)
                assert used["loss"]["params"] == {}
                assert list(trial["skipped"]) == ["loss.params.margin"]
                assert "margin" in trial["skipped"]["loss.params.margin"]
                assert "loss.params.margin" not in trial["params"]
    assert list(summary["winners"]["auc"]["skipped"]) == ["loss.params.margin"]


def test_tuned_yaml_validates_and_reproduces_the_winning_runs(tuned_sweep, tmp_path):
    out, summary = tuned_sweep
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    config = config_from_dict(tuned)
    assert config.bench.losses == ["triplet", "auc"]
    for loss, winner in summary["winners"].items():
        assert winner["params"].items() <= config.bench.overrides[loss].items()
    assert config.bench.overrides["triplet"]["optimizer.weight_decay"] == 1e-4
    # `rankwise bench --config tuned.yaml` plans exactly the winning runs (bar directories)
    runs = plan_bench(tuned, seeds=(0, 1), output=tmp_path / "bench")
    for run in runs:
        winner = summary["winners"][run.label]
        used = yaml.safe_load(
            (
                out
                / "trials"
                / f"trial{winner['trial']:03d}"
                / run.label
                / f"seed{run.seed}"
                / "config.yaml"
            ).read_text()
        )
        planned = run.config.to_dict()
        for key in ("output_dir", "bench"):
            used.pop(key), planned.pop(key)
        assert planned == used


def test_selection_ignores_test_metrics_and_skips_diverged_points(tmp_path, monkeypatch, base):
    """Synthetic runs: validation mAP peaks at lr=1e-3, test mAP at lr=1e-4, lr=1e-2 diverges."""
    val = {1e-4: 0.2, 1e-3: 0.9, 1e-2: None}

    def fake_fit(self, **kwargs):
        lr = self.config.optimizer.lr
        if val[lr] is None:
            raise NonFiniteLossError("loss is nan", 3, None)
        test = type("Report", (), {"map": 1.0 if lr == 1e-4 else 0.0})()
        return RunResult(self.run_dir, "completed", 10, 0.01, 10, {"map": val[lr]}, test=test)

    monkeypatch.setattr(Trainer, "fit", fake_fit)
    summary = tune(
        base,
        losses=["auc"],
        grid={"optimizer.lr": [1e-4, 1e-3, 1e-2]},
        seeds=(0, 1),
        output=tmp_path / "t",
        console=None,
    )
    assert summary["winners"]["auc"]["params"] == {"optimizer.lr": 1e-3}
    diverged = summary["trials"][2]
    assert diverged["val_map_mean"] is None and "nan" in diverged["errors"][0]
    assert diverged["val_map_per_seed"] == [None]  # stopped at its first seed

    # every point diverging leaves the loss without a winner and its overrides untouched
    val.update({1e-4: None, 1e-3: None})
    summary = tune(
        base, losses=["triplet"], grid={"optimizer.lr": [1e-4, 1e-3]}, output=tmp_path / "t2"
    )
    assert summary["winners"] == {"triplet": None}
    tuned = yaml.safe_load((tmp_path / "t2" / "tuned.yaml").read_text())
    assert tuned["bench"]["overrides"]["triplet"] == {"optimizer.weight_decay": 1e-4}


def never_train(self, **kwargs):
    raise AssertionError("training started before every config error was reported")


@pytest.mark.parametrize(
    ("grid", "quick", "fragment"),
    [
        ({"optimizer.lrr": [1e-3]}, False, "optimizer.lrr"),
        ({"optimizer.lr": [1e-3, -1.0]}, False, "optimizer.lr"),
        ({"loss.params.margn": [0.1]}, False, "loss.params.margn"),
        # data-dependent: 100 / 4 = 25 classes per batch, the open-set split has 5
        ({"sampler.batch_size": [20, 100]}, False, "sampler.batch_size"),
        ({"seed": [0, 1]}, False, "seed"),
        ({"loss.name": ["ap"]}, False, "loss.name"),
        ({"budget.iterations": [5, 10]}, True, "budget.iterations"),
        ({"optimizer.lr": []}, False, "optimizer.lr"),
        ({"optimizer": [{"lr": 0.1}], "optimizer.lr": [0.1]}, False, "overlap"),
        ({}, False, "grid is empty"),
    ],
)
def test_grid_errors_are_reported_before_any_training(
    tmp_path, monkeypatch, grid, quick, fragment, base
):
    monkeypatch.setattr(Trainer, "fit", never_train)
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        tune(base, losses=["triplet", "auc"], grid=grid, quick=quick, output=tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_parse_grid_values_reads_yaml_lists():
    assert parse_grid_values("optimizer.lr=0.0003,0.001") == ("optimizer.lr", [0.0003, 0.001])
    assert parse_grid_values("loss.params.semi_variance_weights=[1,5],null") == (
        "loss.params.semi_variance_weights",
        [[1, 5], None],
    )
    assert parse_grid_values("optimizer.name=sgd,adam") == ("optimizer.name", ["sgd", "adam"])
    for bad in ("optimizer.lr", "optimizer.lr=", "=1,2", "optimizer.lr=[1,"):
        with pytest.raises(ConfigError):
            parse_grid_values(bad)


def test_cli_tune_writes_results_and_marks_the_winner(tmp_path, base):
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(base))
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "tune",
            "--config",
            str(config),
            "--losses",
            "auc",
            "--grid",
            "optimizer.lr=0.0003,0.003",
            "--seeds",
            "1",
            "--output",
            str(out),
            "budget.iterations=6",
            "eval_every=3",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "tune.json").read_text())
    assert [t["params"] for t in summary["trials"]] == [
        {"optimizer.lr": 0.0003},
        {"optimizer.lr": 0.003},
    ]
    assert summary["trials"][0]["best_step_per_seed"][0] in (3, 6)
    winner = summary["winners"]["auc"]
    assert "★" in result.output and "tuned.yaml" in result.output
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    assert tuned["bench"]["overrides"]["auc"] == winner["params"]
    assert tuned["budget"] == {"iterations": 6}  # the command-line overrides are kept


def test_cli_tune_config_errors_exit_2(tmp_path, base):
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(base))
    cases = [
        (["--grid", "optimizer.lrr=0.1"], "optimizer.lrr"),
        (["--grid", "optimizer.lr"], "--grid"),
        (["--grid", "optimizer.lr=0.1", "--grid", "optimizer.lr=0.2"], "twice"),
        (["--grid", "optimizer.lr=0.1", "loss.params.margin=0.1"], "loss.params.margin"),
        (["--grid", "optimizer.lr=0.1", "--losses", "auc,nope"], "unknown loss 'nope'"),
    ]
    for args, fragment in cases:
        result = runner.invoke(
            app,
            [
                "tune",
                "--config",
                str(config),
                "--losses",
                "auc",
                "--output",
                str(tmp_path / "o"),
                *args,
            ],
        )
        assert result.exit_code == 2, (args, result.output)
        assert "config error" in result.output and fragment in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_ties_are_broken_by_the_documented_rule_and_reported():
    from rankwise.workflows.tune import TIE_RULE, SeedOutcome, TuneTrial, _winners

    def trial(index, *maps):
        outcomes = [SeedOutcome(s, v, 1, 1, 0.0, "") for s, v in enumerate(maps)]
        return TuneTrial(index, "auc", {}, {}, [None] * len(maps), outcomes)

    # equal means: the higher worst seed wins (trial 1), not the first in grid order (trial 0)
    trials = [trial(0, 0.5, 0.9), trial(1, 0.7, 0.7), trial(2, 0.6, 0.7)]
    winners, ties = _winners(trials)
    assert winners["auc"].index == 1 and ties == {"auc": [1, 0]}
    # fully equal: the earlier trial, and the tie is still reported
    winners, ties = _winners([trial(0, 0.7, 0.7), trial(1, 0.7, 0.7)])
    assert winners["auc"].index == 0 and ties == {"auc": [0, 1]}
    assert "worst seed" in TIE_RULE and "grid order" in TIE_RULE


def test_cli_tune_losses_all_tunes_every_loss_of_the_config(tmp_path, base):
    # `--losses all` means the config's bench.losses, as in `rankwise bench` (it was refused as an
    # unknown loss 'all' before the flag's parse was shared)
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump({**base, "bench": {**base["bench"], "losses": ["auc"]}}))
    out = tmp_path / "out"
    args = ["tune", "--config", str(config), "--losses", "all", "--grid", "optimizer.lr=0.001"]
    args += ["--seeds", "1", "--output", str(out), "budget.iterations=2", "eval_every=2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "tune.json").read_text())
    assert [t["loss"] for t in summary["trials"]] == ["auc"]


def test_cli_tune_overrides_win_over_quick_as_in_bench(tmp_path, base):
    """Issue 30: `tune --quick ... budget.iterations=N` trained the quick budget's steps without a
    word; the caller's KEY=VALUE wins, as `rankwise bench` applies it after the quick budget, and
    tuned.yaml keeps that under `bench --quick` too."""
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(base))  # bench.quick: the default 100 iterations, eval 50
    out = tmp_path / "out"
    args = ["tune", "--config", str(config), "--losses", "auc", "--grid", "optimizer.lr=0.001"]
    args += ["--quick", "--output", str(out), "budget.iterations=4", "eval_every=2"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "1 trial (1 run) on digits" in " ".join(result.output.split())  # was "1 trials (1 runs)"
    run_dir = json.loads((out / "tune.json").read_text())["trials"][0]["run_dirs"][0]
    assert json.loads((Path(run_dir) / "report.json").read_text())["steps"] == 4
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    assert tuned["bench"]["quick"]["overrides"] == {"budget.epochs": None}
    (rerun,) = plan_bench(tuned, losses=["auc"], seeds=[0], quick=True, output=tmp_path / "b")
    assert rerun.config.budget.iterations == 4 and rerun.config.eval_every == 2
    # the header of tuned.yaml names the command line's bench command (the CLI words it)
    header = (out / "tuned.yaml").read_text().split("\n# with ")[1].splitlines()[0]
    expected = f"`rankwise bench --config {out / 'tuned.yaml'} --seeds 3` (tuned with --quick"
    assert header.startswith(expected), header
    # --resume: the sweep engine locks the folder, reads sweep.json, keeps the finished run
    report = Path(run_dir) / "report.json"
    written = report.stat().st_mtime_ns
    resumed = runner.invoke(app, ["tune", "--resume", str(out), "--device", "cpu"])
    assert resumed.exit_code == 0, resumed.output
    assert report.stat().st_mtime_ns == written  # kept, not trained again
    assert (out / "tuned.yaml").read_text().split("\n# with ")[1].startswith(expected)


def test_tuned_yaml_of_python_names_the_python_call(tuned_sweep):
    """tune() from Python words tuned.yaml's header as a Python call, never a command-line flag."""
    out, _ = tuned_sweep
    header = [line for line in (out / "tuned.yaml").read_text().splitlines() if line[:1] == "#"]
    assert (
        f"# with `run_bench(read_config_file({str(out / 'tuned.yaml')!r}), output=...)`." in header
    )
    assert not any("--" in line for line in header), header


def test_tune_records_and_writes_model_pretrained_absolute(tmp_path, monkeypatch, base):
    """tuned.yaml and sweep.json are read from anywhere: a relative model.pretrained (relative to
    where tune runs, where the trials load it) is recorded resolved, from Python and the CLI."""
    import rankwise.workflows.tune as tune_module

    class Planned(Exception):
        """What tune would run (nothing is trained)."""

    seen = []

    def planned(plan, summarise, **_):
        seen.append(plan)
        raise Planned

    monkeypatch.setattr(tune_module, "run_sweep", planned)
    monkeypatch.chdir(tmp_path)
    relative = {**base, "model": {**base.get("model", {}), "pretrained": "runs/pretrained"}}
    with pytest.raises(Planned):
        tune(relative, losses=["auc"], grid={"optimizer.lr": [0.001]}, output=tmp_path / "t")
    absolute = str(tmp_path / "runs" / "pretrained")
    (plan,) = seen
    assert plan.settings["base"]["model"]["pretrained"] == absolute  # sweep.json
    assert all(run.config.model.pretrained == absolute for run in plan.runs)  # config.yaml
    # tuned.yaml is the base with the winners: the summariser's base
    assert plan.prepare.__self__.base["model"]["pretrained"] == absolute

    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump(base))
    args = ["tune", "-c", str(config), "--losses", "auc", "--grid", "optimizer.lr=0.001"]
    result = CliRunner().invoke(app, [*args, "-o", "t2", "model.pretrained=runs/pretrained"])
    assert isinstance(result.exception, Planned), result.output
    assert seen[1].settings["base"]["model"]["pretrained"] == absolute
