"""The one sweep engine of ``bench``, ``tune`` and the hash sweep: no lost work.

A sweep is a plan of training runs below one output folder (:class:`SweepPlan`, one
:class:`SweepRun` per run) and a summariser that turns the finished runs into the sweep's result
files (:class:`SweepSummary`). :func:`run_sweep` runs it: the folder is locked for the whole sweep
(:func:`~rankwise.training.lock.lock_run_dir`); ``sweep.json`` records the sweep's settings; a run
whose stored ``config.yaml`` differs from the planned one (device and workers aside) is refused
before anything is written; an unchanged run is kept when completed and resumed from
``checkpoints/last.pt`` when interrupted; the summary is replaced atomically after every run; an
interruption says what is kept and how to resume. ``roc fit`` (one run) uses its writers. No
paper equation is implemented here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from .._disk import atomic_write
from .._signals import signal_label, signal_number_of
from ..training.checkpoint import atomic_write_text
from ..training.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_from_dict,
    read_config_file,
)
from ..training.errors import NonFiniteLossError, TrainingInterrupted
from ..training.lock import lock_run_dir
from ..training.rundir import RunPaths, existing_results
from .sweepdir import check_sweep_dir, read_sweep, record_sweep

__all__ = [
    "MAY_CHANGE",
    "FinishedRun",
    "SweepPlan",
    "SweepRun",
    "SweepSummary",
    "check_planned_configs",
    "check_stored_config",
    "json_text",
    "resume_sweep",
    "run_sweep",
    "stored_config_differences",
    "sweep_settings",
    "write_json",
    "write_npz",
]

# settings that may change between an interrupted sweep and its resumption
MAY_CHANGE = ("device", "num_workers")
Kept = TypeVar("Kept")
R = TypeVar("R")  # what one run of a sweep gives
S = TypeVar("S")  # what the whole sweep gives


def comparable(config: dict[str, Any]) -> dict[str, Any]:
    """A run's config without the settings that may change when it resumes."""
    return {k: v for k, v in config.items() if k not in MAY_CHANGE}


def _differences(saved: Any, planned: Any, prefix: str = "") -> list[str]:
    """The dotted keys where two configs differ, as ``key: <stored> stored, <planned> planned``."""
    if isinstance(saved, dict) and isinstance(planned, dict):
        out: list[str] = []
        for key in [*saved, *(k for k in planned if k not in saved)]:
            out += _differences(saved.get(key), planned.get(key), f"{prefix}{key}.")
        return out
    if saved == planned:
        return []
    return [f"{prefix.rstrip('.')}: {json.dumps(saved)} stored, {json.dumps(planned)} planned"]


def stored_config_differences(config: Config, run_dir: Path) -> list[str] | None:
    """How the ``config.yaml`` of ``run_dir`` differs from ``config`` (device and workers aside).

    Returns:
        ``None`` when it is the same config or none is stored; else the differing keys (a
        config.yaml that no longer validates is one difference).
    """
    saved_path = RunPaths(run_dir).config
    if not saved_path.is_file():
        return None
    try:  # through the schema: a key added since the run was stored compares as its default
        saved = config_from_dict(read_config_file(saved_path)).to_dict()
    except ConfigError as exc:
        return [f"its config.yaml is not a valid config today ({exc})"]
    differences = _differences(comparable(saved), comparable(config.to_dict()))
    return differences or None


def _refusal(refused: Sequence[tuple[Path, list[str]]]) -> str:
    """The message refusing the runs of a sweep stored with another config, and why."""
    shown = 3
    why = "; ".join(refused[0][1][:shown]) + (" ..." if len(refused[0][1]) > shown else "")
    if len(refused) == 1:
        where = f"the run in {str(refused[0][0])!r} was made with another config than this sweep"
        what = "it"
    else:
        runs = ", ".join(f"{d.parent.name}/{d.name}" for d, _ in refused)
        root = refused[0][0].parent.parent
        where = (
            f"{len(refused)} runs in {str(root)!r} ({runs}) were made with another config than "
            "this sweep"
        )
        what = "them"
    return (
        f"output: {where} plans for {what} ({why}); start the sweep afresh with `overwrite` (or "
        "choose another output)."
    )


def check_stored_config(config: Config, run_dir: Path) -> None:
    """Refuse a run directory whose ``config.yaml`` is not ``config`` (none stored: no check).

    Raises:
        ConfigError: naming ``run_dir``, the keys that differ and the fix (``overwrite`` or
            another output).
    """
    differences = stored_config_differences(config, run_dir)
    if differences is not None:
        raise ConfigError(_refusal([(run_dir, differences)]))


