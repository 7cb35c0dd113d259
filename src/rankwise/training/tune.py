"""The old path of hyper-parameter tuning: :mod:`rankwise.workflows.tune` (a re-export)."""

from ..workflows.tune import *  # noqa: F403
from ..workflows.tune import __all__  # noqa: F401
