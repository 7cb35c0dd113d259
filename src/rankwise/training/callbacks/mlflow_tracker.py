"""An MLflow run of a training run: :class:`MLflowTracker` (``logging.trackers: [mlflow]``).

Written with :class:`mlflow.tracking.MlflowClient` (``mlflow-skinny`` suffices) to a tracking
store, by default a local ``file:`` store ``mlruns/`` in the run folder: the scalars of
:mod:`~rankwise.training.callbacks.tracker` against the step, the config as parameters and the
test precision-recall figure as the artifact ``pr_curve.png``. The MLflow run's id is recorded in
``<run folder>/mlflow_run.json``; a resumed run continues that MLflow run. An MLflow store cannot
take back a logged value, so each batch of metrics sets the run's tag ``rankwise.logged_through``
to its step and kind and a resumed run skips the records up to it (a killed run logged them after its
checkpoint; the resume recomputes the same values, bit for bit on the same device).

MLflow 3 refuses a ``file:`` store unless ``MLFLOW_ALLOW_FILE_STORE=true``; the tracker sets that
variable in its own process when it writes to one (``mlflow ui`` needs it too).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..checkpoint import atomic_write_text
from .base import TrainerView
from .tracker import Tracker, config_params

__all__ = ["MLflowTracker"]

# how many parameters one log_batch call may carry (MLflow's limit)
_PARAMS_PER_BATCH = 100
_THROUGH = "rankwise.logged_through"  # "<step>:<kind>" of the last record the run holds
_ORDER = {"train": 0, "val": 1, "test": 2}  # the order of a step's records in the history
_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED", "ended": "KILLED"}


def _position(tag: str | None) -> tuple[int, int]:
    """``(step, order)`` of a ``rankwise.logged_through`` tag (``(-1, 0)``: none)."""
    step, _, kind = (tag or "").partition(":")
    if not step.lstrip("-").isdigit():
        return (-1, 0)
    return (int(step), _ORDER.get(kind, len(_ORDER)))


def _is_file_store(uri: str) -> bool:
    """Whether ``uri`` names MLflow's file store (``file:`` or a plain path)."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1  # a Windows drive letter


