"""``hash-euclidean-ndcg``: multi-level NDCG of linear hash functions with Euclidean affinities.

The LabelMe experiment of He, Cakir, Bargal & Sclaroff, "Hashing as Tie-Aware Learning to Rank"
(CVPR 2018), Sec. 5.3 and Table 3: without labels, affinities come from thresholded Euclidean
distances of the original features — pairs closer than the 5 %, 1 %, 0.2 % and 0.1 % quantiles of
the training pairs' distances get affinities 1, 2, 5 and 10 — and retrieval is scored by
tie-aware NDCG_T of the Hamming ranking with gain ``2^a - 1``. Hash functions are linear,
``f_i(x) = w_iᵀ x`` (a :class:`~rankwise.hashing.HashingHead` on the features).

Here on PCA-reduced Fashion-MNIST pixels instead of LabelMe's GIST descriptors, with LabelMe's
sizes; LSH, PCA + sign, DPSH and TALR-AP (binary affinities) against TALR-NDCG (exact and
released midpoint forms), every trained method on the library's Trainer with the same batches and
budget. The paper's claim (Table 3): TALR-NDCG has the highest NDCG at every code length. Settings
and results: docs/experiments.md.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._validation import Interval, check_choice, check_scalar
from .base import ExperimentResult, experiment, new_figure, parse_sequence, progress

__all__ = ["METHODS", "run"]

METHODS = ("lsh", "pca", "dpsh", "talr_ap", "talr_ndcg", "talr_ndcg_midpoint")
_TRAINED: dict[str, tuple[str, dict[str, Any]]] = {
    "dpsh": ("dpsh", {}),
    "talr_ap": ("tie_aware_ap", {}),
    "talr_ndcg": ("tie_aware_ndcg", {}),
    "talr_ndcg_midpoint": ("tie_aware_ndcg", {"form": "midpoint"}),
}
_QUANTILES = (0.05, 0.01, 0.002, 0.001)
_LEVELS = (1, 2, 5, 10)


class RandomBatches:
    """Uniformly random minibatches without replacement, a new permutation every epoch.

    The paper samples minibatches at random (Sec. 3.3); ``set_epoch`` makes the batches a
    function of ``(seed, epoch)`` so the Trainer resumes them exactly.

    Args:
        n: number of items.
        batch_size: items per batch (``n // batch_size`` batches per epoch).
        seed: seed of the permutations.
    """

    def __init__(self, n: int, batch_size: int, seed: int = 0) -> None:
        self.n = int(n)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.n // self.batch_size

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        for i in range(len(self)):
            yield order[i * self.batch_size : (i + 1) * self.batch_size].tolist()


def _load_pixels(dataset: str, n: int, seed: int) -> np.ndarray:
    """``n`` random images of ``dataset`` as flat float64 pixels in [0, 1]."""
    from ..data.registry import pixel_features, read_images  # noqa: PLC0415 - deferred: the CLI imports every experiment module

    rng = np.random.default_rng(seed)
    train_x, _, test_x, _ = read_images(dataset)
    images = pixel_features(train_x if test_x is None else np.concatenate([train_x, test_x]))
    if n > images.shape[0]:
        raise ValueError(f"{dataset!r} has {images.shape[0]} images; {n} were requested.")
    return images[rng.choice(images.shape[0], n, replace=False)].astype(np.float64)


def _split(pixels: np.ndarray, n_test: int, n_train: int, dims: int, seed: int):
    """Test / database / training features (PCA on the training set), LabelMe-style."""
    rng = np.random.default_rng(seed + 1)
    test, database = pixels[:n_test], pixels[n_test:]
    train_rows = rng.choice(database.shape[0], n_train, replace=False)
    mean = database[train_rows].mean(0)
    _, _, vt = np.linalg.svd(database[train_rows] - mean, full_matrices=False)
    basis = vt[:dims].T
    return (test - mean) @ basis, (database - mean) @ basis, train_rows


def _train_linear(method, bits, train_x, affinity, iterations, batch_size, lr, seed):
    """A linear hash function trained with ``method``'s loss on the Trainer; returns the model."""
    # deferred: the command line imports every experiment module to build its options
    import torch  # noqa: PLC0415
    from torch.utils.data import TensorDataset  # noqa: PLC0415

    from ..hashing import build_hashing_model  # noqa: PLC0415
    from ..losses import build_loss  # noqa: PLC0415
    from ..metrics.hamming import IndexedAffinity  # noqa: PLC0415
    from ..workflows.hashing import HashingTrainer  # noqa: PLC0415

    torch.manual_seed(seed)
    model = build_hashing_model("linear", (train_x.shape[1],), bits)
    name, params = _TRAINED[method]
    loss = build_loss(
        name, embedding_dim=bits, affinity=IndexedAffinity(train_x, affinity), **params
    )
    data = TensorDataset(
        torch.from_numpy(train_x).float(), torch.arange(train_x.shape[0], dtype=torch.int64)
    )
    # deterministic items: the Trainer skips per-item RNG seeding (a marker the loader reads)
    data.transform = None  # type: ignore[attr-defined]
    trainer = HashingTrainer(
        model,
        loss,
        data,
        optimizer=torch.optim.Adam(model.parameters(), lr=lr),
        sampler=RandomBatches(train_x.shape[0], batch_size, seed),
        iterations=iterations,
        seed=seed,
        progress=False,
        device="cpu",
    )
    trainer.fit(test=False)
    return model


def _codes(model, x: np.ndarray) -> np.ndarray:
    import torch  # noqa: PLC0415 - deferred: the CLI imports every experiment module

    with torch.no_grad():
        return model.eval()(torch.from_numpy(x).float()).numpy().astype(np.int8)


def _method_codes(method, bits, features, train_rows, affinity, options) -> tuple:
    """(test codes, database codes) of one method at one code length."""
    test_x, db_x = features
    scale = db_x[train_rows].std()  # one global scale: inputs of unit variance, same geometry
    if method == "pca":
        return np.where(test_x[:, :bits] >= 0, 1, -1), np.where(db_x[:, :bits] >= 0, 1, -1)
    if method == "lsh":
        rng = np.random.default_rng(options["seed"] + bits)
        w = rng.standard_normal((test_x.shape[1], bits))
        return np.where(test_x @ w >= 0, 1, -1), np.where(db_x @ w >= 0, 1, -1)
    model = _train_linear(
        method, bits, db_x[train_rows] / scale, _ScaledAffinity(affinity, scale), **options
    )
    return _codes(model, test_x / scale), _codes(model, db_x / scale)


class _ScaledAffinity:
    """The affinity of the unscaled features, called on features divided by ``scale``."""

    def __init__(self, affinity, scale: float) -> None:
        self.affinity = affinity
        self.scale = float(scale)
        self.max_level = affinity.max_level

    def __call__(self, a, b):
        return self.affinity(np.asarray(a) * self.scale, np.asarray(b) * self.scale)


def _check_options(bits, dataset, dims, iterations, batch_size, lr) -> tuple[int, ...]:
    bits = tuple(int(b) for b in parse_sequence(bits, "bits", int))
    if not bits or min(bits) < 1:
        raise ValueError(f"`bits` must be positive code lengths, got {bits}.")
    check_choice(dataset, "dataset", ("fashion-mnist", "mnist", "digits"))
    check_scalar(dims, "dims", Interval("integer", 1, None))
    if max(bits) > dims:
        raise ValueError(f"`bits` up to {max(bits)} need `dims` >= {max(bits)} (PCA + sign).")
    check_scalar(iterations, "iterations", Interval("integer", 1, None))
    check_scalar(batch_size, "batch_size", Interval("integer", 2, None))
    check_scalar(lr, "lr", Interval("real", 0, None, closed="neither"))
    return bits


@experiment(
    "hash-euclidean-ndcg",
    summary="Multi-level NDCG of linear hash functions with Euclidean-threshold affinities "
    "(TALR-NDCG vs LSH, PCA, DPSH, TALR-AP).",
    reference="He et al., CVPR 2018, Sec. 5.3, Table 3 (LabelMe)",
)
def run(
    *,
    quick: bool = False,
    seed: int = 0,
    bits: tuple[int, ...] = (16, 32, 48, 64),
    dataset: str = "fashion-mnist",
    dims: int = 128,
    iterations: int = 500,
    batch_size: int = 250,
    lr: float = 0.01,
) -> ExperimentResult:
    """Train and evaluate every method at every code length; NDCG_T by code length.

    Args:
        quick: a small version (400 training items, 1 code length, 30 iterations).
        seed: seed of the data sample, the initialisations and the batches.
        bits: Code lengths, comma-separated.
        dataset: fashion-mnist, mnist or digits (the images' pixels are the features).
        dims: PCA dimensions of the features (the hash functions' input).
        iterations: Training steps of every trained method.
        batch_size: Minibatch size (random minibatches, as in the paper).
        lr: Adam learning rate of the linear hash functions.
    """
    bits = _check_options(bits, dataset, dims, iterations, batch_size, lr)
    if quick:
        sizes, iterations, batch_size, dims = (200, 1500, 400), 30, 64, min(dims, 32)
        bits = tuple(b for b in bits if b <= dims)[:1] or (min(16, dims),)
    else:
        sizes = (2000, 20000, 5000)
    n_test, n_all, n_train = sizes[0], sizes[0] + sizes[1], sizes[2]
    pixels = _load_pixels(dataset, n_all, seed)
    test_x, db_x, train_rows = _split(pixels, n_test, n_train, dims, seed)
    from ..metrics import EuclideanThresholdAffinity, hamming_retrieval_metrics  # noqa: PLC0415 - deferred: the CLI imports every experiment module

    affinity = EuclideanThresholdAffinity.from_quantiles(db_x[train_rows], _QUANTILES, _LEVELS)
    options = {"seed": seed, "iterations": iterations, "batch_size": batch_size, "lr": lr}
    rows: list[dict[str, Any]] = []
    parts = progress(len(bits) * len(METHODS))  # a trained method takes 20-40 s at the defaults
    for b in bits:
        for method in METHODS:
            q_codes, db_codes = _method_codes(
                method, b, (test_x, db_x), train_rows, affinity, options
            )
            report = hamming_retrieval_metrics(
                q_codes, test_x, db_codes, db_x, ks=(100,), affinity=affinity
            )
            rows.append(
                {
                    "method": method,
                    "bits": b,
                    "ndcg": report.ndcg,
                    "ndcg_range": list(report.ndcg_range),
                    "ndcg_at_100": report.ndcg_at[100],
                    "map": report.map,
                    "queries_without_neighbour": report.n_queries_without_relevant,
                }
            )
            parts.advance(f"{method} {b} bits")
    return _result(rows, bits, affinity, sizes, dims, dataset, options)


def _result(rows, bits, affinity, sizes, dims, dataset, options) -> ExperimentResult:
    fig, axes = new_figure(size=(6.4, 4.2))
    ax = axes[0, 0]
    for method in METHODS:
        values = [r["ndcg"] for r in rows if r["method"] == method]
        ax.plot(bits, values, marker="o", label=method)
    ax.set(xlabel="bits", ylabel="tie-aware NDCG (test)")
    ax.set_title(f"Euclidean-threshold affinities, linear hash functions ({dataset})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    by = {(r["method"], r["bits"]): r["ndcg"] for r in rows}
    margins = [
        by[("talr_ndcg", b)] - max(by[(m, b)] for m in METHODS if not m.startswith("talr_ndcg"))
        for b in bits
    ]
    consistent = all(m > 0 for m in margins)
    verdict = (
        "hash-euclidean-ndcg: TALR-NDCG NDCG_T "
        + ", ".join(f"{by[('talr_ndcg', b)]:.4f}@{b}" for b in bits)
        + "; margin over the best non-TALR-NDCG method "
        + ", ".join(f"{m:+.4f}" for m in margins)
        + (
            " (highest at every code length, as in Table 3)"
            if consistent
            else " (NOT highest everywhere)"
        )
    )
    data = {
        "rows": rows,
        "bits": list(bits),
        "sizes": {"test": sizes[0], "database": sizes[1], "train": sizes[2]},
        "features": f"{dataset} pixels, PCA to {dims} dims (fitted on the training items)",
        "affinity": {**affinity.to_dict(), "quantiles": list(_QUANTILES)},
        "training": options,
    }
    return ExperimentResult("hash-euclidean-ndcg", data, verdict, consistent, fig)
