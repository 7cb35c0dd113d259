"""rankwise: learn embeddings, similarities and binary codes by optimizing ranking metrics.

They are judged by those metrics (AUPRC / average precision, ROC AUC, tie-aware AP and NDCG, TPR
at a fixed FPR), so rankwise optimizes them directly.

Subpackages: ``metrics`` (exact, tie-aware evaluation; no training code), ``losses`` (SOPRC, AP,
AUC, Wilcoxon, Smooth-AP, DIR, BlackBox-AP and pytorch-metric-learning baselines), ``sampling``
(P x K batch sampler), ``models``, ``hashing``, ``similarity_learning`` (scikit-learn estimators),
``data``, ``training`` and ``experiments``.
"""

__version__ = "0.1.0"
