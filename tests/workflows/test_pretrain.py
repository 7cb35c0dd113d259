"""A pretrained start (issue 21): ``rankwise pretrain``, ``model.pretrained``, ``backbone_lr_mult``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rankwise.cli import build_app
from rankwise.data import load_dataset
from rankwise.data.instances import InstanceViews
from rankwise.models import build_model
from rankwise.training import ConfigError, Trainer
from rankwise.training.build import build_model_from_config, build_optimizer
from rankwise.training.config import OptimizerConfig
from rankwise.training.factory import build_trainer
from rankwise.workflows.pretrain import pretrain, source_split_hash

OPTIONS = {"train_classes": 60, "val_classes": 20, "test_classes": 40}
DATASET = {"name": "digits-instances", "options": OPTIONS}
MODEL = {"backbone": "small_cnn", "embedding_dim": 8}
# the tiny run of tests/conftest.py on the digits instances: AP, 4 x 4, 2 steps, on the CPU
CHANGES = {
    "dataset": DATASET,
    "loss.name": "ap",
    "sampler.batch_size": 16,
    "budget.iterations": 2,
    "log_every": 1,
    "device": "cpu",
}
INPUT_SHAPE = (1, 8, 8)


@pytest.fixture(scope="module")
def make_config(tiny_config):
    return lambda **sections: tiny_config(**{**CHANGES, **sections})


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """One tiny pretraining, the pool indices of the sources it drew views of, and its report."""
    output = tmp_path_factory.mktemp("pretrained")
    seen: list[np.ndarray] = []
    original = InstanceViews.batch

    def spy(self, indices, generator=None):
        views, labels = original(self, indices, generator)
        seen.append(self.source_ids[labels.numpy()])
        return views, labels

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InstanceViews, "batch", spy)
        report = pretrain(
            "digits-instances",
            output,
            steps=3,
            batch_size=16,
            embedding_dim=8,
            dataset_options=OPTIONS,
            threads=1,
        )
    return output, np.concatenate(seen), report


def test_pretrain_writes_the_weights_and_a_report(pretrained):
    output, _, report = pretrained
    stored = torch.load(output / "pretrained.pt", weights_only=True)
    assert stored["metadata"]["backbone"] == "small_cnn"
    assert stored["metadata"]["input_shape"] == list(INPUT_SHAPE)
    written = json.loads((output / "report.json").read_text())
    assert written["steps"] == 3 and 0.0 <= written["val_accuracy"] <= 1.0
    assert set(report["spread_scratch"]) == {"mean_negative_cosine", "embedding_spread"}


def test_pretrain_draws_views_of_training_sources_only(pretrained):
    output, seen, _ = pretrained
    splits = load_dataset("digits-instances", protocol="open-set", seed=0, **OPTIONS)
    assert set(seen) <= set(splits.train.source_ids)
    assert not set(seen) & (set(splits.val.source_ids) | set(splits.test.source_ids))
    metadata = torch.load(output / "pretrained.pt", weights_only=True)["metadata"]
    assert metadata["source_split_hash"] == source_split_hash(splits.train.source_ids)


def test_pretrain_refuses_to_overwrite(pretrained):
    output, _, _ = pretrained
    # (steps=1: zero steps is refused as no pretraining at all, before the folder is read)
    with pytest.raises(ConfigError, match="overwrite"):
        pretrain("digits-instances", output, steps=1, dataset_options=OPTIONS)
    with pytest.raises(ConfigError, match="steps: pretraining needs at least one step"):
        pretrain("digits-instances", output, steps=0, dataset_options=OPTIONS)


def test_model_pretrained_starts_from_the_stored_weights(pretrained, make_config):
    output, _, _ = pretrained
    state = torch.load(output / "pretrained.pt", weights_only=True)["model"]
    for where in (output, output / "pretrained.pt"):
        model = build_model_from_config(
            make_config(model={**MODEL, "pretrained": str(where)}), INPUT_SHAPE
        )
        for name, value in model.state_dict().items():
            assert torch.equal(value, state[name]), name


@pytest.mark.parametrize(
    ("model", "dataset", "named"),
    [
        ({"backbone": "mlp", "embedding_dim": 8}, DATASET, "backbone"),
        ({"backbone": "small_cnn", "embedding_dim": 16}, DATASET, "embedding_dim"),
        # the same pool split otherwise: its validation sources could be pretraining sources
        (
            {"backbone": "small_cnn", "embedding_dim": 8},
            {**DATASET, "split_seed": 1},
            "dataset",
        ),
    ],
)
def test_mismatched_pretrained_is_refused_naming_the_key(
    pretrained, model, dataset, named, make_config
):
    config = make_config(model={**model, "pretrained": str(pretrained[0])}, dataset=dataset)
    with pytest.raises(ConfigError, match=rf"model\.pretrained: .* {named}="):
        build_model_from_config(config, INPUT_SHAPE)


def test_backbone_lr_mult_gives_a_backbone_group_the_trainer_keeps(tmp_path, make_config):
    config = make_config(optimizer={"name": "adam", "lr": 1e-3, "backbone_lr_mult": 0.1})
    model = build_model_from_config(config, INPUT_SHAPE)
    optimizer = build_optimizer(config.optimizer, list(model.parameters()), model.backbone)
    head, backbone = optimizer.param_groups
    assert {id(p) for p in backbone["params"]} == {id(p) for p in model.backbone.parameters()}
    assert head["lr"] == 1e-3 and backbone["lr"] == pytest.approx(1e-4)
    # the trainer sets the scheduled rate every step: the backbone keeps its multiple (it was
    # overwritten by the head's rate before lr_mult)
    trainer = Trainer.from_config(config.model_copy(update={"output_dir": str(tmp_path / "r")}))
    trainer.fit(test=False)
    rates = [group["lr"] for group in trainer.optimizer.param_groups]
    assert rates == [1e-3, pytest.approx(1e-4)]


def test_default_config_trains_as_before(tmp_path, make_config):
    """No pretrained start, backbone_lr_mult 1: one parameter group, and the run is step for step
    the one every config made before the two options existed: the model as build_model makes it,
    a single-group Adam. Both runs are made here, in this process (constants measured on one CPU
    fail on another: oneDNN's AVX-512 convolutions round differently from its AVX2 ones)."""
    optimizer = build_optimizer(OptimizerConfig(), [torch.nn.Parameter(torch.zeros(1))])
    assert len(optimizer.param_groups) == 1 and "lr_mult" not in optimizer.param_groups[0]
    config = make_config(output_dir=str(tmp_path / "run"))
    trainer = Trainer.from_config(config)
    trainer.fit(test=False)

    def plain_model(input_shape):  # called after the config's seed is set, as the default is
        model = config.model
        return build_model(
            model.backbone, input_shape, model.embedding_dim, frozen_bn=model.frozen_bn
        )

    before = build_trainer(
        config.model_copy(update={"output_dir": str(tmp_path / "before")}), model=plain_model
    )
    params = [p for m in (before.model, before.loss_fn) for p in m.parameters() if p.requires_grad]
    before.optimizer = torch.optim.Adam(
        params, lr=config.optimizer.lr, weight_decay=config.optimizer.weight_decay
    )
    before.fit(test=False)

    def losses(run):
        return [record["loss"] for record in run.history if record["kind"] == "train"]

    assert len(losses(trainer)) == 2 and losses(trainer) == losses(before)
    reference = before.model.state_dict()
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, reference[name]), name


