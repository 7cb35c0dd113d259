"""The checks of the Trainer's arguments (each named, before any step) and its deterministic mode.

:func:`determinism` switches on the deterministic algorithms that make a run resumable bit for
bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._validation import Interval, check_scalar, resolve_device
from .config import Config

__all__ = [
    "check_dataset",
    "check_datasets",
    "check_modules",
    "check_run_options",
    "check_schedule",
    "determinism",
    "device_of",
    "positive_int",
    "resolved_device",
]

LRSchedule = Callable[[int], float] | torch.optim.lr_scheduler.LRScheduler


@contextlib.contextmanager
def determinism(enabled: bool) -> Iterator[None]:
    """Deterministic algorithms (warn-only) and cuDNN inside the block, when ``enabled``."""
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    previous_cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    if enabled:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous_cudnn


def device_of(model: nn.Module, device: str | torch.device | None) -> torch.device:
    """The device of ``device`` (``None``: where the model's parameters are)."""
    if device is None:
        first = next(iter(model.parameters()), None)
        return first.device if first is not None else torch.device("cpu")
    return resolve_device(device)


def check_dataset(data: Any, name: str, required: bool = False) -> None:
    """``data`` is a non-empty map-style dataset of ``(x, label)`` items (or ``None``)."""
    if data is None:
        if required:
            raise ValueError(f"`{name}` is required: a map-style dataset of (x, label) items.")
        return
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ValueError(
            f"`{name}` must be a map-style dataset (with __len__ and __getitem__ returning "
            f"(x, label)), got {type(data).__name__}."
        )
    if len(data) == 0:
        raise ValueError(f"`{name}` is empty.")
    item = data[0]  # one item, so a wrong layout fails here and not in a worker process
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ValueError(
            f"`{name}[0]` must be an (x, label) pair, got {type(item).__name__}; wrap the data "
            "in a Dataset whose __getitem__ returns (input, class id)."
        )


def check_datasets(train_data: Any, val_data: Any, test_data: Any, gallery_data: Any) -> None:
    """The Trainer's datasets: each map-style (:func:`check_dataset`), a gallery with its test."""
    check_dataset(train_data, "train_data", required=True)
    for data, data_name in ((val_data, "val_data"), (test_data, "test_data")):
        check_dataset(data, data_name)
    check_dataset(gallery_data, "gallery_data")
    if gallery_data is not None and test_data is None:
        raise ValueError("`gallery_data` is the gallery of a test: pass `test_data` too.")


def resolved_device(device: str | torch.device | None) -> torch.device | None:
    """``device`` when it is already resolved (a ``torch.device``, a CUDA one with its index)."""
    if isinstance(device, torch.device) and (device.type != "cuda" or device.index is not None):
        return device
    return None


def positive_int(value: Any, name: str, low: int = 1) -> int:
    """``value`` as an integer ``>= low``, or a ValueError naming ``name``."""
    return check_scalar(value, name, Interval("integer", low, None))


def check_modules(model: Any, loss_fn: Any) -> None:
    """The model and the loss are modules (a config as the model: ``Trainer.from_config``)."""
    if isinstance(model, Config):
        raise TypeError(
            "Trainer(config) became Trainer.from_config(config); Trainer() takes the model, "
            "the loss and the training data."
        )
    if not isinstance(model, nn.Module):
        raise ValueError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(loss_fn, nn.Module):
        raise ValueError(
            f"`loss_fn` must be a torch.nn.Module called as loss_fn(embeddings, labels) "
            f"(every rankwise.losses loss is one), got {type(loss_fn).__name__}."
        )


def check_run_options(
    run_dir: Path | None, resume: bool, overwrite: bool, resume_from: str | Path | None = None
) -> None:
    """``resume``, ``overwrite`` and ``resume_from`` fit together and with ``run_dir``."""
    if resume_from is not None and not resume:
        raise ValueError("`resume_from` names the checkpoint to resume: pass `resume` too.")
    if resume and run_dir is None:
        raise ValueError("`resume` needs the `run_dir` of the run to continue.")
    if resume and overwrite:
        raise ValueError(
            "pass `resume` or `overwrite`, not both: `resume` continues the run, "
            "`overwrite` deletes its results and starts afresh."
        )


def check_schedule(schedule: LRSchedule | None) -> Callable[[int], float] | None:
    """The per-step learning-rate function of ``schedule`` (``None``: a scheduler, or none)."""
    if schedule is None or isinstance(schedule, torch.optim.lr_scheduler.LRScheduler):
        return None
    if not callable(schedule):
        raise ValueError(
            "`lr_schedule` must be a function step -> learning rate or a torch LRScheduler, "
            f"got {type(schedule).__name__}."
        )
    return schedule
