"""``pointwise-roc-sphere``: pointwise ROC optimization on the sphere (Vogel et al., Sec. 5.1, Fig. 1).

Vogel, Bellet and Clémençon, *A Probabilistic Theory of Supervised Similarity Learning for Pointwise
ROC Curve Optimization* (ICML 2018), Sec. 5.1: K = 3 classes on the unit sphere of R³, class i
uniform on the cap of angle π/4 around its centroid c_i (c₁ = (cos π/3, sin π/3, 0), c₂ = e₂,
c₃ = e₃, p_i = 1/3), and bilinear similarities S_A(x, x') = ½(1 + xᵀAx'), ‖A‖_F ≤ 1.

Two families of solutions are fitted on a training sample and scored on the pairs of a test sample:
problem (6) in closed form for several feasible α (Fig. 1(b)), checked against projected gradient
ascent, and :class:`~rankwise.models.BilinearSimilarity` with ``risk="indicator"`` at FPR targets
α. Settings and results: docs/pointwise_roc.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._validation import Interval, check_scalar
from .base import ExperimentResult, Progress, experiment, new_figure, parse_sequence, progress

__all__ = ["CENTROIDS", "CAP_ANGLE", "run", "sample_caps"]

#: the class centroids of Sec. 5.1
CENTROIDS = np.array(
    [[math.cos(math.pi / 3), math.sin(math.pi / 3), 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
)
CAP_ANGLE = math.pi / 4
DEFAULT_FPR_TARGETS = (0.02, 0.05, 0.1, 0.2, 0.4)
# a solution is "best near its α" when no other solution of its family beats its test TPR at
# FPR = α by more than this (the test TPRs carry a sampling error of about 0.01 at n = 3000)
BEST_MARGIN = 0.01


def sample_caps(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Draw n points of the Fig. 1 distribution: a uniform class, then a uniform point of its cap.

    On the sphere of R³ the height z = cos θ of a uniform point is uniform (Archimedes), so the
    cap θ < π/4 is sampled as z ~ U[cos π/4, 1], azimuth ~ U[0, 2π), rotated onto the centroid.

    Returns:
        (X (n, 3) unit rows, y (n,) int64 in {0, 1, 2}).
    """
    labels = rng.integers(0, 3, n)
    z = rng.uniform(math.cos(CAP_ANGLE), 1.0, n)
    azimuth = rng.uniform(0.0, 2 * math.pi, n)
    radius = np.sqrt(1.0 - z**2)
    local = np.stack([radius * np.cos(azimuth), radius * np.sin(azimuth), z], 1)
    points = np.empty_like(local)
    for k, center in enumerate(CENTROIDS):
        helper = np.array([1.0, 0.0, 0.0]) if abs(center[0]) < 0.9 else np.array([0.0, 1.0, 0.0])
        u = np.cross(center, helper)
        u /= np.linalg.norm(u)
        v = np.cross(center, u)
        rows = labels == k
        points[rows] = local[rows] @ np.stack([u, v, center])
    return points, labels.astype(np.int64)


