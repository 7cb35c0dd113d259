"""Training and benchmarking of embedding models with ranking losses, following the protocol of
Wen et al., *Exploring the Algorithm-Dependent Generalization of AUPRC Optimization with List
Stability* (NeurIPS 2022), Sec. 5.1 and App. D: P x K batches, model selection by validation
mAUPRC, test report of the selected model, and the Table 1 / Table 2 comparisons
(:mod:`rankwise.training.bench`).
"""

from .checkpoint import atomic_save, atomic_write_text, load_checkpoint
from .config import Config, ConfigError, config_from_dict, load_config, parse_overrides
from .trainer import (
    NonFiniteLossError,
    RunResult,
    Trainer,
    TrainingInterrupted,
    learning_rate_at,
    train,
)

__all__ = [
    "Config",
    "ConfigError",
    "NonFiniteLossError",
    "RunResult",
    "Trainer",
    "TrainingInterrupted",
    "atomic_save",
    "atomic_write_text",
    "config_from_dict",
    "learning_rate_at",
    "load_checkpoint",
    "load_config",
    "parse_overrides",
    "train",
]