def sweep_settings(base: Mapping[str, Any], **fields: Any) -> dict[str, Any]:
    """The plain-JSON settings a sweep records in ``sweep.json`` and is resumed with.

    ``base`` is recorded without the settings that may change on resumption; ``fields`` are the
    protocol's own (losses, seeds, grid, ...).
    """
    return json.loads(json.dumps({"base": comparable(dict(base)), **fields}))


def check_planned_configs(configs: Iterable[Config], result_files: Sequence[str] = ()) -> None:
    """:func:`check_stored_config` of every planned run that holds results, before any training.

    Every refused run is named in one message, with the keys the first one differs in.

    Args:
        configs: the planned runs' configs.
        result_files: files besides a training run's own that count as results of a run.
    """
    refused = []
    for config in configs:
        run_dir = config.resolved_output_dir()
        if existing_results(run_dir) or existing_results(run_dir, result_files):
            differences = stored_config_differences(config, run_dir)
            if differences is not None:
                refused.append((run_dir, differences))
    if refused:
        raise ConfigError(_refusal(refused))


def json_text(data: Any) -> str:
    """``data`` as the indented JSON of every result file of a sweep (a final newline)."""
    return json.dumps(data, indent=2) + "\n"


def write_json(data: Any, path: Path) -> None:
    """Replace ``path`` atomically by ``data`` as indented JSON (readers never see half a file)."""
    atomic_write_text(json_text(data), path)


def write_npz(path: Path, **arrays: Any) -> None:
    """Replace ``path`` atomically by an ``np.savez`` archive of ``arrays``."""
    atomic_write(path, lambda handle: np.savez(handle, **arrays))


def _interruption(
    kind: str,
    exc: KeyboardInterrupt,
    running: str | None,
    finished: int,
    planned: int,
    output: Path,
    kept: str,
    again: str,
) -> TrainingInterrupted:
    """The interruption of a sweep naming the run that was ``running`` (``None``: between runs).

    What is kept (``kept``: where the finished runs' results are) and the Python call that resumes
    (``again``).
    """
    signal_number = signal_number_of(exc)
    head = f"{kind} interrupted ({signal_label(signal_number)})"
    if isinstance(exc, TrainingInterrupted) and running is not None:
        # the run's own message without its "training interrupted (Ctrl-C)" head: said once
        where = f" {exc.detail}" if exc.detail is not None else f": {exc.message}"
        message = f"{head} in run {running}{where}; {_finished(finished, planned, kept)}"
        step, checkpoint = exc.step, exc.checkpoint_step
    else:
        message, step, checkpoint = f"{head}; {_finished(finished, planned, kept)}", 0, None
    return TrainingInterrupted(
        message,
        step,
        output,
        checkpoint,
        f"{again} (output={str(output)!r})",
        signal_number=signal_number,
    )


def _finished(finished: int, planned: int, kept: str) -> str:
    """How many runs of a sweep finished, and where their results are (when there are some)."""
    if finished == 0:
        return "no run had finished" if planned > 1 else "the run had not finished"
    return f"{finished} of {planned} run{'s' if planned > 1 else ''} finished ({kept})"


# -- the engine ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepRun(Generic[R]):
    """One planned run of a sweep.

    Attributes:
        name: the run in messages, e.g. ``"soprc seed 0"``.
        config: the planned config; its ``output_dir`` is the run's directory.
        train: ``train(resume)`` trains the run and gives its result: afresh (``resume=False``;
            whatever its directory holds is overwritten) or continued from its checkpoint.
        kept: the stored result of the run when it completed (``None``: not completed); without
            it a run is never kept.
        failed: the result of a run whose loss became non-finite, from the error and the seconds
            it ran; the sweep goes on. Without it the error ends the sweep.
        group: runs of one group after a failed one are skipped (``tune``: the seeds of one grid
            point, which is never selected once one of them diverged).
    """

    name: str
    config: Config
    train: Callable[[bool], R]
    kept: Callable[[], R | None] | None = None
    failed: Callable[[NonFiniteLossError, float], R] | None = None
    group: Hashable | None = None

    @property
    def run_dir(self) -> Path:
        """The run's directory."""
        return self.config.resolved_output_dir()


@dataclass(frozen=True)
class FinishedRun(Generic[R]):
    """A run of a sweep that finished, as the summariser receives it.

    Attributes:
        index: its position in :attr:`SweepPlan.runs`.
        run: the planned run.
        result: what its ``train``, ``kept`` or ``failed`` gave.
        how: ``"trained"``, ``"resumed"`` (from the checkpoint an interruption left) or
            ``"kept"`` (completed by an earlier sweep with this config).
        failed: its loss became non-finite (``result`` is then ``failed``'s).
    """

    index: int
    run: SweepRun[R]
    result: R
    how: str
    failed: bool = False


