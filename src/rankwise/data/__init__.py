"""rankwise.data: retrieval benchmarks, split for open-set metric learning and closed-set hashing.

Entry point: :func:`load_dataset`, whose module :mod:`rankwise.data.registry` gives the protocols
of Wen et al. (NeurIPS 2022, Sec. 6), Gajić et al. (Sec. 4.1) and He et al. (CVPR 2018, Sec. 5.1)
and the augmented-instance benchmarks. Nothing is ever downloaded.
"""

from .array_datasets import read_cifar10, read_digits_images, read_mnist_family
from .base import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ArrayDataset,
    CorruptDatasetError,
    DataError,
    DatasetNotFoundError,
    ImageFolderDataset,
    MissingImageError,
    RetrievalSplits,
    UnreadableImageError,
    default_image_transform,
)
from .idx import read_idx, write_idx
from .instances import (
    INSTANCE_DEFAULTS,
    INSTANCE_OPTIONS,
    InstanceViews,
    ViewAugmentation,
    build_instance_splits,
)
from .locate import RANKWISE_DATA_ENV
from .registry import (
    DATASET_ALIASES,
    DATASETS,
    INSTANCE_DATASETS,
    PROTOCOLS,
    dataset_protocols,
    default_val_holdout,
    load_dataset,
)
from .splits import VAL_HOLDOUTS, class_holdout_split, closed_set_split, stratified_split

__all__ = [
    "ArrayDataset",
    "ImageFolderDataset",
    "RetrievalSplits",
    "DatasetNotFoundError",
    "CorruptDatasetError",
    "DataError",
    "MissingImageError",
    "UnreadableImageError",
    "DATASETS",
    "DATASET_ALIASES",
    "INSTANCE_DATASETS",
    "INSTANCE_DEFAULTS",
    "INSTANCE_OPTIONS",
    "PROTOCOLS",
    "VAL_HOLDOUTS",
    "RANKWISE_DATA_ENV",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "load_dataset",
    "dataset_protocols",
    "default_val_holdout",
    "build_instance_splits",
    "InstanceViews",
    "ViewAugmentation",
    "class_holdout_split",
    "default_image_transform",
    "stratified_split",
    "closed_set_split",
    "read_idx",
    "write_idx",
    "read_mnist_family",
    "read_digits_images",
    "read_cifar10",
]
