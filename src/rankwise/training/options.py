"""The Trainer's keyword options: what ``Trainer(..., **options)`` accepts, sorted by who uses it.

:class:`TrainerOptions` names every keyword; :func:`split_options` sorts them into the settings
groups (:mod:`rankwise.training.settings`), the evaluation's (checked here, for the
:class:`~rankwise.training.evaluation.Evaluator`), how a ``run_dir`` path is opened (for the
:class:`~rankwise.training.store.RunStore`) and the seams of a loop that is not the retrieval one
(:class:`BatchSource`, :class:`EndPolicy`, :class:`Seams`). The loop itself is the one of Wen et al.
(NeurIPS 2022), Sec. 5.1; nothing here changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch
from rich.console import Console

from ..metrics._inputs import check_ks
from ..metrics.verification import check_fprs
from .arguments import LRSchedule, positive_int
from .config import Config
from .settings import Logging, Runtime, Schedule, group_options

if TYPE_CHECKING:
    from ..metrics import PRCurve, RetrievalReport

__all__ = [
    "BatchSource",
    "EndPolicy",
    "Seams",
    "TrainerArguments",
    "TrainerOptions",
    "split_options",
]

_EVALUATION = ("metric_fn", "curve_fn", "eval_ks", "eval_batch_size", "eval_fpr")
_RUN_FOLDER = ("resume", "resume_from", "overwrite", "run_dir_key", "record", "config")


class BatchSource(Protocol):
    """Where the training batches come from, instead of the loader of ``sampler``.

    A source that draws its batches itself keeps what its position depends on in a callback's
    checkpointed state, so a resumed run draws the batches of an uninterrupted one (the
    pretraining's ``SourceBatches``, :mod:`rankwise.workflows.pretrain`).
    """

    def batches(self, step: int, epoch: int, position: int) -> Iterator[Any]:
        """The ``(x, y, meta)`` batches from ``step`` on (``meta[0]``: ``(epoch, position)``)."""


class EndPolicy(Protocol):
    """What a run does once its budget is reached, instead of testing and writing the report.

    Called with the :class:`~rankwise.training.Trainer`; a ``KeyboardInterrupt`` inside it is its
    own to report (the trainer's ``resume_hint`` says how to continue).
    """

    def __call__(self, trainer: Any) -> None:
        """Write the run's outcome."""


class TrainerOptions(TypedDict, total=False):
    """The keywords of :class:`~rankwise.training.Trainer` besides its named parameters.

    The evaluation: ``metric_fn`` (called as ``metric_fn(query, query_labels, gallery,
    gallery_labels, ks=eval_ks)``, ``gallery`` ``None`` for leave-one-out; default
    :func:`rankwise.metrics.retrieval_metrics`; its report needs ``map`` and ``to_dict()``),
    ``curve_fn`` (the test curve, called like ``metric_fn`` without ``ks``; default
    :func:`rankwise.metrics.pr_curve`), ``eval_ks`` (default ``(1, 10, 100)``),
    ``eval_batch_size`` (default 256), ``eval_fpr`` (FPR budgets: every report adds ROC AUC and
    TPR at each; default none).

    How a ``run_dir`` path is opened: ``resume`` (continue from ``checkpoints/last.pt``; build
    the same objects first), ``resume_from`` (with ``resume``: that checkpoint instead, e.g.
    ``checkpoints/previous.pt``), ``overwrite`` (start afresh in a folder holding a run: its
    results are deleted when ``fit`` starts), ``run_dir_key`` (the name messages give
    ``run_dir``) and ``record`` (what ``config.yaml`` and the checkpoints hold as the run's
    config; ``config``: a Config, whose ``to_dict()`` is the record).

    The seams of a loop that is not the retrieval one: ``batch_source`` (a
    :class:`BatchSource`), ``end_policy`` (an :class:`EndPolicy` instead of the test and
    report), ``resume_hint`` (how messages say to continue), ``activity`` (what they call the
    run, e.g. ``"pretraining"``). And, as in earlier versions, each field of the
    :class:`Schedule`, :class:`Runtime` and :class:`Logging` groups on its own.
    """

    metric_fn: Callable[..., RetrievalReport] | None
    curve_fn: Callable[..., PRCurve] | None
    eval_ks: Sequence[int]
    eval_batch_size: int
    eval_fpr: Sequence[float]
    resume: bool
    resume_from: str | Path | None
    overwrite: bool
    run_dir_key: str
    record: Mapping[str, Any] | None
    config: Config | None
    iterations: int | None
    epochs: int | None
    lr_schedule: LRSchedule | None
    eval_every: int | None
    device: str | torch.device | None
    seed: int
    num_workers: int
    deterministic: bool
    detect_collapse: bool
    precision: str
    sub_batch_size: int | None
    log_every: int
    progress: bool | None
    console: Console | None
    name: str | None
    loss_name: str | None
    batch_source: BatchSource | None
    end_policy: EndPolicy | None
    resume_hint: str | None
    activity: str


@dataclass(frozen=True)
class Seams:
    """The seams of a loop that is not the retrieval one (see :class:`TrainerOptions`)."""

    batch_source: BatchSource | None = None
    end_policy: EndPolicy | None = None
    resume_hint: str | None = None
    activity: str = "training"


@dataclass(frozen=True)
class TrainerArguments:
    """The Trainer's options sorted by who uses them (:func:`split_options`).

    Attributes:
        schedule: the :class:`Schedule` group.
        runtime: the :class:`Runtime` group.
        logging: the :class:`Logging` group.
        evaluation: the :class:`~rankwise.training.evaluation.Evaluator`'s keywords
            (``metric_fn``, ``curve_fn``, ``ks``, ``batch_size``, checked; ``num_workers``,
            ``seed`` of the runtime).
        folder: how a ``run_dir`` path is opened (``resume``, ``overwrite``, ...), as given.
        seams: the :class:`Seams`.
    """

    schedule: Schedule
    runtime: Runtime
    logging: Logging
    evaluation: dict[str, Any]
    folder: dict[str, Any]
    seams: Seams


def _split(options: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The entries of ``names`` in ``options`` (removed from it)."""
    return {name: options.pop(name) for name in names if name in options}


def split_options(
    options: Mapping[str, Any],
    schedule: Schedule | None = None,
    runtime: Runtime | None = None,
    logging: Logging | None = None,
) -> TrainerArguments:
    """Sort the Trainer's ``**options`` (and its three groups) by who uses them.

    Args:
        options: the keywords (:class:`TrainerOptions`).
        schedule: the ``schedule`` group passed whole (or ``None``: from its fields).
        runtime: the ``runtime`` group, likewise.
        logging: the ``logging`` group, likewise.

    Returns:
        The :class:`TrainerArguments`.

    Raises:
        TypeError: an unknown keyword, or a group passed with some of its fields.
        ValueError: a bad ``eval_ks`` / ``eval_batch_size``, named.

    Example:
        >>> args = split_options({"iterations": 6, "eval_ks": (10, 1), "activity": "pretraining"})
        >>> args.schedule.iterations, args.evaluation["ks"], args.seams.activity
        (6, (1, 10), 'pretraining')
    """
    rest = dict(options)
    groups = (
        group_options(schedule, Schedule, rest, "schedule"),
        group_options(runtime, Runtime, rest, "runtime"),
        group_options(logging, Logging, rest, "logging"),
    )
    evaluation = _split(rest, _EVALUATION)
    folder = _split(rest, _RUN_FOLDER)
    seams = _split(rest, ("batch_source", "end_policy", "resume_hint", "activity"))
    if rest:
        raise TypeError(f"Trainer() got an unexpected keyword argument {next(iter(rest))!r}.")
    # the Trainer's checks, in its order and with its names (the Evaluator checks them again)
    batch_size = positive_int(evaluation.get("eval_batch_size", 256), "eval_batch_size")
    ks = tuple(sorted(check_ks(evaluation.get("eval_ks", (1, 10, 100)), "eval_ks")))
    return TrainerArguments(
        *groups,
        evaluation={
            "metric_fn": evaluation.get("metric_fn"),
            "curve_fn": evaluation.get("curve_fn"),
            "ks": ks,
            "batch_size": batch_size,
            "fpr": check_fprs(evaluation.get("eval_fpr", ()), "eval_fpr"),
            "num_workers": groups[1].num_workers,
            "seed": groups[1].seed,
        },
        folder=folder,
        seams=Seams(
            seams.get("batch_source"),
            seams.get("end_policy"),
            seams.get("resume_hint"),
            str(seams.get("activity", "training")),
        ),
    )
