"""Tie-aware AP and NDCG losses for learning binary codes (TALR).

He, Cakir, Bargal & Sclaroff, "Hashing as Tie-Aware Learning to Rank" (CVPR 2018), Sec. 4 and
App. B. Within a minibatch every item is a query against the others (or against a reference
set). With relaxed codes ``φ ∈ (-1, 1)^b`` (``tanh(γ f / 2)``, see
:class:`rankwise.hashing.HashingHead`) the relaxed Hamming distance is ``(b - φᵀφ') / 2``
(Eq. 1); it is spread over ``K + 1`` bins ``0, b/K, ..., b`` by the triangular kernel of width
``Δ`` (Sec. 4.2, Eq. 12-13), giving soft histograms ``c_{d,v}`` per affinity level and their
cumulative sums ``C_d``. The objective is tie-aware AP (Eq. 6 / 11) or DCG (Eq. 7 / 12) of these
soft histograms, averaged over the queries; the loss is ``1 - mean``.

Eq. (11)/(12) diverge at the first non-empty bin and Eq. (11) has a pole where a soft bin holds
one item's mass; ``form="exact"`` (default) adds back what their integrals dropped (docs/hashing.md):

* AP: ``AP(d) = c_d^+ / (c_d N^+) [(C^+_{d-1} + 1) ΔH + (c_d^+ - 1) F(C_{d-1}, c_d)]`` with the
  harmonic numbers ``H(x) = ψ(x + 1) + γ_E`` of Eq. (24), ``ΔH = H(C_d) - H(C_{d-1})`` and
  ``F(g, n) = (n - (g + 1) ΔH) / (n - 1)`` (removable pole at ``n = 1``).
* DCG: ``DCG(d) = (Σ_v G(v) c_{d,v}) / c_d · (S(C_d) - S(C_{d-1}))`` (Eq. 7 / 19), ``S`` the
  continued cumulative discount of :func:`relaxed_cumulative_discount`.

With hard codes the objectives equal AP_T and NDCG_T of
:func:`rankwise.metrics.hamming_retrieval_metrics` exactly. ``form="midpoint"`` is the released
code's simplification, exact without ties (docs/hashing.md); both forms are differentiated by
autograd. NDCG divides by the exact ideal DCG of the query's affinities.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch

from .._affinity import affinity_levels, check_affinity
from .._validation import Interval, check_choice, check_embeddings, check_finite, check_scalar
from .base import PairBatch, RankingLoss

__all__ = [
    "TieAwareAPLoss",
    "TieAwareNDCGLoss",
    "FORMS",
    "relaxed_harmonic",
    "trigamma",
    "relaxed_cumulative_discount",
    "logarithmic_integral",
    "soft_histograms",
    "tie_aware_ap_relaxation",
    "tie_aware_dcg_relaxation",
    "affinity_levels",
]

FORMS = ("exact", "midpoint")
_EULER_GAMMA = 0.57721566490153286061
_LN2 = math.log(2.0)
_SHIFT = 32  # M: positions summed exactly before the Euler-Maclaurin tail takes over
_TAYLOR_RADIUS = 1e-4
_CODE_BOUND = (
    1.0 + 1e-6
)  # relaxed codes beyond [-1, 1] by more than rounding are refused  # |n - 1| / (g + 2) below which F(g, n) uses its Taylor series


# -- special functions (autograd-friendly, float64) ------------------------------------------------


def relaxed_harmonic(x: torch.Tensor) -> torch.Tensor:
    """``H(x) = ψ(x + 1) + γ_E``: the harmonic numbers continued to real ``x > -1``."""
    return torch.digamma(x + 1.0) + _EULER_GAMMA


def trigamma(x: torch.Tensor) -> torch.Tensor:
    """``ψ'(x)`` for ``x > 0`` to float64 accuracy, differentiable.

    ``torch.polygamma(1, ·)`` is only accurate to about 1e-9 in float64; here the recurrence
    ``ψ'(x) = 1 / x² + ψ'(x + 1)`` moves the argument past 10, where the asymptotic series
    ``1/y + 1/(2y²) + Σ B_{2k} / y^{2k+1}`` is accurate to rounding.
    """
    shifted = x + 10.0
    head = sum(1.0 / (x + k) ** 2 for k in range(10))
    inv = 1.0 / shifted
    inv2 = inv * inv
    series = inv * (
        1.0
        + inv / 2
        + inv2 * (1 / 6 + inv2 * (-1 / 30 + inv2 * (1 / 42 + inv2 * (-1 / 30 + inv2 * 5 / 66))))
    )
    return head + series


def logarithmic_integral(x: torch.Tensor, x_max: float | None = None) -> torch.Tensor:
    """``Li(x) = Ei(ln x)`` for ``x > 1`` by its convergent series (all terms positive).

    ``Ei(u) = γ_E + ln u + Σ_{k≥1} u^k / (k · k!)``; the number of terms is chosen from the
    largest argument so that the tail is below float64 resolution: ``x_max`` when given (a bound
    known on the host: no read of ``x``), else ``x.max()`` (a host read).
    """
    u = torch.log(x.to(torch.float64))
    if x_max is not None:
        u_max = max(math.log(x_max), 1.0)
    else:
        u_max = max(float(u.detach().max()) if u.numel() else 1.0, 1.0)
    n_terms = _series_terms(math.ceil(u_max))
    k = torch.arange(1, n_terms + 1, dtype=u.dtype, device=u.device)
    log_coef = -torch.log(k) - torch.lgamma(k + 1.0)  # 1 / (k · k!)
    total = (u.unsqueeze(-1) ** k * torch.exp(log_coef)).sum(-1)
    return _EULER_GAMMA + torch.log(u) + total


@lru_cache(maxsize=64)
def _series_terms(u_max: int) -> int:
    """Terms of the Ei series after which the tail is below 1e-17 of the sum, for u <= u_max."""
    k, term = 1, float(u_max)
    while not (k > u_max and term < 1e-17):
        k += 1
        term *= u_max / k
    return k + 1


def _discount_tail(y: torch.Tensor, y_max: float | None = None) -> torch.Tensor:
    """``S_∞(y)`` without its constant: Li integral plus Euler-Maclaurin terms (y large)."""
    u = y + 1.0
    lg = torch.log(u)
    d0 = _LN2 / lg
    d1 = -_LN2 / (lg**2 * u)
    d3 = -2 * _LN2 * (lg**2 + 3 * lg + 3) / (lg**4 * u**3)
    d5 = -2 * _LN2 * (12 * lg**4 + 50 * lg**3 + 105 * lg**2 + 120 * lg + 60) / (lg**6 * u**5)
    u_max = None if y_max is None else y_max + 1.0
    return _LN2 * logarithmic_integral(u, u_max) + d0 / 2 + d1 / 12 - d3 / 720 + d5 / 30240


@lru_cache(maxsize=1)
def _discount_constant() -> float:
    exact = math.fsum(1.0 / math.log2(t + 1) for t in range(1, _SHIFT + 1))
    tail = _discount_tail(torch.tensor([float(_SHIFT)], dtype=torch.float64))
    return exact - float(tail[0])


def relaxed_cumulative_discount(x: torch.Tensor, x_max: float | None = None) -> torch.Tensor:
    """``S(x)``: ``Σ_{t=1}^{x} 1 / log2(t + 1)`` continued smoothly to real ``x > -1``.

    ``S(x) = S_∞(x + 32) - Σ_{t=1}^{32} D(x + t)`` with
    ``S_∞(y) = ln 2 Li(y + 1) + D(y)/2 + D'(y)/12 - D'''(y)/720 + D^(5)(y)/30240 + const``;
    exact (to float64 rounding) at every integer. ``x_max``: the largest ``x`` if known on the
    host (it sizes the series of :func:`logarithmic_integral` without reading ``x``).
    """
    x = x.to(torch.float64)
    shifts = torch.arange(1, _SHIFT + 1, dtype=torch.float64, device=x.device)
    head = (_LN2 / torch.log1p(x.unsqueeze(-1) + shifts)).sum(-1)
    y_max = None if x_max is None else x_max + _SHIFT
    return _discount_constant() + _discount_tail(x + _SHIFT, y_max) - head


# -- soft histograms -------------------------------------------------------------------------------


def soft_histograms(
    distances: torch.Tensor, weights: torch.Tensor, bits: int, num_bins: int, delta: float
) -> torch.Tensor:
    """``Σ_j weights[..., j, w] δ(distances[i, j], centre_k)`` for every bin (TALR Eq. 12-13).

    Args:
        distances: ``(B, M)`` relaxed Hamming distances in ``[0, bits]``.
        weights: ``(B, M, W)`` what each reference item adds (its masks / gains).
        bits: code length ``b``: the bins span ``[0, b]``.
        num_bins: ``K``; bin centres ``k · b / K``, ``k = 0..K``.
        delta: half-width of the triangular kernel ``δ(z, c) = max(0, 1 - |z - c| / Δ)``; each
            item's kernel weights are normalised to sum to 1 (they already do when ``Δ`` is the
            bin spacing, the default), so every item adds exactly its weight to the histogram.

    Returns:
        ``(B, num_bins + 1, W)`` soft counts, bins by increasing distance.
    """
    spacing = bits / num_bins
    if math.isclose(delta, spacing, rel_tol=1e-12):
        # Δ = spacing: the kernel splits z linearly between its two neighbouring centres, so
        # two scatter-adds replace the (B, M, K + 1) kernel matrix
        position = (distances / spacing).clamp(0.0, float(num_bins))
        # NaN distances (codes refused on the device, the error raised later) index bin 0
        lower = position.detach().nan_to_num(0.0).floor().clamp_max(num_bins - 1).long()
        frac = (position - lower).unsqueeze(-1)
        hist = distances.new_zeros(distances.shape[0], num_bins + 1, weights.shape[-1])
        index = lower.unsqueeze(-1).expand_as(weights)
        hist = hist.scatter_add(1, index, (1.0 - frac) * weights)
        return hist.scatter_add(1, index + 1, frac * weights)
    centres = torch.linspace(0.0, float(bits), num_bins + 1, dtype=distances.dtype)
    kernel = 1.0 - (distances.unsqueeze(-1) - centres.to(distances.device)).abs() / delta
    kernel = kernel.clamp_min(0.0)  # (B, M, K + 1)
    total = kernel.sum(-1, keepdim=True)
    kernel = kernel / torch.where(total > 0, total, torch.ones_like(total))
    return torch.einsum("bmk,bmw->bkw", kernel, weights)


# -- the relaxed objectives ------------------------------------------------------------------------


def _within_tie_term(above: torch.Tensor, size: torch.Tensor, delta_h: torch.Tensor):
    """``F(g, n) = (n - (g + 1) ΔH) / (n - 1)`` with its removable pole at ``n = 1``.

    ``ψ(g + 2) - ψ(g + 1) = 1 / (g + 1)`` turns it into ``1 - (g + 1) [ψ(x + ε) - ψ(x)] / ε``
    (``x = g + 2``, ``ε = n - 1``), a divided difference of ψ. Within ``|ε| < 1e-4 x`` its Taylor
    series (derivatives of ψ up to the fourth) is used, whose truncation error is below
    ``ε⁴ / (5 x⁴)``; outside it the direct form, whose rounding error is below
    ``1e-16 x ln(x) / |ε|``: both stay near 1e-12 everywhere.
    """
    x = above + 2.0
    eps = size - 1.0
    near = eps.abs() < _TAYLOR_RADIUS * x
    safe_eps = torch.where(near, torch.ones_like(eps), eps)
    direct = (size - (above + 1.0) * delta_h) / safe_eps
    e = torch.where(near, eps, torch.zeros_like(eps))
    slope = (
        trigamma(x)
        + torch.polygamma(2, x) * e / 2
        + torch.polygamma(3, x) * e**2 / 6
        + torch.polygamma(4, x) * e**3 / 24
    )
    return torch.where(near, 1.0 - (above + 1.0) * slope, direct)


def _previous(cumulative: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum along dim 1 (``C_{d-1}``) from the inclusive one."""
    return torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)


