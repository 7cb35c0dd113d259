"""Loss comparison and ablation sweeps (Tables 1 and 2 of the SOPRC paper).

The protocol of Wen et al. (NeurIPS 2022), Sec. 5.2-5.3 and App. D.1, at any scale: every loss is
trained with the same backbone, sampler, budget and seeds (only its own parameters and, where
configured, its optimizer differ) and reported as mean ± std over seeds of the test mAUPRC
(tie-aware mAP), Recall@1, Recall@10 and MAP@R of the model selected on validation mAP. The ablation
reproduces Table 2's SOPRC rows: biased estimator (class prior pi replaced by the batch ratio),
without the auxiliary vector ``v`` (phi(z+) instead of phi(S+)), without the semi-variance
regularizer L_var (Eq. 9), and SGD versus Adam.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.console import Console

from ..metrics import PRCurve, RetrievalReport, pr_curve, retrieval_metrics
from ..plots import plot_pr_curves
from ..reporting import bench_table_markdown
from ..training.build import check_data_files, load_splits, preflight
from ..training.config import (
    Config,
    ConfigError,
    absolute_paths,
    apply_overrides,
    config_from_dict,
)
from ..training.monitor import DEFAULT_MONITOR, monitor_of, monitor_value
from ..training.result import RunResult
from ..training.trainer import Trainer
from .sweep import (
    FinishedRun,
    SweepPlan,
    SweepRun,
    SweepSummary,
    check_stored_config,
    json_text,
    resume_sweep,
    run_sweep,
    sweep_settings,
)
from .sweepdir import SweepPaths

if TYPE_CHECKING:
    from ..data import RetrievalSplits

__all__ = [
    "ABLATION_ROWS",
    "BENCH_FILES",
    "BenchRow",
    "BenchRun",
    "aggregate_rows",
    "plan_bench",
    "prepare_splits",
    "reference_rows",
    "resume_bench",
    "run_bench",
    "run_trainer",
    "stored_result",
    "warm_up_metrics",
]

_NAMES = SweepPaths(Path())
# the sweep's own result files (the run directories are below them)
BENCH_FILES = tuple(p.name for p in (_NAMES.bench_json, _NAMES.bench_table, _NAMES.pr_curves_plot))

# Table 2 of the paper: (No., unbiased estimator, with v, with L_var, optimizer).
ABLATION_ROWS: tuple[tuple[int, bool, bool, bool, str], ...] = (
    (1, False, False, False, "sgd"),
    (2, True, False, False, "sgd"),
    (3, True, True, False, "sgd"),
    (4, True, True, True, "sgd"),
    (5, True, True, True, "adam"),
)
# metrics aggregated per row: (bench.json key prefix, getter on a RetrievalReport)
_METRICS = (
    ("map", lambda r: r.map),
    ("recall_at_1", lambda r: r.recall_at[1]),
    ("recall_at_10", lambda r: r.recall_at[10]),
    ("map_at_r", lambda r: r.map_at_r),
    ("r_precision", lambda r: r.r_precision),
)


@dataclass
class BenchRun:
    """One planned training run of a sweep."""

    label: str  # the row it belongs to ("soprc", or "soprc #3" in the ablation)
    seed: int
    config: Config
    row_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchRow:
    """Aggregated results of one row (one loss or ablation variant over all seeds)."""

    label: str
    info: dict[str, Any]
    results: list[RunResult]

    def to_dict(self) -> dict[str, Any]:
        """The row of ``bench.json``: mean and std over seeds of every metric, and bookkeeping."""
        out: dict[str, Any] = {"loss": self.info.get("loss", self.label)}
        out.update(_mean_std([tested(r)[0] for r in self.results]))
        out["seconds"] = float(np.mean([r.seconds for r in self.results]))
        out.update({k: v for k, v in self.info.items() if k != "loss"})
        out["label"] = self.label
        out["seeds"] = [int(r.config["seed"]) for r in self.results]
        out["map_per_seed"] = [float(tested(r)[0].map) for r in self.results]
        monitor = monitor_of(self.results[0].config)
        if monitor != DEFAULT_MONITOR:  # the test value of the metric that selected the model
            values = [monitor_value(tested(r)[0], monitor) for r in self.results]
            out["monitor_mean"] = float(np.mean(values))
            out["monitor_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        out["steps"] = int(self.results[0].steps)
        out["run_dirs"] = [str(r.run_dir) for r in self.results]
        return out


def _mean_std(reports: Sequence[Any]) -> dict[str, float]:
    """``<metric>_mean`` and ``<metric>_std`` over seeds of every metric of :data:`_METRICS`."""
    out = {}
    for key, getter in _METRICS:
        values = [float(getter(r)) for r in reports]
        out[f"{key}_mean"] = float(np.mean(values))
        # sample standard deviation over seeds (0 for a single seed)
        out[f"{key}_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    # runs evaluated at FPR budgets (eval_fpr): ROC AUC and TPR@FPR, the table's extra columns
    views = [getattr(r, "verification", None) for r in reports]
    present = [v for v in views if v is not None]
    if present and len(present) == len(views):
        for name in present[0].scalars():
            values = [float(v.scalars()[name]) for v in present]
            out[f"{name}_mean"] = float(np.mean(values))
            out[f"{name}_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    return out


def _loss_data(base: Mapping[str, Any], loss: str) -> dict[str, Any]:
    """The base config switched to ``loss``: its params are kept only for the same loss."""
    base_loss = base.get("loss") or {}
    params = dict(base_loss.get("params") or {}) if base_loss.get("name") == loss else {}
    return apply_overrides(base, {"loss": {"name": loss, "params": params}})


def plan_bench(
    base: Mapping[str, Any],
    *,
    losses: Sequence[str] | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    quick: bool = False,
    ablation: bool = False,
    output: str | Path,
    run_overrides: Mapping[str, Any] | None = None,
) -> list[BenchRun]:
    """Resolve and validate every run of a sweep before any training.

    Args:
        base: the base config as a plain mapping (e.g. ``yaml.safe_load`` of configs/digits.yaml).
        losses: losses to compare (default ``base["bench"]["losses"]``); ignored by ``ablation``.
        seeds: training seeds; every row uses all of them.
        quick: apply ``bench.quick.overrides`` (a short budget) to every run.
        ablation: plan Table 2's five SOPRC rows instead of the loss comparison.
        output: sweep directory; run ``<label>/seed<k>`` goes below it.
        run_overrides: dotted ``{key: value}`` overrides applied to every run last (after its loss
            and the ``quick`` budget), e.g. ``{"loss.params.lambda_val": 50}``; a parameter a
            run's loss does not take is a config error naming the run.

    Raises:
        ConfigError: naming the run and the offending key.
    """
    base_config = config_from_dict(base)  # reports errors of the base file itself first
    bench = base_config.bench
    # the table reports R@1 and R@10 whatever the base config evaluates
    common: dict[str, Any] = {"eval_ks": sorted({*base_config.eval_ks, 1, 10})}
    if quick:
        common.update(bench.quick.overrides)
    plans: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    if ablation:
        for number, unbiased, use_v, with_var, optimizer in ABLATION_ROWS:
            data = apply_overrides(_loss_data(base, "soprc"), bench.overrides.get("soprc", {}))
            opt = bench.ablation.sgd if optimizer == "sgd" else bench.ablation.adam
            data = apply_overrides(
                data,
                {
                    "loss.params.unbiased": unbiased,
                    "loss.params.use_v": use_v,
                    **({} if with_var else {"loss.params.semi_variance_weights": None}),
                    "optimizer": opt.model_dump(mode="json"),
                },
            )
            info = {
                "loss": "soprc",
                "variant": number,
                "unbiased_estimator": unbiased,
                "with_v": use_v,
                "with_semi_variance": with_var,
                "optimizer": optimizer,
            }
            plans.append((f"soprc-ablation-{number}", data, info))
    else:
        for loss in losses if losses is not None else bench.losses:
            data = apply_overrides(_loss_data(base, loss), bench.overrides.get(loss, {}))
            plans.append((loss, data, {"loss": loss}))
    runs = []
    run_overrides = dict(run_overrides or {})
    if "loss.name" in run_overrides or "loss" in run_overrides:
        raise ConfigError("bench: choose losses with `losses`, not a loss.name override.")
    reserved = {"seed": "seeds", "output_dir": "output"}
    for key, argument in reserved.items():
        if key in run_overrides:
            raise ConfigError(f"bench: set {key} with `{argument}`, not a {key}= override.")
    for label, data, info in plans:
        for seed in seeds:
            resolved = apply_overrides(
                data,
                {
                    **common,
                    "seed": int(seed),
                    "output_dir": str(SweepPaths(Path(output)).run(label, int(seed))),
                },
            )
            # last, so that the caller's values win over the quick budget too
            resolved = apply_overrides(resolved, run_overrides)
            try:
                config = config_from_dict(resolved)
            except ConfigError as exc:
                raise ConfigError(f"bench run {label} (seed {seed}): {exc}") from None
            runs.append(BenchRun(label, int(seed), config, info))
    if not runs:
        raise ConfigError("bench: nothing to run (empty `losses` or `seeds`).")
    return runs


def aggregate_rows(runs: Sequence[BenchRun], results: Sequence[RunResult]) -> list[BenchRow]:
    """Group finished runs by row label (in planning order)."""
    rows: dict[str, BenchRow] = {}
    for run, result in zip(runs, results, strict=True):
        row = rows.setdefault(run.label, BenchRow(run.label, dict(run.row_info), []))
        row.results.append(result)
    return list(rows.values())


def prepare_splits(
    runs: Sequence[BenchRun],
    describe: Callable[[BenchRun], str],
    cache: Path | None = None,
    console: Console | None = None,
) -> RetrievalSplits:
    """One data load for a whole sweep, then every data-dependent check of every distinct run.

    Last the pre-flight check of the image files
    (:func:`~rankwise.training.build.check_data_files`), once for every run.

    Args:
        runs: the planned runs; they must share their ``dataset`` section.
        describe: names a run in error messages (e.g. ``"bench run soprc (seed 0)"``).
        cache: the pre-flight check's cache (the sweep folder's ``preflight.json``).
        console: where its progress bar goes.

    Raises:
        ConfigError: runs that disagree on the dataset, or the first run that fails
            :func:`~rankwise.training.build.preflight`, named by ``describe``.
    """
    if (
        len({json.dumps(r.config.dataset.model_dump(mode="json"), sort_keys=True) for r in runs})
        > 1
    ):
        raise ConfigError("per-loss bench.overrides must not change the dataset section.")
    splits = load_splits(runs[0].config)
    checked: set[str] = set()
    for run in runs:
        # seed and output directory change no data-dependent check
        key = json.dumps({**run.config.to_dict(), "output_dir": None, "seed": None}, sort_keys=True)
        if key in checked:
            continue
        try:
            preflight(run.config, splits)
        except ConfigError as exc:
            raise ConfigError(f"{describe(run)}: {exc}") from None
        checked.add(key)
    check_data_files(runs[0].config, splits, cache, console)
    return splits


def reference_rows(
    runs: Sequence[BenchRun],
    splits: RetrievalSplits,
    seeds: Sequence[int],
    output: Path,
    curves: dict[str, PRCurve] | None = None,
) -> list[dict[str, Any]]:
    """What the table must be read against: the same test protocol with no learning at all.

    ``input (no training)``: cosine retrieval on the flattened raw inputs (in-memory array
    datasets only; no row for image folders). ``untrained network``: the backbone + head at its
    seeded initialisation, evaluated per seed by the same :meth:`Trainer.evaluate`. A loss that
    does not beat these has learned nothing that transfers to the test classes.

    Args:
        runs: the planned runs (the first one's config gives the backbone).
        splits: the loaded dataset splits.
        seeds: the seeds of the untrained networks.
        output: the sweep directory.
        curves: when given, receives each row's mean test PR curve, by row name.

    Returns:
        The rows, with a trained row's fields (``seeds``: those evaluated, ``[]`` for raw input).
    """

    def row(name: str, reports: Sequence[Any], row_seeds: Sequence[int]) -> dict[str, Any]:
        seeds = [int(s) for s in row_seeds]
        return {"loss": name, "label": name, "seconds": 0.0, **_mean_std(reports), "seeds": seeds}

    def flat(dataset: Any) -> tuple[torch.Tensor, np.ndarray]:  # any split with .inputs
        x = dataset.inputs.reshape(len(dataset.labels), -1).to(torch.float32)
        return x, np.asarray(dataset.labels)

    rows = []
    ks = (1, 10)
    if all(hasattr(d, "inputs") for d in (splits.test, splits.gallery) if d is not None):
        query, query_labels = flat(splits.test)
        gallery: tuple[Any, Any] = (None, None)
        if splits.protocol == "closed-set":
            gallery = flat(splits.gallery)
        report = retrieval_metrics(query, query_labels, *gallery, ks=ks)
        rows.append(row("input (no training)", [report], []))
        if curves is not None:
            curves["input (no training)"] = pr_curve(query, query_labels, *gallery)
    reports, untrained_curves = [], []
    for seed in seeds:
        config = runs[0].config.model_copy(
            update={"seed": int(seed), "output_dir": str(SweepPaths(output).untrained(int(seed)))}
        )
        trainer = Trainer.from_config(config, splits=splits, overwrite=True)
        if curves is None:
            reports.append(trainer.evaluate("test"))
        else:
            report, curve = trainer.test()
            reports.append(report)
            untrained_curves.append(curve)
    rows.append(row("untrained network", reports, seeds))
    if curves is not None:
        curves["untrained network"] = _average_curves(untrained_curves)
    return rows


def _average_curves(curves: Sequence[PRCurve]) -> PRCurve:
    return PRCurve(
        recall=np.asarray(curves[0].recall, dtype=np.float64),
        precision=np.mean([np.asarray(c.precision, dtype=np.float64) for c in curves], axis=0),
        n_queries=int(curves[0].n_queries),
    )


def warm_up_metrics() -> float:
    """Compile the numba evaluation kernels before anything is timed; returns the seconds spent.

    A kernel's first call in a process compiles it (or loads numba's cache), which would count
    in the first run's time. Exercises leave-one-out, query / gallery and the PR curve in float32.
    """
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(24, 8, generator=generator)
    labels = np.repeat(np.arange(6), 4)
    retrieval_metrics(x, labels, ks=(1, 10))
    retrieval_metrics(x[:12], labels[:12], x, labels, ks=(1, 10))
    pr_curve(x, labels)
    pr_curve(x[:12], labels[:12], x, labels)
    return time.perf_counter() - start


def stored_result(run: BenchRun, with_test: bool = True) -> RunResult | None:
    """The result of a run of the sweep that already completed (``None``: not completed).

    Args:
        run: the planned run.
        with_test: whether the run's test report is needed (``bench``; ``tune`` has none).

    Returns:
        The :class:`RunResult` read back by :meth:`RunResult.load`, with the run's config.

    Raises:
        ConfigError: the run directory holds a run made with another config.
    """
    run_dir = run.config.resolved_output_dir()
    result = RunResult.load(run_dir, with_test)
    if result is None:
        return None
    check_stored_config(run.config, run_dir)
    return replace(result, config=run.config.to_dict())


def run_trainer(
    run: BenchRun,
    splits: RetrievalSplits,
    *,
    resume: bool,
    console: Console | None,
    name: str,
) -> Trainer:
    """The trainer of a planned run on the sweep's splits: continued (``resume``) or afresh.

    ``console`` shows the run's progress, under ``name``.
    """
    return Trainer.from_config(
        run.config, splits=splits, console=console, resume=resume, overwrite=not resume, name=name
    )


def tested(result: RunResult) -> tuple[RetrievalReport, PRCurve]:
    """The test report and curve of a bench run (every bench run tests its selected model)."""
    if result.test is None or result.pr_curve is None:
        raise ValueError(f"the run in {result.run_dir} has no test report; run it with test data")
    return result.test, result.pr_curve


class _BenchSweep:
    """The plan and the summariser of one bench sweep: its runs, data, references and tables."""

    def __init__(
        self,
        runs: Sequence[BenchRun],
        seeds: Sequence[int],
        ablation: bool,
        output: Path,
        console: Console,
    ) -> None:
        self.runs, self.seeds, self.ablation = list(runs), [int(s) for s in seeds], ablation
        self.paths, self.console = SweepPaths(output), console
        self.splits: RetrievalSplits | None = None  # loaded by prepare
        self.warm_up = 0.0
        self.references: list[dict[str, Any]] = []
        self.curves: dict[str, PRCurve] = {}  # the references' mean test PR curves

    def plan(self, settings: dict[str, Any]) -> SweepPlan[RunResult]:
        """The sweep's plan for :func:`~rankwise.workflows.sweep.run_sweep`."""
        return SweepPlan(
            kind="bench",
            output=self.paths.root,
            runs=[self._sweep_run(i, run) for i, run in enumerate(self.runs, 1)],
            kept_in="their rows are in bench.json and bench.md",
            settings=settings,
            files=BENCH_FILES,
            prepare=self.prepare,
            start=self.start,
            report=self.report,
        )

    def _sweep_run(self, number: int, run: BenchRun) -> SweepRun[RunResult]:
        name = f"[{number}/{len(self.runs)}] {run.label} seed {run.seed}"

        def train(resume: bool) -> RunResult:
            trainer = run_trainer(run, self._splits, resume=resume, console=self.console, name=name)
            return trainer.fit(test=True)

        kept = partial(stored_result, run, True)
        return SweepRun(f"{run.label} seed {run.seed}", run.config, train, kept)

    @property
    def _splits(self) -> RetrievalSplits:
        if self.splits is None:
            raise RuntimeError("the bench sweep's data is loaded by its plan's prepare()")
        return self.splits

    def prepare(self) -> None:
        """One data load, and every data-dependent check, before anything is written."""
        self.splits = prepare_splits(
            self.runs,
            lambda run: f"bench run {run.label} (seed {run.seed})",
            self.paths.preflight,
            self.console,
        )

    def start(self) -> None:
        """Announce the sweep, compile the metric kernels, evaluate the reference rows."""
        self.console.print(
            f"[bold]rankwise bench[/bold]: {len(self.runs)} runs on "
            f"{self.runs[0].config.dataset.name} ({self._splits.protocol}) -> {self.paths.root}",
            soft_wrap=True,
        )
        self.warm_up = warm_up_metrics()
        self.references = reference_rows(
            self.runs, self._splits, self.seeds, self.paths.root, self.curves
        )

    def report(self, finished: Sequence[FinishedRun[RunResult]]) -> None:
        """One progress line per run: its test mAP and R@1, time and selected step."""
        last = finished[-1]
        run, result, number = self.runs[last.index], last.result, last.index + 1
        test = tested(result)[0]
        self.console.print(
            f"  [{number}/{len(self.runs)}] {run.label:<20} seed {run.seed}: test mAP "
            f"{100 * test.map:.2f}  R@1 {100 * test.recall_at[1]:.2f}  "
            f"({result.seconds:.1f} s, best val step {result.best_step}"
            f"{'' if last.how == 'trained' else ', ' + last.how})",
            soft_wrap=True,
            highlight=False,
        )

    def summarise(
        self, finished: Sequence[FinishedRun[RunResult]], complete: bool
    ) -> SweepSummary[dict[str, Any]]:
        """``bench.json`` and ``bench.md`` of the finished runs (and, complete, the PR curves)."""
        runs = [self.runs[f.index] for f in finished]
        results = [f.result for f in finished]
        rows = aggregate_rows(runs, results)
        dataset = self.runs[0].config.dataset.name
        summary: dict[str, Any] = {
            "dataset": dataset,
            "protocol": str(self._splits.protocol),
            "seeds": self.seeds,
            "complete": complete,
            "runs_finished": len(results),
            "runs_planned": len(self.runs),
            "warm_up_seconds": self.warm_up,
            # the forward pass's precision and chunking: what `seconds` and the memory depend on
            "precision": self.runs[0].config.precision,
            "sub_batch_size": self.runs[0].config.sub_batch_size,
            "rows": [row.to_dict() for row in rows],
            "reference_rows": self.references,
        }
        monitor = self.runs[0].config.selection.monitor
        if monitor != DEFAULT_MONITOR:  # a bench.json of the default selection keeps its keys
            summary["monitor"] = monitor
        files = {
            self.paths.bench_json: json_text(summary),
            self.paths.bench_table: bench_table_markdown(summary, self.ablation),
        }
        finish = partial(self._plot, rows, dataset) if complete else None
        return SweepSummary(summary, files, finish)

    def _plot(self, rows: Sequence[BenchRow], dataset: str) -> None:
        """``pr_curves.png``: every row's mean test PR curve, and the references'."""
        trained = {row.label: _average_curves([tested(r)[1] for r in row.results]) for row in rows}
        plot_pr_curves(
            {**trained, **self.curves},  # curves: the no-learning references
            self.paths.pr_curves_plot,
            title=f"mean test PR curves on {dataset} "
            f"({'SOPRC ablation' if self.ablation else 'all losses'})",
            labels=_legend_labels(rows, self.references, self.ablation),
            references=list(self.curves),
        )


