"""The AUC loss and the Wilcoxon loss of Gajić et al., ROC-area maximization for metric learning.

Gajić, Amato, Baldrich, van de Weijer and Gatta, *Area Under the ROC Curve Maximization for Metric
Learning*: the area under the ROC curve of a batch's positive and negative pair similarities,
computed with the trapezoidal rule over thresholds s = t_min, t_min + Δs, …, t_max (Eq. 5) of the
sigmoid-relaxed TPR T*(s) and FPR F*(s) of Eq. (7), σ_r(x, s) = 1 / (1 + exp(−r (x − s))) (Eq. 6);
loss 1 − A (Eq. 8/9, read as in ``docs/errata.md``, "AUC loss"), with the batch-hard and batch-all
pair strategies of Sec. 3.3. The slope r defaults to the non-degenerate local minimum of Eq. (10),
the integrated squared second derivative of the sum of all threshold sigmoids (:func:`auc_slope`,
Table 1). :class:`WilcoxonLoss` is the batch-hard Wilcoxon–Mann–Whitney baseline of Eq. (11) (Sec.
4.3.4).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from scipy import integrate, optimize
from scipy.special import expit
from torch.autograd.function import once_differentiable

from .._validation import Interval, check_choice, check_range_pair, check_scalar
from .base import BatchLayout, PairBatch, RankingLoss

__all__ = ["AUCLoss", "WilcoxonLoss", "auc_slope", "auc_thresholds", "STRATEGIES"]

STRATEGIES = ("hard", "all")
_POSITIVE = Interval("real", 0, None, closed="neither")


# -- threshold grid and the slope of Eq. (10) ------------------------------------------------------
def _check_delta_s(delta_s: float, t_min: float, t_max: float) -> float:
    # a step as wide as the range would leave a single trapezoid (the paper uses 0.05 on [-1, 1])
    return check_scalar(delta_s, "delta_s", Interval("real", 0, t_max - t_min, closed="neither"))


def auc_thresholds(delta_s: float, score_range: Sequence[float] = (-1.0, 1.0)) -> np.ndarray:
    """Threshold grid s_k = t_min + k Δs, k = 0 … ceil((t_max − t_min) / Δs), as float64 (K,).

    When the range width is a multiple of ``delta_s`` the last threshold is t_max exactly (41
    thresholds for Δs = 0.05 on [−1, 1]); otherwise it is the first grid point beyond t_max.
    """
    t_min, t_max = check_range_pair(score_range, "score_range")
    step = _check_delta_s(delta_s, t_min, t_max)
    # reaching t_max closes the curve; the tolerance keeps 2 / 0.1 = 19.999999999999996 at 20 steps
    n_steps = max(1, math.ceil((t_max - t_min) / step - 1e-9))
    return t_min + step * np.arange(n_steps + 1, dtype=np.float64)


# Beyond |z| = 40 the sigmoid's second derivative is below 1e-17 of its peak: thresholds farther
# than 40 / ρ grid steps from x contribute nothing measurable to the curvature at x.
_SIGMOID_REACH = 40.0
# Integration points per grid step; the sigmoid's curvature bump is about 1/ρ ≈ 0.5 step wide at
# the optimum, so 64 points resolve it to well below the 1% tolerance of Table 1.
_POINTS_PER_STEP = 64


def _eq10_objective(rho: float, n_steps_real: float) -> float:
    """Eq. (10) in grid units u = (x − t_min) / Δs, ρ = r Δs (same minimizer), g = σ'' / r².

    ρ⁴ ∫_0^W (Σ_k g(ρ (u − k)))² du with g(z) = σ(z)(1 − σ(z))(1 − 2σ(z)).
    """
    n_thresholds = math.ceil(n_steps_real - 1e-9) + 1
    u = np.linspace(0.0, n_steps_real, math.ceil(n_steps_real * _POINTS_PER_STEP) + 1)
    reach = _SIGMOID_REACH / rho
    curvature = np.empty_like(u)
    chunk = 4096
    for start in range(0, u.size, chunk):
        uc = u[start : start + chunk]
        k_lo = max(0, math.floor(uc[0] - reach))
        k_hi = min(n_thresholds - 1, math.ceil(uc[-1] + reach))
        k = np.arange(k_lo, k_hi + 1, dtype=np.float64)
        sig = expit(rho * (uc[:, None] - k[None, :]))
        curvature[start : start + chunk] = (sig * (1.0 - sig) * (1.0 - 2.0 * sig)).sum(1)
    return rho**4 * float(integrate.simpson(curvature**2, x=u))


@functools.lru_cache(maxsize=64)
def _solve_auc_slope(delta_s: float, t_min: float, t_max: float) -> float:
    n_steps_real = (t_max - t_min) / delta_s
    # after the degenerate minimum at ρ = 0 the objective has one local minimum (ρ ≈ 1.8–3 for
    # 1 to 200 steps) before growing like ρ³: bracket it on a geometric grid, refine with Brent
    rhos = np.geomspace(0.2, 40.0, 49)
    values = np.array([_eq10_objective(float(r), n_steps_real) for r in rhos])
    interior = np.flatnonzero((values[1:-1] < values[:-2]) & (values[1:-1] < values[2:])) + 1
    if interior.size == 0:
        raise ValueError(
            f"Eq. (10) has no non-degenerate local minimum for delta_s={delta_s} on "
            f"[{t_min}, {t_max}]; pass `slope` explicitly."
        )
    i = int(interior[0])
    result = optimize.minimize_scalar(
        _eq10_objective,
        bounds=(rhos[i - 1], rhos[i + 1]),
        args=(n_steps_real,),
        method="bounded",
        options={"xatol": 1e-7},
    )
    return float(result.x) / delta_s


def auc_slope(delta_s: float, score_range: Sequence[float] = (-1.0, 1.0)) -> float:
    """Sigmoid slope r for threshold step ``delta_s``: the non-degenerate local minimum of Eq. (10).

    Eq. (10) chooses r minimizing ∫_{t_min}^{t_max} (d²/dx² Σ_s σ_r(x, s))² dx, the sum running over
    all thresholds of the grid (:func:`auc_thresholds`): the slope whose summed sigmoids have the
    flattest gradient magnitude. r → 0 is a trivial minimum and is excluded. Table 1 is matched
    within 1% for Δs = 0.05, 0.1 and 0.2, not for 0.01 and 0.02 (docs/experiments.md, "auc-slope").

    Args:
        delta_s: threshold step, a float in (0, t_max − t_min).
        score_range: (t_min, t_max), the range of the similarity.

    Returns:
        r as a Python float. Results are cached (``auc_slope.cache_info()``).

    Example:
        >>> from rankwise.losses import auc_slope
        >>> round(auc_slope(0.05), 1), round(auc_slope(0.1), 1)
        (42.1, 22.5)
    """
    t_min, t_max = check_range_pair(score_range, "score_range")
    step = _check_delta_s(delta_s, t_min, t_max)
    return _solve_auc_slope(step, t_min, t_max)


auc_slope.cache_info = _solve_auc_slope.cache_info  # type: ignore[attr-defined]
auc_slope.cache_clear = _solve_auc_slope.cache_clear  # type: ignore[attr-defined]


# -- pair selection shared by both losses ----------------------------------------------------------
def _hardest_scores(batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) lowest positive and (N,) highest negative score of each valid anchor."""
    valid = batch.restrict_to_valid()
    inf = torch.finfo(valid.scores.dtype).max
    hardest_pos = valid.scores.masked_fill(~valid.pos_mask, inf).amin(dim=1)
    hardest_neg = valid.scores.masked_fill(~valid.neg_mask, -inf).amax(dim=1)
    return hardest_pos, hardest_neg


