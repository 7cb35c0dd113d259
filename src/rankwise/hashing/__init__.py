"""rankwise.hashing: binary codes learned by tie-aware ranking, stored packed, searched exactly.

He, Cakir, Bargal & Sclaroff, "Hashing as Tie-Aware Learning to Rank" (CVPR 2018): a network's
activations ``f`` become bits by ``sgn`` (relaxed to ``tanh(γ f / 2)`` while training, Sec. 4.1,
Eq. 8-10), codes are compared by the Hamming distance ``(b - φᵀφ') / 2`` (Eq. 1) computed as XOR +
popcount of packed bits, and a database is searched by counting sort over the ``b + 1`` distances
(Sec. 3.2). Evaluation lives in :func:`rankwise.metrics.hamming_retrieval_metrics`, the training
objectives in :class:`rankwise.losses.TieAwareAPLoss` / :class:`rankwise.losses.TieAwareNDCGLoss`.
"""

from .codes import PackedCodes, as_packed_codes, hamming_distances, pack_codes, unpack_codes
from .head import HashingHead, HashingModel, binarize, build_hashing_model
from .index import HammingIndex

__all__ = [
    "HammingIndex",
    "HashingHead",
    "HashingModel",
    "PackedCodes",
    "as_packed_codes",
    "binarize",
    "build_hashing_model",
    "hamming_distances",
    "pack_codes",
    "unpack_codes",
]
