"""Loss comparison and ablation sweeps (Tables 1 and 2 of the SOPRC paper).

Loss comparison and ablation sweeps: the Table 1 and Table 2 protocol of Wen et al.,
*Exploring the Algorithm-Dependent Generalization of AUPRC Optimization with List Stability*
(NeurIPS 2022), Sec. 5.2-5.3 and App. D.1, at any scale.

Every loss is trained with the same backbone, sampler, budget and seeds (only its own parameters
and, where configured, its optimizer differ) and reported as mean ± std over seeds of the test
mAUPRC (tie-aware mAP), Recall@1, Recall@10 and MAP@R of the model selected on validation mAP. The
ablation reproduces Table 2's rows for SOPRC: biased estimator (class prior pi replaced by the
batch ratio), without the auxiliary vector ``v`` (phi(z+) instead of phi(S+)), without the
semi-variance regularizer L_var (Eq. 9), and SGD versus Adam.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .build import load_splits, preflight
from .checkpoint import atomic_write_text
from .config import Config, ConfigError, apply_overrides, config_from_dict
from .trainer import RunResult, Trainer

if TYPE_CHECKING:
    from rich.console import Console

    from ..data import ArrayDataset, RetrievalSplits
    from ..metrics import PRCurve

__all__ = [
    "ABLATION_ROWS",
    "BenchRow",
    "BenchRun",
    "aggregate_rows",
    "plan_bench",
    "prepare_splits",
    "reference_rows",
    "run_bench",
]

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
        for key, getter in _METRICS:
            values = [float(getter(r.test)) for r in self.results]
            out[f"{key}_mean"] = float(np.mean(values))
            # sample standard deviation over seeds (0 for a single seed)
            out[f"{key}_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        out["seconds"] = float(np.mean([r.seconds for r in self.results]))
        out.update({k: v for k, v in self.info.items() if k != "loss"})
        out["label"] = self.label
        out["seeds"] = [int(r.config["seed"]) for r in self.results]
        out["map_per_seed"] = [float(r.test.map) for r in self.results]
        out["steps"] = int(self.results[0].steps)
        out["run_dirs"] = [str(r.run_dir) for r in self.results]
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
            is chosen and after the ``quick`` budget), e.g. ``{"loss.params.lambda_val": 50}`` or
            ``{"budget.iterations": 20}`` from the command line (a parameter a run's loss does not
            take is reported as a config error naming the run).

    Raises:
        ConfigError: naming the run and the offending key.
    """
    base_config = config_from_dict(base)  # reports errors of the base file itself first
    bench = base_config.bench
    # the table reports R@1 and R@10 whatever the base config evaluates
    common: dict[str, Any] = {"progress": False, "eval_ks": sorted({*base_config.eval_ks, 1, 10})}
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
                    "output_dir": str(Path(output) / label / f"seed{seed}"),
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
    runs: Sequence[BenchRun], describe: Callable[[BenchRun], str]
) -> RetrievalSplits:
    """One data load for a whole sweep, then every data-dependent check of every distinct run.

    Args:
        runs: the planned runs; they must share their ``dataset`` section.
        describe: names a run in error messages (e.g. ``"bench run soprc (seed 0)"``).

    Raises:
        ConfigError: runs that disagree on the dataset, or the first run that fails
            :func:`~rankwise.training.trainer.preflight`, named by ``describe``.
    """
    dataset_key = json.dumps(runs[0].config.dataset.model_dump(mode="json"), sort_keys=True)
    if any(
        json.dumps(r.config.dataset.model_dump(mode="json"), sort_keys=True) != dataset_key
        for r in runs
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
    return splits


def reference_rows(
    runs: Sequence[BenchRun], splits: RetrievalSplits, seeds: Sequence[int], output: Path
) -> list[dict[str, Any]]:
    """What the table must be read against: the same test protocol with no learning at all.

    * ``input (no training)``: cosine retrieval on the flattened raw inputs (only for in-memory
      array datasets; image folders are skipped, and the skip is reported in the row list's
      absence, never silently replaced).
    * ``untrained network``: the benchmark's backbone + head at its seeded initialisation, one
      evaluation per seed, through the same :meth:`Trainer.evaluate` as the trained rows.

    A loss that does not beat these rows has not learned anything that transfers to the test
    classes; on tiny open-set problems (5 training classes) that happens, and the table says so.
    """
    from ..metrics import retrieval_metrics

    def row(name: str, reports: Sequence[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"loss": name, "label": name, "seconds": 0.0}
        values = {
            "map": [r.map for r in reports],
            "recall_at_1": [r.recall_at[1] for r in reports],
            "recall_at_10": [r.recall_at[10] for r in reports],
            "map_at_r": [r.map_at_r for r in reports],
            "r_precision": [r.r_precision for r in reports],
        }
        for key, vals in values.items():
            out[f"{key}_mean"] = float(np.mean(vals))
            out[f"{key}_std"] = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
        return out

    def flat(dataset: ArrayDataset) -> tuple[torch.Tensor, np.ndarray]:
        x = dataset.inputs.reshape(len(dataset.labels), -1).to(torch.float32)
        return x, np.asarray(dataset.labels)

    rows = []
    ks = (1, 10)
    if all(hasattr(d, "inputs") for d in (splits.test, splits.gallery) if d is not None):
        query, query_labels = flat(splits.test)
        if splits.protocol == "closed-set":
            gallery, gallery_labels = flat(splits.gallery)
            report = retrieval_metrics(query, query_labels, gallery, gallery_labels, ks=ks)
        else:
            report = retrieval_metrics(query, query_labels, ks=ks)
        rows.append(row("input (no training)", [report]))
    reports = []
    for seed in seeds:
        config = runs[0].config.model_copy(
            update={"seed": int(seed), "output_dir": str(output / "untrained" / f"seed{seed}")}
        )
        trainer = Trainer.from_config(config, splits=splits, overwrite=True)
        reports.append(trainer.evaluate("test"))
    rows.append(row("untrained network", reports))
    return rows


def _mean_curve(results: Sequence[RunResult]) -> PRCurve:
    from ..metrics import PRCurve

    curves = [r.pr_curve for r in results]
    return PRCurve(
        recall=np.asarray(curves[0].recall, dtype=np.float64),
        precision=np.mean([np.asarray(c.precision, dtype=np.float64) for c in curves], axis=0),
        n_queries=int(curves[0].n_queries),
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
) -> dict[str, Any]:
    """Train every planned run, then write ``bench.json``, ``bench.md`` and ``pr_curves.png``.

    Arguments as in :func:`plan_bench`; ``console`` receives one progress line per run (the
    table itself is :func:`rankwise.reporting.print_bench_table` of the returned summary). All configuration errors (including the data-dependent
    ones: unknown loss parameter, too many classes per batch) are raised before the first run.

    Returns:
        The ``bench.json`` content: ``{"dataset", "protocol", "seeds", "rows"}``, one row per
        loss (or ablation variant) with ``map_mean``, ``map_std``, ``recall_at_1_mean``, ...,
        ``seconds`` (mean wall-clock seconds per run) and bookkeeping fields.
    """
    from rich.console import Console

    from ..plots import plot_pr_curves
    from ..reporting import bench_table_markdown

    console = console if console is not None else Console()
    output = Path(output)
    runs = plan_bench(
        base,
        losses=losses,
        seeds=seeds,
        quick=quick,
        ablation=ablation,
        output=output,
        run_overrides=run_overrides,
    )
    splits = prepare_splits(runs, lambda run: f"bench run {run.label} (seed {run.seed})")

    console.print(
        f"[bold]rankwise bench[/bold]: {len(runs)} runs on {runs[0].config.dataset.name} "
        f"({splits.protocol}) -> {output}",
        soft_wrap=True,
    )
    results: list[RunResult] = []
    for i, run in enumerate(runs, 1):
        trainer = Trainer.from_config(run.config, splits=splits, overwrite=True, console=console)
        result = trainer.fit()
        results.append(result)
        console.print(
            f"  [{i}/{len(runs)}] {run.label:<20} seed {run.seed}: test mAP "
            f"{100 * result.test.map:.2f}  R@1 {100 * result.test.recall_at[1]:.2f}  "
            f"({result.seconds:.1f} s, best val step {result.best_step})",
            soft_wrap=True,
        )

    rows = aggregate_rows(runs, results)
    summary = {
        "dataset": runs[0].config.dataset.name,
        "protocol": str(splits.protocol),
        "seeds": [int(s) for s in seeds],
        "rows": [row.to_dict() for row in rows],
        "reference_rows": reference_rows(runs, splits, seeds, output),
    }
    output.mkdir(parents=True, exist_ok=True)
    atomic_write_text(json.dumps(summary, indent=2) + "\n", output / "bench.json")
    atomic_write_text(bench_table_markdown(summary, ablation), output / "bench.md")
    curves = {row.label: _mean_curve(row.results) for row in rows}
    plot_pr_curves(
        curves,
        output / "pr_curves.png",
        title=f"mean PR curves on {summary['dataset']} test "
        f"({'SOPRC ablation' if ablation else 'all losses'})",
        labels={row.label: row.to_dict()["map_mean"] for row in rows},
    )
    return summary
