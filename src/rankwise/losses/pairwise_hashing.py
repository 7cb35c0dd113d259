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
from torch import nn

from .._affinity import affinity_labels, affinity_levels, check_affinity
from .._validation import Interval, check_embeddings, check_scalar
from .base import score_dtype

__all__ = ["DPSHLoss"]


class DPSHLoss(nn.Module):
    """Deep pairwise-supervised hashing loss (negative pair log-likelihood + quantization).

    Args:
        eta: weight ``η >= 0`` of the quantization term ``mean ||sgn(u) - u||²``.
        affinity: which pairs are similar: ``"labels"`` (same class id / a shared multi-hot
            label; ``"shared_labels"`` is the same here), an
            :class:`~rankwise.metrics.EuclideanThresholdAffinity` (labels are features; affinity
            > 0 is similar: multi-level affinities are made binary, as the paper does for DPSH in
            Sec. 5.3) or a callable ``f(labels, ref_labels) -> (B, M)``.

    Call as ``loss(codes (B, b), labels, ref_codes=None (M, b), ref_labels=None)``; returns a
    scalar.
    ``last_stats``: ``n_pairs``, ``n_similar_pairs``, ``likelihood``, ``quantization``.
    """

    def __init__(self, eta: float = 0.1, affinity: Any = "labels") -> None:
        super().__init__()
        self.eta = check_scalar(eta, "eta", Interval("real", 0, None))
        self.affinity = check_affinity(affinity)
        self.last_stats: dict[str, float] = {}

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss of one batch (see the class docstring for the arguments)."""
        u = check_embeddings(embeddings, "embeddings")
        lab = affinity_labels(self.affinity, labels, u.shape[0], "labels", u.device)
        if (ref_embeddings is None) != (ref_labels is None):
            raise ValueError("pass both `ref_embeddings` and `ref_labels`, or neither.")
        if ref_embeddings is None:
            ref, ref_lab = u, lab
        else:
            ref = check_embeddings(ref_embeddings, "ref_embeddings").to(u.device, u.dtype)
            if ref.shape[1] != u.shape[1]:
                raise ValueError(
                    f"`ref_embeddings` has {ref.shape[1]} bits but `embeddings` has {u.shape[1]}."
                )
            ref_lab = affinity_labels(
                self.affinity, ref_labels, ref.shape[0], "ref_labels", u.device
            )
        similar = affinity_levels(self.affinity, lab, ref_lab) > 0
        pairs = torch.ones_like(similar)
        if ref_embeddings is None:
            pairs.fill_diagonal_(False)
        n_pairs = int(pairs.sum())
        if n_pairs == 0:
            raise ValueError("DPSHLoss: the batch has no pair of distinct items; pass >= 2 items.")
        n_similar = int((similar & pairs).sum())
        if n_similar in (0, n_pairs):
            # as every loss of the library: a batch of one kind of pair only pulls every code
            # together (or apart) and teaches nothing about the ranking
            kind = "similar" if n_similar == 0 else "dissimilar"
            raise ValueError(
                f"DPSHLoss: the batch has no {kind} pair ({n_pairs} pairs); sample batches with "
                "several classes and >= 2 items per class (rankwise.sampling.MPerClassBatchSampler)."
            )
        # half precision is computed in float32 with autocast off, as every loss does
        # (rankwise.losses.base): Θ = ½ uᵀu' overflows float16 for long unsaturated codes
        dtype = score_dtype(u.dtype)
        with torch.autocast(u.device.type, enabled=False):
            u_c = u.to(dtype)
            ref_c = u_c if ref_embeddings is None else ref.to(dtype)
            theta = u_c @ ref_c.T / 2
            nll = F.softplus(theta) - similar.to(dtype) * theta
            likelihood = (nll * pairs).sum() / n_pairs
            quantization = (torch.where(u_c >= 0, 1.0, -1.0).to(dtype) - u_c).pow(2).mean()
        self.last_stats = {
            "n_pairs": n_pairs,
            "n_similar_pairs": n_similar,
            "likelihood": float(likelihood.detach()),
            "quantization": float(quantization.detach()),
        }
        return likelihood + self.eta * quantization

    def extra_repr(self) -> str:
        """The settings shown by ``repr``."""
        return f"eta={self.eta:g}"
