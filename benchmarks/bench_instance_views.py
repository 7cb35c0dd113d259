"""Cost of drawing augmented-instance views beside the training step they feed.

The training split of an instance benchmark (``rankwise.data.instances``; many-class regime of
Wen et al., NeurIPS 2022, Sec. 6) draws a fresh random affine view plus pixel noise of every item
at every step. This script times, on one P x K batch of 224 items (56 sources x 4 views) of
``fashion-mnist-instances`` (28 x 28) and ``digits-instances`` (8 x 8), in the same process with
the calls interleaved so machine load affects them alike:

* ``loader``: one batch through the trainer's own path (DataLoader over ``SeededItems`` with the
  per-item seeds of ``PositionedBatches``, ``num_workers=0``) -- what a training step waits for;
* ``loader, no augmentation``: the same path over the un-augmented sources (the floor: indexing,
  per-item seeding, collation);
* ``views only``: 224 per-item views without the loader (``InstanceViews.__getitem__``);
* ``vectorised``: ``InstanceViews.batch`` (one ``grid_sample`` call for the batch);
* ``train step``: forward + backward + Adam step of the ``small_cnn`` embedding (64-d) with the
  ``ap`` loss on that batch.

Usage::

    python benchmarks/bench_instance_views.py            # prints a markdown table
    python benchmarks/bench_instance_views.py --threads 1 2 --repeats 20
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader

from rankwise.data import ArrayDataset, load_dataset
from rankwise.losses import build_loss
from rankwise.models import build_model
from rankwise.sampling import MPerClassBatchSampler
from rankwise.training.loader import PositionedBatches, SeededItems


def _loader(dataset, labels: np.ndarray) -> Callable[[], None]:
    sampler = MPerClassBatchSampler(labels, 4, 224, seed=0)
    items = SeededItems(dataset, reseed=getattr(dataset, "transform", None) is not None)
    batches = iter(DataLoader(items, batch_sampler=PositionedBatches(sampler, 0, 0, 0)))
    return lambda: next(batches)


def _cases(name: str) -> dict[str, Callable[[], None]]:
    splits = load_dataset(name, val_classes=0, test_classes=2)
    train = splits.train
    labels = train.labels
    plain = ArrayDataset(train.sources[torch.from_numpy(labels)], labels)  # same items, no views
    batch_idx = np.arange(224)
    model = build_model("small_cnn", train.input_shape, 64)
    loss_fn = build_loss("ap", train_labels=labels, num_classes=train.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = train.batch(batch_idx, torch.Generator().manual_seed(0))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    def views_only() -> None:
        for i in batch_idx:
            train[int(i)]

    return {
        "loader": _loader(train, labels),
        "loader, no augmentation": _loader(plain, labels),
        "views only": views_only,
        "vectorised": lambda: train.batch(batch_idx),
        "train step": step,
    }


def _time(cases: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    for fn in cases.values():  # warm up
        fn()
    samples: dict[str, list[float]] = {key: [] for key in cases}
    for _ in range(repeats):
        for key, fn in cases.items():  # interleaved
            start = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - start)
    return {key: statistics.median(v) for key, v in samples.items()}


def main() -> None:
    """Time every case per dataset and thread count and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--datasets", nargs="+", default=["fashion-mnist-instances", "digits-instances"]
    )
    args = parser.parse_args()
    print(
        f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"median of {args.repeats} interleaved repeats, batch 224 (56 x 4)\n"
    )
    print("| dataset | threads | case | ms / batch | share of loader + step |")
    print("|---|---|---|---|---|")
    for name in args.datasets:
        cases = _cases(name)
        for threads in args.threads:
            torch.set_num_threads(threads)
            t = _time(cases, args.repeats)
            total = t["loader"] + t["train step"]
            for key, seconds in t.items():
                share = f"{100 * seconds / total:.0f} %" if key != "vectorised" else "-"
                print(f"| {name} | {threads} | {key} | {1e3 * seconds:.1f} | {share} |")


if __name__ == "__main__":
    main()
