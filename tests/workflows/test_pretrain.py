"""A pretrained start (issue 21): ``rankwise pretrain``, ``model.pretrained``, ``backbone_lr_mult``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rankwise.cli import build_app
from rankwise.data import load_dataset
from rankwise.data.instances import InstanceViews
from rankwise.models import build_model
from rankwise.training import ConfigError, Trainer, config_from_dict
from rankwise.training.build import build_model_from_config, build_optimizer
from rankwise.training.config import OptimizerConfig
from rankwise.training.factory import build_trainer
from rankwise.workflows.pretrain import pretrain, source_split_hash

OPTIONS = {"train_classes": 60, "val_classes": 20, "test_classes": 40}
BASE = {
    "dataset": {"name": "digits-instances", "options": OPTIONS},
    "model": {"backbone": "small_cnn", "embedding_dim": 8},
    "loss": {"name": "ap", "params": {}},
    "sampler": {"m": 4, "batch_size": 16},
    "budget": {"iterations": 2},
    "eval_every": 2,
    "log_every": 1,
    "eval_ks": [1],
    "seed": 0,
    "progress": False,
    "threads": 1,
    "device": "cpu",
}
INPUT_SHAPE = (1, 8, 8)


def _config(**sections):
    return config_from_dict({**BASE, **sections})


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
    with pytest.raises(ConfigError, match="overwrite"):
        pretrain("digits-instances", output, steps=0, dataset_options=OPTIONS)


def test_model_pretrained_starts_from_the_stored_weights(pretrained):
    output, _, _ = pretrained
    state = torch.load(output / "pretrained.pt", weights_only=True)["model"]
    for where in (output, output / "pretrained.pt"):
        model = build_model_from_config(
            _config(model={**BASE["model"], "pretrained": str(where)}), INPUT_SHAPE
        )
        for name, value in model.state_dict().items():
            assert torch.equal(value, state[name]), name


@pytest.mark.parametrize(
    ("model", "dataset", "named"),
    [
        ({"backbone": "mlp", "embedding_dim": 8}, BASE["dataset"], "backbone"),
        ({"backbone": "small_cnn", "embedding_dim": 16}, BASE["dataset"], "embedding_dim"),
        # the same pool split otherwise: its validation sources could be pretraining sources
        (
            {"backbone": "small_cnn", "embedding_dim": 8},
            {**BASE["dataset"], "split_seed": 1},
            "dataset",
        ),
    ],
)
def test_mismatched_pretrained_is_refused_naming_the_key(pretrained, model, dataset, named):
    config = _config(model={**model, "pretrained": str(pretrained[0])}, dataset=dataset)
    with pytest.raises(ConfigError, match=rf"model\.pretrained: .* {named}="):
        build_model_from_config(config, INPUT_SHAPE)


def test_backbone_lr_mult_gives_a_backbone_group_the_trainer_keeps(tmp_path):
    config = _config(optimizer={"name": "adam", "lr": 1e-3, "backbone_lr_mult": 0.1})
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


def test_default_config_trains_as_before(tmp_path):
    """No pretrained start, backbone_lr_mult 1: one parameter group, and the run is step for step
    the one every config made before the two options existed: the model as build_model makes it,
    a single-group Adam. Both runs are made here, in this process (constants measured on one CPU
    fail on another: oneDNN's AVX-512 convolutions round differently from its AVX2 ones)."""
    optimizer = build_optimizer(OptimizerConfig(), [torch.nn.Parameter(torch.zeros(1))])
    assert len(optimizer.param_groups) == 1 and "lr_mult" not in optimizer.param_groups[0]
    config = _config(output_dir=str(tmp_path / "run"))
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


def test_a_pretraining_fits_runs_that_only_view_its_sources_differently(pretrained):
    # issue 21's study fine-tunes one pretraining at K = 2, 4, 8 views per source: the views, the
    # evaluation views and the augmentation do not change which sources are held out, so they are
    # not compared (refused before: "was pretrained with dataset=..., views_per_class: 2")
    views = {"views_per_class": 2, "eval_views_per_class": 3, "rotation": 10.0, "noise": 0.0}
    config = _config(
        model={**BASE["model"], "pretrained": str(pretrained[0])},
        dataset={**BASE["dataset"], "options": {**OPTIONS, **views}},
    )
    model = build_model_from_config(config, INPUT_SHAPE)
    state = torch.load(pretrained[0] / "pretrained.pt", weights_only=True)["model"]
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # a split option still is: other validation / test sources could be pretraining sources
    config = _config(
        model={**BASE["model"], "pretrained": str(pretrained[0])},
        dataset={**BASE["dataset"], "options": {**OPTIONS, "val_classes": 10}},
    )
    with pytest.raises(ConfigError, match=r"model\.pretrained: .* dataset="):
        build_model_from_config(config, INPUT_SHAPE)