def tie_aware_ap_relaxation(
    pos_hist: torch.Tensor, all_hist: torch.Tensor, n_pos: torch.Tensor, form: str = "exact"
) -> torch.Tensor:
    """Relaxed AP_T of every query from its soft histograms (TALR Eq. 11 / 24; module docstring).

    Args:
        pos_hist: ``(B, K + 1)`` soft counts of relevant items per bin (``c_d^+``).
        all_hist: ``(B, K + 1)`` soft counts of all ranked items per bin (``c_d``).
        n_pos: ``(B,)`` number of relevant items ``N^+`` (> 0).
        form: ``"exact"`` or ``"midpoint"``.

    Returns:
        ``(B,)`` float64.
    """
    cp = pos_hist.to(torch.float64)
    c = all_hist.to(torch.float64)
    cum_p, cum = cp.cumsum(1), c.cumsum(1)
    prev_p, prev = _previous(cum_p), _previous(cum)
    if form == "midpoint":
        terms = cp * (prev_p + cum_p + 1.0) / (prev + cum + 1.0)
        return terms.sum(1) / n_pos.to(torch.float64)
    occupied = c > 0
    c_safe = torch.where(occupied, c, torch.ones_like(c))
    at_cum = relaxed_harmonic(cum)
    delta_h = at_cum - _previous(at_cum)  # H(C_{d-1}) is the previous bin's H(C_d); H(0) = 0
    inner = (prev_p + 1.0) * delta_h + (cp - 1.0) * _within_tie_term(prev, c, delta_h)
    terms = torch.where(occupied, cp / c_safe * inner, torch.zeros_like(c))
    return terms.sum(1) / n_pos.to(torch.float64)


