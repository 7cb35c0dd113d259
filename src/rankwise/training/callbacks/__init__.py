"""Callbacks of the training loop: progress, metrics log, model selection, plots, collapse.

Everything around the training loop that is not the loop: the progress bar, the
``metrics.jsonl`` log, the selection of the best checkpoint by validation mAP (tie-aware mAUPRC,
the model selection of Wen et al., NeurIPS 2022, Sec. 5.1), the convergence and PR-curve plots
(Fig. 2 style), and the collapse detector. Each is a :class:`Callback` that
:class:`~rankwise.training.trainer.Trainer` calls at fixed points of :meth:`Trainer.fit`.

The points, in the order they happen:

* ``on_fit_start(trainer)``: before the first step of a ``fit`` call (also after a resume);
* ``on_train_batch(trainer, embeddings, labels)``: in :meth:`Trainer.train_step`, after the
  forward pass and before the loss; raising here stops the step before anything is applied;
* ``on_train_step_end(trainer, output)``: the optimizer step is applied (:class:`StepOutput`);
* ``on_validation_end(trainer, report, embeddings)``: at every evaluation, before the checkpoint;
* ``on_step_end(trainer)``: the step, its records, its evaluation and its checkpoint are complete —
  the safe point to stop (raising ``KeyboardInterrupt`` here behaves like Ctrl-C);
* ``on_train_end(trainer)``: the loop is left, normally or by an exception;
* ``on_test_end(trainer, report, curve)``: the selected model was tested;
* ``on_fit_end(trainer, result)``: the run's :class:`RunResult` is ready;
* ``on_failure(trainer, error)``: the run stopped on a non-finite or collapsed model.

A callback with state to resume (the logged loss window, the best-so-far) sets ``state_key`` and
implements ``state_dict`` / ``load_state_dict`` with plain values: the trainer stores it in every
checkpoint, so a resumed run continues exactly.
"""

from .base import Callback, StepCallback, StepOutput, report_summary
from .collapse import (
    COLLAPSE_SPREAD,
    CollapseDetector,
    config_collapse_advice,
    embedding_spread,
    optimizer_collapse_advice,
)
from .metrics_log import MetricsLogger
from .plots import PlotCurves
from .progress import ProgressBar
from .selection import BestCheckpoint

__all__ = [
    "COLLAPSE_SPREAD",
    "BestCheckpoint",
    "Callback",
    "CollapseDetector",
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
