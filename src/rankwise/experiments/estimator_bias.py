"""``estimator-bias``: the biased AP estimator vs SOPRC's estimator (Wen et al., Sec. 3.3, Fig. 1, 4).

Reproduces the simulation study of Wen, Xu, Yang, He and Huang, *Exploring the Algorithm-Dependent
Generalization of AUPRC Optimization with List Stability* (NeurIPS 2022), Sec. 3.3, Fig. 1 and
App. B.2, Fig. 4: batches of B points with n⁺ = round(π₀ B) positives are drawn at sampling rates
π₀ from N scores of prior π, and the biased AP↓ of Eq. (5) (:func:`ap_estimator`) and SOPRC's
estimator of Eq. (8) (:func:`soprc_estimator`, TPR from the vector v of Alg. 1 or from all
positives) are compared with the full-data AUPRC↓ of Eq. (3)/(4) (:func:`full_data_loss`), for the
0-1 loss and the surrogates ℓ1, ℓ2 of Eq. (7) (imported from :mod:`rankwise.losses.soprc`, like φ;
the estimators are written here from the formulas), with σ(t) = t / (1 + t). Settings and measured
results: docs/experiments.md.

The biased estimator lies ABOVE the true AUPRC↓ for π₀ < π and BELOW it for π₀ > π (Remark 2 and
Prop. 2 state it the other way round; derivation in docs/experiments.md). SOPRC's limit is the
truth at every π₀, up to a small Jensen bias at finite batch size (term (a) of Eq. 25, O(1/n⁻)),
computed exactly for the 0-1 loss by :func:`expected_soprc_zero_one`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .._validation import Interval, check_scalar
from ._scores import DISTRIBUTIONS, ScoreModel, draw_population, score_model
from .base import ExperimentResult, experiment, new_figure, parse_sequence, progress

__all__ = [
    "LOSSES",
    "RankLoss",
    "SortedScores",
    "ap_estimator",
    "expected_soprc_zero_one",
    "full_data_loss",
    "run",
    "soprc_estimator",
]

LOSSES = ("zero_one", "surrogate")
PAPER_RATES = (0.01, 0.02, 0.03, 0.1, 0.2)
# ℓ2(x) = tanh(−x / (2 τ2)) is exactly 1.0 in float64 once −x / (2 τ2) ≥ 20 (1 − tanh(20) < 1e-17)
_TANH_SATURATION = 40.0


def _sigma(t: np.ndarray) -> np.ndarray:
    return t / (1.0 + t)


# -- sums of surrogate losses over sorted scores ---------------------------------------------------
@dataclass(frozen=True)
class SortedScores:
    """Scores sorted ascending with prefix sums, for O(log n) sums of ℓ1 / ℓ2 / ℓ_{0,1} per threshold.

    Attributes:
        values: (n,) sorted float64 scores.
        shift: their mean; prefix sums are of the centred scores (fewer digits lost).
        prefix1: (n + 1,) cumulative sums of values − shift, starting at 0.
        prefix2: (n + 1,) cumulative sums of (values − shift)².
    """

    values: np.ndarray
    shift: float
    prefix1: np.ndarray
    prefix2: np.ndarray

    @classmethod
    def of(cls, scores: np.ndarray, presorted: bool = False) -> SortedScores:
        """Sort ``scores`` (unless ``presorted``) and build the prefix sums."""
        values = np.asarray(scores, dtype=np.float64)
        if not presorted:
            values = np.sort(values)
        shift = float(values.mean()) if values.size else 0.0
        centred = values - shift
        zero = np.zeros(1)
        return cls(
            values,
            shift,
            np.concatenate([zero, np.cumsum(centred)]),
            np.concatenate([zero, np.cumsum(centred**2)]),
        )

    @property
    def size(self) -> int:
        """Number of scores."""
        return int(self.values.size)

    def count_at_or_above(self, c: np.ndarray) -> np.ndarray:
        """#{s ≥ c} for every threshold c: Σ ℓ_{0,1}(c − s), ℓ_{0,1}(x) = 1[x ≤ 0]."""
        return self.size - np.searchsorted(self.values, c, side="left")

    def huber_sums(self, c: np.ndarray, tau1: float) -> np.ndarray:
        """Σ_s ℓ1(c − s) for every threshold c, ℓ1 the one-sided Huber loss of Eq. (7).

        ℓ1(x) = 1 − 2x/τ1 for x < 0 (s > c), (1 − x/τ1)² for 0 ≤ x < τ1 (c − τ1 < s ≤ c) and 0
        beyond; both pieces are polynomials in s, summed with the prefix sums.
        """
        c = np.asarray(c, dtype=np.float64)
        lo = np.searchsorted(self.values, c - tau1, side="right")  # first s > c − τ1
        mid = np.searchsorted(self.values, c, side="right")  # first s > c
        n = self.size
        cc = c - self.shift
        # s > c: Σ (1 + 2 (s − c)/τ1)
        count_a = n - mid
        sum_a = self.prefix1[n] - self.prefix1[mid]
        linear = count_a + 2.0 * (sum_a - count_a * cc) / tau1
        # c − τ1 < s ≤ c: Σ ((s − d)/τ1)², d = c − τ1
        count_b = mid - lo
        s1 = self.prefix1[mid] - self.prefix1[lo]
        s2 = self.prefix2[mid] - self.prefix2[lo]
        d = cc - tau1
        quadratic = (s2 - 2.0 * d * s1 + d * d * count_b) / tau1**2
        return linear + np.maximum(quadratic, 0.0)

    def sigmoid_sums(self, c: np.ndarray, tau2: float) -> np.ndarray:
        """Σ_s ℓ2(c − s) for every threshold c, ℓ2(x) = tanh(−x/(2 τ2)) for x < 0, else 0.

        Only scores in (c, c + 40 τ2) need tanh; those above contribute exactly 1.0 in float64.
        """
        c = np.asarray(c, dtype=np.float64)
        lo = np.searchsorted(self.values, c, side="right")
        hi = np.searchsorted(self.values, c + _TANH_SATURATION * tau2, side="left")
        total = (self.size - hi).astype(np.float64)
        width = int((hi - lo).max()) if c.size else 0
        if width:
            index = lo[:, None] + np.arange(width)[None, :]
            inside = index < hi[:, None]
            gap = self.values[np.minimum(index, self.size - 1)] - c[:, None]
            total += np.where(inside, np.tanh(gap / (2.0 * tau2)), 0.0).sum(axis=1)
        return total


