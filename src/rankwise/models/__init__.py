"""rankwise.models: embedding networks and learned similarities.

Embedding networks (backbone, linear head, L2 normalization): ResNet-50 with frozen batch
normalization as in Wen et al., NeurIPS 2022 (SOPRC), Sec. 6 and Gajić et al. (AUC loss), Sec. 4.2;
small CNN / MLP backbones for digits, the MNIST family and tests; your own network from a factory
(``"package.module:factory"``) or a timm model (``"timm:NAME"``, :mod:`rankwise.models.external`).
Entry point: :func:`build_model`.

The scikit-learn estimators :class:`BilinearSimilarity` and :class:`MMC` live in
:mod:`rankwise.similarity_learning`; they are re-exported here on first use, so importing a
backbone never needs scikit-learn (not a core dependency).
"""

from typing import Any

from .backbones import (
    VISION_EXTRA_HINT,
    FrozenBatchNorm,
    MLPBackbone,
    SmallCNN,
    freeze_batchnorm,
    resnet50_backbone,
)
from .build import BACKBONES, build_backbone, build_model
from .embedding import EmbeddingHead, EmbeddingModel
from .external import BackboneError

__all__ = [
    "BACKBONES",
    "BackboneError",
    "BilinearSimilarity",
    "MMC",
    "VISION_EXTRA_HINT",
    "EmbeddingHead",
    "EmbeddingModel",
    "FrozenBatchNorm",
    "MLPBackbone",
    "SmallCNN",
    "build_backbone",
    "build_model",
    "freeze_batchnorm",
    "resnet50_backbone",
]


def __getattr__(name: str) -> Any:
    """``BilinearSimilarity`` / ``MMC`` of :mod:`rankwise.similarity_learning`, imported lazily."""
    if name in ("BilinearSimilarity", "MMC"):
        # an optional extra (scikit-learn): imported on first use, with its install hint
        from .. import similarity_learning  # noqa: PLC0415

        return getattr(similarity_learning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
