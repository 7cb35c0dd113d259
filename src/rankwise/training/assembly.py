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
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import torch
from torch import nn

from .arguments import positive_int
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
from .callbacks import (
    BestCheckpoint,
    CollapseDetector,
    EarlyStopping,
    MLflowTracker,
    PlotCurves,
    TensorBoardTracker,
    config_collapse_advice,
)
from .callbacks.base import Callback
from .callbacks.host import CallbackLike
from .config import Config, config_from_dict, read_config_file
from .data_record import check_same_data, data_fingerprint, read_data_record
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

__all__ = [
    "BuildOptions",
    "ModelLike",
    "ResumeOptions",
    "build_from_config",
    "resume_from_run_dir",
    "strategy_of",
]

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


class BuildOptions(TypedDict, total=False):
    """The keywords of a trainer built from a config (:func:`build_from_config`), named once.

    ``Trainer.from_config`` and ``factory.build_trainer`` take exactly these.
    """

    model: ModelLike | None
    metric_fn: Callable[..., RetrievalReport] | None
    curve_fn: Callable[..., PRCurve] | None
    splits: RetrievalSplits | None
    resume: bool
    overwrite: bool
    console: Console | None
    callbacks: Sequence[CallbackLike]
    resume_from: str | Path | None
    name: str | None
    plots: PlotCurves | None


class ResumeOptions(TypedDict, total=False):
    """The keywords of a trainer resumed from its run folder (:func:`resume_from_run_dir`).

    ``Trainer.from_run_dir`` takes exactly these.
    """

    num_workers: int | None
    device: str | None
    console: Console | None
    checkpoint: str | Path | None
    data_dir: str | Path | None
    max_steps: int | None


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
    extend_to: int | None = None  # a resumption's budget: a shorter one is extended to it
    moved_from: str | None = None  # a resumption's data folder before ``data_dir`` changed it


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
    trackers = _trackers(config)  # a missing package fails here, before the data is read
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    # data, then every data-dependent check before anything is built
    check_files = splits is None  # a sweep checks the splits it hands over, once for all runs
    splits = splits if splits is not None else _load_splits(config, store)
    _record_data(config, store, splits, parts.moved_from)
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
    if parts.extend_to is not None and parts.extend_to > steps:
        config = _extended(config, store, steps, parts.extend_to)
        steps = parts.extend_to
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
    selection: list[Callback] = [BestCheckpoint(config.selection.monitor)]
    stopping = config.early_stopping
    if stopping is not None:
        selection.append(
            EarlyStopping(
                stopping.monitor or config.selection.monitor,
                stopping.patience,
                stopping.min_delta,
                stopping.mode,
            )
        )
    return trainer_cls(
        model,
        loss_fn,
        splits.train,
        val_data=splits.val,
        test_data=splits.test,
        gallery_data=splits.gallery,
        optimizer=build_optimizer(config.optimizer, params, getattr(model, "backbone", None)),
        sampler=sampler,
        callbacks=[collapse, plots, *selection, *trackers, *parts.callbacks],
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
            precision=config.precision,
            sub_batch_size=config.sub_batch_size,
        ),
        logging=Logging(
            log_every=config.log_every,
            progress=config.progress,
            console=parts.console,
            name=name,
            loss_name=config.loss.name,
        ),
        eval_ks=config.eval_ks,
        eval_fpr=config.eval_fpr,
        eval_batch_size=config.eval_batch_size,
        **{k: v for k, v in evaluation.items() if v is not None},  # else the class default
    )


def _trackers(config: Config) -> list[Callback]:
    """The trackers of ``logging.trackers`` (each logs the run's config, read from its store)."""
    made: list[Callback] = []
    for name in config.logging.trackers:
        if name == "tensorboard":
            made.append(TensorBoardTracker())
        else:
            made.append(MLflowTracker(config.logging.mlflow_uri, experiment=config.dataset.name))
    return made


