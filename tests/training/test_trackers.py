"""The experiment trackers (issue 37, item 5): TensorBoard event files and an MLflow store, read back.

`logging.trackers: [tensorboard, mlflow]` logs the training loss, the learning rate, every
validation and test metric, the config as parameters and the test PR figure; what the trackers
hold is read back (TensorBoard's `EventAccumulator`, `MlflowClient` on the `file:` store) and
compared with `metrics.jsonl` and the config. A run killed after its last checkpoint and resumed
continues the same tracker runs with no step logged twice. A missing package is an error naming
the `trackers` extra before the data is read; `import rankwise` imports neither package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tensorboard", reason="the trackers extra: pip install 'rankwise[trackers]'")
pytest.importorskip("mlflow", reason="the trackers extra: pip install 'rankwise[trackers]'")

from mlflow.tracking import MlflowClient  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData  # noqa: E402

import rankwise  # noqa: E402
from rankwise.training import (  # noqa: E402
    Callback,
    ConfigError,
    MLflowTracker,
    TensorBoardTracker,
    Trainer,
)

os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file: store only so


def expected_scalars(records):
    """What a tracker must hold, by name: [(step, value)] read from metrics.jsonl's records."""
    out = defaultdict(list)
    for r in records:
        kind, step = r["kind"], r["step"]
        if kind == "train":
            for name in ("loss", "lr", "samples_per_s"):
                out[f"train/{name}"].append((step, r[name]))
        elif kind in ("val", "test"):
            for name in ("map", "map_at_r", "r_precision", "mrr"):
                out[f"{kind}/{name}"].append((step, r[name]))
            for family in ("recall", "precision", "ndcg"):
                for k, value in r[f"{family}_at"].items():
                    out[f"{kind}/{family}_at_{k}"].append((step, value))
    return out


