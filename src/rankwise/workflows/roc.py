"""Fit and evaluate a bilinear similarity for a target false positive rate (``rankwise roc fit``).

Pointwise ROC optimization (Vogel, Bellet & Clémençon, ICML 2018): a verification system runs at a
fixed FPR α, so learn the similarity that maximizes the TPR there. :func:`fit_roc` fits
:class:`~rankwise.similarity_learning.BilinearSimilarity` on a dataset's pixels or feature arrays
and reports held-out TPRs next to cosine's; its run folder (docs/pointwise_roc.md, "rankwise roc
fit") follows the rules of :mod:`rankwise.workflows.sweep`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..data.registry import DATASETS as ALL_DATASETS
from ..data.registry import dataset_info, pixel_features, read_images
from ..data.splits import stratified_split
from ..metrics import roc_curve, tpr_at_fpr
from ..sampling.pairs import class_structure
from ..training.checkpoint import atomic_write_text
from ..training.lock import lock_run_dir
from .sweep import write_npz

__all__ = ["DATASETS", "METHODS", "RocFit", "RocProgress", "fit_roc"]

# the array datasets of grayscale images (their pixels are the features)
DATASETS = tuple(
    name
    for name in ALL_DATASETS
    if (info := dataset_info(name)).kind == "array" and (info.item_shape or (0,))[0] == 1
)
# method -> the risk of BilinearSimilarity
METHODS = {"indicator": "indicator", "closed-form": "mean"}
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class RocProgress:
    """What :func:`fit_roc` reports while it works; this one says nothing (the CLI's prints)."""

    def stage(self, text: str) -> None:
        """The step starting now (loading, fitting, evaluating, writing)."""

    def iteration(self, done: int, total: int) -> None:
        """After every iteration of the estimator (``done`` of ``total``)."""


@dataclass
class RocFit:
    """The outcome of :func:`fit_roc`.

    Attributes:
        report: the content of ``report.json`` (NaN / inf as in the fit, not yet ``null``).
        estimator: the fitted :class:`~rankwise.similarity_learning.BilinearSimilarity`.
        preprocessing: ``{"mean", "components"}`` applied before the L2 normalization.
        split: ``(train rows, test rows)`` of the source.
        paths: the written files by name (``roc``, ``report``, ``model``, ``split``).
    """

    report: dict[str, Any]
    estimator: Any
    preprocessing: dict[str, np.ndarray]
    split: tuple[np.ndarray, np.ndarray]
    paths: dict[str, Path]


def fit_roc(
    source: str | Arrays,
    *,
    alpha: float = 0.05,
    method: str = "indicator",
    tolerance: float = 0.0,
    fpr: Sequence[float] = (0.001, 0.01, 0.05, 0.1),
    center: bool = False,
    pca: float = 0.0,
    n_train: int | None = None,
    n_test: int | None = 2000,
    test_fraction: float = 0.5,
    negatives: str = "complete",
    n_negative_samples: int | None = None,
    max_iter: int = 500,
    learning_rate: float = 2e-3,
    seed: int = 0,
    threads: int = 1,
    data_dir: str | None = None,
    name: str | None = None,
    output: str | Path | None = None,
    overwrite: bool = False,
    progress: RocProgress | None = None,
) -> RocFit:
    """Fit a bilinear similarity for FPR = ``alpha``, evaluate it on held-out pairs, write the run.

    Args:
        source: one of :data:`DATASETS` (its pixels; ``digits`` is split here, stratified), or
            ``(X, y, X_test, y_test)`` feature arrays.
        alpha: the target false positive rate in (0, 1).
        method: ``indicator`` (max TPR s.t. FPR ≤ α of the threshold, smoothed Lagrangian) or
            ``closed-form`` (the paper's problem (6) on mean similarities).
        tolerance: Φ of problem (6) (closed-form).
        fpr: the FPR levels to report.
        center: subtract the training mean first.
        pca: keep this fraction of the variance with PCA (0: no PCA; needs scikit-learn).
        n_train: subsample the training part.
        n_test: subsample the held-out part.
        test_fraction: digits: the share held out.
        negatives: ``complete``, ``pairs`` or ``tuples`` (incomplete U-statistics).
        n_negative_samples: B pairs or tuples for ``pairs`` / ``tuples``.
        max_iter: primal-dual iterations (indicator).
        learning_rate: Adam step (indicator).
        seed: seed of the splits and samples.
        threads: BLAS / torch threads.
        data_dir: the dataset folder.
        name: the source's name in the report (default: the dataset, or ``"arrays"``).
        output: the run folder (default ``runs/roc/<name>``).
        overwrite: replace the results of a previous fit in ``output``.
        progress: receives the stages and iterations.

    Returns:
        The report, the estimator, the preprocessing, the split and the written paths.

    Raises:
        ValueError: a bad option or input (named by its argument in backticks).
        FileNotFoundError / DatasetNotFoundError: a missing dataset.
        RunDirInUseError: another process is writing ``output``.
    """
    progress = progress if progress is not None else RocProgress()
    options = dict(
        alpha=alpha, method=method, tolerance=tolerance, center=center, pca=pca,
        negatives=negatives, n_negative_samples=n_negative_samples, max_iter=max_iter,
        learning_rate=learning_rate, seed=seed, threads=threads,
    )  # fmt: skip
    levels = tuple(sorted(float(a) for a in fpr))
    if not levels or any(not 0 < a < 1 for a in levels):
        raise ValueError(f"`fpr` must be numbers in (0, 1), got {list(fpr)}.")
    if method not in METHODS:
        raise ValueError(f"`method` must be one of {', '.join(METHODS)}, got {method!r}.")
    if not 0 <= pca < 1:
        raise ValueError(f"`pca` must be a fraction of the variance in [0, 1), got {pca}.")
    if isinstance(source, str) and source not in DATASETS:
        raise ValueError(f"`dataset` must be one of {', '.join(DATASETS)}, got {source!r}.")
    name = name or (source if isinstance(source, str) else "arrays")
    output = Path(output) if output is not None else Path("runs") / "roc" / name
    paths = _outputs(output, overwrite)
    _estimator(options, progress)._check_params()  # bad options before any data is read
    progress.stage(f"loading {name}")
    data, split = _load(source, data_dir, test_fraction, n_train, n_test, seed)
    report, estimator, prep, curves = _fit_and_evaluate(data, levels, options, progress)
    report["source"] = name
    report["split"] = paths["split"].name
    progress.stage(f"writing {output}")
    with lock_run_dir(output, "output"):  # one writer of the run folder
        _outputs(output, overwrite)  # no fit wrote it in the meantime
        _write(paths, report, estimator, prep, curves, alpha)
        write_npz(paths["split"], train=split[0], test=split[1], seed=seed, source=name)
    return RocFit(report, estimator, prep, split, paths)


def _subsample(rows: np.ndarray, n: int | None, rng: np.random.Generator) -> np.ndarray:
    """``n`` of the row indices ``rows`` drawn without replacement (sorted), or all of them."""
    if n is None or n >= rows.size:
        return rows
    return rows[np.sort(rng.choice(rows.size, size=n, replace=False))]


def _dataset_features(
    name: str, data_dir: str | None, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train X, train y, test X, test y, train rows, test rows) of flattened pixels in [0, 1].

    The rows index ``split.npz``'s source: the 1,797 digits images, else the official sets.
    """
    train_x, train_y, test_x, test_y = read_images(name, data_dir)
    if test_x is None:  # digits: one part, split here
        X = pixel_features(train_x)
        train, test = stratified_split(train_y, test_fraction, seed)
        return X, train_y, X, train_y, train, test
    assert test_y is not None  # read_images gives both test parts or neither
    rows = lambda y: np.arange(y.shape[0])  # noqa: E731
    X, X_test = pixel_features(train_x), pixel_features(test_x)
    return X, train_y, X_test, test_y, rows(train_y), rows(test_y)


def _load(
    source: str | Arrays,
    data_dir: str | None,
    test_fraction: float,
    n_train: int | None,
    n_test: int | None,
    seed: int,
) -> tuple[Arrays, tuple[np.ndarray, np.ndarray]]:
    """((X, y, X_test, y_test), (train rows, test rows)): the data and the rows of the source."""
    rng = np.random.default_rng(seed)
    if isinstance(source, str):
        if not 0 < test_fraction < 1:
            raise ValueError(f"`test_fraction` must be in (0, 1), got {test_fraction}.")
        X, y, X_test, y_test, train, test = _dataset_features(source, data_dir, test_fraction, seed)
    else:
        X, y = _checked_arrays(source[0], source[1], "X", "y")
        X_test, y_test = _checked_arrays(source[2], source[3], "X_test", "y_test")
        if X_test.shape[1] != X.shape[1]:
            raise ValueError(f"`X_test` has {X_test.shape[1]} columns but `X` has {X.shape[1]}.")
        train, test = np.arange(y.shape[0]), np.arange(y_test.shape[0])
    for key, value in (("n_train", n_train), ("n_test", n_test)):
        if value is not None and value < 2:
            raise ValueError(f"`{key}` must be at least 2, got {value}.")
    train, test = _subsample(train, n_train, rng), _subsample(test, n_test, rng)
    return (X[train], y[train], X_test[test], y_test[test]), (train, test)


def _checked_arrays(
    X: np.ndarray, y: np.ndarray, x_name: str, y_name: str
) -> tuple[np.ndarray, np.ndarray]:
    """Float features ``(n, d)`` and ``n`` integer class ids of two classes or more."""
    X, y = np.asarray(X, dtype=np.float64), np.asarray(y)
    if X.ndim != 2:
        raise ValueError(f"`{x_name}` must be a 2-D (n, d) array, got shape {X.shape}.")
    if y.ndim != 1:
        raise ValueError(
            f"`{y_name}` must be 1-D (one class id per row of `{x_name}`), got shape {y.shape}; "
            "pass labels.ravel()."
        )
    if y.shape[0] != X.shape[0]:
        raise ValueError(
            f"`{y_name}` has {y.shape[0]} entries but `{x_name}` has {X.shape[0]} rows; pass one "
            "label per row."
        )
    class_structure(y, y_name)
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
    for part_name, part in (("training", train), ("test", test)):
        if (np.linalg.norm(part, axis=1) == 0).any():
            raise ValueError(
                f"a {part_name} sample has an all-zero feature vector after preprocessing; it has "
                "no direction to normalize (drop it, or do not use `center`)."
            )
    unit = lambda Z: Z / np.linalg.norm(Z, axis=1, keepdims=True)  # noqa: E731
    return unit(train), unit(test), {"mean": mean, "components": components}


def _test_pairs(y: np.ndarray, max_pairs: int) -> tuple[np.ndarray, np.ndarray]:
    n = y.size
    if n * (n - 1) // 2 > max_pairs:
        raise ValueError(
            f"the test part has {n * (n - 1) // 2:,} pairs, more than {max_pairs:,}; lower "
            "`n_test`."
        )
    return np.triu_indices(n, 1)


def _rates(scores: np.ndarray, same: np.ndarray, levels: tuple[float, ...]) -> dict[str, Any]:
    curve = roc_curve(scores, same)
    return {
        "curve": curve,
        "tpr_at_fpr": {f"{a:g}": float(tpr_at_fpr(scores, same, a)) for a in levels},
        "auc": curve.auc,
    }


def _outputs(output: Path, overwrite: bool) -> dict[str, Path]:
    paths = {name: output / f"{name}.{ext}" for name, ext in (("roc", "png"), ("report", "json"))}
    paths["model"] = output / "bilinear.npz"
    paths["split"] = output / "split.npz"
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing and not overwrite:
        raise ValueError(
            f"{existing[0]} exists; pass `overwrite` to replace the previous results or choose "
            "another `output`."
        )
    return paths


def _estimator(options: dict[str, Any], progress: RocProgress) -> Any:
    from ..similarity_learning import BilinearSimilarity  # noqa: PLC0415 - extra (scikit-learn)

    same = ("tolerance", "negatives", "n_negative_samples", "max_iter", "learning_rate")
    return BilinearSimilarity(
        options["alpha"],
        risk=METHODS[options["method"]],
        random_state=options["seed"],
        n_threads=options["threads"],
        callback=progress.iteration,
        **{key: options[key] for key in same},
    )


def _fit_and_evaluate(
    data: Arrays, levels: tuple[float, ...], options: dict[str, Any], progress: RocProgress
) -> tuple[dict[str, Any], Any, dict[str, Any], dict[str, Any]]:
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
    return report, model, prep, curves


def _write(
    paths: dict[str, Path],
    report: dict[str, Any],
    estimator: Any,
    prep: dict[str, Any],
    curves: dict[str, Any],
    alpha: float,
) -> None:
    from ..plots import plot_roc_curves  # noqa: PLC0415 - optional extra (matplotlib)

    paths["report"].parent.mkdir(parents=True, exist_ok=True)
    plot_roc_curves(
        curves, paths["roc"], title=f"held-out pairs, bilinear similarity for FPR = {alpha:g}"
    )
    text = json.dumps(_finite(report), indent=2, default=_json_default, allow_nan=False)
    atomic_write_text(text + "\n", paths["report"])
    write_npz(
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