def _load_splits(config: Config, store: RunStore) -> RetrievalSplits:
    """The config's data; for a resumed run that cannot find it, how to point it at its new place."""
    try:
        return load_splits(config)
    except ConfigError as exc:
        if not store.resuming or not str(exc).startswith("dataset.data_dir"):
            raise
        raise ConfigError(
            f"{exc}\nIf the run's data moved, resume with `data_dir` naming its new place (it "
            "is checked against the run's data.json)."
        ) from None


def _record_data(
    config: Config, store: RunStore, splits: RetrievalSplits, moved_from: str | None
) -> None:
    """Give the store the fingerprint of a fresh run's data; check a moved one's against it.

    A fresh run (and one restarted from step 0) records its data in ``data.json``; a resumed
    run whose ``data_dir`` changed must find the recorded data there (else a ConfigError naming
    both folders), and then records the new folder.
    """
    if store.root is None:
        return
    if store.resuming and moved_from is None:
        return  # the data is where it was: read, never fingerprinted again
    if not store.resuming and not store.strategy.is_main_process:
        return  # the main process writes the record
    found = {**data_fingerprint(splits), "data_dir": config.dataset.data_dir}
    if store.resuming:
        new_dir = str(config.dataset.data_dir)
        check_same_data(read_data_record(store.paths.data), found, moved_from, new_dir)
    store.adopt_data_record(found)


def _extended(config: Config, store: RunStore, steps: int, extend_to: int) -> Config:
    """``config`` with its budget extended from ``steps`` to ``extend_to`` (the store's record too).

    The budget becomes ``budget.iterations=extend_to``: the learning-rate schedule is defined
    over the budget, so the steps from here on follow the schedule of ``extend_to`` steps.
    """
    data = config.to_dict()
    data["budget"] = {"epochs": None, "iterations": extend_to}
    extended = config_from_dict(data)
    # what config.yaml and the checkpoints hold from now on
    store.adopt_extension(extended.to_dict(), steps)
    return extended


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
    data_dir: str | Path | None = None,
    max_steps: int | None = None,
) -> _T:
    """The ``trainer_cls`` that resumes the config run in ``run_dir`` (see ``Trainer.from_run_dir``).

    A run that stopped before its first checkpoint trains again from step 0 with its config.

    Args:
        trainer_cls: the trainer class.
        run_dir: a run directory, or a folder holding exactly one.
        num_workers: may change freely (batches do not depend on it).
        device: may change too (results are then no longer bit-identical).
        console: rich console for messages.
        checkpoint: the checkpoint file to continue from instead of ``last.pt``.
        data_dir: the run's data moved here: accepted when it holds the data the run recorded
            in its ``data.json`` (the same file list and sizes), else a ConfigError naming both
            folders.
        max_steps: train on to this many steps: a budget below it is extended to it
            (``budget.iterations``; the learning rate then follows the schedule of the new
            budget, see docs/training.md).

    Returns:
        The trainer, at the step of the checkpoint.
    """
    if max_steps is not None:
        max_steps = positive_int(max_steps, "max_steps", 0)
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
        moved_from = _moved_data(data, data_dir)
        if checkpoint is None and not store.restarted and not paths.last.is_file():
            raise CorruptCheckpointError(paths.last, "it is missing").with_context(
                run_dir=paths.root, **fallback_checkpoint(paths.root)
            )
        config = config_from_dict(data)
    except BaseException:
        store.release()
        raise
    store.adopt_record(config.to_dict())  # what config.yaml and the checkpoints go on holding
    parts = _Parts(console=console, extend_to=max_steps, moved_from=moved_from)
    return _assemble(trainer_cls, config, store, chosen, parts)


def _moved_data(data: dict[str, Any], data_dir: str | Path | None) -> str | None:
    """Point the saved config ``data`` at ``data_dir``; the folder it named before, if it changed."""
    if data_dir is None:
        return None
    dataset = data.get("dataset")
    if not isinstance(dataset, dict):
        return None  # the config's own validation names the missing section
    old = dataset.get("data_dir")
    new = str(Path(data_dir).expanduser().resolve())
    dataset["data_dir"] = new
    if old == new:
        return None
    return "the default data folders (no data_dir)" if old is None else str(old)