def test_rankwise_pretrain_command(tmp_path):
    args = ["pretrain", "-c", "configs/digits_instances.yaml", "-o", str(tmp_path), "--steps", "1"]
    args += [f"dataset.options.{key}={value}" for key, value in OPTIONS.items()]
    runner = CliRunner()
    first = runner.invoke(build_app(), args)
    assert first.exit_code == 0, first.output
    assert "wrote" in first.output and (tmp_path / "pretrained.pt").is_file()
    again = runner.invoke(build_app(), args)
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_a_pretraining_fits_runs_that_only_view_its_sources_differently(pretrained, make_config):
    # issue 21's study fine-tunes one pretraining at K = 2, 4, 8 views per source: the views, the
    # evaluation views and the augmentation do not change which sources are held out, so they are
    # not compared (refused before: "was pretrained with dataset=..., views_per_class: 2")
    views = {"views_per_class": 2, "eval_views_per_class": 3, "rotation": 10.0, "noise": 0.0}
    config = make_config(
        model={**MODEL, "pretrained": str(pretrained[0])},
        dataset={**DATASET, "options": {**OPTIONS, **views}},
    )
    model = build_model_from_config(config, INPUT_SHAPE)
    state = torch.load(pretrained[0] / "pretrained.pt", weights_only=True)["model"]
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # a split option still is: other validation / test sources could be pretraining sources
    config = make_config(
        model={**MODEL, "pretrained": str(pretrained[0])},
        dataset={**DATASET, "options": {**OPTIONS, "val_classes": 10}},
    )
    with pytest.raises(ConfigError, match=r"model\.pretrained: .* dataset="):
        build_model_from_config(config, INPUT_SHAPE)


