"""Batch samplers and pair samplers for ranking losses and similarity learning.

:class:`MPerClassBatchSampler` builds seeded, resumable P x K batches (``batch_size / m``
distinct classes with ``m`` samples each), the batch layout used to train the stochastic AUPRC
estimator of Wen et al. (NeurIPS 2022, App. D) and the AUC loss of Gajić et al.;
:class:`DistributedMPerClassBatchSampler` hands each data-parallel rank a disjoint shard (whole
classes) of every such global batch. :mod:`rankwise.sampling.pairs` holds the incomplete
U-statistics of the negative-pair risk of Vogel, Bellet & Clémençon (ICML 2018, Sec. 4):
pair-based and tuple-based sampling, their estimators and the variances of Prop. 1.
"""

from .distributed import DistributedMPerClassBatchSampler
from .m_per_class import MPerClassBatchSampler
from .pairs import (
    ClassTupleSample,
    IncompleteVariances,
    NegativePairSample,
    complete_negative_risk,
    incomplete_variances,
    negative_pairs,
    pair_based_negative_risk,
    sample_class_tuples,
    sample_negative_pairs,
    tuple_based_negative_risk,
)

__all__ = [
    "ClassTupleSample",
    "DistributedMPerClassBatchSampler",
    "IncompleteVariances",
    "MPerClassBatchSampler",
    "NegativePairSample",
    "complete_negative_risk",
    "incomplete_variances",
    "negative_pairs",
    "pair_based_negative_risk",
    "sample_class_tuples",
    "sample_negative_pairs",
    "tuple_based_negative_risk",
]