def _all_pair_scores(batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(P,) positive and (Q,) negative pair scores of the rows of valid anchors (batch-all).

    Without a reference set each unordered pair is kept once (upper triangle): both halves would
    count a pair with a skipped anchor (e.g. a singleton class) once and the others twice.
    """
    pos_index, neg_index = batch.host.pattern_cached("all_pair_index", _all_pair_index)
    flat = batch.scores.reshape(-1)
    pos_index, neg_index = batch.send(pos_index, neg_index)
    return flat.index_select(0, pos_index), flat.index_select(0, neg_index)


def _all_pair_index(host: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major flat positions of :func:`_all_pair_scores`' pairs, from the labels (host)."""
    valid_rows = host.valid[:, None]
    if host.self_reference:
        n = host.pos_mask.shape[0]
        in_valid_row = valid_rows | host.valid[None, :]
        keep = in_valid_row & torch.ones(n, n, dtype=torch.bool).triu_(1)
    else:
        keep = valid_rows.expand_as(host.pos_mask)
    return (
        (host.pos_mask & keep).reshape(-1).nonzero().squeeze(1),
        (host.neg_mask & keep).reshape(-1).nonzero().squeeze(1),
    )


# Elements of one (scores, thresholds) sigmoid block: above this the block is built in chunks.
# 2**22 float32 values are 16 MiB; batch-all at B = 2,000 has ~2e6 scores x 41 thresholds.
_BLOCK_ELEMENTS = 2**22


def _mean_sigmoid(scores: torch.Tensor, thresholds: torch.Tensor, slope: float) -> torch.Tensor:
    """(K,) mean over the (n,) scores x of sigmoid(slope (x − s_k)): T* or F* of Eq. (7)."""
    if scores.numel() * thresholds.numel() <= _BLOCK_ELEMENTS:
        return torch.sigmoid(slope * (scores[:, None] - thresholds)).mean(dim=0)
    rows = max(1, _BLOCK_ELEMENTS // thresholds.numel())
    return _ChunkedMeanSigmoid.apply(scores, thresholds, slope, rows)


class _ChunkedMeanSigmoid(torch.autograd.Function):
    """mean_x sigmoid(r (x − s_k)) over chunks of ``rows`` scores; backward recomputes each chunk.

    Autograd would keep the whole (n, K) block (+1 GB for batch-all at B = 2,000). Not twice
    differentiable; the thresholds get no gradient.
    """

    @staticmethod
    def forward(
        ctx: Any, scores: torch.Tensor, thresholds: torch.Tensor, slope: float, rows: int
    ) -> torch.Tensor:
        total = scores.new_zeros(thresholds.shape)
        for chunk in scores.split(rows):
            total += torch.sigmoid(slope * (chunk[:, None] - thresholds)).sum(dim=0)
        ctx.save_for_backward(scores, thresholds)
        ctx.slope, ctx.rows = slope, rows
        return total / scores.numel()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        scores, thresholds = ctx.saved_tensors
        weights = grad * (ctx.slope / scores.numel())
        parts = []
        for chunk in scores.split(ctx.rows):
            sig = torch.sigmoid(ctx.slope * (chunk[:, None] - thresholds))
            parts.append((sig * (1 - sig)) @ weights)
        return torch.cat(parts), None, None, None


# -- losses ----------------------------------------------------------------------------------------
class AUCLoss(RankingLoss):
    """AUC loss (Gajić et al., Eq. 9): 1 − the trapezoidal area under the sigmoid-relaxed ROC curve.

    A = Σ_k ½ (T*(s_k) + T*(s_{k+1})) · (F*(s_k) − F*(s_{k+1})) over the threshold grid s_k of
    :func:`auc_thresholds`, with T*(s) = mean over positive scores x of sigmoid(r (x − s)) and F*(s)
    the same mean over negative scores (Eq. 7). The loss is 1 − A.

    Strategies (Sec. 3.3):

    - ``"hard"`` (the paper's default, batch hard): each valid anchor contributes its hardest
      positive (lowest similarity) to the positive set and its hardest negative (highest
      similarity) to the negative set, N scores each.
    - ``"all"`` (batch all): every positive and every negative pair in the row of a valid anchor.
      Without ``ref_embeddings`` each unordered pair {i, j} is counted once; with a reference set
      every (anchor, reference) pair is distinct and counted once.

    ``last_stats`` gains ``n_positive_scores``/``n_negative_scores`` (the sizes of the two score
    sets) and ``relaxed_auc`` (A). Memory O(B·M) for both strategies: the sigmoid blocks
    are chunked (docs/losses.md, "Memory of every loss").

    Args:
        delta_s: threshold step Δs in (0, t_max − t_min); 0.05 in the paper.
        slope: sigmoid slope r > 0; ``None`` solves Eq. (10) for ``delta_s`` (:func:`auc_slope`).
        strategy: ``"hard"`` or ``"all"``.
        score_range: (t_min, t_max), the range the thresholds span; (−1, 1) suits cosine.
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"neg_euclidean"``.

    Example:
        >>> import torch
        >>> from rankwise.losses import AUCLoss
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> loss_fn = AUCLoss(delta_s=0.05)  # slope r from Eq. (10): auc_slope(0.05)
        >>> round(loss_fn(emb, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.2837
    """

    def __init__(
        self,
        delta_s: float = 0.05,
        slope: float | None = None,
        strategy: str = "hard",
        score_range: Sequence[float] = (-1.0, 1.0),
        similarity: str = "cosine",
    ) -> None:
        super().__init__(similarity)
        self.strategy = check_choice(strategy, "strategy", STRATEGIES)
        self.t_min, self.t_max = check_range_pair(score_range, "score_range")
        self.delta_s = _check_delta_s(delta_s, self.t_min, self.t_max)
        if slope is None:
            self.slope = auc_slope(self.delta_s, (self.t_min, self.t_max))
        else:
            self.slope = check_scalar(slope, "slope", _POSITIVE)
        self._thresholds = auc_thresholds(self.delta_s, (self.t_min, self.t_max))

    def relaxed_auc(self, pos_scores: torch.Tensor, neg_scores: torch.Tensor) -> torch.Tensor:
        """A of Eq. (8) for (P,) positive and (Q,) negative scores (same dtype/device); scalar."""
        thresholds = torch.as_tensor(
            self._thresholds, dtype=pos_scores.dtype, device=pos_scores.device
        )
        tpr = _mean_sigmoid(pos_scores, thresholds, self.slope)
        fpr = _mean_sigmoid(neg_scores, thresholds, self.slope)
        return (0.5 * (tpr[:-1] + tpr[1:]) * (fpr[:-1] - fpr[1:])).sum()

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """The loss of a validated batch (see the class docstring)."""
        if self.strategy == "hard":
            pos_scores, neg_scores = _hardest_scores(batch)
        else:
            pos_scores, neg_scores = _all_pair_scores(batch)
        area = self.relaxed_auc(pos_scores, neg_scores)
        self.last_stats["n_positive_scores"] = int(pos_scores.numel())
        self.last_stats["n_negative_scores"] = int(neg_scores.numel())
        self.last_stats["relaxed_auc"] = area.detach()
        return 1.0 - area

    def extra_repr(self) -> str:
        """The constructor arguments, shown by ``repr``."""
        return (
            f"delta_s={self.delta_s}, slope={self.slope:.4g}, strategy={self.strategy!r}, "
            f"score_range=({self.t_min}, {self.t_max}), similarity={self.similarity!r}"
        )


class WilcoxonLoss(RankingLoss):
    """Batch-hard Wilcoxon loss (Gajić et al., Eq. 11): the sigmoid-relaxed WMW statistic.

    L = 1 − (1 / N²) Σ_i Σ_j σ(r (f_{p_i} − f_{n_j})), f_{p_i} the hardest (lowest) positive score
    and f_{n_j} the hardest (highest) negative score of valid anchors i and j, N the number of
    valid anchors. Eq. (11) writes the plain logistic σ, i.e. ``slope=1``; a larger slope sharpens
    the relaxation toward the exact statistic. Memory O(N²).

    Args:
        slope: r > 0 multiplying the score difference; 1 as in Eq. (11).
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"neg_euclidean"``.

    Example:
        >>> import torch
        >>> from rankwise.losses import WilcoxonLoss
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> round(WilcoxonLoss()(emb, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.4584
    """

    def __init__(self, slope: float = 1.0, similarity: str = "cosine") -> None:
        super().__init__(similarity)
        self.slope = check_scalar(slope, "slope", _POSITIVE)

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """The loss of a validated batch (see the class docstring)."""
        hardest_pos, hardest_neg = _hardest_scores(batch)
        statistic = torch.sigmoid(self.slope * (hardest_pos[:, None] - hardest_neg[None, :]))
        wmw = statistic.mean()
        self.last_stats["relaxed_wmw"] = wmw.detach()
        return 1.0 - wmw

    def extra_repr(self) -> str:
        """The constructor arguments, shown by ``repr``."""
        return f"slope={self.slope:.4g}, similarity={self.similarity!r}"