@dataclass(frozen=True)
class SweepSummary(Generic[S]):
    """What a summariser makes of the finished runs.

    Attributes:
        value: what :func:`run_sweep` returns (once every run finished).
        files: path -> text of the sweep's result files, each replaced atomically, in order.
        finish: called once the complete summary is written (e.g. a figure); ``None``: nothing.
    """

    value: S
    files: Mapping[Path, str]
    finish: Callable[[], None] | None = None


def _nothing(*_: Any) -> None:
    """The default of a plan's hooks: nothing to do."""


@dataclass(frozen=True)
class SweepPlan(Generic[R]):
    """The runs of a sweep below one output folder, and what the protocol adds around them.

    Attributes:
        kind: the sweep, in messages and ``sweep.json`` (``"bench"``, ``"tune"``,
            ``"hash train"``).
        output: the sweep folder.
        runs: the planned runs, in order.
        kept_in: where the finished runs' results are, for the interruption message (``"their
            rows are in bench.json and bench.md"``).
        settings: the plain-JSON settings recorded in ``sweep.json``; then an output with
            results is refused unless resumed (same settings) or overwritten (previous sweep
            deleted). ``None``: no ``sweep.json``; running the sweep again continues it.
        files: the sweep's own result files (names in ``output``), deleted by ``overwrite``.
        records: path -> text of files that record the sweep, written once the checks pass.
        run_files: files besides a training run's own that count as results of a run.
        argument: the argument that named ``output``, for messages (``"output"``).
        prepare: called first, under the lock, before anything is written: data loads and the
            data-dependent checks.
        start: called once the sweep is recorded, before the first run (warm-up, references).
        report: called after each run with the finished runs so far (the new one last), once
            the summary holding it is written: a progress line.
    """

    kind: str
    output: Path
    runs: Sequence[SweepRun[R]]
    kept_in: str
    settings: dict[str, Any] | None = None
    files: Sequence[str] = ()
    records: Mapping[Path, str] = field(default_factory=dict)
    run_files: Sequence[str] = ()
    argument: str = "output"
    prepare: Callable[[], None] = _nothing
    start: Callable[[], None] = _nothing
    report: Callable[[Sequence[FinishedRun[R]]], None] = _nothing


#: ``summarise(finished_runs, complete)`` of :func:`run_sweep`
Summariser = Callable[[Sequence[FinishedRun[R]], bool], SweepSummary[S]]


def run_sweep(
    plan: SweepPlan[R],
    summarise: Summariser[R, S],
    *,
    resume: bool = False,
    overwrite: bool = False,
    resume_hint: str | None = None,
) -> S:
    """Run every run of ``plan``; rewrite the summary after each; return the complete one.

    Under the lock of ``plan.output``, in order: ``plan.prepare()``; the results rule (with
    ``plan.settings``: :func:`~rankwise.workflows.sweepdir.check_sweep_dir`); when the sweep
    continues, the stored config of every planned run that holds results is checked
    (:func:`check_planned_configs`: all refused runs named at once); nothing is written before
    these checks pass. Then ``sweep.json`` and ``plan.records`` are written, ``plan.start()``
    runs, and each run is kept, resumed or trained; after each, ``summarise(finished, False)``'s
    files are replaced atomically and ``plan.report`` is called; after the last,
    ``summarise(finished, True)``'s files, then its ``finish``.

    Args:
        plan: the runs and the protocol's hooks.
        summarise: ``summarise(finished_runs, complete)`` -> the summary (called after every run,
            ``complete=False``, and once at the end, ``complete=True``).
        resume: continue the sweep in ``plan.output`` (a plan without ``settings`` continues
            unless ``overwrite``).
        overwrite: start afresh: the previous sweep's results are deleted (``settings``) or
            every run is trained anew.
        resume_hint: the call that continues the sweep, for the interruption message (default
            ``"the same call with resume=True"``, ``"the same call again"`` without ``settings``);
            the command line puts its own command in its place.

    Returns:
        The complete summary's ``value``.

    Raises:
        ConfigError: the results rule or the stored-config check refused the sweep (nothing
            written), or a ``prepare`` error.
        TrainingInterrupted: Ctrl-C or SIGTERM: the finished runs are in the summary, the
            interrupted one has its checkpoint; the message says how to resume.
        RunDirInUseError: another process is writing ``plan.output`` (nothing read or written).
    """
    with lock_run_dir(plan.output, plan.argument, then="resume it" if resume else None):
        return _run_locked(plan, summarise, resume, overwrite, resume_hint)


