"""Config to objects: the data, model, loss, sampler, optimizer and schedule of a run.

From a validated :class:`~rankwise.training.config.Config` (``config`` below) to the objects a
:class:`~rankwise.training.trainer.Trainer` takes, following the protocol of Wen et al. (NeurIPS
2022), Sec. 5.1 and App. D.1. Every check that needs the data is made here, before training, as a
:class:`~rankwise.training.errors.ConfigError` naming the config key; :func:`preflight` runs them
all without building the model; :func:`check_data_files` opens every listed image file first
(:mod:`rankwise.data.preflight`). ``splits`` is the loaded :class:`~rankwise.data.RetrievalSplits`.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn
from torch.optim.optimizer import ParamsT

from .._validation import resolve_device as resolve_any_device
from .config import Config, OptimizerConfig
from .errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from ..data import RetrievalSplits
    from ..sampling import MPerClassBatchSampler

__all__ = [
    "build_loss_from_config",
    "build_model_from_config",
    "build_optimizer",
    "build_sampler_from_config",
    "check_batch_classes",
    "default_optimizer",
    "check_data_files",
    "learning_rate_at",
    "load_splits",
    "preflight",
    "resolve_device",
    "seed_everything",
    "total_steps",
]


def learning_rate_at(config: Config, step: int, total_steps: int) -> float:
    """Learning rate of the optimizer step with 0-based index ``step``.

    multistep: ``lr * gamma ** (number of milestones <= step)`` (as ``MultiStepLR`` stepped per
    iteration); cosine: ``min_lr + (lr - min_lr) * (1 + cos(pi * step / total_steps)) / 2``.

    Args:
        config: the run configuration (``optimizer.lr`` and the ``schedule`` section).
        step: 0-based index of the optimizer step.
        total_steps: the run's budget in steps (the cosine period).

    Returns:
        The learning rate; a pure function of the step, so the schedule needs no state.
    """
    base = config.optimizer.lr
    schedule = config.schedule
    if schedule.name == "multistep":
        passed = sum(1 for milestone in schedule.milestones if milestone <= step)
        return base * schedule.gamma**passed
    if schedule.name == "cosine":
        progress = min(step, total_steps) / max(total_steps, 1)
        return schedule.min_lr + (base - schedule.min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * progress)
        )
    return base


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device of ``name`` (the ``device`` key: ``auto`` -> CUDA when available, else CPU).

    Raises:
        ConfigError: ``cuda`` without a GPU.
    """
    try:
        return resolve_any_device(name, "device")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def seed_everything(seed: int) -> None:
    """Seed ``random``, numpy's global generator and torch (CPU and CUDA) with ``seed`` (>= 0)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))  # noqa: NPY002
    torch.manual_seed(seed)


def load_splits(config: Config) -> RetrievalSplits:
    """:func:`rankwise.data.load_dataset` for ``config.dataset``; failures as ConfigError.

    Returns:
        The dataset's :class:`~rankwise.data.RetrievalSplits`.
    """
    from ..data import load_dataset

    ds = config.dataset
    try:
        return load_dataset(
            ds.name,
            protocol=ds.protocol,
            data_dir=ds.data_dir,
            val_fraction=ds.val_fraction,
            seed=ds.split_seed,
            image_size=ds.image_size,
            val_holdout=ds.val_holdout,
            augment=None if ds.augment is None else ds.augment.model_dump(),
            **ds.options,
        )
    except FileNotFoundError as exc:
        raise ConfigError(f"dataset.data_dir: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"dataset: {exc}") from None


PROGRESS_FROM = 2000  # image files from which the pre-flight check shows a progress bar


def check_data_files(
    config: Config,
    splits: RetrievalSplits,
    cache: str | Path | None,
    console: Console | None = None,
) -> int:
    """The pre-flight check of the image files of ``splits`` (``dataset.preflight``).

    Every listed file must exist and its header decode
    (:func:`rankwise.data.preflight.check_image_files`, in a thread pool, with a progress bar on
    ``console`` from :data:`PROGRESS_FROM` files); the check is skipped when ``cache`` holds the
    fingerprint of the same file list, and when ``dataset.preflight`` is false. Array datasets
    have no file to check.

    Args:
        config: the run's config.
        splits: its loaded splits.
        cache: the cache file (``preflight.json`` of the run or sweep folder; ``None``: none).
        console: where the progress bar goes (``None``: no bar).

    Returns:
        How many files were opened now (``0``: skipped, cached or no image files).

    Raises:
        ConfigError: ``dataset '<name>': '<file>' (<list file>, line N): missing`` (or ``not an
            image``), every bad file counted; nothing has been written.
    """
    from ..data.preflight import DataFilesError, check_image_files

    if not config.dataset.preflight:
        return 0
    with _file_progress(console, config.dataset.name) as progress:
        try:
            report = check_image_files(splits, cache=cache, progress=progress)
        except DataFilesError as exc:
            raise ConfigError(str(exc)) from None
    return report.decoded


@contextlib.contextmanager
def _file_progress(console: Console | None, name: str) -> Iterator[Any]:
    """A ``progress(done, total)`` that draws a rich bar on ``console`` for large file lists."""
    if console is None:
        yield None
        return
    from rich.progress import Progress

    bar: Progress | None = None
    task: Any = None

    def progress(done: int, total: int) -> None:
        nonlocal bar, task
        if total < PROGRESS_FROM or task == "said":
            return
        if not console.is_terminal:  # a log: one line says what the wait is
            console.print(f"checking the {total} image files of {name} (dataset.preflight)")
            task = "said"
            return
        if bar is None:
            bar = Progress(console=console, transient=True)
            bar.start()
            task = bar.add_task(f"checking the image files of {name}", total=total)
        bar.update(task, completed=done)

    try:
        yield progress
    finally:
        if bar is not None:
            bar.stop()


def check_batch_classes(config: Config, splits: RetrievalSplits) -> tuple[np.ndarray, int]:
    """The training labels and class count, after checking a batch's classes fit in them.

    Returns:
        ``(train_labels (N,) int64, number of training classes)``.
    """
    train_labels = np.asarray(splits.train.labels, dtype=np.int64)
    n_classes = int(np.unique(train_labels).size)
    size, m = config.sampler.batch_size, config.sampler.m
    if n_classes < 2:
        raise ConfigError(
            f"dataset: the training split of {config.dataset.name!r} has {n_classes} class; "
            "ranking losses need at least 2."
        )
    fits = size % m == 0 and size // m <= n_classes
    if not fits:
        # what works here: a multiple of m holding 2..n_classes classes, nearest to the request
        low = m * min(max(size // m, 2), n_classes)
        high = m * min(max(-(-size // m), 2), n_classes)
        suggestion = " or ".join(str(v) for v in sorted({low, high}))
        why = (
            f"{size} is not divisible by sampler.m={m}"
            if size % m
            else f"{size} / sampler.m={m} = {size // m} classes per batch"
        )
        raise ConfigError(
            f"sampler.batch_size: {why}, and the training split of {config.dataset.name!r} has "
            f"{n_classes} classes; a batch holds a multiple of {m} samples from 2 to {n_classes} "
            f"classes ({2 * m} to {n_classes * m}): use sampler.batch_size={suggestion}."
        )
    return train_labels, n_classes


def build_loss_from_config(config: Config, train_labels: np.ndarray, n_classes: int) -> nn.Module:
    """:func:`rankwise.losses.build_loss` for ``config.loss``; bad parameters as ConfigError.

    Args:
        config: the run configuration.
        train_labels: (N,) class ids of the training split.
        n_classes: number of training classes.

    Returns:
        The loss module.
    """
    from ..losses import build_loss

    try:
        return build_loss(
            config.loss.name,
            train_labels=train_labels,
            num_classes=n_classes,
            embedding_dim=config.model.embedding_dim,
            memory=None if config.loss.memory is None else config.loss.memory.model_dump(),
            **config.loss.params,
        )
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"loss.params ({config.loss.name}): {exc}") from None


def build_sampler_from_config(config: Config, train_labels: np.ndarray) -> MPerClassBatchSampler:
    """The P x K batch sampler of ``config.sampler``, seeded with ``config.seed``.

    Args:
        config: the run configuration.
        train_labels: (N,) class ids of the training split.

    Returns:
        The sampler (at least one full batch per epoch).
    """
    from ..sampling import MPerClassBatchSampler

    try:
        sampler = MPerClassBatchSampler(
            train_labels, config.sampler.m, config.sampler.batch_size, seed=config.seed
        )
    except ValueError as exc:
        raise ConfigError(f"sampler: {exc}") from None
    if len(sampler) <= 0:
        raise ConfigError("sampler: the training split yields no full batch per epoch.")
    return sampler


def build_model_from_config(config: Config, input_shape: Sequence[int]) -> nn.Module:
    """:func:`rankwise.models.build_model` for ``config.model``; failures as ConfigError.

    Args:
        config: the run configuration.
        input_shape: the shape of one input item, e.g. ``(1, 8, 8)``.

    Returns:
        The embedding model (on the CPU).
    """
    from ..models import BackboneError, build_model

    mc = config.model
    try:
        model = build_model(
            mc.backbone,
            tuple(input_shape),
            mc.embedding_dim,
            weights_path=mc.weights_path,
            frozen_bn=mc.frozen_bn,
            backbone_options=mc.backbone_options,
        )
    except FileNotFoundError as exc:
        raise ConfigError(f"model.weights_path: {exc}") from None
    except BackboneError as exc:  # a factory / timm backbone: the key at fault
        raise ConfigError(f"model.{exc.argument}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    if mc.pretrained is not None:
        model.load_state_dict(_pretrained_state(config, tuple(input_shape)))
    return model


def _pretrained_state(config: Config, input_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The state dict of ``model.pretrained``, after checking it fits the config's model and data."""
    from ..data.instances import VIEW_OPTIONS

    path = Path(config.model.pretrained or "")
    path = path / "pretrained.pt" if path.is_dir() else path
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
        meta, state = stored["metadata"], stored["model"]
    except (OSError, RuntimeError, KeyError, TypeError) as exc:
        raise ConfigError(f"model.pretrained: {path} is no pretrained.pt ({exc}).") from None
    mc, ds = config.model, config.dataset
    wanted = {
        "backbone": mc.backbone,
        "embedding_dim": mc.embedding_dim,
        "frozen_bn": mc.frozen_bn,
        "input_shape": list(input_shape),
    }
    if mc.backbone_options:  # rankwise pretrain builds its backbone without options
        wanted["backbone_options"] = mc.backbone_options

    def held_out(dataset: dict[str, Any]) -> dict[str, Any]:
        # views and augmentation do not move a source between splits
        options = {k: v for k, v in dataset["options"].items() if k not in VIEW_OPTIONS}
        return {**dataset, "options": options}

    stored = {**meta, "dataset": held_out(meta["dataset"])}
    if meta["dataset"]["name"] == ds.name:  # the same pool: its held-out sources must be ours
        wanted["dataset"] = held_out(
            {"name": ds.name, "split_seed": ds.split_seed, "options": ds.options}
        )
    for key, value in wanted.items():
        if stored.get(key, {}) != value:
            raise ConfigError(
                f"model.pretrained: {path} was pretrained with {key}={stored.get(key, {})!r}, "
                f"this run has {key}={value!r}; pretrain again with this run's settings."
            )
    return state


