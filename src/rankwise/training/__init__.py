"""Training and benchmarking of embedding models with ranking losses.

The protocol of Wen et al. (NeurIPS 2022), Sec. 5.1 and App. D: P x K batches, model selection by
validation mAUPRC, test report of the selected model (Table 1 / 2 comparisons:
:mod:`rankwise.workflows.bench`). :class:`Trainer` takes your model, loss and data (settings grouped in
:class:`Schedule`, :class:`Runtime`, :class:`Logging`) and holds its :class:`RunStore`,
:class:`Evaluator` and :class:`StopControl`; :meth:`Trainer.from_config` builds them from a YAML
config. Needs ``pip install 'rankwise[train]'``.
"""

from .._extras import require

require(("rich", "pydantic", "yaml", "matplotlib"), "train", "rankwise.training")

from .build import learning_rate_at  # noqa: E402
from .callbacks import (  # noqa: E402 - after the dependency check
    BestCheckpoint,
    Callback,
    CollapseDetector,
    EarlyStopping,
    MetricsLogger,
    MLflowTracker,
    PlotCurves,
    ProgressBar,
    StepOutput,
    TensorBoardTracker,
)
from .checkpoint import atomic_save, atomic_write_text, load_checkpoint  # noqa: E402
from .config import Config, config_from_dict, load_config, parse_overrides  # noqa: E402
from .errors import (  # noqa: E402
    CollapsedEmbeddingsError,
    ConfigError,
    NonFiniteLossError,
    TrainingInterrupted,
)
from .evaluation import Evaluator  # noqa: E402
from .factory import train  # noqa: E402
from .inference import LoadedRun, load_run  # noqa: E402
from .result import RunResult  # noqa: E402
from .settings import Logging, Runtime, Schedule  # noqa: E402
from .stop import StopControl  # noqa: E402
from .store import RunStore  # noqa: E402
from .trainer import Trainer  # noqa: E402

__all__ = [
    "BestCheckpoint",
    "Callback",
    "CollapseDetector",
    "CollapsedEmbeddingsError",
    "Config",
    "ConfigError",
    "EarlyStopping",
    "Evaluator",
    "LoadedRun",
    "Logging",
    "MLflowTracker",
    "MetricsLogger",
    "NonFiniteLossError",
    "PlotCurves",
    "ProgressBar",
    "RunResult",
    "RunStore",
    "Runtime",
    "Schedule",
    "StepOutput",
    "StopControl",
    "TensorBoardTracker",
    "Trainer",
    "TrainingInterrupted",
    "atomic_save",
    "atomic_write_text",
    "config_from_dict",
    "learning_rate_at",
    "load_checkpoint",
    "load_config",
    "load_run",
    "parse_overrides",
    "train",
]