class MLflowTracker(Tracker):
    """Log the run to an MLflow run (needs ``pip install 'rankwise[trackers]'``).

    Args:
        tracking_uri: the tracking store (default: the ``file:`` store ``mlruns/`` in the run
            folder; a store several runs share, e.g. ``file:/data/mlruns`` or a server's
            ``http://host:5000``: the config key ``logging.mlflow_uri``).
        experiment: the MLflow experiment the run belongs to (made when missing).
        params: the parameters to log (default: the run's config, see :class:`Tracker`).

    Attributes:
        run_id: the MLflow run's id (``None`` before the first ``fit``).

    Example:
        >>> tracker = MLflowTracker(experiment="digits")  # a Trainer callback
        >>> tracker.experiment, tracker.run_id
        ('digits', None)
    """

    package = "mlflow"
    title = "the MLflow tracker"

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "rankwise",
        params: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(params)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_id: str | None = None
        self._client: Any = None
        self._through = (-1, 0)  # (step, _ORDER) of the last record the MLflow run holds
        self._status: str | None = None

    # -- the MLflow run ---------------------------------------------------------------------------

    def _uri(self, trainer: TrainerView) -> str:
        if self.tracking_uri is not None:
            return self.tracking_uri
        if trainer.run_dir is None:
            raise ValueError(
                "MLflowTracker: the trainer has no run_dir to hold the MLflow store; pass "
                "MLflowTracker(tracking_uri=...)."
            )
        return (trainer.paths.root / "mlruns").resolve().as_uri()

    def _recorded(self, trainer: TrainerView) -> dict[str, Any]:
        path = None if trainer.run_dir is None else trainer.paths.root / "mlflow_run.json"
        if path is None or not path.is_file():
            return {}
        try:
            return dict(json.loads(path.read_text()))
        except (ValueError, TypeError):
            return {}  # unreadable: a new MLflow run, the record rewritten

    def _live_run(self, run_id: Any) -> bool:
        """Whether the store holds the (not deleted) run ``run_id``."""
        from mlflow.exceptions import MlflowException  # noqa: PLC0415 - the extra

        if not isinstance(run_id, str):
            return False
        try:
            return bool(self._client.get_run(run_id).info.lifecycle_stage == "active")
        except MlflowException:
            return False

    def _new_run(self, trainer: TrainerView, recorded: Mapping[str, Any], uri: str) -> str:
        """A new MLflow run in the experiment; an earlier run of this folder's is deleted."""
        if self._live_run(recorded.get("run_id")):
            self._client.delete_run(recorded["run_id"])  # its results went with --overwrite
        found = self._client.get_experiment_by_name(self.experiment)
        experiment_id = (
            found.experiment_id
            if found is not None
            else self._client.create_experiment(self.experiment)
        )
        tags = {} if trainer.run_dir is None else {"rankwise.run_dir": str(trainer.run_dir)}
        run = self._client.create_run(experiment_id, run_name=trainer.name, tags=tags)
        if trainer.run_dir is not None:
            default = self.tracking_uri is None  # the run folder's store: found again if moved
            record = {"run_id": run.info.run_id, "tracking_uri": None if default else uri}
            atomic_write_text(json.dumps(record) + "\n", trainer.paths.root / "mlflow_run.json")
        return str(run.info.run_id)

    def open(self, trainer: TrainerView, config: Mapping[str, Any] | None) -> None:
        """Continue this folder's MLflow run when resumed (a fresh run starts a new one)."""
        from mlflow.tracking import MlflowClient  # noqa: PLC0415 - the extra

        uri = self._uri(trainer)
        if _is_file_store(uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: opt in
        self._client = MlflowClient(tracking_uri=uri)
        recorded = self._recorded(trainer)
        candidate = self.run_id or recorded.get("run_id")  # a second fit, or a resume
        if trainer.step > 0 and self._live_run(candidate):
            self.run_id = str(candidate)
            run = self._client.get_run(self.run_id)
            self._through = _position(run.data.tags.get(_THROUGH))
            self._client.update_run(self.run_id, status="RUNNING")
            held = dict(run.data.params)
        else:
            self.run_id, self._through, held = self._new_run(trainer, recorded, uri), (-1, 0), {}
        self._status = None
        if config is not None:
            self._log_params(config_params(config), held)

    def _log_params(self, params: Mapping[str, str | int | float], held: Mapping[str, str]) -> None:
        """Log the parameters the run lacks; a changed one (an extended budget) as a tag."""
        from mlflow.entities import Param, RunTag  # noqa: PLC0415 - the extra

        new = [Param(k, str(v)) for k, v in params.items() if k not in held]
        changed = [
            RunTag(f"rankwise.resumed_with.{k}", str(v))
            for k, v in params.items()
            if k in held and held[k] != str(v)
        ]
        for i in range(0, max(len(new), len(changed)), _PARAMS_PER_BATCH):
            chunk = slice(i, i + _PARAMS_PER_BATCH)
            self._client.log_batch(self.run_id, params=new[chunk], tags=changed[chunk])

    # -- logging --------------------------------------------------------------------------------

    def log_scalars(self, step: int, kind: str, scalars: Mapping[str, float]) -> None:
        """One batch: the record's metrics at ``step`` and the tag saying the run holds it."""
        position = (step, _ORDER.get(kind, len(_ORDER)))
        if position <= self._through:
            return  # logged by an earlier process (after the checkpoint this run resumed from)
        from mlflow.entities import Metric, RunTag  # noqa: PLC0415 - the extra

        stamp = int(time.time() * 1000)
        metrics = [Metric(name, float(value), stamp, step) for name, value in scalars.items()]
        tag = RunTag(_THROUGH, f"{step}:{kind}")
        self._client.log_batch(self.run_id, metrics=metrics, tags=[tag])
        self._through = position

    def log_image(self, step: int, name: str, png: Path) -> None:
        """The PNG as an artifact of its file name (``pr_curve.png``; a new one replaces it)."""
        self._client.log_artifact(self.run_id, str(png))

    def close(self, status: str) -> None:
        """Set the MLflow run's status (a failure stays failed)."""
        if self._client is None or self.run_id is None or self._status == "failed":
            return
        self._status = status
        self._client.set_terminated(self.run_id, status=_STATUS[status])