@dataclass(frozen=True)
class RankLoss:
    """The losses in the numerators and denominators of Eq. (3)-(8).

    Attributes:
        name: ``"zero_one"`` (ℓ_{0,1} everywhere, Eq. 3) or ``"surrogate"`` (ℓ1 in the FPR, ℓ2 in
            the TPR, Eq. 4, 5, 8).
        tau1: ℓ1 margin τ1.
        tau2: ℓ2 temperature τ2.
    """

    name: str
    tau1: float = 0.1
    tau2: float = 0.001

    def negative_sums(self, negatives: SortedScores, c: np.ndarray) -> np.ndarray:
        """Σ_{x⁻} ℓ(c − s(x⁻)) over ``negatives``: the FPR numerator."""
        if self.name == "zero_one":
            return negatives.count_at_or_above(c).astype(np.float64)
        return negatives.huber_sums(c, self.tau1)

    def tpr_counts(self, reference: SortedScores, c: np.ndarray, holds_c: bool) -> np.ndarray:
        """1 + Σ_{x ≠ x⁺} ℓ(c − s(x)) over ``reference``: the TPR numerator.

        ``holds_c`` says whether every threshold c is itself one of the reference scores (batch or
        all positives; not v): for ℓ_{0,1} the count of s ≥ c then already includes x⁺, for ℓ2
        (ℓ2(0) = 0) it never does.
        """
        if self.name == "zero_one":
            counts = reference.count_at_or_above(c).astype(np.float64)
            return counts if holds_c else counts + 1.0
        return 1.0 + reference.sigmoid_sums(c, self.tau2)


