"""Batch-hard triplet variants on the demo protocol (docs/losses.md, issue 21).

``rankwise bench --dataset digits-instances --quick`` trains 150 steps of 56 x 4 from scratch; this
script trains PML's batch-hard ``TripletMarginLoss`` there with the settings of Hermans et al.
(2017) that a config cannot express: embeddings without L2 normalisation (the head's ``normalize``
off and PML's ``LpDistance(normalize_embeddings=False)`` in the loss and the miner).

    python benchmarks/studies/triplet_variants.py VARIANT [OUT]

VARIANT joins ``raw`` (no normalisation) or ``norm``, ``soft`` (soft margin), ``m0.2`` (margin 0.2)
and ``lr3e-4`` (else lr 1e-3), e.g. ``raw_soft_lr3e-4``. Prints the test report.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytorch_metric_learning.distances as pml_distances
import pytorch_metric_learning.losses as pml_losses
import pytorch_metric_learning.miners as pml_miners

from rankwise.models.build import build_model
from rankwise.training.config import load_config
from rankwise.training.factory import build_trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits_instances.yaml"


def _default_unnormalized_distance(cls: type) -> None:
    """Make ``cls`` default to the Euclidean distance of raw (unnormalised) embeddings."""
    original = cls.__init__

    @functools.wraps(original)  # keeps the signature rankwise checks loss parameters against
    def init(self, *args, **kwargs):
        kwargs.setdefault("distance", pml_distances.LpDistance(normalize_embeddings=False))
        original(self, *args, **kwargs)

    cls.__init__ = init


def main(variant: str, out: str) -> None:
    """Train and test one variant; the run folder is ``out/<variant>``."""
    normalize = "raw" not in variant
    overrides = [
        "loss.name=triplet",
        "budget.iterations=150",
        "eval_every=50",
        f"optimizer.lr={3e-4 if 'lr3e-4' in variant else 1e-3}",
        f"output_dir={Path(out) / variant}",
    ]
    if "soft" in variant:
        overrides.append("loss.params.smooth_loss=true")
    if "m0.2" in variant:
        overrides.append("loss.params.margin=0.2")
    if not normalize:
        _default_unnormalized_distance(pml_losses.TripletMarginLoss)
        _default_unnormalized_distance(pml_miners.BatchHardMiner)
    config = load_config(CONFIG, overrides)

    def model(shape):
        return build_model(
            config.model.backbone, shape, config.model.embedding_dim, normalize=normalize
        )

    result = build_trainer(config, model=model, overwrite=True).fit()
    print(variant, result.test)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "runs/triplet_variants")
