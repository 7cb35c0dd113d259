"""rankwise.models: embedding networks and learned similarities.

Embedding networks (backbone, linear head, L2 normalization): ResNet-50 with frozen batch
normalization as in Wen et al., NeurIPS 2022 (SOPRC), Sec. 6 and Gajić et al. (AUC loss), Sec. 4.2;
small CNN / MLP backbones for digits, the MNIST family and tests. Entry point: :func:`build_model`.

Similarities learned for pointwise ROC optimization (Vogel, Bellet & Clémençon, ICML 2018), as
scikit-learn estimators: :class:`BilinearSimilarity` (problem (6), closed form of Sec. 5.1) and
:class:`MMC` (Xing et al. 2002 in the form of Sec. 5.3).
"""

from .backbones import (
    VISION_EXTRA_HINT,
    FrozenBatchNorm,
    MLPBackbone,
    SmallCNN,
    freeze_batchnorm,
    resnet50_backbone,
)
from .bilinear import BilinearSimilarity
from .build import BACKBONES, build_backbone, build_model
from .embedding import EmbeddingHead, EmbeddingModel
from .mmc import MMC

__all__ = [
    "BACKBONES",
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
