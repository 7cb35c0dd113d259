"""Config -> Trainer: the one place that reads a run's configuration.

Builds what a :class:`~rankwise.training.config.Config` describes (the protocol of Wen et al.,
NeurIPS 2022, Sec. 5.1 and App. D.1) and hands it, as plain objects, settings groups and an opaque
record of the config, to a :class:`~rankwise.training.Trainer` or a subclass; the strategy is
chosen from the environment (data-parallel under torchrun, joining its process group). The reading
itself is :mod:`rankwise.training.assembly` (below the Trainer, which ``Trainer.from_config`` /
``from_run_dir`` call with their own class); this module gives it the Trainer as default class.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .assembly import BuildOptions, ModelLike, resume_from_run_dir, strategy_of
from .config import Config
from .strategy import SingleProcess
from .trainer import Trainer

if TYPE_CHECKING:
    from rich.console import Console
    from typing_extensions import Unpack

    from ..data import RetrievalSplits
    from .callbacks.host import CallbackLike
    from .result import RunResult


__all__ = [
    "ModelLike",
    "build_trainer",
    "strategy_from_config",
    "train",
    "trainer_from_run_dir",
]


def strategy_from_config(config: Config, trainer_cls: type[Trainer] | None = None) -> SingleProcess:
    """The strategy of a run of ``config`` in this environment.

    Under torchrun (or in a process group of several processes, or for ``trainer_cls`` =
    ``DistributedTrainer``) this process joins the process group with the ``distributed``
    settings of ``config`` and gets a ``DataParallelStrategy``; otherwise ``SingleProcess()``.

    Args:
        config: the run's config.
        trainer_cls: the trainer class (its ``strategy_class`` may ask for data parallelism).

    Returns:
        The strategy.
    """
    cls = Trainer if trainer_cls is None else trainer_cls
    return strategy_of(config, cls.strategy_class is not SingleProcess)[0]


def build_trainer(
    config: Config, *, trainer_cls: type[Trainer] | None = None, **options: Unpack[BuildOptions]
) -> Trainer:
    """``trainer_cls.from_config(config, **options)``: the one door from a config to a trainer.

    The strategy is chosen from the environment (data-parallel under torchrun: this process
    joins the process group); the output directory is locked, and a run in it refused (unless
    ``resume`` / ``overwrite``), before the data is loaded (one lock, one check per run);
    data-dependent config errors are raised as in :mod:`rankwise.training.build`, before any
    step.

    Args:
        config: the validated run configuration.
        trainer_cls: the trainer class (default :class:`~rankwise.training.Trainer`).
        **options: (:class:`~rankwise.training.assembly.BuildOptions`) ``model`` (instead of
            ``config.model``'s: a module, or a function of the input shape, called after the
            config's seed is set), ``metric_fn`` / ``curve_fn`` (the evaluation, see
            :class:`~rankwise.training.Trainer`), ``splits`` (pre-loaded
            :class:`~rankwise.data.RetrievalSplits`; a sweep reuses one load for every run),
            ``resume`` (continue from ``<output_dir>/checkpoints/last.pt``), ``overwrite``
            (start afresh in an output directory that holds a run), ``console``,
            ``callbacks``, ``resume_from`` (with ``resume``: that checkpoint instead of
            ``last.pt``), ``name`` (default ``"<loss> on <dataset>"``) and ``plots`` (the
            plots callback, titled by ``name`` by default).

    Returns:
        The trainer, its ``run_dir`` the config's output directory.

    Raises:
        RunDirInUseError: another process is writing the output directory.
    """
    return (Trainer if trainer_cls is None else trainer_cls).from_config(config, **options)


def trainer_from_run_dir(
    run_dir: str | Path,
    *,
    trainer_cls: type[Trainer] | None = None,
    num_workers: int | None = None,
    device: str | None = None,
    console: Console | None = None,
    checkpoint: str | Path | None = None,
    data_dir: str | Path | None = None,
    max_steps: int | None = None,
) -> Trainer:
    """The trainer that resumes the config run in ``run_dir`` (see :meth:`Trainer.from_run_dir`).

    The folder is locked before its ``config.yaml`` is read (under torchrun the process group is
    joined first, with the saved ``distributed`` settings). A run that stopped before its first
    checkpoint trains again from step 0 with its config.

    Args:
        run_dir: a run directory, or a folder holding exactly one.
        trainer_cls: the trainer class (default :class:`~rankwise.training.Trainer`).
        num_workers: may change freely (batches do not depend on it).
        device: may change too (results are then no longer bit-identical).
        console: rich console for messages.
        checkpoint: the checkpoint file to continue from instead of ``last.pt``.
        data_dir: the run's data moved here: accepted when it holds the data recorded in the
            run's ``data.json`` (the same file list and sizes), else a ConfigError naming both
            folders; the run's ``config.yaml`` then names the new folder.
        max_steps: train on to this many steps: a budget below it is extended to
            ``budget.iterations=max_steps`` (the learning rate then follows the schedule of
            the new budget from the checkpoint's step on; docs/training.md).

    Returns:
        The trainer, at the step of the checkpoint.
    """
    return resume_from_run_dir(
        Trainer if trainer_cls is None else trainer_cls,
        run_dir,
        num_workers=num_workers,
        device=device,
        console=console,
        checkpoint=checkpoint,
    )


def train(
    config: Config,
    *,
    splits: RetrievalSplits | None = None,
    overwrite: bool = False,
    max_steps: int | None = None,
    callbacks: Sequence[CallbackLike] = (),
    console: Console | None = None,
) -> RunResult:
    """Build a :class:`~rankwise.training.Trainer` from ``config`` and run its ``fit``.

    Args:
        config: the validated run configuration.
        splits: pre-loaded dataset splits (default: loaded from ``config.dataset``).
        overwrite: start afresh in an output directory that already holds a run.
        max_steps: stop early (see :meth:`Trainer.fit <rankwise.training.Trainer.fit>`).
        callbacks: extra callbacks.
        console: rich console for messages.

    Returns:
        The :class:`~rankwise.training.result.RunResult`.
    """
    trainer = Trainer.from_config(config, splits=splits, overwrite=overwrite, console=console)
    return trainer.fit(max_steps=max_steps, callbacks=callbacks)
