"""Early stopping, a callback's stop with a reason, and any validation scalar as the monitor.

A run ended by :class:`EarlyStopping` (or any callback's ``request_stop(reason=...)``) ends
normally: ``status == "stopped_early"``, the selected model tested, the report written, a resume
finished; ``selection.monitor`` chooses the scalar that selects the model.
"""

import json

import pytest
import torch
from torch.utils.data import TensorDataset

from rankwise.losses import build_loss
from rankwise.training import Callback, EarlyStopping, RunResult, Trainer
from rankwise.training.callbacks import BestCheckpoint
from rankwise.training.monitor import check_monitor, monitor_value


def clusters(seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(4).repeat_interleave(16)
    points = 3 * torch.randn(4, 8, generator=generator)[labels]
    return TensorDataset(points + torch.randn(64, 8, generator=generator), labels)


def make_trainer(run_dir, callbacks, resume=False, **options):
    torch.manual_seed(0)
    data = clusters()
    return Trainer(
        torch.nn.Linear(8, 4),
        build_loss("ap"),
        data,
        val_data=data,
        test_data=data,
        eval_every=2,
        progress=False,
        callbacks=callbacks,
        run_dir=run_dir,
        resume=resume,
        **{"iterations": 40, **options},
    )


class StopAt(Callback):
    """Ask for a normal end with a reason after step ``step``."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer):
        if trainer.step == self.step:
            trainer.request_stop(reason=f"enough at step {self.step}")


def test_a_callback_stop_with_a_reason_is_an_end_not_an_interruption(tmp_path):
    trainer = make_trainer(tmp_path / "run", [StopAt(5)])
    result = trainer.fit()  # no TrainingInterrupted
    assert result.status == "stopped_early" and result.steps == 5
    assert result.stop_reason == "enough at step 5"
    assert result.test is not None and result.pr_curve is not None  # the selected model tested
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "stopped_early" and report["stop_reason"] == "enough at step 5"
    assert (tmp_path / "run" / "pr_curve.json").is_file()


def test_early_stopping_tests_the_selected_model_and_a_resume_is_finished(tmp_path):
    stopper = EarlyStopping("map", patience=1, min_delta=1.0)  # no evaluation improves by 1
    trainer = make_trainer(tmp_path / "run", [stopper])
    result = trainer.fit()
    assert result.status == "stopped_early"
    assert result.steps == 4 and stopper.stopped_step == 4  # evaluations at 2 (best) and 4
    assert "early stopping" in result.stop_reason
    # the test report is the selected model's: the one saved at the best validation step
    selected = trainer.store.selected_weights(trainer.device)
    trainer.model.load_state_dict(selected)
    assert trainer.evaluate("test").map == result.test.map
    assert RunResult.load(tmp_path / "run").status == "stopped_early"

    resumed = make_trainer(tmp_path / "run", [EarlyStopping("map", 1, 1.0)], resume=True)
    assert resumed.stopped_early == result.stop_reason
    again = resumed.fit()
    assert again.status == "stopped_early" and again.steps == 4  # no further step


def test_a_reasonless_stop_is_still_an_interruption(tmp_path):
    from rankwise.training import TrainingInterrupted

    def stop(trainer):
        if trainer.step == 3:
            trainer.request_stop()

    with pytest.raises(TrainingInterrupted):
        make_trainer(tmp_path / "run", [stop]).fit()


def test_early_stopping_arguments_are_checked():
    with pytest.raises(ValueError, match="`patience` must be an integer >= 1"):
        EarlyStopping(patience=0)
    with pytest.raises(ValueError, match="`min_delta`"):
        EarlyStopping(min_delta=-0.1)
    with pytest.raises(ValueError, match="`mode` must be one of 'max', 'min'"):
        EarlyStopping(mode="up")
    with pytest.raises(ValueError, match="unknown validation metric 'acc'.*recall@<k>"):
        EarlyStopping("acc")


def test_recall_at_1_as_the_monitor_selects_on_recall_at_1(tmp_path):
    best = BestCheckpoint("recall@1")
    trainer = make_trainer(tmp_path / "run", [best], iterations=12)
    result = trainer.fit()
    assert trainer.monitor == "recall@1"
    vals = [r for r in trainer.history if r["kind"] == "val"]
    scores = [monitor_value(r, "recall@1") for r in vals]
    first_best = vals[scores.index(max(scores))]["step"]  # ties keep the earliest
    assert result.best_step == first_best
    assert best.best_value == max(scores)


def test_config_selection_monitor_reaches_selection_and_early_stopping(tiny_config, tmp_path):
    config = tiny_config(
        tmp_path / "run",
        **{
            "eval_ks": [1, 5],
            "selection.monitor": "recall@5",
            "early_stopping": {"patience": 2},
        },
    )
    trainer = Trainer.from_config(config)
    try:
        assert trainer.monitor == "recall@5"
        stoppers = [c for c in trainer.callbacks if isinstance(c, EarlyStopping)]
        assert len(stoppers) == 1 and stoppers[0].monitor == "recall@5"  # its default
        assert stoppers[0].patience == 2
    finally:
        trainer.store.release()


def test_an_unknown_monitor_names_the_valid_ones(tiny_config, tmp_path):
    from rankwise.training import ConfigError

    with pytest.raises(ConfigError, match="selection.monitor.*'accuracy'.*map_at_r.*recall@<k>"):
        tiny_config(tmp_path, **{"selection.monitor": "accuracy"})
    with pytest.raises(ConfigError, match="recall@10.*eval_ks=\\[1\\]"):
        tiny_config(tmp_path, **{"selection.monitor": "recall@10"})  # not evaluated
    assert check_monitor("precision@1", [1]) == "precision@1"
    assert check_monitor("ndcg@10", [1, 10]) == "ndcg@10" and check_monitor("mrr") == "mrr"


def docs_section():
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    return text.split("### Early stopping and the monitored metric", 1)[1].split("\n## ", 1)[0]


def test_the_docs_example_runs_and_stops_early(capsys):
    code = docs_section().split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/training.md", "exec"), {})
    status, steps, best = capsys.readouterr().out.splitlines()[0].split()
    assert status == "stopped_early" and int(steps) < 200 and int(best) <= int(steps)


def test_the_docs_config_is_a_valid_config(tiny_config, tmp_path):
    import yaml

    block = yaml.safe_load(docs_section().split("```yaml\n", 1)[1].split("```", 1)[0])
    config = tiny_config(tmp_path, **block)
    assert config.selection.monitor == "recall@1" and config.early_stopping.patience == 3


def test_the_fit_loop_returns_its_end():
    from rankwise.training.loop import FitLoop, LoopEnd
    from rankwise.training.stop import StopControl

    def run(reason, stop_at=3, budget=10, max_steps=None):
        stop = StopControl()

        def emit(hook, *args):
            if hook == "on_step_end" and loop.step == stop_at:
                stop.request(reason)

        batches = ((torch.zeros(2, 1), torch.zeros(2), torch.tensor([[0, i]])) for i in range(99))
        loop = FitLoop(
            99, budget, 5, lambda x, y: torch.tensor(0.5), lambda s: 0.1, emit, lambda: None, stop
        )
        return loop.run(batches, max_steps), loop.step

    assert run("plateau") == (LoopEnd("stopped_early", reason="plateau"), 3)
    assert run(None) == (LoopEnd("signal", signal=None), 3)  # no reason: an interruption
    assert run(None, stop_at=-1) == (LoopEnd("budget"), 10)
    assert run(None, stop_at=-1, max_steps=4) == (LoopEnd("max_steps"), 4)


def test_tune_objective_and_bench_table_follow_the_monitor():
    from rankwise.reporting import bench_table_markdown
    from rankwise.workflows.tune import validation_map

    best_val = {"map": 0.5, "recall_at": {"1": 0.75}}
    config = {"selection": {"monitor": "recall@1"}}
    result = RunResult(None, "completed", 4, 1.0, 2, best_val, config=config)
    assert validation_map(result) == 0.75  # the monitored value, not the mAP
    assert validation_map(RunResult(None, "completed", 4, 1.0, 2, best_val)) == 0.5  # default

    metrics = {
        f"{k}_{s}": 0.5
        for k in ("map", "recall_at_1", "recall_at_10", "map_at_r")
        for s in ("mean", "std")
    }
    row = {
        "loss": "ap",
        "seconds": 1.0,
        "seeds": [0],
        **metrics,
        "monitor_mean": 0.25,
        "monitor_std": 0.0,
    }
    summary = {
        "dataset": "digits",
        "protocol": "open-set",
        "seeds": [0],
        "rows": [row],
        "monitor": "ndcg@10",
    }
    text = bench_table_markdown(summary)
    assert "best validation ndcg@10" in text
    assert "| MAP@R | ndcg@10 | s / run |" in text and "| 50.00 | 25.00 | 1.0 |" in text


def test_the_command_exits_0_and_a_resume_says_the_run_is_finished(tiny_config, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from rankwise.cli import build_app

    data = tiny_config.data(
        tmp_path / "run",
        **{"early_stopping": {"patience": 1, "min_delta": 1.0}, "selection.monitor": "recall@1"},
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    runner = CliRunner()
    first = runner.invoke(build_app(), ["train", "--config", str(tmp_path / "c.yaml")])
    assert first.exit_code == 0, first.output
    said = " ".join(first.output.split())
    assert "stopped early at step 4: early stopping: validation recall@1" in said
    assert "the model selected on validation recall@1" in said
    assert "best validation recall@1" in said
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "stopped_early" and report["test"] is not None
    again = runner.invoke(build_app(), ["train", "--resume", str(tmp_path / "run")])
    assert again.exit_code == 0, again.output
    assert "is finished: it stopped early at step 4 of 8" in " ".join(again.output.split())
    assert json.loads((tmp_path / "run" / "report.json").read_text())["steps"] == 4
