"""``mmc-subsampling``: MMC trained on incomplete U-statistics (Vogel et al., Sec. 5.3, Fig. 4).

Vogel, Bellet and Clémençon, *A Probabilistic Theory of Supervised Similarity Learning for Pointwise
ROC Curve Optimization* (ICML 2018), Sec. 4 and 5.3: the negative term of MMC (Xing et al. 2002),
a mean over all n⁻ negative pairs, is replaced by an incomplete U-statistic of B K-tuples (one
sample per class, pairs weighted n_k n_l / n⁻), B·K(K−1)/2 pairs instead of n⁻ ≈ n²(K−1)/(2K). Thm. 3
says B = O(n) keeps the learning rate; Fig. 4 shows the test objective and constraint for several
n and B, averaged over 5 runs.

Here on Fashion-MNIST by default (the paper's MNIST where installed), with the paper's PCA to 90 %
of the variance: for every n and budget B = f·n the :class:`~rankwise.models.MMC` solution is scored
on the test pairs (objective, constraint, fit time), beside metric-learn's ``MMC_Supervised`` run in
an interpreter that has it (:func:`find_metric_learn`; skipped otherwise, the reason kept).
Settings and results: docs/pointwise_roc.md.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from .._validation import Interval, check_choice, check_scalar
from .base import ExperimentResult, experiment, new_figure, parse_sequence, progress

__all__ = ["METRIC_LEARN_ENV", "find_metric_learn", "load_pca_features", "run"]

METRIC_LEARN_ENV = "RANKWISE_METRIC_LEARN_PYTHON"
_RUNNER = Path(__file__).with_name("_metric_learn_runner.py")
# the budget whose pair count the matched metric-learn run uses (B = 0.15 n, as in the paper)
_MATCHED_FRACTION = 0.15
_ML_RUNS = ("default", "matched")


# -- data ------------------------------------------------------------------------------------------
def load_pca_features(
    dataset: str, data_dir: str | None, variance: float, pca_fit_size: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
    """Pixels in [0, 1] projected on the principal components keeping ``variance`` of it.

    The PCA is fitted on the official training images (all of them, or ``pca_fit_size`` drawn at
    random) and applied to both splits.
    """
    from sklearn.decomposition import PCA  # noqa: PLC0415 - optional extra (scikit-learn)

    from ..data.registry import pixel_features, read_images  # noqa: PLC0415 - deferred: the CLI imports every experiment module

    train_x, train_y, test_x, test_y = read_images(dataset, data_dir)
    assert test_x is not None and test_y is not None  # mnist and fashion-mnist have one
    X, X_test = pixel_features(train_x), pixel_features(test_x)
    rng = np.random.default_rng(seed)
    fit_rows = (
        np.arange(X.shape[0])
        if pca_fit_size is None or pca_fit_size >= X.shape[0]
        else rng.choice(X.shape[0], pca_fit_size, replace=False)
    )
    pca = PCA(n_components=variance, svd_solver="full").fit(X[fit_rows])
    info = {
        "n_components": int(pca.n_components_),
        "explained_variance": float(pca.explained_variance_ratio_.sum()),
        "pca_fit_size": int(fit_rows.size),
    }
    return pca.transform(X), train_y, pca.transform(X_test), test_y, info


# -- metric-learn ----------------------------------------------------------------------------------
def find_metric_learn(python: str | None) -> tuple[str | None, str]:
    """The interpreter to run metric-learn with, or None and the reason it is skipped.

    Order: ``python`` (an explicit path), ``$RANKWISE_METRIC_LEARN_PYTHON``, this interpreter.
    An interpreter qualifies when it imports metric_learn and a scikit-learn older than 1.8.
    """
    candidates = [c for c in (python, os.environ.get(METRIC_LEARN_ENV)) if c] or [sys.executable]
    candidate = candidates[0]
    if not Path(candidate).exists():
        raise ValueError(f"`metric_learn_python` {candidate!r} does not exist.")
    probe = (
        "import metric_learn, sklearn; v = tuple(int(p) for p in sklearn.__version__.split('.')[:2]);"
        "print(metric_learn.__version__, sklearn.__version__, v < (1, 8))"
    )
    done = subprocess.run(
        [candidate, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{candidate} cannot import metric_learn ({last})"
    version, sklearn_version, supported = done.stdout.split()
    if supported != "True":
        return None, (
            f"{candidate} has metric-learn {version} with scikit-learn {sklearn_version}, which "
            "metric-learn 0.7.0 does not support (it needs scikit-learn <= 1.7); install it in a "
            f"separate virtual environment and set ${METRIC_LEARN_ENV}"
        )
    return candidate, f"metric-learn {version}, scikit-learn {sklearn_version} ({candidate})"


def _run_metric_learn(
    python: str, X: np.ndarray, y: np.ndarray, n_constraints: int, seed: int, max_iter: int
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rankwise-metric-learn-") as tmp:
        source, target = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        np.savez(source, X=X, y=y, n_constraints=n_constraints, seed=seed, max_iter=max_iter)
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        env["MKL_NUM_THREADS"] = "1"  # one BLAS thread, as the rankwise fits
        done = subprocess.run(
            [python, str(_RUNNER), str(source), str(target)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"metric-learn failed: {last}")
        with np.load(target) as out:
            return {
                "A": out["A"],
                "seconds": float(out["seconds"]),
                "converged": bool(out["converged"]),
                "n_constraints": int(out["n_constraints"]),
            }


# -- one run ---------------------------------------------------------------------------------------
def _score(A: np.ndarray, X: np.ndarray, y: np.ndarray, test: tuple) -> dict[str, float]:
    """Rescale A to meet the training constraint exactly; score it on the test set."""
    from ..similarity_learning.mmc import mmc_objective, positive_scatter  # noqa: PLC0415 - extra

    train_constraint = float((positive_scatter(X, y) * A).sum())
    A = A / train_constraint if train_constraint > 0 else A
    objective, constraint = mmc_objective(test[0], test[1], A)
    return {
        "train_constraint_before_rescaling": train_constraint,
        "test_objective": objective,
        "test_constraint": constraint,
        "test_scale_free": objective / math.sqrt(constraint),
    }


def _fit_ours(X, y, negatives, budget, seed, max_iter, tol) -> tuple[Any, float]:
    from ..similarity_learning import MMC  # noqa: PLC0415 - optional extra (scikit-learn)

    model = MMC(
        negatives=negatives,
        n_negative_samples=budget,
        max_iter=max_iter,
        tol=tol,
        max_pairs=10**12,
        random_state=seed,
        n_threads=1,
    )
    start = time.perf_counter()
    model.fit(X, y)
    return model, time.perf_counter() - start


def _size_runs(n, repeat, data, test, options, ml_python) -> list[dict[str, Any]]:
    """Every method on one training subset of size n."""
    X_all, y_all = data
    seed = options["seed"] * 1000 + repeat
    rng = np.random.default_rng(seed)
    rows_idx = rng.choice(y_all.size, size=n, replace=False)
    X, y = X_all[rows_idx], y_all[rows_idx]
    counts = np.bincount(y)
    n_negative = (n * n - int((counts * counts).sum())) // 2
    k = int((counts > 0).sum())
    runs = []
    methods = [
        (f"tuples B={f:g}n", options["sampling"], max(1, math.ceil(f * n)), f)
        for f in options["budgets"]
    ]
    if n_negative <= options["complete_max_pairs"]:
        methods.append(("complete", "complete", None, None))
    for name, negatives, budget, fraction in methods:
        model, seconds = _fit_ours(
            X, y, negatives, budget, seed, options["max_iter"], options["tol"]
        )
        runs.append(
            {
                "method": name if negatives != "pairs" else name.replace("tuples", "pairs"),
                "budget_fraction": fraction,
                "n_negative_pairs_used": model.n_negative_pairs_,
                "n_iter": model.n_iter_,
                "converged": model.converged_,
                "train_objective": model.objective_,
                "seconds": seconds,
                **_score(model.A_, X, y, test),
            }
        )
    if ml_python is not None:
        matched = math.ceil(_MATCHED_FRACTION * n) * k * (k - 1) // 2
        constraint_counts = {"default": 0, "matched": matched}
        for name, constraints in (
            (f"metric-learn ({m})", constraint_counts[m]) for m in options["ml_runs"]
        ):
            out = _run_metric_learn(ml_python, X, y, constraints, seed, options["ml_max_iter"])
            runs.append(
                {
                    "method": name,
                    "n_negative_pairs_used": out["n_constraints"],
                    "converged": out["converged"],
                    "seconds": out["seconds"],
                    **_score(out["A"], X, y, test),
                }
            )
    for run in runs:
        run.update(n=n, repeat=repeat, n_negative_pairs=n_negative)
    return runs


# -- summary -----------------------------------------------------------------------------------
_MEASURES = ("test_objective", "test_constraint", "test_scale_free", "seconds")


def _aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and standard deviation over repeats, per (n, method)."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["n"], run["method"]), []).append(run)
    table = []
    for (n, method), members in groups.items():
        row: dict[str, Any] = {
            "n": n,
            "method": method,
            "repeats": len(members),
            "n_negative_pairs": members[0]["n_negative_pairs"],
            "n_negative_pairs_used": members[0]["n_negative_pairs_used"],
        }
        for key in _MEASURES:
            values = [m[key] for m in members if m.get(key) is not None]
            row[key] = float(np.mean(values)) if values else None
            row[f"{key}_std"] = float(np.std(values, ddof=1)) if len(values) > 1 else None
        table.append(row)
    return table


def _comparisons(table: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per n: the B = 0.15 n run against the complete statistic and the best method."""
    out = []
    for n in sorted({row["n"] for row in table}):
        rows = {row["method"]: row for row in table if row["n"] == n}
        matched = next(
            (r for m, r in rows.items() if m.endswith(f"B={_MATCHED_FRACTION:g}n")), None
        )
        if matched is None:
            continue
        best = max(r["test_scale_free"] for r in rows.values())
        entry = {"n": n, "loss_vs_best": (best - matched["test_scale_free"]) / best}
        complete = rows.get("complete")
        if complete is not None:
            entry["loss_vs_complete"] = (
                complete["test_scale_free"] - matched["test_scale_free"]
            ) / complete["test_scale_free"]
            if complete["seconds"] and matched["seconds"]:
                entry["time_ratio_complete"] = complete["seconds"] / matched["seconds"]
        for name in ("metric-learn (default)", "metric-learn (matched)"):
            other = rows.get(name)
            if other is not None:
                key = name.split("(")[1].rstrip(")")
                entry[f"objective_gain_vs_metric_learn_{key}"] = (
                    matched["test_scale_free"] - other["test_scale_free"]
                ) / other["test_scale_free"]
                if other["seconds"] and matched["seconds"]:
                    entry[f"time_ratio_metric_learn_{key}"] = other["seconds"] / matched["seconds"]
        out.append(entry)
    return out


