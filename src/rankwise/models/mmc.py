"""Moved to :mod:`rankwise.similarity_learning.mmc` (needs scikit-learn); this path keeps working."""

from ..similarity_learning.mmc import *  # noqa: F403
from ..similarity_learning.mmc import __all__  # noqa: F401
