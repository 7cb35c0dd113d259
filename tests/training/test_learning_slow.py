"""Slow: training on digits actually learns. With the shipped configs/digits.yaml budget every
ranking loss of the papers must lift the validation mAP (held-out samples of the training classes)
far above the untrained network's, and keep a high R@1 on the unseen test classes.

(The test-class mAP is deliberately not asserted to beat the untrained network: with 5 training
classes the learned embedding specialises to them, and `rankwise bench` reports that comparison
in its reference rows — see docs/results.md.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from rankwise.training import Trainer, load_config
from rankwise.training.factory import train

pytestmark = pytest.mark.slow

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "digits.yaml"


@pytest.mark.parametrize("loss", ["soprc", "ap", "auc", "smooth_ap", "dir", "blackbox_ap"])
def test_digits_training_learns(tmp_path, loss):
    config = load_config(
        CONFIG, [f"loss.name={loss}", f"output_dir={tmp_path / 'run'}", "progress=false"]
    )
    untrained = Trainer.from_config(
        config.model_copy(update={"output_dir": str(tmp_path / "untrained")})
    )
    base_val = untrained.evaluate("val").map
    result = train(config)
    assert result.status == "completed"
    assert result.best_val["map"] > base_val + 0.2, (loss, base_val, result.best_val["map"])
    assert result.best_val["map"] > 0.9
    assert result.test.recall_at[1] > 0.8
