"""In-memory benchmark datasets: scikit-learn digits, MNIST, Fashion-MNIST and CIFAR-10.

Open-set protocol (metric learning, as in Wen et al., NeurIPS 2022, Sec. 6, and Gajić et al.,
Sec. 4.1): train on the lower half of the classes (0-4) of the training split, test on the upper
half (5-9) of the test split, leave-one-out. For ``digits`` (no official split) both halves come
from the single bundled set. Closed-set protocol (hashing, He et al., CVPR 2018, Sec. 5.1,
CIFAR-10 "setting 1"): ``n_query`` queries per class from the test split, the rest of the data is
the database, ``n_train`` training samples per class from the database; ``n_query=None,
n_train=None`` gives "setting 2" (the official test split as queries, all training data as both
database and training set). Images stay ``uint8`` in memory and are scaled to [0, 1] per item.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from .base import ArrayDataset, CorruptDatasetError, RetrievalSplits
from .idx import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx
from .locate import find_dataset_root
from .splits import closed_set_split, split_validation

__all__ = [
    "FASHION_MNIST_SYSTEM_DIR",
    "read_mnist_family",
    "read_cifar10",
    "read_digits_images",
    "load_digits_dataset",
    "load_mnist_family_dataset",
    "load_cifar10_dataset",
    "assemble_array_splits",
]

FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"

_IDX_STEMS = {
    "train_images": ("train-images-idx3-ubyte", "train-images.idx3-ubyte"),
    "train_labels": ("train-labels-idx1-ubyte", "train-labels.idx1-ubyte"),
    "test_images": ("t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"),
    "test_labels": ("t10k-labels-idx1-ubyte", "t10k-labels.idx1-ubyte"),
}


def _find_idx_file(folder: Path, stems: tuple[str, ...]) -> Path | None:
    for stem in stems:
        for suffix in ("", ".gz"):
            cand = folder / (stem + suffix)
            if cand.is_file():
                return cand
    return None


def read_mnist_family(
    name: str, data_dir: str | os.PathLike | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read the four IDX files of MNIST or Fashion-MNIST.

    Looks where :mod:`rankwise.data.locate` says (system copy: Fashion-MNIST's Debian package).

    Returns:
        ``(train_images (60000, 28, 28) uint8, train_labels (60000,) int64, test_images,
        test_labels)`` for the official files; any sizes are accepted if headers are consistent.
    """
    system = (FASHION_MNIST_SYSTEM_DIR,) if name == "fashion-mnist" else ()
    hint = (
        "On Debian/Ubuntu: `apt-get install dataset-fashion-mnist` installs the files into "
        f"{FASHION_MNIST_SYSTEM_DIR}."
        if name == "fashion-mnist"
        else ""
    )
    subfolders = (name, name.replace("-", "_"), name.upper())
    root = find_dataset_root(
        name,
        data_dir,
        markers=(),
        subfolders=subfolders,
        layout="\n".join(f"  <dir>/{stems[0]}[.gz]" for stems in _IDX_STEMS.values()),
        system_dirs=system,
        hint=hint,
        is_root=lambda d: all(_find_idx_file(d, st) is not None for st in _IDX_STEMS.values()),
    )
    files = {key: _find_idx_file(root, stems) for key, stems in _IDX_STEMS.items()}
    arrays = {}
    for key, path in files.items():
        assert path is not None  # find_dataset_root's is_root found every file
        magic = IDX_IMAGES_MAGIC if key.endswith("images") else IDX_LABELS_MAGIC
        arrays[key] = read_idx(path, magic)
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.shape[0] != labels.shape[0]:
            raise CorruptDatasetError(
                f"{files[f'{split}_images']} holds {images.shape[0]} images but "
                f"{files[f'{split}_labels']} holds {labels.shape[0]} labels; one of them is "
                "corrupt or from another dataset."
            )
        if labels.size and int(labels.max()) > 9:
            raise CorruptDatasetError(
                f"{files[f'{split}_labels']} holds label {int(labels.max())}; MNIST-family labels "
                "are 0-9, the file is corrupt."
            )
    return (
        arrays["train_images"],
        arrays["train_labels"].astype(np.int64),
        arrays["test_images"],
        arrays["test_labels"].astype(np.int64),
    )


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays: a CIFAR batch cannot run arbitrary code."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
    }

    def find_class(self, module: str, name: str):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a dataset pickle")


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as f:
            batch = _NumpyOnlyUnpickler(f, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise CorruptDatasetError(
            f"CIFAR-10 batch {str(path)!r} could not be unpickled ({exc}); it is truncated or "
            "not a CIFAR-10 python batch, re-extract cifar-10-python.tar.gz."
        ) from exc
    if not isinstance(batch, dict):
        raise CorruptDatasetError(f"CIFAR-10 batch {str(path)!r} does not hold a dict.")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if data is None or labels is None:
        raise CorruptDatasetError(
            f"CIFAR-10 batch {str(path)!r} lacks the 'data' or 'labels' entry."
        )
    data = np.asarray(data)
    labels = np.asarray(labels, dtype=np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise CorruptDatasetError(
            f"CIFAR-10 batch {str(path)!r}: 'data' must be uint8 (N, 3072), got {data.dtype} "
            f"{data.shape}."
        )
    if labels.shape != (data.shape[0],) or (
        labels.size and not 0 <= labels.min() <= labels.max() <= 9
    ):
        raise CorruptDatasetError(
            f"CIFAR-10 batch {str(path)!r}: 'labels' must be {data.shape[0]} ids in 0-9."
        )
    return data.reshape(-1, 3, 32, 32), labels


_CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


def read_cifar10(
    data_dir: str | os.PathLike | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Read the CIFAR-10 python batches (``cifar-10-batches-py/data_batch_1..5``, ``test_batch``).

    Returns:
        ``(train_images (50000, 3, 32, 32) uint8, train_labels (50000,) int64, test_images
        (10000, 3, 32, 32) uint8, test_labels (10000,) int64)``.
    """
    layout = "  <dir>/cifar-10-batches-py/{data_batch_1..data_batch_5, test_batch}"
    root = find_dataset_root(
        "cifar10",
        data_dir,
        markers=_CIFAR_FILES,
        subfolders=("cifar-10-batches-py", "cifar10/cifar-10-batches-py", "cifar10"),
        layout=layout,
    )
    train = [_read_cifar_batch(root / f) for f in _CIFAR_FILES[:5]]
    test_x, test_y = _read_cifar_batch(root / "test_batch")
    return (
        np.concatenate([x for x, _ in train]),
        np.concatenate([y for _, y in train]),
        test_x,
        test_y,
    )


def assemble_array_splits(
    name: str,
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray | None,
    test_y: np.ndarray | None,
    *,
    protocol: str,
    val_fraction: float,
    seed: int,
    n_query: int | None,
    n_train: int | None,
    val_holdout: str = "samples",
) -> RetrievalSplits:
    """Build :class:`RetrievalSplits` from arrays with the open-set or closed-set protocol.

    Args:
        name: dataset name.
        train_x: official training split, ``(N, C, H, W)`` uint8 / float images.
        train_y: its ``(N,)`` class ids.
        test_x: official test split, or ``None`` when the dataset has a single pool
            (``digits``): then both halves / the query pool come from ``train_x``.
        test_y: its class ids, or ``None``.
        protocol: ``"open-set"`` (lower half of the classes to train, upper half to test) or
            ``"closed-set"`` (see module docstring).
        val_fraction: share of the training data held out for validation (``0``: none).
        seed: seed of the validation and closed-set splits.
        n_query: closed-set queries per class (``None``: all).
        n_train: closed-set training samples per class (``None``: all).
        val_holdout: ``"samples"`` or ``"classes"`` (:func:`rankwise.data.load_dataset`);
            ``"classes"`` is open-set only, as closed-set queries belong to the training classes.
    """
    if val_holdout == "classes" and protocol == "closed-set":
        raise ValueError(
            "val_holdout='classes' needs protocol='open-set': closed-set test queries belong to "
            "the training classes, so holding classes out of training would test on classes "
            "never trained on; use val_holdout='samples'."
        )
    notes: list[str] = []
    single_pool = test_x is None
    if protocol == "open-set":
        classes = np.unique(train_y)
        seen = classes[: classes.size // 2]
        train_mask = np.isin(train_y, seen)
        if test_x is None or test_y is None:  # a single pool
            test_x, test_y, test_mask = train_x, train_y, ~train_mask
        else:
            test_mask = ~np.isin(test_y, seen)
        tr_x, tr_y = train_x[train_mask], train_y[train_mask]
        te_x, te_y = test_x[test_mask], test_y[test_mask]
        source = "the bundled set" if single_pool else "the train / test split"
        notes.append(
            f"open-set: train on classes {seen.min()}-{seen.max()} and test on classes "
            f"{np.unique(te_y).min()}-{np.unique(te_y).max()} of {source}"
            + (
                ""
                if single_pool
                else f"; {int((~train_mask).sum())} training-split samples of test classes and "
                f"{int((~test_mask).sum())} test-split samples of training classes unused"
            )
        )
        gallery_x = gallery_y = None
    elif protocol == "closed-set":
        if test_x is None or test_y is None:  # a single pool
            q_pool_x, q_pool_y = train_x, train_y
            db_pool_x, db_pool_y = train_x[:0], train_y[:0]
        else:
            q_pool_x, q_pool_y, db_pool_x, db_pool_y = test_x, test_y, train_x, train_y
        idx = closed_set_split(q_pool_y, db_pool_y, n_query, n_train, seed)
        te_x, te_y = q_pool_x[idx.query], q_pool_y[idx.query]
        gallery_x = np.concatenate([db_pool_x, q_pool_x[idx.query_rest]])
        gallery_y = np.concatenate([db_pool_y, q_pool_y[idx.query_rest]])
        tr_x, tr_y = gallery_x[idx.train], gallery_y[idx.train]
        notes.append(
            f"closed-set: {te_y.size} queries ({n_query if n_query else 'all'} per class) from "
            f"the {'bundled set' if single_pool else 'test split'}; database = the other "
            f"{gallery_y.size} samples; {tr_y.size} training samples "
            f"({n_train if n_train else 'all'} per class) drawn from the database"
        )
    else:
        raise ValueError(f"`protocol` must be 'open-set' or 'closed-set', got {protocol!r}.")

    kept, held, tr_y, val_note = split_validation(tr_y, val_fraction, seed, val_holdout)
    if val_fraction > 0 and held.size == 0:
        raise ValueError(
            f"`val_fraction`={val_fraction} leaves no validation sample for {name!r} (every class "
            "is too small to give two samples); raise it or pass val_fraction=0."
        )
    if held.size:
        notes.append(val_note)
    # ArrayDataset turns a numpy array into a contiguous tensor
    return RetrievalSplits(
        train=ArrayDataset(tr_x[kept], tr_y[kept], name=f"{name}/train"),
        val=ArrayDataset(tr_x[held], tr_y[held], name=f"{name}/val") if held.size else None,
        test=ArrayDataset(te_x, te_y, name=f"{name}/test"),
        gallery=None
        if gallery_x is None or gallery_y is None
        else ArrayDataset(gallery_x, gallery_y, name=f"{name}/gallery"),
        protocol=protocol,
        name=name,
        notes=tuple(notes),
    )


def read_digits_images(with_labels: bool = False) -> Any:
    """Scikit-learn's bundled digits as ``(1797, 1, 8, 8)`` float32 in [0, 1].

    Pixel values 0-16 are divided by 16. Returns the images, or ``(images, (1797,) int64
    labels)`` when ``with_labels``.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = (np.asarray(bunch.images, dtype=np.float32) / 16.0)[:, None, :, :]
    if not with_labels:
        return images
    return images, np.asarray(bunch.target, dtype=np.int64)


def load_digits_dataset(
    *,
    protocol: str,
    val_fraction: float,
    seed: int,
    n_query: int | None = 20,
    n_train: int | None = 100,
    val_holdout: str = "samples",
) -> RetrievalSplits:
    """Scikit-learn's bundled 8x8 digits (1797 images, 10 classes) as retrieval splits.

    Images as :func:`read_digits_images` gives them; keywords as in :func:`assemble_array_splits`.
    """
    images, labels = read_digits_images(with_labels=True)
    return assemble_array_splits(
        "digits",
        images,
        labels,
        None,
        None,
        protocol=protocol,
        val_fraction=val_fraction,
        seed=seed,
        n_query=n_query,
        n_train=n_train,
        val_holdout=val_holdout,
    )


def load_mnist_family_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike | None,
    protocol: str,
    val_fraction: float,
    seed: int,
    n_query: int | None = 100,
    n_train: int | None = 500,
    val_holdout: str = "samples",
) -> RetrievalSplits:
    """MNIST / Fashion-MNIST from local IDX files as ``(N, 1, 28, 28)`` uint8 retrieval splits.

    See :func:`read_mnist_family` for where the files are looked for; keywords as in
    :func:`assemble_array_splits`.
    """
    train_x, train_y, test_x, test_y = read_mnist_family(name, data_dir)
    return assemble_array_splits(
        name,
        train_x[:, None],
        train_y,
        test_x[:, None],
        test_y,
        protocol=protocol,
        val_fraction=val_fraction,
        seed=seed,
        n_query=n_query,
        n_train=n_train,
        val_holdout=val_holdout,
    )


def load_cifar10_dataset(
    *,
    data_dir: str | os.PathLike | None,
    protocol: str,
    val_fraction: float,
    seed: int,
    n_query: int | None = 100,
    n_train: int | None = 500,
    val_holdout: str = "samples",
) -> RetrievalSplits:
    """CIFAR-10 from the local python batches as ``(N, 3, 32, 32)`` uint8 retrieval splits.

    Keywords as in :func:`assemble_array_splits`.
    """
    return assemble_array_splits(
        "cifar10",
        *read_cifar10(data_dir),
        protocol=protocol,
        val_fraction=val_fraction,
        seed=seed,
        n_query=n_query,
        n_train=n_train,
        val_holdout=val_holdout,
    )
