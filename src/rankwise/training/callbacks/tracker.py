"""Experiment trackers as callbacks: what :class:`Tracker` mirrors of a run, and how it names it.

A tracker copies the run's records (``trainer.history``, written by
:class:`~rankwise.training.callbacks.MetricsLogger` to ``metrics.jsonl``) into an experiment
tracker, so the logged values are the ``metrics.jsonl`` ones by construction: every training
record (``train/loss``, ``train/lr``, ``train/samples_per_s``, the loss's ``loss_stats``), every
float of a validation and test report (``val/map``, ``val/recall_at_1``, ``test/map``, ...), the
run's config as parameters (flattened to dotted keys, :func:`config_params`) and the test
precision-recall figure. Each tracker is one file: TensorBoard
(:mod:`~rankwise.training.callbacks.tensorboard_tracker`) and MLflow
(:mod:`~rankwise.training.callbacks.mlflow_tracker`); the config key ``logging.trackers``
chooses them. Only the main process of a data-parallel run logs. Their packages are imported
when a tracker is made (the ``trackers`` extra), never by ``import rankwise``.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..._extras import require
from ..errors import NonFiniteLossError
from .base import Callback, StepOutput, TrainerView

if TYPE_CHECKING:
    from ...metrics import PRCurve, RetrievalReport
    from ..result import RunResult

__all__ = ["TRACKER_EXTRA", "Tracker", "config_params", "metric_name", "record_scalars"]

#: the extra of ``pyproject.toml`` that installs every tracker's package
TRACKER_EXTRA = "trackers"

# what MLflow accepts in a metric or parameter name (TensorBoard takes any): the others become _
_UNSAFE = re.compile(r"[^\w./\- ]")


def metric_name(name: str) -> str:
    """A report value's name in a tracker: ``"recall@1"`` -> ``"recall_at_1"``, others as they are.

    MLflow refuses ``@`` in a name; ``recall_at_1`` reads like ``map_at_r``.

    Example:
        >>> metric_name("recall@1"), metric_name("map")
        ('recall_at_1', 'map')
    """
    return _UNSAFE.sub("_", name.replace("@", "_at_"))


def record_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars a tracker logs for one ``metrics.jsonl`` record, by name.

    A ``train`` record gives ``train/loss``, ``train/lr``, ``train/samples_per_s`` and
    ``train/loss_stats/<key>``; a ``val`` or ``test`` record every float of its report:
    ``val/map``, ``val/map_at_r``, ``val/recall_at_1`` (a per-cutoff ``recall_at`` entry), ...
    Counts (``n_queries``), lists and texts are not metrics and are left out; so are ``error``
    records.

    Args:
        record: a record of ``trainer.history`` (a dict with ``kind`` and ``step``).

    Returns:
        ``{name: value}``.

    Example:
        >>> record_scalars({"kind": "val", "step": 4, "map": 0.5, "recall_at": {"1": 0.75},
        ...                 "n_queries": 30})
        {'val/map': 0.5, 'val/recall_at_1': 0.75}
    """
    kind = record.get("kind")
    if kind not in ("train", "val", "test"):
        return {}
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("kind", "step", "epoch"):
            continue
        if isinstance(value, float):
            out[f"{kind}/{metric_name(key)}"] = value
        elif isinstance(value, Mapping):
            # a per-cutoff family ("recall_at": {"1": ...}) or a group ("loss_stats": {...})
            joint = "_" if key.endswith("_at") else "/"
            for sub, inner in value.items():
                if isinstance(inner, float):
                    out[f"{kind}/{metric_name(f'{key}{joint}{sub}')}"] = inner
    return out


def _param_value(value: Any) -> str | int | float:
    """A config leaf as a tracker parameter: numbers and texts as they are, the rest as JSON."""
    if isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return value
    return json.dumps(value)  # true / false / null / [1, 10, 100] / {} as the YAML file reads


def config_params(config: Mapping[str, Any]) -> dict[str, str | int | float]:
    """The run's config as tracker parameters: one dotted key per leaf.

    Args:
        config: the config as a plain dict (``Config.to_dict()``, ``config.yaml``).

    Returns:
        ``{"optimizer.lr": 0.001, "loss.name": "auc", "eval_ks": "[1, 10, 100]", ...}``: numbers
        and strings as they are, booleans, ``null``, lists and empty sections as JSON.

    Example:
        >>> config_params({"optimizer": {"lr": 0.01}, "eval_ks": [1, 10], "model": {"pretrained": None}})
        {'optimizer.lr': 0.01, 'eval_ks': '[1, 10]', 'model.pretrained': 'null'}
    """
    out: dict[str, str | int | float] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(f"{prefix}.{key}" if prefix else str(key), value)
        else:
            out[prefix] = _param_value(node)

    walk("", dict(config))
    return out


def _step(record: Mapping[str, Any]) -> int:
    return int(record.get("step", 0))