# -- the estimators -------------------------------------------------------------------------------
def ap_estimator(positives: np.ndarray, negatives: np.ndarray, loss: RankLoss) -> float:
    """The biased AP↓ of Eq. (5) on one batch: batch FPR and batch TPR, no prior.

    Args:
        positives: (n⁺,) positive scores of the batch.
        negatives: (n⁻,) negative scores of the batch.
        loss: the 0-1 loss or the surrogates.
    """
    pos = SortedScores.of(positives)
    numerator = loss.negative_sums(SortedScores.of(negatives), pos.values)
    return float(np.mean(_sigma(numerator / loss.tpr_counts(pos, pos.values, holds_c=True))))


def soprc_estimator(
    positives: np.ndarray,
    negatives: np.ndarray,
    prior: float,
    loss: RankLoss,
    tpr_reference: np.ndarray | SortedScores,
    reference_holds_positives: bool,
) -> float:
    """SOPRC's estimator, Eq. (8), on one batch: batch FPR, prior π, TPR from a reference.

    Args:
        positives: (n⁺,) positive scores of the batch.
        negatives: (n⁻,) negative scores of the batch.
        prior: π, the positive rate of the full data.
        loss: the 0-1 loss or the surrogates.
        tpr_reference: v (sorted, |v| values) or all N⁺ positive scores of the data.
        reference_holds_positives: True for all positives (TPR = (1 + Σ_{x≠x⁺} ℓ)/N⁺), False for
            v (TPR = (1 + Σ_j ℓ(s⁺ − v_j))/(|v| + 1)).
    """
    reference = (
        tpr_reference if isinstance(tpr_reference, SortedScores) else SortedScores.of(tpr_reference)
    )
    c = np.asarray(positives, dtype=np.float64)
    fpr = loss.negative_sums(SortedScores.of(negatives), c) / len(negatives)
    size = reference.size if reference_holds_positives else reference.size + 1
    tpr = loss.tpr_counts(reference, c, holds_c=reference_holds_positives) / size
    return float(np.mean(_sigma((1 - prior) / prior * fpr / tpr)))


def full_data_loss(
    positives: SortedScores, negatives: SortedScores, loss: RankLoss
) -> tuple[float, float]:
    """The full-data AUPRC↓ of Eq. (3) (0-1 loss) or its surrogate f(w; S) of Eq. (4).

    Returns:
        (value, prior) with prior π = N⁺ / (N⁺ + N⁻).
    """
    prior = positives.size / (positives.size + negatives.size)
    c = positives.values
    fpr = loss.negative_sums(negatives, c) / negatives.size
    tpr = loss.tpr_counts(positives, c, holds_c=True) / positives.size
    return float(np.mean(_sigma((1 - prior) / prior * fpr / tpr))), prior


def expected_soprc_zero_one(
    positives: SortedScores, negatives: SortedScores, n_negatives: int
) -> float:
    """The exact expectation of SOPRC's 0-1 estimator with TPR from all positives.

    Every batch positive is uniform on S⁺ and the number j of batch negatives scoring ≥ s⁺ is
    hypergeometric (n⁻ draws from N⁻, K of them ≥ s⁺), so
    E = mean_{s⁺ ∈ S⁺} Σ_j P(j) σ((1 − π)/π · (j / n⁻) / TPR(s⁺)).
    """
    from scipy.special import gammaln

    def log_choose(n: np.ndarray, k: np.ndarray) -> np.ndarray:
        return gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)

    prior = positives.size / (positives.size + negatives.size)
    above = negatives.count_at_or_above(positives.values).astype(np.float64)
    tpr = positives.count_at_or_above(positives.values) / positives.size
    n, total_negatives = n_negatives, float(negatives.size)
    log_all = log_choose(np.float64(total_negatives), np.float64(n))
    total = 0.0
    for start in range(0, positives.size, 256):
        k = above[start : start + 256, None]
        # j beyond 12 standard deviations of the hypergeometric mean has pmf < 1e-30: skip it
        fraction = k / total_negatives
        spread = 12.0 * np.sqrt(n * fraction * (1 - fraction)).max() + 5.0
        j_lo = max(0, math.floor(n * fraction.min() - spread))
        j_hi = min(n, math.ceil(n * fraction.max() + spread))
        j = np.arange(j_lo, j_hi + 1, dtype=np.float64)[None, :]
        possible = (j <= k) & (n - j <= total_negatives - k)
        jj = np.where(possible, j, 0.0)
        kk = np.broadcast_to(k, jj.shape)
        log_pmf = log_choose(kk, jj) + log_choose(total_negatives - kk, n - jj) - log_all
        pmf = np.where(possible, np.exp(log_pmf), 0.0)
        odds = (1 - prior) / prior * (j / n) / tpr[start : start + 256, None]
        total += float(np.sum(pmf * _sigma(odds)))
    return total / positives.size


