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
from typing import TYPE_CHECKING

from .assembly import BuildOptions, ModelLike
from .config import Config
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
    "train",
]


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
