"""Config -> Trainer: the one place that reads a run's configuration.

Builds what a :class:`~rankwise.training.config.Config` describes (the protocol of Wen et al.,
NeurIPS 2022, Sec. 5.1 and App. D.1) and hands it, as plain values, to a
:class:`~rankwise.training.Trainer` or a subclass; ``Trainer.from_config`` / ``from_run_dir``
delegate here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .build import (
    build_loss_from_config,
    build_model_from_config,
    build_optimizer,
    build_sampler_from_config,
    check_batch_classes,
    learning_rate_at,
    load_splits,
    resolve_device,
    seed_everything,
    total_steps,
)
from .callbacks import PlotCurves
from .config import Config, config_from_dict, read_config_file
from .errors import CorruptCheckpointError
from .rundir import resolve_run_dir
from .state import RunPaths, fallback_checkpoint, refuse_results
from .strategy import SingleProcess
from .trainer import CallbackLike, Trainer

if TYPE_CHECKING:
    from rich.console import Console

    from ..data import RetrievalSplits
    from ..metrics import PRCurve, RetrievalReport

__all__ = ["build_trainer", "strategy_from_config", "trainer_from_run_dir"]

ModelLike = nn.Module | Callable[[tuple[int, ...]], nn.Module]


def strategy_from_config(config: Config, trainer_cls: type[Trainer]) -> SingleProcess:
    """``trainer_cls.strategy_class`` with the ``distributed`` settings of ``config``."""
    if trainer_cls.strategy_class is SingleProcess:
        return SingleProcess()
    return trainer_cls.strategy_class(
        check_every=config.distributed.check_every,  # type: ignore[call-arg]
        sync_batchnorm=config.distributed.sync_batchnorm,
    )


def build_trainer(
    config: Config,
    *,
    model: ModelLike | None = None,
    metric_fn: Callable[..., RetrievalReport] | None = None,
    curve_fn: Callable[..., PRCurve] | None = None,
    trainer_cls: type[Trainer] | None = None,
    splits: RetrievalSplits | None = None,
    resume: bool = False,
    overwrite: bool = False,
    console: Console | None = None,
    callbacks: Sequence[CallbackLike] = (),
    resume_from: str | Path | None = None,
    name: str | None = None,
    plots: PlotCurves | None = None,
) -> Trainer:
    """Build the data, model, loss, sampler, optimizer and schedule of ``config``; a trainer.

    Data-dependent config errors are raised as in :mod:`rankwise.training.build`, before any
    step; the output directory is locked, and a run in it refused (unless ``resume`` /
    ``overwrite``), before the data is loaded.

    Args:
        config: the validated run configuration.
        model: the model instead of ``config.model``'s: a module, or a function of the input
            shape (called after the config's seed is set, so its initialisation is seeded).
        metric_fn: the evaluation (see :class:`~rankwise.training.Trainer`).
        curve_fn: the test curve (idem).
        trainer_cls: the trainer class (default :class:`~rankwise.training.Trainer`).
        splits: pre-loaded :class:`~rankwise.data.RetrievalSplits` (a sweep reuses one
            load for every run); by default :func:`rankwise.data.load_dataset` is called.
        resume: continue from ``<output_dir>/checkpoints/last.pt``.
        overwrite: start afresh in an output directory that already holds a run.
        console: rich console for messages (default: stderr).
        callbacks: extra callbacks (see :class:`~rankwise.training.Trainer`).
        resume_from: with ``resume``, the checkpoint to continue from instead of ``last.pt``.
        name: the run's name (default ``"<loss> on <dataset>"``).
        plots: the plots callback (default: titled by ``name``).

    Returns:
        The trainer, its ``run_dir`` the config's output directory.

    Raises:
        RunDirInUseError: another process is writing the output directory.
    """
    cls = Trainer if trainer_cls is None else trainer_cls
    run_dir = config.resolved_output_dir()
    strategy = strategy_from_config(config, cls)
    refuse = None if resume or overwrite else partial(refuse_results, run_dir, "output_dir")
    key = "run_dir" if resume else "output_dir"
    with cls._lock_run_dir(run_dir, key, resume=resume, check=refuse, strategy=strategy):
        device = resolve_device(config.device)
        if device.type == "cuda" and config.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        # data, then every data-dependent check before anything is built
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
        evaluation: dict[str, Any] = {"metric_fn": metric_fn, "curve_fn": curve_fn}
        return cls(
            model,
            loss_fn,
            splits.train,
            optimizer=build_optimizer(config.optimizer, params, getattr(model, "backbone", None)),
            sampler=sampler,
            val_data=splits.val,
            test_data=splits.test,
            gallery_data=splits.gallery,
            run_dir=run_dir,
            callbacks=[plots, *callbacks],
            iterations=steps,
            lr_schedule=partial(learning_rate_at, config, total_steps=steps),
            eval_every=config.eval_every,
            log_every=config.log_every,
            eval_ks=config.eval_ks,
            eval_batch_size=config.eval_batch_size,
            device=device,
            seed=config.seed,
            num_workers=config.num_workers,
            deterministic=config.deterministic,
            progress=config.progress,
            resume=resume,
            overwrite=overwrite,
            console=console,
            name=name,
            config=config,
            loss_name=config.loss.name,
            run_dir_key=key,
            resume_from=resume_from,
            strategy=strategy,
            **{k: v for k, v in evaluation.items() if v is not None},  # else the class default
        )


def trainer_from_run_dir(
    run_dir: str | Path,
    *,
    trainer_cls: type[Trainer] | None = None,
    num_workers: int | None = None,
    device: str | None = None,
    console: Console | None = None,
    checkpoint: str | Path | None = None,
) -> Trainer:
    """The trainer that resumes the config run in ``run_dir`` (see :meth:`Trainer.from_run_dir`).

    Args:
        run_dir: a run directory, or a folder holding exactly one.
        trainer_cls: the trainer class (default :class:`~rankwise.training.Trainer`).
        num_workers: may change freely (batches do not depend on it).
        device: may change too (results are then no longer bit-identical).
        console: rich console for messages.
        checkpoint: the checkpoint file to continue from instead of ``last.pt``.

    Returns:
        The trainer, at the step of the checkpoint.
    """
    cls = Trainer if trainer_cls is None else trainer_cls
    paths = RunPaths(resolve_run_dir(run_dir))
    # locked before config.yaml is read
    with cls._lock_run_dir(paths.root, "run_dir", resume=True, strategy=cls.strategy_class()):
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
        return build_trainer(
            config_from_dict(data),
            trainer_cls=cls,
            resume=True,
            console=console,
            resume_from=checkpoint,
        )
