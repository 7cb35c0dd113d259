"""Run directories: what counts as results, finding runs below a folder, picking a checkpoint.

One rule protects finished work for ``train``, ``bench`` and ``tune`` alike: a directory that
holds results is never written into unless the caller asked to resume it or to overwrite it.
"Results" are the files a run produces (checkpoints, ``report.json``, a non-empty
``metrics.jsonl``, the PR curve) — not a ``config.yaml`` alone, which a run writes before its
first step. This module also finds the run directories below a folder (``rankwise train --resume
runs/digits`` when the run is ``runs/digits/auc-seed0``) and chooses which checkpoint to resume
from when the newest is corrupt. No paper equation is implemented here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .errors import ConfigError, CorruptCheckpointError

__all__ = [
    "RUN_RESULT_FILES",
    "existing_results",
    "find_run_dirs",
    "readable_checkpoint_step",
    "resolve_run_dir",
]

# files a training run writes, relative to its directory
RUN_RESULT_FILES: tuple[str, ...] = (
    "checkpoints/last.pt",
    "checkpoints/previous.pt",
    "checkpoints/best.pt",
    "report.json",
    "metrics.jsonl",
    "pr_curve.json",
)


def existing_results(directory: str | Path, files: Sequence[str] = RUN_RESULT_FILES) -> list[str]:
    """The result files ``directory`` already holds (relative paths; empty files do not count).

    Args:
        directory: a run (or sweep) directory.
        files: the relative paths that count as results.

    Returns:
        The ones present and non-empty, in the order of ``files``.
    """
    directory = Path(directory)
    found = []
    for name in files:
        path = directory / name
        if path.is_file() and path.stat().st_size > 0:
            found.append(name)
    return found


def _is_run_dir(path: Path) -> bool:
    checkpoints = path / "checkpoints"
    return (path / "config.yaml").is_file() and (
        (checkpoints / "last.pt").is_file() or (checkpoints / "previous.pt").is_file()
    )


def find_run_dirs(folder: str | Path, max_depth: int = 3) -> list[Path]:
    """The resumable run directories at or below ``folder`` (``config.yaml`` + a checkpoint).

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
        level = [c for c in children if c.is_dir() and c.name != "checkpoints"]
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
            "directory has config.yaml and checkpoints/last.pt)."
        )
    listing = "\n  ".join(str(r) for r in runs)
    raise ConfigError(
        f"run_dir: {str(path)!r} holds {len(runs)} runs; name the one to resume:\n  {listing}"
    )


def readable_checkpoint_step(path: str | Path) -> int | None:
    """The step of a checkpoint that loads (``None``: missing or corrupt).

    Args:
        path: a checkpoint file.

    Returns:
        Its ``step``, or ``None``.
    """
    from .checkpoint import load_checkpoint

    try:
        state = load_checkpoint(path)
    except (FileNotFoundError, CorruptCheckpointError):
        return None
    step = state.get("step")
    return int(step) if step is not None else None
