"""Optional dependencies and the extras that install them.

``pip install rankwise`` installs what the losses and metrics need (torch, numpy, scipy, numba).
Everything else is an extra, named in ``pyproject.toml``: ``train`` (the trainer, configs and
plots), ``cli`` (the ``rankwise`` command on top of ``train``), ``baselines``
(pytorch-metric-learning), ``vision`` (torchvision + Pillow), ``faiss`` (faiss-cpu, the faiss
backend of :class:`rankwise.search.EmbeddingIndex`), ``export`` (onnx, onnxruntime and
onnxscript, for ``rankwise export --format onnx``), ``timm`` (timm, for ``model.backbone:
"timm:NAME"``), ``trackers`` (tensorboard and mlflow-skinny, for ``logging.trackers``). A feature
whose extra is missing fails at its
first use with :class:`MissingDependencyError`, which names the extra to install,
instead of an ``ImportError`` from deep inside the package.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType

__all__ = ["EXTRAS", "MissingDependencyError", "require"]

# extra -> the import names it provides (kept in step with [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("rich", "pydantic", "yaml", "matplotlib", "sklearn"),
    "cli": ("typer", "rich", "pydantic", "yaml", "matplotlib", "sklearn"),
    "baselines": ("pytorch_metric_learning",),
    "vision": ("torchvision", "PIL"),
    "faiss": ("faiss",),
    "export": ("onnx", "onnxruntime", "onnxscript"),
    "timm": ("timm",),
    "trackers": ("tensorboard", "mlflow"),
}
# import name -> distribution name, where they differ
_DISTRIBUTIONS = {
    "yaml": "PyYAML",
    "sklearn": "scikit-learn",
    "PIL": "Pillow",
    "pytorch_metric_learning": "pytorch-metric-learning",
    "faiss": "faiss-cpu",
    "mlflow": "mlflow-skinny",
}


class MissingDependencyError(ImportError):
    """An optional dependency of the feature in use is not installed.

    Attributes:
        extra: the extra that installs it (``pip install 'rankwise[<extra>]'``).
        missing: the distribution names that could not be imported.
    """

    def __init__(self, message: str, extra: str, missing: Sequence[str]) -> None:
        super().__init__(message)
        self.extra = extra
        self.missing = tuple(missing)


def require(modules: Sequence[str], extra: str, feature: str) -> list[ModuleType]:
    """The imported ``modules`` (e.g. ``("rich", "yaml")``), in order.

    Raises :class:`MissingDependencyError` listing every module that failed to import, what needs
    them (``feature``, e.g. ``"rankwise.training"``) and the install command of ``extra`` (the
    extra of ``pyproject.toml`` that installs them, e.g. ``"train"``).
    """
    imported: list[ModuleType] = []
    missing: list[str] = []
    for name in modules:
        try:
            imported.append(importlib.import_module(name))
        except ImportError:
            missing.append(_DISTRIBUTIONS.get(name, name))
    if missing:
        raise MissingDependencyError(
            f"{feature}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
            f"installed; install the {extra!r} extra: pip install 'rankwise[{extra}]'",
            extra,
            missing,
        )
    return imported
