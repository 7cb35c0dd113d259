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

from rankwise.data import load_dataset
from rankwise.metrics import retrieval_metrics
from rankwise.models import build_model
from rankwise.training import config_from_dict, train

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ("sop.yaml", "inat2018.yaml", "vehicleid.yaml")
LOSSES = ("soprc", "ap", "auc", "smooth_ap")

TINY_OPTIONS = {"train_classes": 300, "val_classes": 0, "test_classes": 150}
TINY = {
    "dataset": {"name": "digits-instances", "protocol": "open-set", "options": TINY_OPTIONS},
    "model": {"backbone": "small_cnn", "embedding_dim": 32},
    "sampler": {"m": 4, "batch_size": 64},
    "optimizer": {"name": "adam", "lr": 1e-3},
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
