"""Dataset containers and retrieval splits shared by every loader in :mod:`rankwise.data`.

*Open-set* (metric learning; Wen et al., NeurIPS 2022, Sec. 6; Gajić et al., Sec. 4.1): the test
classes are disjoint from the training classes and every test sample is queried against all other
test samples (leave-one-out). *Closed-set* (hashing; He et al., CVPR 2018, Sec. 5.1, CIFAR-10
"setting 1"): queries are retrieved against a separate database of the same classes. No equation
is implemented here; this module only holds the data.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "ArrayDataset",
    "ImageFolderDataset",
    "RetrievalSplits",
    "DatasetNotFoundError",
    "CorruptDatasetError",
    "DataError",
    "MissingImageError",
    "UnreadableImageError",
    "ListRows",
    "open_image",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "default_image_transform",
    "NumpyImageTransform",
    "as_label_array",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not where they were looked for; the message gives the layout."""


class CorruptDatasetError(ValueError):
    """A dataset file exists but cannot be parsed (truncated, wrong magic, bad header)."""


class DataError(Exception):
    """An image file of a dataset that cannot be read: what every data error while training is.

    The base of :class:`MissingImageError` (a ``FileNotFoundError``) and
    :class:`UnreadableImageError` (a :class:`CorruptDatasetError`), so existing handlers of those
    still catch them. The message names the file, the list file and line it comes from, and the
    sample of which dataset it is.
    """

    @staticmethod
    def one_line(exc: BaseException) -> str:
        r"""The message of ``exc`` on one line, also when a DataLoader worker re-raised it.

        A worker's exception reaches the main process as the same type with the worker's whole
        traceback as its message (``torch.utils.data``'s ``ExceptionWrapper``); its last line
        is ``module.Type: message``.

        >>> DataError.one_line(MissingImageError("Caught MissingImageError in DataLoader worker "
        ...     "process 0.\nOriginal Traceback (most recent call last):\n  ...\n"
        ...     "rankwise.data.base.MissingImageError: image file 'a.png' does not exist"))
        "image file 'a.png' does not exist"
        """
        text = str(exc).strip()
        if "Original Traceback" in text:
            last = text.splitlines()[-1]
            head, sep, rest = last.partition(": ")
            text = rest if sep and head.rsplit(".", 1)[-1] == type(exc).__name__ else last
        return " ".join(text.split())


class MissingImageError(DataError, FileNotFoundError):
    """A listed image file does not exist (a :class:`DataError` and a ``FileNotFoundError``)."""


class UnreadableImageError(DataError, CorruptDatasetError):
    """A listed image file exists but does not decode (a :class:`DataError`)."""


@dataclass(frozen=True)
class ListRows:
    """Where the samples of an image dataset are listed: one list file, one row per sample.

    Attributes:
        file: the list file (e.g. ``.../Ebay_train.txt``).
        rows: ``(N,)`` 1-based row of each sample in it (the line number for text lists).
        unit: what a row is called in messages (``"line"``; ``"annotation"`` for a .mat).

    Example:
        >>> ListRows("Ebay_train.txt", np.array([2, 5])).where(1)
        'Ebay_train.txt, line 5'
    """

    file: str
    rows: np.ndarray
    unit: str = "line"

    def where(self, index: int) -> str:
        """``"<file>, <unit> <row>"`` of sample ``index``."""
        return f"{self.file}, {self.unit} {int(self.rows[index])}"

    def take(self, indices: np.ndarray) -> ListRows:
        """The rows of the samples ``indices`` (a subset keeps where its samples come from)."""
        return ListRows(self.file, self.rows[indices], self.unit)


