"""Augmented-instance retrieval: any image dataset as a many-class, open-set benchmark.

Every source image is a class of its own and its samples ("views") are random affine transforms
of it plus Gaussian pixel noise: the many-class regime SOPRC was designed for (Wen et al., NeurIPS
2022, Sec. 6: Stanford Online Products, a class share pi ~ 1e-4, the quantity the SOPRC prior
estimates; here pi = 1 / train_classes) built from small offline images, as in exemplar /
instance discrimination (Dosovitskiy et al., NeurIPS 2014). Training, validation and test sources
are disjoint (open-set, queried leave-one-out). No equation of the papers is implemented here.

Training views are fresh at every fetch, from the global torch generator, which
:class:`rankwise.training.Trainer` seeds per item by ``(seed, epoch, batch, slot)`` (resume stays
bit-for-bit whatever ``num_workers``). Validation and test views are drawn once in seeded chunks,
so they are identical across runs and a larger split extends a smaller one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .._validation import Interval, check_choice, check_scalar
from .base import ArrayDataset, LabelledDataset, RetrievalSplits

__all__ = [
    "INSTANCE_DEFAULTS",
    "INSTANCE_OPTIONS",
    "InstanceViews",
    "ViewAugmentation",
    "build_instance_splits",
]

PADDING_MODES = ("zeros", "border", "reflection")

# Views drawn from one seeded generator by fixed_views.
_VIEW_CHUNK = 1024


@dataclass(frozen=True)
class ViewAugmentation:
    """A seeded random affine transform plus Gaussian pixel noise, for images in ``[0, 1]``.

    A view rotates the image by ``theta ~ U[-rotation, rotation]`` degrees, scales it by
    ``s ~ U[scale[0], scale[1]]`` about its centre, shifts it by ``U[-translation, translation]``
    times its side per axis, samples it bilinearly, adds ``N(0, noise^2)`` noise to every pixel and
    clips to ``[0, 1]``. Call it on one ``(C, H, W)`` image to draw from the global torch generator
    (what the trainer seeds per item), or :meth:`apply` on a batch with an explicit generator.

    Args:
        rotation: largest absolute rotation in degrees, in ``[0, 180]``.
        scale: ``(low, high)`` range of the zoom factor, ``0 < low <= high`` (``(1, 1)``: none).
        translation: largest shift per axis as a fraction of the image side, in ``[0, 1)``.
        noise: standard deviation of the additive pixel noise, ``>= 0``.
        padding: what pixels from outside the image become: ``"zeros"`` (black background: right
            for MNIST-like images), ``"border"`` or ``"reflection"`` (for natural images).
    """

    rotation: float = 30.0
    scale: tuple[float, float] = (0.8, 1.2)
    translation: float = 0.1
    noise: float = 0.1
    padding: str = "zeros"

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen dataclass: normalise the validated values in place
        for key, interval in (
            ("rotation", Interval("real", 0, 180)),
            ("translation", Interval("real", 0, 1, closed="left")),
            ("noise", Interval("real", 0, None)),
        ):
            set_(self, key, check_scalar(getattr(self, key), key, interval))
        set_(self, "padding", check_choice(self.padding, "padding", PADDING_MODES))
        set_(self, "scale", _check_scale(self.scale))

    def to_dict(self) -> dict[str, Any]:
        """The parameters as plain python values (``scale`` as a list)."""
        return {**asdict(self), "scale": list(self.scale)}

    def _affine(self, u: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """``(n, 2, 3)`` float64 output-to-input maps for ``F.affine_grid``, from ``(n, 4)`` uniforms."""
        theta = (2.0 * u[:, 0] - 1.0) * math.radians(self.rotation)
        s = self.scale[0] + (self.scale[1] - self.scale[0]) * u[:, 1]
        shift = (2.0 * u[:, 2:] - 1.0) * (2.0 * self.translation)  # normalised coords span 2
        cos, sin = torch.cos(theta) / s, torch.sin(theta) / s
        # inverse of "rotate by theta, scale by s" in pixel units, written in the normalised
        # coordinates of affine_grid (x spans the width, y the height: D^-1 R(-theta) D / s)
        a = torch.stack(
            [
                torch.stack([cos, sin * (height / width)], dim=1),
                torch.stack([-sin * (width / height), cos], dim=1),
            ],
            dim=1,
        )
        b = -(a @ shift.unsqueeze(2))
        return torch.cat([a, b], dim=2)

    def apply(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Views of a batch, one independent draw per image (vectorised).

        Args:
            images: ``(n, C, H, W)`` float images in ``[0, 1]``.
            generator: torch generator to draw from (``None``: the global one).

        Returns:
            ``(n, C, H, W)`` float32 views in ``[0, 1]``.
        """
        if images.ndim != 4:
            raise ValueError(f"`images` must be (n, C, H, W), got shape {tuple(images.shape)}.")
        u = torch.rand(images.shape[0], 4, generator=generator, dtype=torch.float64)
        noise = torch.randn(images.shape, generator=generator) if self.noise > 0 else None
        return self.render(images, u, noise)

    def render(
        self, images: torch.Tensor, uniforms: torch.Tensor, noise: torch.Tensor | None
    ) -> torch.Tensor:
        """Views of images from given draws (:meth:`apply` is this with fresh draws).

        Args:
            images: ``(n, C, H, W)`` float images in ``[0, 1]``.
            uniforms: ``(n, 4)`` uniforms in ``[0, 1)``: rotation, scale, x shift, y shift.
            noise: a standard-normal ``(n, C, H, W)`` field, or ``None`` for no noise.

        Returns:
            ``(n, C, H, W)`` float32 views in ``[0, 1]``.
        """
        images = images.to(torch.float32)
        _, _, height, width = images.shape
        theta = self._affine(uniforms, height, width).to(torch.float32)
        grid = F.affine_grid(theta, list(images.shape), align_corners=False)
        out = F.grid_sample(
            images, grid, mode="bilinear", padding_mode=self.padding, align_corners=False
        )
        if noise is not None and self.noise > 0:
            out.add_(noise, alpha=self.noise)
        return out.clamp_(0.0, 1.0)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        """One view of a ``(C, H, W)`` float image, drawn from the global torch generator.

        The per-item path of the training loader: the same distribution as :meth:`apply`, written
        with python floats for the four parameters because a DataLoader calls it once per item.
        """
        if image.ndim != 3:
            raise ValueError(f"`image` must be (C, H, W), got shape {tuple(image.shape)}.")
        channels, height, width = image.shape
        u0, u1, u2, u3 = torch.rand(4, dtype=torch.float64).tolist()
        theta = (2.0 * u0 - 1.0) * math.radians(self.rotation)
        s = self.scale[0] + (self.scale[1] - self.scale[0]) * u1
        tx = (2.0 * u2 - 1.0) * (2.0 * self.translation)
        ty = (2.0 * u3 - 1.0) * (2.0 * self.translation)
        cos, sin = math.cos(theta) / s, math.sin(theta) / s
        a00, a01 = cos, sin * (height / width)
        a10, a11 = -sin * (width / height), cos
        # grid = [x, y, 1] @ M with M = [[a00, a10], [a01, a11], [b0, b1]], b = -A t
        matrix = torch.tensor(
            [[a00, a10], [a01, a11], [-(a00 * tx + a01 * ty), -(a10 * tx + a11 * ty)]],
            dtype=torch.float32,
        )
        grid = (_base_grid(height, width) @ matrix).reshape(1, height, width, 2)
        out = F.grid_sample(
            image.to(torch.float32).unsqueeze(0),
            grid,
            mode="bilinear",
            padding_mode=self.padding,
            align_corners=False,
        )[0]
        if self.noise > 0:
            out.add_(torch.randn(out.shape), alpha=self.noise)
        return out.clamp_(0.0, 1.0)


