"""``load_dataset``: one entry point for every benchmark rankwise trains and evaluates on.

Protocols: open-set metric learning (Wen et al., NeurIPS 2022, Sec. 6: official test split,
the rest split 9:1 into train / validation; Gajić et al., Sec. 4.1) and closed-set hashing
(He et al., CVPR 2018, Sec. 5.1, CIFAR-10 settings 1 and 2), plus the augmented-instance
benchmarks ``<name>-instances`` (:mod:`rankwise.data.instances`: every source image a class, the
many-class regime of SOPRC). Validation holds out samples of the training classes or, with
``val_holdout="classes"``, whole training classes (open-set validation). Nothing is ever
downloaded: data is read from ``data_dir``, ``$RANKWISE_DATA`` or system dataset packages.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np

from .._registry import Registry
from .array_datasets import (
    load_cifar10_dataset,
    load_digits_dataset,
    load_mnist_family_dataset,
    read_cifar10,
    read_digits_images,
    read_mnist_family,
)
from .augment import augment_transforms
from .base import RetrievalSplits
from .image_datasets import IMAGE_DATASETS, load_image_dataset, read_vehicleid
from .instances import INSTANCE_OPTIONS, build_instance_splits
from .own_datasets import OWN_DATASETS, OWN_OPTIONS, arrays_input_shape, load_own_dataset
from .splits import VAL_HOLDOUTS

__all__ = [
    "DATASETS",
    "DATASET_ALIASES",
    "DatasetInfo",
    "INSTANCE_DATASETS",
    "PROTOCOLS",
    "dataset_info",
    "load_dataset",
    "dataset_protocols",
    "default_val_holdout",
    "input_spec",
    "pixel_features",
    "read_images",
]

PROTOCOLS: tuple[str, ...] = ("open-set", "closed-set")


@dataclass(frozen=True)
class DatasetInfo:
    """What rankwise knows of one benchmark (the table every module reads).

    Attributes:
        kind: ``"array"`` (in memory), ``"folder"`` (image files, see ``IMAGE_DATASETS``),
            ``"instances"`` (augmented-instance benchmark of ``source``'s images) or ``"own"``
            (the user's data: :mod:`rankwise.data.own_datasets`).
        protocols: the protocols it supports, its usual one first.
        source: the dataset whose images an instance benchmark augments.
        item_shape: ``(C, H, W)`` of one item of an array dataset (None: image files).
        raw_inputs: ``"digits"`` (pixel values 0-16), ``"uint8"`` (0-255) or ``"images"``.
    """

    kind: str
    protocols: tuple[str, ...]
    source: str | None = None
    item_shape: tuple[int, ...] | None = None
    raw_inputs: str = "images"


DATASET_ALIASES: dict[str, str] = {
    "fashion_mnist": "fashion-mnist",
    "fashionmnist": "fashion-mnist",
    "cifar-10": "cifar10",
    "cifar_10": "cifar10",
    "cub": "cub200",
    "cub-200": "cub200",
    "cub-200-2011": "cub200",
    "cub200-2011": "cub200",
    "cars": "cars196",
    "cars-196": "cars196",
    "stanford-online-products": "sop",
    "online-products": "sop",
    "in-shop": "inshop",
    "deepfashion-inshop": "inshop",
    "inat": "inaturalist",
    "inaturalist2018": "inaturalist",
    "inat2018": "inaturalist",
    "pku-vehicleid": "vehicleid",
    "vehicle-id": "vehicleid",
    "fashion-mnist-instance": "fashion-mnist-instances",
    "fashion_mnist_instances": "fashion-mnist-instances",
    "digits_instances": "digits-instances",
    "mnist_instances": "mnist-instances",
    "cifar10_instances": "cifar10-instances",
    "cifar-10-instances": "cifar10-instances",
}


_INFO: Registry[DatasetInfo] = Registry(
    "dataset",
    {
        "digits": DatasetInfo("array", PROTOCOLS, item_shape=(1, 8, 8), raw_inputs="digits"),
        "mnist": DatasetInfo("array", PROTOCOLS, item_shape=(1, 28, 28), raw_inputs="uint8"),
        "fashion-mnist": DatasetInfo(
            "array", PROTOCOLS, item_shape=(1, 28, 28), raw_inputs="uint8"
        ),
        "cifar10": DatasetInfo("array", PROTOCOLS, item_shape=(3, 32, 32), raw_inputs="uint8"),
        **{
            name: DatasetInfo("folder", (spec["protocol"],))
            for name, spec in IMAGE_DATASETS.items()
        },
        **{
            f"{source}-instances": DatasetInfo("instances", ("open-set",), source=source)
            for source in ("digits", "mnist", "fashion-mnist", "cifar10")
        },
        **{name: DatasetInfo("own", PROTOCOLS) for name in OWN_DATASETS},
    },
    aliases=DATASET_ALIASES,
    hint=f" (aliases: {', '.join(sorted(DATASET_ALIASES))})",
    normalize=lambda name: str(name).strip().lower(),
)

DATASETS: tuple[str, ...] = _INFO.names
# augmented-instance benchmarks -> the dataset their source images come from
INSTANCE_DATASETS: dict[str, str] = {
    name: info.source for name in DATASETS if (info := _INFO[name]).source is not None
}

_CLOSED_SET_KWARGS = ("n_query", "n_train")


class _SplitArguments(TypedDict):
    """The keywords every class-split loader takes."""

    protocol: str
    val_fraction: float
    seed: int
    val_holdout: str


_IMAGE_KWARGS = ("transform", "train_transform")


def dataset_info(name: str) -> DatasetInfo:
    """The :class:`DatasetInfo` of ``name`` (or an alias); ``ValueError`` listing the names."""
    return _INFO[name]


def dataset_protocols(name: str) -> tuple[str, ...]:
    """The protocols ``name`` supports (first = its usual one)."""
    return _INFO[name].protocols


def default_val_holdout(name: str) -> str:
    """What ``val_holdout=None`` means for ``name``.

    ``"classes"`` for the instance benchmarks (validation on unseen sources), ``"samples"`` for
    the others (the papers' 9:1 split).
    """
    return "classes" if _INFO[name].kind == "instances" else "samples"


def input_spec(
    name: str, image_size: int, data_dir: str | os.PathLike | None = None
) -> tuple[tuple[int, ...], str]:
    """The shape of one model input of ``name`` and its :attr:`DatasetInfo.raw_inputs`.

    Instance benchmarks take their source's; image files become ``(3, image_size, image_size)``;
    an ``arrays`` dataset's come from its file ``data_dir`` (raw kind ``uint8`` or ``float``).
    """
    info = _INFO[name]
    if _INFO.canonical(name) == "arrays":
        if data_dir is None:
            raise ValueError("dataset 'arrays' needs its data_dir (the .npz file) for its shape.")
        return arrays_input_shape(data_dir)
    if info.source is not None:
        info = _INFO[info.source]
    if info.item_shape is None:
        return (3, image_size, image_size), "images"
    return info.item_shape, info.raw_inputs


def read_images(
    name: str, data_dir: str | os.PathLike | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Images ``(N, C, H, W)`` and labels of an array dataset's official train / test parts.

    digits has one part (test ``None``) of float32 pixels in [0, 1]; the others are uint8.
    """
    key = _INFO.canonical(name)
    if _INFO[key].kind != "array":
        raise ValueError(f"dataset {key!r} is not an array dataset; use load_dataset({key!r}).")
    if key == "digits":
        images, labels = read_digits_images(with_labels=True)
        return images, labels, None, None
    if key == "cifar10":
        return read_cifar10(data_dir)
    train_x, train_y, test_x, test_y = read_mnist_family(key, data_dir)
    return train_x[:, None], train_y, test_x[:, None], test_y


def pixel_features(images: np.ndarray) -> np.ndarray:
    """Flat float64 pixels in [0, 1] of :func:`read_images` images (uint8 divided by 255)."""
    flat = images.reshape(images.shape[0], -1).astype(np.float64)
    return flat / 255.0 if images.dtype == np.uint8 else flat


def _check_kwargs(name: str, kw: dict[str, Any], allowed: tuple[str, ...], where: str = "") -> None:
    unknown = sorted(set(kw) - set(allowed))
    if unknown:
        raise ValueError(
            f"dataset {name!r} does not take option(s) {unknown}{' ' + where if where else ''}; "
            f"it accepts {list(allowed) or 'no extra options'}."
        )


def load_dataset(
    name: str = "digits",
    *,
    protocol: str | None = None,
    data_dir: str | os.PathLike | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    image_size: int = 224,
    val_holdout: str | None = None,
    augment: Mapping[str, Any] | None = None,
    **kw: Any,
) -> RetrievalSplits:
    """Load a retrieval benchmark and split it for training and evaluation.

    Args:
        name: one of :data:`DATASETS` (or an alias in :data:`DATASET_ALIASES`).
        protocol: ``"open-set"`` (test classes disjoint from training classes; the test set is
            queried leave-one-out) or ``"closed-set"`` (queries vs a database of the same
            classes), as the dataset allows (the table of docs/training.md, "Datasets");
            ``None`` (default): open-set for all but ``inshop``.
        data_dir: folder holding the dataset (or holding it under its conventional folder name);
            default: ``$RANKWISE_DATA``, then system locations (:mod:`rankwise.data.locate`).
        val_fraction: share of the training data held out for validation (``0`` -> ``val=None``):
            of its samples (``val_holdout="samples"``, stratified) or of its classes
            (``"classes"``). Not used by the ``*-instances`` benchmarks, whose validation split
            is ``val_classes`` unseen sources.
        seed: seed of every random choice (validation and closed-set splits, instance sources
            and their fixed validation / test views).
        image_size: side of the square image tensors of the folder datasets.
        val_holdout: ``"samples"`` (held-out samples of the training classes, the papers' 9:1
            split), ``"classes"`` (held-out training classes: open-set validation, like the
            test) or ``None`` (:func:`default_val_holdout`; instance benchmarks: only "classes").
        augment: seeded resize / crop / flip of image files
            (:func:`rankwise.data.augment.check_augment`'s keys): the training split gets the
            random pipeline, the others the deterministic one; refused for in-memory arrays and
            beside ``transform`` / ``train_transform``.
        **kw: ``n_query``, ``n_train`` (closed-set per-class counts, ``None`` = all; defaults
            100 / 500, digits 20 / 100) for digits / mnist / fashion-mnist / cifar10;
            ``transform``, ``train_transform`` for folder datasets; ``test_size``
            ("small" | "medium" | "large") for vehicleid; the ``INSTANCE_OPTIONS`` of
            :func:`rankwise.data.instances.build_instance_splits` for the ``*-instances``;
            ``test_fraction``, ``transform``, ``train_transform`` for ``folder`` / ``csv`` /
            ``arrays`` (:func:`rankwise.data.own_datasets.load_own_dataset`).

    Returns:
        :class:`RetrievalSplits`.

    Raises:
        ValueError: unknown name, protocol or option.
        rankwise.data.DatasetNotFoundError: the files are not there (the message shows the
            expected layout).
        rankwise.data.CorruptDatasetError: a file is truncated or malformed (names the file).
    """
    key = _INFO.canonical(name)
    protocol_given = protocol  # a table's flags decide the protocol of an own dataset
    if protocol is None:
        protocol = dataset_protocols(key)[0]
    if protocol not in PROTOCOLS:
        raise ValueError(f"`protocol` must be one of {PROTOCOLS}, got {protocol!r}.")
    if val_holdout is None:
        val_holdout = default_val_holdout(key)
    if val_holdout not in VAL_HOLDOUTS:
        raise ValueError(f"`val_holdout` must be one of {VAL_HOLDOUTS}, got {val_holdout!r}.")
    kind = _INFO[key].kind
    kw = _augmented(key, kind, kw, augment, image_size)
    if kind == "own":
        _check_kwargs(key, kw, OWN_OPTIONS)
        return load_own_dataset(
            key,
            data_dir=data_dir,
            protocol=None if protocol_given is None else protocol,
            val_fraction=float(val_fraction),
            seed=int(seed),
            image_size=image_size,
            val_holdout=val_holdout,
            **kw,
        )
    if kind == "instances":
        return _load_instances(key, protocol, data_dir, seed, val_holdout, kw)
    common: _SplitArguments = {
        "protocol": protocol,
        "val_fraction": float(val_fraction),
        "seed": int(seed),
        "val_holdout": val_holdout,
    }
    if kind == "array":
        if protocol == "open-set":
            # n_query / n_train shape the closed-set split only: refuse them rather than ignore
            _check_kwargs(key, kw, (), "in protocol 'open-set' (n_query / n_train are closed-set)")
        _check_kwargs(key, kw, _CLOSED_SET_KWARGS)
    if key == "digits":
        return load_digits_dataset(**common, **kw)
    if key in ("mnist", "fashion-mnist"):
        return load_mnist_family_dataset(key, data_dir=data_dir, **common, **kw)
    if key == "cifar10":
        return load_cifar10_dataset(data_dir=data_dir, **common, **kw)
    extra = tuple(p for p in inspect.signature(read_vehicleid).parameters if p != "data_dir")
    _check_kwargs(key, kw, _IMAGE_KWARGS + (extra if key == "vehicleid" else ()))
    return load_image_dataset(key, data_dir=data_dir, image_size=image_size, **common, **kw)


def _augmented(
    key: str, kind: str, kw: dict[str, Any], augment: Mapping[str, Any] | None, image_size: int
) -> dict[str, Any]:
    """``kw`` with the transforms of ``augment`` (image-file datasets only; ``None``: ``kw``)."""
    if augment is None:
        return kw
    if kind not in ("folder", "own") or key == "arrays":
        raise ValueError(
            f"`augment` resizes, crops and flips image files; dataset {key!r} holds in-memory "
            "arrays (the *-instances benchmarks draw their own random views): remove `augment`."
        )
    given = sorted({"transform", "train_transform"} & set(kw))
    if given:
        raise ValueError(f"`augment` and {given} both set the image transforms; pass one of them.")
    train_transform, transform = augment_transforms(augment, image_size)
    return {**kw, "transform": transform, "train_transform": train_transform}


def _load_instances(
    key: str,
    protocol: str,
    data_dir: str | os.PathLike | None,
    seed: int,
    val_holdout: str,
    kw: dict[str, Any],
) -> RetrievalSplits:
    """An augmented-instance benchmark from the images of its source dataset."""
    if protocol != "open-set":
        raise ValueError(
            f"dataset {key!r} supports only protocol='open-set' (unseen test sources, "
            f"leave-one-out); got {protocol!r}."
        )
    if val_holdout != "classes":
        raise ValueError(
            f"dataset {key!r} validates on unseen sources only (val_holdout='classes'); the "
            "training views are redrawn every step, so there are no fixed training samples to "
            f"hold out; got val_holdout={val_holdout!r}."
        )
    _check_kwargs(key, kw, INSTANCE_OPTIONS)
    base = INSTANCE_DATASETS[key]
    train_pool, _, test_pool, _ = read_images(base, data_dir)
    return build_instance_splits(key, train_pool, test_pool, seed=int(seed), defaults_of=base, **kw)
