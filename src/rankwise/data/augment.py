"""Seeded augmentation of image files: the papers' resize, crops and flips.

Training applies ``resize`` -> ``random_resized_crop`` or ``random_crop`` -> ``hflip``;
evaluation applies ``resize`` -> ``center_crop``, with nothing random. The recipes it serves:

- SOPRC (Wen et al., NeurIPS 2022, Sec. 5.1 "Optimization Strategy"; App. D.1 gives the
  competitors the same augmentation): shorter side resized to 256, random 224 x 224 crop,
  horizontal flip with probability 0.5.
- Recall@k surrogate (Patel et al., CVPR 2022, released ``src/datasets.py``): random-resized crop
  224 (torchvision's default scale (0.08, 1), ratio (3/4, 4/3)) and flip 0.5; test: shorter side
  256, centre crop 224.
- ROADMAP (Ramzi et al., NeurIPS 2021, released ``config/transform/sop.yaml``): shorter side 256,
  random-resized crop 224 with scale (0.16, 1), ratio (0.75, 1.33), flip 0.5; test: 256 x 256,
  centre crop 224.

Every operation is torchvision's (``transforms`` v1 on PIL images) written with PIL and numpy,
so augmentation works without torchvision: ``Resize`` (an int: the shorter side, the longer one
``int(size * long / short)``; a pair: that height and width), ``RandomCrop``,
``RandomResizedCrop`` (10 attempts of a random area share and log-uniform aspect ratio, then the
centre crop of the ratio range), ``RandomHorizontalFlip`` and ``CenterCrop`` (zero padding of a
too-small image). Resizing is PIL bilinear (with PIL's antialiasing), torchvision's default
interpolation, which the papers' code uses.

The random draws of an item come from a numpy ``Generator`` seeded with the item's seed, which
the trainer derives from ``(run seed, epoch, batch, slot in the batch)``
(:func:`rankwise.training.loader.mix_seed`): never from a worker's or the global RNG state, so a
run is reproducible, a resumed run sees the same views and ``num_workers`` changes nothing.
``backend="torchvision"`` (opt-in) runs torchvision's own transforms instead, seeded through the
torch generator: the same operations, but different random numbers, so its views differ from
``"pil"``'s at the same seed. The default is ``"pil"`` whatever is installed, so a run's views
never depend on whether torchvision imports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .base import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "AUGMENT_BACKENDS",
    "AUGMENT_KEYS",
    "ImageAugmentation",
    "augment_transforms",
    "center_offsets",
    "check_augment",
    "crop_image",
    "random_resized_window",
    "resize_image",
    "torchvision_pipeline",
]

AUGMENT_KEYS: tuple[str, ...] = (
    "resize",
    "random_resized_crop",
    "random_crop",
    "hflip",
    "center_crop",
    "backend",
)
AUGMENT_BACKENDS: tuple[str, ...] = ("pil", "torchvision")
_RRC_DEFAULTS = {"scale": (0.08, 1.0), "ratio": (3.0 / 4.0, 4.0 / 3.0)}  # torchvision's
_ATTEMPTS = 10  # torchvision RandomResizedCrop.get_params


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive integer (pixels), got {value!r}.")
    return int(value)


def _range(value: Any, name: str, upper: float | None) -> tuple[float, float]:
    """An ordered pair ``0 < low <= high (<= upper)`` of floats."""
    bound = f" <= {upper:g}" if upper is not None else ""
    try:
        low, high = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"`{name}` must be a pair [low, high], got {value!r}.") from None
    if not (0 < low <= high and (upper is None or high <= upper)) or math.isinf(high):
        raise ValueError(
            f"`{name}` must be an ordered pair 0 < low <= high{bound}, got {[low, high]}."
        )
    return low, high


def _resize_size(value: Any) -> int | tuple[int, int] | None:
    if value is None or isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return None if value is None else _positive_int(value, "resize")
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2:
        return _positive_int(value[0], "resize"), _positive_int(value[1], "resize")
    raise ValueError(
        f"`resize` must be an integer (the shorter side) or [height, width], got {value!r}."
    )


def _rrc(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or "size" not in value:
        raise ValueError(
            "`random_resized_crop` must be a mapping {size, scale, ratio} (scale and ratio "
            f"optional), got {value!r}."
        )
    unknown = sorted(set(value) - {"size", "scale", "ratio"})
    if unknown:
        raise ValueError(
            f"`random_resized_crop` has unknown key(s) {unknown}; its keys are size, scale, ratio."
        )
    return {
        "size": _positive_int(value["size"], "random_resized_crop.size"),
        "scale": _range(
            value.get("scale", _RRC_DEFAULTS["scale"]), "random_resized_crop.scale", 1.0
        ),
        "ratio": _range(
            value.get("ratio", _RRC_DEFAULTS["ratio"]), "random_resized_crop.ratio", None
        ),
    }


def _fits(resize: int | tuple[int, int] | None, crop: int, name: str) -> None:
    """A crop larger than the resized image: a config mistake, refused before any image is read."""
    if resize is None:
        return
    smallest = resize if isinstance(resize, int) else min(resize)
    if crop > smallest:
        raise ValueError(
            f"`{name}` ({crop}) is larger than the resized image (`resize`: {resize!r}); "
            f"resize to at least {crop} or crop smaller."
        )


def check_augment(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Validate an augmentation mapping (the keys of :data:`AUGMENT_KEYS`), filled and typed.

    Args:
        spec: ``resize`` (int: the shorter side; ``[h, w]``: that size), ``random_resized_crop``
            (``{size, scale, ratio}``; scale and ratio default to torchvision's (0.08, 1) and
            (3/4, 4/3)), ``random_crop`` (size), ``hflip`` (probability), ``center_crop`` (size,
            evaluation), ``backend`` (``"pil"`` or ``"torchvision"``).

    Returns:
        The mapping with every key, ranges as tuples.

    Raises:
        ValueError: naming the key and the fix.

    Example:
        >>> check_augment({"resize": 256, "random_crop": 224, "hflip": 0.5, "center_crop": 224})
        {'resize': 256, 'random_resized_crop': None, 'random_crop': 224, 'hflip': 0.5, 'center_crop': 224, 'backend': 'pil'}
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"augmentation must be a mapping of {AUGMENT_KEYS}, got {spec!r}.")
    unknown = sorted(set(spec) - set(AUGMENT_KEYS))
    if unknown:
        raise ValueError(f"unknown augmentation key(s) {unknown}; the keys are {AUGMENT_KEYS}.")
    if spec.get("random_resized_crop") is not None and spec.get("random_crop") is not None:
        raise ValueError(
            "`random_resized_crop` and `random_crop` are both set; a training image gets one "
            "crop: keep one of them."
        )
    resize = _resize_size(spec.get("resize"))
    out: dict[str, Any] = {
        "resize": resize,
        "random_resized_crop": _rrc(spec.get("random_resized_crop")),
        "random_crop": None,
        "hflip": 0.0,
        "center_crop": None,
        "backend": spec.get("backend", "pil"),
    }
    if spec.get("random_crop") is not None:
        out["random_crop"] = _positive_int(spec["random_crop"], "random_crop")
        _fits(resize, out["random_crop"], "random_crop")
    if spec.get("center_crop") is not None:
        out["center_crop"] = _positive_int(spec["center_crop"], "center_crop")
        _fits(resize, out["center_crop"], "center_crop")
    hflip = spec.get("hflip", 0.0)
    if isinstance(hflip, bool) or not isinstance(hflip, (int, float)) or not 0 <= hflip <= 1:
        raise ValueError(f"`hflip` must be a probability in [0, 1], got {hflip!r}.")
    out["hflip"] = float(hflip)
    if out["backend"] not in AUGMENT_BACKENDS:
        raise ValueError(f"`backend` must be one of {AUGMENT_BACKENDS}, got {out['backend']!r}.")
    return out


def _output_sizes(spec: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """The side of the square training and evaluation images (``None``: not one size)."""
    resize = spec["resize"]
    square = resize[0] if isinstance(resize, tuple) and resize[0] == resize[1] else None
    rrc = spec["random_resized_crop"]
    train = rrc["size"] if rrc is not None else spec["random_crop"] or square
    return train, spec["center_crop"] or square


def augment_transforms(
    spec: Mapping[str, Any], image_size: int
) -> tuple[ImageAugmentation, ImageAugmentation]:
    """The training and evaluation transforms of an augmentation mapping.

    Args:
        spec: see :func:`check_augment`.
        image_size: the side of the square tensors both must make (the model's input).

    Returns:
        ``(train_transform, eval_transform)``.

    Raises:
        ValueError: a bad mapping, or a pipeline whose images are not ``image_size`` squares.

    Example:
        >>> train, test = augment_transforms(
        ...     {"resize": 256, "random_crop": 224, "hflip": 0.5, "center_crop": 224}, 224)
        >>> train
        ImageAugmentation(train=True, resize=256, random_crop=224, hflip=0.5, backend='pil')
        >>> test
        ImageAugmentation(train=False, resize=256, center_crop=224, backend='pil')
    """
    checked = check_augment(spec)
    train_size, eval_size = _output_sizes(checked)
    for size, stage, keys in (
        (train_size, "training", "`random_resized_crop`, `random_crop`"),
        (eval_size, "evaluation", "`center_crop`"),
    ):
        if size is None:
            raise ValueError(
                f"{stage} images would keep their own sizes and not stack into a batch: set "
                f"{keys} (or `resize: [{image_size}, {image_size}]`)."
            )
        if size != image_size:
            raise ValueError(
                f"{stage} images would be {size} x {size} but `image_size` is {image_size} (the "
                f"model's input); set image_size: {size} or change {keys}."
            )
    return ImageAugmentation(checked, train=True), ImageAugmentation(checked, train=False)


# ----------------------------------------------------------------------------- operations


def _bilinear() -> Any:
    from PIL import Image

    # Image.BILINEAR is set through globals() (kept for Pillow < 9.1, without Resampling)
    return Image.BILINEAR  # type: ignore[attr-defined]


def resize_image(image: Any, size: int | tuple[int, int]) -> Any:
    """The torchvision ``Resize(size)`` of a PIL image, bilinear (int: the shorter side)."""
    width, height = image.size
    if isinstance(size, tuple):
        new_h, new_w = size
    else:
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size, int(size * long / short)
        new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
    if (new_w, new_h) == (width, height):
        return image
    return image.resize((new_w, new_h), _bilinear())


def crop_image(image: Any, top: int, left: int, height: int, width: int) -> Any:
    """The ``height x width`` window at ``(top, left)``; outside the image is black (zeros)."""
    return image.crop((left, top, left + width, top + height))


def center_offsets(height: int, width: int, size: int) -> tuple[int, int]:
    """The top-left corner of torchvision's ``CenterCrop``, negative where it pads a small image."""

    def offset(extent: int) -> int:
        if size > extent:  # padded by (size - extent) // 2 before, the rest after
            return -((size - extent) // 2)
        return int(round((extent - size) / 2.0))

    return offset(height), offset(width)


def random_resized_window(
    height: int,
    width: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    rng: np.random.Generator,
) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of torchvision ``RandomResizedCrop.get_params``, drawn from ``rng``.

    Up to 10 attempts of an area share uniform in ``scale`` and an aspect ratio log-uniform in
    ``ratio``; when none fits, the centre crop of the image clamped to the ratio range.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(_ATTEMPTS):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class ImageAugmentation:
    """PIL image (+ item seed) -> ``(3, size, size)`` ImageNet-normalized float32 tensor.

    Training: ``resize`` -> ``random_resized_crop`` or ``random_crop`` -> ``hflip``; evaluation:
    ``resize`` -> ``center_crop``. Picklable (DataLoader workers).

    Args:
        spec: an augmentation mapping (:func:`check_augment`).
        train: the training pipeline (random) or the evaluation one (deterministic).

    Attributes:
        takes_seed: ``True``: ``ImageFolderDataset.seeded_item`` passes the item's seed.

    Example:
        >>> from PIL import Image
        >>> augment = ImageAugmentation({"resize": 8, "random_crop": 6, "hflip": 0.5}, train=True)
        >>> image = Image.new("RGB", (16, 8))
        >>> augment(image, seed=3).shape
        torch.Size([3, 6, 6])
        >>> bool((augment(image, seed=3) == augment(image, seed=3)).all())
        True
    """

    takes_seed = True

    def __init__(self, spec: Mapping[str, Any], train: bool) -> None:
        self.spec = check_augment(spec)
        self.train = bool(train)
        self.mean = np.asarray(IMAGENET_MEAN, dtype=np.float32).reshape(3, 1, 1)
        self.std = np.asarray(IMAGENET_STD, dtype=np.float32).reshape(3, 1, 1)
        self._torchvision: Any = None
        if self.spec["backend"] == "torchvision":
            self._torchvision = torchvision_pipeline(self.spec, self.train)

    def __call__(self, image: Any, seed: int | None = None) -> torch.Tensor:
        """Transform one PIL image; ``seed`` fixes the random draws (training).

        Without a seed, a training view draws its seed from numpy's global generator (what
        :class:`rankwise.training.loader.SeededItems` seeds per item); the trainer always passes
        the item's seed.
        """
        image = image.convert("RGB")
        if self.train and seed is None:
            seed = int(np.random.randint(0, 2**63 - 1, dtype=np.int64))  # noqa: NPY002
        if self._torchvision is not None:
            image = self._run_torchvision(image, seed)
        else:
            image = self._run_pil(image, seed)
        chw = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0
        return torch.from_numpy(np.ascontiguousarray((chw - self.mean) / self.std))

    def _run_pil(self, image: Any, seed: int | None) -> Any:
        spec = self.spec
        if spec["resize"] is not None:
            image = resize_image(image, spec["resize"])
        if not self.train:
            if spec["center_crop"] is not None:
                size = spec["center_crop"]
                top, left = center_offsets(image.size[1], image.size[0], size)
                image = crop_image(image, top, left, size, size)
            return image
        rng = np.random.default_rng(seed)
        width, height = image.size
        rrc = spec["random_resized_crop"]
        if rrc is not None:
            top, left, h, w = random_resized_window(height, width, rrc["scale"], rrc["ratio"], rng)
            size = rrc["size"]
            image = crop_image(image, top, left, h, w).resize((size, size), _bilinear())
        elif spec["random_crop"] is not None:
            size = spec["random_crop"]
            if height < size or width < size:
                raise ValueError(
                    f"random_crop {size} does not fit a {width} x {height} image; set `resize` "
                    f"to at least {size}."
                )
            top = int(rng.integers(0, height - size + 1))
            left = int(rng.integers(0, width - size + 1))
            image = crop_image(image, top, left, size, size)
        if spec["hflip"] > 0 and rng.random() < spec["hflip"]:
            from PIL import Image

            image = image.transpose(Image.FLIP_LEFT_RIGHT)  # type: ignore[attr-defined]
        return image

    def _run_torchvision(self, image: Any, seed: int | None) -> Any:
        if seed is None:
            return self._torchvision(image)
        # torchvision draws from the global torch generator: seed it for this item only
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return self._torchvision(image)

    def __repr__(self) -> str:
        keys = ["resize"]
        keys += ["random_resized_crop", "random_crop", "hflip"] if self.train else ["center_crop"]
        shown = [f"{k}={self.spec[k]!r}" for k in keys if self.spec[k] not in (None, 0.0)]
        return (
            f"ImageAugmentation(train={self.train}, {', '.join(shown)}, "
            f"backend={self.spec['backend']!r})"
        )


def torchvision_pipeline(spec: Mapping[str, Any], train: bool) -> Any:
    """The same pipeline as torchvision ``transforms`` (v1) on PIL images (``backend: torchvision``).

    Raises:
        rankwise._extras.MissingDependencyError: torchvision does not import; the message says
            to install the ``vision`` extra or to use ``backend: pil``.
    """
    from .._extras import MissingDependencyError

    try:
        from torchvision import transforms
    except Exception as exc:  # absent, or broken beside this torch build
        raise MissingDependencyError(
            f"augmentation backend 'torchvision': torchvision does not import ({exc}); install "
            "the 'vision' extra (pip install 'rankwise[vision]') with a torchvision matching "
            "your torch, or use backend: pil (the same operations, numpy random numbers).",
            "vision",
            ["torchvision"],
        ) from None
    steps: list[Any] = []
    if spec["resize"] is not None:
        steps.append(transforms.Resize(spec["resize"]))
    if not train:
        if spec["center_crop"] is not None:
            steps.append(transforms.CenterCrop(spec["center_crop"]))
        return transforms.Compose(steps)
    rrc = spec["random_resized_crop"]
    if rrc is not None:
        steps.append(transforms.RandomResizedCrop(rrc["size"], rrc["scale"], rrc["ratio"]))
    elif spec["random_crop"] is not None:
        steps.append(transforms.RandomCrop(spec["random_crop"]))
    if spec["hflip"] > 0:
        steps.append(transforms.RandomHorizontalFlip(spec["hflip"]))
    return transforms.Compose(steps)
