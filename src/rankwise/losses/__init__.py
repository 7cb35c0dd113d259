"""Ranking-metric losses and pytorch-metric-learning baselines.

SOPRC (unbiased stochastic AUPRC), the biased AP baseline, the AUC loss, the Wilcoxon loss,
Smooth-AP, ROADMAP, the Recall@k surrogate, DIR (histogram AP), BlackBox-AP, the pointwise ROC
loss (TPR at FPR ≤ α), the semi-variance regularizer, the binary-code losses (tie-aware AP / NDCG of TALR, He et al., CVPR
2018; the DPSH baseline), pytorch-metric-learning baselines through :func:`baseline`, and a cross-batch memory for the ranking
losses (:class:`RankingMemory`).

Every loss is an ``nn.Module`` called as ``loss(embeddings, labels, ref_embeddings=None,
ref_labels=None)`` and returns a scalar; see :mod:`rankwise.losses.base`.
"""

from .auc import AUCLoss, WilcoxonLoss, auc_slope
from .base import PairBatch, RankingLoss, similarity_matrix
from .baselines import BASELINES, baseline
from .blackbox_ap import BlackBoxAPLoss
from .dir import DIRLoss
from .memory import MEMORY_LOSSES, RankingMemory
from .pairwise_hashing import DPSHLoss
from .pointwise_roc import PointwiseROCLoss
from .recall_at_k import RecallAtKLoss
from .registry import LOSSES, build_loss
from .roadmap import ROADMAPLoss
from .smooth_ap import SmoothAPLoss
from .soprc import APLoss, SemiVarianceRegularizer, SOPRCLoss
from .tie_aware import TieAwareAPLoss, TieAwareNDCGLoss

__all__ = [
    "APLoss",
    "AUCLoss",
    "BASELINES",
    "BlackBoxAPLoss",
    "DIRLoss",
    "DPSHLoss",
    "LOSSES",
    "MEMORY_LOSSES",
    "PairBatch",
    "PointwiseROCLoss",
    "ROADMAPLoss",
    "RankingLoss",
    "RankingMemory",
    "RecallAtKLoss",
    "SOPRCLoss",
    "SemiVarianceRegularizer",
    "SmoothAPLoss",
    "TieAwareAPLoss",
    "TieAwareNDCGLoss",
    "WilcoxonLoss",
    "auc_slope",
    "baseline",
    "build_loss",
    "similarity_matrix",
]
