"""Training and evaluating hash functions on rankwise's Trainer: TALR and its baselines.

The protocol of He, Cakir, Bargal & Sclaroff (CVPR 2018), Sec. 5.1-5.2 ("CIFAR-10, setting 1"): per
class 100 test queries and 500 training images drawn from the database, the database is everything
but the queries; every query is ranked against the database by Hamming distance and scored by
tie-aware AP_T (Table 1), with the tie-breaking range of every method (Fig. 3). Here on
Fashion-MNIST (same class structure and sizes) with a small CNN trained from scratch.

The methods of :data:`HASH_METHODS` share backbone, data, sampler and optimizer (only the loss
and the head differ; the table in docs/hashing.md, "Workflow"), each trained by
:class:`HashingTrainer`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .._registry import Registry
from ..hashing.head import binarize, build_hashing_model
from ..metrics import (
    HammingRetrievalReport,
    PRCurve,
    hamming_retrieval_metrics,
    pr_curve,
    query_blocks,
)
from ..models import build_model
from ..plots import plot_tie_ranges
from ..training import NonFiniteLossError, RunResult, Trainer
from ..training.build import check_data_files, load_splits, resolve_device, seed_everything
from ..training.callbacks import PlotCurves
from ..training.checkpoint import atomic_write_text, load_checkpoint
from ..training.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    parse_overrides,
    read_config_file,
)
from ..training.evaluation import embed_labelled
from ..training.factory import build_trainer
from ..training.rundir import RunPaths
from .sweep import FinishedRun, SweepPlan, SweepRun, SweepSummary, json_text, run_sweep, write_json
from .sweepdir import SweepPaths

if TYPE_CHECKING:
    from rich.console import Console

    from ..data import RetrievalSplits

__all__ = [
    "DEFAULT_HASH_CONFIG",
    "HASH_METHODS",
    "HashSettings",
    "HashingTrainer",
    "MethodResult",
    "build_hash_trainer",
    "calibrate_batch_norm",
    "encode_dataset",
    "evaluate_codes",
    "evaluate_sweep",
    "hamming_curve_fn",
    "hamming_metric_fn",
    "load_hash_config",
    "method_config",
    "plot_tie_ranges",
    "results_table",
    "run_hash_experiment",
    "write_report",
]

# method -> (loss, None = hash.objective's; params). Triplet: FaceNet's margin 0.2, semi-hard
# (Schroff et al., CVPR 2015; batch-hard collapses on these 10-class batches at the shared lr)
_METHODS: Registry[tuple[str | None, dict[str, Any]]] = Registry(
    "hash method",
    {
        "talr": (None, {}),
        "talr_midpoint": (None, {"form": "midpoint"}),
        "dpsh": ("dpsh", {}),
        "smooth_ap": ("smooth_ap", {}),
        "triplet": ("triplet_semihard", {"margin": 0.2}),
        "untrained": (None, {}),
    },
)
HASH_METHODS = _METHODS.names
_OBJECTIVE_LOSS = {"ap": "tie_aware_ap", "ndcg": "tie_aware_ndcg"}
# `rankwise hash train`'s built-in config = configs/hash_fashion_mnist.yaml (documented there)
DEFAULT_HASH_CONFIG: dict[str, Any] = {
    "dataset": {
        "name": "fashion-mnist",
        "protocol": "closed-set",
        "options": {"n_query": 100, "n_train": 500},
        "val_fraction": 0.1,
        "split_seed": 0,
    },
    "model": {"backbone": "small_cnn", "embedding_dim": 32},
    "loss": {"name": "tie_aware_ap", "params": {}},
    "sampler": {"m": 25, "batch_size": 250},
    "optimizer": {"name": "adam", "lr": 0.001, "weight_decay": 0.0},
    "schedule": {"name": "none"},
    "budget": {"iterations": 500},
    "eval_every": 100,
    "eval_ks": [100, 1000],
    "eval_batch_size": 1000,
    "log_every": 10,
    "seed": 0,
    "device": "auto",
    "num_workers": 0,
    "deterministic": True,
    "threads": 1,
    "hash": {
        "bits": [12, 24, 32, 48],
        "objective": "ap",
        "gamma": 1.0,
        "center": True,
        "backbone_options": {"width": 16},
        "methods": ["untrained", "talr", "talr_midpoint", "dpsh", "smooth_ap", "triplet"],
        "loss_params": {},
        "overrides": {},
    },
}


class HashSettings(BaseModel):
    """The ``hash:`` section of a hashing config (everything else is a training config).

    Attributes:
        bits: code lengths, one run per length and method (the paper: 12, 24, 32, 48).
        objective: ``"ap"`` (TieAwareAPLoss) or ``"ndcg"`` (TieAwareNDCGLoss) for ``talr``.
        gamma: steepness of the ``tanh(γ f / 2)`` relaxation of the hashing head.
        center: batch-normalize the head's activations (:class:`~rankwise.hashing.HashingHead`).
        backbone_options: options of the backbone of every method, e.g. ``{width: 16}`` for
            ``small_cnn`` (see :func:`rankwise.models.build_backbone`).
        methods: which of :data:`HASH_METHODS` to run.
        loss_params: per-method loss parameters, e.g. ``{talr: {form: midpoint}, dpsh: {eta:
            0.1}}`` (``bits`` of the TALR losses is set from the run's code length).
        overrides: per-method dotted config overrides, e.g. ``{triplet: {optimizer.lr: 1e-4}}``.
    """

    model_config = ConfigDict(extra="forbid")

    bits: list[int] = Field(default_factory=lambda: [12, 24, 32, 48])
    objective: str = "ap"
    gamma: float = Field(1.0, gt=0)
    center: bool = True
    backbone_options: dict[str, Any] = Field(default_factory=dict)
    methods: list[str] = Field(default_factory=lambda: list(HASH_METHODS))
    loss_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @field_validator("bits")
    @classmethod
    def _bits(cls, value: list[int]) -> list[int]:
        if not value or any(b < 1 for b in value):
            raise ValueError(f"hash.bits must be a non-empty list of positive ints, got {value}.")
        return sorted(set(value))

    @field_validator("objective")
    @classmethod
    def _objective(cls, value: str) -> str:
        if value not in _OBJECTIVE_LOSS:
            raise ValueError(f"hash.objective must be 'ap' or 'ndcg', got {value!r}.")
        return value

    @field_validator("methods")
    @classmethod
    def _methods(cls, value: list[str]) -> list[str]:
        unknown = [m for m in value if m not in HASH_METHODS]
        if unknown or not value:
            raise ValueError(f"hash.methods must be chosen from {HASH_METHODS}, got {value}.")
        return list(dict.fromkeys(value))


def _leaves_a_row_out(exclude_self: Any, leave_one_out: bool) -> bool:
    """Whether ``exclude_self`` takes a row out of every query's list (see the metric)."""
    if exclude_self is None:
        return leave_one_out
    if isinstance(exclude_self, (bool, np.bool_)):
        return bool(exclude_self)
    return bool((torch.as_tensor(np.asarray(exclude_self)) >= 0).any())


@query_blocks
def hamming_metric_fn(
    query: torch.Tensor,
    query_labels: Any,
    gallery: torch.Tensor | None = None,
    gallery_labels: Any = None,
    *,
    ks: Sequence[int] | None = (100,),
    exclude_self: Any = None,
) -> HammingRetrievalReport:
    """Evaluation of a :class:`~rankwise.training.Trainer` by Hamming ranking of ``sign`` codes.

    The ``metric_fn`` of :class:`HashingTrainer`. Cut-offs beyond the number of ranked items are
    dropped, as a validation split may hold fewer items than the test cut-offs. Takes the block
    call of :func:`~rankwise.metrics.sharded_metric` (a data-parallel evaluation ranks each
    rank's share of the queries).

    Args:
        query: ``(n, bits)`` outputs of the queries.
        query_labels: ``(n,)`` labels.
        gallery: ``(m, bits)`` outputs of the database, or None for leave-one-out.
        gallery_labels: ``(m,)`` labels.
        ks: cut-offs of recall@k / precision@k / AP_T@k / NDCG_T@k.
        exclude_self: as :func:`~rankwise.metrics.hamming_retrieval_metrics`.

    Returns:
        A :class:`~rankwise.metrics.HammingRetrievalReport`.
    """
    query_codes = binarize(query)
    gallery_codes = None if gallery is None else binarize(gallery)
    n_listed = len(query_codes) if gallery_codes is None else len(gallery_codes)
    n_ranked = n_listed - int(_leaves_a_row_out(exclude_self, gallery_codes is None))
    ks = tuple(k for k in (ks or ()) if k <= n_ranked) or None
    return hamming_retrieval_metrics(
        query_codes, query_labels, gallery_codes, gallery_labels, ks=ks, exclude_self=exclude_self
    )


@query_blocks
def hamming_curve_fn(
    query: torch.Tensor,
    query_labels: Any,
    gallery: torch.Tensor | None = None,
    gallery_labels: Any = None,
    *,
    exclude_self: Any = None,
    keep_per_query: bool = False,
) -> PRCurve:
    """Mean precision-recall curve of the ``sign`` codes (the ``curve_fn`` of HashingTrainer).

    Arguments as :func:`hamming_metric_fn` (and ``keep_per_query`` as
    :func:`~rankwise.metrics.pr_curve`); ranked by the integer inner products of the ±1 codes
    (``similarity="dot"``), the same order as the Hamming distances.
    """
    return pr_curve(
        binarize(query).float(),
        query_labels,
        None if gallery is None else binarize(gallery).float(),
        gallery_labels,
        similarity="dot",
        exclude_self=exclude_self,
        keep_per_query=keep_per_query,
    )


class HashingTrainer(Trainer):
    """The library's :class:`~rankwise.training.Trainer`, ranking by Hamming distance of codes.

    Arguments as :class:`~rankwise.training.Trainer`, with ``metric_fn`` / ``curve_fn``
    defaulting to :func:`hamming_metric_fn` / :func:`hamming_curve_fn`: model selection picks the
    model whose *codes* have the best tie-aware mAP, and the test report carries NDCG_T and the
    tie-breaking ranges.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("metric_fn", hamming_metric_fn)
        kwargs.setdefault("curve_fn", hamming_curve_fn)
        super().__init__(*args, **kwargs)


def load_hash_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> tuple[Config, HashSettings]:
    """Read a hashing config: a training config plus a ``hash:`` section.

    Args:
        path: YAML file (see ``configs/hash_fashion_mnist.yaml``); None = the built-in
            :data:`DEFAULT_HASH_CONFIG`.
        overrides: ``KEY=VALUE`` strings; keys under ``hash.`` go to the hash settings, the
            others to the training config.

    Returns:
        ``(Config, HashSettings)``.

    Raises:
        rankwise.training.ConfigError: unreadable file, unknown key, invalid value.
    """
    data: dict[str, Any] = DEFAULT_HASH_CONFIG if path is None else read_config_file(path)
    data = apply_overrides(data, parse_overrides(overrides))
    section = data.pop("hash", None) or {}
    try:
        settings = HashSettings.model_validate(section)
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            key = "hash." + ".".join(map(str, e["loc"]))
            msg = e["msg"].removeprefix("Value error, ").removeprefix(key + " ")
            if e["type"] == "extra_forbidden":
                msg = "unknown key (not part of the hash section; check its spelling)"
            lines.append(f"{key}: {msg}")
        raise ConfigError("\n  ".join(lines)) from None
    data.setdefault("loss", {"name": _OBJECTIVE_LOSS[settings.objective]})
    return config_from_dict(data), settings


def method_config(
    config: Config, settings: HashSettings, method: str, bits: int, output: Path | None
) -> Config:
    """The training config of one (method, code length) run."""
    data = config.to_dict()
    loss, params = _METHODS[method]
    params = {**params, **settings.loss_params.get(method, {})}
    data["loss"] = {"name": loss or _OBJECTIVE_LOSS[settings.objective], "params": params}
    data["model"]["embedding_dim"] = bits
    if output is not None:
        data["output_dir"] = str(SweepPaths(output).hash_run(method, bits))
    data = apply_overrides(data, settings.overrides.get(method, {}))
    return config_from_dict(data)


def _build_model(
    config: Config, method: str, settings: HashSettings, input_shape: Sequence[int]
) -> nn.Module:
    """The hashing model (or, for smooth_ap / triplet, the embedding model) of a run."""
    mc = config.model
    common: dict[str, Any] = {"weights_path": mc.weights_path, "frozen_bn": mc.frozen_bn}
    if mc.backbone_options:  # beside hash.backbone_options, which every method shares
        common["backbone_options"] = mc.backbone_options
    try:
        if method in ("smooth_ap", "triplet"):
            return build_model(
                mc.backbone,
                tuple(input_shape),
                mc.embedding_dim,
                **common,
                **settings.backbone_options,
            )
        return build_hashing_model(
            mc.backbone,
            tuple(input_shape),
            mc.embedding_dim,
            gamma=settings.gamma,
            # DPSH's quantization term acts on linear outputs u (Li et al., IJCAI 2016, Eq. 5)
            relaxation="identity" if method == "dpsh" else "tanh",
            center=settings.center,
            **common,
            **settings.backbone_options,
        )
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"model: {exc}") from None


def build_hash_trainer(
    config: Config,
    settings: HashSettings,
    method: str,
    bits: int,
    *,
    splits: RetrievalSplits | None = None,
    overwrite: bool = False,
    resume: bool = False,
    console: Console | None = None,
) -> Trainer:
    """A :class:`HashingTrainer` for one (method, code length) run of ``config``.

    Built as :meth:`rankwise.training.Trainer.from_config` builds (data, sampler, optimizer,
    seeds), with a hashing model (an embedding model for ``smooth_ap`` / ``triplet``).

    Args:
        config: the run's training config (:func:`method_config`).
        settings: the hash settings (``gamma``).
        method: one of :data:`HASH_METHODS` other than ``"untrained"``.
        bits: code length (the model's outputs).
        splits: pre-loaded splits (one load for every run).
        overwrite: start afresh in an output directory holding a run.
        resume: continue the run in the output directory.
        console: rich console for messages.
    """
    name = f"{method} {bits} bits on {config.dataset.name}"
    return build_trainer(
        config,
        trainer_cls=HashingTrainer,
        model=lambda shape: _build_model(config, method, settings, shape),
        splits=splits,
        overwrite=overwrite,
        resume=resume,
        console=console,
        name=name,
        plots=PlotCurves(title=name, pr_title=f"test mean PR curve, {name}", label=method),
    )


def encode_dataset(
    model: nn.Module,
    dataset: Dataset[Any],
    batch_size: int = 512,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, np.ndarray]:
    """``({-1, +1}`` int8 codes ``(N, bits)``, ``(N,)`` labels``)`` of a dataset, eval mode."""
    device = device or next(model.parameters()).device
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    return embed_labelled(model, loader, device, finish=lambda out: binarize(out).cpu())


def evaluate_codes(
    model: nn.Module,
    splits: RetrievalSplits,
    ks: Sequence[int] = (100, 1000),
    batch_size: int = 512,
) -> HammingRetrievalReport:
    """Test report of a model's codes: test queries against the gallery, or leave-one-out."""
    query, query_labels = encode_dataset(model, splits.test, batch_size)
    gallery, gallery_labels = (None, None)
    if splits.gallery is not None:
        gallery, gallery_labels = encode_dataset(model, splits.gallery, batch_size)
    return hamming_metric_fn(query, query_labels, gallery, gallery_labels, ks=ks)


@dataclass
class MethodResult:
    """Test result of one (method, code length) run.

    Attributes:
        method, bits: the run's method and code length.
        map: tie-aware mAP of the test queries (AP_T).
        map_range: ``(worst, best)`` mAP over every tie-breaking (Fig. 3).
        ndcg: tie-aware NDCG.
        report: the full report as a dict.
        run_dir: where the run lives (``<output>/<method>/<bits>bits``, ``untrained`` too).
        best_step: the selected step.
        seconds: training time.
        error: why the run failed (a diverged or collapsed run), else None.
    """

    method: str
    bits: int
    map: float
    map_range: tuple[float, float]
    ndcg: float
    report: dict[str, Any] = field(default_factory=dict)
    run_dir: str | None = None
    best_step: int | None = None
    seconds: float = 0.0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``report`` last)."""
        data = asdict(self)
        return data | {"map_range": list(self.map_range), "report": data.pop("report")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MethodResult:
        """The result back from :meth:`to_dict` (``hash_result.json``, ``results.json``)."""
        return cls(**{**data, "map_range": tuple(data["map_range"])})


def _result(
    method: str,
    bits: int,
    report: HammingRetrievalReport,
    run_dir: Path | None = None,
    best_step: int | None = None,
    seconds: float = 0.0,
) -> MethodResult:
    summary = report.to_dict()
    summary.pop("per_query_ap", None)
    return MethodResult(
        method,
        bits,
        float(report.map),
        (float(report.map_range[0]), float(report.map_range[1])),
        float(report.ndcg),
        summary,
        None if run_dir is None else str(run_dir),
        best_step,
        seconds,
    )


RESULT_FILE = RunPaths(Path()).hash_result.name  # a run's MethodResult, beside its report.json


class _HashSweep:
    """The plan and the summariser of one hash sweep: (method, code length) runs on one data load."""

    def __init__(
        self,
        config: Config,
        settings: HashSettings,
        output: Path,
        console: Console | None,
        progress_callback: Callable[[MethodResult, str], Any] | None,
    ) -> None:
        self.config, self.settings, self.paths = config, settings, SweepPaths(output)
        self.console, self.progress_callback = console, progress_callback
        self.splits: RetrievalSplits | None = None  # loaded by prepare

    def plan(self) -> SweepPlan[MethodResult]:
        """The sweep's plan for :func:`~rankwise.workflows.sweep.run_sweep`."""
        runs = [
            self._sweep_run(method, bits)
            for bits in self.settings.bits
            for method in self.settings.methods
        ]
        record = {**self.config.to_dict(), "hash": self.settings.model_dump()}
        return SweepPlan(
            kind="hash train",
            output=self.paths.root,
            runs=runs,
            kept_in="their results are in results.json",
            records={self.paths.hash_config: yaml.safe_dump(record, sort_keys=False)},
            run_files=(RESULT_FILE,),
            argument="output_dir",
            prepare=self.prepare,
            report=self.report,
        )

    def _sweep_run(self, method: str, bits: int) -> SweepRun[MethodResult]:
        cfg = method_config(self.config, self.settings, method, bits, self.paths.root)
        run_dir = cfg.resolved_output_dir()

        def failed(error: NonFiniteLossError, seconds: float) -> MethodResult:
            # a diverged / collapsed run: reported, the sweep goes on
            return _failed(method, bits, run_dir, str(error))

        return SweepRun(
            f"{method} {bits} bits",
            cfg,
            partial(self._train, cfg, method, bits),
            partial(_stored, run_dir),
            None if method == "untrained" else failed,
        )

    def _train(self, cfg: Config, method: str, bits: int, resume: bool) -> MethodResult:
        """Train one run afresh or continue it; its result also goes to ``hash_result.json``."""
        if method == "untrained":
            return _run_untrained(cfg, self.settings, bits, self._splits)
        trainer = build_hash_trainer(
            cfg,
            self.settings,
            method,
            bits,
            splits=self._splits,
            console=self.console,
            resume=resume,
            overwrite=not resume,
        )
        run = trainer.fit()
        run_dir = cfg.resolved_output_dir()
        result = _result(method, bits, _tested(run), run_dir, run.best_step, run.seconds)
        write_json(result.to_dict(), RunPaths(run_dir).hash_result)
        return result

    @property
    def _splits(self) -> RetrievalSplits:
        if self.splits is None:
            raise RuntimeError("the hash sweep's data is loaded by its plan's prepare()")
        return self.splits

    def prepare(self) -> None:
        """One data load and pre-flight check of its files for every run."""
        self.splits = load_splits(self.config)
        check_data_files(self.config, self.splits, self.paths.preflight, self.console)

    def report(self, finished: Sequence[FinishedRun[MethodResult]]) -> None:
        """``progress_callback(result, how)`` of the run that finished."""
        if self.progress_callback is not None:
            self.progress_callback(finished[-1].result, finished[-1].how)

    def summarise(
        self, finished: Sequence[FinishedRun[MethodResult]], complete: bool
    ) -> SweepSummary[list[MethodResult]]:
        """``results.json``: the test results of the finished runs (complete or not)."""
        results = [f.result for f in finished]
        text = json_text([r.to_dict() for r in results])
        return SweepSummary(results, {self.paths.hash_results: text})


def _tested(run: RunResult) -> HammingRetrievalReport:
    """The test report of a completed hash run (by :func:`hamming_metric_fn`)."""
    if run.test is None:
        raise RuntimeError(f"the run in {run.run_dir} has no test report; run it with test data")
    return cast(HammingRetrievalReport, run.test)


def run_hash_experiment(
    config: Config,
    settings: HashSettings,
    output: str | Path,
    *,
    overwrite: bool = False,
    console: Console | None = None,
    progress_callback: Callable[[MethodResult, str], Any] | None = None,
) -> list[MethodResult]:
    """Train every method of ``settings`` at every code length; test each by Hamming ranking.

    Runs are normal run directories ``<output>/<method>/<bits>bits``; ``<output>/results.json``
    collects the test results. The runs go through :func:`rankwise.workflows.sweep.run_sweep`:
    running the sweep again continues it (no ``sweep.json``; ``hash_config.yaml`` records it).

    Args:
        config: the base training config.
        settings: code lengths, methods, objective, ``gamma``.
        output: the sweep directory.
        overwrite: retrain runs that exist.
        console: rich console for messages.
        progress_callback: called as ``fn(result, how)`` after each run, ``how`` being
            ``"trained"``, ``"resumed"`` (from the checkpoint an interruption left) or
            ``"kept"`` (completed by an earlier call with this config).

    Returns:
        One :class:`MethodResult` per (method, bits).

    Raises:
        ConfigError: a run in ``output`` was trained with another config (without
            ``overwrite``).
        TrainingInterrupted: Ctrl-C or SIGTERM; the same call again continues.
        RunDirInUseError: another process is writing ``output`` (see :mod:`rankwise.training.lock`).
    """
    sweep = _HashSweep(config, settings, Path(output), console, progress_callback)
    return run_sweep(sweep.plan(), sweep.summarise, overwrite=overwrite)


@torch.no_grad()
def calibrate_batch_norm(
    model: nn.Module, dataset: Dataset[Any], batch_size: int = 512
) -> nn.Module:
    """Set the running statistics of every batch-norm layer to the data's, without training.

    Without it an untrained centred head keeps its initial mean 0 / variance 1 (centring nothing).
    Exact averages over one pass of ``dataset``; the model's mode and momenta are restored.

    Args:
        model: the network.
        dataset: map-style ``(x, label)`` dataset (the training data).
        batch_size: items per forward pass.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return model
    device = next(model.parameters()).device
    momenta = [m.momentum for m in norms]
    was_training = model.training
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    try:
        for x, _ in DataLoader(dataset, batch_size=batch_size, shuffle=False):
            model(x.to(device))
    finally:
        for m, momentum in zip(norms, momenta, strict=True):
            m.momentum = momentum
        model.train(was_training)
    return model


def _untrained(cfg: Config, settings: HashSettings, splits: RetrievalSplits) -> nn.Module:
    """The hashing network at its initialisation (the seed of the runs), statistics calibrated."""
    seed_everything(cfg.seed)
    model = _build_model(cfg, "talr", settings, splits.train.input_shape)
    return calibrate_batch_norm(model, splits.train, cfg.eval_batch_size)


def _run_untrained(
    cfg: Config, settings: HashSettings, bits: int, splits: RetrievalSplits
) -> MethodResult:
    """The untrained baseline in a run directory like every other run: config, report, result."""
    paths = RunPaths(cfg.resolved_output_dir())
    paths.root.mkdir(parents=True, exist_ok=True)
    atomic_write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), paths.config)
    start = time.perf_counter()
    model = _untrained(cfg, settings, splits)
    report = evaluate_codes(model, splits, batch_size=cfg.eval_batch_size)
    seconds = time.perf_counter() - start
    run = RunResult(paths.root, "completed", 0, seconds, None, None, report, config=cfg.to_dict())
    run.save(paths.root)  # report.json
    result = _result("untrained", bits, report, paths.root, seconds=seconds)
    write_json(result.to_dict(), paths.hash_result)
    return result


def _stored(run_dir: Path) -> MethodResult | None:
    """The result of a run that completed (its ``hash_result.json``), else None."""
    path = RunPaths(run_dir).hash_result
    return MethodResult.from_dict(json.loads(path.read_text())) if path.is_file() else None


def _failed(method: str, bits: int, run_dir: Path, error: str) -> MethodResult:
    nan = float("nan")
    return MethodResult(method, bits, nan, (nan, nan), nan, {}, str(run_dir), error=error)


def results_table(results: Sequence[MethodResult], metric: str = "map") -> str:
    """Markdown table: one row per method, one column per code length (tie-aware values)."""
    bits = sorted({r.bits for r in results})
    methods = list(dict.fromkeys(r.method for r in results))
    by_key = {(r.method, r.bits): r for r in results}
    head = "| method | " + " | ".join(f"{b} bits" for b in bits) + " |"
    rows = [head, "|---|" + "---:|" * len(bits)]

    def cell(r: MethodResult | None) -> str:
        return "—" if r is None else "failed" if r.error else f"{getattr(r, metric):.4f}"

    for m in methods:
        rows.append(f"| {m} | " + " | ".join(cell(by_key.get((m, b))) for b in bits) + " |")
    return "\n".join(rows)


def _make_sweep(output: str | Path) -> str:
    """The call that makes the sweep in ``output``, for messages."""
    return f"`run_hash_experiment(config, settings, {str(output)!r})`"


def evaluate_sweep(
    output: str | Path, device: str | None = None, *, make_sweep: str | None = None
) -> list[MethodResult]:
    """Re-evaluate every run of a sweep from its selected checkpoint (``checkpoints/best.pt``).

    Models are rebuilt from ``hash_config.yaml`` and each run's ``config.yaml`` (``untrained``
    from the same seeds) and tested by :func:`evaluate_codes`.

    Args:
        output: the sweep directory of :func:`run_hash_experiment`.
        device: where to encode (default: the runs' device setting).
        make_sweep: how a missing sweep's message says to make it (default: the
            :func:`run_hash_experiment` call; the command line passes its own command).

    Raises:
        FileNotFoundError: not a sweep directory (a run without a checkpoint is reported failed).
    """
    output = Path(output)
    sweep_config = SweepPaths(output).hash_config
    if not sweep_config.is_file():
        raise FileNotFoundError(
            f"{str(output)!r} is not a sweep directory (no hash_config.yaml); run "
            f"{make_sweep or _make_sweep(output)} first."
        )
    config, settings = load_hash_config(sweep_config)
    splits = load_splits(config)
    results = []
    for bits in settings.bits:
        for method in settings.methods:
            cfg = method_config(config, settings, method, bits, output)
            dev = resolve_device(device or cfg.device)
            run_dir, best_step = cfg.resolved_output_dir(), None
            if method == "untrained":
                model = _untrained(cfg, settings, splits).to(dev)
            else:
                seed_everything(cfg.seed)
                model = _build_model(cfg, method, settings, splits.train.input_shape).to(dev)
                path = RunPaths(run_dir).best
                if not path.is_file():
                    results.append(_failed(method, bits, run_dir, f"no checkpoint {path}"))
                    continue
                state = load_checkpoint(path, dev)
                model.load_state_dict(state["model"])
                best_step = state.get("step")
            report = evaluate_codes(model, splits, ks=cfg.eval_ks, batch_size=cfg.eval_batch_size)
            results.append(_result(method, bits, report, run_dir, best_step))
    return results


def write_report(
    results: Sequence[MethodResult], output: str | Path, title: str = "", prefix: str = "results"
) -> list[Path]:
    """Write ``<prefix>.json``, ``<prefix>_table.md`` and ``<prefix>_tie_ranges.png``.

    Args:
        results: the results of a sweep.
        output: the sweep directory.
        title: title of the tie-range figure.
        prefix: file-name prefix.

    Returns:
        The written paths.
    """
    json_path, table_path, plot_path = SweepPaths(Path(output)).hash_report(prefix)
    write_json([r.to_dict() for r in results], json_path)
    ranges = "\n".join(
        f"| {r.method} | {r.bits} | {r.map:.4f} | {r.map_range[0]:.4f} | {r.map_range[1]:.4f} |"
        for r in results
    )
    atomic_write_text(
        "Tie-aware mAP (AP_T):\n\n"
        + results_table(results, "map")
        + "\n\nTie-aware NDCG:\n\n"
        + results_table(results, "ndcg")
        + "\n\nTie-breaking range of mAP (worst, best):\n\n"
        + "| method | bits | AP_T | worst | best |\n|---|---:|---:|---:|---:|\n"
        + ranges
        + "\n",
        table_path,
    )
    return [json_path, table_path, plot_tie_ranges(results, plot_path, title)]
