"""``interpolation-error``: the score interpolation φ of SOPRC (Wen et al., Prop. 3, Fig. 1(c), Fig. 5).

SOPRC (Wen, Xu, Yang, He and Huang, *Exploring the Algorithm-Dependent Generalization of AUPRC
Optimization with List Stability*, NeurIPS 2022) replaces the N⁺ positive scores h(S⁺) by a vector v
fed with φ(h(z⁺)), the n⁺ batch positives linearly interpolated onto N⁺ quantile positions (Alg. 2,
:func:`rankwise.losses.soprc.score_interpolation`: the sorted batch scores sit at i/(n⁺ + 1), one
extrapolated point closes each end). Prop. 3 bounds the interpolation error of the quantile function
p of the positive scores by ‖p − p̂‖∞ ≤ ‖p″‖∞ / (8 (n⁺)²) when the knots are exact quantiles.

For the three score models of App. B.2 and a range of n⁺ this experiment measures Prop. 3's error
on the interior [1/(n⁺ + 1), n⁺/(n⁺ + 1)] against its bound (also per interval,
max_i ‖p″‖_{∞, [k_i, k_{i+1}]} / (8 (n⁺ + 1)²)), the expected error E[φ(z⁺)] − h(S⁺) that v
inherits (Prop. 1; it also holds the O(1/n⁺) gap between expected order statistics and quantiles
that Prop. 3 assumes away) and the error of one batch. Settings and results: docs/experiments.md.
"""

from __future__ import annotations

import numpy as np

from .._validation import Interval, check_scalar
from ._scores import DISTRIBUTIONS, ScoreModel, draw_population, score_model
from .base import ExperimentResult, experiment, new_figure, parse_sequence, progress

__all__ = ["interpolation_bound", "prop3_error", "run"]

DEFAULT_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
QUICK_SIZES = (2, 4, 8, 16, 32, 64, 128, 256)
_POINTS_PER_INTERVAL = 64


