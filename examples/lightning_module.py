"""A rankwise loss and ``RetrievalMetric`` inside a PyTorch Lightning ``LightningModule``.

The loss is an ``nn.Module`` child of the LightningModule, so Lightning moves its state (SOPRC's
per-class vector ``v``) with the model and saves it in Lightning checkpoints; the metric
accumulates the validation embeddings and computes the exact tie-aware report once per
validation epoch. P x K batches come from rankwise's ``MPerClassBatchSampler`` as the loader's
``batch_sampler`` (Lightning must not replace it: ``use_distributed_sampler=False``).
Needs ``pip install 'rankwise[lightning]'`` (lightning beside the installed torch).

    python examples/lightning_module.py [--steps 300]
"""

from __future__ import annotations

import argparse

import lightning as L
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


class RankingModule(L.LightningModule):
    """An embedding network trained with SOPRC and validated by leave-one-out mAP."""

    def __init__(self, train_labels: torch.Tensor, lr: float = 1e-3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
        self.loss_fn = SOPRCLoss.from_labels(train_labels)  # a child module: state moves with it
        self.val_metric = RetrievalMetric(ks=(1, 10))
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 64) pixels -> (B, 32) embeddings."""
        return self.net(x)

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        """The rankwise loss of one P x K batch."""
        x, y = batch
        loss = self.loss_fn(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate the batch's embeddings in the metric."""
        x, y = batch
        self.val_metric.update(self(x), y)

    def on_validation_epoch_end(self) -> None:
        """Rank every held-out sample against all the others; log mAP and R@1."""
        report = self.val_metric.compute()
        self.val_metric.reset()
        self.log("val_map", report.map)
        self.log("val_recall_at_1", report.recall_at[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam over the network's parameters."""
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class EpochSampler(MPerClassBatchSampler):
    """MPerClassBatchSampler that starts a new shuffle at every pass.

    Lightning does not call ``set_epoch`` on a custom batch sampler.
    """

    def __iter__(self):
        """The batches of the current epoch, then advance to the next epoch."""
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


def main(steps: int = 300, seed: int = 0) -> dict[str, float]:
    """Train with Lightning for ``steps`` steps; return the held-out mAP before and after."""
    L.seed_everything(seed, verbose=False)
    train, held_out = digits(seed)
    labels = train.tensors[1]
    module = RankingModule(labels)
    sampler = EpochSampler(labels, m=4, batch_size=40, seed=seed)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=None,
        val_check_interval=steps,
    )
    val_loader = DataLoader(held_out, batch_size=256)
    before = trainer.validate(module, val_loader, verbose=False)[0]["val_map"]
    trainer.fit(module, DataLoader(train, batch_sampler=sampler), val_loader)
    after = float(trainer.callback_metrics["val_map"])
    print(f"held-out mAP (tie-aware): {before:.4f} untrained -> {after:.4f} after {steps} steps")
    return {"before": before, "after": after}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(args.steps, args.seed)
