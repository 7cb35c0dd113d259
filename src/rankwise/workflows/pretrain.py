"""A pretrained start: train the backbone on a disjoint task before a ranking loss fine-tunes it.

Wen et al. (NeurIPS 2022, App. D.1) fine-tune an ImageNet-pretrained ResNet-50, so their embeddings
start spread out; a run here starts from random weights. :func:`pretrain` trains the backbone of an
instance benchmark (:mod:`rankwise.data.instances`) with cross-entropy on its categories, from the
**training sources only** (test sources never touched), and writes ``pretrained.pt`` and
``report.json`` (docs/training.md, "A pretrained start"). No ranking equation is implemented here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..data import DATASET_ALIASES, INSTANCE_DATASETS, ArrayDataset, load_dataset
from ..data.instances import InstanceViews
from ..data.registry import read_images
from ..models import build_model
from ..models.build import backbone_width
from ..training.callbacks import embedding_spread
from ..training.checkpoint import atomic_save
from ..training.config import ConfigError
from ..training.lock import lock_run_dir
from .sweep import write_json

__all__ = ["PRETRAINED_FILE", "mean_negative_cosine", "pretrain", "source_split_hash"]

PRETRAINED_FILE = "pretrained.pt"


def source_split_hash(source_ids: np.ndarray) -> str:
    """First 16 hex digits of the SHA-256 of the training sources' pool indices (int64)."""
    return hashlib.sha256(np.asarray(source_ids, dtype=np.int64).tobytes()).hexdigest()[:16]


def mean_negative_cosine(embeddings: torch.Tensor, labels: np.ndarray) -> float:
    """Mean cosine of the pairs of ``embeddings`` (N, d) with different ``labels`` (N,)."""
    unit = nn.functional.normalize(embeddings.detach().float(), dim=1)
    label = torch.as_tensor(np.asarray(labels))
    negative = label[:, None] != label[None, :]
    return float((unit @ unit.T)[negative].mean())


def _categories(dataset: str, data_dir: str | None) -> np.ndarray:
    """Category label of every image of the pool the training sources are drawn from."""
    if dataset not in INSTANCE_DATASETS:
        raise ConfigError(
            f"dataset: pretraining needs an instance benchmark (its sources' categories are the "
            f"disjoint task), one of {sorted(INSTANCE_DATASETS)}; got {dataset!r}."
        )
    return np.asarray(read_images(INSTANCE_DATASETS[dataset], data_dir)[1], dtype=np.int64)


@torch.no_grad()
def _forward(net: nn.Module, inputs: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    net.eval()
    return torch.cat([net(inputs[i : i + batch_size]) for i in range(0, len(inputs), batch_size)])


def _accuracy(logits: torch.Tensor, categories: np.ndarray) -> float:
    return float((logits.argmax(1).numpy() == categories).mean())


def _spread(model: nn.Module, test: ArrayDataset) -> dict[str, float]:
    embeddings = _forward(model, test.batch(np.arange(len(test)))[0])
    return {
        "mean_negative_cosine": mean_negative_cosine(embeddings, test.labels),
        "embedding_spread": embedding_spread(embeddings),
    }


def pretrain(
    dataset: str,
    output: str | Path,
    *,
    steps: int = 400,
    lr: float = 1e-3,
    batch_size: int = 128,
    seed: int = 0,
    embedding_dim: int = 64,
    backbone: str = "small_cnn",
    frozen_bn: bool = True,
    dataset_options: Mapping[str, Any] | None = None,
    split_seed: int = 0,
    data_dir: str | None = None,
    threads: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train ``backbone`` with cross-entropy on the categories of ``dataset``'s training sources.

    Args:
        dataset: an instance benchmark, e.g. ``"fashion-mnist-instances"``.
        output: folder for ``pretrained.pt`` and ``report.json`` (locked while written).
        steps: Adam steps of ``batch_size`` fresh views of random training sources.
        lr: Adam's learning rate.
        batch_size: views per step.
        seed: seed of the weights, the batches and the views.
        embedding_dim: the embedding model's ``embedding_dim`` (its head stays as initialised).
        backbone: the embedding model's backbone name.
        frozen_bn: the embedding model's ``frozen_bn``.
        dataset_options: ``dataset.options`` of the runs to fine-tune (the same sources).
        split_seed: ``dataset.split_seed`` of those runs.
        data_dir: ``dataset.data_dir``.
        threads: torch intra-op threads (``None`` keeps the default).
        overwrite: replace an existing ``pretrained.pt``.

    Returns:
        The report (also written to ``report.json``).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    options = dict(dataset_options or {})
    dataset = DATASET_ALIASES.get(dataset.lower(), dataset.lower())
    categories = _categories(dataset, data_dir)
    splits = load_dataset(
        dataset, protocol="open-set", data_dir=data_dir, seed=split_seed, **options
    )
    train, val, test = splits.train, splits.val, splits.test
    # what build_instance_splits returns (source_ids: the pool index of each split's classes)
    assert isinstance(train, InstanceViews) and isinstance(test, ArrayDataset)
    assert val is None or isinstance(val, ArrayDataset)
    output = Path(output)
    with lock_run_dir(output, "output"):
        if (output / PRETRAINED_FILE).exists() and not overwrite:
            raise ConfigError(
                f"output: {output / PRETRAINED_FILE} exists; pass `overwrite` to replace it."
            )
        torch.manual_seed(seed)
        model = build_model(backbone, train.input_shape, embedding_dim, frozen_bn=frozen_bn)
        scratch = _spread(model, test)
        classes = int(categories.max()) + 1
        classifier = nn.Linear(backbone_width(model.backbone), classes)
        net = nn.Sequential(model.backbone, classifier)
        optimizer = torch.optim.Adam(net.parameters(), lr=lr)
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
        if val is not None:
            val_ids = val.source_ids  # type: ignore[attr-defined]  # build_instance_splits sets it
            val_sources = np.asarray(val_ids, dtype=np.int64)[val.labels - val.labels.min()]
            report["val_accuracy"] = _accuracy(
                _forward(net, val.batch(np.arange(len(val)))[0]), categories[val_sources]
            )
        metadata = {
            "backbone": backbone,
            "embedding_dim": embedding_dim,
            "frozen_bn": frozen_bn,
            "input_shape": list(train.input_shape),
            "dataset": {"name": dataset, "split_seed": split_seed, "options": options},
            "steps": steps,
            "seed": seed,
            "source_split_hash": source_split_hash(train.source_ids),
        }
        atomic_save({"model": model.state_dict(), "metadata": metadata}, output / PRETRAINED_FILE)
        write_json(report | {"metadata": metadata}, output / "report.json")
    return report
