"""Using a trained run: the model of a run directory with the preprocessing it was trained with.

:func:`load_run` rebuilds the model from ``config.yaml`` and a checkpoint (by default
``best.pt``, the one the test report evaluates) and embeds raw inputs, as the dataset ships them,
exactly as the test data was (``rankwise embed RUN_DIR INPUT``; the input formats:
docs/training.md, "Using a trained run").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..data.own_datasets import IMAGE_SUFFIXES  # one list of image suffixes for the library
from .config import Config, config_from_dict, read_config_file
from .errors import ConfigError
from .evaluation import embed_batches
from .rundir import RunPaths, existing_results, resolve_run_dir

_NAMES = RunPaths(Path())  # the run directory's file names, relative to it


__all__ = ["IMAGE_SUFFIXES", "LoadedRun", "image_paths", "load_run"]


@dataclass
class LoadedRun:
    """A trained model ready to embed new data, with the preprocessing of its training data.

    Attributes:
        model: the embedding model, in eval mode, on ``device``.
        config: the run's :class:`Config`.
        run_dir: the run directory.
        checkpoint: the checkpoint file the weights come from.
        step: the training step of those weights.
        input_shape: the shape of one preprocessed item, e.g. ``(1, 8, 8)``.
        input_kind: ``"digits"`` (pixel values 0-16), ``"uint8"`` (0-255 images as arrays),
            ``"float"`` (an ``arrays`` dataset's float inputs, used as they are) or ``"images"``
            (image files).
        device: where the model is.
    """

    model: nn.Module
    config: Config
    run_dir: Path
    checkpoint: Path
    step: int
    input_shape: tuple[int, ...]
    input_kind: str
    device: torch.device

    def preprocess(self, inputs: Any) -> torch.Tensor:
        """Raw inputs -> the float tensor the model was trained on.

        Args:
            inputs: for array runs, an array ``(N, *input_shape)`` or, for one channel,
                ``(N, H, W)``; for image runs, a sequence of image paths.

        Returns:
            ``(N, *input_shape)`` float32 on the CPU.

        Raises:
            ValueError: wrong shape, values outside the dataset's range, or NaN.
        """
        if self.input_kind == "images":
            return self._preprocess_images(inputs)
        x = torch.as_tensor(np.asarray(inputs))
        if x.ndim == len(self.input_shape) and self.input_shape[0] == 1:
            x = x.unsqueeze(1)  # (N, H, W) -> (N, 1, H, W)
        if tuple(x.shape[1:]) != self.input_shape or x.ndim != len(self.input_shape) + 1:
            raise ValueError(
                f"`inputs` must have shape (N, {', '.join(map(str, self.input_shape))}) for a "
                f"run trained on {self.config.dataset.name}, got {tuple(x.shape)}."
            )
        if x.dtype == torch.uint8 and self.input_kind == "uint8":
            return x.to(torch.float32).div_(255.0)
        if x.dtype == torch.bool or x.is_complex():
            raise ValueError(f"`inputs` must be numeric, got {x.dtype}.")
        x = x.to(torch.float32)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("`inputs` contain NaN or inf values.")
        if x.numel() == 0:
            raise ValueError("`inputs` is empty.")
        low, high = float(x.min()), float(x.max())
        if self.input_kind == "digits":
            # scikit-learn's digits: integer pixel values 0..16, scaled by 1/16 in training
            if low < 0 or high > 16:
                raise ValueError(
                    f"`inputs`: digits pixels are 0-16 (sklearn.datasets.load_digits().images), "
                    f"got values in [{low:g}, {high:g}]."
                )
            return x / 16.0
        if self.input_kind != "float" and (low < 0 or high > 1):
            raise ValueError(
                f"`inputs`: {self.config.dataset.name} floats must be in [0, 1] (or pass the "
                f"uint8 pixels 0-255), got values in [{low:g}, {high:g}]."
            )
        return x

    def _preprocess_images(self, paths: Any) -> torch.Tensor:
        from ..data.base import default_image_transform, open_image

        if isinstance(paths, (str, Path)):
            paths = [paths]
        augment = self.config.dataset.augment
        transform: Any = default_image_transform(self.config.dataset.image_size)
        if augment is not None:  # the run's evaluation transform: resize + centre crop
            from ..data.augment import augment_transforms

            transform = augment_transforms(augment.model_dump(), self.config.dataset.image_size)[1]
        items = []
        for path in paths:
            # a missing or broken file is one DataError naming it, never PIL's traceback
            items.append(transform(open_image(path, "an image of `inputs`")))
        if not items:
            raise ValueError("`inputs`: no image paths given.")
        return torch.stack(items)

    def embed(self, inputs: Any, batch_size: int = 256) -> torch.Tensor:
        """Embed raw inputs (as in :meth:`preprocess`) in batches.

        Args:
            inputs: see :meth:`preprocess`.
            batch_size: items per forward pass.

        Returns:
            ``(N, embedding_dim)`` float32 embeddings on the CPU, as the run's evaluation saw them.
        """
        if self.input_kind == "images":
            paths = [inputs] if isinstance(inputs, (str, Path)) else list(inputs)
            chunks = [paths[i : i + batch_size] for i in range(0, len(paths), batch_size)]
            batches = (self.preprocess(chunk) for chunk in chunks)
        else:
            x = self.preprocess(inputs)
            batches = (x[i : i + batch_size] for i in range(0, x.shape[0], batch_size))
        return embed_batches(self.model, batches, self.device, finish=lambda e: e.float().cpu())


def _pick_checkpoint(run_dir: Path, checkpoint: str) -> Path:
    names = {"best": [str(_NAMES.best)], "last": [str(_NAMES.last)]}
    if checkpoint == "auto":
        candidates = names["best"] + names["last"]
    elif checkpoint in names:
        candidates = names[checkpoint]
    else:
        path = Path(checkpoint)
        if not path.is_file():
            raise ConfigError(f"checkpoint: {str(path)!r} does not exist.")
        return path
    found = existing_results(run_dir, candidates)
    if not found:
        raise ConfigError(
            f"run_dir: {str(run_dir)!r} holds no {' or '.join(candidates)}; train the run first "
            "(rankwise train) or resume it."
        )
    return run_dir / found[0]


def load_run(
    run_dir: str | Path,
    checkpoint: str = "auto",
    device: str | torch.device | None = None,
) -> LoadedRun:
    """The trained model of a run directory, with the preprocessing of its training data.

    Args:
        run_dir: a run directory (``config.yaml`` + checkpoints), or a folder holding one.
        checkpoint: ``"auto"`` (``best.pt``, the model selected on validation that the test
            report evaluates, else ``last.pt``), ``"best"``, ``"last"`` or a checkpoint path.
        device: where to put the model (default: the CPU).

    Returns:
        A :class:`LoadedRun`; ``load_run(d).embed(x)`` embeds raw inputs ``x``.

    Raises:
        ConfigError: no run there, no such checkpoint, or its backbone cannot be rebuilt (a
            factory ``"package.module:factory"`` that no longer imports, names the factory).
        CorruptCheckpointError: the checkpoint cannot be read.

    Example:
        >>> run = load_run("runs/digits/soprc-seed0")  # doctest: +SKIP
        >>> from sklearn.datasets import load_digits  # doctest: +SKIP
        >>> emb = run.embed(load_digits().images)  # (1797, 64)  # doctest: +SKIP
    """
    from ..data.registry import input_spec
    from ..models import BackboneError, build_model
    from .checkpoint import load_checkpoint

    path = Path(run_dir)
    if RunPaths(path).config.is_file() and RunPaths(path).checkpoints.is_dir():
        run_path = path
    else:
        run_path = resolve_run_dir(path)
    config = config_from_dict(read_config_file(RunPaths(run_path).config))
    source = _pick_checkpoint(run_path, checkpoint)
    dev = torch.device(device) if device is not None else torch.device("cpu")
    state = load_checkpoint(source, map_location=dev)
    input_shape, kind = input_spec(
        config.dataset.name, int(config.dataset.image_size), config.dataset.data_dir
    )
    # the trained weights replace the backbone's: no pretrained weights file is needed here
    try:
        model = build_model(
            config.model.backbone,
            input_shape,
            config.model.embedding_dim,
            weights_path=None,
            frozen_bn=config.model.frozen_bn,
            backbone_options=config.model.backbone_options,
        )
    except BackboneError as exc:  # e.g. a factory that no longer imports
        options = config.model.backbone_options
        raise ConfigError(
            f"run {str(run_path)!r} needs backbone {config.model.backbone!r} (model.backbone "
            f"in its config.yaml{f', options {options}' if options else ''}) to rebuild its "
            f"model: {exc}"
        ) from None
    model.load_state_dict(state["model"])
    model.to(dev).eval()
    return LoadedRun(
        model=model,
        config=config,
        run_dir=run_path,
        checkpoint=source,
        step=int(state.get("step", 0)),
        input_shape=input_shape,
        input_kind=kind,
        device=dev,
    )


def image_paths(folder: str | Path) -> list[Path]:
    """The image files below ``folder`` (recursively; ``[folder]`` for a file), sorted."""
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
