"""Resuming at the edges (issue 40, items 4-6): a run that stopped before its first checkpoint
trains again from step 0 (never "resume it" and "not a run directory" both), a run's data folder
is stored absolute and may move (``--resume RUN --data-dir NEW``, checked against the run's
``data.json``), and ``--resume RUN --max-steps N`` trains a finished run on to ``N``."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from PIL import Image
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.training import ConfigError, Trainer, config_from_dict, load_checkpoint
from rankwise.training.build import learning_rate_at

runner = CliRunner()


def _flat(text: str) -> str:
    return " ".join(text.split())


def _records(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _same_run(a, b):
    """Two run folders hold the same training: losses, learning rates, validation and test."""
    for kind, keys in (("train", ("step", "loss", "lr")), ("val", ("step", "map"))):
        assert [[r[k] for k in keys] for r in _records(a, kind)] == [
            [r[k] for k in keys] for r in _records(b, kind)
        ]
    report_a, report_b = (json.loads((d / "report.json").read_text()) for d in (a, b))
    for key in ("status", "steps", "best_step"):
        assert report_a[key] == report_b[key]
    assert report_a["test"]["map"] == report_b["test"]["map"]
    best_a, best_b = (load_checkpoint(d / "checkpoints" / "best.pt")["model"] for d in (a, b))
    assert all(torch.equal(best_a[k], best_b[k]) for k in best_a)


# -- item 4: a run that stopped before its first checkpoint -----------------------------------


class Crash(RuntimeError):
    pass


def _crash_at_step_1(trainer):
    if trainer.step == 1:  # after the first step's record, before the first checkpoint (step 2)
        raise Crash("the first step failed")


def test_a_run_that_crashed_before_its_first_checkpoint_trains_again_from_step_0(
    tmp_path, tiny_config
):
    run_dir, fresh = tmp_path / "crashed", tmp_path / "fresh"
    settings = {"budget.iterations": 4, "log_every": 1}
    with pytest.raises(Crash):
        Trainer.from_config(tiny_config(run_dir, **settings)).fit(callbacks=[_crash_at_step_1])
    assert (run_dir / "config.yaml").is_file() and _records(run_dir, "train")
    assert not (run_dir / "checkpoints" / "last.pt").exists()

    # starting it again names both ways, and the one it says works
    config_path = tmp_path / "c.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config.data(**settings)))
    again = runner.invoke(app, ["train", "-c", str(config_path), "--output", str(run_dir)])
    assert again.exit_code == 2, again.output
    said = _flat(again.output)
    assert "stopped before its first checkpoint" in said
    assert "--resume" in said and "--overwrite" in said

    resumed = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert resumed.exit_code == 0, resumed.output
    assert "stopped before its first checkpoint: training it again from step 0" in _flat(
        resumed.output
    )
    Trainer.from_config(tiny_config(fresh, **settings)).fit()
    _same_run(run_dir, fresh)  # the crash left nothing behind: the same run as a fresh one


def test_the_python_api_restarts_it_too_and_a_folder_without_a_run_is_still_refused(
    tmp_path, tiny_config
):
    run_dir = tmp_path / "crashed"
    with pytest.raises(Crash):
        Trainer.from_config(tiny_config(run_dir)).fit(callbacks=[_crash_at_step_1])
    trainer = Trainer.from_run_dir(tmp_path)  # the folder holding it finds it
    assert trainer.run_dir == run_dir and trainer.step == 0 and trainer.store.restarted
    trainer.store.release()
    trainer = Trainer.from_config(tiny_config(run_dir), resume=True)
    assert trainer.step == 0 and trainer.store.restarted
    trainer.store.release()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a run directory"):
        Trainer.from_run_dir(tmp_path / "empty")


# -- item 5: moved data ----------------------------------------------------------------------


def _sop_tree(base, extra_image=False):
    """A tiny Stanford Online Products folder (its official list files) under ``base``."""
    root = base / "Stanford_Online_Products"
    header = "image_id class_id super_class_id path"
    rows = {"train": [], "test": []}
    image_id = 1
    for split, classes, per_class in (("train", range(1, 5), 4), ("test", range(5, 8), 3)):
        for c in classes:
            for k in range(per_class + (extra_image and c == 1)):
                rel = f"bicycle_final/{c}_{k}.JPG"
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (7, 5), (image_id * 9 % 256, 40 * c % 256, 90)).save(
                    root / rel, format="JPEG"
                )
                rows[split].append(f"{image_id} {c} 1 {rel}")
                image_id += 1
    for split in rows:
        text = "\n".join([header] + rows[split]) + "\n"
        (root / f"Ebay_{split}.txt").write_text(text)
    return root


def _sop_config(tiny_config, output_dir, data_dir):
    return tiny_config.data(
        output_dir,
        dataset={"name": "sop", "data_dir": str(data_dir), "image_size": 8, "val_fraction": 0.25},
        sampler={"m": 2, "batch_size": 4},
        **{"budget.iterations": 4},
    )


def test_moved_data_is_found_again_with_data_dir_and_other_data_is_refused(
    tmp_path, tiny_config, monkeypatch
):
    _sop_tree(tmp_path / "A")
    run_dir, fresh = tmp_path / "runs" / "moved", tmp_path / "runs" / "fresh"
    monkeypatch.chdir(tmp_path)  # the data folder given relative, from A's parent
    config_path = tmp_path / "sop.yaml"
    config_path.write_text(yaml.safe_dump(_sop_config(tiny_config, run_dir, "A")))
    started = runner.invoke(app, ["train", "-c", str(config_path), "--max-steps", "2"])
    assert started.exit_code == 0, started.output
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["dataset"]["data_dir"] == str((tmp_path / "A").resolve())  # absolute
    recorded = json.loads((run_dir / "data.json").read_text())
    assert recorded["dataset"] == "sop" and recorded["files"] == 16 + 9

    shutil.move(tmp_path / "A", tmp_path / "B")
    _sop_tree(tmp_path / "C", extra_image=True)  # another dataset: one image more
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    lost = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert lost.exit_code == 2 and "If the run's data moved" in _flat(lost.output), lost.output
    other = runner.invoke(app, ["train", "--resume", str(run_dir), "--data-dir", "../C"])
    assert other.exit_code == 2, other.output
    said = _flat(other.output)
    assert str((tmp_path / "A").resolve()) in said and str((tmp_path / "C").resolve()) in said
    assert "not the data this run trained on" in said and "Traceback" not in said

    moved = runner.invoke(app, ["train", "--resume", str(run_dir), "--data-dir", "../B"])
    assert moved.exit_code == 0, moved.output
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["dataset"]["data_dir"] == str((tmp_path / "B").resolve())
    assert json.loads((run_dir / "data.json").read_text())["data_dir"] == str(
        (tmp_path / "B").resolve()
    )
    Trainer.from_config(config_from_dict(_sop_config(tiny_config, fresh, tmp_path / "B"))).fit()
    _same_run(run_dir, fresh)  # the same run as one that never moved


# -- item 6: training a finished run on ------------------------------------------------------


def test_max_steps_trains_a_finished_run_on_as_a_longer_one_would_have(tmp_path, tiny_config):
    run_dir, longer = tmp_path / "run", tmp_path / "longer"
    # a schedule that does not depend on the budget: the extension is the longer run
    settings = {"budget.iterations": 4, "log_every": 2, "schedule.name": "multistep"}
    settings["schedule.milestones"] = [3]
    config_path = tmp_path / "c.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config.data(run_dir, **settings)))
    fresh = runner.invoke(app, ["train", "-c", str(config_path), "--max-steps", "6"])
    assert fresh.exit_code == 0, fresh.output  # a fresh run's budget is its config's: said
    assert "--max-steps 6 is past the run's budget of 4 steps" in _flat(fresh.output)
    again = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert again.exit_code == 0
    assert "completed its 4 steps" in _flat(again.output) and "--max-steps" in again.output
    fewer = runner.invoke(app, ["train", "--resume", str(run_dir), "--max-steps", "3"])
    assert fewer.exit_code == 2 and "already at step 4" in _flat(fewer.output)

    extended = runner.invoke(app, ["train", "--resume", str(run_dir), "--max-steps", "8"])
    assert extended.exit_code == 0, extended.output
    assert "its budget of 4 steps is extended to 8" in _flat(extended.output)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "completed" and report["steps"] == 8
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["budget"]["iterations"] == 8
    Trainer.from_config(tiny_config(longer, **{**settings, "budget.iterations": 8})).fit()
    _same_run(run_dir, longer)


def test_a_cosine_schedule_is_redefined_over_the_extended_budget(tmp_path, tiny_config):
    run_dir = tmp_path / "run"
    settings = {"budget.iterations": 4, "log_every": 1, "schedule.name": "cosine"}
    Trainer.from_config(tiny_config(run_dir, **settings)).fit()
    trainer = Trainer.from_run_dir(run_dir, max_steps=6)
    assert trainer.store.extended_from == 4 and trainer.total_steps == 6
    assert trainer.fit().steps == 6
    config = trainer.config
    rates = {r["step"]: r["lr"] for r in _records(run_dir, "train")}
    # steps 1-4 on the 4-step schedule, then the 6-step one from where the run stood
    short = tiny_config(**settings)
    assert [rates[s] for s in range(1, 5)] == [
        learning_rate_at(short, s - 1, 4) for s in range(1, 5)
    ]
    assert [rates[s] for s in (5, 6)] == [learning_rate_at(config, s - 1, 6) for s in (5, 6)]
    assert rates[5] > rates[4]  # the cosine rises again: not what a fresh 6-step run does


def test_a_bench_run_that_crashed_before_its_first_checkpoint_trains_again_on_resume(
    tmp_path, tiny_config, monkeypatch
):
    """The sweeps give the same answer: the resumed sweep trains that run again from step 0."""
    import io

    from rich.console import Console

    from rankwise.workflows.bench import run_bench

    base = tiny_config.data(**{"budget.iterations": 4, "log_every": 1})
    out = tmp_path / "bench"
    original = Trainer.fit

    def crashing_fit(self, **kwargs):
        if self.name.startswith("[2/"):
            kwargs["callbacks"] = [*kwargs.get("callbacks", ()), _crash_at_step_1]
        return original(self, **kwargs)

    monkeypatch.setattr(Trainer, "fit", crashing_fit)
    options = dict(losses=["auc", "triplet"], seeds=[0], output=out)
    with pytest.raises(Crash):
        run_bench(base, **options, console=Console(file=io.StringIO()))
    crashed = out / "triplet" / "seed0"
    assert _records(crashed, "train") and not (crashed / "checkpoints" / "last.pt").exists()
    monkeypatch.undo()
    console = Console(file=io.StringIO(), width=200)
    summary = run_bench(base, **options, console=console, resume=True)
    assert summary["complete"] is True and summary["runs_finished"] == 2
    assert [r["step"] for r in _records(crashed, "train")] == [1, 2, 3, 4]  # from step 0, once
