"""Callbacks of the training loop: progress, metrics log, model selection, plots, collapse, trackers.

Everything around the loop: the progress bar, the ``metrics.jsonl`` log, the best checkpoint by
validation mAP (tie-aware mAUPRC, the model selection of Wen et al., NeurIPS 2022, Sec. 5.1), the
plots (Fig. 2 style), the collapse detector and the experiment trackers (TensorBoard, MLflow). Each is a :class:`Callback`, whose methods are the
hooks in the order :meth:`Trainer.fit` calls them; a callback with a ``state_key`` is stored in
every checkpoint. See docs/training.md (Callbacks).
"""

from .base import Callback, StepCallback, StepOutput, report_summary
from .collapse import (
    COLLAPSE_SPREAD,
    CollapseDetector,
    config_collapse_advice,
    embedding_spread,
    optimizer_collapse_advice,
)
from .early_stopping import EarlyStopping
from .metrics_log import MetricsLogger
from .mlflow_tracker import MLflowTracker
from .plots import PlotCurves
from .progress import ProgressBar
from .selection import BestCheckpoint
from .tensorboard_tracker import TensorBoardTracker
from .tracker import Tracker

__all__ = [
    "COLLAPSE_SPREAD",
    "BestCheckpoint",
    "Callback",
    "CollapseDetector",
    "EarlyStopping",
    "MLflowTracker",
    "MetricsLogger",
    "PlotCurves",
    "ProgressBar",
    "StepCallback",
    "StepOutput",
    "TensorBoardTracker",
    "Tracker",
    "config_collapse_advice",
    "embedding_spread",
    "optimizer_collapse_advice",
    "report_summary",
]
