"""The old path of the loss-comparison sweep: :mod:`rankwise.workflows.bench` (a re-export)."""

from ..workflows.bench import *  # noqa: F403
from ..workflows.bench import __all__  # noqa: F401
