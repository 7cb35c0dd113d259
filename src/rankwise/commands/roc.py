"""``rankwise roc fit``: learn a bilinear similarity for a target false positive rate.

Pointwise ROC optimization (Vogel, Bellet & Clémençon, ICML 2018) from the command line, by
:func:`rankwise.workflows.roc.fit_roc`: reads numpy / torch arrays, prints the table, shows
progress on stderr. Bad input ends with a one-line ``error:`` and exit code 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import typer

from ..data.base import DatasetNotFoundError
from ..workflows.roc import DATASETS, RocProgress, fit_roc
from .common import cli_errors, output_console
from .evaluate import load_array

__all__ = ["roc_app"]

roc_app = typer.Typer(
    name="roc",
    help="Pointwise ROC optimization: similarities learned for a target false positive rate.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_FLAGS = {
    **{
        name: "--" + name.replace("_", "-")
        for name in (
            "alpha tolerance negatives n_negative_samples max_iter learning_rate dataset method "
            "fpr pca center test_fraction n_train n_test output overwrite data_dir"
        ).split()
    },
    "n_threads": "--threads",
    "risk": "--method",
    "X": "--features",
    "y": "--labels",
    "y_test": "--test-labels",
    "X_test": "--test-features",
}


def _parse_levels(text: str) -> tuple[float, ...]:
    try:
        levels = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        levels = ()
    if not levels or any(not 0 < a < 1 for a in levels):
        raise ValueError(f"--fpr must be comma-separated numbers in (0, 1), got {text!r}.")
    return tuple(sorted(levels))


def _print_report(console: Any, report: dict[str, Any]) -> None:
    from rich.table import Table  # noqa: PLC0415 - deferred at CLI start-up

    levels = list(report["learned"]["tpr_at_fpr"])
    table = Table(show_header=True, header_style="bold", title="held-out pairs")
    table.add_column("similarity")
    for level in levels:
        table.add_column(f"TPR@FPR={level}", justify="right")
    table.add_column("ROC AUC", justify="right")
    for key, label in (("cosine", "cosine (input features)"), ("learned", report["method"])):
        row = report[key]
        table.add_row(
            label, *(f"{row['tpr_at_fpr'][lv]:.4f}" for lv in levels), f"{row['auc']:.4f}"
        )
    console.print(table)
    at = report["threshold"]
    console.print(
        f"learned threshold {at['value']:.6g}: FPR {at['train_fpr']:.4f} on training pairs "
        f"(alpha = {report['alpha']:g}), FPR {at['test_fpr']:.4f} and TPR {at['test_tpr']:.4f} "
        f"on held-out pairs; lambda = {report['lambda']:.4g}",
        soft_wrap=True,
    )


class _Progress(RocProgress):
    """``roc fit``'s progress on stderr: a line per stage; iterations as a bar or timed lines."""

    def __init__(self, console: Any, line_every: float = 10.0) -> None:
        self.console = console
        self.line_every = line_every
        self.bar = bool(console.is_terminal) and sys.stderr.isatty()
        self._progress: Any = None
        self._task: Any = None
        self._start = self._last = time.perf_counter()

    def stage(self, text: str) -> None:
        self.console.print(f"roc fit: {text}", markup=False, highlight=False, soft_wrap=True)

    def iteration(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done == 1:
            self._start = self._last = now
            if self.bar:
                self._start_bar(total)
        if self._progress is not None:
            self._progress.update(self._task, completed=done)
            if done == total:
                self.close()
            return
        if done == total or now - self._last >= self.line_every:
            elapsed = now - self._start
            left = f", ~{elapsed / done * (total - done):.1f} s left" if done < total else ""
            self.stage(
                f"iteration {done}/{total} ({100 * done / total:.0f}%)  {elapsed:.1f} s "
                f"elapsed{left}"
            )
            self._last = now

    def _start_bar(self, total: int) -> None:
        from rich.progress import (  # noqa: PLC0415 - deferred at CLI start-up
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]roc fit: iterations"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
        )
        self._progress.start()
        self._task = self._progress.add_task("iterations", total=total)

    def close(self) -> None:
        """Stop a bar left running (an error in the middle of the fit)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


@roc_app.command("fit")
def fit(
    alpha: float = typer.Option(0.05, "--alpha", help="Target false positive rate α in (0, 1)."),
    dataset: str | None = typer.Option(
        None, "--dataset", help=f"A dataset's pixels as features: {', '.join(DATASETS)}."
    ),
    features: str | None = typer.Option(
        None, "--features", help="Training features (n, d): .npy, .npz (file:key), .pt."
    ),
    labels: str | None = typer.Option(None, "--labels", help="Training labels (n,)."),
    test_features: str | None = typer.Option(
        None, "--test-features", help="Held-out features (m, d), with --test-labels."
    ),
    test_labels: str | None = typer.Option(None, "--test-labels", help="Held-out labels (m,)."),
    method: str = typer.Option(
        "indicator",
        "--method",
        help="indicator: max TPR s.t. FPR ≤ α of the threshold (smoothed Lagrangian); "
        "closed-form: the paper's problem (6) on mean similarities (α must be feasible).",
    ),
    tolerance: float = typer.Option(0.0, "--tolerance", help="Φ of problem (6) (closed-form)."),
    fpr: str = typer.Option("0.001,0.01,0.05,0.1", "--fpr", help="FPR levels to report."),
    center: bool = typer.Option(False, "--center", help="Subtract the training mean first."),
    pca: float = typer.Option(
        0.0, "--pca", help="Keep this fraction of the variance with PCA (0: no PCA)."
    ),
    n_train: int | None = typer.Option(None, "--n-train", help="Subsample the training part."),
    n_test: int | None = typer.Option(2000, "--n-test", help="Subsample the held-out part."),
    test_fraction: float = typer.Option(
        0.5, "--test-fraction", help="digits: share held out (stratified)."
    ),
    negatives: str = typer.Option(
        "complete", "--negatives", help="complete, pairs or tuples (incomplete U-statistics)."
    ),
    n_negative_samples: int | None = typer.Option(
        None, "--n-negative-samples", help="B pairs or tuples for --negatives pairs / tuples."
    ),
    max_iter: int = typer.Option(500, "--max-iter", help="Primal-dual iterations (indicator)."),
    learning_rate: float = typer.Option(2e-3, "--learning-rate", help="Adam step (indicator)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the splits and samples."),
    threads: int = typer.Option(1, "--threads", help="BLAS / torch threads."),
    data_dir: str | None = typer.Option(None, "--data-dir", help="Dataset folder."),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Results folder (default runs/roc/<dataset>)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing results."),
) -> None:
    """Fit a bilinear similarity for FPR = α; print TPR@FPR on held-out pairs; plot the ROC."""
    with cli_errors("roc fit", _FLAGS, bad_input=(ValueError, FileNotFoundError)) as err:
        levels = _parse_levels(fpr)
        source = _source(dataset, features, labels, test_features, test_labels)
        progress = _Progress(err)
        try:
            run = fit_roc(
                source if dataset is not None else _arrays(features, labels, test_features,
                                                           test_labels),
                alpha=alpha, method=method, tolerance=tolerance, fpr=levels, center=center,
                pca=pca, n_train=n_train, n_test=n_test, test_fraction=test_fraction,
                negatives=negatives, n_negative_samples=n_negative_samples, max_iter=max_iter,
                learning_rate=learning_rate, seed=seed, threads=threads, data_dir=data_dir,
                name=source, output=output, overwrite=overwrite, progress=progress,
            )  # fmt: skip
        except DatasetNotFoundError as exc:  # several lines: where it looked, how to install it
            lines = (line.strip() for line in str(exc).splitlines())
            raise ValueError(" ".join(line for line in lines if line)) from None
        finally:
            progress.close()
    console = output_console()
    _print_report(console, run.report)
    written = ", ".join(str(run.paths[key]) for key in ("roc", "report", "model", "split"))
    console.print(f"wrote {written}", soft_wrap=True)


def _source(dataset, features, labels, test_features, test_labels) -> str:
    arrays = (features, labels, test_features, test_labels)
    if dataset is not None:
        if any(a is not None for a in arrays):
            raise ValueError("pass either --dataset or --features/--labels/--test-*, not both.")
        return dataset
    if any(a is None for a in arrays):
        raise ValueError(
            "pass --dataset NAME, or all of --features, --labels, --test-features and "
            "--test-labels."
        )
    return Path(str(features).split(":")[0]).stem


def _arrays(*files: str | None) -> tuple:
    """(X, y, X_test, y_test) from the files of the options (all given: _source checked)."""
    names = ("--features", "--labels", "--test-features", "--test-labels")
    return tuple(
        load_array(str(spec), name).numpy() for spec, name in zip(files, names, strict=True)
    )
