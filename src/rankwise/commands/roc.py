"""``rankwise roc fit``: learn a bilinear similarity for a target false positive rate.

Pointwise ROC optimization (Vogel, Bellet & Clémençon, ICML 2018): a verification system runs at a
fixed FPR α, so learn the similarity that maximizes the TPR there. The command reads a dataset's
features (a bundled / installed dataset, or arrays saved with numpy / torch), preprocesses them
(optional centring and PCA, then L2 normalization), fits
:class:`~rankwise.models.BilinearSimilarity` on the training part and reports, on the pairs of the
held-out part, the TPR at a few FPR levels next to the cosine similarity of the same features, the
FPR and TPR of the learned threshold, and writes the ROC curves (PNG), a JSON report, the
learned model (``.npz``) and the split (``split.npz``: the rows of the source used for training and
for testing, and the seed), from which every reported number can be recomputed. Progress goes to
stderr (a bar in a terminal, a few lines otherwise). Bad input ends with a one-line ``error:`` and
exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import typer

from ..data.base import DatasetNotFoundError
from ..data.registry import DATASETS as ALL_DATASETS
from ..data.registry import dataset_info, pixel_features, read_images
from ..data.splits import stratified_split
from ..sampling.pairs import class_structure
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

# the array datasets of grayscale images (their pixels are the features)
DATASETS = tuple(
    name
    for name in ALL_DATASETS
    if (info := dataset_info(name)).kind == "array" and info.item_shape[0] == 1
)
METHODS = {"indicator": "indicator", "closed-form": "mean"}
_FLAGS = {
    "alpha": "--alpha",
    "tolerance": "--tolerance",
    "negatives": "--negatives",
    "n_negative_samples": "--n-negative-samples",
    "max_iter": "--max-iter",
    "n_threads": "--threads",
    "learning_rate": "--learning-rate",
    "risk": "--method",
    "X": "--features",
    "y": "--labels",
    "test_labels": "--test-labels",
}


# -- data ------------------------------------------------------------------------------------------
def _subsample(rows: np.ndarray, n: int | None, rng: np.random.Generator) -> np.ndarray:
    """``n`` of the row indices ``rows`` drawn without replacement (sorted), or all of them."""
    if n is None or n >= rows.size:
        return rows
    return rows[np.sort(rng.choice(rows.size, size=n, replace=False))]


def _dataset_features(
    name: str, data_dir: str | None, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train X, train y, test X, test y, train rows, test rows) of flattened pixels in [0, 1].

    The rows index the source the command names in ``split.npz``: the 1,797 digits images for
    ``digits`` (both parts), the official training and test sets otherwise.
    """
    train_x, train_y, test_x, test_y = read_images(name, data_dir)
    if test_x is None:  # digits: one part, split here
        X = pixel_features(train_x)
        train, test = stratified_split(train_y, test_fraction, seed)
        return X, train_y, X, train_y, train, test
    rows = lambda y: np.arange(y.shape[0])  # noqa: E731
    X, X_test = pixel_features(train_x), pixel_features(test_x)
    return X, train_y, X_test, test_y, rows(train_y), rows(test_y)


