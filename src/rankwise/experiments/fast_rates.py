"""``fast-rates``: empirical generalization speed of pointwise ROC optimization (Vogel et al., Sec. 5.2).

Vogel, Bellet and Clémençon, *A Probabilistic Theory of Supervised Similarity Learning for Pointwise
ROC Curve Optimization* (ICML 2018), Thm. 2: under the noise assumption NA with exponent a,
E_{X'}|η(X, X') − Q*_α|^(−a) ≤ c, the solution Ŝ_n of the empirical problem (6) has
ROC*(α) − R⁺(Ŝ_n) ≤ C' n^(−(2+a)/4). Sec. 5.2 illustrates it on a one-dimensional construction,
rebuilt here from the text (the supplementary material is not available):

- X = [0, 1], μ = 1 (uniform), K = 2 classes with p₁ = p₂ = 1/2, so η₁ = μ₁/2 and μ₂ = 2 − μ₁;
- μ₁(x) = 2C on [0, m], 1 − |2x − 1|^((1−a)/a) on (m, 1/2], and "symmetric in (1/2, 1)" read as
  point symmetry about (1/2, 1): μ₁(x) = 2 − μ₁(1 − x) on (1/2, 1], which makes ∫μ₁ = 1 for every C
  (the reason the paper gives for the symmetry). With e(x) = η₁(x) − 1/2 (odd about 1/2) the pairwise
  posterior is η(x, x') = 1/2 + 2 e(x) e(x'), so {η > 1/2} is the pairs on the same side of 1/2;
- C is chosen so that Q*_α = 1/2, i.e. P(η > 1/2 | Y ≠ Y') = α: with E(t) = ∫₀ᵗ e,
  FPR of that set = 1/2 − 8 E(1/2)² = α, so m (1/2 − C) = √((1/2 − α)/8) − (1 − 2m)^(k+1)/(4(k+1)),
  k = (1 − a)/a; then ROC*(α) = 1/2 + 8 E(1/2)² = 1 − α;
- the class S₀ of indicators of S_t = {(x, x'): min(max(x, x'), max(1 − x, 1 − x')) < t}, two
  corner squares of side t; the optimal set is S_{1/2}. For t ≤ 1/2, TPR(t) = 2t² + 8 E(t)² and
  FPR(t) = 2t² − 8 E(t)²; for t > 1/2 the squares overlap on [1 − t, t]², where ∫e = 0, so both lose
  (2t − 1)²; E(t) = E(1 − t) for t > 1/2;
- problem (6) with Φ = 0: both empirical risks grow with t, so Ŝ_n = S_t̂ with t̂ the largest t whose
  empirical FPR (a U-statistic over the n₋ negative pairs) is ≤ α: the (⌊α n₋⌋ + 1)-th smallest
  negative-pair level, found in O(n log n) by counting pairs per class;
- the empirical 90% quantile of ROC*(α) − R⁺(Ŝ_n) over repeated samples is fitted to C_a log n + D_a
  (α = 0.26, m = 0.35, a ∈ [0.1, 0.9], 1,000 repetitions in the paper).

Besides the fitted speed C_a (with a bootstrap interval over the repetitions) the excess is split into
the constraint slack α − R⁻(Ŝ_n) and the excess of the cost-sensitive risk of Remark 1,
[ROC*(α) − α] − [R⁺(Ŝ_n) − R⁻(Ŝ_n)] ≥ 0 (with p = Q* = 1/2 its weights are equal), the part of the
error on which the noise exponent a acts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._validation import Interval, check_scalar
from .base import ExperimentResult, experiment, new_figure, parse_sequence, progress

__all__ = ["NoiseProblem", "empirical_threshold", "run", "sample"]

DEFAULT_A = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_SIZES = (100, 200, 500, 1000, 2000, 5000, 10_000)
QUICK_SIZES = (100, 300, 1000, 3000)


@dataclass(frozen=True)
class NoiseProblem:
    """The construction of Sec. 5.2 for one noise exponent a.

    Attributes:
        a: noise exponent in (0, 1).
        alpha: FPR level α in (0, 1/2).
        m: end of the flat part of μ₁, in (0, 1/2).
    """

    a: float
    alpha: float = 0.26
    m: float = 0.35

    @property
    def k(self) -> float:
        """Exponent (1 − a)/a of μ₁ near 1/2."""
        return (1.0 - self.a) / self.a

    @property
    def half_integral(self) -> float:
        """E(1/2) = ∫₀^{1/2} e, fixed by Q*_α = 1/2: −√((1/2 − α)/8)."""
        return -math.sqrt((0.5 - self.alpha) / 8.0)

    @property
    def c(self) -> float:
        """The constant C of μ₁ = 2C on [0, m] that makes Q*_α = 1/2."""
        tail = (1 - 2 * self.m) ** (self.k + 1) / (4 * (self.k + 1))
        return 0.5 - (-self.half_integral - tail) / self.m

    @property
    def roc_star(self) -> float:
        """ROC*(α) = TPR of the optimal set S_{1/2} = 1 − α."""
        return float(self.rates(np.array([0.5]))[0][0])

    def check(self) -> NoiseProblem:
        """Validate the parameters; C must land in (0, 1/2) for μ₁ to be a density."""
        check_scalar(self.a, "a", Interval("real", 0, 1, closed="neither"))
        check_scalar(self.alpha, "alpha", Interval("real", 0, 0.5, closed="neither"))
        check_scalar(self.m, "m", Interval("real", 0, 0.5, closed="neither"))
        if not 0 < self.c < 0.5:
            raise ValueError(
                f"no C in (0, 1/2) gives Q*_α = 1/2 for a={self.a:g}, alpha={self.alpha:g}, "
                f"m={self.m:g} (C would be {self.c:.4f}); choose a larger `m` or `alpha` closer "
                "to 1/2."
            )
        return self

    def e(self, x: np.ndarray) -> np.ndarray:
        """The centred class-1 posterior η₁ − 1/2 at ``x`` (odd about 1/2)."""
        x = np.asarray(x, dtype=np.float64)
        near = np.minimum(x, 1 - x)
        left = np.where(
            near <= self.m, self.c - 0.5, -(np.clip(1 - 2 * near, 0, None) ** self.k) / 2
        )
        return np.where(x <= 0.5, left, -left)

    def mu1(self, x: np.ndarray) -> np.ndarray:
        """Density μ₁ of class 1 (= 2 η₁, as μ = 1 and p₁ = 1/2)."""
        return 1.0 + 2.0 * self.e(x)

    def integral(self, t: np.ndarray) -> np.ndarray:
        """E(t) = ∫₀ᵗ e(x) dx (E(t) = E(1 − t): e is odd about 1/2)."""
        t = np.asarray(t, dtype=np.float64)
        s = np.minimum(t, 1 - t)
        k = self.k
        inner = (self.c - 0.5) * self.m - ((1 - 2 * self.m) ** (k + 1) - (1 - 2 * s) ** (k + 1)) / (
            4 * (k + 1)
        )
        return np.where(s <= self.m, (self.c - 0.5) * s, inner)

    def rates(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(R⁺(S_t), R⁻(S_t)): TPR and FPR of the two-square set of side t, exactly."""
        t = np.asarray(t, dtype=np.float64)
        square = 8.0 * self.integral(t) ** 2
        overlap = np.where(t > 0.5, (2 * t - 1) ** 2, 0.0)
        return 2 * t * t + square - overlap, 2 * t * t - square - overlap


