"""Config -> the parts of a trainer: the one place that reads a run's configuration.

Builds what a :class:`~rankwise.training.config.Config` describes (the protocol of Wen et al.,
NeurIPS 2022, Sec. 5.1 and App. D.1) for a given trainer class: the strategy chosen from the
environment (:func:`~rankwise.training.launch.choose_strategy`: data-parallel under torchrun), the
run store (one lock and one results check per run), the device (resolved once), the data, model,
loss, sampler, optimizer and schedule; then calls the class with plain objects, settings groups and
the config's plain dict as an opaque record. It never imports the Trainer (it is given the class),
so ``Trainer.from_config`` reaches it from below; :mod:`rankwise.training.factory` is its public
face, with the Trainer as the default class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from .build import (
    build_loss_from_config,
    build_model_from_config,
    build_optimizer,
    build_sampler_from_config,
    check_batch_classes,
    check_data_files,
    learning_rate_at,
    load_splits,
    resolve_device,
    seed_everything,
    total_steps,
)
from .callbacks import CollapseDetector, PlotCurves, config_collapse_advice
from .callbacks.host import CallbackLike
from .config import Config, config_from_dict, read_config_file
from .errors import ConfigError, CorruptCheckpointError
from .launch import choose_strategy
from .rundir import resolve_run_dir
from .settings import Logging, Runtime, Schedule
from .store import RunPaths, RunStore, fallback_checkpoint
from .strategy import SingleProcess

if TYPE_CHECKING:
    from rich.console import Console

    from ..data import RetrievalSplits
    from ..metrics import PRCurve, RetrievalReport

__all__ = ["ModelLike", "build_from_config", "resume_from_run_dir", "strategy_of"]

ModelLike = nn.Module | Callable[[tuple[int, ...]], nn.Module]
_T = TypeVar("_T")


def strategy_of(
    config: Config | dict[str, Any], data_parallel: bool = False
) -> tuple[SingleProcess, torch.device | None]:
    """The strategy of a run of ``config`` in this environment, and its device once chosen.

    Data-parallel under torchrun (joining the process group with ``distributed.backend`` and the
    ``device`` setting), else one process (see :func:`~rankwise.training.launch.choose_strategy`).

    Args:
        config: the run's config, or a plain dict of one (read before it is validated, e.g. the
            ``config.yaml`` of a run to resume).
        data_parallel: train data-parallel even in a group of one process.

    Returns:
        ``(strategy, device)`` (``device`` ``None``: not chosen yet).
    """
    if isinstance(config, Config):
        settings: dict[str, Any] = config.distributed.model_dump()
        device: str = config.device
    else:
        settings = config.get("distributed") or {}
        device = config.get("device", "auto")
    return choose_strategy(
        backend=settings.get("backend", "auto"),
        device=device,
        check_every=settings.get("check_every"),
        sync_batchnorm=settings.get("sync_batchnorm", True),
        data_parallel=data_parallel,
    )


def build_from_config(
    trainer_cls: Callable[..., _T],
    config: Config,
    *,
    model: ModelLike | None = None,
    metric_fn: Callable[..., RetrievalReport] | None = None,
    curve_fn: Callable[..., PRCurve] | None = None,
    splits: RetrievalSplits | None = None,
    resume: bool = False,
    overwrite: bool = False,
    console: Console | None = None,
    callbacks: Sequence[CallbackLike] = (),
    resume_from: str | Path | None = None,
    name: str | None = None,
    plots: PlotCurves | None = None,
) -> _T:
    """A ``trainer_cls`` of what ``config`` describes (see :func:`~rankwise.training.factory.build_trainer`).

    Args:
        trainer_cls: the trainer class (its ``strategy_class`` may ask for data parallelism).
        config: the validated run configuration.
        model: the model instead of ``config.model``'s (a module, or a function of the input
            shape).
        metric_fn: the evaluation.
        curve_fn: the test curve.
        splits: pre-loaded splits.
        resume: continue from the output directory's checkpoint.
        overwrite: start afresh in an output directory that holds a run.
        console: rich console for messages.
        callbacks: extra callbacks.
        resume_from: with ``resume``, the checkpoint to continue from.
        name: the run's name (default ``"<loss> on <dataset>"``).
        plots: the plots callback.

    Returns:
        The trainer.
    """
    strategy, device = strategy_of(config, _data_parallel(trainer_cls))
    key = "run_dir" if resume else "output_dir"
    store = RunStore(
        config.resolved_output_dir(), strategy=strategy, key=key, record=config.to_dict()
    )
    # locked, and a run in it refused, before the data is loaded
    store.open(resume=resume, overwrite=overwrite, resume_from=resume_from)
    parts = _Parts(model, metric_fn, curve_fn, splits, console, callbacks, name, plots)
    return _assemble(trainer_cls, config, store, device, parts)


def _data_parallel(trainer_cls: Callable[..., Any]) -> bool:
    """Whether ``trainer_cls`` asks for data parallelism (``DistributedTrainer``)."""
    return getattr(trainer_cls, "strategy_class", SingleProcess) is not SingleProcess


@dataclass(frozen=True)
class _Parts:
    """What a caller gives besides the config (see :func:`build_from_config`)."""

    model: ModelLike | None = None
    metric_fn: Callable[..., RetrievalReport] | None = None
    curve_fn: Callable[..., PRCurve] | None = None
    splits: RetrievalSplits | None = None
    console: Console | None = None
    callbacks: Sequence[CallbackLike] = ()
    name: str | None = None
    plots: PlotCurves | None = None


def _assemble(
    trainer_cls: Callable[..., _T],
    config: Config,
    store: RunStore,
    device: torch.device | None,
    parts: _Parts,
) -> _T:
    """The trainer of ``config`` in the opened ``store``; a failure releases the store."""
    try:
        if device is None:
            device = resolve_device(config.device)  # once per run
        return _build(trainer_cls, config, store, device, parts)
    except BaseException:
        store.release()
        raise


def _build(
    trainer_cls: Callable[..., _T],
    config: Config,
    store: RunStore,
    device: torch.device,
    parts: _Parts,
) -> _T:
    model, splits, name, plots = parts.model, parts.splits, parts.name, parts.plots
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    # data, then every data-dependent check before anything is built
    check_files = splits is None  # a sweep checks the splits it hands over, once for all runs
    splits = splits if splits is not None else load_splits(config)
    train_labels, n_classes = check_batch_classes(config, splits)
    # model, loss, sampler, optimizer (seeded: the same seed gives the same init)
    seed_everything(config.seed)
    if model is None:
        model = build_model_from_config(config, splits.train.input_shape)
    elif not isinstance(model, nn.Module):
        model = model(splits.train.input_shape)
    loss_fn = build_loss_from_config(config, train_labels, n_classes)
    sampler = build_sampler_from_config(config, train_labels)
    steps = total_steps(config, len(sampler))
    params = [p for p in model.parameters() if p.requires_grad]
    params += [p for p in loss_fn.parameters() if p.requires_grad]
    name = name or f"{config.loss.name} on {config.dataset.name}"
    if plots is None:
        plots = PlotCurves(
            title=name,
            pr_title=f"test mean PR curve ({config.dataset.name})",
            label=config.loss.name,
        )
    advice = config_collapse_advice(config)  # in config keys
    collapse = CollapseDetector(advice=lambda _trainer: advice)
    evaluation: dict[str, Any] = {"metric_fn": parts.metric_fn, "curve_fn": parts.curve_fn}
    if check_files:  # the slow check last, after the instant ones passed
        _check_files(config, splits, store, parts.console)
    return trainer_cls(
        model,
        loss_fn,
        splits.train,
        val_data=splits.val,
        test_data=splits.test,
        gallery_data=splits.gallery,
        optimizer=build_optimizer(config.optimizer, params, getattr(model, "backbone", None)),
        sampler=sampler,
        callbacks=[collapse, plots, *parts.callbacks],
        run_dir=store,
        strategy=store.strategy,
        schedule=Schedule(
            iterations=steps,
            lr_schedule=partial(learning_rate_at, config, total_steps=steps),
            eval_every=config.eval_every,
        ),
        runtime=Runtime(
            device=device,
            seed=config.seed,
            num_workers=config.num_workers,
            deterministic=config.deterministic,
        ),
        logging=Logging(
            log_every=config.log_every,
            progress=config.progress,
            console=parts.console,
            name=name,
            loss_name=config.loss.name,
        ),
        eval_ks=config.eval_ks,
        eval_batch_size=config.eval_batch_size,
        **{k: v for k, v in evaluation.items() if v is not None},  # else the class default
    )


def _check_files(
    config: Config, splits: RetrievalSplits, store: RunStore, console: Console | None
) -> None:
    """The pre-flight check of the data files, on the main process (cached in the run folder)."""
    cache = None if store.root is None else store.paths.preflight

    def check() -> str | None:
        from rich.console import Console

        try:
            check_data_files(config, splits, cache, console or Console(stderr=True))
        except ConfigError as exc:
            return str(exc)
        return None

    message = store.strategy.from_main_process(check)  # every rank learns a failure
    if message is not None:
        raise ConfigError(message)


def _launch_settings(paths: RunPaths) -> dict[str, Any]:
    """The saved config's plain dict, for joining the process group (``{}``: unreadable yet)."""
    try:
        return read_config_file(paths.config)
    except ConfigError:  # the resumption below reports it, the folder locked
        return {}


