"""Way in no. 1: your own PyTorch loop with a rankwise loss and ``RetrievalMetric``.

Nothing of rankwise's training stack is used: a plain ``nn.Module``, a plain loop, the SOPRC
loss (Wen et al., NeurIPS 2022, Eq. 8 and Alg. 1) fed P x K batches by
``MPerClassBatchSampler``, and the exact tie-aware retrieval metrics of ``RetrievalMetric``.
Needs only ``pip install rankwise`` (plus scikit-learn for the bundled digits data).

    python examples/own_loop.py [--steps 300]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from rankwise.losses import SOPRCLoss
from rankwise.metrics import RetrievalMetric
from rankwise.sampling import MPerClassBatchSampler


def digits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Scikit-learn's 8x8 digits, 70 % of each class for training, 30 % held out."""
    x, y = load_digits(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    held_out = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        members = np.flatnonzero(y == label)
        held_out[members[: int(0.3 * len(members))]] = True
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    return TensorDataset(x[~held_out], y[~held_out]), TensorDataset(x[held_out], y[held_out])


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset) -> float:
    """Leave-one-out retrieval on ``data``: every sample queries all the others; returns mAP."""
    model.eval()
    metric = RetrievalMetric(ks=(1, 10))
    for x, y in DataLoader(data, batch_size=256):
        metric.update(model(x), y)
    report = metric.compute()
    model.train()
    return report.map


def main(steps: int = 300, seed: int = 0) -> dict[str, float]:
    """Train for ``steps`` steps; return the held-out mAP before and after."""
    torch.manual_seed(seed)
    train, held_out = digits(seed)
    labels = train.tensors[1]
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    loss_fn = SOPRCLoss.from_labels(labels)  # per-class priors and state from the training labels
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = MPerClassBatchSampler(labels, m=4, batch_size=40, seed=seed)  # 10 classes x 4

    before = evaluate(model, held_out)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)  # a new shuffle every epoch
        for batch in sampler:
            x, y = train[batch]
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    after = evaluate(model, held_out)
    print(f"held-out mAP (tie-aware): {before:.4f} untrained -> {after:.4f} after {steps} steps")
    return {"before": before, "after": after}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.steps, args.seed)