def read_jsonl(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def config_leaves(node, prefix=""):
    """Every leaf of the config dict, dotted."""
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from config_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def tensorboard_scalars(folder):
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc, {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
    }


def tensorboard_hparams(acc):
    for content in acc.PluginTagToContent("hparams").values():
        data = HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            return {
                key: value.string_value if value.HasField("string_value") else value.number_value
                for key, value in data.session_start_info.hparams.items()
            }
    return None


def mlflow_run(store_uri, run_dir):
    client = MlflowClient(tracking_uri=store_uri)
    run_id = json.loads((run_dir / "mlflow_run.json").read_text())["run_id"]
    return client, client.get_run(run_id)


def mlflow_scalars(client, run):
    return {
        key: [
            (m.step, m.value)
            for m in sorted(
                client.get_metric_history(run.info.run_id, key), key=lambda m: (m.step, m.timestamp)
            )
        ]
        for key in run.data.metrics
    }


def as_float32(pairs):
    """TensorBoard keeps a scalar as a float32."""
    return [(step, float(np.float32(value))) for step, value in pairs]


def test_the_trackers_hold_what_metrics_jsonl_and_the_config_hold(tiny_config, tmp_path):
    run = tmp_path / "run"
    config = tiny_config(run, **{"logging.trackers": ["tensorboard", "mlflow"], "log_every": 2})
    trainer = Trainer.from_config(config)
    kinds = [type(c) for c in trainer.callbacks]
    assert TensorBoardTracker in kinds and MLflowTracker in kinds
    result = trainer.fit()
    assert result.status == "completed"
    records = read_jsonl(run)
    expected = expected_scalars(records)
    assert {"train/loss", "train/lr", "val/map", "val/recall_at_1", "test/map"} <= expected.keys()

    # TensorBoard: <run>/tensorboard, every value of metrics.jsonl at its step, once
    acc, scalars = tensorboard_scalars(run / "tensorboard")
    for name, pairs in expected.items():
        assert scalars[name] == as_float32(pairs), name
    assert [e.step for e in acc.Images("test/pr_curve")] == [result.steps]
    leaves = dict(config_leaves(config.to_dict()))
    assert tensorboard_hparams(acc) == {
        key: float(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool)
        else (v if isinstance(v, str) else json.dumps(v))
        for key, v in leaves.items()
    }
    assert "optimizer: adam" not in leaves and "optimizer.name" in leaves  # dotted, one per leaf

    # MLflow: the file: store mlruns/ in the run folder, the same values exactly
    client, mlrun = mlflow_run((run / "mlruns").as_uri(), run)
    assert mlrun.info.status == "FINISHED"
    found = mlflow_scalars(client, mlrun)
    for name, pairs in expected.items():
        assert found[name] == pairs, name
    assert mlrun.data.params == {
        key: str(v)
        if isinstance(v, (str, int, float)) and not isinstance(v, bool)
        else json.dumps(v)
        for key, v in leaves.items()
    }
    artifacts = [a.path for a in client.list_artifacts(mlrun.info.run_id)]
    assert artifacts == ["pr_curve.png"]
    experiment = client.get_experiment(mlrun.info.experiment_id)
    assert experiment.name == "digits"


class CrashAt(Callback):
    """A crash (not a signal: no checkpoint) at the end of step ``step``."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer):
        if trainer.step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def test_a_resumed_run_continues_the_same_tracker_runs_without_a_step_twice(tiny_config, tmp_path):
    run, store = tmp_path / "run", (tmp_path / "shared-mlruns").as_uri()
    config = tiny_config(
        run,
        **{
            "logging.trackers": ["tensorboard", "mlflow"],
            "logging.mlflow_uri": store,  # a store outside the run folder, several runs share
            "log_every": 1,
            "eval_every": 4,
        },
    )
    with pytest.raises(RuntimeError, match="crash at step 7"):
        Trainer.from_config(config).fit(callbacks=[CrashAt(7)])
    run_id = json.loads((run / "mlflow_run.json").read_text())["run_id"]
    # the trackers hold steps 5-7, which the checkpoint (step 4) does not
    _, before = tensorboard_scalars(run / "tensorboard")
    assert [s for s, _ in before["train/loss"]] == list(range(1, 8))
    client, mlrun = mlflow_run(store, run)
    assert [s for s, _ in mlflow_scalars(client, mlrun)["train/loss"]] == list(range(1, 8))

    resumed = Trainer.from_run_dir(run)
    assert resumed.step == 4
    result = resumed.fit()
    assert result.status == "completed" and result.steps == 8
    expected = expected_scalars(read_jsonl(run))
    assert [s for s, _ in expected["train/loss"]] == list(range(1, 9))

    acc, scalars = tensorboard_scalars(run / "tensorboard")  # the same folder, purged at step 4
    for name, pairs in expected.items():
        assert scalars[name] == as_float32(pairs), name
    assert [e.step for e in acc.Images("test/pr_curve")] == [8]

    client, mlrun = mlflow_run(store, run)
    assert mlrun.info.run_id == run_id  # the same MLflow run, recorded in the run folder
    assert len(client.search_runs([mlrun.info.experiment_id])) == 1
    assert mlrun.info.status == "FINISHED"
    found = mlflow_scalars(client, mlrun)
    for name, pairs in expected.items():
        if name == "train/samples_per_s":  # a time: the killed process's values of steps 5-7 stay
            assert [s for s, _ in found[name]] == [s for s, _ in pairs]
            assert found[name][:4] == pairs[:4] and found[name][7:] == pairs[7:]
        else:  # steps 5-7 once: the resume recomputed the same values, bit for bit
            assert found[name] == pairs, name


@pytest.mark.parametrize(
    ("tracker", "module"), [("tensorboard", "tensorboard"), ("mlflow", "mlflow")]
)
def test_a_missing_tracker_package_names_the_extra_before_the_data_is_read(
    tiny_config, tmp_path, monkeypatch, tracker, module
):
    from rankwise._extras import MissingDependencyError
    from rankwise.training import assembly

    def no_data(*args):
        raise AssertionError("the data was read before the package check")

    monkeypatch.setattr(assembly, "_load_splits", no_data)
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    config = tiny_config(tmp_path / "run", **{"logging.trackers": [tracker]})
    with pytest.raises(MissingDependencyError, match=r"pip install 'rankwise\[trackers\]'") as info:
        Trainer.from_config(config)
    assert info.value.extra == "trackers" and "logging.trackers" in str(info.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_command_exits_3_naming_the_extra(tiny_config, tmp_path, monkeypatch):
    import yaml
    from typer.testing import CliRunner

    from rankwise.cli import build_app

    monkeypatch.setitem(sys.modules, "tensorboard", None)
    data = tiny_config.data(tmp_path / "run", **{"logging.trackers": ["tensorboard"]})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(build_app(), ["train", "--config", str(tmp_path / "c.yaml")])
    assert result.exit_code == 3, result.output
    assert "pip install 'rankwise[trackers]'" in " ".join(result.output.split())


def test_logging_trackers_is_checked(tiny_config, tmp_path):
    with pytest.raises(
        ConfigError, match=r"logging.trackers.0: Input should be 'tensorboard' or 'mlflow'"
    ):
        tiny_config(tmp_path, **{"logging.trackers": ["wandb"]})
    with pytest.raises(ConfigError, match="logging.trackers: mlflow listed twice"):
        tiny_config(tmp_path, **{"logging.trackers": ["mlflow", "mlflow"]})
    assert tiny_config(tmp_path).logging.trackers == []  # the default: none


class OtherRank:
    """The view of a process that is not the main one of a data-parallel run."""

    is_main_process = False
    step = 0
    history = [{"kind": "train", "step": 1, "loss": 0.5, "lr": 0.1}]
    record = {"seed": 0}
    run_dir = None


def test_only_the_main_process_logs(tmp_path):
    from rankwise.training.callbacks import StepOutput

    trackers = [
        TensorBoardTracker(log_dir=tmp_path / "tb"),
        MLflowTracker(tracking_uri=(tmp_path / "mlruns").as_uri()),
    ]
    view = OtherRank()
    for tracker in trackers:
        tracker.on_fit_start(view)
        tracker.on_train_step_end(view, StepOutput(1, 0, 0, 0.5, 0.1, 4))
        tracker.on_step_end(view)
        tracker.on_train_end(view)
    assert list(tmp_path.iterdir()) == []  # nothing written, no MLflow run made
    assert trackers[1].run_id is None


def test_importing_rankwise_imports_no_tracker_package():
    src = Path(rankwise.__file__).resolve().parents[1]
    code = (
        "import sys, rankwise, rankwise.training, rankwise.training.callbacks\n"
        "from rankwise.training import MLflowTracker, TensorBoardTracker\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorboard', 'mlflow')\n"
        "             or m.startswith('torch.utils.tensorboard')))\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def docs_section():
    text = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    return text.split("### Experiment trackers: TensorBoard and MLflow", 1)[1].split("\n## ", 1)[0]


def test_the_docs_config_and_command_are_valid(tiny_config, tmp_path):
    import shlex

    import yaml

    from rankwise.training import load_config

    block = yaml.safe_load(docs_section().split("```yaml\n", 1)[1].split("```", 1)[0])
    config = tiny_config(tmp_path, **block)
    assert config.logging.trackers == ["tensorboard", "mlflow"]
    assert config.logging.mlflow_uri is None

    commands = docs_section().split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    train = shlex.split(commands.splitlines()[0], comments=True)
    assert train[:4] == ["rankwise", "train", "--config", "configs/digits.yaml"]
    overrides = [arg for arg in train if "=" in arg]
    repo = Path(__file__).parents[2]
    config = load_config(repo / "configs" / "digits.yaml", overrides)
    assert config.logging.trackers == ["tensorboard", "mlflow"]