class Tracker(Callback):
    """Base of the experiment trackers: mirror ``trainer.history`` into a tracker, on the main process.

    A subclass opens its tracker run in :meth:`open` (a resumed run continues the same one),
    writes named scalars at a step (:meth:`log_scalars`), an image file (:meth:`log_image`) and
    ends its run (:meth:`close`). The records are those the run keeps (a resumed run's history
    is cut back to its checkpoint's step): the records of the steps after the step a ``fit``
    starts at are offered once each, in order, and those of the start step again (a tracker
    that can take back what it logged after that step, TensorBoard, logs them again; one that
    cannot, MLflow, skips the steps it holds).

    Args:
        params: the parameters to log (default: the run's config, ``trainer.store.record``, flattened by
            :func:`config_params`; none for a trainer built from objects).

    Raises:
        MissingDependencyError: the tracker's package is not installed (it names the
            ``trackers`` extra), when the tracker is made: before the run starts.
    """

    #: the import name of the tracker's package
    package = ""
    #: what the tracker is called in messages
    title = ""

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        require((self.package,), TRACKER_EXTRA, f"{self.title} (logging.trackers)")
        self.params = None if params is None else dict(params)
        self.active = False  # on the main process, between on_fit_start and the end
        self.start_step = 0
        self._next: int | None = None  # the first record of trainer.history not yet offered

    # -- what a tracker implements -------------------------------------------------------------

    def open(self, trainer: TrainerView, config: Mapping[str, Any] | None) -> None:
        """Start (or, resumed, continue) the tracker run; log ``config`` as its parameters."""
        raise NotImplementedError

    def log_scalars(self, step: int, kind: str, scalars: Mapping[str, float]) -> None:
        """Log ``scalars`` of a ``kind`` record (``train``, ``val``, ``test``) at ``step``."""
        raise NotImplementedError

    def log_image(self, step: int, name: str, png: Path) -> None:
        """Log the PNG file ``png`` as ``name`` at ``step``."""
        raise NotImplementedError

    def flush(self) -> None:
        """Write what is buffered (before a checkpoint, so a resume finds it)."""

    def close(self, status: str) -> None:
        """End the tracker run: ``"finished"``, ``"stopped"`` (to resume), ``"failed"``, ``"ended"``."""

    # -- the hooks -------------------------------------------------------------------------------

    def _sync(self, trainer: TrainerView) -> None:
        """Offer the records of ``trainer.history`` not offered yet."""
        if not self.active:
            return
        records = trainer.history
        if self._next is None or self._next > len(records):
            # the first call after on_fit_start (every callback's, so the history is cut back)
            self._next = next(
                (i for i, r in enumerate(records) if _step(r) >= self.start_step), len(records)
            )
        for record in records[self._next :]:
            scalars = record_scalars(record)
            if scalars:
                self.log_scalars(_step(record), str(record["kind"]), scalars)
        self._next = len(records)

    def on_fit_start(self, trainer: TrainerView) -> None:
        """Open the tracker run (on the main process only)."""
        self.active = trainer.is_main_process
        if not self.active:
            return
        self.start_step, self._next = trainer.step, None
        self.open(trainer, self.params if self.params is not None else trainer.store.record)

    def on_train_step_end(self, trainer: TrainerView, output: StepOutput) -> None:
        """Log the step's training record."""
        self._sync(trainer)

    def on_validation_end(
        self, trainer: TrainerView, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Log the validation record and flush: the checkpoint written next has it on disk."""
        self._sync(trainer)
        if self.active:
            self.flush()

    def on_step_end(self, trainer: TrainerView) -> None:
        """Log what the step recorded."""
        self._sync(trainer)

    def on_train_end(self, trainer: TrainerView) -> None:
        """Flush and end the run for now (``fit`` may end here by an exception)."""
        self._sync(trainer)
        if self.active:
            self.close("ended")

    def on_test_end(self, trainer: TrainerView, report: RetrievalReport, curve: PRCurve) -> None:
        """Log the test record and the test precision-recall figure."""
        self._sync(trainer)
        if not self.active:
            return
        from ...plots import plot_pr_curves  # noqa: PLC0415 - matplotlib: only when drawing

        label = trainer.loss_name
        with tempfile.TemporaryDirectory() as folder:
            png = plot_pr_curves(
                {label: curve},
                Path(folder) / "pr_curve.png",
                title="test mean PR curve",
                labels={label: float(report.map)},
            )
            self.log_image(trainer.step, "test/pr_curve", png)

    def on_fit_end(self, trainer: TrainerView, result: RunResult) -> None:
        """End the tracker run with the run's outcome."""
        self._sync(trainer)
        if self.active:
            finished = result.status in ("completed", "stopped_early")
            self.close("finished" if finished else "stopped")
            self.active = False

    def on_failure(self, trainer: TrainerView, error: NonFiniteLossError) -> None:
        """End the tracker run as failed."""
        self._sync(trainer)
        if self.active:
            self.close("failed")
            self.active = False