def _verdict(comparisons: list[dict[str, Any]], ml_reason: str | None) -> tuple[str, bool]:
    worst = max(c["loss_vs_best"] for c in comparisons)
    complete = [c for c in comparisons if "loss_vs_complete" in c]
    parts = [
        f"mmc-subsampling: B = {_MATCHED_FRACTION:g} n tuples is within {100 * worst:.2f} % of the "
        "best test objective at every n"
    ]
    if complete:
        loss = max(c["loss_vs_complete"] for c in complete)
        parts.append(f"{100 * loss:+.2f} % vs the complete statistic (n ≤ {complete[-1]['n']})")
        ratios = [c["time_ratio_complete"] for c in complete if "time_ratio_complete" in c]
        if ratios:
            parts.append(f"{min(ratios):.0f}-{max(ratios):.0f}x faster")
    gains = [c["objective_gain_vs_metric_learn_default"] for c in comparisons
             if "objective_gain_vs_metric_learn_default" in c]  # fmt: skip
    if gains:
        parts.append(
            f"test objective {100 * min(gains):+.1f} to {100 * max(gains):+.1f} % vs metric-learn"
        )
    else:
        parts.append(f"metric-learn skipped: {ml_reason}")
    return "; ".join(parts), worst <= 0.02


def _figure(table: list[dict[str, Any]]) -> Any:
    figure, axes = new_figure(1, 3, size=(16.0, 4.8))
    methods = list(dict.fromkeys(row["method"] for row in table))
    panels = (
        ("test_objective", "objective on test pairs (mean d_A, negatives)", False),
        ("test_constraint", "constraint on test pairs (mean d_A², positives)", False),
        ("seconds", "training time (s, one thread)", True),
    )
    for ax, (key, title, log_y) in zip(axes[0], panels, strict=True):
        for method in methods:
            rows = sorted((r for r in table if r["method"] == method and r[key] is not None),
                          key=lambda r: r["n"])  # fmt: skip
            if not rows:
                continue
            n = [r["n"] for r in rows]
            mean = np.array([r[key] for r in rows])
            std = np.array([r[f"{key}_std"] or 0.0 for r in rows])
            ax.errorbar(n, mean, yerr=std, marker="o", capsize=3, label=method)
        ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("training size n")
        ax.set_title(title, fontsize="medium")
        ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(fontsize="small")
    return figure


