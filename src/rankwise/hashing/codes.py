"""Binary codes: validation, bit packing, Hamming distances (XOR + popcount).

The public path of :mod:`rankwise._packing`, which holds them below the metrics.
"""

from .._packing import *  # noqa: F403
from .._packing import __all__  # noqa: F401