# -- the simulation --------------------------------------------------------------------------------
ESTIMATORS = ("ap", "soprc", "soprc_all_positives")


@dataclass(frozen=True)
class _Settings:
    model: ScoreModel
    prior: float
    batch_size: int
    repeats: int
    beta: float
    burn_in: int
    num_v: int
    losses: tuple[RankLoss, ...]


def _simulate_rate(
    rate: float,
    positives: SortedScores,
    negatives: SortedScores,
    settings: _Settings,
    rng: np.random.Generator,
) -> dict[str, dict[str, np.ndarray]]:
    """One rate: ``burn_in`` batches settle v, then loss -> estimator -> (repeats,) measurements."""
    n_pos = int(round(rate * settings.batch_size))
    n_neg = settings.batch_size - n_pos
    out = {
        loss.name: {e: np.empty(settings.repeats) for e in ESTIMATORS} for loss in settings.losses
    }
    v = None
    for step in range(settings.burn_in + settings.repeats):
        batch_pos = positives.values[rng.choice(positives.size, n_pos, replace=False)]
        batch_neg = negatives.values[rng.choice(negatives.size, n_neg, replace=False)]
        phi = settings.model.phi(batch_pos, settings.num_v)
        # Alg. 1: v_{t+1} = (1 − β) v_t + β φ(h(z⁺)), then the loss uses v_{t+1}; v_1 = φ of the
        # first batch (Remark 1: v_1 ≈ E[φ]) and the burn-in forgets it
        v = phi if v is None else (1 - settings.beta) * v + settings.beta * phi
        if step < settings.burn_in:
            continue
        i = step - settings.burn_in
        v_sorted = SortedScores.of(v, presorted=True)  # φ is non-decreasing, so is any average
        for loss in settings.losses:
            row = out[loss.name]
            row["ap"][i] = ap_estimator(batch_pos, batch_neg, loss)
            row["soprc"][i] = soprc_estimator(
                batch_pos, batch_neg, settings.prior, loss, v_sorted, False
            )
            row["soprc_all_positives"][i] = soprc_estimator(
                batch_pos, batch_neg, settings.prior, loss, positives, True
            )
    return out


def _rows(rates, n_pos, values: dict[str, list[np.ndarray]], estimator: str) -> list[dict]:
    return [
        {
            "sampling_rate": rate,
            "batch_positives": n,
            "ap_mean": float(ap.mean()),
            "ap_std": float(ap.std(ddof=1)),
            "soprc_mean": float(so.mean()),
            "soprc_std": float(so.std(ddof=1)),
        }
        for rate, n, ap, so in zip(rates, n_pos, values["ap"], values[estimator], strict=True)
    ]


