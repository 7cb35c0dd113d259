"""rankwise.models: embedding networks (backbone, linear head, L2 normalization).

ResNet-50 with frozen batch normalization as in Wen et al., NeurIPS 2022 (SOPRC), Sec. 6 and
Gajić et al. (AUC loss), Sec. 4.2; small CNN / MLP backbones for digits, the MNIST family and
tests. Entry point: :func:`build_model`.
"""

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

__all__ = [
    "BACKBONES",
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