# -- the pretraining runs in the Trainer's loop (issue 30): bit-identical to the loop it replaced ----


def _loop_before_issue_30(dataset, output, *, steps, batch_size, seed, embedding_dim, options):
    """A faithful copy of pretrain()'s own loop before it ran in the Trainer (main at 3f2bb05),
    threads, locking and the overwrite check left out: the reference the new code must equal."""
    from torch import nn

    from rankwise.models.build import backbone_width
    from rankwise.workflows.pretrain import (
        _accuracy,
        _categories,
        _forward,
        _spread,
        mean_negative_cosine,  # noqa: F401 - the same helpers as before
    )

    categories = _categories(dataset, None)
    splits = load_dataset(dataset, protocol="open-set", data_dir=None, seed=0, **options)
    train, val, test = splits.train, splits.val, splits.test
    torch.manual_seed(seed)
    model = build_model("small_cnn", train.input_shape, embedding_dim, frozen_bn=True)
    scratch = _spread(model, test)
    classes = int(categories.max()) + 1
    classifier = nn.Linear(backbone_width(model.backbone), classes)
    net = nn.Sequential(model.backbone, classifier)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    train_categories = torch.from_numpy(categories[train.source_ids])
    for _ in range(steps):
        net.train()
        items = torch.randint(len(train), (batch_size,), generator=generator)
        views, sources = train.batch(items, generator)
        loss = nn.functional.cross_entropy(net(views), train_categories[sources])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    report = {
        "dataset": dataset,
        "steps": steps,
        "final_loss": float(loss.detach()) if steps else None,
        "train_accuracy": _accuracy(
            _forward(net, train.batch(np.arange(len(train)), generator)[0]),
            train_categories[train.labels].numpy(),
        ),
        "val_accuracy": None,
        "spread_scratch": scratch,
        "spread_pretrained": _spread(model, test),
    }
    val_sources = np.asarray(val.source_ids, dtype=np.int64)[val.labels - val.labels.min()]
    report["val_accuracy"] = _accuracy(
        _forward(net, val.batch(np.arange(len(val)))[0]), categories[val_sources]
    )
    return model.state_dict(), report


TINY = {"steps": 7, "batch_size": 16, "seed": 3, "embedding_dim": 8}


def _assert_same_pretraining(output, state, report):
    stored = torch.load(output / "pretrained.pt", weights_only=True)
    assert stored["model"].keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(stored["model"][name], value), name
    written = json.loads((output / "report.json").read_text())
    assert {k: v for k, v in written.items() if k != "metadata"} == report