def run_bench(
    base: Mapping[str, Any],
    *,
    losses: Sequence[str] | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    quick: bool = False,
    ablation: bool = False,
    output: str | Path,
    console: Console | None = None,
    run_overrides: Mapping[str, Any] | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Train every planned run, then write ``bench.json``, ``bench.md`` and ``pr_curves.png``.

    Arguments as :func:`plan_bench`; ``console`` gets one progress line per run (the table is
    :func:`rankwise.reporting.print_bench_table` of the summary). Every configuration error,
    data-dependent ones included, is raised before the first run. The runs go through
    :func:`rankwise.workflows.sweep.run_sweep`, whose ``resume`` / ``overwrite`` rules apply;
    ``bench.json`` / ``bench.md`` are rewritten after every run (``"complete": false`` until
    the end).

    Returns:
        The ``bench.json`` content (schema: docs/training.md, "rankwise bench"): one row per
        loss (or ablation variant) with ``map_mean``, ``map_std``, ``recall_at_1_mean``, ...

    Raises:
        TrainingInterrupted: Ctrl-C or SIGTERM; the finished runs are in ``bench.json`` and the
            interrupted one has its checkpoint: ``resume=True`` continues.
        RunDirInUseError: another process is writing ``output`` (nothing is read or written).
    """
    plan, summarise = _bench_sweep(
        base,
        losses=losses,
        seeds=seeds,
        quick=quick,
        ablation=ablation,
        output=output,
        console=console,
        run_overrides=run_overrides,
    )
    return run_sweep(plan, summarise, resume=resume, overwrite=overwrite)


def resume_bench(
    output: str | Path,
    *,
    device: str | None = None,
    num_workers: int | None = None,
    console: Console | None = None,
    argument: str = "output",
) -> dict[str, Any]:
    """Continue the interrupted bench sweep in ``output`` with the settings it recorded.

    As :func:`run_bench` with ``resume=True`` and the settings of its ``sweep.json``, read under
    the folder's lock (:func:`~rankwise.workflows.sweep.resume_sweep`); only ``device`` and
    ``num_workers`` may change.

    Args:
        output: the sweep directory.
        device: run on this device instead of the recorded one.
        num_workers: data-loader workers instead of the recorded number.
        console: as :func:`run_bench`.
        argument: the argument that named ``output``, for messages.

    Returns:
        The ``bench.json`` content, as :func:`run_bench`.

    Raises:
        ConfigError: ``output`` holds no bench sweep.
        TrainingInterrupted: Ctrl-C or SIGTERM; call again to continue.
        RunDirInUseError: another process is writing ``output`` (nothing is read or written).
    """

    def build(settings: dict[str, Any]) -> tuple[SweepPlan[RunResult], Any]:
        return _bench_sweep(**settings, output=output, console=console)

    return resume_sweep(
        output, "bench", build, argument=argument, device=device, num_workers=num_workers
    )


def _bench_sweep(
    base: Mapping[str, Any],
    *,
    losses: Sequence[str] | None,
    seeds: Sequence[int],
    quick: bool,
    ablation: bool,
    output: str | Path,
    console: Console | None,
    run_overrides: Mapping[str, Any] | None,
) -> tuple[SweepPlan[RunResult], Any]:
    """The plan and the summariser of :func:`run_bench` (arguments as there)."""
    output, base = Path(output), absolute_paths(base)
    runs = plan_bench(
        base,
        losses=losses,
        seeds=seeds,
        quick=quick,
        ablation=ablation,
        output=output,
        run_overrides=run_overrides,
    )
    settings = sweep_settings(
        base,
        losses=None if losses is None else list(losses),
        seeds=[int(s) for s in seeds],
        quick=bool(quick),
        ablation=bool(ablation),
        run_overrides=dict(run_overrides or {}),
    )
    console = console if console is not None else Console()
    bench = _BenchSweep(runs, seeds, ablation, output, console)
    return bench.plan(settings), bench.summarise


def _legend_labels(
    rows: Sequence[BenchRow], references: Sequence[Mapping[str, Any]], ablation: bool
) -> dict[str, str]:
    """Legend text per curve: a readable name and the test mAP in %, as in the tables."""
    labels = {}
    for row in rows:
        data = row.to_dict()
        name = row.label
        if ablation:
            parts = [
                "unbiased" if data["unbiased_estimator"] else "biased",
                "with v" if data["with_v"] else "no v",
                "with L_var" if data["with_semi_variance"] else "no L_var",
                "SGD" if data["optimizer"] == "sgd" else "Adam",
            ]
            name = f"No. {data['variant']}: {', '.join(parts)}"
        labels[row.label] = f"{name} (mAP {100 * data['map_mean']:.2f} %)"
    for ref in references:
        labels[ref["label"]] = f"{ref['label']} (mAP {100 * ref['map_mean']:.2f} %)"
    return labels