def _array_features(
    spec: str, labels: str, flag: str, labels_flag: str, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """Features and labels from files, the labels checked here so that errors name the options."""
    X = load_array(spec, flag).numpy().astype(np.float64)
    y = load_array(labels, labels_flag).numpy()
    if X.ndim != 2:
        raise ValueError(f"{flag}: features must be a 2-D (n, d) array, got shape {X.shape}.")
    if y.ndim != 1:
        raise ValueError(
            f"{labels_flag} must be 1-D (one class id per row of {flag}), got shape {y.shape}; "
            "save labels.ravel()."
        )
    if y.shape[0] != X.shape[0]:
        raise ValueError(
            f"{labels_flag} has {y.shape[0]} entries but {flag} has {X.shape[0]} rows; pass one "
            "label per row."
        )
    class_structure(y, name)  # integer class ids of two classes or more, named by option
    return X, y


def _preprocess(
    train: np.ndarray, test: np.ndarray, center: bool, pca: float
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Centre (train mean), project on the PCA keeping ``pca`` of the variance, L2-normalize."""
    mean = train.mean(0) if center or pca > 0 else np.zeros(train.shape[1])
    train, test = train - mean, test - mean
    components = np.eye(train.shape[1])
    if pca > 0:
        from sklearn.decomposition import PCA  # noqa: PLC0415 - optional extra (scikit-learn)

        model = PCA(n_components=pca, svd_solver="full").fit(train)
        components = model.components_
        train, test = train @ components.T, test @ components.T
    for name, part in (("training", train), ("test", test)):
        if (np.linalg.norm(part, axis=1) == 0).any():
            raise ValueError(
                f"a {name} sample has an all-zero feature vector after preprocessing; it has no "
                "direction to normalize (drop it, or do not use --center)."
            )
    unit = lambda Z: Z / np.linalg.norm(Z, axis=1, keepdims=True)  # noqa: E731
    return unit(train), unit(test), {"mean": mean, "components": components}


# -- evaluation ------------------------------------------------------------------------------------
def _test_pairs(y: np.ndarray, max_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    n = y.size
    if n * (n - 1) // 2 > max_pairs:
        raise ValueError(
            f"the test part has {n * (n - 1) // 2:,} pairs, more than {max_pairs:,}; lower "
            "`n_test` (--n-test)."
        )
    return np.triu_indices(n, 1)


def _rates(scores: np.ndarray, same: np.ndarray, levels: tuple[float, ...]) -> dict[str, Any]:
    from ..metrics import roc_curve, tpr_at_fpr  # noqa: PLC0415 - deferred (numba) at CLI start

    curve = roc_curve(scores, same)
    return {
        "curve": curve,
        "tpr_at_fpr": {f"{a:g}": float(tpr_at_fpr(scores, same, a)) for a in levels},
        "auc": curve.auc,
    }


def _parse_levels(text: str) -> tuple[float, ...]:
    try:
        levels = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        levels = ()
    if not levels or any(not 0 < a < 1 for a in levels):
        raise ValueError(f"--fpr must be comma-separated numbers in (0, 1), got {text!r}.")
    return tuple(sorted(levels))


def _outputs(output: Path, overwrite: bool) -> dict[str, Path]:
    paths = {name: output / f"{name}.{ext}" for name, ext in (("roc", "png"), ("report", "json"))}
    paths["model"] = output / "bilinear.npz"
    paths["split"] = output / "split.npz"
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not overwrite:
        raise ValueError(
            f"{existing[0]} exists; pass --overwrite to replace the previous results or choose "
            "another --output."
        )
    return paths


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


# -- progress ---------------------------------------------------------------------------------------
class _Progress:
    """The stages of ``roc fit`` on stderr: a bar for the iterations in a terminal, lines otherwise.

    Every stage is one line (``roc fit: fitting ...``); the primal-dual iterations of the indicator
    risk are a rich bar in a terminal and, in a log or a pipe, a line at most every ``line_every``
    seconds and at the last iteration, as ``rankwise train`` shows its steps.
    """

    def __init__(self, console: Any, line_every: float = 10.0) -> None:
        self.console = console
        self.line_every = line_every
        self.bar = bool(console.is_terminal) and sys.stderr.isatty()
        self._progress: Any = None
        self._task: Any = None
        self._start = self._last = time.perf_counter()

    def stage(self, text: str) -> None:
        """One line naming what the command does now."""
        self.console.print(f"roc fit: {text}", markup=False, highlight=False, soft_wrap=True)

    def iteration(self, done: int, total: int) -> None:
        """Called by the estimator after every iteration (``done`` of ``total``)."""
        now = time.perf_counter()
        if done == 1:
            self._start = self._last = now
            if self.bar:
                self._start_bar(total)
        if self._progress is not None:
            self._progress.update(self._task, completed=done)
            if done == total:
                self._progress.stop()
                self._progress = None
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


# -- the command -----------------------------------------------------------------------------------
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
        options = dict(
            alpha=alpha, method=method, tolerance=tolerance, center=center, pca=pca,
            negatives=negatives, n_negative_samples=n_negative_samples, max_iter=max_iter,
            learning_rate=learning_rate, seed=seed, threads=threads,
        )  # fmt: skip
        levels = _parse_levels(fpr)
        if method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}.")
        if not 0 <= pca < 1:
            raise ValueError(f"--pca must be a fraction of the variance in [0, 1), got {pca}.")
        source = _source(dataset, features, labels, test_features, test_labels)
        output = output if output is not None else Path("runs") / "roc" / source
        paths = _outputs(output, overwrite)
        progress = _Progress(err)
        _estimator(options, progress)._check_params()  # bad options before any data is read
        try:
            progress.stage(f"loading {source}")
            data, split = _load(dataset, features, labels, test_features, test_labels, data_dir,
                                test_fraction, n_train, n_test, seed)  # fmt: skip
            report, model, curves = _fit_and_evaluate(data, levels, options, progress)
        finally:
            progress.close()
        report["source"] = source
        report["split"] = paths["split"].name
        progress.stage(f"writing {output}")
        _write(paths, report, model, curves, alpha)
        np.savez(paths["split"], train=split[0], test=split[1], seed=seed, source=source)
    console = output_console()
    _print_report(console, report)
    written = ", ".join(str(paths[key]) for key in ("roc", "report", "model", "split"))
    console.print(f"wrote {written}", soft_wrap=True)


def _source(dataset, features, labels, test_features, test_labels) -> str:
    arrays = (features, labels, test_features, test_labels)
    if dataset is not None:
        if any(a is not None for a in arrays):
            raise ValueError("pass either --dataset or --features/--labels/--test-*, not both.")
        if dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {dataset!r}.")
        return dataset
    if any(a is None for a in arrays):
        raise ValueError(
            "pass --dataset NAME, or all of --features, --labels, --test-features and "
            "--test-labels."
        )
    return Path(str(features).split(":")[0]).stem


def _load(dataset, features, labels, test_features, test_labels, data_dir, test_fraction,
          n_train, n_test, seed):  # fmt: skip
    """((X, y, X_test, y_test), (train rows, test rows)): the data and the rows of the source."""
    rng = np.random.default_rng(seed)
    if dataset is not None:
        if not 0 < test_fraction < 1:
            raise ValueError(f"--test-fraction must be in (0, 1), got {test_fraction}.")
        try:
            X, y, X_test, y_test, train, test = _dataset_features(
                dataset, data_dir, test_fraction, seed
            )
        except DatasetNotFoundError as exc:  # several lines: where it looked, how to install it
            lines = (line.strip() for line in str(exc).splitlines())
            raise ValueError(" ".join(line for line in lines if line)) from None
    else:
        X, y = _array_features(features, labels, "--features", "--labels", "y")
        X_test, y_test = _array_features(
            test_features, test_labels, "--test-features", "--test-labels", "test_labels"
        )
        if X_test.shape[1] != X.shape[1]:
            raise ValueError(
                f"--test-features has {X_test.shape[1]} columns but --features has {X.shape[1]}."
            )
        train, test = np.arange(y.shape[0]), np.arange(y_test.shape[0])
    for flag, value in (("--n-train", n_train), ("--n-test", n_test)):
        if value is not None and value < 2:
            raise ValueError(f"{flag} must be at least 2, got {value}.")
    train, test = _subsample(train, n_train, rng), _subsample(test, n_test, rng)
    return (X[train], y[train], X_test[test], y_test[test]), (train, test)


def _estimator(options: dict[str, Any], progress: _Progress) -> Any:
    from ..similarity_learning import BilinearSimilarity  # noqa: PLC0415 - extra (scikit-learn)

    return BilinearSimilarity(
        options["alpha"],
        risk=METHODS[options["method"]],
        tolerance=options["tolerance"],
        negatives=options["negatives"],
        n_negative_samples=options["n_negative_samples"],
        max_iter=options["max_iter"],
        learning_rate=options["learning_rate"],
        random_state=options["seed"],
        n_threads=options["threads"],
        callback=progress.iteration,
    )


def _fit_and_evaluate(
    data, levels, options, progress: _Progress
) -> tuple[dict[str, Any], Any, dict[str, Any]]:

    X, y, X_test, y_test = data
    if options["center"] or options["pca"] > 0:
        progress.stage("preprocessing (centring / PCA)")
    train, test, prep = _preprocess(X, X_test, options["center"], options["pca"])
    what = (
        f"indicator, {options['max_iter']} primal-dual iterations"
        if options["method"] == "indicator"
        else "closed form"
    )
    progress.stage(f"fitting the bilinear similarity on {y.size:,} training samples ({what})")
    model = _estimator(options, progress).fit(train, y)
    i, j = _test_pairs(np.asarray(y_test), 20_000_000)
    progress.stage(f"evaluating {i.size:,} held-out pairs")
    same = np.asarray(y_test)[i] == np.asarray(y_test)[j]
    if same.all() or not same.any():
        raise ValueError("the held-out labels give no positive or no negative pair.")
    learned_scores = model.pair_score(test[i], test[j])
    cosine = _rates((test[i] * test[j]).sum(1), same, levels)
    learned = _rates(learned_scores, same, levels)
    accepted = learned_scores >= model.threshold_
    report = {
        "alpha": options["alpha"],
        "method": f"bilinear, {options['method']}",
        "options": options,
        "n_train": int(y.size),
        "n_test": int(np.asarray(y_test).size),
        "n_features": int(train.shape[1]),
        "n_test_pairs": int(same.size),
        "lambda": float(model.lambda_),
        "train_positive_risk": float(model.positive_risk_),
        "train_negative_risk": float(model.negative_risk_),
        "min_negative_risk": float(model.min_negative_risk_),
        "threshold": {
            "value": float(model.threshold_),
            "train_fpr": float(model.threshold_fpr_),
            "test_fpr": float(accepted[~same].mean()),
            "test_tpr": float(accepted[same].mean()),
        },
        "cosine": {k: v for k, v in cosine.items() if k != "curve"},
        "learned": {k: v for k, v in learned.items() if k != "curve"},
    }
    curves = {"cosine": cosine["curve"], report["method"]: learned["curve"]}
    return report, (model, prep), curves


def _write(paths: dict[str, Path], report: dict, model: Any, curves: dict, alpha: float) -> None:
    from ..plots import plot_roc_curves  # noqa: PLC0415 - optional extra (matplotlib)

    estimator, prep = model
    paths["report"].parent.mkdir(parents=True, exist_ok=True)
    plot_roc_curves(
        curves, paths["roc"], title=f"held-out pairs, bilinear similarity for FPR = {alpha:g}"
    )
    text = json.dumps(_finite(report), indent=2, default=_json_default, allow_nan=False)
    paths["report"].write_text(text + "\n")
    np.savez(
        paths["model"],
        A=estimator.A_,
        threshold=estimator.threshold_,
        mean=prep["mean"],
        components=prep["components"],
    )


def _finite(value: Any) -> Any:
    """The report with NaN and ±inf (λ = inf at the feasibility floor) as JSON null."""
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        return None
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