def test_pretraining_in_the_trainer_is_bit_identical_to_the_loop_it_replaced(tmp_path):
    state, expected = _loop_before_issue_30("digits-instances", tmp_path, options=OPTIONS, **TINY)
    report = pretrain(
        "digits-instances", tmp_path / "new", dataset_options=OPTIONS, threads=1, **TINY
    )
    assert report == expected  # every number, exactly (== on floats)
    _assert_same_pretraining(tmp_path / "new", state, expected)
    # the Trainer's run folder: a checkpoint at the last step, the loss of every step
    assert torch.load(tmp_path / "new" / "checkpoints" / "last.pt", weights_only=True)["step"] == 7
    assert json.loads((tmp_path / "new" / "pretrain.json").read_text())["steps"] == 7


def test_an_interrupted_pretraining_resumes_bit_for_bit(tmp_path):
    from rankwise.training import TrainingInterrupted
    from rankwise.workflows.pretrain import resume_pretraining

    state, expected = _loop_before_issue_30("digits-instances", tmp_path, options=OPTIONS, **TINY)

    def stop_at_3(trainer):  # the in-process stand-in for Ctrl-C / SIGTERM (as train's tests)
        if trainer.step == 3:
            trainer.request_stop()

    output = tmp_path / "interrupted"
    with pytest.raises(TrainingInterrupted) as info:
        pretrain(
            "digits-instances",
            output,
            dataset_options=OPTIONS,
            threads=1,
            callbacks=[stop_at_3],
            **TINY,
        )
    assert "pretraining interrupted (Ctrl-C) at step 3/7: checkpoint saved at step 3" in str(
        info.value
    )
    assert "resume_pretraining(" in str(info.value)
    assert not (output / "pretrained.pt").exists()
    with pytest.raises(ConfigError, match="already holds a run"):  # not silently restarted
        pretrain("digits-instances", output, dataset_options=OPTIONS, threads=1, **TINY)
    with pytest.raises(ConfigError, match=r"steps=7 \(now 8\)"):
        pretrain(
            "digits-instances",
            output,
            dataset_options=OPTIONS,
            resume=True,
            **{**TINY, "steps": 8},
        )
    report = resume_pretraining(output)
    assert report == expected
    _assert_same_pretraining(output, state, expected)
    steps = [
        r["step"] for r in map(json.loads, (output / "metrics.jsonl").read_text().splitlines())
    ]
    assert steps == [7]  # a record every 10 steps and at the last: none repeated by the resume


def _pretrain_args(output, *extra):
    config = Path(__file__).resolve().parents[2] / "configs" / "digits_instances.yaml"
    args = ["pretrain", "-c", str(config), "-o", str(output), "--batch-size", "16", *extra]
    return (
        args
        + [f"dataset.options.{key}={value}" for key, value in OPTIONS.items()]
        + ["model.embedding_dim=8"]
    )


