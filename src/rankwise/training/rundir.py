"""Run directories: file names (:class:`RunPaths`), results, finding runs, picking a checkpoint.

Sweep folders: file names (:class:`SweepPaths`), ``sweep.json``. One rule protects finished work
for ``train``, ``bench`` and ``tune``: a directory holding results (checkpoints, ``report.json``, a
non-empty ``metrics.jsonl``, the PR curve; not a ``config.yaml`` alone) is written into only when
the caller resumes or overwrites it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .checkpoint import atomic_write_text, load_checkpoint
from .errors import ConfigError, CorruptCheckpointError

__all__ = [
    "RunPaths",
    "RUN_RESULT_FILES",
    "SWEEP_FILE",
    "HashReportPaths",
    "SweepPaths",
    "check_sweep_dir",
    "existing_results",
    "find_run_dirs",
    "never_checkpointed",
    "prepare_sweep_dir",
    "read_sweep",
    "readable_checkpoint_step",
    "record_sweep",
    "remove_stale_temporaries",
    "resolve_run_dir",
]


@dataclass(frozen=True)
class RunPaths:
    """The files of a run directory, named once.

    Attributes:
        root: the run directory.
    """

    root: Path

    @property
    def config(self) -> Path:
        """``config.yaml``: the run's config (runs built from a config)."""
        return self.root / "config.yaml"

    @property
    def report(self) -> Path:
        """``report.json``: the :class:`RunResult` of a completed run."""
        return self.root / "report.json"

    @property
    def pr_curve(self) -> Path:
        """``pr_curve.json``: the test mean precision-recall curve."""
        return self.root / "pr_curve.json"

    @property
    def metrics(self) -> Path:
        """``metrics.jsonl``: one record per logged step and evaluation."""
        return self.root / "metrics.jsonl"

    @property
    def data(self) -> Path:
        """``data.json``: the fingerprint of the run's data (see :mod:`~rankwise.training.data_record`)."""
        return self.root / "data.json"

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``."""
        return self.root / "checkpoints"

    @property
    def last(self) -> Path:
        """``checkpoints/last.pt``: the state after the last checkpointed step."""
        return self.checkpoints / "last.pt"

    @property
    def previous(self) -> Path:
        """``checkpoints/previous.pt``: the good checkpoint ``last.pt`` replaced."""
        return self.checkpoints / "previous.pt"

    @property
    def best(self) -> Path:
        """``checkpoints/best.pt``: the model selected on validation."""
        return self.checkpoints / "best.pt"

    @property
    def training_curves_plot(self) -> Path:
        """``training_curves.png``."""
        return self.root / "training_curves.png"

    @property
    def pr_curve_plot(self) -> Path:
        """``pr_curve.png``."""
        return self.root / "pr_curve.png"

    @property
    def hash_result(self) -> Path:
        """``hash_result.json``: a hash sweep run's test result, beside its ``report.json``."""
        return self.root / "hash_result.json"

    @property
    def preflight(self) -> Path:
        """``preflight.json``: the fingerprint of the data files the pre-flight check passed."""
        return self.root / "preflight.json"

    def stale_outputs(self) -> tuple[Path, ...]:
        """What a fresh run deletes first: the checkpoints and outputs of an earlier run."""
        return (
            self.last,
            self.previous,
            self.best,
            self.report,
            self.pr_curve,
            self.pr_curve_plot,
            self.training_curves_plot,
        )


_NAMES = RunPaths(Path())
# files a training run writes, relative to its directory
RUN_RESULT_FILES: tuple[str, ...] = tuple(
    str(path)
    for path in (
        _NAMES.last,
        _NAMES.previous,
        _NAMES.best,
        _NAMES.report,
        _NAMES.metrics,
        _NAMES.pr_curve,
    )
)


def existing_results(directory: str | Path, files: Sequence[str] = RUN_RESULT_FILES) -> list[str]:
    """The result files ``directory`` already holds (relative paths; empty files do not count).

    Args:
        directory: a run (or sweep) directory.
        files: the relative paths that count as results.

    Returns:
        The ones present and non-empty, in the order of ``files``.
    """
    paths = [(name, Path(directory) / name) for name in files]
    return [name for name, path in paths if path.is_file() and path.stat().st_size > 0]