def _checks(rows: list[dict], truth: float, prior: float, repeats: int) -> dict:
    """z-scores of both estimators' mean errors, and whether they behave as derived."""
    root = math.sqrt(repeats)
    ap_z = [(r["ap_mean"] - truth) / (r["ap_std"] / root) for r in rows]
    soprc_z = [(r["soprc_mean"] - truth) / (r["soprc_std"] / root) for r in rows]
    ap_bias = [r["ap_mean"] - truth for r in rows]
    soprc_bias = [r["soprc_mean"] - truth for r in rows]
    off_prior = [k for k, r in enumerate(rows) if not math.isclose(r["sampling_rate"], prior)]
    sign_ok = all(
        (ap_z[k] > 3) if rows[k]["sampling_rate"] < prior else (ap_z[k] < -3) for k in off_prior
    )
    ap_worst = max((abs(ap_bias[k]) for k in off_prior), default=0.0)
    soprc_worst = max(abs(b) for b in soprc_bias)
    ap_spread = max(ap_bias) - min(ap_bias)
    soprc_spread = max(soprc_bias) - min(soprc_bias)
    return {
        "note": "z = (mean - truth) / (std / sqrt(repeats)); batches that share v are correlated, "
        "so the z of SOPRC with TPR from v overstates its significance",
        "ap_bias": ap_bias,
        "ap_z": ap_z,
        "soprc_bias": soprc_bias,
        "soprc_z": soprc_z,
        "ap_sign_as_derived": bool(sign_ok),
        "ap_max_abs_bias_off_prior": ap_worst,
        "soprc_max_abs_bias": soprc_worst,
        "ap_spread_across_rates": ap_spread,
        "soprc_spread_across_rates": soprc_spread,
        # sampling-rate invariance (Prop. 2): SOPRC's mean moves little across π₀ where AP's moves,
        # and its remaining (Jensen, O(1/n⁻)) bias is well below AP's
        "soprc_invariant": bool(soprc_spread < 0.25 * ap_spread) if len(rows) > 1 else None,
        "soprc_bias_below_ap": bool(soprc_worst < 0.5 * ap_worst) if off_prior else None,
    }


def _check_options(
    distribution, repeats, batch_size, sampling_rates, prior, num_points, beta, num_v, tau1, tau2
):
    model = score_model(distribution)
    check_scalar(repeats, "repeats", Interval("integer", 2, None))
    check_scalar(batch_size, "batch_size", Interval("integer", 2, None))
    rates = parse_sequence(sampling_rates, "sampling_rates", float)
    for rate in rates:
        check_scalar(rate, "sampling_rates", Interval("real", 0, 1, closed="neither"))
    check_scalar(prior, "prior", Interval("real", 0, 1, closed="neither"))
    check_scalar(num_points, "num_points", Interval("integer", 10, None))
    check_scalar(beta, "beta", Interval("real", 0, 1, closed="right"))
    if num_v is not None:
        check_scalar(num_v, "num_v", Interval("integer", 1, None))
    check_scalar(tau1, "tau1", Interval("real", 0, None, closed="neither"))
    check_scalar(tau2, "tau2", Interval("real", 0, None, closed="neither"))
    n_total_pos = int(round(prior * num_points))
    for rate in rates:
        n_pos = int(round(rate * batch_size))
        if n_pos < 2 or batch_size - n_pos < 1:
            raise ValueError(
                f"`batch_size` {batch_size} at sampling rate {rate:g} gives {n_pos} positive(s) and "
                f"{batch_size - n_pos} negative(s); every batch needs ≥ 2 positives (φ extrapolates "
                f"from two) and ≥ 1 negative: use a batch size ≥ {math.ceil(1.5 / rate)}."
            )
        if n_pos > n_total_pos or batch_size - n_pos > num_points - n_total_pos:
            raise ValueError(
                f"`batch_size` {batch_size} at sampling rate {rate:g} needs more points than the "
                f"{num_points} of the data set; raise `num_points` or lower `batch_size`."
            )
    return model, tuple(sorted(rates))


