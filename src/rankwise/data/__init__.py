"""rankwise.data: retrieval benchmarks, split for open-set metric learning and closed-set hashing.

Open-set protocol as in Wen et al., NeurIPS 2022 (SOPRC), Sec. 6 (official test split, training
data split 9:1 into train / validation) and Gajić et al. (AUC loss), Sec. 4.1; closed-set
protocol as in He et al., CVPR 2018 (tie-aware hashing), Sec. 5.1 (CIFAR-10 settings 1 / 2).
Entry point: :func:`load_dataset`. Nothing is ever downloaded.
"""

from .array_datasets import read_cifar10, read_mnist_family
from .base import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ArrayDataset,
    CorruptDatasetError,
    DatasetNotFoundError,
    ImageFolderDataset,
    RetrievalSplits,
    default_image_transform,
)
from .idx import read_idx, write_idx
from .locate import RANKWISE_DATA_ENV
from .registry import DATASET_ALIASES, DATASETS, PROTOCOLS, dataset_protocols, load_dataset
from .splits import closed_set_split, stratified_split

__all__ = [
    "ArrayDataset",
    "ImageFolderDataset",
    "RetrievalSplits",
    "DatasetNotFoundError",
    "CorruptDatasetError",
    "DATASETS",
    "DATASET_ALIASES",
    "PROTOCOLS",
    "RANKWISE_DATA_ENV",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "load_dataset",
    "dataset_protocols",
    "default_image_transform",
    "stratified_split",
    "closed_set_split",
    "read_idx",
    "write_idx",
    "read_mnist_family",
    "read_cifar10",
]
