"""Way in no. 2: the rankwise ``Trainer`` with your own model and your own data.

The trainer runs the loop of Wen et al. (NeurIPS 2022, Sec. 5.1): P x K batches, validation mAP
(tie-aware mAUPRC) every ``eval_every`` steps, the best model kept, a final test of that model;
with a ``run_dir`` it also writes atomic, bit-for-bit resumable checkpoints, ``metrics.jsonl``,
``report.json`` and plots. The data only has to be map-style datasets of ``(x, label)`` items
whose class ids the sampler can read (``TensorDataset(x, y)`` or a ``labels`` attribute).
Needs ``pip install 'rankwise[train]'``.

    python examples/trainer_own_model.py [--steps 300] [--run-dir runs/example]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from rankwise.losses import SOPRCLoss
from rankwise.training import Trainer


class Embedder(nn.Module):
    """Any network mapping a batch of inputs to (B, d) embeddings will do."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 64) pixels -> (B, d) embeddings."""
        return self.net(x)


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """Scikit-learn's digits, per class 60 % train, 20 % validation, 20 % test."""
    x, y = load_digits(return_X_y=True)
    rng = np.random.default_rng(seed)
    part = np.empty(len(y), dtype=np.int64)
    for label in np.unique(y):
        members = rng.permutation(np.flatnonzero(y == label))
        cut = np.array([0.6, 0.8]) * len(members)
        part[members] = np.searchsorted(cut, np.arange(len(members)), side="right")
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    return tuple(TensorDataset(x[part == k], y[part == k]) for k in range(3))  # type: ignore[return-value]


def main(steps: int = 300, run_dir: str | None = None, seed: int = 0) -> dict[str, float]:
    """Train with the Trainer; return the validation mAP of the untrained and selected model."""
    torch.manual_seed(seed)  # the model's initialisation is yours to seed
    train, val, test = digits(seed)
    model = Embedder()
    trainer = Trainer(
        model,
        SOPRCLoss.from_labels(train.tensors[1]),
        train,
        val_data=val,  # selects the model (leave-one-out mAP)
        test_data=test,  # tests the selected model
        run_dir=run_dir,  # None: nothing is written, everything stays in memory
        iterations=steps,
        eval_every=max(steps // 4, 1),
        eval_ks=(1, 10),
        seed=seed,
    )
    before = trainer.evaluate("val").map
    result = trainer.fit()
    print(
        f"validation mAP {before:.4f} untrained -> {result.best_val['map']:.4f} "
        f"(best step {result.best_step} of {result.steps})"
    )
    print(f"test of the selected model: {result.test}")
    return {"before": before, "after": result.best_val["map"], "test": result.test.map}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.steps, args.run_dir, args.seed)