# -- the experiment --------------------------------------------------------------------------------
def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    sizes = parse_sequence(options["sizes"], "sizes", int)
    options["sizes"] = tuple(check_scalar(n, "sizes", Interval("integer", 20, None)) for n in sizes)
    budgets = parse_sequence(options["budgets"], "budgets", float)
    positive = Interval("real", 0, None, closed="neither")
    options["budgets"] = tuple(check_scalar(b, "budgets", positive) for b in budgets)
    check_choice(options["sampling"], "sampling", ("tuples", "pairs"))
    check_choice(options["dataset"], "dataset", ("fashion-mnist", "mnist"))
    check_scalar(options["repeats"], "repeats", Interval("integer", 1, None))
    check_scalar(options["n_test"], "n_test", Interval("integer", 20, None))
    check_scalar(options["variance"], "variance", Interval("real", 0, 1, closed="neither"))
    check_scalar(options["complete_max_pairs"], "complete_max_pairs", Interval("integer", 0, None))
    check_scalar(options["max_iter"], "max_iter", Interval("integer", 1, None))
    check_scalar(options["ml_max_iter"], "ml_max_iter", Interval("integer", 1, None))
    runs = parse_sequence(options["ml_runs"], "ml_runs", str)
    options["ml_runs"] = tuple(dict.fromkeys(check_choice(r, "ml_runs", _ML_RUNS) for r in runs))
    check_scalar(options["tol"], "tol", positive)
    return options


