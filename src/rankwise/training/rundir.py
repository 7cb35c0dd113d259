"""Run directories: file names (:class:`RunPaths`), results, finding runs, picking a checkpoint.

One rule protects finished work: a directory holding results (checkpoints, ``report.json``, a
non-empty ``metrics.jsonl``, the PR curve; not a ``config.yaml`` alone) is written into only when
the caller resumes or overwrites it. The sweep folders (``bench``, ``tune``, the hash sweep) apply
it to their runs in :mod:`rankwise.workflows.sweepdir`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import load_checkpoint
from .errors import ConfigError, CorruptCheckpointError

__all__ = [
    "RunPaths",
    "RUN_RESULT_FILES",
    "existing_results",
    "find_run_dirs",
    "never_checkpointed",
    "readable_checkpoint_step",
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
