"""Exact, tie-aware evaluation of rankings and retrieval (no training code).

Tie-aware AP and NDCG follow He et al. (CVPR 2018), Prop. 1 / App. A (McSherry & Najork 2008); MAP@R
and R-precision follow Musgrave et al., "A Metric Learning Reality Check" (ECCV 2020); ROC curves,
ROC AUC and TPR at a fixed FPR (Vogel et al., ICML 2018) live in :mod:`rankwise.metrics.curves` (their
streamed form over an evaluation's pairs in :mod:`rankwise.metrics.verification`), the
accumulating ``RetrievalMetric`` in :mod:`rankwise.metrics.module`; Hamming rankings of binary codes
are evaluated by counting sort in :mod:`rankwise.metrics.hamming` (TALR, Sec. 3.2).
"""

from ._blocks import query_blocks, supports_query_blocks
from .curves import (
    OperatingPoint,
    RocCurve,
    operating_point,
    pair_scores,
    roc_auc,
    roc_curve,
    roc_curve_from_embeddings,
    tpr_at_fpr,
)
from .distributed import (
    distributed_pr_curve,
    distributed_retrieval_metrics,
    merge_pr_curves,
    merge_retrieval_reports,
    query_share,
    sharded_curve,
    sharded_metric,
    sharded_verification,
)
from .hamming import EuclideanThresholdAffinity, HammingRetrievalReport, hamming_retrieval_metrics
from .module import RetrievalMetric
from .ranking import average_precision, batched_average_precision, batched_ndcg, ndcg
from .retrieval import PRCurve, ReportField, RetrievalReport, pr_curve, retrieval_metrics
from .verification import (
    PairCounts,
    VerificationReport,
    pair_counts,
    positive_pair_keys,
    verification_metrics,
)

__all__ = [
    "average_precision",
    "batched_average_precision",
    "ndcg",
    "batched_ndcg",
    "retrieval_metrics",
    "RetrievalReport",
    "ReportField",
    "pr_curve",
    "PRCurve",
    "roc_curve",
    "roc_auc",
    "tpr_at_fpr",
    "pair_scores",
    "roc_curve_from_embeddings",
    "RocCurve",
    "operating_point",
    "OperatingPoint",
    "RetrievalMetric",
    "hamming_retrieval_metrics",
    "HammingRetrievalReport",
    "EuclideanThresholdAffinity",
    "merge_retrieval_reports",
    "merge_pr_curves",
    "distributed_retrieval_metrics",
    "distributed_pr_curve",
    "sharded_metric",
    "sharded_curve",
    "query_share",
    "query_blocks",
    "supports_query_blocks",
    "verification_metrics",
    "VerificationReport",
    "pair_counts",
    "positive_pair_keys",
    "PairCounts",
    "sharded_verification",
]