def test_sigterm_stops_rankwise_pretrain_with_a_checkpoint_and_resume_finishes_it(tmp_path):
    """SIGTERM (a scheduler's stop) in the middle of `rankwise pretrain`: exit 143, the command
    that continues it printed, and the resumed pretraining ends bit for bit where an
    uninterrupted one ends."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "stopped"
    command = [sys.executable, "-m", "rankwise", *_pretrain_args(out, "--steps", "120")]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    metrics = out / "metrics.jsonl"  # its first record is written at step 10 of 120
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.is_file() and metrics.stat().st_size:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    said = " ".join(proc.communicate(timeout=240)[0].split())
    assert proc.returncode == 143, said
    step = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert 10 <= step < 120, said
    assert f"pretraining interrupted (SIGTERM) at step {step}/120: checkpoint saved" in said
    assert f"Resume with: rankwise pretrain --resume {out}" in said
    assert not (out / "pretrained.pt").exists()

    runner = CliRunner()
    resumed = runner.invoke(build_app(), ["pretrain", "--resume", str(out)])
    assert resumed.exit_code == 0, resumed.output
    assert "resuming the pretraining" in resumed.output
    reference = runner.invoke(build_app(), _pretrain_args(tmp_path / "whole", "--steps", "120"))
    assert reference.exit_code == 0, reference.output
    report = json.loads((tmp_path / "whole" / "report.json").read_text())
    state = torch.load(tmp_path / "whole" / "pretrained.pt", weights_only=True)["model"]
    _assert_same_pretraining(out, state, {k: v for k, v in report.items() if k != "metadata"})


def test_rankwise_pretrain_messages(tmp_path):
    runner = CliRunner()
    done = runner.invoke(build_app(), _pretrain_args(tmp_path, "--steps", "2"))
    assert done.exit_code == 0, done.output
    line = [row for row in done.output.splitlines() if row.startswith("wrote")][0]
    # every accuracy formatted alike (the val accuracy was printed as 0.87625)
    assert re.search(r"train accuracy \d\.\d{3}, val accuracy \d\.\d{3}, test mean", line), line
    for extra, named in (
        (["--steps", "3"], "--steps"),
        (["seed=1"], "KEY=VALUE overrides"),
    ):
        refused = runner.invoke(build_app(), ["pretrain", "--resume", str(tmp_path), *extra])
        assert refused.exit_code == 2 and named in refused.output, refused.output
    missing = runner.invoke(build_app(), ["pretrain", "-o", str(tmp_path / "x")])
    assert missing.exit_code == 2 and "--config: pass the runs' config" in missing.output
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"junk")
    corrupt = runner.invoke(build_app(), ["pretrain", "--resume", str(tmp_path)])
    said = " ".join(corrupt.output.split())
    assert corrupt.exit_code == 2 and "last.pt is corrupt" in said, corrupt.output
    assert "start it afresh with --overwrite" in said and "rankwise train" not in said


def test_a_relative_model_pretrained_is_stored_absolute_and_resumes_from_anywhere(
    pretrained, tmp_path, monkeypatch
):
    """`rankwise train model.pretrained=<relative>` records the resolved path in config.yaml, so
    `rankwise train --resume RUN` from another directory finds the weights."""
    import yaml

    folder = pretrained[0]
    config = Path(__file__).resolve().parents[2] / "configs" / "digits_instances.yaml"
    run = tmp_path / "run"
    args = ["train", "-c", str(config), "-o", str(run), "budget.iterations=2", "eval_every=2"]
    args += [f"dataset.options.{key}={value}" for key, value in OPTIONS.items()]
    args += ["model.embedding_dim=8", "sampler.batch_size=16", f"model.pretrained={folder.name}"]
    monkeypatch.chdir(folder.parent)
    started = CliRunner().invoke(build_app(), [*args, "--max-steps", "1"])
    assert started.exit_code == 0, started.output
    stored = yaml.safe_load((run / "config.yaml").read_text())["model"]["pretrained"]
    assert stored == str(folder.resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resumed = CliRunner().invoke(build_app(), ["train", "--resume", str(run)])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((run / "report.json").read_text())["steps"] == 2


def test_rankwise_train_says_the_pretrained_start_and_the_backbone_rate_took_effect(
    pretrained, tmp_path
):
    config = Path(__file__).resolve().parents[2] / "configs" / "digits_instances.yaml"
    args = ["train", "-c", str(config), "-o", str(tmp_path / "run"), "budget.iterations=2"]
    args += [f"dataset.options.{key}={value}" for key, value in OPTIONS.items()]
    args += ["model.embedding_dim=8", "eval_every=2", "sampler.batch_size=16"]
    plain = CliRunner().invoke(build_app(), [*args, "-o", str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    assert "model.pretrained" not in plain.output and "backbone_lr_mult" not in plain.output
    args += [f"model.pretrained={pretrained[0]}", "optimizer.backbone_lr_mult=0.1"]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert (
        f"the model starts from the pretrained weights {pretrained[0] / 'pretrained.pt'} "
        "(model.pretrained); the backbone trains at 0.1 x the scheduled learning rate "
        "(optimizer.backbone_lr_mult; 0.0001 at optimizer.lr=0.001)"
    ) in said
