"""Reproductions of the papers' analysis figures, one module per experiment.

Each experiment writes JSON, a PNG figure and a one-line verdict: the SOPRC estimator study and
interpolation error of Wen et al. (NeurIPS 2022, Sec. 3.3, Fig. 1, App. B.2, Fig. 4-5), the sigmoid
slope of Gajić et al. (Eq. 10, Table 1, Fig. 2), the generalization rates, pointwise ROC and MMC
studies of Vogel, Bellet and Clémençon (ICML 2018, Sec. 5) and TALR's LabelMe NDCG (He et al.,
CVPR 2018, Table 3); each module cites its paper in full.

Every experiment runs from Python and from the command line with the same arguments:
``estimator_bias.run(quick=True, seed=1, output="runs/eb")`` is
``rankwise experiment estimator-bias --quick --seed 1 --output runs/eb``; docs/experiments.md
shows both and the ``output`` rules (:func:`~rankwise.experiments.base.resolve_output`).

Adding an experiment takes one module and one registry entry:

1. ``src/rankwise/experiments/my_study.py`` defines ``run`` with the :func:`experiment` decorator::

       from .base import ExperimentResult, experiment, new_figure

       @experiment("my-study", summary="One line for `rankwise experiment list`.",
                   reference="Author et al., Venue Year, Sec. 5, Fig. 3")
       def run(*, quick: bool = False, seed: int = 0, sizes: tuple[int, ...] = (10, 100)):
           ...  # docstring: a summary line, then Args ("sizes: Sample sizes, comma-separated.")
           return ExperimentResult("my-study", data={...}, verdict="my-study: ...",
                                   consistent=True, figure=figure)

   Options are keyword-only with defaults; ``bool``, ``int``, ``float``, ``str``, ``X | None`` and
   ``tuple[X, ...]`` annotations become ``--kebab-case`` options of the command (tuples as
   comma-separated lists), and the docstring's ``Args:`` lines their help. ``quick`` and ``seed``
   are required; ``output`` and ``overwrite`` are added by the decorator. Validate options with the
   helpers of :mod:`rankwise._validation` (a ``ValueError`` becomes a one-line ``error:`` and exit
   code 2 on the command line). Keep module-level imports light (numpy): the command line imports
   every registered module to build its options. An experiment that runs for more than a minute
   at its defaults reports its parts: ``parts = progress(total)`` (from ``.base``), then
   ``parts.advance("what finished")`` after each (or ``for x in parts.track(items, label)``); the
   command line shows them (silent from Python).
2. Add ``"my-study": "rankwise.experiments.my_study"`` to :data:`REGISTRY` below.

Tests (``tests/experiments/``) run every registered experiment with ``quick=True`` and check that
it finishes within a minute and is deterministic for a seed, so a new experiment is covered at once.
"""

from __future__ import annotations

from typing import Any

from .._registry import Lazy, Registry
from .base import ExperimentResult, ExperimentRun, ExperimentSpec, experiment

__all__ = [
    "REGISTRY",
    "ExperimentResult",
    "ExperimentSpec",
    "experiment",
    "get_experiment",
    "list_experiments",
    "run_experiment",
]

#: Experiment name -> module defining its ``run`` (imported on first use).
REGISTRY: dict[str, str] = {
    "estimator-bias": "rankwise.experiments.estimator_bias",
    "interpolation-error": "rankwise.experiments.interpolation_error",
    "auc-slope": "rankwise.experiments.auc_slope",
    "fast-rates": "rankwise.experiments.fast_rates",
    "hash-euclidean-ndcg": "rankwise.experiments.hash_euclidean_ndcg",
    "pointwise-roc-sphere": "rankwise.experiments.pointwise_roc_sphere",
    "mmc-subsampling": "rankwise.experiments.mmc_subsampling",
}
_RUNS: Registry[ExperimentRun] = Registry(
    "experiment",
    {name: Lazy(module, "run") for name, module in REGISTRY.items()},
    hint=" (`rankwise experiment list`)",
)


def get_experiment(name: str) -> ExperimentRun:
    """The ``run`` function of a registered experiment (with its spec as ``run.spec``).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    run = _RUNS[name]
    if run.spec.name != name:
        raise RuntimeError(
            f"REGISTRY maps {name!r} to {REGISTRY[name]}, whose experiment is {run.spec.name!r}."
        )
    return run


def list_experiments() -> list[ExperimentSpec]:
    """The specs of every registered experiment, in registry order."""
    return [get_experiment(name).spec for name in REGISTRY]


def run_experiment(name: str, **options: Any) -> ExperimentResult:
    """Run a registered experiment by name: ``run_experiment("auc-slope", quick=True)``.

    Args:
        name: a key of :data:`REGISTRY`.
        **options: the experiment's options, plus ``output`` and ``overwrite``.
    """
    return get_experiment(name)(**options)
