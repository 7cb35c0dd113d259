"""rankwise.data: retrieval benchmarks, split for open-set metric learning and closed-set hashing.

Open-set protocol as in Wen et al., NeurIPS 2022 (SOPRC), Sec. 6 (official test split, training
data split 9:1 into train / validation) and Gajić et al. (AUC loss), Sec. 4.1; closed-set
protocol as in He et al., CVPR 2018 (tie-aware hashing), Sec. 5.1 (CIFAR-10 settings 1 / 2);
augmented-instance benchmarks (every source image a class, views by random affine transforms and
pixel noise) for the many-class regime of SOPRC (Wen et al., Sec. 6: Stanford Online Products).
Entry point: :func:`load_dataset`. Nothing is ever downloaded.
"""

from .array_datasets import read_cifar10, read_digits_images, read_mnist_family
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