@experiment(
    "mmc-subsampling",
    summary="MMC on Fashion-MNIST with the negative pairs subsampled as K-tuples (B = f n): test "
    "objective, constraint and time vs the complete statistic and metric-learn (Fig. 4).",
    reference="Vogel, Bellet & Clémençon, ICML 2018, Sec. 4 and 5.3, Fig. 4",
)
def run(
    *,
    quick: bool = False,
    seed: int = 0,
    dataset: str = "fashion-mnist",
    data_dir: str | None = None,
    sizes: tuple[int, ...] = (1000, 3000, 10000, 30000, 60000),
    budgets: tuple[float, ...] = (0.01, 0.05, 0.15, 0.5),
    sampling: str = "tuples",
    repeats: int = 3,
    n_test: int = 10000,
    variance: float = 0.9,
    complete_max_pairs: int = 2_000_000,
    max_iter: int = 200,
    tol: float = 1e-5,
    metric_learn: bool = True,
    metric_learn_python: str | None = None,
    ml_max_iter: int = 100,
    ml_runs: tuple[str, ...] = _ML_RUNS,
) -> ExperimentResult:
    """Fit MMC for each training size n and budget B = f·n; score on the test set.

    Args:
        quick: n = 200 and 400, budgets 0.05 n and 0.15 n, one repeat, 400 test images, the
            complete statistic at n = 200, 100 steps (metric-learn 30), PCA fitted on 3000 images;
            no timings recorded (they differ from run to run).
        seed: Seed of the training subsets, the samples and metric-learn's constraints.
        dataset: fashion-mnist or mnist (IDX files; see rankwise.data).
        data_dir: Folder of the dataset (default: the usual locations).
        sizes: Training sizes n, comma-separated (at most 60000).
        budgets: Budgets as fractions f of n (B = ceil(f n) tuples or pairs), comma-separated.
        sampling: tuples (the paper's Fig. 4) or pairs.
        repeats: Training subsets per size (the paper averages 5 runs).
        n_test: Test images scored (all their pairs).
        variance: Fraction of the variance the PCA keeps.
        complete_max_pairs: Fit the complete statistic when n⁻ is at most this.
        max_iter: Projected gradient iterations of the rankwise MMC.
        tol: Certified relative gap to the optimum at which the rankwise MMC stops.
        metric_learn: Also run metric-learn's MMC_Supervised on the same subsets.
        metric_learn_python: Interpreter with metric-learn (default $RANKWISE_METRIC_LEARN_PYTHON).
        ml_max_iter: metric-learn's max_iter.
        ml_runs: metric-learn runs, comma-separated: default (its 20 K² constraints of each
            kind) and / or matched (as many negative pairs as B = 0.15 n tuples).
    """
    options = _check_options(dict(locals()))
    if quick:
        options.update(
            sizes=(200, 400),
            budgets=(0.05, 0.15),
            repeats=1,
            n_test=400,
            complete_max_pairs=30_000,
            max_iter=100,
            ml_max_iter=30,
        )
    X, y, X_test, y_test, pca = load_pca_features(
        dataset, data_dir, variance, 3000 if quick else None, seed
    )
    if max(options["sizes"]) > y.size:
        raise ValueError(
            f"`sizes` goes up to {max(options['sizes'])} but there are {y.size} images."
        )
    pick = np.random.default_rng(seed).choice(
        y_test.size, min(options["n_test"], y_test.size), replace=False
    )
    test = (X_test[np.sort(pick)], y_test[np.sort(pick)])
    ml_python, ml_reason = (None, "disabled (metric_learn=False)")
    if metric_learn:
        ml_python, ml_reason = find_metric_learn(metric_learn_python)
    runs = []
    parts = progress(len(options["sizes"]) * options["repeats"])
    for n in options["sizes"]:
        for repeat in range(options["repeats"]):
            runs.extend(_size_runs(n, repeat, (X, y), test, options, ml_python))
            parts.advance(f"n = {n}" + (f", repeat {repeat}" if options["repeats"] > 1 else ""))
    if quick:  # wall times differ run to run; the quick mode's output must be reproducible
        for run_ in runs:
            run_["seconds"] = None
    table = _aggregate(runs)
    comparisons = _comparisons(table)
    verdict, consistent = _verdict(comparisons, ml_reason)
    data = {
        "dataset": dataset,
        "pca": pca,
        "n_test": int(test[1].size),
        "options": {k: v for k, v in options.items() if k != "metric_learn_python"},
        "metric_learn": ml_reason if ml_python is None else ml_reason.split(" (")[0],
        "metric_learn_ran": ml_python is not None,
        "threads": 1,
        "timings_recorded": not quick,
        "table": table,
        "comparisons": comparisons,
        "runs": runs,
    }
    return ExperimentResult(
        "mmc-subsampling", data=data, verdict=verdict, consistent=consistent, figure=_figure(table)
    )