def resume_sweep(
    output: str | Path,
    kind: str,
    build: Callable[[dict[str, Any]], tuple[SweepPlan[R], Summariser[R, S]]],
    *,
    argument: str = "output",
    device: str | None = None,
    num_workers: int | None = None,
    resume_hint: str | None = None,
) -> S:
    """Continue the ``kind`` sweep recorded in ``output`` with its saved settings.

    Under the lock of ``output`` (taken once, before ``sweep.json`` is read) the settings are
    read, ``device`` / ``num_workers`` applied to their ``base`` config (the only settings that
    may change), and ``build(settings)`` gives the plan and the summariser that
    :func:`run_sweep` would run with ``resume=True``.

    Args:
        output: the sweep folder.
        kind: the sweep recorded there (``"bench"``, ``"tune"``).
        build: ``settings -> (plan, summarise)``.
        argument: the argument that named ``output``, for messages.
        device: run on this device instead of the saved one.
        num_workers: data-loader workers instead of the saved number.
        resume_hint: as :func:`run_sweep` (default ``"the same call again"``).

    Returns:
        The complete summary's ``value``.

    Raises:
        ConfigError: no ``kind`` sweep in ``output``, or a refusal of :func:`run_sweep`.
        RunDirInUseError: another process is writing ``output`` (nothing read or written).
    """
    with lock_run_dir(output, argument, then="resume it"):
        settings = dict(read_sweep(output, kind)["settings"])
        changes = {"device": device, "num_workers": num_workers}
        settings["base"] = apply_overrides(
            settings["base"], {key: value for key, value in changes.items() if value is not None}
        )
        plan, summarise = build(settings)
        hint = "the same call again" if resume_hint is None else resume_hint
        return _run_locked(plan, summarise, True, False, hint)


def _run_locked(
    plan: SweepPlan[R],
    summarise: Summariser[R, S],
    resume: bool,
    overwrite: bool,
    resume_hint: str | None,
) -> S:
    """The body of :func:`run_sweep`, its folder locked."""
    output = Path(plan.output)
    recorded = plan.settings is not None
    continuing = resume or (not recorded and not overwrite)
    if resume_hint is None:
        resume_hint = "the same call with resume=True" if recorded else "the same call again"
    plan.prepare()
    _check(plan, resume=resume, overwrite=overwrite, continuing=continuing)
    _record(plan, overwrite=overwrite)
    finished: list[FinishedRun[R]] = []
    running: str | None = None  # the run in progress, if any
    try:
        plan.start()
        for index, run in enumerate(plan.runs):
            if _skipped(run, finished):
                continue
            running = run.name
            finished.append(_run_one(index, run, continuing))
            running = None
            _write(summarise(finished, False))
            plan.report(finished)
    except KeyboardInterrupt as exc:
        counts = (len(finished), len(plan.runs))
        raise _interruption(
            plan.kind, exc, running, *counts, output, plan.kept_in, resume_hint
        ) from None
    summary = summarise(finished, True)
    _write(summary)
    if summary.finish is not None:
        summary.finish()
    return summary.value


def _check(plan: SweepPlan[Any], *, resume: bool, overwrite: bool, continuing: bool) -> None:
    """Every refusal of the sweep, before anything is written."""
    if plan.settings is not None:
        check_sweep_dir(
            plan.output, plan.kind, plan.settings, plan.files, resume=resume, overwrite=overwrite
        )
    if continuing:
        check_planned_configs([run.config for run in plan.runs], plan.run_files)


def _record(plan: SweepPlan[Any], *, overwrite: bool) -> None:
    """``sweep.json`` (``overwrite``: the previous sweep deleted first) and ``plan.records``."""
    if plan.settings is not None:
        run_dirs = [run.run_dir for run in plan.runs]
        record_sweep(
            plan.output, plan.kind, plan.settings, run_dirs, plan.files, overwrite=overwrite
        )
    for path, text in plan.records.items():
        atomic_write_text(text, path)


def _skipped(run: SweepRun[Any], finished: Sequence[FinishedRun[Any]]) -> bool:
    """Whether a run of ``run``'s group failed already (the rest of a group is not run)."""
    return run.group is not None and any(f.failed and f.run.group == run.group for f in finished)


def _run_one(index: int, run: SweepRun[R], continuing: bool) -> FinishedRun[R]:
    """Keep, resume or train one run (only a continuing sweep keeps or resumes)."""
    how = "trained"
    if continuing:
        stored = run.kept() if run.kept is not None else None
        if stored is not None:
            return FinishedRun(index, run, stored, "kept")
        if RunPaths(run.run_dir).last.is_file():
            how = "resumed"
    start = time.perf_counter()
    try:
        return FinishedRun(index, run, run.train(how == "resumed"), how)
    except NonFiniteLossError as exc:
        if run.failed is None:
            raise
        return FinishedRun(index, run, run.failed(exc, time.perf_counter() - start), how, True)


def _write(summary: SweepSummary[Any]) -> None:
    """Replace every result file of ``summary`` atomically (readers never see half a file)."""
    for path, text in summary.files.items():
        atomic_write_text(text, path)
