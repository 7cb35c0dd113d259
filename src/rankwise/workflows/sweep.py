"""The one sweep engine of ``bench``, ``tune``, the hash sweep and ``roc fit``: no lost work.

A sweep is a plan of training runs below one output folder, locked for the whole sweep
(:func:`~rankwise.training.lock.lock_run_dir`). A run whose stored ``config.yaml`` differs from
the planned one (device and workers aside) is refused before anything is written; an unchanged
run is kept when completed, resumed from ``checkpoints/last.pt`` when interrupted; result files
are replaced atomically; an interruption says what is kept and how to resume. No paper
equation is implemented here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from .._disk import atomic_write
from .._signals import signal_label, signal_number_of
from ..training.checkpoint import atomic_write_text
from ..training.config import Config, ConfigError, config_from_dict, read_config_file
from ..training.errors import TrainingInterrupted
from ..training.rundir import existing_results
from ..training.trainer import RunResult, Trainer

__all__ = [
    "MAY_CHANGE",
    "check_planned_configs",
    "check_stored_config",
    "run_or_resume",
    "stored_config_differences",
    "sweep_interrupted",
    "sweep_settings",
    "write_json",
    "write_npz",
]

# settings that may change between an interrupted sweep and its resumption
MAY_CHANGE = ("device", "num_workers")
Kept = TypeVar("Kept")


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
    saved_path = run_dir / "config.yaml"
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


def run_or_resume(
    config: Config,
    build: Callable[..., Trainer],
    *,
    resume: bool,
    kept: Callable[[], Kept | None] | None = None,
    test: bool = True,
) -> tuple[RunResult | Kept, str]:
    """Train one run of a sweep, resume it from its checkpoint, or keep its stored result.

    Args:
        config: the planned run's config.
        build: ``build(overwrite=..., resume=...)`` -> the run's trainer.
        resume: continue an interrupted sweep: a completed run is kept, an interrupted one
            continues from ``checkpoints/last.pt``, the others start afresh.
        kept: the stored result of the run when it completed (``None``: not completed).
        test: test the selected model (``tune`` does not).

    Returns:
        ``(result, how)``: how is ``"trained"``, ``"resumed"`` or ``"kept"``.

    Raises:
        ConfigError: the run directory holds a run made with another config.
    """
    run_dir = config.resolved_output_dir()
    if resume:
        if existing_results(run_dir):
            check_stored_config(config, run_dir)
        stored = kept() if kept is not None else None
        if stored is not None:
            return stored, "kept"
        if (run_dir / "checkpoints" / "last.pt").is_file():
            return build(resume=True).fit(test=test), "resumed"
    return build(overwrite=True).fit(test=test), "trained"


def write_json(data: Any, path: Path) -> None:
    """Replace ``path`` atomically by ``data`` as indented JSON (readers never see half a file)."""
    atomic_write_text(json.dumps(data, indent=2) + "\n", path)


def write_npz(path: Path, **arrays: Any) -> None:
    """Replace ``path`` atomically by an ``np.savez`` archive of ``arrays``."""
    atomic_write(path, lambda handle: np.savez(handle, **arrays))


def sweep_interrupted(
    kind: str,
    exc: KeyboardInterrupt,
    runs: Sequence[str],
    finished: int,
    output: Path,
    kept: str = "their rows are in bench.json and bench.md",
    again: str = "the same call with resume=True",
) -> TrainingInterrupted:
    """The interruption of a sweep: what is kept and that the sweep resumes.

    Args:
        kind: the sweep (``"bench"``, ``"tune"``, ``"hash train"``).
        exc: the interruption.
        runs: the planned runs' names, e.g. ``"soprc seed 0"``.
        finished: how many of them finished.
        output: the sweep directory.
        kept: where the finished runs' results are.
        again: the Python call that resumes.
    """
    signal_number = signal_number_of(exc)
    head = f"{kind} interrupted ({signal_label(signal_number)})"
    if isinstance(exc, TrainingInterrupted) and finished < len(runs):
        # the run's own message without its "training interrupted (Ctrl-C)" head: said once
        where = f" {exc.detail}" if exc.detail is not None else f": {exc.message}"
        message = f"{head} in run {runs[finished]}{where}; {_finished(finished, runs, kept)}"
        step, checkpoint = exc.step, exc.checkpoint_step
    else:
        message, step, checkpoint = f"{head}; {_finished(finished, runs, kept)}", 0, None
    return TrainingInterrupted(
        message,
        step,
        output,
        checkpoint,
        f"{again} (output={str(output)!r})",
        signal_number=signal_number,
    )


def _finished(finished: int, runs: Sequence[str], kept: str) -> str:
    """How many runs of a sweep finished, and where their results are (when there are some)."""
    if finished == 0:
        return "no run had finished" if len(runs) > 1 else "the run had not finished"
    return f"{finished} of {len(runs)} run{'s' if len(runs) > 1 else ''} finished ({kept})"
