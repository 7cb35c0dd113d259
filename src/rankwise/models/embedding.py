"""Embedding models: a backbone, a linear projection to ``d`` dimensions and L2 normalization.

The ranking losses rankwise implements score pairs by cosine similarity of unit-norm embeddings
(Wen et al., NeurIPS 2022, Sec. 6: ResNet-50 features projected to 512 dimensions and
L2-normalized; Gajić et al., Sec. 4.2, likewise), so ``f(x) = W h(x) / ||W h(x)||_2`` with ``h`` the
backbone and ``W`` the head's linear map.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EmbeddingHead", "EmbeddingModel"]


class EmbeddingHead(nn.Module):
    """Linear projection ``(B, in_features) -> (B, dim)`` followed by L2 normalization.

    Args:
        in_features: backbone feature size.
        dim: embedding dimension ``d``.
        normalize: divide each row by its Euclidean norm (``eps = 1e-12`` keeps zero rows finite).
    """

    def __init__(self, in_features: int, dim: int, normalize: bool = True) -> None:
        super().__init__()
        if int(in_features) < 1 or int(dim) < 1:
            raise ValueError(
                f"`in_features` and `dim` must be positive integers, got {in_features} and {dim}."
            )
        self.in_features = int(in_features)
        self.dim = int(dim)
        self.normalize = bool(normalize)
        self.linear = nn.Linear(self.in_features, self.dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Project features ``(B, in_features)`` to embeddings ``(B, dim)``."""
        if features.ndim != 2 or features.shape[1] != self.in_features:
            raise ValueError(
                f"EmbeddingHead expects features (B, {self.in_features}), got {tuple(features.shape)}."
            )
        z = self.linear(features)
        return F.normalize(z, p=2.0, dim=1, eps=1e-12) if self.normalize else z

    def extra_repr(self) -> str:
        """Input and output sizes and whether outputs are L2-normalized."""
        return f"in_features={self.in_features}, dim={self.dim}, normalize={self.normalize}"


class EmbeddingModel(nn.Module):
    """``backbone`` then ``head``: ``forward(x) -> (B, d)`` embeddings (unit norm by default).

    Args:
        backbone: module mapping a batch to ``(B, F)`` features.
        head: :class:`EmbeddingHead` (or any module mapping ``(B, F)`` to ``(B, d)``).

    Attributes:
        embedding_dim: ``d`` (from ``head.dim`` when present).
    """

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.embedding_dim = int(getattr(head, "dim", 0)) or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Embed a batch: ``x`` of the backbone's input shape -> ``(B, d)``."""
        features = self.backbone(x)
        if features.ndim != 2:
            features = features.flatten(1)
        return self.head(features)
