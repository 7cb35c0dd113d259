"""Callbacks of the training loop: progress, metrics log, model selection, plots, collapse.

Everything around the loop: the progress bar, the ``metrics.jsonl`` log, the best checkpoint by
validation mAP (tie-aware mAUPRC, the model selection of Wen et al., NeurIPS 2022, Sec. 5.1), the
plots (Fig. 2 style) and the collapse detector. Each is a :class:`Callback`, whose methods are the
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
from .plots import PlotCurves
from .progress import ProgressBar
from .selection import BestCheckpoint

__all__ = [
    "COLLAPSE_SPREAD",
    "BestCheckpoint",
    "Callback",
    "CollapseDetector",
    "EarlyStopping",
    "MetricsLogger",
    "PlotCurves",
    "ProgressBar",
    "StepCallback",
    "StepOutput",
    "config_collapse_advice",
    "embedding_spread",
    "optimizer_collapse_advice",
    "report_summary",
]