def _check_scale(value: Any) -> tuple[float, float]:
    message = "`scale` must be a pair (low, high) of finite numbers with 0 < low <= high"
    try:
        low, high = (check_scalar(v, "scale", Interval("real", 0, None, "neither")) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{message}, got {value!r}.") from None
    if low > high:
        raise ValueError(f"{message}, got {value!r}.")
    return float(low), float(high)


_BASE_GRIDS: dict[tuple[int, int], torch.Tensor] = {}


def _base_grid(height: int, width: int) -> torch.Tensor:
    """``(H * W, 3)`` rows ``[x, y, 1]`` of the identity grid of ``F.affine_grid``."""
    key = (height, width)
    if key not in _BASE_GRIDS:
        identity = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
        xy = F.affine_grid(identity, [1, 1, height, width], align_corners=False).reshape(-1, 2)
        _BASE_GRIDS[key] = torch.cat([xy, torch.ones(height * width, 1)], dim=1)
    return _BASE_GRIDS[key]


class _FixedViews(ArrayDataset):
    """Evaluation split of an instance benchmark: fixed views, ``source_ids`` as in InstanceViews."""

    source_ids: np.ndarray


class InstanceViews(LabelledDataset):
    """Training split of an instance benchmark: a fresh random view at every fetch.

    Item ``i`` is a view of source ``i // views_per_class`` with that label (``0 .. S - 1``),
    drawn from the global torch generator, which the trainer seeds per item.

    Args:
        sources: ``(S, C, H, W)`` uint8 (scaled by 1/255 per item) or float images in ``[0, 1]``.
        views_per_class: items per source, ``>= 2``.
        augmentation: how views are drawn.
        name: a human-readable name used in summaries.

    Attributes:
        labels: ``(S * views_per_class,)`` ``np.int64`` class ids.
        input_shape, classes, num_classes: as in :class:`ArrayDataset`.
        transform: the augmentation (non-``None``: the trainer reseeds every item).
        source_ids: ``(S,)`` index of each source in the pool it was drawn from.
    """

    def __init__(
        self,
        sources: torch.Tensor,
        views_per_class: int,
        augmentation: ViewAugmentation,
        name: str = "",
    ) -> None:
        if not isinstance(sources, torch.Tensor) or sources.ndim != 4:
            shape = tuple(getattr(sources, "shape", ()))
            raise ValueError(f"`sources` must be a (S, C, H, W) tensor, got shape {shape}.")
        if not (sources.dtype == torch.uint8 or sources.is_floating_point()):
            raise ValueError(f"`sources` must be uint8 or floating point, got {sources.dtype}.")
        self.sources = sources
        self.views_per_class = check_scalar(
            views_per_class, "views_per_class", Interval("integer", 2, None)
        )
        self.transform = augmentation
        self.name = name
        self.labels = np.repeat(np.arange(sources.shape[0], dtype=np.int64), self.views_per_class)
        self.input_shape: tuple[int, ...] = tuple(int(s) for s in sources.shape[1:])
        self.classes = np.arange(sources.shape[0], dtype=np.int64)
        self.num_classes = int(sources.shape[0])
        self.source_ids = np.arange(sources.shape[0], dtype=np.int64)

    def _source(self, index: Any) -> torch.Tensor:
        x = self.sources[index]
        if x.dtype == torch.uint8:
            return x.to(torch.float32).div_(255.0)
        return x.to(torch.float32)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} items.")
        label = int(self.labels[index])
        return self.transform(self._source(label)), label

    def batch(
        self,
        indices: Sequence[int] | np.ndarray | torch.Tensor,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh views of a batch in one vectorised call: ``(B, *input_shape)``, ``(B,)``."""
        idx = np.asarray(indices, dtype=np.int64)
        labels = self.labels[idx]
        views = self.transform.apply(self._source(torch.from_numpy(labels)), generator)
        return views, torch.from_numpy(labels)

    def __repr__(self) -> str:
        return (
            f"InstanceViews(name={self.name!r}, sources={self.num_classes}, "
            f"views_per_class={self.views_per_class}, input_shape={self.input_shape})"
        )


def fixed_views(
    sources: torch.Tensor, views_per_class: int, augmentation: ViewAugmentation, seed: int
) -> torch.Tensor:
    """``(S * views_per_class, C, H, W)`` float32 views, source-major, fixed by ``seed``.

    Drawn in chunks of 1024 items: chunk ``k`` takes the draws of 1024 items from a generator
    seeded by ``(seed, k)`` even when it holds fewer, so the same seed gives the same views and
    the views of the first items do not depend on ``S`` (a larger split extends a smaller one).
    """
    n = sources.shape[0] * views_per_class
    shape = tuple(sources.shape[1:])
    out = torch.empty((n, *shape), dtype=torch.float32)
    for k, start in enumerate(range(0, n, _VIEW_CHUNK)):
        stop = min(start + _VIEW_CHUNK, n)
        chunk = sources[torch.arange(start, stop) // views_per_class]
        chunk = chunk.to(torch.float32).div_(255.0) if chunk.dtype == torch.uint8 else chunk
        generator = torch.Generator().manual_seed(_derive_seed(seed, k))
        uniforms = torch.rand(_VIEW_CHUNK, 4, generator=generator, dtype=torch.float64)
        noise = None
        if augmentation.noise > 0:
            noise = torch.randn((_VIEW_CHUNK, *shape), generator=generator)[: stop - start]
        out[start:stop] = augmentation.render(chunk, uniforms[: stop - start], noise)
    return out


def _derive_seed(*parts: int) -> int:
    """A 63-bit seed decorrelated from its integer parts."""
    state = np.random.SeedSequence([int(p) % 2**63 for p in parts]).generate_state(1, np.uint64)
    return int(state[0] >> np.uint64(1))


# -- options --------------------------------------------------------------------------------------

INSTANCE_OPTIONS: tuple[str, ...] = (
    "train_classes",
    "views_per_class",
    "val_classes",
    "test_classes",
    "eval_views_per_class",
    "rotation",
    "scale",
    "translation",
    "noise",
    "padding",
)
_AUGMENTATION_OPTIONS = INSTANCE_OPTIONS[5:]  # the ViewAugmentation fields
# how a source is viewed, not which sources each split holds (a pretraining on the same split fits
# runs that differ only here)
VIEW_OPTIONS: tuple[str, ...] = ("views_per_class", "eval_views_per_class", *_AUGMENTATION_OPTIONS)

# Defaults per source dataset. Fashion-MNIST is the proxy of issue 7 (4,000 training sources x 4
# views, 1,000 unseen test sources x 4 views, pi = 1 / 4000); digits has 1,797 images, so fewer
# sources. The augmentation makes raw pixels fail and leaves learning room (docs/training.md).
_FASHION_MNIST_DEFAULTS: dict[str, Any] = {
    "train_classes": 4000,
    "views_per_class": 4,
    "val_classes": 500,
    "test_classes": 1000,
    "eval_views_per_class": 4,
    "rotation": 30.0,
    "scale": (0.8, 1.2),
    "translation": 0.1,
    "noise": 0.1,
    "padding": "zeros",
}
INSTANCE_DEFAULTS: dict[str, dict[str, Any]] = {
    "fashion-mnist": _FASHION_MNIST_DEFAULTS,
    # the same views and augmentation (and key order), fewer sources
    "digits": {
        **_FASHION_MNIST_DEFAULTS,
        "train_classes": 1000,
        "val_classes": 200,
        "test_classes": 500,
    },
}


def _resolve_options(base: str, options: Mapping[str, Any]) -> dict[str, Any]:
    defaults = INSTANCE_DEFAULTS.get(base, INSTANCE_DEFAULTS["fashion-mnist"])
    unknown = sorted(set(options) - set(INSTANCE_OPTIONS))
    if unknown:
        raise ValueError(
            f"dataset option(s) {unknown} unknown for an instance dataset; it accepts "
            f"{list(INSTANCE_OPTIONS)}."
        )
    opts = {**defaults, **{k: v for k, v in options.items() if v is not None}}
    counts = {
        "train_classes": Interval("integer", 2, None),
        "views_per_class": Interval("integer", 2, None),
        "val_classes": Interval("integer", 0, None),
        "test_classes": Interval("integer", 2, None),
        "eval_views_per_class": Interval("integer", 2, None),
    }
    for key, interval in counts.items():
        opts[key] = check_scalar(opts[key], key, interval)
    if opts["val_classes"] == 1:
        raise ValueError(
            "`val_classes` must be 0 (no validation split) or >= 2: a single validation source "
            "has no negatives, got 1."
        )
    return opts


def _pick_sources(
    name: str,
    train_pool: np.ndarray,
    test_pool: np.ndarray | None,
    opts: Mapping[str, Any],
    seed: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """Disjoint ``(train, val, test)`` source indices and a note saying where they come from.

    Each split is taken from the front of a seeded permutation (val before train, test first in
    one pool), so the test and validation sources stay fixed while ``train_classes`` is swept.
    """
    n_train, n_val, n_test = opts["train_classes"], opts["val_classes"], opts["test_classes"]
    rng = np.random.default_rng(_derive_seed(seed, 0))
    if test_pool is None:
        pool = train_pool.shape[0]
        needed = n_train + n_val + n_test
        if needed > pool:
            raise ValueError(
                f"{name}: train_classes + val_classes + test_classes = {needed} source images, "
                f"but the dataset has only {pool}; lower `train_classes` (or the others)."
            )
        perm = rng.permutation(pool)
        test = perm[:n_test]
        val = perm[n_test : n_test + n_val]
        train = perm[n_test + n_val : needed]
        return train, val, test, f"{pool} images, one pool"
    pool = train_pool.shape[0]
    if n_train + n_val > pool:
        raise ValueError(
            f"{name}: train_classes + val_classes = {n_train + n_val} source images, but the "
            f"training split has only {pool}; lower `train_classes`."
        )
    if n_test > test_pool.shape[0]:
        raise ValueError(
            f"{name}: test_classes = {n_test} source images, but the test split has only "
            f"{test_pool.shape[0]}; lower `test_classes`."
        )
    perm = rng.permutation(pool)
    val, train = perm[:n_val], perm[n_val : n_val + n_train]
    test = np.random.default_rng(_derive_seed(seed, 1)).permutation(test_pool.shape[0])[:n_test]
    return train, val, test, "train / val sources from the training split, test from the test split"


def build_instance_splits(
    name: str,
    train_pool: np.ndarray,
    test_pool: np.ndarray | None = None,
    *,
    seed: int = 0,
    defaults_of: str = "fashion-mnist",
    **options: Any,
) -> RetrievalSplits:
    """Turn images into an augmented-instance, open-set retrieval benchmark.

    Args:
        name: dataset name (e.g. ``"fashion-mnist-instances"``).
        train_pool: ``(N, C, H, W)`` uint8 (0-255) or float (``[0, 1]``) images the training and
            validation sources are drawn from.
        test_pool: images the test sources are drawn from (an official test split), or ``None``
            to draw all three from ``train_pool``.
        seed: seed of the source choice and of the fixed validation / test views.
        defaults_of: whose :data:`INSTANCE_DEFAULTS` fill the options not given.
        **options: :data:`INSTANCE_OPTIONS`: ``train_classes``, ``views_per_class`` (training
            items per source), ``val_classes`` (0: no validation split), ``test_classes``,
            ``eval_views_per_class`` (views per validation / test source), and the
            :class:`ViewAugmentation` parameters.

    Returns:
        Open-set :class:`RetrievalSplits`: ``train`` an :class:`InstanceViews` (fresh views),
        ``val`` / ``test`` :class:`ArrayDataset` of fixed float32 views, queried leave-one-out.
        Labels: training sources ``0 .. T - 1``, validation ``T ..``, test after those. Each
        split's ``source_ids`` attribute gives the pool index of its classes' source images
        (``train`` / ``val`` index ``train_pool``, ``test`` indexes ``test_pool`` when given).
    """
    opts = _resolve_options(defaults_of, options)
    augmentation = ViewAugmentation(**{k: opts[k] for k in _AUGMENTATION_OPTIONS})
    for what, pool in (("train_pool", train_pool), ("test_pool", test_pool)):
        if pool is not None and np.asarray(pool).ndim != 4:
            raise ValueError(f"`{what}` must be (N, C, H, W) images, got shape {pool.shape}.")
    train_idx, val_idx, test_idx, origin = _pick_sources(name, train_pool, test_pool, opts, seed)
    test_images = train_pool if test_pool is None else test_pool

    def tensor(images: np.ndarray, idx: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(images[idx]))

    n_train, n_val = train_idx.size, val_idx.size
    train = InstanceViews(
        tensor(train_pool, train_idx), opts["views_per_class"], augmentation, f"{name}/train"
    )
    k_eval = opts["eval_views_per_class"]

    def fixed(images: torch.Tensor, first_label: int, split: str, salt: int) -> _FixedViews:
        views = fixed_views(images, k_eval, augmentation, _derive_seed(seed, salt))
        labels = first_label + np.repeat(np.arange(images.shape[0], dtype=np.int64), k_eval)
        return _FixedViews(views, labels, name=f"{name}/{split}")

    val = fixed(tensor(train_pool, val_idx), n_train, "val", 2) if n_val else None
    test = fixed(tensor(test_images, test_idx), n_train + n_val, "test", 3)
    # class j of a split is pool image source_ids[j], for audits and tests
    train.source_ids = train_idx
    if val is not None:
        val.source_ids = val_idx
    test.source_ids = test_idx
    notes = (
        f"instances: every source image is a class ({origin}); {n_train} training sources x "
        f"{opts['views_per_class']} fresh views per step (class share pi = {1 / n_train:.2g}), "
        f"{n_val} validation and {test_idx.size} test sources x {k_eval} fixed views "
        f"(disjoint sources, open-set, leave-one-out; split seed {seed})",
        "views: " + ", ".join(f"{k}={v}" for k, v in augmentation.to_dict().items()),
    )
    return RetrievalSplits(
        train=train, val=val, test=test, gallery=None, protocol="open-set", name=name, notes=notes
    )