def never_checkpointed(path: str | Path) -> bool:
    """Whether a run started in ``path`` and stopped before its first checkpoint.

    It wrote its ``config.yaml`` (and ``checkpoints/`` or ``metrics.jsonl``) but no checkpoint
    and no result: e.g. it crashed or was killed in its first steps. Such a run resumes from
    step 0 with its config.

    Args:
        path: a folder.

    Returns:
        ``True`` for such a run; ``False`` for anything else (no run, or a run with a
        checkpoint or a result).
    """
    paths = RunPaths(Path(path))
    started = paths.config.is_file() and (paths.checkpoints.is_dir() or paths.metrics.is_file())
    written = (paths.last, paths.previous, paths.best, paths.report, paths.pr_curve)
    return started and not any(p.exists() for p in written)


def _is_run_dir(path: Path) -> bool:
    paths = RunPaths(path)
    checkpointed = paths.last.is_file() or paths.previous.is_file()
    return paths.config.is_file() and checkpointed or never_checkpointed(path)


def find_run_dirs(folder: str | Path, max_depth: int = 3) -> list[Path]:
    """The resumable run directories at or below ``folder``.

    ``config.yaml`` and a checkpoint, or a run that stopped before its first checkpoint
    (:func:`never_checkpointed`).

    Args:
        folder: where to look.
        max_depth: how many folder levels below ``folder`` to search.

    Returns:
        The run directories, sorted; ``[folder]`` when ``folder`` is one.
    """
    folder = Path(folder)
    if _is_run_dir(folder):
        return [folder]
    found: list[Path] = []
    level = [folder]
    for _ in range(max_depth):
        children = sorted(
            child for parent in level if parent.is_dir() for child in parent.iterdir()
        )
        level = [c for c in children if c.is_dir() and c.name != _NAMES.checkpoints.name]
        found += [c for c in level if _is_run_dir(c)]
        level = [c for c in level if not _is_run_dir(c)]
    return sorted(found)


