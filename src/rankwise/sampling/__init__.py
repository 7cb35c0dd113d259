"""Batch samplers for ranking losses.

:class:`MPerClassBatchSampler` builds seeded, resumable P x K batches (``batch_size / m``
distinct classes with ``m`` samples each), the batch layout used to train the stochastic AUPRC
estimator of Wen et al. (NeurIPS 2022, App. D) and the AUC loss of Gajić et al.;
:class:`DistributedMPerClassBatchSampler` hands each data-parallel rank a disjoint shard (whole
classes) of every such global batch.
"""

from .distributed import DistributedMPerClassBatchSampler
from .m_per_class import MPerClassBatchSampler

__all__ = ["DistributedMPerClassBatchSampler", "MPerClassBatchSampler"]