def as_label_array(labels: Any, n: int, name: str = "labels") -> np.ndarray:
    """Convert labels to a 1-D ``np.int64`` array of length ``n`` with a clear error otherwise."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D (one class id per sample), got shape {arr.shape}.")
    if arr.shape[0] != n:
        raise ValueError(
            f"`{name}` has {arr.shape[0]} entries but there are {n} samples; pass one label each."
        )
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"`{name}` must hold integer class ids, got non-integer floats.")
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"`{name}` must hold integer class ids, got dtype {arr.dtype}.")
    return arr.astype(np.int64, copy=False)


class LabelledDataset(Dataset):
    """What a split of :class:`RetrievalSplits` is: items with class ids and one item shape.

    Attributes:
        labels: ``(N,)`` ``np.int64`` class ids.
        input_shape: shape of one item, e.g. ``(1, 28, 28)``.
    """

    labels: np.ndarray
    input_shape: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.labels.shape[0])


class ArrayDataset(LabelledDataset):
    """In-memory dataset of array inputs with integer class labels.

    Args:
        inputs: tensor (or numpy array) of shape ``(N, *input_shape)``. ``uint8`` inputs stay
            ``uint8`` in memory and become ``float32`` in ``[0, 1]`` (divided by 255) per item;
            floating inputs are returned as stored.
        labels: ``(N,)`` integer class ids (numpy array or tensor).
        name: a human-readable name used in summaries.
        transform: optional callable applied to each float ``(*input_shape)`` item.

    Attributes:
        labels, input_shape: as in :class:`LabelledDataset`.
        num_classes: number of distinct classes present.
        classes: sorted ``np.int64`` array of the distinct class ids.
    """

    def __init__(
        self,
        inputs: torch.Tensor | np.ndarray,
        labels: np.ndarray | torch.Tensor,
        name: str = "",
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if isinstance(inputs, np.ndarray):
            inputs = torch.from_numpy(np.ascontiguousarray(inputs))
        if not isinstance(inputs, torch.Tensor):
            raise ValueError(f"`inputs` must be a tensor, got {type(inputs).__name__}.")
        if inputs.ndim < 2:
            raise ValueError(
                f"`inputs` must have shape (N, *input_shape) with at least 2 dims, "
                f"got {tuple(inputs.shape)}."
            )
        if not (inputs.dtype == torch.uint8 or inputs.is_floating_point()):
            raise ValueError(f"`inputs` must be uint8 or floating point, got {inputs.dtype}.")
        self.inputs = inputs
        self.labels = as_label_array(labels, inputs.shape[0])
        self.name = name
        self.transform = transform
        self.input_shape: tuple[int, ...] = tuple(int(s) for s in inputs.shape[1:])
        self.classes = np.unique(self.labels)
        self.num_classes = int(self.classes.size)

    def _to_float(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            return x.to(torch.float32).div_(255.0)
        return x

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self._to_float(self.inputs[index])
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.labels[index])

    def batch(
        self, indices: Sequence[int] | np.ndarray | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather a batch without a DataLoader: ``(B, *input_shape)`` float32, ``(B,)`` int64."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        x = self._to_float(self.inputs[idx])
        if self.transform is not None:
            x = torch.stack([self.transform(item) for item in x])
        return x, torch.from_numpy(self.labels[idx.numpy()])

    def subset(self, indices: Sequence[int] | np.ndarray, name: str | None = None) -> ArrayDataset:
        """A new dataset holding rows ``indices`` (the storage dtype is kept)."""
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        return ArrayDataset(
            self.inputs[idx],
            self.labels[idx.numpy()],
            name=self.name if name is None else name,
            transform=self.transform,
        )

    def __repr__(self) -> str:
        return (
            f"ArrayDataset(name={self.name!r}, n={len(self)}, input_shape={self.input_shape}, "
            f"num_classes={self.num_classes}, dtype={self.inputs.dtype})"
        )


class NumpyImageTransform:
    """PIL image -> ``(3, size, size)`` float32 tensor, numpy + PIL only.

    RGB, bilinear resize of the whole image to a square, [0, 1], ImageNet mean / std
    normalization; picklable, so DataLoader workers can use it.
    """

    def __init__(self, image_size: int) -> None:
        self.image_size = int(image_size)
        self.mean = np.asarray(IMAGENET_MEAN, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.asarray(IMAGENET_STD, dtype=np.float32).reshape(3, 1, 1)

    def __call__(self, image: Any) -> torch.Tensor:
        """Transform one PIL image."""
        from PIL import Image

        size = (self.image_size, self.image_size)
        # Image.BILINEAR is set through globals() (kept for Pillow < 9.1, without Resampling)
        resized = image.convert("RGB").resize(size, Image.BILINEAR)  # type: ignore[attr-defined]
        chw = np.asarray(resized, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return torch.from_numpy(np.ascontiguousarray((chw - self.mean) / self.std))

    def __repr__(self) -> str:
        return f"NumpyImageTransform(image_size={self.image_size})"


def _to_rgb(image: Any) -> Any:
    return image.convert("RGB")


def default_image_transform(image_size: int = 224) -> Callable[[Any], torch.Tensor]:
    """PIL image -> ``(3, image_size, image_size)`` float32 tensor, ImageNet-normalized.

    Uses torchvision transforms when the ``vision`` extra imports, and the equivalent
    :class:`NumpyImageTransform` otherwise.
    """
    if int(image_size) < 1:
        raise ValueError(f"`image_size` must be a positive integer, got {image_size}.")
    image_size = int(image_size)
    try:
        from torchvision import transforms
    except Exception:  # torchvision absent or broken beside this torch build
        return NumpyImageTransform(image_size)
    return transforms.Compose(
        [
            transforms.Lambda(_to_rgb),
            transforms.Resize((image_size, image_size)),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def open_image(path: str | os.PathLike, where: str) -> Any:
    """Open an image file as an RGB PIL image, fully decoded.

    Args:
        path: the file.
        where: what it is, for the messages (e.g. ``"Ebay_train.txt, line 7; sample 6 of
            dataset 'sop/val'"``).

    Raises:
        MissingImageError: the file does not exist (a ``FileNotFoundError``).
        UnreadableImageError: it does not decode (a :class:`CorruptDatasetError`). Both are a
            :class:`DataError` whose one-line message names the file and ``where``.
    """
    from PIL import Image, UnidentifiedImageError

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise MissingImageError(f"image file {path!r} ({where}) does not exist.")
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        # PIL's "cannot identify image file '<path>'" would name the file twice
        unknown = isinstance(exc, UnidentifiedImageError)
        reason = "no image format recognised" if unknown else " ".join(str(exc).split())
        raise UnreadableImageError(
            f"image file {path!r} ({where}) could not be decoded ({reason}); the file is "
            "truncated or not an image."
        ) from exc


class ImageFolderDataset(LabelledDataset):
    """Lazily loaded image files with integer class labels.

    Images are opened with PIL in ``__getitem__`` only (never all held in memory).

    Args:
        paths: image paths, absolute or relative to ``root``.
        labels: ``(N,)`` integer class ids.
        transform: callable PIL image -> tensor; ``None`` uses :func:`default_image_transform`.
        root: directory the relative ``paths`` are resolved against.
        image_size: side of the square output of the default transform; this is also reported
            as ``input_shape = (3, image_size, image_size)``.
        name: a human-readable name used in summaries.
        origin: the list file and row of every sample (named by errors and the pre-flight
            check, :mod:`rankwise.data.preflight`); ``None``: not from a list file.

    Attributes:
        labels, input_shape, num_classes, classes: as in :class:`ArrayDataset`.
        paths: the resolved image paths.
        origin: see above.
    """

    def __init__(
        self,
        paths: list[str],
        labels: np.ndarray | torch.Tensor | Sequence[int],
        transform: Callable[[Any], torch.Tensor] | None = None,
        root: str | os.PathLike | None = None,
        image_size: int = 224,
        name: str = "",
        origin: ListRows | None = None,
    ) -> None:
        paths = [os.fspath(p) for p in paths]
        if root is not None:
            paths = [p if os.path.isabs(p) else os.path.join(os.fspath(root), p) for p in paths]
        self.paths = paths
        self.root = None if root is None else os.fspath(root)
        self.labels = as_label_array(labels, len(paths))
        self.transform = default_image_transform(image_size) if transform is None else transform
        self.input_shape: tuple[int, ...] = (3, int(image_size), int(image_size))
        self.name = name
        self.classes = np.unique(self.labels)
        self.num_classes = int(self.classes.size)
        if origin is not None and origin.rows.shape != (len(paths),):
            raise ValueError(
                f"`origin` lists {origin.rows.shape[0]} rows for {len(paths)} paths; give one "
                "row per path."
            )
        self.origin = origin

    def describe_sample(self, index: int) -> str:
        """``"Ebay_train.txt, line 7; sample 6 of dataset 'sop/val'"``: where sample ``index`` is."""
        where = f"{self.origin.where(index)}; " if self.origin is not None else ""
        return f"{where}sample {index} of dataset {self.name!r}"

    def load_image(self, index: int) -> Any:
        """Open image ``index`` as an RGB PIL image (:func:`open_image`, naming its list row)."""
        return open_image(self.paths[index], self.describe_sample(index))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.load_image(index)), int(self.labels[index])

    def seeded_item(self, index: int, seed: int) -> tuple[torch.Tensor, int]:
        """Item ``index`` with its random transform drawn from ``seed`` alone.

        A transform with ``takes_seed = True`` (:class:`rankwise.data.augment.ImageAugmentation`)
        is called with ``seed=``, so its views depend on nothing else (not on a worker's or the
        global RNG state); any other transform is called as in ``__getitem__``.
        """
        image = self.load_image(index)
        if getattr(self.transform, "takes_seed", False):
            return self.transform(image, seed=seed), int(self.labels[index])  # type: ignore[call-arg]
        return self.transform(image), int(self.labels[index])

    def subset(
        self, indices: Sequence[int] | np.ndarray, name: str | None = None
    ) -> ImageFolderDataset:
        """A new dataset holding samples ``indices`` (same transform, still lazy)."""
        idx = np.asarray(indices, dtype=np.int64)
        out = ImageFolderDataset.__new__(ImageFolderDataset)
        out.paths = [self.paths[i] for i in idx]
        out.root = self.root
        out.labels = self.labels[idx]
        out.transform = self.transform
        out.input_shape = self.input_shape
        out.name = self.name if name is None else name
        out.origin = None if self.origin is None else self.origin.take(idx)
        out.classes = np.unique(out.labels)
        out.num_classes = int(out.classes.size)
        return out

    def __repr__(self) -> str:
        return (
            f"ImageFolderDataset(name={self.name!r}, n={len(self)}, "
            f"input_shape={self.input_shape}, num_classes={self.num_classes})"
        )


@dataclass
class RetrievalSplits:
    """The splits of one retrieval benchmark.

    Attributes:
        train: training data.
        val: validation data carved from the training data (``None`` when ``val_fraction=0``);
            evaluated leave-one-out.
        test: the queries. For ``protocol="open-set"`` it is also the gallery: every test sample
            is retrieved against all other test samples (leave-one-out).
        gallery: the database for ``protocol="closed-set"`` (``None`` for open-set).
        protocol: ``"open-set"`` or ``"closed-set"``.
        name: the dataset name.
        notes: human-readable remarks on how the splits were built (what was held out, why).
    """

    train: LabelledDataset
    val: LabelledDataset | None
    test: LabelledDataset
    gallery: LabelledDataset | None
    protocol: str
    name: str
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.protocol not in ("open-set", "closed-set"):
            raise ValueError(
                f"`protocol` must be 'open-set' or 'closed-set', got {self.protocol!r}."
            )
        if self.protocol == "closed-set" and self.gallery is None:
            raise ValueError("a closed-set RetrievalSplits needs a `gallery` (the database).")
        if self.protocol == "open-set" and self.gallery is not None:
            raise ValueError(
                "an open-set RetrievalSplits has no `gallery` (test is leave-one-out)."
            )

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input item, e.g. ``(1, 8, 8)``."""
        return tuple(self.train.input_shape)

    def splits(self) -> dict[str, LabelledDataset]:
        """The splits that are present, by name (``train``, ``val``, ``test``, ``gallery``)."""
        named = {"train": self.train, "val": self.val, "test": self.test, "gallery": self.gallery}
        return {k: v for k, v in named.items() if v is not None}

    def describe(self) -> dict[str, dict[str, int]]:
        """Sample and class counts per present split: ``{"train": {"samples": n, "classes": c}}``."""
        return {
            key: {"samples": len(ds), "classes": int(np.unique(ds.labels).size)}
            for key, ds in self.splits().items()
        }

    def __str__(self) -> str:
        parts = [
            f"{k}: {v['samples']} samples / {v['classes']} classes"
            for k, v in self.describe().items()
        ]
        return f"{self.name} ({self.protocol}) - " + "; ".join(parts)
