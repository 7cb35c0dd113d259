"""Hyper-parameter selection on the validation split.

The way Wen et al. (NeurIPS 2022), Sec. 5.1 and App. D.1, tuned every loss: each point of a grid of
dotted overrides is trained with the protocol of :mod:`rankwise.workflows.bench` and scored by the
validation mAUPRC (tie-aware mAP) of its selected checkpoint, averaged over the tuning seeds; the
best point per loss wins. Test metrics are never read. The winners are written as
``bench.overrides`` of a ``tuned.yaml`` for ``rankwise bench --config tuned.yaml``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml
from rich.console import Console

from ..losses.registry import loss_parameters
from ..training.config import (
    Config,
    ConfigError,
    absolute_paths,
    apply_overrides,
    config_from_dict,
)
from ..training.errors import NonFiniteLossError
from ..training.monitor import monitor_of, monitor_value
from ..training.result import RunResult
from .bench import (
    BenchRun,
    plan_bench,
    prepare_splits,
    run_trainer,
    stored_result,
    warm_up_metrics,
)
from .sweep import (
    FinishedRun,
    SweepPlan,
    SweepRun,
    SweepSummary,
    json_text,
    resume_sweep,
    run_sweep,
    sweep_settings,
)
from .sweepdir import SweepPaths

if TYPE_CHECKING:
    from ..data import RetrievalSplits

__all__ = [
    "TIE_RULE",
    "TUNE_FILES",
    "Reproduce",
    "SeedOutcome",
    "TuneTrial",
    "overrides_over_quick",
    "parse_grid_values",
    "plan_tune",
    "python_reproduce",
    "resume_tune",
    "tune",
    "tuned_config",
    "validation_map",
]

# keys the protocol sets itself (from seeds, output, losses): a grid over them would be lost
_RESERVED_KEYS = (
    "seed",
    "output_dir",
    "progress",
    "eval_ks",
    "loss",
    "loss.name",
    "loss.params",
    "dataset",
    "bench",
)
_LOSS_PARAM_PREFIX = "loss.params."
_NAMES = SweepPaths(Path())
TUNE_FILES = (_NAMES.tune_json.name, _NAMES.tuned_config.name)
# equal scores are common when a grid key has no effect (docs/training.md, "rankwise tune")
TIE_RULE = (
    "equal mean validation mAP: the trial with the higher worst seed wins (the steadier "
    "point), then the earlier trial in grid order"
)


@dataclass
class SeedOutcome:
    """What tuning keeps of one finished run: the validation score and bookkeeping, no test."""

    seed: int
    val_map: float | None  # None: the run stopped on a non-finite loss
    best_step: int | None
    steps: int
    seconds: float
    run_dir: str
    error: str | None = None


@dataclass
class TuneTrial:
    """One grid point of one loss, trained with every tuning seed.

    Attributes:
        index: position in the sweep (trial directories are ``trials/trial<index>``).
        params: the dotted overrides of this point that apply to ``loss``.
        skipped: grid keys left out for ``loss`` (``{key: reason}``).
        runs: the planned, validated runs (one per seed).
        outcomes: filled by :func:`tune`, one per finished (or failed) seed.
    """

    index: int
    loss: str
    params: dict[str, Any]
    skipped: dict[str, str]
    runs: list[BenchRun]
    outcomes: list[SeedOutcome] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """Whether a seed failed (non-finite loss) or was not run."""
        return any(o.val_map is None for o in self.outcomes) or len(self.outcomes) < len(self.runs)

    @property
    def val_map_mean(self) -> float | None:
        """Mean validation mAP over the seeds; ``None`` when a seed failed or was not run."""
        if self.failed:
            return None
        mean = float(np.mean([o.val_map for o in self.outcomes]))
        return mean if math.isfinite(mean) else None

    def to_dict(self) -> dict[str, Any]:
        """The trial's entry of ``tune.json``."""
        return {
            "trial": self.index,
            "loss": self.loss,
            "params": self.params,
            "skipped": self.skipped,
            "seeds": [run.seed for run in self.runs],
            "val_map_per_seed": [o.val_map for o in self.outcomes],
            "val_map_mean": self.val_map_mean,
            "best_step_per_seed": [o.best_step for o in self.outcomes],
            "seconds": float(sum(o.seconds for o in self.outcomes)),
            "seconds_per_seed": [o.seconds for o in self.outcomes],
            "run_dirs": [o.run_dir for o in self.outcomes],
            "errors": [o.error for o in self.outcomes if o.error is not None],
        }