def tie_aware_dcg_relaxation(
    gain_hist: torch.Tensor,
    all_hist: torch.Tensor,
    form: str = "exact",
    max_count: float | None = None,
) -> torch.Tensor:
    """Relaxed DCG_T of every query from its soft histograms (TALR Eq. 12 / 19).

    Args:
        gain_hist: ``(B, K + 1)`` soft sums of gains ``Ĝ_d = Σ_v G(v) c_{d,v}`` per bin.
        all_hist: ``(B, K + 1)`` soft counts of all ranked items per bin.
        form: ``"exact"`` or ``"midpoint"``.
        max_count: the most items a query ranks, if known on the host (the soft counts sum to
            it): sizes a series without reading the histograms.

    Returns:
        ``(B,)`` float64 (not normalised).
    """
    g = gain_hist.to(torch.float64)
    c = all_hist.to(torch.float64)
    cum = c.cumsum(1)
    prev = _previous(cum)
    if form == "midpoint":
        return (g / torch.log2(prev + (c + 1.0) / 2 + 1.0)).sum(1)
    occupied = c > 0
    c_safe = torch.where(occupied, c, torch.ones_like(c))
    at_cum = relaxed_cumulative_discount(cum, max_count)
    span = at_cum - _previous(at_cum)  # S(C_{d-1}) is the previous bin's S(C_d); S(0) = 0
    return torch.where(occupied, g / c_safe * span, torch.zeros_like(c)).sum(1)


