"""Binary codes: validation, bit packing and Hamming distances by XOR + popcount.

The public home of :mod:`rankwise._packing` (bit layout, accepted code forms), which holds the
implementation below the metrics so that :mod:`rankwise.metrics` needs no hashing network.
"""

from .._packing import (
    PackedCodes,
    as_packed_codes,
    code_distance,
    distance_dtype,
    hamming_distances,
    pack_codes,
    popcount,
    unpack_codes,
)

__all__ = [
    "PackedCodes",
    "as_packed_codes",
    "pack_codes",
    "unpack_codes",
    "hamming_distances",
    "popcount",
    "code_distance",
    "distance_dtype",
]
