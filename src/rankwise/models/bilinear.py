"""Moved to :mod:`rankwise.similarity_learning.bilinear` (needs scikit-learn); this path keeps working."""

from ..similarity_learning.bilinear import *  # noqa: F403
from ..similarity_learning.bilinear import __all__  # noqa: F401