def validation_map(result: RunResult) -> float:
    """The selection score of a run: the monitored validation value of its selected checkpoint.

    The run's ``selection.monitor`` (default the validation mAP; :mod:`rankwise.training.monitor`).
    Only ``result.best_val`` is read, never ``result.test``: selection cannot see test data.
    """
    if result.best_val is None:
        raise RuntimeError(
            f"run {result.run_dir} has no validation report; tuning needs a validation split "
            "(dataset.val_fraction > 0)."
        )
    return monitor_value(result.best_val, monitor_of(result.config))


def _plain(value: Any, key: str) -> Any:
    """Tuples become lists; anything YAML cannot store is a ConfigError naming the key."""
    if isinstance(value, (tuple, list)):
        return [_plain(v, key) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, key) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ConfigError(
        f"grid {key}: value {value!r} of type {type(value).__name__} is not a plain YAML value "
        "(use numbers, strings, booleans, null, lists or mappings)."
    )


def parse_grid_values(item: str) -> tuple[str, list[Any]]:
    """``"optimizer.lr=0.0003,0.001"`` -> ``("optimizer.lr", [0.0003, 0.001])``.

    The values are read with ``yaml.safe_load`` as the items of a YAML list, so
    ``loss.params.semi_variance_weights=[1,5],null`` gives ``[[1, 5], None]``.
    """
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise ConfigError(
            f"`grid` item {item!r} must look like KEY=V1,V2,..., e.g. "
            "optimizer.lr=0.0003,0.001,0.003."
        )
    try:
        values = yaml.safe_load(f"[{raw}]")
    except yaml.YAMLError as exc:
        raise ConfigError(f"`grid` {key}: cannot parse values {raw!r}: {exc}") from None
    if not isinstance(values, list) or not values:
        raise ConfigError(f"`grid` {key}: no values in {raw!r}.")
    return key, values


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def overrides_over_quick(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` (the overrides applied) whose ``--quick`` budget leaves the overridden keys alone.

    ``rankwise bench`` applies its ``KEY=VALUE`` overrides after ``bench.quick.overrides``;
    ``rankwise tune`` applies them to the base config, which the quick budget would override. The
    ``bench.quick.overrides`` keys that overlap an override are dropped from the base, so the
    caller's value wins under ``quick`` too (and ``bench --quick`` on ``tuned.yaml`` keeps it).

    Args:
        base: the base config as a mapping, ``overrides`` already applied.
        overrides: the caller's dotted overrides.

    Returns:
        ``base`` with those ``bench.quick.overrides`` keys removed (a copy).
    """
    quick = config_from_dict(base).bench.quick.overrides
    kept = {k: v for k, v in quick.items() if not any(_overlap(k, key) for key in overrides)}
    if len(kept) == len(quick):
        return dict(base)
    return apply_overrides(base, {"bench.quick.overrides": kept})


def _check_grid_key(key: Any, checked: Sequence[str], quick_keys: Sequence[str]) -> None:
    """A grid key must be a dotted key the protocol does not set, overlapping no other key."""
    if not isinstance(key, str) or not key or any(not p for p in key.split(".")):
        raise ConfigError(f"grid key {key!r} must be a dotted config key, e.g. optimizer.lr.")
    for reserved in _RESERVED_KEYS:
        if key == reserved or (reserved in ("dataset", "bench") and key.startswith(reserved)):
            raise ConfigError(
                f"grid {key}: the tuning protocol sets {reserved} itself (seeds with `seeds`, "
                "losses with `losses`, the dataset is shared by every trial); tune "
                "loss parameters as loss.params.NAME."
            )
    for quick_key in quick_keys:
        if _overlap(key, quick_key):
            raise ConfigError(
                f"grid {key}: `quick` fixes {quick_key} (bench.quick.overrides); drop `quick` "
                "or this grid key."
            )
    for other in checked:
        if _overlap(key, other):
            raise ConfigError(f"grid keys {other} and {key} overlap; keep one of them.")


def _check_grid(
    grid: Mapping[str, Sequence[Any]], losses: Sequence[str], quick_keys: Sequence[str]
) -> dict[str, list[Any]]:
    """Structural checks of the grid; returns it with plain-YAML value lists."""
    if not grid:
        raise ConfigError("tune: the grid is empty; give `grid` at least one key with values.")
    checked: dict[str, list[Any]] = {}
    for key, values in grid.items():
        _check_grid_key(key, list(checked), quick_keys)
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
            raise ConfigError(f"grid {key}: give a list of values, got {values!r}.")
        if not values:
            raise ConfigError(f"grid {key}: the list of values is empty.")
        checked[key] = [_plain(v, key) for v in values]
        if key.startswith(_LOSS_PARAM_PREFIX):
            param = key[len(_LOSS_PARAM_PREFIX) :].split(".")[0]
            if not any(param in loss_parameters(loss) for loss in losses):
                raise ConfigError(
                    f"grid {key}: no tuned loss ({', '.join(losses)}) accepts a parameter "
                    f"{param!r}; check its spelling."
                )
    return checked


def plan_tune(
    base: Mapping[str, Any],
    *,
    losses: Sequence[str] | None = None,
    grid: Mapping[str, Sequence[Any]],
    seeds: Sequence[int] = (0,),
    quick: bool = False,
    output: str | Path,
) -> list[TuneTrial]:
    """Resolve and validate every trial of a tuning sweep, without loading data or training.

    Each loss gets the Cartesian product of the grid keys that apply to it (a
    ``loss.params.NAME`` its loss does not take goes to :attr:`TuneTrial.skipped`). Runs are
    planned by :func:`plan_bench`: the base's ``bench.overrides`` first, the grid point on top.

    Args:
        base: the base config as a plain mapping (``yaml.safe_load`` of a config file).
        losses: losses to tune (default ``base["bench"]["losses"]``).
        grid: ``{dotted key: [values]}``, e.g. ``{"optimizer.lr": [3e-4, 1e-3]}``.
        seeds: tuning seeds; a point's score is the mean over them.
        quick: apply ``bench.quick.overrides`` (the grid must not touch those keys).
        output: sweep directory; trial runs go to ``trials/trial<k>/<loss>/seed<s>``.

    Raises:
        ConfigError: bad grid key or value, unknown loss, or any run that does not validate,
            naming the key (and the trial).
    """
    # the base and the losses first: errors of the file itself before errors of the grid
    base_config = config_from_dict(base)
    loss_list = list(losses if losses is not None else base_config.bench.losses)
    if not loss_list:
        raise ConfigError("tune: no losses to tune (empty `losses`).")
    if not list(seeds):
        raise ConfigError("tune: no seeds (`seeds` must hold at least one seed).")
    if len(set(loss_list)) != len(loss_list):
        raise ConfigError(f"tune: `losses` names a loss twice: {loss_list}.")
    plan_bench(base, losses=loss_list, seeds=seeds[:1], quick=quick, output=output)
    quick_keys = list(base_config.bench.quick.overrides) if quick else []
    checked = _check_grid(grid, loss_list, quick_keys)
    trials: list[TuneTrial] = []
    for loss in loss_list:
        accepted = set(loss_parameters(loss))
        keys, skipped = [], {}
        for key in checked:
            param = key[len(_LOSS_PARAM_PREFIX) :].split(".")[0]
            if key.startswith(_LOSS_PARAM_PREFIX) and param not in accepted:
                skipped[key] = f"loss {loss!r} has no parameter {param!r}"
            else:
                keys.append(key)
        for point in itertools.product(*(checked[k] for k in keys)):
            params = dict(zip(keys, point, strict=True))
            index = len(trials)
            try:
                runs = plan_bench(
                    base,
                    losses=[loss],
                    seeds=seeds,
                    quick=quick,
                    output=SweepPaths(Path(output)).trial(index),
                    run_overrides=params,
                )
            except ConfigError as exc:
                raise ConfigError(
                    f"tune trial {_describe(loss, params)}: {_without_run_prefix(exc)}"
                ) from None
            trials.append(TuneTrial(index, loss, params, skipped, runs))
    return trials


def _describe(loss: str, params: Mapping[str, Any]) -> str:
    shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in params.items())
    return f"{loss} ({shown})" if shown else loss


def _without_run_prefix(exc: ConfigError) -> str:
    """plan_bench's ``bench run <label> (seed <s>): `` prefix: the trial name replaces it."""
    text = str(exc)
    if text.startswith("bench run "):
        return text.split("): ", 1)[-1]
    return text


def _selection_key(trial: TuneTrial) -> tuple[float, float, int]:
    """Larger is better: mean validation mAP, then the worst seed's, then earlier in the grid."""
    mean = trial.val_map_mean
    assert mean is not None, "only trials that ran every seed are ranked"  # as _winners does
    worst = min(o.val_map for o in trial.outcomes if o.val_map is not None)
    return (mean, worst, -trial.index)


def _winners(
    trials: Sequence[TuneTrial],
) -> tuple[dict[str, TuneTrial | None], dict[str, list[int]]]:
    """Per loss, the best trial by mean validation mAP (:data:`TIE_RULE`), and the tied trials.

    ``ties[loss]`` lists the trials whose mean validation mAP equals the winner's (the winner
    first); absent when there was no tie.
    """
    best = {
        loss: max(
            (t for t in trials if t.loss == loss and t.val_map_mean is not None),
            key=_selection_key,
            default=None,
        )
        for loss in dict.fromkeys(t.loss for t in trials)
    }
    ties: dict[str, list[int]] = {}
    for loss, winner in best.items():
        if winner is None:
            continue
        tied = [
            t.index
            for t in trials
            if t.loss == loss and t is not winner and t.val_map_mean == winner.val_map_mean
        ]
        if tied:
            ties[loss] = [winner.index, *tied]
    return best, ties


def tuned_config(
    base: Mapping[str, Any], winners: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """The base config with each loss's winning overrides as its ``bench.overrides[loss]``.

    Existing per-loss overrides are kept unless the grid set the same key; ``bench.losses`` is
    set to the tuned losses, in order.
    """
    data = copy.deepcopy(dict(base))  # keeps the base file's section order
    bench = data.setdefault("bench", {}) or {}
    data["bench"] = bench
    overrides = dict(bench.get("overrides") or {})
    for loss, params in winners.items():
        overrides[loss] = {**(overrides.get(loss) or {}), **dict(params)}
    bench["overrides"] = overrides
    bench["losses"] = list(winners)
    return data


def _comparable(config: Config) -> dict[str, Any]:
    # the run directory differs by construction and the bench section does not affect a run
    return {**config.to_dict(), "output_dir": None, "bench": None}


def _check_reproduces(
    tuned: Mapping[str, Any], winners: Mapping[str, TuneTrial], quick: bool, output: Path
) -> None:
    """``rankwise bench`` on ``tuned`` must resolve to exactly the winning trials' configs."""
    for loss, trial in winners.items():
        runs = plan_bench(
            tuned, losses=[loss], seeds=[trial.runs[0].seed], quick=quick, output=output
        )
        if _comparable(runs[0].config) != _comparable(trial.runs[0].config):
            raise RuntimeError(
                f"tune: tuned.yaml does not resolve to the winning config of {loss} "
                f"(trial {trial.index}); please report this bug."
            )


def _summary(
    trials: Sequence[TuneTrial],
    splits: RetrievalSplits,
    grid: Mapping[str, Any],
    seeds: Sequence[int],
    quick: bool,
    complete: bool,
    winners: Mapping[str, TuneTrial | None] | None = None,
    tuned_path: Path | None = None,
    ties: Mapping[str, list[int]] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "dataset": trials[0].runs[0].config.dataset.name,
        "protocol": str(splits.protocol),
        "selection": "validation mAP (tie-aware) of each run's selected checkpoint, mean over "
        "the tuning seeds; test metrics are never read",
        "tie_rule": TIE_RULE,
        "seeds": [int(s) for s in seeds],
        "quick": bool(quick),
        "grid": {k: list(v) for k, v in grid.items()},
        "complete": complete,
        "trials": [t.to_dict() for t in trials if _trial_done(t)],
    }
    if winners is not None:
        out["winners"] = {
            loss: None
            if t is None
            else {
                "trial": t.index,
                "params": t.params,
                "skipped": t.skipped,
                "val_map_mean": t.val_map_mean,
                "tied_with": [i for i in (ties or {}).get(loss, []) if i != t.index],
            }
            for loss, t in winners.items()
        }
        out["tuned_config"] = None if tuned_path is None else str(tuned_path)
    return out


def _announce(
    trials: Sequence[TuneTrial], splits: RetrievalSplits, output: Path, console: Console
) -> None:
    for loss in dict.fromkeys(t.loss for t in trials):
        skipped = trials[[t.loss for t in trials].index(loss)].skipped
        if skipped:
            console.print(
                f"[yellow]{loss}: skipping {', '.join(skipped)} (not a parameter of "
                f"{loss})[/yellow]",
                soft_wrap=True,
            )
    n_runs = sum(len(t.runs) for t in trials)
    counted = f"{len(trials)} trial{'s' * (len(trials) != 1)} ({n_runs} run{'s' * (n_runs != 1)})"
    console.print(
        f"[bold]rankwise tune[/bold]: {counted} on "
        f"{trials[0].runs[0].config.dataset.name} ({splits.protocol}) -> {output}",
        soft_wrap=True,
    )


def _report_ties(
    ties: Mapping[str, list[int]], trials: Sequence[TuneTrial], console: Console
) -> None:
    for loss, tied in ties.items():
        score = trials[tied[0]].val_map_mean
        assert score is not None  # a tie is among winners, which ran every seed
        console.print(
            f"[yellow]{loss}: trials {', '.join(map(str, sorted(tied)))} tie at validation mAP "
            f"{100 * score:.2f}; trial {tied[0]} chosen ({TIE_RULE}).[/yellow]",
            soft_wrap=True,
        )


def _outcome(run: BenchRun, result: RunResult) -> SeedOutcome:
    """What tuning keeps of a finished run: its validation score (a RunResult goes no further)."""
    return SeedOutcome(
        run.seed,
        validation_map(result),
        result.best_step,
        result.steps,
        result.seconds,
        str(result.run_dir),
    )


def _diverged(run: BenchRun, error: NonFiniteLossError, seconds: float) -> SeedOutcome:
    """A diverging point is a legitimate tuning outcome: recorded, never selected."""
    run_dir = str(run.config.resolved_output_dir())
    return SeedOutcome(run.seed, None, None, error.step, seconds, run_dir, str(error))


def _trial_done(trial: TuneTrial) -> bool:
    """Whether every seed of ``trial`` ran, or one diverged (the others are then not run)."""
    return len(trial.outcomes) == len(trial.runs) or any(o.val_map is None for o in trial.outcomes)


#: ``reproduce(tuned_path, quick)``: how ``tuned.yaml``'s header says to reproduce the test table
Reproduce = Callable[[Path, bool], str]


def python_reproduce(tuned_path: Path, quick: bool) -> str:
    """The Python call that reproduces the test table from ``tuned.yaml`` (its header's words).

    >>> python_reproduce(Path("runs/tune/tuned.yaml"), True)
    "`run_bench(read_config_file('runs/tune/tuned.yaml'), output=...)` (tuned with `quick` budgets)"
    """
    call = f"`run_bench(read_config_file({str(tuned_path)!r}), output=...)`"
    return call + (" (tuned with `quick` budgets)" if quick else "")


class _TuneSweep:
    """The plan and the summariser of one tuning sweep: its trials, data and selection."""

    def __init__(
        self,
        base: Mapping[str, Any],
        trials: Sequence[TuneTrial],
        settings: dict[str, Any],
        output: Path,
        console: Console,
        reproduce: Reproduce,
    ) -> None:
        self.base, self.trials, self.settings = base, list(trials), settings
        self.reproduce = reproduce
        self.paths, self.console = SweepPaths(output), console
        self.runs = [run for trial in trials for run in trial.runs]
        self.trial_of = [trial for trial in trials for _ in trial.runs]  # by position in runs
        self.splits: RetrievalSplits | None = None  # loaded by prepare
        self.ties: dict[str, list[int]] = {}

    def plan(self) -> SweepPlan[SeedOutcome]:
        """The sweep's plan for :func:`~rankwise.workflows.sweep.run_sweep`."""
        return SweepPlan(
            kind="tune",
            output=self.paths.root,
            runs=[self._sweep_run(trial, run) for trial in self.trials for run in trial.runs],
            kept_in="their scores are in tune.json",
            settings=self.settings,
            files=TUNE_FILES,
            prepare=self.prepare,
            start=self.start,
            report=self.report,
        )

    def _sweep_run(self, trial: TuneTrial, run: BenchRun) -> SweepRun[SeedOutcome]:
        name = f"[{trial.index + 1}/{len(self.trials)}] {run.label} seed {run.seed}"

        def train(resume: bool) -> SeedOutcome:
            trainer = run_trainer(run, self._splits, resume=resume, console=self.console, name=name)
            # tuning selects on validation data only: the test data is never evaluated
            return _outcome(run, trainer.fit(test=False))

        def kept() -> SeedOutcome | None:
            result = stored_result(run, with_test=False)
            return None if result is None else _outcome(run, result)

        return SweepRun(
            f"{run.label} seed {run.seed}",
            run.config,
            train,
            kept,
            failed=partial(_diverged, run),
            group=trial.index,
        )

    @property
    def _splits(self) -> RetrievalSplits:
        if self.splits is None:
            raise RuntimeError("the tuning sweep's data is loaded by its plan's prepare()")
        return self.splits

    def prepare(self) -> None:
        """One data load, and every data-dependent check, before anything is written."""
        described = {
            id(run): f"tune trial {_describe(t.loss, t.params)}"
            for t in self.trials
            for run in t.runs
        }
        self.splits = prepare_splits(
            self.runs, lambda run: described[id(run)], self.paths.preflight, self.console
        )

    def start(self) -> None:
        """Announce the sweep and compile the metric kernels."""
        _announce(self.trials, self._splits, self.paths.root, self.console)
        warm_up_metrics()

    def _collect(self, finished: Sequence[FinishedRun[SeedOutcome]]) -> None:
        """Each trial's outcomes, in seed order, from the finished runs."""
        for trial in self.trials:
            trial.outcomes = [f.result for f in finished if self.trial_of[f.index] is trial]

    def report(self, finished: Sequence[FinishedRun[SeedOutcome]]) -> None:
        """One progress line per trial, once its last seed finished (or one diverged)."""
        self._collect(finished)
        trial = self.trial_of[finished[-1].index]
        if not _trial_done(trial):
            return
        mean = trial.val_map_mean
        score = "diverged" if mean is None else f"val mAP {100 * mean:.2f}"
        self.console.print(
            f"  [{trial.index + 1}/{len(self.trials)}] {trial.loss:<18} "
            f"{json.dumps(trial.params)}: {score}",
            soft_wrap=True,
            highlight=False,
        )

    def summarise(
        self, finished: Sequence[FinishedRun[SeedOutcome]], complete: bool
    ) -> SweepSummary[dict[str, Any]]:
        """``tune.json`` of the finished trials; complete, the winners and ``tuned.yaml``."""
        self._collect(finished)
        trials, splits = self.trials, self._splits
        grid, seeds, quick = self.settings["grid"], self.settings["seeds"], self.settings["quick"]
        if not complete:
            # progress on disk: an interrupted sweep still shows what it measured
            summary = _summary(trials, splits, grid, seeds, quick, False)
            return SweepSummary(summary, {self.paths.tune_json: json_text(summary)})
        winners, self.ties = _winners(self.trials)
        chosen = {loss: t for loss, t in winners.items() if t is not None}
        tuned = tuned_config(self.base, {loss: t.params for loss, t in chosen.items()})
        tuned["bench"]["losses"] = list(winners)
        _check_reproduces(tuned, chosen, quick, self.paths.trials)
        tuned_path = self.paths.tuned_config
        header = (
            "# written by `rankwise tune`: the base config with bench.overrides[<loss>] set to the\n"
            "# hyper-parameters selected on validation mAP (see tune.json); reproduce the test table\n"
            f"# with {self.reproduce(tuned_path, quick)}.\n"
        )
        summary = _summary(trials, splits, grid, seeds, quick, True, winners, tuned_path, self.ties)
        files = {
            tuned_path: header + yaml.safe_dump(tuned, sort_keys=False),
            self.paths.tune_json: json_text(summary),
        }
        report_ties = partial(_report_ties, self.ties, self.trials, self.console)
        return SweepSummary(summary, files, report_ties)


def tune(
    base: Mapping[str, Any],
    *,
    losses: Sequence[str] | None,
    grid: Mapping[str, Sequence[Any]],
    seeds: Sequence[int] = (0,),
    output: str | Path,
    quick: bool = False,
    console: Console | None = None,
    resume: bool = False,
    overwrite: bool = False,
    reproduce: Reproduce | None = None,
) -> dict[str, Any]:
    """Select each loss's hyper-parameters on validation data; write ``tune.json``, ``tuned.yaml``.

    Arguments as :func:`plan_tune`, and ``console``, ``resume``, ``overwrite`` as
    :func:`~rankwise.workflows.bench.run_bench` (``tune.json`` is rewritten after every run,
    with the trials finished so far); ``reproduce(tuned_path, quick)`` words how the header of
    ``tuned.yaml`` says to reproduce the test table (default :func:`python_reproduce`; the
    command line passes its ``rankwise bench`` command). A relative ``model.pretrained`` of
    ``base`` is made absolute (:func:`~rankwise.training.config.absolute_paths`).
    Every configuration error, data-dependent ones included, is raised before the first run. A
    trial whose loss becomes non-finite is recorded as diverged and never selected; ties are
    broken by :data:`TIE_RULE` and reported.

    Returns:
        The ``tune.json`` content (fields: docs/training.md, "rankwise tune"): every trial, and
        ``winners[loss]`` (``None`` when every trial of the loss diverged; its bench overrides
        are then left as in the base).

    Raises:
        TrainingInterrupted: Ctrl-C or SIGTERM; ``resume=True`` continues.
        RunDirInUseError: another process is writing ``output`` (see :mod:`rankwise.training.lock`).
    """
    plan, summarise = _tune_sweep(
        base,
        losses=losses,
        grid=grid,
        seeds=seeds,
        quick=quick,
        output=output,
        console=console,
        reproduce=reproduce,
    )
    return run_sweep(plan, summarise, resume=resume, overwrite=overwrite)


def resume_tune(
    output: str | Path,
    *,
    device: str | None = None,
    num_workers: int | None = None,
    console: Console | None = None,
    argument: str = "output",
    reproduce: Reproduce | None = None,
) -> dict[str, Any]:
    """Continue the interrupted tuning sweep in ``output`` with the settings it recorded.

    As :func:`tune` with ``resume=True`` and the settings of its ``sweep.json``, read under the
    folder's lock (:func:`~rankwise.workflows.sweep.resume_sweep`); only ``device`` and
    ``num_workers`` may change. Arguments as :func:`~rankwise.workflows.bench.resume_bench`, and
    ``reproduce`` as :func:`tune`.

    Returns:
        The ``tune.json`` content, as :func:`tune`.
    """

    def build(settings: dict[str, Any]) -> tuple[SweepPlan[SeedOutcome], Any]:
        return _tune_sweep(**settings, output=output, console=console, reproduce=reproduce)

    return resume_sweep(
        output, "tune", build, argument=argument, device=device, num_workers=num_workers
    )


def _tune_sweep(
    base: Mapping[str, Any],
    *,
    losses: Sequence[str] | None,
    grid: Mapping[str, Sequence[Any]],
    seeds: Sequence[int],
    quick: bool,
    output: str | Path,
    console: Console | None,
    reproduce: Reproduce | None,
) -> tuple[SweepPlan[SeedOutcome], Any]:
    """The plan and the summariser of :func:`tune` (arguments as there)."""
    output, base = Path(output), absolute_paths(base)
    trials = plan_tune(base, losses=losses, grid=grid, seeds=seeds, quick=quick, output=output)
    settings = sweep_settings(
        base,
        losses=None if losses is None else list(losses),
        grid={k: [_plain(v, k) for v in values] for k, values in grid.items()},
        seeds=[int(s) for s in seeds],
        quick=bool(quick),
    )
    console = console if console is not None else Console()
    sweep = _TuneSweep(base, trials, settings, output, console, reproduce or python_reproduce)
    return sweep.plan(), sweep.summarise