@experiment(
    "estimator-bias",
    summary="Biased AP estimator (Eq. 5) vs SOPRC (Eq. 8) vs the true AUPRC loss across π₀.",
    reference="Wen et al., NeurIPS 2022, Sec. 3.3, Fig. 1, App. B.2, Fig. 4",
)
def run(
    *,
    quick: bool = False,
    seed: int = 0,
    distribution: str = "binormal",
    repeats: int | None = None,
    batch_size: int = 1000,
    sampling_rates: tuple[float, ...] = PAPER_RATES,
    prior: float = 0.1,
    num_points: int | None = None,
    beta: float | None = None,
    num_v: int | None = None,
    tau1: float = 0.1,
    tau2: float = 0.001,
) -> ExperimentResult:
    """Estimate the AUPRC loss from batches at several sampling rates with Eq. (5) and Eq. (8).

    Args:
        quick: 20,000 points, 100 repeats, β = 0.02: seconds instead of a minute.
        seed: Seed of the data set and of every batch (same seed, same JSON).
        distribution: Score model of App. B.2: binormal, bibeta or offset-uniform.
        repeats: Batches per sampling rate (default 500, the paper's; 100 with --quick).
        batch_size: Points per batch B; a batch holds round(π₀ B) positives (default 1000).
        sampling_rates: Rates π₀ of positives in a batch, comma-separated (default the paper's).
        prior: Positive rate π of the data set (default 0.1).
        num_points: Size N of the data set (default 100,000; 20,000 with --quick).
        beta: Moving-average rate β of v, Eq. (10) (default 0.01; 0.02 with --quick); the first
            ceil(4/β) batches of each rate settle v and are not measured.
        num_v: Length |v| of the auxiliary vector (default N⁺, as in the paper).
        tau1: Margin τ1 of the surrogate ℓ1 (default 0.1).
        tau2: Temperature τ2 of the surrogate ℓ2 (default 0.001).
    """
    check_scalar(seed, "seed", Interval("integer", 0, None))
    repeats = (100 if quick else 500) if repeats is None else repeats
    num_points = (20_000 if quick else 100_000) if num_points is None else num_points
    beta = (0.02 if quick else 0.01) if beta is None else beta
    model, rates = _check_options(
        distribution,
        repeats,
        batch_size,
        sampling_rates,
        prior,
        num_points,
        beta,
        num_v,
        tau1,
        tau2,
    )
    streams = np.random.SeedSequence(seed).spawn(len(rates) + 1)
    pos_scores, neg_scores = draw_population(
        model, num_points, prior, np.random.default_rng(streams[0])
    )
    positives = SortedScores.of(pos_scores, presorted=True)
    negatives = SortedScores.of(neg_scores, presorted=True)
    losses = tuple(RankLoss(name, float(tau1), float(tau2)) for name in LOSSES)
    settings = _Settings(
        model,
        positives.size / num_points,
        batch_size,
        repeats,
        float(beta),
        math.ceil(4 / beta),
        positives.size if num_v is None else num_v,
        losses,
    )
    parts = progress(len(rates))  # one sampling rate after the other (13-26 s each)
    per_rate = [
        _simulate_rate(rate, positives, negatives, settings, np.random.default_rng(stream))
        for rate, stream in parts.track(
            zip(rates, streams[1:], strict=True), lambda item: f"π₀ = {item[0]:g}"
        )
    ]
    values = {
        loss.name: {e: [r[loss.name][e] for r in per_rate] for e in ESTIMATORS} for loss in losses
    }
    n_pos = [int(round(r * batch_size)) for r in rates]
    truths = {loss.name: full_data_loss(positives, negatives, loss)[0] for loss in losses}
    expected = [expected_soprc_zero_one(positives, negatives, batch_size - n) for n in n_pos]
    data = _assemble(rates, n_pos, values, truths, expected, settings)
    data["settings"] = {
        "seed": seed,
        "quick": quick,
        "num_points": num_points,
        "num_positives": positives.size,
        "prior": settings.prior,
        "batch_size": batch_size,
        "repeats": repeats,
        "beta": settings.beta,
        "burn_in_batches": settings.burn_in,
        "num_v": settings.num_v,
        "tau1": float(tau1),
        "tau2": float(tau2),
        "score_range_of_phi": model.score_range,
    }
    verdict, consistent = _verdict(data, model)
    figure = _figure(data, model)
    return ExperimentResult("estimator-bias", data, verdict, consistent, figure)


_CASES = {
    # case key: (loss, SOPRC estimator, description)
    "zero_one_all_positives": (
        "zero_one",
        "soprc_all_positives",
        "0-1 loss, TPR from all positives",
    ),
    "surrogate": ("surrogate", "soprc", "surrogates ℓ1/ℓ2 (Eq. 4, 5, 8), TPR from v"),
    "surrogate_all_positives": (
        "surrogate",
        "soprc_all_positives",
        "surrogates ℓ1/ℓ2, TPR from all positives",
    ),
}


