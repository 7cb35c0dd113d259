"""Old import path of the run on disk (:mod:`rankwise.training.store`, :mod:`rankwise.training.result`).

``RunState``, the Trainer's run-folder mixin, became the :class:`~rankwise.training.store.RunStore`
the Trainer holds.
"""

from .result import RunResult
from .store import RunPaths, fallback_checkpoint, refuse_results

__all__ = ["RunPaths", "RunResult", "fallback_checkpoint", "refuse_results"]