def sample(
    problem: NoiseProblem, n: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Draw n i.i.d. points: X ~ U(0, 1), Y = 1 with probability η₁(X) = 1/2 + e(X), else 0.

    Class 2 of the paper is coded 0.
    """
    x = rng.uniform(size=n)
    y = (rng.uniform(size=n) < 0.5 + problem.e(x)).astype(np.int8)
    return x, y


def empirical_threshold(x: np.ndarray, y: np.ndarray, alpha: float) -> float:
    """t̂: the largest t whose empirical FPR over the negative pairs (i < j, y_i ≠ y_j) is ≤ α.

    A pair's level is ℓ = min(max(x, x'), max(1 − x, 1 − x')); S_t holds the pairs with ℓ < t.
    #{negative pairs with ℓ ≤ c} = A(c) + B(c) − O(c): pairs of opposite classes with both x ≤ c,
    with both 1 − x ≤ c, and with both max(x, 1 − x) ≤ c, each a product of two per-class counts.
    t̂ is the smallest level c at which that count exceeds ⌊α n₋⌋ (1.0 if it never does).
    """
    counts = []
    for cls in (0, 1):
        xc = x[y == cls]
        yc = 1.0 - xc
        counts.append((np.sort(xc), np.sort(yc), np.sort(np.maximum(xc, yc))))
    n_negative = counts[0][0].size * counts[1][0].size
    allowed = math.floor(alpha * n_negative + 1e-9)
    levels = np.unique(np.concatenate([x, 1.0 - x]))

    def below(values: np.ndarray) -> np.ndarray:
        return np.searchsorted(values, levels, side="right")

    pairs = sum(below(counts[0][j]) * below(counts[1][j]) for j in (0, 1)) - below(
        counts[0][2]
    ) * below(counts[1][2])
    first = int(np.searchsorted(pairs, allowed, side="right"))
    return float(levels[first]) if first < levels.size else 1.0


def _simulate(
    problem: NoiseProblem, sizes: tuple[int, ...], repeats: int, rng: np.random.Generator
) -> dict[int, np.ndarray]:
    """t̂ for every size and repetition: n -> (repeats,)."""
    out = {}
    for n in sizes:
        out[n] = np.array(
            [empirical_threshold(*sample(problem, n, rng), problem.alpha) for _ in range(repeats)]
        )
    return out


def _fit(sizes: tuple[int, ...], values: np.ndarray) -> tuple[float, float]:
    """Least-squares C, D of log(values) = C log(n) + D (values > 0)."""
    slope, intercept = np.polyfit(np.log(sizes), np.log(values), 1)
    return float(slope), float(intercept)


def _bootstrap_slopes(
    sizes: tuple[int, ...], excess: dict[int, np.ndarray], q: float, rounds: int, rng
) -> np.ndarray:
    """C_a refitted on resampled repetitions (percentile bootstrap)."""
    quantiles = np.empty((rounds, len(sizes)))
    for j, n in enumerate(sizes):
        values = excess[n]
        draws = rng.integers(0, values.size, size=(rounds, values.size))
        quantiles[:, j] = np.quantile(values[draws], q, axis=1)
    quantiles = np.maximum(quantiles, 1e-300)
    x = np.log(np.asarray(sizes, dtype=np.float64))
    x = x - x.mean()
    y = np.log(quantiles)
    return (y - y.mean(axis=1, keepdims=True)) @ x / (x @ x)


def _study(problem: NoiseProblem, sizes, repeats, quantile, bootstrap, rng) -> dict:
    thresholds = _simulate(problem, sizes, repeats, rng)
    roc_star = problem.roc_star
    rows, excess, cost = [], {}, {}
    for n in sizes:
        tpr, fpr = problem.rates(thresholds[n])
        excess[n] = roc_star - tpr
        slack = problem.alpha - fpr
        cost[n] = excess[n] - slack  # [ROC* − α] − [TPR − FPR] ≥ 0
        rows.append(
            {
                "n": n,
                "excess_quantile": float(np.quantile(excess[n], quantile)),
                "excess_mean": float(excess[n].mean()),
                "slack_quantile": float(np.quantile(slack, quantile)),
                "cost_sensitive_excess_quantile": float(np.quantile(cost[n], quantile)),
                "constraint_violated_fraction": float(np.mean(fpr > problem.alpha)),
                "threshold_mean": float(thresholds[n].mean()),
                "threshold_std": float(thresholds[n].std(ddof=1)),
            }
        )
    slope, intercept = _fit(sizes, np.array([r["excess_quantile"] for r in rows]))
    boot = _bootstrap_slopes(sizes, excess, quantile, bootstrap, rng)
    cost_q = np.array([r["cost_sensitive_excess_quantile"] for r in rows])
    return {
        "a": problem.a,
        "c": problem.c,
        "roc_star": roc_star,
        "theory_speed": -(2 + problem.a) / 4,
        "speed": slope,
        "intercept": intercept,
        "speed_interval": [float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))],
        "slack_speed": _fit(sizes, np.maximum([r["slack_quantile"] for r in rows], 1e-300))[0],
        # below ≈ 1e-12 the cost-sensitive excess is float rounding (a = 0.1: |t̂ − 1/2|^10)
        "cost_sensitive_speed": _fit(sizes, cost_q)[0] if (cost_q > 1e-12).all() else None,
        "rows": rows,
    }


def _check_options(a_values, alpha, m, sizes, repeats, quantile, bootstrap):
    problems = tuple(
        NoiseProblem(float(a), float(alpha), float(m)).check()
        for a in parse_sequence(a_values, "a_values", float)
    )
    sizes = tuple(sorted(set(parse_sequence(sizes, "sizes", int))))
    for n in sizes:
        check_scalar(n, "sizes", Interval("integer", 10, None))
    if len(sizes) < 2:
        raise ValueError("`sizes` needs at least two sample sizes to fit a speed.")
    check_scalar(repeats, "repeats", Interval("integer", 10, None))
    check_scalar(quantile, "quantile", Interval("real", 0, 1, closed="neither"))
    check_scalar(bootstrap, "bootstrap", Interval("integer", 10, None))
    return problems, sizes


@experiment(
    "fast-rates",
    summary="Empirical generalization speed of pointwise ROC optimization per noise exponent a.",
    reference="Vogel, Bellet, Clémençon, ICML 2018, Sec. 5.2, Fig. 2-3 (Thm. 2)",
)
def run(
    *,
    quick: bool = False,
    seed: int = 0,
    full: bool = False,
    a_values: tuple[float, ...] | None = None,
    alpha: float = 0.26,
    m: float = 0.35,
    sizes: tuple[int, ...] | None = None,
    repeats: int | None = None,
    quantile: float = 0.9,
    bootstrap: int = 200,
) -> ExperimentResult:
    """Fit the speed C_a of the 90% quantile of ROC*(α) − R⁺(Ŝ_n) against n for each a.

    Args:
        quick: a = 0.1, 0.5, 0.9, n up to 3,000, 100 repetitions: seconds.
        seed: Seed of every sample (same seed, same JSON).
        full: The paper's 1,000 repetitions per (a, n) instead of 200.
        a_values: Noise exponents a in (0, 1), comma-separated (default 0.1,0.3,0.5,0.7,0.9;
            0.1,0.5,0.9 with --quick).
        alpha: FPR level α (default 0.26, the paper's).
        m: End of the flat part of μ₁ (default 0.35, the paper's).
        sizes: Sample sizes n, comma-separated (default 100,200,500,...,10000).
        repeats: Repetitions per (a, n) (default 200; 1,000 with --full; 100 with --quick).
        quantile: Quantile of the excess that is fitted (default 0.9, the paper's).
        bootstrap: Bootstrap resamples for the interval of C_a (default 200).
    """
    check_scalar(seed, "seed", Interval("integer", 0, None))
    if a_values is None:
        a_values = (0.1, 0.5, 0.9) if quick else DEFAULT_A
    sizes = (QUICK_SIZES if quick else DEFAULT_SIZES) if sizes is None else sizes
    repeats = (1000 if full else 100 if quick else 200) if repeats is None else repeats
    problems, sizes = _check_options(a_values, alpha, m, sizes, repeats, quantile, bootstrap)
    *streams, figure_stream = np.random.SeedSequence(seed).spawn(len(problems) + 1)
    parts = progress(len(problems))  # one noise exponent a after the other
    studies = [
        _study(problem, sizes, repeats, quantile, bootstrap, np.random.default_rng(stream))
        for problem, stream in parts.track(
            zip(problems, streams, strict=True), lambda item: f"a = {item[0].a:g}"
        )
    ]
    data = {
        "alpha": alpha,
        "m": m,
        "quantile": quantile,
        "studies": studies,
        "settings": {
            "seed": seed,
            "quick": quick,
            "full": full,
            "repeats": repeats,
            "sizes": list(sizes),
            "bootstrap": bootstrap,
        },
    }
    trend = _trend(studies)
    data["trend"] = trend
    verdict = _verdict(studies, trend, quantile)
    figure = _figure(studies, problems, np.random.default_rng(figure_stream), quantile)
    return ExperimentResult("fast-rates", data, verdict, bool(trend["downward"]), figure)


def _trend(studies: list[dict]) -> dict:
    """Is C_a lower for the largest a than for the smallest, beyond the bootstrap intervals?"""
    a = np.array([s["a"] for s in studies])
    speeds = np.array([s["speed"] for s in studies])
    first, last = studies[int(a.argmin())], studies[int(a.argmax())]
    slope = float(np.polyfit(a, speeds, 1)[0]) if len(studies) > 1 else None
    return {
        "speed_vs_a_slope": slope,
        "theory_speed_vs_a_slope": -0.25,
        "downward": bool(
            len(studies) > 1 and last["speed_interval"][1] < first["speed_interval"][0]
        ),
    }


def _verdict(studies: list[dict], trend: dict, quantile: float) -> str:
    speeds = ", ".join(
        f"a={s['a']:g}: {s['speed']:.2f} [{s['speed_interval'][0]:.2f}, {s['speed_interval'][1]:.2f}]"
        for s in studies
    )
    theory = ", ".join(f"{s['theory_speed']:.2f}" for s in studies)
    outcome = (
        "C_a falls as a grows, as in the paper's Fig. 3"
        if trend["downward"]
        else "no downward trend of C_a with a beyond the bootstrap intervals (the paper's Fig. 3 "
        "shows one)"
    )
    return (
        f"fast-rates: fitted speed C_a of the {quantile:g}-quantile of ROC*(α) − R⁺(Ŝ_n): {speeds} "
        f"(Thm. 2: {theory}); {outcome}."
    )


def _figure(
    studies: list[dict],
    problems: tuple[NoiseProblem, ...],
    rng: np.random.Generator,
    quantile: float,
):
    figure, axes = new_figure(2, 2, size=(12.0, 8.4))
    (left, middle), (right, parts) = axes
    x = np.linspace(0, 1, 2001)
    shown = [problems[0], problems[-1]] if len(problems) > 1 else [problems[0]]
    for problem, color in zip(shown, ("tab:blue", "tab:red"), strict=False):
        left.plot(x, problem.mu1(x), color=color, label=f"μ₁, a = {problem.a:g}")
        xs, ys = sample(problem, 1000, rng)
        left.hist(
            xs[ys == 1],
            bins=40,
            range=(0, 1),
            weights=np.full((ys == 1).sum(), 2 * 40 / 1000),  # density of class 1 relative to μ
            histtype="step",
            color=color,
            alpha=0.6,
            label=f"class 1 of n = 1000, a = {problem.a:g}",
        )
    left.set(xlabel="x", ylabel="density", title="Fig. 2: μ₁ and a sample of n = 1000")
    left.legend(fontsize=7)

    colors = [f"C{i}" for i in range(len(studies))]
    for study, color in zip(studies, colors, strict=True):
        n = np.array([r["n"] for r in study["rows"]])
        q = np.array([r["excess_quantile"] for r in study["rows"]])
        middle.loglog(n, q, "o", color=color, ms=4)
        middle.loglog(
            n,
            np.exp(study["intercept"]) * n ** study["speed"],
            "-",
            color=color,
            label=f"a = {study['a']:g}: C_a = {study['speed']:.2f}",
        )
    middle.set(xlabel="n", ylabel=f"{100 * quantile:g}% quantile of ROC*(α) − R⁺(Ŝ_n)")
    middle.set_title("Fig. 3: generalization speed")
    middle.legend(fontsize=7)

    a = np.array([s["a"] for s in studies])
    speeds = np.array([s["speed"] for s in studies])
    low = speeds - np.array([s["speed_interval"][0] for s in studies])
    high = np.array([s["speed_interval"][1] for s in studies]) - speeds
    right.errorbar(
        a,
        speeds,
        yerr=[low, high],
        fmt="o",
        color="k",
        capsize=3,
        label="fitted C_a (95% bootstrap)",
    )
    grid = np.linspace(0, 1, 50)
    right.plot(grid, -(2 + grid) / 4, "--", color="tab:green", label="Thm. 2: −(2 + a)/4")
    right.axhline(-0.5, color="grey", ls=":", label="−1/2")
    right.set(xlabel="noise exponent a", ylabel="C_a", title="Speed per a")
    right.legend(fontsize=7)

    for study, color in zip(studies, colors, strict=True):
        n = np.array([r["n"] for r in study["rows"]])
        slack = np.array([r["slack_quantile"] for r in study["rows"]])
        cost = np.array([r["cost_sensitive_excess_quantile"] for r in study["rows"]])
        parts.loglog(n, slack, "-", color=color, label=f"a = {study['a']:g}: α − R⁻(Ŝ_n)")
        visible = cost > 1e-12  # below: float rounding
        if visible.any():
            parts.loglog(
                n[visible], cost[visible], "--", color=color, label="cost-sensitive excess"
            )
    parts.set(xlabel="n", ylabel=f"{100 * quantile:g}% quantile over repetitions")
    parts.set_title("Excess = constraint slack + cost-sensitive excess (Remark 1)")
    parts.legend(fontsize=6.5, ncol=2)
    return figure
