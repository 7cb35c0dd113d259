"""The outcome of a run: :class:`RunResult`, written to and read from ``report.json`` / ``pr_curve.json``.

The test report (tie-aware metrics, Wen et al., NeurIPS 2022, Sec. 5.1) and mean PR curve of the
model selected on validation; file names from :class:`~rankwise.training.rundir.RunPaths`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..metrics import PRCurve, RetrievalReport
from .checkpoint import atomic_write_text
from .config import read_config_file
from .rundir import RunPaths

__all__ = ["FINISHED", "RunResult", "per_category_map"]

FINISHED = ("completed", "stopped_early")  # the statuses of a run that is over


def per_category_map(per_query_ap: Any, categories: Any) -> dict[str, dict[str, Any]]:
    """Mean AP of the queries of each category (a table's ``category`` column).

    Queries without a relevant item (AP ``NaN``) are counted apart, as in the overall mAP.

    Args:
        per_query_ap: ``(n_q,)`` APs in query order (``RetrievalReport.per_query_ap``).
        categories: ``(n_q,)`` the category of each query.

    Returns:
        ``{category: {"map": float | None, "n_queries": int, "n_queries_without_relevant": int}}``,
        categories sorted.

    Example:
        >>> per_category_map([1.0, 0.5, float("nan")], ["a", "b", "b"])["b"]
        {'map': 0.5, 'n_queries': 2, 'n_queries_without_relevant': 1}
    """
    if hasattr(per_query_ap, "detach"):  # a tensor, as RetrievalReport holds it
        per_query_ap = per_query_ap.detach().cpu().numpy()
    ap = np.asarray(per_query_ap, dtype=np.float64)
    cats = np.asarray(categories, dtype=str)
    if cats.shape != ap.shape:
        raise ValueError(
            f"`categories` has {cats.shape[0]} entries for {ap.shape[0]} queries; give one per query."
        )
    out: dict[str, dict[str, Any]] = {}
    for cat in sorted(set(cats.tolist())):
        values = ap[cats == cat]
        scored = values[~np.isnan(values)]
        out[cat] = {
            "map": float(scored.mean()) if scored.size else None,
            "n_queries": int(values.size),
            "n_queries_without_relevant": int(values.size - scored.size),
        }
    return out


@dataclass
class RunResult:
    """Outcome of :meth:`Trainer.fit <rankwise.training.Trainer.fit>`.

    Attributes:
        run_dir: the run directory (``None`` for a trainer without one).
        status: ``"completed"`` (budget reached, test report made), ``"stopped_early"``
            (a callback ended it with a reason, e.g. :class:`EarlyStopping
            <rankwise.training.callbacks.EarlyStopping>`; test report made, the run is finished)
            or ``"stopped"`` (``max_steps`` reached; resume to finish).
        steps: optimizer steps taken.
        seconds: wall-clock seconds spent in this run, summed over resumptions.
        best_step: step of the best validation score (``None`` before the first evaluation).
        best_val: the best validation ``RetrievalReport`` summary (a dict).
        test: the test report of the selected model (completed runs with test data only).
        pr_curve: the test mean precision-recall curve of the selected model (idem).
        config: the run's config as a dict (empty for a trainer built from objects).
        stop_reason: why a ``"stopped_early"`` run ended (``None`` otherwise).
        test_per_category: the test mAP of each query category (:func:`per_category_map`), for
            test data with ``categories`` (a table's ``category`` column); ``None`` otherwise.
        overflow_steps: with precision ``"16"``, the steps skipped because the float16
            gradients overflowed (``None``: no loss scaling).
    """

    run_dir: Path | None
    status: str
    steps: int
    seconds: float
    best_step: int | None
    best_val: dict[str, Any] | None
    test: RetrievalReport | None = None
    pr_curve: PRCurve | None = None
    config: dict[str, Any] = field(default_factory=dict)
    test_per_category: dict[str, dict[str, Any]] | None = None
    stop_reason: str | None = None
    overflow_steps: int | None = None

    @property
    def finished(self) -> bool:
        """Whether the run is over: completed, or stopped early (not resumable to more steps)."""
        return self.status in FINISHED

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the content of ``report.json``)."""
        extra = (
            {} if self.test_per_category is None else {"test_per_category": self.test_per_category}
        )
        return {
            "status": self.status,
            "steps": self.steps,
            "seconds": self.seconds,
            "best_step": self.best_step,
            "best_val": self.best_val,
            "test": None if self.test is None else self.test.to_dict(),
            "run_dir": None if self.run_dir is None else str(self.run_dir),
            # only for an early end: the reports of complete runs keep their fields
            **({} if self.stop_reason is None else {"stop_reason": self.stop_reason}),
            **({} if self.overflow_steps is None else {"overflow_steps": self.overflow_steps}),
            **extra,
        }

    def save(self, run_dir: str | Path) -> None:
        """Write ``report.json`` (and ``pr_curve.json``, if any) in ``run_dir``, atomically."""
        paths = RunPaths(Path(run_dir))
        atomic_write_text(json.dumps(self.to_dict(), indent=2) + "\n", paths.report)
        if self.pr_curve is not None:
            data = {
                "recall": [float(v) for v in self.pr_curve.recall],
                "precision": [float(v) for v in self.pr_curve.precision],
                "n_queries": int(self.pr_curve.n_queries),
            }
            atomic_write_text(json.dumps(data) + "\n", paths.pr_curve)

    @classmethod
    def load(cls, run_dir: str | Path, with_test: bool = True) -> RunResult | None:
        """The result :meth:`save` wrote in ``run_dir`` (``None``: no finished run there).

        Args:
            run_dir: the run directory.
            with_test: the test report and curve are needed (``None`` without them).

        Returns:
            The :class:`RunResult` of the finished run (completed or stopped early) (its ``config`` read from
            ``config.yaml`` when there is one), or ``None``.
        """
        paths = RunPaths(Path(run_dir))
        try:
            report = json.loads(paths.report.read_text())
        except (FileNotFoundError, ValueError):
            return None
        if report.get("status") not in FINISHED:
            return None
        test, curve = None, None
        if with_test:
            try:
                data = json.loads(paths.pr_curve.read_text())
            except (FileNotFoundError, ValueError):
                return None
            if report.get("test") is None:
                return None
            test = RetrievalReport.from_dict(report["test"])
            curve = PRCurve(
                recall=np.asarray(data["recall"], dtype=np.float64),
                precision=np.asarray(data["precision"], dtype=np.float64),
                n_queries=int(data["n_queries"]),
            )
        return cls(
            run_dir=paths.root,
            status=str(report["status"]),
            steps=int(report["steps"]),
            seconds=float(report["seconds"]),
            best_step=report.get("best_step"),
            best_val=report.get("best_val"),
            test=test,
            pr_curve=curve,
            config=read_config_file(paths.config) if paths.config.is_file() else {},
            stop_reason=report.get("stop_reason"),
            test_per_category=report.get("test_per_category"),
            overflow_steps=report.get("overflow_steps"),
        )
