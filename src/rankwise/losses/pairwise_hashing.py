"""DPSH: pairwise-likelihood hashing loss, the pointwise (pair-based) baseline of TALR's Table 1.

Li, Wang & Kang, "Feature Learning based Deep Supervised Hashing with Pairwise Labels" (IJCAI
2016), Eq. (3)-(5): with ``Θ_ij = ½ u_iᵀ u_j`` for the network outputs ``u`` of two items and
``s_ij = 1`` for similar pairs, the negative log-likelihood of the pair labels under
``p(s_ij = 1) = σ(Θ_ij)`` is ``Σ_ij [log(1 + e^{Θ_ij}) - s_ij Θ_ij]``, and a quantization term
``η Σ_i ||sgn(u_i) - u_i||²`` pulls the outputs towards binary codes. Here ``u`` are the relaxed
codes of a :class:`rankwise.hashing.HashingHead`, both terms are averaged (over the batch's pairs,
self-pairs excluded, and over code entries), as in the common PyTorch re-implementations, so
``η`` does not depend on the batch size; ``log(1 + e^Θ)`` is evaluated as a stable softplus.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .._affinity import check_affinity
from .._validation import Interval, check_scalar
from ._deferred import LossStats
from .base import PairBatch, RankingLoss

__all__ = ["DPSHLoss"]


def _pair_counts(batch: PairBatch) -> tuple[int, int]:
    """(similar pairs, pairs of distinct items) of a batch, counted on the host from its labels."""
    host = batch.host
    n_similar = int(host.positives_per_anchor.sum())
    return n_similar, n_similar + int(host.negatives_per_anchor.sum())


class DPSHLoss(RankingLoss):
    """Deep pairwise-supervised hashing loss (negative pair log-likelihood + quantization).

    Args:
        eta: weight ``η >= 0`` of the quantization term ``mean ||sgn(u) - u||²``.
        affinity: which pairs are similar (affinity > 0), as for
            :class:`~rankwise.losses.TieAwareAPLoss`; multi-level affinities are made binary, as
            the paper does for DPSH in Sec. 5.3.

    Call as ``loss(codes (B, b), labels, ref_codes=None (M, b), ref_labels=None)``; returns a
    scalar. ``last_stats``: ``n_pairs``, ``n_similar_pairs``, ``likelihood``, ``quantization``.

    Example:
        >>> import torch
        >>> from rankwise.losses import DPSHLoss
        >>> codes = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])  # relaxed codes
        >>> round(DPSHLoss(eta=0.1)(codes, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.746
    """

    def __init__(self, eta: float = 0.1, affinity: Any = "labels") -> None:
        super().__init__("dot")  # Θ = ½ uᵀu' from the base class's "dot" scores
        self.eta = check_scalar(eta, "eta", Interval("real", 0, None))
        self.affinity = check_affinity(affinity)

    def check_batch(self, batch: PairBatch) -> None:
        """Refuse a batch without a pair of distinct items, or with one kind of pair only."""
        n_similar, n_pairs = _pair_counts(batch)
        if n_pairs == 0:
            raise ValueError("DPSHLoss: the batch has no pair of distinct items; pass >= 2 items.")
        if n_similar in (0, n_pairs):
            # as every loss of the library: a batch of one kind of pair only pulls every code
            # together (or apart) and teaches nothing about the ranking
            kind = "similar" if n_similar == 0 else "dissimilar"
            raise ValueError(
                f"DPSHLoss: the batch has no {kind} pair ({n_pairs} pairs); sample batches with "
                "several classes and >= 2 items per class (rankwise.sampling.MPerClassBatchSampler)."
            )

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """Loss of a prepared batch: every pair of distinct items, no anchor skipped."""
        pairs = batch.pos_mask | batch.neg_mask
        n_similar, n_pairs = _pair_counts(batch)
        # prepare() sets the embeddings; the affinity (always set here) gives the levels
        assert batch.levels is not None and batch.embeddings is not None
        similar = batch.levels > 0
        # half precision is computed in float32 with autocast off, as every loss does
        # (rankwise.losses.base): Θ = ½ uᵀu' overflows float16 for long unsaturated codes
        theta = batch.scores / 2
        dtype, u_c = theta.dtype, batch.embeddings
        with torch.autocast(theta.device.type, enabled=False):
            nll = F.softplus(theta) - similar.to(dtype) * theta
            likelihood = (nll * pairs).sum() / n_pairs
            quantization = (torch.where(u_c >= 0, 1.0, -1.0).to(dtype) - u_c).pow(2).mean()
        # these keys only, the deferred check of the call's codes kept
        self.last_stats = LossStats(
            {
                "n_pairs": n_pairs,
                "n_similar_pairs": n_similar,
                "likelihood": likelihood.detach(),
                "quantization": quantization.detach(),
            },
            check=getattr(self.last_stats, "check", None),
        )
        return likelihood + self.eta * quantization

    def extra_repr(self) -> str:
        """The settings shown by ``repr``."""
        return f"eta={self.eta:g}"