def _interior_grid(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Knots i/(n + 1), i = 1..n, and a grid of the interior with 64 points per knot interval."""
    knots = np.arange(1, n + 1) / (n + 1)
    steps = np.linspace(0.0, 1.0, _POINTS_PER_INTERVAL + 1)[:-1]
    grid = (knots[:-1, None] + steps[None, :] / (n + 1)).ravel()
    return knots, np.append(grid, knots[-1])


CENTRAL = (0.1, 0.9)


def prop3_error(model: ScoreModel, n: int, window: tuple[float, float] | None = None) -> float:
    """‖p − p̂‖∞ on [1/(n + 1), n/(n + 1)], p̂ the linear interpolation of p at i/(n + 1).

    Args:
        model: the score model (p is its positive-score quantile function).
        n: number of knots n⁺.
        window: optionally restrict the sup to this quantile interval, e.g. (0.1, 0.9).
    """
    knots, grid = _interior_grid(n)
    if window is not None:
        grid = grid[(grid >= window[0]) & (grid <= window[1])]
    if grid.size == 0:
        return 0.0
    interpolated = np.interp(grid, knots, model.positive_quantile(knots))
    return float(np.max(np.abs(interpolated - model.positive_quantile(grid))))


def interpolation_bound(
    model: ScoreModel, n: int, window: tuple[float, float] | None = None
) -> tuple[float, float]:
    """Prop. 3's bound for n knots, and its per-interval form.

    Args:
        model: the score model.
        n: number of knots n⁺.
        window: optionally take ‖p″‖∞ over this quantile interval only (paper form only).

    Returns:
        (‖p″‖∞ / (8 n²) with the sup over the interior (or the window), the paper's form;
         max_i sup_{[k_i, k_{i+1}]} |p″| · h² / 8 with the knot spacing h = 1/(n + 1)).
    """
    _, grid = _interior_grid(n)
    curvature = np.abs(model.positive_quantile_d2(grid))
    per_interval = curvature[:-1].reshape(n - 1, _POINTS_PER_INTERVAL).max(axis=1)
    per_interval = np.maximum(per_interval, curvature[_POINTS_PER_INTERVAL::_POINTS_PER_INTERVAL])
    local = float(per_interval.max()) / (8 * (n + 1) ** 2)
    if window is not None:
        curvature = np.abs(model.positive_quantile_d2(np.linspace(*window, 4001)))
    return float(curvature.max()) / (8 * n**2), local


def expected_order_statistics(population: np.ndarray, n: int) -> np.ndarray:
    """E[u_(i)], i = 1..n, for n scores drawn without replacement from ``population`` (sorted).

    P(u_(i) = s_(k)) = C(k − 1, i − 1) C(N − k, n − i) / C(N, n): exact, no Monte Carlo.
    """
    from scipy.special import gammaln

    size = population.size
    k = np.arange(1, size + 1, dtype=np.float64)[None, :]
    log_all = gammaln(size + 1) - gammaln(n + 1) - gammaln(size - n + 1)
    out = np.empty(n)
    for start in range(0, n, 128):
        i = np.arange(start + 1, min(n, start + 128) + 1, dtype=np.float64)[:, None]
        possible = (k >= i) & (size - k >= n - i)
        a, b = np.where(possible, k - 1, i - 1), np.where(possible, size - k, n - i)
        log_p = (
            gammaln(a + 1)
            - gammaln(i)
            - gammaln(a - i + 2)
            + gammaln(b + 1)
            - gammaln(n - i + 1)
            - gammaln(b - n + i + 1)
            - log_all
        )
        out[start : start + i.shape[0]] = np.where(possible, np.exp(log_p), 0.0) @ population
    return out


def expected_phi_interior(population: np.ndarray, n: int, num_points: int) -> tuple:
    """E[φ(z⁺)] at the positions j/(K + 1) inside [1/(n + 1), n/(n + 1)], exactly.

    There φ is a fixed linear combination of two neighbouring order statistics (the extrapolated
    and clipped ends play no part), so its expectation is that of the expected order statistics.

    Returns:
        (indices j − 1 of the interior positions, E[φ] there).
    """
    expected = expected_order_statistics(population, n)
    j = np.arange(1, num_points + 1)
    numerator = j * (n + 1)  # position j/(K+1) is at t = j(n+1)/(K+1) on the knot scale 1..n
    inside = (numerator >= num_points + 1) & (numerator <= n * (num_points + 1))
    left = numerator[inside] // (num_points + 1)
    frac = (numerator[inside] - left * (num_points + 1)) / (num_points + 1)
    right = np.minimum(left + 1, n)
    values = (1 - frac) * expected[left - 1] + frac * expected[right - 1]
    return np.flatnonzero(inside), values


def _batch_errors(
    model: ScoreModel, positives: np.ndarray, n: int, repeats: int, rng: np.random.Generator
) -> dict:
    """Bias of E[φ(z⁺)] and the single-batch error, against the sorted h(S⁺) (``positives``).

    Inside [1/(n + 1), n/(n + 1)] the bias is exact (:func:`expected_phi_interior`). Over all
    positions (the extrapolated ends included) it is estimated from the R batches, whose mean carries
    Monte Carlo noise of variance σ²/R at every position; the squared bias is estimated without it:
    mean_j [(mean_j − h_j)² − s_j² / R], s² the sample variance over batches (0 when the bias is
    below that noise).
    """
    k = positives.size
    positions = np.arange(1, k + 1) / (k + 1)
    central = (positions >= CENTRAL[0]) & (positions <= CENTRAL[1])
    total = np.zeros(k)
    total_sq = np.zeros(k)
    batch_mae = np.empty(repeats)
    for r in range(repeats):
        phi = model.phi(positives[rng.choice(k, n, replace=False)], k)
        total += phi
        total_sq += phi * phi
        batch_mae[r] = np.abs(phi - positives).mean()
    mean = total / repeats
    variance = np.maximum(total_sq - repeats * mean**2, 0.0) / (repeats - 1)
    noise = variance / repeats
    squared_bias = (mean - positives) ** 2 - noise
    index, exact = expected_phi_interior(positives, n, k)
    exact_gap = exact - positives[index]
    in_central = central[index]
    return {
        "bias_rms_interior_exact": float(np.sqrt(np.mean(exact_gap**2))),
        "bias_rms_central_exact": float(np.sqrt(np.mean(exact_gap[in_central] ** 2)))
        if in_central.any()
        else None,
        "bias_rms_monte_carlo": float(np.sqrt(max(squared_bias.mean(), 0.0))),
        "monte_carlo_noise_rms": float(np.sqrt(noise.mean())),
        "batch_mean_abs_error": float(batch_mae.mean()),
        "batch_rms_error": float(np.sqrt(np.mean(variance + (mean - positives) ** 2))),
        "_mean": mean,
        "_std": np.sqrt(variance),
    }


def _fit_slope(sizes: list[int], values: list[float | None]) -> float | None:
    """Slope of log(value) against log(n⁺) over n⁺ ≥ 16 (the asymptotic regime)."""
    ok = [
        (n, v)
        for n, v in zip(sizes, values, strict=True)
        if n >= 16 and v is not None and v > 1e-12
    ]
    if len(ok) < 2:
        return None
    x, y = np.log([n for n, _ in ok]), np.log([v for _, v in ok])
    return float(np.polyfit(x, y, 1)[0])


def _study(model, sizes, repeats, num_points, prior, rng) -> dict:
    # φ onto N⁺ positions returns N⁺ scores: they are compared with h(S⁺), sorted, itself
    positives, _ = draw_population(model, num_points, prior, rng)
    spread = float(np.subtract(*np.quantile(positives, [0.75, 0.25])))
    rows, curves = [], {}
    for n in sizes:
        paper_bound, local_bound = interpolation_bound(model, n)
        row = {
            "batch_positives": n,
            "prop3_error": prop3_error(model, n),
            "prop3_bound": paper_bound,
            "prop3_bound_local": local_bound,
            "prop3_error_central": prop3_error(model, n, CENTRAL),
            "prop3_bound_central": interpolation_bound(model, n, CENTRAL)[0],
            **_batch_errors(model, positives, n, repeats, rng),
        }
        curves[n] = (row.pop("_mean"), row.pop("_std"))
        # 1e-12: float rounding of p̂ (the offset-uniform error and bound are both 0)
        row["bound_holds"] = bool(
            row["prop3_error"] <= paper_bound + 1e-12
            and row["prop3_error_central"] <= row["prop3_bound_central"] + 1e-12
        )
        rows.append(row)

    def slope(key: str) -> float | None:
        return _fit_slope(list(sizes), [r[key] for r in rows])

    return {
        "distribution": model.name,
        "num_positives": int(positives.size),
        "positive_iqr": spread,
        "rows": rows,
        "slopes": {
            key: slope(key)
            for key in (
                "prop3_error_central",
                "bias_rms_interior_exact",
                "bias_rms_central_exact",
                "batch_rms_error",
            )
        },
        "_curves": curves,
        "_truth": positives,
    }


def _check_options(distributions, sizes, repeats, num_points, prior) -> tuple:
    models = tuple(score_model(d) for d in parse_sequence(distributions, "distributions", str))
    sizes = tuple(sorted(set(parse_sequence(sizes, "sizes", int))))
    for n in sizes:
        check_scalar(n, "sizes", Interval("integer", 2, None))
    check_scalar(repeats, "repeats", Interval("integer", 2, None))
    check_scalar(num_points, "num_points", Interval("integer", 10, None))
    check_scalar(prior, "prior", Interval("real", 0, 1, closed="neither"))
    if max(sizes) > round(prior * num_points):
        raise ValueError(
            f"`sizes` holds n⁺ = {max(sizes)} but the data set has only "
            f"{round(prior * num_points)} positives; raise `num_points` or drop that size."
        )
    return models, sizes


@experiment(
    "interpolation-error",
    summary="Error of SOPRC's score interpolation φ vs the true positive-score quantiles, by n⁺.",
    reference="Wen et al., NeurIPS 2022, Prop. 3, Fig. 1(c), App. B.2 Fig. 5",
)
def run(
    *,
    quick: bool = False,
    seed: int = 0,
    distributions: tuple[str, ...] = tuple(DISTRIBUTIONS),
    sizes: tuple[int, ...] | None = None,
    repeats: int | None = None,
    num_points: int | None = None,
    prior: float = 0.1,
    figure_size: int = 16,
) -> ExperimentResult:
    """Measure φ's error against the quantiles of the positive scores for several n⁺.

    Args:
        quick: 20,000 points, 50 repeats, n⁺ up to 256: seconds instead of a minute.
        seed: Seed of the data sets and of every batch (same seed, same JSON).
        distributions: Score models, comma-separated (default binormal,bibeta,offset-uniform).
        sizes: Batch positives n⁺, comma-separated (default 2,4,...,1024; up to 256 with --quick).
        repeats: Batches per n⁺ (default 500, as in App. B.2; 50 with --quick).
        num_points: Size N of each data set (default 100,000; 20,000 with --quick).
        prior: Positive rate π of the data set (default 0.1); φ maps onto its N⁺ = π N positions.
        figure_size: The n⁺ whose E[φ] ± std is drawn against the true quantiles (default 16).
    """
    check_scalar(seed, "seed", Interval("integer", 0, None))
    sizes = (QUICK_SIZES if quick else DEFAULT_SIZES) if sizes is None else sizes
    repeats = (50 if quick else 500) if repeats is None else repeats
    num_points = (20_000 if quick else 100_000) if num_points is None else num_points
    models, sizes = _check_options(distributions, sizes, repeats, num_points, prior)
    check_scalar(figure_size, "figure_size", Interval("integer", 2, None))
    if figure_size not in sizes:
        raise ValueError(f"`figure_size` {figure_size} must be one of `sizes` {list(sizes)}.")
    streams = np.random.SeedSequence(seed).spawn(len(models))
    parts = progress(len(models))  # one score model after the other (about 35 s each)
    studies = [
        _study(model, sizes, repeats, num_points, prior, np.random.default_rng(stream))
        for model, stream in parts.track(
            zip(models, streams, strict=True), lambda item: item[0].name
        )
    ]
    figure = _figure(studies, models, figure_size)
    for study in studies:
        study.pop("_curves")
        study.pop("_truth")
    data = {
        "distributions": studies,
        "settings": {
            "seed": seed,
            "quick": quick,
            "num_points": num_points,
            "prior": prior,
            "repeats": repeats,
            "sizes": list(sizes),
            "figure_size": figure_size,
        },
    }
    verdict, consistent = _verdict(studies)
    return ExperimentResult("interpolation-error", data, verdict, consistent, figure)


def _verdict(studies: list[dict]) -> tuple[str, bool]:
    bound_ok = all(r["bound_holds"] for s in studies for r in s["rows"])
    # Fig. 1(c)'s "ignorable": the expected error shrinks with n⁺ and, on the central 80% of the
    # quantiles, ends below 1% of the positive scores' interquartile range
    shrinks = all(
        (s["slopes"]["bias_rms_central_exact"] or 0.0) < 0
        and s["rows"][-1]["bias_rms_central_exact"] is not None
        and s["rows"][-1]["bias_rms_central_exact"] < 0.01 * s["positive_iqr"]
        for s in studies
    )
    parts = []
    for s in studies:
        last = s["rows"][-1]
        slope = s["slopes"]["prop3_error_central"]
        parts.append(
            f"{s['distribution']}: at n⁺={last['batch_positives']} E[φ] bias "
            f"{last['bias_rms_interior_exact']:.1e} (interior) / "
            f"{last['bias_rms_central_exact']:.1e} (central), one batch "
            f"{last['batch_rms_error']:.1e} (slope {s['slopes']['batch_rms_error']:.2f})"
            + (f", Prop. 3 error slope {slope:.2f}" if slope is not None else ", Prop. 3 error 0")
        )
    verdict = (
        f"interpolation-error: Prop. 3 bound ‖p″‖∞/(8n⁺²) {'holds' if bound_ok else 'FAILS'} for "
        f"every n⁺ and distribution; the expected error "
        f"{'shrinks below 1% of the IQR' if shrinks else 'does NOT shrink below 1% of the IQR'}; "
        + "; ".join(parts)
        + "."
    )
    return verdict, bound_ok and shrinks


def _figure(studies: list[dict], models: tuple[ScoreModel, ...], figure_size: int):
    figure, axes = new_figure(len(studies), 2, size=(11.5, 3.6 * len(studies)))
    for (left, right), study, model in zip(axes, studies, models, strict=True):
        truth = study["_truth"]
        mean, std = study["_curves"][figure_size]
        positions = np.arange(1, truth.size + 1) / (truth.size + 1)
        left.plot(positions, truth, color="k", lw=1.5, label="h(S⁺), sorted (true quantiles)")
        left.plot(
            positions, mean, color="tab:red", lw=1, ls="--", label=f"E[φ(z⁺)], n⁺={figure_size}"
        )
        left.fill_between(
            positions, mean - std, mean + std, color="tab:red", alpha=0.2, label="± std"
        )
        left.set(xlabel="quantile position", ylabel="positive score")
        left.set_title(DISTRIBUTIONS[model.name].label, fontsize=10)
        left.legend(fontsize=8, loc="upper left")

        sizes = np.array([r["batch_positives"] for r in study["rows"]])
        series = [
            ("one batch: rms |φ − h(S⁺)|", "batch_rms_error", "tab:blue", "o-"),
            ("E[φ] − h(S⁺), interior (exact)", "bias_rms_interior_exact", "tab:red", "s-"),
            ("E[φ] − h(S⁺), central 80% (exact)", "bias_rms_central_exact", "tab:orange", "s--"),
            ("Prop. 3: ‖p̂ − p‖∞, interior", "prop3_error", "tab:green", "^-"),
            ("Prop. 3 bound, interior", "prop3_bound", "tab:green", ":"),
            ("Prop. 3: ‖p̂ − p‖∞, central 80%", "prop3_error_central", "tab:purple", "v-"),
            ("Prop. 3 bound, central 80%", "prop3_bound_central", "tab:purple", ":"),
        ]
        for label, key, color, style in series:
            values = np.array([r[key] or 0.0 for r in study["rows"]], dtype=np.float64)
            # log axes: the offset-uniform errors and bounds are 0 (up to float rounding)
            shown = values > 1e-12
            if shown.any():
                right.loglog(sizes[shown], values[shown], style, color=color, ms=4, label=label)
        right.set(xlabel="positives per batch n⁺", ylabel="error (score units)")
        right.legend(fontsize=6.5, ncol=2)
    figure.suptitle("Interpolation error of φ (Alg. 2) against the true positive-score quantiles")
    return figure
