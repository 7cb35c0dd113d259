"""Learning in the many-class regime SOPRC exists for (Wen et al., NeurIPS 2022, Sec. 5: SOP,
iNaturalist, VehicleID — thousands of classes of a few images, so a class holds ~1e-4 of the data).

A tiny augmented-instance problem stands in for it: 300 source digits are 300 training classes of
4 fresh views each (π = 3/1199), tested open-set on 150 unseen sources. Within a small budget
every ranking loss of the papers must lift the test mAP well above the untrained network's and
never collapse (the trainer raises ``CollapsedEmbeddingsError`` when every score ties). This is
the regression test of issue 7: SOPRC with the raw class prior ~1e-4 and Adam's coupled weight
decay collapsed on exactly this kind of problem.

The slow tests run each shipped GPU recipe (configs/sop.yaml, inat2018.yaml, vehicleid.yaml) on
the same proxy at its own loss and optimizer settings, scaled down: fewer steps (milestones
scaled alike), a small CNN instead of the ImageNet ResNet-50 and the instance data instead of the
real dataset (see ``recipe_on_proxy``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from rankwise.data import load_dataset
from rankwise.metrics import retrieval_metrics
from rankwise.models import build_model
from rankwise.training import CollapsedEmbeddingsError, config_from_dict, train
from rankwise.training.config import apply_overrides

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("sop.yaml", "inat2018.yaml", "vehicleid.yaml")
LOSSES = ("soprc", "ap", "auc", "smooth_ap")

TINY_OPTIONS = {"train_classes": 300, "val_classes": 0, "test_classes": 150}
TINY = {
    "dataset": {"name": "digits-instances", "protocol": "open-set", "options": TINY_OPTIONS},
    "model": {"backbone": "small_cnn", "embedding_dim": 32},
    "sampler": {"m": 4, "batch_size": 64},
    # the paper's weight decay, decoupled (Adam's coupled L2 collapses SOPRC at small priors)
    "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 4e-4},
    "eval_ks": [1],
    "eval_batch_size": 512,
    "progress": False,
    "threads": 1,
    "device": "cpu",
    "num_workers": 0,
    "seed": 0,
}
FAST_STEPS = 80


@pytest.fixture(scope="module")
def splits():
    return load_dataset("digits-instances", protocol="open-set", seed=0, **TINY_OPTIONS)


def untrained_map(config, splits) -> float:
    """Test mAP of the network the run starts from (the trainer seeds the init with the seed)."""
    torch.manual_seed(config.seed)
    model = build_model(
        config.model.backbone, tuple(splits.train.input_shape), config.model.embedding_dim
    ).eval()
    loader = torch.utils.data.DataLoader(splits.test, batch_size=512)
    with torch.no_grad():
        embeddings = torch.cat([model(x) for x, _ in loader])
    labels = np.asarray(splits.test.labels)
    return float(retrieval_metrics(embeddings, labels, ks=[1]).map)


def run(data, splits, tmp_path):
    config = config_from_dict({**data, "output_dir": str(tmp_path / "run")})
    result = train(config, splits=splits)  # raises CollapsedEmbeddingsError on a collapse
    assert result.status == "completed"
    return float(result.test.map), untrained_map(config, splits)


@pytest.mark.parametrize("loss", LOSSES)
def test_every_ranking_loss_learns_in_the_many_class_regime(splits, tmp_path, loss):
    data = copy.deepcopy(TINY)
    data.update(
        loss={"name": loss, "params": {}},
        budget={"iterations": FAST_STEPS},
        eval_every=FAST_STEPS,
        log_every=FAST_STEPS,
    )
    trained, untrained = run(data, splits, tmp_path)
    assert trained > untrained + 0.08 and trained > 1.8 * untrained, (loss, untrained, trained)


@pytest.mark.parametrize(
    ("params", "learns"),
    [({"start_iteration": 0, "batch_loss": False}, False), ({}, True)],
    ids=["pml-form", "default-released-form"],
)
def test_xbm_needs_its_warm_up_from_scratch(splits, tmp_path, params, learns):
    """PML's CrossBatchMemory from the first step collapses a network trained from scratch (every
    embedding to one direction: test mAP below the untrained network's); the released XBM code's
    warm-up + batch term, the default since issue 21 (75 warm-up steps), trains."""
    data = copy.deepcopy(TINY)
    steps = 2 * FAST_STEPS
    data.update(
        loss={"name": "xbm", "params": params},
        budget={"iterations": steps},
        eval_every=steps,
        log_every=steps,
    )
    trained, untrained = run(data, splits, tmp_path)
    if learns:
        assert trained > untrained + 0.08 and trained > 1.8 * untrained, (untrained, trained)
    else:
        assert trained < untrained, (untrained, trained)


def test_the_issue_7_setting_collapses_and_the_trainer_says_why(splits, tmp_path):
    """Raw class priors, the released TPR term and Adam's coupled weight decay (the setting that
    collapsed on the SOP-shaped proxy): the loss gradient is ~1e-4 of the biased AP loss's, the
    decay term wins for every weight, and the run is stopped with the causes and fixes named."""
    data = copy.deepcopy(TINY)
    data.update(
        loss={"name": "soprc", "params": {"prior_scale": None, "tpr_count": "num_v"}},
        optimizer={"name": "adam", "lr": 1e-3, "weight_decay": 4e-4},
        budget={"iterations": 150},
        eval_every=150,
        log_every=150,
    )
    with pytest.raises(CollapsedEmbeddingsError) as info:
        run(data, splits, tmp_path)
    message = str(info.value)
    assert "optimizer.name=adamw" in message and "prior_scale=0.1" in message
    assert info.value.step < 100


# -- the shipped GPU recipes on the proxy ---------------------------------------------------------

# The recipes' learning rates fine-tune an ImageNet ResNet-50 over 50k-130k steps; a small CNN
# trained from scratch for a few hundred steps needs a larger one (SGD at 0.01 leaves the AP loss
# at the untrained network's mAP after 100 steps here), so the proxy uses this learning rate per
# optimizer family and keeps everything else of the recipe. The paper tunes the learning rate per
# dataset on validation; SOPRC under SGD needs a larger one than the other losses here (proxy test
# mAP of inat2018.yaml's SOPRC after 300 steps: lr 0.05 -> 9.3 = the untrained network, 0.15 ->
# 34.2, 0.5 -> 5.8), so it gets its own.
PROXY_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}
PROXY_SGD_LR = {"soprc": 0.15}
# 600 steps: sop.yaml decays its lr at 30 % of the budget (15k of 50k); at 300 steps that is step
# 90, before a from-scratch network leaves the loss's initial plateau (about step 100-120), and
# SOPRC stays at the untrained mAP (7.57 vs 9.25); at 600 it reaches 34.62 (docs/losses.md).
RECIPE_STEPS = 600


def recipe_on_proxy(name: str, loss: str, steps: int = RECIPE_STEPS) -> dict:
    """The recipe ``configs/<name>`` scaled down to the tiny proxy.

    Kept: the loss parameters (for ``loss`` = the recipe's loss; other losses take the recipe's
    ``bench.overrides`` for them), the optimizer (name, momentum, weight decay), the schedule
    shape (milestones scaled with the budget) and P x K's K. Replaced: the data (tiny instance
    problem), the model (small CNN, 32-d), the batch (16 classes x K), the budget, and the
    learning rate (``PROXY_LR``, ``PROXY_SGD_LR``).
    """
    data = yaml.safe_load((ROOT / "configs" / name).read_text())
    proxy = copy.deepcopy(TINY)
    if loss != data["loss"]["name"]:
        data["loss"] = {"name": loss, "params": {}}
        overrides = data.get("bench", {}).get("overrides", {}).get(loss, {})
        data = apply_overrides(data, overrides)
    proxy["loss"] = data["loss"]
    optimizer = dict(data["optimizer"])
    optimizer["lr"] = PROXY_LR[optimizer["name"]]
    if optimizer["name"] == "sgd":
        optimizer["lr"] = PROXY_SGD_LR.get(loss, optimizer["lr"])
    proxy["optimizer"] = optimizer
    schedule = dict(data.get("schedule", {"name": "none"}))
    if schedule.get("name") == "multistep":
        total = data["budget"]["iterations"]
        schedule["milestones"] = sorted(
            {max(1, round(m * steps / total)) for m in schedule["milestones"]}
        )
    proxy["schedule"] = schedule
    proxy["sampler"] = {"m": data["sampler"]["m"], "batch_size": 16 * data["sampler"]["m"]}
    proxy.update(budget={"iterations": steps}, eval_every=steps, log_every=steps)
    return proxy


RECIPE_CASES = [
    pytest.param(recipe, loss, id=f"{recipe}-{loss}") for recipe in RECIPES for loss in LOSSES
]


@pytest.mark.slow
@pytest.mark.parametrize(("recipe", "loss"), RECIPE_CASES)
def test_every_shipped_recipe_trains_on_the_proxy(splits, tmp_path, recipe, loss):
    trained, untrained = run(recipe_on_proxy(recipe, loss), splits, tmp_path)
    assert trained > untrained + 0.08 and trained > 1.8 * untrained, (recipe, loss, trained)