def resolve_run_dir(path: str | Path) -> Path:
    """The run directory ``path`` names: itself, or the single run below it.

    Args:
        path: a run directory, or a folder holding exactly one (e.g. ``runs/digits`` holding
            ``runs/digits/auc-seed0``).

    Returns:
        The run directory.

    Raises:
        ConfigError: ``path`` does not exist, holds no run, or holds several (they are listed).
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"run_dir: {str(path)!r} does not exist.")
    runs = find_run_dirs(path)
    if len(runs) == 1:
        return runs[0]
    if not runs:
        raise ConfigError(
            f"run_dir: {str(path)!r} is not a run directory and holds none below it (a run "
            "directory has config.yaml and checkpoints/last.pt, or config.yaml and "
            "metrics.jsonl when it stopped before its first checkpoint)."
        )
    listing = "\n  ".join(str(r) for r in runs)
    raise ConfigError(
        f"run_dir: {str(path)!r} holds {len(runs)} runs; name the one to resume:\n  {listing}"
    )


def readable_checkpoint_step(path: str | Path) -> int | None:
    """The ``step`` of the checkpoint file ``path`` if it loads (``None``: missing or corrupt)."""
    try:
        state = load_checkpoint(path)
    except (FileNotFoundError, CorruptCheckpointError):
        return None
    step = state.get("step")
    return int(step) if step is not None else None


def remove_stale_temporaries(run_dir: str | Path) -> list[Path]:
    """Delete the temporary files of atomic writes that a killed run left in ``run_dir``.

    (``.NAME.XXXX.tmp`` of :mod:`rankwise.training.checkpoint`). Call only from the process
    that writes the run directory (rank 0 of a data-parallel run).

    Args:
        run_dir: a run directory.

    Returns:
        The files removed.
    """
    run_dir = Path(run_dir)
    removed = []
    for folder in (run_dir, RunPaths(run_dir).checkpoints):
        for path in sorted(folder.glob(".*.tmp")) if folder.is_dir() else ():
            if path.is_file():
                path.unlink(missing_ok=True)
                removed.append(path)
    return removed


# -- sweeps (bench, tune, the hash sweep) -----------------------------------------------------------

SWEEP_FILE = "sweep.json"


class HashReportPaths(NamedTuple):
    """The report files of a hash sweep under one prefix (``results``, ``evaluation``)."""

    json: Path
    table: Path
    tie_ranges: Path


@dataclass(frozen=True)
class SweepPaths:
    """The files and run folders of a sweep folder (``bench``, ``tune``, the hash sweep), named once.

    Attributes:
        root: the sweep folder.
    """

    root: Path

    @property
    def record(self) -> Path:
        """``sweep.json``: kind, settings and run folders of a ``bench`` / ``tune`` sweep."""
        return self.root / SWEEP_FILE

    @property
    def preflight(self) -> Path:
        """``preflight.json``: the fingerprint of the data files the sweep's pre-flight passed."""
        return self.root / "preflight.json"

    # bench
    @property
    def bench_json(self) -> Path:
        """``bench.json``: the rows of ``rankwise bench``."""
        return self.root / "bench.json"

    @property
    def bench_table(self) -> Path:
        """``bench.md``: the bench table in Markdown."""
        return self.root / "bench.md"

    @property
    def pr_curves_plot(self) -> Path:
        """``pr_curves.png``: every bench row's mean test PR curve."""
        return self.root / "pr_curves.png"

    def run(self, label: str, seed: int) -> Path:
        """``<label>/seed<seed>``: a bench run (a loss or an ablation row, one seed)."""
        return self.root / label / f"seed{seed}"

    def untrained(self, seed: int) -> Path:
        """``untrained/seed<seed>``: the untrained-network reference of a bench sweep."""
        return self.run("untrained", seed)

    # tune
    @property
    def tune_json(self) -> Path:
        """``tune.json``: the trials and winners of ``rankwise tune``."""
        return self.root / "tune.json"

    @property
    def tuned_config(self) -> Path:
        """``tuned.yaml``: the base config with the winners as ``bench.overrides``."""
        return self.root / "tuned.yaml"

    @property
    def trials(self) -> Path:
        """``trials/``: the folder of a tuning sweep's trials."""
        return self.root / "trials"

    def trial(self, index: int) -> Path:
        """``trials/trial<index>``: one grid point (its runs as a bench sweep below it)."""
        return self.trials / f"trial{index:03d}"

    # the hash sweep
    @property
    def hash_config(self) -> Path:
        """``hash_config.yaml``: the config and hash settings of a hash sweep."""
        return self.root / "hash_config.yaml"

    def hash_run(self, method: str, bits: int) -> Path:
        """``<method>/<bits>bits``: one (method, code length) run of a hash sweep."""
        return self.root / method / f"{bits}bits"

    def hash_report(self, prefix: str = "results") -> HashReportPaths:
        """``<prefix>.json``, ``<prefix>_table.md``, ``<prefix>_tie_ranges.png`` of a hash sweep."""
        return HashReportPaths(
            self.root / f"{prefix}.json",
            self.root / f"{prefix}_table.md",
            self.root / f"{prefix}_tie_ranges.png",
        )

    @property
    def hash_results(self) -> Path:
        """``results.json``: the test results of a hash sweep, rewritten after every run."""
        return self.hash_report().json


def _sweep_results(output: Path, files: Sequence[str]) -> list[str]:
    """What of a sweep's results ``output`` holds: its files and the run directories below it."""
    found = existing_results(output, (SWEEP_FILE, *files))
    if output.is_dir():
        runs = [p for p in output.rglob(_NAMES.config.name) if existing_results(p.parent)]
        if runs:
            found.append(f"{len(runs)} run director{'y' if len(runs) == 1 else 'ies'}")
    return found


def _remove_previous_sweep(output: Path, files: Sequence[str]) -> None:
    """Delete what the previous sweep in ``output`` wrote: its files and the runs it listed."""
    manifest = SweepPaths(output).record
    runs: list[str] = []
    if manifest.is_file():
        try:
            runs = list(json.loads(manifest.read_text()).get("runs", []))
        except (ValueError, AttributeError):
            runs = []
    root = output.resolve()
    for run in runs:
        path = Path(run).resolve()
        # only run directories inside the sweep's own folder, never anything else
        if root in path.parents and path.is_dir():
            shutil.rmtree(path)
            parent = path.parent  # and the folders left empty (e.g. output/<loss>)
            while parent != root and root in parent.parents and not any(parent.iterdir()):
                parent.rmdir()
                parent = parent.parent
    for name in (SWEEP_FILE, *files):
        (output / name).unlink(missing_ok=True)


