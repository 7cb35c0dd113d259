"""Old import path of the stop on Ctrl-C / SIGTERM (:mod:`rankwise.training.stop`).

``Failures``, the Trainer's mixin of the interruption and non-finite messages, became part of the
Trainer; the signal handling is the :class:`~rankwise.training.stop.StopControl` it holds.
"""

from .stop import graceful_stop

__all__ = ["graceful_stop"]
