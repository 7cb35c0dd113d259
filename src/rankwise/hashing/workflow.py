"""The old path of the hash sweep: :mod:`rankwise.workflows.hashing` (a re-export)."""

from ..workflows.hashing import *  # noqa: F403
from ..workflows.hashing import __all__  # noqa: F401