def _test_pairs(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    i, j = np.triu_indices(y.size, 1)
    return X[i], X[j], y[i] == y[j]


def _tpr_at(curve: Any, levels: np.ndarray) -> np.ndarray:
    """Largest TPR among the curve's points with FPR ≤ each level (the rule of ``tpr_at_fpr``)."""
    index = np.searchsorted(curve.fpr, np.asarray(levels, dtype=np.float64), side="right") - 1
    return curve.tpr[index]


def _curve_summary(scores: np.ndarray, same: np.ndarray, grid: np.ndarray) -> dict[str, Any]:
    from ..metrics import roc_curve  # noqa: PLC0415 - deferred: the CLI imports every experiment module

    curve = roc_curve(scores, same)
    return {"curve": curve, "auc": curve.auc, "tpr_on_grid": _tpr_at(curve, grid)}


def _mean_risk_family(
    X: np.ndarray,
    y: np.ndarray,
    pairs: tuple,
    alphas: tuple[float, ...] | None,
    count: int,
    parts: Progress,
) -> dict[str, Any]:
    """Closed-form solutions of problem (6), their PGA check and their test ROC summaries."""
    # optional extra (scikit-learn)
    from ..similarity_learning import BilinearSimilarity  # noqa: PLC0415
    from ..similarity_learning.bilinear import (  # noqa: PLC0415
        pair_moment_matrices,
        projected_gradient_bilinear,
    )

    P, N = pair_moment_matrices(X, y)
    floor = 0.5 * (1 - float(np.linalg.norm(N)))
    ceiling = 0.5 * (1 + float((P / np.linalg.norm(P) * N).sum()))  # λ = 0 from here on
    if alphas is None:
        # evenly spaced over the feasible range, the ends excluded (λ = ∞ and λ = 0)
        alphas = tuple(floor + (ceiling - floor) * (k + 0.5) / count for k in range(count))
    rows = []
    for alpha in alphas:
        if not floor < alpha < 1:
            raise ValueError(
                f"`alphas` holds {alpha:g}, outside the feasible range ({floor:.4f}, 1) of the "
                "mean negative risk on this sample."
            )
        model = BilinearSimilarity(alpha).fit(X, y)
        A_pga, iterations = projected_gradient_bilinear(P, N, alpha)
        rows.append(
            {
                "alpha": alpha,
                "lambda": model.lambda_,
                "train_positive_risk": model.positive_risk_,
                "train_negative_risk": model.negative_risk_,
                "constraint_holds": model.negative_risk_ <= alpha + 1e-12,
                "pga_max_abs_diff": float(np.abs(A_pga - model.A_).max()),
                "pga_objective_gap": 0.5 * float(((A_pga - model.A_) * P).sum()),
                "pga_iterations": iterations,
                "scores": model.pair_score(pairs[0], pairs[1]),
            }
        )
        parts.advance(f"mean-risk α = {alpha:.3f}")
    return {"floor": floor, "ceiling": ceiling, "rows": rows}


def _fpr_target_family(
    X: np.ndarray,
    y: np.ndarray,
    pairs: tuple,
    targets: tuple[float, ...],
    max_iter: int,
    parts: Progress,
) -> list[dict[str, Any]]:
    from ..similarity_learning import BilinearSimilarity  # noqa: PLC0415 - optional extra (scikit-learn)

    rows = []
    for alpha in targets:
        model = BilinearSimilarity(alpha, risk="indicator", max_iter=max_iter, n_threads=1)
        model.fit(X, y)
        scores = model.pair_score(pairs[0], pairs[1])
        accepted = scores >= model.threshold_
        same = pairs[2]
        rows.append(
            {
                "alpha": alpha,
                "lambda": model.lambda_,
                "train_fpr": model.negative_risk_,
                "train_tpr": model.positive_risk_,
                "test_fpr_at_threshold": float(accepted[~same].mean()),
                "test_tpr_at_threshold": float(accepted[same].mean()),
                "scores": scores,
            }
        )
        parts.advance(f"FPR target {alpha:g}")
    return rows


def _best_regions(tpr_on_grid: np.ndarray, grid: np.ndarray) -> list[tuple[float, float] | None]:
    """For each row of ``tpr_on_grid``, the FPR span where its TPR alone is highest (or None)."""
    ordered = np.sort(tpr_on_grid, axis=0)
    unique = (
        ordered[-1] - ordered[-2] > 1e-12 if tpr_on_grid.shape[0] > 1 else np.ones(grid.size, bool)
    )
    winner = np.where(unique, np.argmax(tpr_on_grid, axis=0), -1)
    regions: list[tuple[float, float] | None] = []
    for k in range(tpr_on_grid.shape[0]):
        where = grid[winner == k]
        regions.append((float(where.min()), float(where.max())) if where.size else None)
    return regions


def _check_options(n_train, n_test, n_alphas, alphas, fpr_targets, max_iter):
    check_scalar(n_train, "n_train", Interval("integer", 20, None))
    check_scalar(n_test, "n_test", Interval("integer", 20, 20_000))
    check_scalar(n_alphas, "n_alphas", Interval("integer", 2, None))
    check_scalar(max_iter, "max_iter", Interval("integer", 1, None))
    unit = Interval("real", 0, 1, closed="neither")
    if alphas is not None:
        alphas = tuple(check_scalar(a, "alphas", unit) for a in parse_sequence(alphas, "alphas"))
    targets = parse_sequence(fpr_targets, "fpr_targets")
    targets = tuple(sorted(check_scalar(a, "fpr_targets", unit) for a in targets))
    return alphas, targets


@experiment(
    "pointwise-roc-sphere",
    summary="Bilinear similarities for several α on 3 caps of the sphere: each optimizes its own "
    "part of the ROC curve (Fig. 1).",
    reference="Vogel, Bellet & Clémençon, ICML 2018, Sec. 5.1, Fig. 1",
)
def run(
    *,
    quick: bool = False,
    seed: int = 0,
    n_train: int = 1000,
    n_test: int = 3000,
    n_alphas: int = 5,
    alphas: tuple[float, ...] | None = None,
    fpr_targets: tuple[float, ...] = DEFAULT_FPR_TARGETS,
    max_iter: int = 500,
) -> ExperimentResult:
    """Fit the closed form of problem (6) for several α and FPR-target solutions; ROC on test pairs.

    Args:
        quick: 300 training and 600 test points, 3 α and 3 FPR targets, 150 iterations.
        seed: Seed of the training and test samples.
        n_train: Training points.
        n_test: Test points (all their pairs are scored).
        n_alphas: Number of α spread over the feasible range of the mean negative risk.
        alphas: Explicit α of problem (6) instead (mean negative risk, comma-separated).
        fpr_targets: FPR targets of the thresholded (indicator) solutions, comma-separated.
        max_iter: Primal-dual iterations of each indicator solution.
    """
    alphas, targets = _check_options(n_train, n_test, n_alphas, alphas, fpr_targets, max_iter)
    if quick:
        n_train, n_test, n_alphas, max_iter = 300, 600, 3, 150
        targets = targets[:: max(1, len(targets) // 3)][:3]
    rng = np.random.default_rng(seed)
    X, y = sample_caps(n_train, rng)
    X_test, y_test = sample_caps(n_test, rng)
    pairs = _test_pairs(X_test, y_test)
    grid = np.geomspace(1e-3, 0.95, 60)

    parts = progress((n_alphas if alphas is None else len(alphas)) + len(targets))
    mean_family = _mean_risk_family(X, y, pairs, alphas, n_alphas, parts)
    for row in mean_family["rows"]:
        row.update(_curve_summary(row.pop("scores"), pairs[2], grid))
    mean_regions = _best_regions(np.stack([r["tpr_on_grid"] for r in mean_family["rows"]]), grid)
    for row, region in zip(mean_family["rows"], mean_regions, strict=True):
        row["best_fpr_region"] = region

    target_rows = _fpr_target_family(X, y, pairs, targets, max_iter, parts)
    _score_targets(target_rows, pairs)
    for row in target_rows:
        row.update(_curve_summary(row.pop("scores"), pairs[2], grid))

    checks = _checks(mean_family["rows"], target_rows)
    figure = _figure(X, y, mean_family["rows"], target_rows)
    data = _data(seed, n_train, n_test, mean_family, target_rows, grid, checks)
    return ExperimentResult(
        "pointwise-roc-sphere",
        data=data,
        verdict=_verdict(mean_family["rows"], target_rows, checks),
        consistent=all(checks.values()),
        figure=figure,
    )


def _score_targets(rows: list[dict[str, Any]], pairs: tuple) -> None:
    """Every FPR-target solution's test TPR at every target, and the cosine baseline's."""
    from ..metrics import roc_curve  # noqa: PLC0415 - deferred: the CLI imports every experiment module

    same = pairs[2]
    targets = np.array([row["alpha"] for row in rows])
    cosine = _tpr_at(roc_curve((pairs[0] * pairs[1]).sum(1), same), targets)
    family = np.stack([_tpr_at(roc_curve(row["scores"], same), targets) for row in rows])
    for k, row in enumerate(rows):
        row["cosine_tpr_at_alpha"] = float(cosine[k])
        row["family_tpr_at_alpha"] = family[:, k]
        row["tpr_at_alpha"] = float(family[k, k])
        row["best_in_family_at_alpha"] = float(family[:, k].max() - family[k, k]) <= BEST_MARGIN


def _checks(mean_rows: list[dict[str, Any]], target_rows: list[dict[str, Any]]) -> dict[str, bool]:
    lambdas = [r["lambda"] for r in mean_rows]
    starts = [r["best_fpr_region"][0] for r in mean_rows if r["best_fpr_region"] is not None]
    return {
        "closed_form_equals_pga": max(r["pga_max_abs_diff"] for r in mean_rows) < 1e-6,
        "constraint_holds_on_training_pairs": all(r["constraint_holds"] for r in mean_rows),
        "lambda_decreases_in_alpha": all(
            a >= b for a, b in zip(lambdas, lambdas[1:], strict=False)
        ),
        "smaller_alpha_best_at_lower_fpr": all(
            a <= b for a, b in zip(starts, starts[1:], strict=False)
        ),
        "fpr_target_best_near_its_alpha": all(r["best_in_family_at_alpha"] for r in target_rows),
        "fpr_target_beats_cosine": all(
            r["tpr_at_alpha"] >= r["cosine_tpr_at_alpha"] for r in target_rows
        ),
    }


def _data(seed, n_train, n_test, mean_family, target_rows, grid, checks) -> dict[str, Any]:
    def clean(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k != "curve"}

    return {
        "seed": seed,
        "n_train": n_train,
        "n_test": n_test,
        "n_test_pairs": n_test * (n_test - 1) // 2,
        "fpr_grid": grid,
        "mean_risk_feasible_range": [mean_family["floor"], mean_family["ceiling"]],
        "mean_risk_solutions": [clean(r) for r in mean_family["rows"]],
        "fpr_target_solutions": [clean(r) for r in target_rows],
        "checks": checks,
    }


def _verdict(mean_rows, target_rows, checks) -> str:
    gap = max(r["pga_max_abs_diff"] for r in mean_rows)
    wins = sum(r["best_in_family_at_alpha"] for r in target_rows)
    fpr_error = max(abs(r["test_fpr_at_threshold"] - r["alpha"]) for r in target_rows)
    failed = [name for name, ok in checks.items() if not ok]
    return (
        f"pointwise-roc-sphere: closed form = PGA (max |ΔA| {gap:.1e}), lambda decreasing in "
        f"alpha: {checks['lambda_decreases_in_alpha']}; "
        f"FPR-target solutions best at their own FPR in {wins}/{len(target_rows)} cases, test FPR "
        f"of their thresholds within {fpr_error:.3f} of alpha"
        + (f"; failed: {', '.join(failed)}" if failed else "; every check holds")
    )


def _figure(X, y, mean_rows, target_rows) -> Any:
    figure, axes = new_figure(1, 3, size=(16.0, 4.8))
    ax = axes[0, 0]
    # the sphere seen from the direction (1, 1, 1): a 2-D orthographic projection
    basis = np.array([[1.0, -1.0, 0.0], [1.0, 1.0, -2.0]])
    basis /= np.linalg.norm(basis, axis=1, keepdims=True)
    flat = X @ basis.T
    for k in range(3):
        ax.scatter(*flat[y == k].T, s=4, alpha=0.5, label=f"class {k + 1}")
    ax.scatter(*(CENTROIDS @ basis.T).T, marker="*", s=200, c="k", label="centroids")
    ax.set_aspect("equal")
    ax.set_title("(a) data, seen from (1, 1, 1)")
    ax.legend(fontsize="small")
    for ax, rows, title, key in (
        (axes[0, 1], mean_rows, "(b) problem (6), mean risk ≤ α", "alpha"),
        (axes[0, 2], target_rows, "(c) TPR s.t. FPR ≤ α (indicator)", "alpha"),
    ):
        for row in rows:
            curve = row["curve"]
            line = ax.plot(curve.fpr, curve.tpr, label=f"α = {row[key]:.3g}")[0]
            if rows is target_rows:
                ax.axvline(row["alpha"], color=line.get_color(), linestyle=":", linewidth=1)
        ax.set(xscale="log", xlim=(1e-3, 1), ylim=(0, 1.02))
        ax.set(xlabel="FPR on test pairs (log)", ylabel="TPR on test pairs", title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    return figure