def default_optimizer(model: nn.Module, loss_fn: nn.Module) -> torch.optim.Optimizer:
    """The Trainer's default: ``Adam(lr=1e-3)`` over the trainable parameters of both modules.

    Raises:
        ValueError: neither has a trainable parameter.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    params += [p for p in loss_fn.parameters() if p.requires_grad]
    if not params:
        raise ValueError("`model` has no trainable parameter (requires_grad) to optimize.")
    return torch.optim.Adam(params, lr=1e-3)


def build_optimizer(
    oc: OptimizerConfig,
    params: Sequence[torch.nn.Parameter],
    backbone: nn.Module | None = None,
) -> torch.optim.Optimizer:
    """The optimizer named by ``oc`` over ``params``.

    ``sgd``/``adam``: coupled L2 (``weight_decay * w`` in the gradient); ``adamw``: decoupled
    decay, which cannot outweigh a tiny loss gradient (see docs/losses.md, SOPRC).

    Args:
        oc: the ``optimizer`` section.
        params: the parameters to optimize.
        backbone: the model's backbone: with ``oc.backbone_lr_mult != 1`` its parameters form a
            second group whose ``lr_mult`` the trainer applies to the scheduled rate.

    Returns:
        The torch optimizer.
    """
    groups: ParamsT = params
    if backbone is not None and oc.backbone_lr_mult != 1.0:
        in_backbone = {id(p) for p in backbone.parameters()}
        head: dict[str, Any] = {"params": [p for p in params if id(p) not in in_backbone]}
        groups = [  # the head (and loss) group first: param_groups[0] has the scheduled rate
            head,
            {
                "params": [p for p in params if id(p) in in_backbone],
                "lr": oc.lr * oc.backbone_lr_mult,
                "lr_mult": oc.backbone_lr_mult,
            },
        ]
    if oc.name == "sgd":
        return torch.optim.SGD(groups, lr=oc.lr, momentum=oc.momentum, weight_decay=oc.weight_decay)
    if oc.name == "adamw":
        return torch.optim.AdamW(groups, lr=oc.lr, weight_decay=oc.weight_decay)
    return torch.optim.Adam(groups, lr=oc.lr, weight_decay=oc.weight_decay)


def total_steps(config: Config, steps_per_epoch: int) -> int:
    """The run's budget in optimizer steps (``budget.iterations`` or epochs x batches).

    Args:
        config: the run configuration.
        steps_per_epoch: batches the sampler yields per epoch.

    Returns:
        The number of steps; milestones at or past it are a ConfigError.
    """
    budget = config.budget
    if budget.iterations is not None:
        total = budget.iterations
    else:  # the config holds one of the two
        assert budget.epochs is not None
        total = budget.epochs * steps_per_epoch
    milestones = config.schedule.milestones
    if config.schedule.name == "multistep" and milestones[-1] >= total:
        raise ConfigError(
            f"schedule.milestones: {milestones} reach past the budget of {total} steps; the "
            "last decay would never happen."
        )
    return total


def preflight(config: Config, splits: RetrievalSplits) -> int:
    """Every check :meth:`Trainer.from_config` makes before training, without building the model.

    Returns:
        The number of training steps of the run.
    """
    train_labels, n_classes = check_batch_classes(config, splits)
    build_loss_from_config(config, train_labels, n_classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the trainer warns about undersized classes itself
        sampler = build_sampler_from_config(config, train_labels)
    return total_steps(config, len(sampler))