def _assemble(rates, n_pos, values, truths, expected, settings: _Settings) -> dict:
    rows = _rows(rates, n_pos, values["zero_one"], "soprc")
    data = {
        "distribution": settings.model.name,
        "true_auprc_loss": truths["zero_one"],
        "rows": rows,
        "case": "0-1 loss (Eq. 3, 5, 8), TPR from v (Alg. 1)",
        "checks": _checks(rows, truths["zero_one"], settings.prior, settings.repeats),
        "cases": {},
    }
    for key, (loss, estimator, description) in _CASES.items():
        case_rows = _rows(rates, n_pos, values[loss], estimator)
        data["cases"][key] = {
            "case": description,
            "true_loss": truths[loss],
            "rows": case_rows,
            "checks": _checks(case_rows, truths[loss], settings.prior, settings.repeats),
        }
    data["cases"]["zero_one_all_positives"]["exact_soprc_expectation"] = expected
    return data


def _verdict(data: dict, model: ScoreModel) -> tuple[str, bool]:
    truth = data["true_auprc_loss"]
    rows, checks = data["rows"], data["checks"]
    low, high = rows[0], rows[-1]
    soprc_lo = min(checks["soprc_bias"])
    soprc_hi = max(checks["soprc_bias"])
    surrogate = data["cases"]["surrogate"]["checks"]
    consistent = all(
        c["ap_sign_as_derived"]
        and c["soprc_invariant"] is not False
        and c["soprc_bias_below_ap"] is not False
        for c in (checks, surrogate)
    )
    sign = "as derived" if checks["ap_sign_as_derived"] else "NOT as derived"
    verdict = (
        f"estimator-bias ({model.name}, 0-1 loss): true AUPRC↓ {truth:.4f}; AP↓ (Eq. 5) "
        f"{low['ap_mean'] - truth:+.4f} at π₀={low['sampling_rate']:g} and "
        f"{high['ap_mean'] - truth:+.4f} at π₀={high['sampling_rate']:g} (above the truth for "
        f"π₀ < π, below for π₀ > π: {sign}); SOPRC (Eq. 8, v) stays within "
        f"[{soprc_lo:+.4f}, {soprc_hi:+.4f}] at every π₀; surrogates: "
        f"{'same picture' if surrogate['ap_sign_as_derived'] else 'AP sign NOT as derived'}."
    )
    return verdict, consistent


def _figure(data: dict, model: ScoreModel):
    figure, axes = new_figure(1, 2, size=(12.0, 4.6))
    panels = [
        (
            "0-1 loss (Eq. 3, 5, 8)",
            data["true_auprc_loss"],
            data["rows"],
            data["cases"]["zero_one_all_positives"]["rows"],
        ),
        (
            "surrogates ℓ1, ℓ2 (Eq. 4, 5, 8)",
            data["cases"]["surrogate"]["true_loss"],
            data["cases"]["surrogate"]["rows"],
            data["cases"]["surrogate_all_positives"]["rows"],
        ),
    ]
    prior = data["settings"]["prior"]
    for ax, (title, truth, rows, rows_all) in zip(axes[0], panels, strict=True):
        rates = np.array([r["sampling_rate"] for r in rows])
        series = [
            ("AP↓ (Eq. 5, batch TPR)", rows, "ap", "tab:orange", 0.96),
            ("SOPRC (Eq. 8, TPR from v)", rows, "soprc", "tab:blue", 1.0),
            ("SOPRC (TPR from all positives)", rows_all, "soprc", "tab:green", 1.04),
        ]
        for label, source, key, color, offset in series:
            ax.errorbar(
                rates * offset,
                [r[f"{key}_mean"] for r in source],
                yerr=[r[f"{key}_std"] for r in source],
                fmt="o-",
                color=color,
                capsize=3,
                ms=4,
                label=label,
            )
        ax.axhline(truth, color="k", lw=1.2, label=f"full-data value {truth:.3f}")
        ax.axvline(prior, color="grey", ls=":", lw=1, label=f"π = {prior:g}")
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.set_xlabel("sampling rate π₀ (positives per batch / batch size)")
        ax.set(ylabel="AUPRC loss (mean ± std over batches)", title=title)
        ax.legend(fontsize=8)
    figure.suptitle(f"Estimator bias, {DISTRIBUTIONS[model.name].label}")
    return figure
