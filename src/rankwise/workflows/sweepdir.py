"""Sweep folders (``bench``, ``tune``, the hash sweep): file names (:class:`SweepPaths`), ``sweep.json``.

The results rule of :mod:`rankwise.training.rundir`, applied to a sweep: a folder holding a sweep's
results (its files, ``sweep.json``, run directories with results below it) is written into only
when the caller resumes or overwrites it (:func:`check_sweep_dir`, then :func:`record_sweep`;
the sweep engine, :func:`rankwise.workflows.sweep.run_sweep`, checks the stored run configs in
between).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..training.checkpoint import atomic_write_text
from ..training.errors import ConfigError
from ..training.rundir import RunPaths, existing_results

__all__ = [
    "SWEEP_FILE",
    "HashReportPaths",
    "SweepPaths",
    "check_sweep_dir",
    "read_sweep",
    "record_sweep",
]

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
        runs = [p for p in output.rglob(RunPaths(output).config.name) if existing_results(p.parent)]
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