def check_sweep_dir(
    output: str | Path,
    kind: str,
    settings: dict[str, Any],
    files: Sequence[str],
    *,
    resume: bool,
    overwrite: bool,
) -> None:
    """The results rule of a sweep's output directory, checked without writing anything.

    Results here are ``files``, a ``sweep.json`` or run directories with results below. Without
    ``resume`` / ``overwrite`` a directory with results is refused; ``resume`` needs a sweep of
    the same ``kind`` and ``settings`` there.

    Args:
        output: the sweep directory.
        kind: ``"bench"`` or ``"tune"``.
        settings: the plain-JSON settings that define the sweep.
        files: the sweep's own result files (e.g. ``bench.json``).
        resume: continue the sweep in ``output``.
        overwrite: the previous sweep's results are to be deleted.

    Raises:
        ConfigError: a directory with results without ``resume`` / ``overwrite``; both given; a
            ``resume`` of a directory without this sweep, or of one with other settings.
    """
    output = Path(output)
    if resume and overwrite:
        raise ConfigError(
            f"{kind}: `resume` continues the sweep and `overwrite` deletes its results; pass one."
        )
    if resume:
        saved = read_sweep(output, kind)
        if saved["settings"] != settings:
            raise ConfigError(
                f"output: the {kind} sweep in {str(output)!r} was started with other settings; "
                f"resume it with its own (those in its {SWEEP_FILE}) or start afresh with "
                "`overwrite`."
            )
    elif not overwrite:
        found = _sweep_results(output, files)
        if found:
            raise ConfigError(
                f"output: {str(output)!r} already holds results ({', '.join(found)}); continue "
                f"the {kind} sweep with `resume` or start afresh with `overwrite`, which deletes "
                "them (or choose another output)."
            )


def record_sweep(
    output: str | Path,
    kind: str,
    settings: dict[str, Any],
    runs: Sequence[str | Path],
    files: Sequence[str],
    *,
    overwrite: bool,
) -> None:
    """Record the sweep in ``output``'s ``sweep.json`` (``kind``, ``settings``, ``runs``).

    Call after :func:`check_sweep_dir`. ``overwrite`` first deletes the previous sweep's
    ``files`` and the runs its ``sweep.json`` lists.
    """
    output = Path(output)
    if overwrite:
        _remove_previous_sweep(output, files)
    output.mkdir(parents=True, exist_ok=True)
    record = {"kind": kind, "settings": settings, "runs": [str(r) for r in runs]}
    atomic_write_text(json.dumps(record, indent=2) + "\n", SweepPaths(output).record)


def prepare_sweep_dir(
    output: str | Path,
    kind: str,
    settings: dict[str, Any],
    runs: Sequence[str | Path],
    files: Sequence[str],
    *,
    resume: bool,
    overwrite: bool,
) -> None:
    """Apply the results rule to a sweep's output directory and record the sweep in it.

    :func:`check_sweep_dir`, then :func:`record_sweep` (arguments as there); the sweep engine
    (:func:`rankwise.workflows.sweep.run_sweep`) checks the stored run configs in between.

    Raises:
        ConfigError: as :func:`check_sweep_dir`.
    """
    check_sweep_dir(output, kind, settings, files, resume=resume, overwrite=overwrite)
    record_sweep(output, kind, settings, runs, files, overwrite=overwrite)


def read_sweep(output: str | Path, kind: str) -> dict[str, Any]:
    """The ``sweep.json`` of a ``kind`` sweep in ``output`` (what ``--resume`` reads).

    Args:
        output: the sweep directory.
        kind: ``"bench"`` or ``"tune"``.

    Returns:
        ``{"kind", "settings", "runs"}``.

    Raises:
        ConfigError: no such sweep there.
    """
    path = SweepPaths(Path(output)).record
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"output: {str(output)!r} holds no {kind} sweep to resume (no {SWEEP_FILE})."
        ) from None
    except ValueError:
        raise ConfigError(f"output: {path} is corrupt (not JSON); start afresh.") from None
    if not isinstance(record, dict) or record.get("kind") != kind:
        raise ConfigError(
            f"output: {str(output)!r} holds no {kind} sweep (its {SWEEP_FILE} is "
            f"of a {record.get('kind') if isinstance(record, dict) else '?'} one)."
        )
    return record