def ideal_dcg(gains: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(B,)`` exact ideal DCG: each row's gains (valid entries) sorted decreasingly."""
    g = torch.where(valid, gains, torch.zeros_like(gains)).to(torch.float64)
    ordered = torch.sort(g, dim=1, descending=True).values
    positions = torch.arange(1, g.shape[1] + 1, dtype=torch.float64, device=g.device)
    return (ordered / torch.log2(positions + 1.0)).sum(1)


# -- the losses ------------------------------------------------------------------------------------


class _TieAwareLoss(RankingLoss):
    """Relaxed distances and histograms shared by the two losses, on the base class's batch.

    Called on relaxed codes ``(B, bits)`` in ``[-1, 1]`` (and ``(M, bits)`` reference codes), with
    the labels the ``affinity`` takes (class ids, multi-hot, or ``(B, F)`` features).
    """

    _objective = ""

    def __init__(
        self,
        bits: int,
        num_bins: int | None = None,
        delta: float | None = None,
        form: str = "exact",
        affinity: Any = "labels",
    ) -> None:
        # distances (b - φᵀφ') / 2 from the base class's "dot" scores, in float32 for half codes
        # (the kernel width is finer than float16's spacing of distances near `bits`)
        super().__init__("dot")
        self.bits = check_scalar(bits, "bits", Interval("integer", 1, None))
        if num_bins is None:
            num_bins = self.bits
        self.num_bins = check_scalar(num_bins, "num_bins", Interval("integer", 1, None))
        spacing = self.bits / self.num_bins
        if delta is None:
            delta = spacing
        self.delta = check_scalar(delta, "delta", Interval("real", 0, None, closed="neither"))
        self.form = check_choice(form, "form", FORMS)
        self.affinity = check_affinity(affinity)

    def check_rows(self, x: Any, name: str) -> torch.Tensor:
        """Relaxed codes: ``(n, bits)`` (their range is checked by :meth:`value_flag`)."""
        codes = check_embeddings(x, name, finite=False)
        if codes.shape[1] != self.bits:
            raise ValueError(
                f"`{name}` has {codes.shape[1]} columns but the loss was built for "
                f"bits={self.bits}; pass the relaxed codes of a {self.bits}-bit HashingHead."
            )
        return codes

    def value_flag(self, x: torch.Tensor) -> torch.Tensor:
        """Codes in ``[-1, 1]`` (NaN fails), on the device."""
        return x.detach().abs().amax() <= _CODE_BOUND

    def check_values(self, x: torch.Tensor, name: str) -> None:
        """Finite codes in ``[-1, 1]``, or the ``ValueError`` naming ``name``."""
        check_finite(x, name)
        worst = float(x.detach().abs().max())
        if worst > _CODE_BOUND:
            raise ValueError(
                f"`{name}` must be relaxed codes in [-1, 1] (tanh outputs, e.g. of "
                f"rankwise.hashing.HashingHead), got a value of magnitude {worst:.4g}."
            )

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """Loss ``1 - mean relaxed metric`` of a prepared batch (its valid anchors)."""
        b = batch.restrict_to_valid()
        distances = (self.bits - b.scores) / 2
        ranked = b.pos_mask | b.neg_mask  # every reference but the anchor itself
        assert b.levels is not None  # the affinity of a tie-aware loss gives the levels
        host = b.host
        max_ranked = int((host.positives_per_anchor + host.negatives_per_anchor).max())
        values = self._relaxed_metric(distances, b.levels, ranked, max_ranked)
        mean = values.mean()
        self.last_stats[f"mean_{self._objective}"] = mean.detach()
        return (1.0 - mean).to(distances.dtype)

    def _relaxed_metric(
        self, distances, levels, ranked, max_ranked
    ) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def extra_repr(self) -> str:
        aff = self.affinity if isinstance(self.affinity, str) else type(self.affinity).__name__
        return (
            f"bits={self.bits}, num_bins={self.num_bins}, delta={self.delta:g}, "
            f"form={self.form!r}, affinity={aff!r}"
        )


class TieAwareAPLoss(_TieAwareLoss):
    """``1 - mean AP_r``: relaxed tie-aware average precision of binary codes (TALR, Eq. 11).

    Every anchor is a query against the other items of the batch (or the reference set); its
    relevant items are those with affinity > 0. See the module docstring for the objective.

    Args:
        bits: code length ``b``; the embeddings are ``(B, b)`` relaxed codes in ``[-1, 1]``.
        num_bins: ``K``, bins centred at ``0, b/K, ..., b`` (default ``b``: one bin per Hamming
            distance; the released code uses ``b / 2`` for 32 bits and more).
        delta: triangular kernel half-width ``Δ`` (default the bin spacing ``b / K``).
        form: ``"exact"`` (harmonic-number form, equal to AP_T for hard codes) or
            ``"midpoint"`` (the authors' released simplification).
        affinity: as for :func:`rankwise.metrics.hamming_retrieval_metrics` (labels are
            features for an :class:`EuclideanThresholdAffinity`); relevance is affinity > 0.

    ``last_stats``: the anchor / pair counts of :func:`rankwise.losses.base.anchor_statistics`
    plus ``"mean_ap_r"``. Anchors without a relevant or an irrelevant item are skipped.

    Example:
        >>> import torch
        >>> from rankwise.losses import TieAwareAPLoss
        >>> codes = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])  # in [-1, 1]
        >>> round(TieAwareAPLoss(bits=2)(codes, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.3331
    """

    _objective = "ap_r"

    def _relaxed_metric(self, distances, levels, ranked, max_ranked) -> torch.Tensor:
        positive = ((levels > 0) & ranked).to(distances.dtype)
        weights = torch.stack([positive, ranked.to(distances.dtype)], dim=-1)
        hist = soft_histograms(distances, weights, self.bits, self.num_bins, self.delta)
        return tie_aware_ap_relaxation(hist[..., 0], hist[..., 1], positive.sum(1), self.form)


class TieAwareNDCGLoss(_TieAwareLoss):
    """``1 - mean NDCG_r``: relaxed tie-aware NDCG of binary codes (TALR, Eq. 12).

    Gains are ``G(a) = 2^a - 1`` of the affinity ``a`` (multi-level: ``"shared_labels"`` or a
    :class:`EuclideanThresholdAffinity`); the relaxed DCG is divided by the exact ideal DCG of the
    anchor's affinities. Arguments as :class:`TieAwareAPLoss`; the default affinity here is
    ``"shared_labels"`` (for class ids the same as ``"labels"``).

    ``last_stats``: anchor / pair counts plus ``"mean_ndcg_r"``.

    Example:
        >>> import torch
        >>> from rankwise.losses import TieAwareNDCGLoss
        >>> codes = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])  # in [-1, 1]
        >>> round(TieAwareNDCGLoss(bits=2)(codes, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.2278
    """

    _objective = "ndcg_r"

    def __init__(
        self,
        bits: int,
        num_bins: int | None = None,
        delta: float | None = None,
        form: str = "exact",
        affinity: Any = "shared_labels",
    ) -> None:
        super().__init__(bits, num_bins, delta, form, affinity)

    def _relaxed_metric(self, distances, levels, ranked, max_ranked) -> torch.Tensor:
        gains = torch.where(ranked, torch.exp2(levels) - 1.0, torch.zeros_like(levels))
        weights = torch.stack([gains.to(distances.dtype), ranked.to(distances.dtype)], dim=-1)
        hist = soft_histograms(distances, weights, self.bits, self.num_bins, self.delta)
        dcg = tie_aware_dcg_relaxation(hist[..., 0], hist[..., 1], self.form, float(max_ranked))
        return dcg / ideal_dcg(gains, ranked)