def resume_from_run_dir(
    trainer_cls: Callable[..., _T],
    run_dir: str | Path,
    *,
    num_workers: int | None = None,
    device: str | None = None,
    console: Console | None = None,
    checkpoint: str | Path | None = None,
) -> _T:
    """The ``trainer_cls`` that resumes the config run in ``run_dir`` (see ``Trainer.from_run_dir``).

    Args:
        trainer_cls: the trainer class.
        run_dir: a run directory, or a folder holding exactly one.
        num_workers: may change freely (batches do not depend on it).
        device: may change too (results are then no longer bit-identical).
        console: rich console for messages.
        checkpoint: the checkpoint file to continue from instead of ``last.pt``.

    Returns:
        The trainer, at the step of the checkpoint.
    """
    paths = RunPaths(resolve_run_dir(run_dir))
    launch = _launch_settings(paths)
    if device is not None:
        launch["device"] = device
    strategy, chosen = strategy_of(launch, _data_parallel(trainer_cls))
    store = RunStore(paths.root, strategy=strategy, key="run_dir")
    store.open(resume=True, resume_from=checkpoint)  # locked before config.yaml is read
    try:
        data = read_config_file(paths.config)
        data["output_dir"] = str(paths.root)
        if num_workers is not None:
            data["num_workers"] = num_workers
        if device is not None:
            data["device"] = device
        if checkpoint is None and not paths.last.is_file():
            raise CorruptCheckpointError(paths.last, "it is missing").with_context(
                run_dir=paths.root, **fallback_checkpoint(paths.root)
            )
        config = config_from_dict(data)
    except BaseException:
        store.release()
        raise
    store.record = config.to_dict()  # what config.yaml and the checkpoints go on holding
    return _assemble(trainer_cls, config, store, chosen, _Parts(console=console))
