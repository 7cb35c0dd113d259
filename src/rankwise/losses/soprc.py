"""SOPRC, the biased mini-batch AP loss and the semi-variance regularizer of Wen et al. (NeurIPS 2022).

Wen, Xu, Yang, He and Huang, *Exploring the Algorithm-Dependent Generalization of AUPRC
Optimization with List Stability* (NeurIPS 2022): the surrogates ℓ1 (one-sided Huber) and ℓ2
(one-sided sigmoid) of Eq. (7), the biased estimator AP↓ of Eq. (5) (:class:`APLoss`), the
sampling-rate-invariant estimator of Eq. (8) whose TPR term is read from an auxiliary per-class
vector ``v`` updated by the moving average of Eq. (10) with the score interpolation φ of Alg. 2
(:class:`SOPRCLoss`, Alg. 1), and the semi-variance regularizer of Eq. (9)
(:class:`SemiVarianceRegularizer`). Garbled formulas are read as in docs/errata.md (SOPRC):
ℓ1(x) = 1 − 2x/τ1 for x < 0, ℓ2(x) = tanh(−x/(2τ2)) for x < 0, one row of ``v`` per class. The
TPR term counts the n_c − 1 positives a class row stands for (the released code's |v| + 1 is
``tpr_count="num_v"``). Departures from the released code and the many-class defaults: docs/losses.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .._dispatch import to_device
from .._validation import (
    Interval,
    as_tensor,
    check_bool,
    check_choice,
    check_range_pair,
    check_scalar,
)
from .base import BatchLayout, PairBatch, RankingLoss, score_dtype

__all__ = [
    "APLoss",
    "SOPRCLoss",
    "SemiVarianceRegularizer",
    "huber_surrogate",
    "sigmoid_surrogate",
    "score_interpolation",
]

V_INITS = ("grid", "uniform")
SEMI_VARIANCE_NORMS = ("pairs", "tail")
TPR_COUNTS = ("class", "num_v")
# buffers the step reads on the host (fixed after construction), see SOPRCLoss._host_buffer
_HOST_BUFFERS = ("prior", "positives")
# prior of the largest class in SOPRCLoss.from_labels (the released code's default prior_mul): the
# raw class share of a many-class dataset (~1e-4) leaves the loss almost no gradient (docs/losses.md)
DEFAULT_PRIOR_SCALE = 0.1


# -- surrogates of Eq. (7) ---------------------------------------------------------------------------
def huber_surrogate(x: torch.Tensor, tau1: float) -> torch.Tensor:
    """One-sided Huber ℓ1 of Eq. (7), an upper bound of the step 1[x ≤ 0], applied to s⁺ − s⁻.

    ℓ1(x) = 1 − 2x/τ1 for x < 0, (1 − x/τ1)² for 0 ≤ x < τ1, 0 for x ≥ τ1 (continuous with a
    continuous derivative; the paper's "−2x/τ1" branch misses the 1, see the errata).

    Args:
        x: float tensor of any shape.
        tau1: margin τ1 > 0.
    """
    return _huber_of_margin(1 - x / tau1)


def _huber_of_margin(u: torch.Tensor) -> torch.Tensor:
    """ℓ1 of u = 1 − x/τ1: c·(2u − c) with c = clamp(u, 0, 1), one clamp instead of `where` masks."""
    inside = u.clamp(min=0, max=1)
    return inside * (2 * u - inside)


def sigmoid_surrogate(x: torch.Tensor, tau2: float) -> torch.Tensor:
    """One-sided sigmoid ℓ2 of Eq. (7), a lower bound of the step 1[x ≤ 0], applied to s⁺ − s.

    ℓ2(x) = (exp(−x/τ2) − 1) / (exp(−x/τ2) + 1) = tanh(−x/(2τ2)) for x < 0, 0 for x ≥ 0.

    Args:
        x: float tensor of any shape.
        tau2: temperature τ2 > 0; ℓ2 → 1[x < 0] as τ2 → 0.
    """
    return torch.tanh(x.clamp(max=0) / (-2 * tau2))


# -- score interpolation φ of Alg. 2 -------------------------------------------------------------
class _GroupLayout:
    """Where φ reads and writes, for values in groups: a function of the group ids only (host).

    The values of group g fill row g of a (G, W + 1) block (W the largest group), in input order,
    the rest +inf; a stable row sort puts each group's values in ascending order (ties in input
    order, as a global stable sort would) at columns 0..n_g − 1. Prepending u_0 gives the curve
    u_0, u_1..u_n, u_{n+1} of Alg. 2 with u_{n+1} written over the first +inf.
    """

    def __init__(self, groups: torch.Tensor, num_points: int) -> None:
        # numpy on the host labels: a few microseconds per operation instead of torch's dispatch
        present, first, inverse, counts = np.unique(
            groups.numpy(), return_index=True, return_inverse=True, return_counts=True
        )
        inverse, counts = inverse.astype(np.int64), counts.astype(np.int64)
        self.present, self.num_points = torch.from_numpy(present), num_points
        self.first = torch.from_numpy(first.astype(np.int64))  # each group's first value
        self.n_groups, width = int(present.size), int(counts.max())
        # each value's position within its group, in input order
        order = np.argsort(inverse, kind="stable")
        starts = np.cumsum(counts) - counts
        slot = np.empty_like(inverse)
        slot[order] = np.arange(inverse.size) - starts[inverse[order]]
        self.width = width + 1
        self.cell = torch.from_numpy(inverse * self.width + slot)
        # columns of the sorted block: u_1, u_n, u_2 (u_1 for a single value), u_{n−1} (or u_1)
        ends = [np.zeros_like(counts), counts - 1, np.minimum(counts, 2) - 1]
        self.ends = torch.from_numpy(np.stack([*ends, np.maximum(counts - 2, 0)], axis=1))
        # u_{n+1}: column n + 1 of the curve
        self.high_column = torch.from_numpy((counts + 1).reshape(-1, 1))
        # position j/(K+1) on the index scale of a group of n values is j(n+1)/(K+1); integer
        # arithmetic keeps positions that coincide with a data point exact
        j = np.arange(1, num_points + 1, dtype=np.int64)
        numerator = j[None, :] * (counts[:, None] + 1)
        left = numerator // (num_points + 1)
        # the weight of the right knot, r/(K+1), divided here (IEEE division, correctly rounded):
        # CUDA divides a tensor by a Python number as a product with its reciprocal, one
        # rounding more, so the device gave another last bit than the CPU. Rounded once more to
        # the values' dtype it is still the correctly rounded r/(K+1) of that dtype: for
        # K + 1 < 2**29 a quotient that is not a float32 (float16) rounding midpoint lies at least
        # 2**(e-24)/(K+1) from one, more than float64's rounding error 2**(e-53)
        self.fraction = torch.from_numpy((numerator - left * (num_points + 1)) / (num_points + 1))
        right = np.minimum(left + 1, (counts + 1)[:, None])
        self.knots = torch.from_numpy(np.concatenate([left, right], axis=1))

    def device_tensors(self) -> list[torch.Tensor]:
        """What :func:`_phi` needs on the device (send them, then pass them in this order)."""
        return [self.cell, self.ends, self.high_column, self.knots, self.fraction]


def _phi(
    values: torch.Tensor,
    layout: _GroupLayout,
    sent: list[torch.Tensor],
    score_range: tuple[float, float] | None,
) -> torch.Tensor:
    """φ of every group of ``layout``: (G, num_points); ends never pass u_1 / u_n."""
    cell, ends, high_column, knots, fraction = sent
    block = values.new_full((layout.n_groups * layout.width,), math.inf)
    block = block.index_put_((cell,), values).view(layout.n_groups, layout.width)
    ascending = block.sort(dim=1, stable=True).values
    u = ascending.gather(1, ends)  # u_1, u_n, u_2, u_{n−1}
    # u_0 = 2u_1 − u_2, u_{n+1} = 2u_n − u_{n−1}, each contiguous: maximum / minimum of
    # (+0, −0) depend on the kernel, which depends on the layout
    low, high = 2 * u[:, 0] - u[:, 2], 2 * u[:, 1] - u[:, 3]
    if score_range is not None:
        low = torch.maximum(low, u[:, 0].clamp(max=score_range[0]))
        high = torch.minimum(high, u[:, 1].clamp(min=score_range[1]))
    curve = torch.cat([low[:, None], ascending], dim=1).scatter_(1, high_column, high[:, None])
    k = layout.num_points
    # two gathers, not two halves of one: a strided `minimum` takes another kernel, whose
    # minimum(+0, -0) differs from the contiguous one's
    lower, upper = curve.gather(1, knots[:, :k]), curve.gather(1, knots[:, k:])
    frac = fraction.to(values.dtype)  # no division on the device (see _GroupLayout)
    # lower + frac·(upper − lower) is exact where lower == upper; the minimum keeps rounding from
    # stepping past the next knot, so φ is non-decreasing in floating point too
    return torch.minimum(lower + frac * (upper - lower), upper)


def _grouped_score_interpolation(
    values: torch.Tensor,
    groups: torch.Tensor,
    num_points: int,
    score_range: tuple[float, float] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """φ of every group: (distinct group ids (G,), rows (G, num_points)); ends never pass u_1 / u_n."""
    layout = _GroupLayout(groups.cpu(), num_points)
    sent = to_device(layout.device_tensors(), values.device)
    return layout.present.to(values.device), _phi(values, layout, sent, score_range)


def score_interpolation(
    scores: torch.Tensor, num_points: int, score_range: tuple[float, float] | None = (-1.0, 1.0)
) -> torch.Tensor:
    """φ of Alg. 2: summarise n scores by ``num_points`` interpolated quantiles (ascending).

    The sorted scores u_1 ≤ … ≤ u_n are placed at quantile positions i/(n+1), extended by
    u_0 = 2u_1 − u_2 at 0 and u_{n+1} = 2u_n − u_{n−1} at 1 (clipped to ``score_range``), and the
    piecewise-linear curve is read at j/(num_points+1), j = 1..num_points. When
    num_points + 1 is a multiple of n + 1 the output contains every input score exactly.

    Args:
        scores: (n,) float tensor, n ≥ 1, any order.
        num_points: number of output values (|v|), ≥ 1.
        score_range: (low, high) bounds for the two extrapolated points, or None for no clipping.

    Returns:
        (num_points,) tensor, same dtype and device as ``scores``, non-decreasing.
    """
    s = as_tensor(scores, "scores")
    if s.ndim != 1 or s.numel() == 0 or not s.is_floating_point():
        raise ValueError(
            f"`scores` must be a non-empty 1-D float tensor, got shape {tuple(s.shape)} "
            f"and dtype {s.dtype}."
        )
    check_scalar(num_points, "num_points", _COUNT)
    rng = _check_score_range(score_range)
    groups = torch.zeros(s.numel(), dtype=torch.long, device=s.device)
    return _grouped_score_interpolation(s, groups, num_points, rng)[1][0]


def _moving_average_weights(beta: float, dtype: torch.dtype) -> tuple[float, float]:
    """(1 − β, β) as the values a (1 − β) / β tensor of ``dtype`` holds (cached per dtype)."""
    key = (beta, dtype)
    if key not in _WEIGHTS:
        take = torch.tensor(beta, dtype=dtype)
        _WEIGHTS[key] = (float(1 - take), float(take))
    return _WEIGHTS[key]


_WEIGHTS: dict[tuple[float, torch.dtype], tuple[float, float]] = {}


# -- argument checks --------------------------------------------------------------------------------
_POSITIVE = Interval("real", 0, None, closed="neither")
_NON_NEGATIVE = Interval("real", 0, None)
_UNIT = Interval("real", 0, 1)
_COUNT = Interval("integer", 1, None)


def _check_score_range(score_range: Any, name: str = "score_range") -> tuple[float, float] | None:
    return None if score_range is None else check_range_pair(score_range, name)


def _per_class(values: Any, name: str, num_classes: int) -> torch.Tensor:
    """``values`` as a (num_classes,) tensor of the default dtype (a shape error names ``name``)."""
    t = as_tensor(values, name)
    if t.ndim != 1 or t.shape[0] != num_classes:
        raise ValueError(
            f"`{name}` must have shape (num_classes,) = ({num_classes},), got {tuple(t.shape)}."
        )
    return t.to(torch.get_default_dtype())


def _check_semi_variance(reg: Any) -> SemiVarianceRegularizer | None:
    if reg is not None and not isinstance(reg, SemiVarianceRegularizer):
        raise ValueError(
            "`semi_variance` must be a SemiVarianceRegularizer or None, got "
            f"{type(reg).__name__}; add other regularizers to the loss value yourself."
        )
    return reg


# -- gathers whose backward does not depend on thread order ----------------------------------
class _Segments:
    """How the rows of ``x.index_select(0, index)`` sum back onto the rows of ``x`` (host).

    The backward of a gather adds the gradient of every gathered row to its source row. torch's
    own (``index_add_`` for ``index_select``, ``scatter_add_`` for ``gather``,
    ``index_put_(accumulate=True)`` for indexing) adds them on CUDA with atomic operations, in
    the order the threads happen to come: float64 gradients then differ in their last bits from
    one call to the next (gradcheck on CUDA: "Backward is not reentrant"). Here the sums are
    ordinary tensor operations with no accumulating write, so their order is fixed by the shapes
    on every device:

    - ``"view"``: the index is 0, 0, .., 1, 1, .. (every row W times, in order; the pairs of a
      P x K batch by anchor): the gradient viewed as (size, W, ...) and summed over W;
    - ``"scatter"``: no row is gathered twice (the pairs' positions in the score matrix): each
      gradient row written once (``index_put_`` without accumulation) into zeros;
    - ``"slots"``: otherwise the positions that gather row r, increasing, as row r of a
      (size, W) table padded with a position that reads a zero row; the gradient gathered by
      that table and summed over W.

    Built from the index with numpy, once per label pattern.

    Args:
        index: (n,) int64 numpy array, the gathered rows, in [0, size).
        size: the number of rows of ``x``.
        keep: (n,) bool numpy array of the gathered rows that carry a gradient (None: all);
            the others are padding whose gradient the caller sets to zero.
    """

    def __init__(self, index: np.ndarray, size: int, keep: np.ndarray | None = None) -> None:
        n = int(index.size)
        positions = np.arange(n) if keep is None else np.flatnonzero(keep)
        rows = index[positions]
        order = np.argsort(rows, kind="stable")
        rows, positions = rows[order], positions[order]
        counts = np.bincount(rows, minlength=size)
        self.size, self.width = size, int(counts.max()) if size else 0
        self.slots: torch.Tensor | None = None
        self.padded = False
        in_order = rows.size == n and bool((positions == np.arange(n)).all())
        if in_order and rows.size == size * self.width:
            self.mode = "view"
        elif keep is None and self.width <= 1:
            self.mode = "scatter"
        else:
            self.mode = "slots"
            column = np.arange(rows.size) - (np.cumsum(counts) - counts)[rows]
            slots = np.full((size, self.width), n, dtype=np.int64)
            slots[rows, column] = positions
            self.padded = rows.size < slots.size
            self.slots = torch.from_numpy(slots)

    def tensors(self) -> list[torch.Tensor]:
        """What the backward needs on the device (send it, then :meth:`with_sent`)."""
        return [] if self.slots is None else [self.slots]

    def with_sent(self, sent: list[torch.Tensor]) -> _Segments:
        """This plan with :meth:`tensors` replaced by their device copies ``sent``."""
        if self.slots is None:
            return self
        out = copy.copy(self)
        out.slots = sent[0]
        return out

    def sum_back(self, grad: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The gradient of ``x`` from the gradient of ``x.index_select(0, index)``."""
        rest = grad.shape[1:]
        if self.mode == "scatter":
            return grad.new_zeros((self.size, *rest)).index_put_((index,), grad)
        if self.mode == "view":
            rows = grad.reshape(self.size, self.width, *rest)
        else:
            assert self.slots is not None
            if self.padded:
                grad = torch.cat([grad, grad.new_zeros((1, *rest))])
            rows = grad.index_select(0, self.slots.reshape(-1))
            rows = rows.view(self.size, self.width, *rest)
        return rows.squeeze(1) if self.width == 1 else rows.sum(1)


class _GatherRows(torch.autograd.Function):
    """``x.index_select(0, index)``, differentiated by :meth:`_Segments.sum_back`."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, index: torch.Tensor, segments: _Segments
    ) -> torch.Tensor:
        ctx.segments = segments
        ctx.save_for_backward(index)
        return x.index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return ctx.segments.sum_back(grad, index), None, None


def _gather_rows(x: torch.Tensor, index: torch.Tensor, segments: _Segments) -> torch.Tensor:
    """``x.index_select(0, index)`` whose gradient is summed without atomics (:class:`_Segments`)."""
    return _GatherRows.apply(x, index, segments)


class _Pairs:
    """The positive pairs of a batch and the plans of their gathers (host, once per pattern).

    ``anchor``, ``ref``: (P,) the positive pairs of the valid anchors, row-major; ``flat``: their
    positions in the flattened (B, M) score matrix; ``by_anchor`` / ``by_position``: the
    :class:`_Segments` of gathering score rows by anchor / scores by position.
    """

    def __init__(self, host: BatchLayout) -> None:
        # counts per anchor: the same for every batch of the pattern (not the label values)
        self.per_anchor = {
            name: getattr(host, f"{name}_per_anchor").numpy() for name in ("positives", "negatives")
        }
        self.anchor, self.ref = host.positive_pairs()
        anchor = self.anchor.numpy()
        rows, columns = host.pos_mask.shape
        flat = anchor * columns + self.ref.numpy()
        self.flat = torch.from_numpy(flat)
        self.by_anchor = _Segments(anchor, rows)
        self.by_position = _Segments(flat, rows * columns)
        self._others: tuple[torch.Tensor, torch.Tensor, _Segments] | None = None
        self._counts: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def others(self) -> tuple[torch.Tensor, torch.Tensor, _Segments]:
        """(index, is_real, segments): :func:`_other_pairs_of_same_anchor` and its gather's plan."""
        if self._others is None:
            index, is_real = _other_pairs_of_same_anchor(self.anchor.numpy())
            segments = _Segments(index.reshape(-1), index.shape[0], keep=is_real.reshape(-1))
            self._others = (torch.from_numpy(index), torch.from_numpy(is_real), segments)
        return self._others

    def per_pair(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """n⁺ (``"positives"``) or n⁻ (``"negatives"``) of every pair's anchor, in ``dtype``."""
        key = (name, dtype)
        if key not in self._counts:
            counts = self.per_anchor[name][self.anchor.numpy()]
            self._counts[key] = _host_cast(counts, dtype)
        return self._counts[key]


def _pairs(host: BatchLayout) -> _Pairs:
    """The :class:`_Pairs` of ``host``'s label pattern."""
    return host.pattern_cached("positive_pair_plan", _Pairs)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


def _host_array(t: torch.Tensor) -> np.ndarray:
    """The CPU tensor ``t`` as numpy (bfloat16, which numpy lacks, exactly as float32)."""
    return t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy()


def _send_items(batch: PairBatch, items: dict[str, Any]) -> dict[str, Any]:
    """``items`` on the scores' device in one copy: tensors, lists of tensors, :class:`_Segments`."""
    flat: list[torch.Tensor] = []
    for value in items.values():
        if isinstance(value, _Segments):
            flat += value.tensors()
        else:
            flat += value if isinstance(value, list) else [value]
    sent = iter(batch.send(*flat))
    out: dict[str, Any] = {}
    for key, value in items.items():
        if isinstance(value, _Segments):
            out[key] = value.with_sent([next(sent) for _ in value.tensors()])
        elif isinstance(value, list):
            out[key] = [next(sent) for _ in value]
        else:
            out[key] = next(sent)
    return out


def _host_cast(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a CPU tensor of ``dtype`` (numpy's rounding is IEEE's, as torch's)."""
    if dtype in _NUMPY_DTYPES:
        return torch.from_numpy(values.astype(_NUMPY_DTYPES[dtype]))
    return torch.from_numpy(values).to(dtype)


# -- shared pieces of Eq. (5) and Eq. (8) -----------------------------------------------------------
def _negative_huber_sum(
    batch: PairBatch,
    anchor: torch.Tensor,
    by_anchor: _Segments,
    s_pos: torch.Tensor,
    tau1: float,
) -> torch.Tensor:
    """Σ_{x ∈ z⁻(anchor)} ℓ1(s⁺ − s(x)) for every positive pair: (P,)."""
    rows = _gather_rows(batch.scores / tau1, anchor, by_anchor)
    margin = rows - (s_pos / tau1 - 1)[:, None]
    is_negative = batch.negative_weights().index_select(0, anchor)
    return _MaskedHuberSum.apply(margin, is_negative)


class _MaskedHuberSum(torch.autograd.Function):
    """Row sums Σ_m mask[p, m] · ℓ1(margin[p, m]): (P, M) → (P,); ``mask`` is 0/1 float.

    Differentiated by hand because this block dominates the loss: backward is one product with the
    saved slope 2·clamp(u, 0, 1). Not twice differentiable.
    """

    @staticmethod
    def forward(ctx: Any, margin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        inside = margin.clamp(min=0, max=1)
        row_sums = (inside * (2 * margin - inside) * mask).sum(1)
        ctx.save_for_backward(inside.mul_(mask).mul_(2))  # the slope 2·clamp(u, 0, 1) · mask
        return row_sums

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (slope,) = ctx.saved_tensors
        return grad[:, None] * slope, None


def _other_pairs_of_same_anchor(anchor: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(indices, is_real), (P, W) each: the other pairs of every pair's anchor (sorted ``anchor``).

    Padding slots (is_real False) hold a valid index so the gather stays in bounds. numpy, on
    the host labels.
    """
    n_pairs = anchor.size
    pairs_per_anchor = np.bincount(anchor)
    first = (np.cumsum(pairs_per_anchor) - pairs_per_anchor)[anchor]
    n_others = pairs_per_anchor[anchor] - 1
    width = int(n_others.max()) if n_pairs else 0
    slot = np.arange(width)
    position = np.arange(n_pairs) - first
    others = first[:, None] + slot + (slot >= position[:, None])
    is_real = slot < n_others[:, None]
    return np.minimum(others, max(n_pairs - 1, 0)), is_real


def _other_positive_sigmoid_sum(
    pair_scores: torch.Tensor,
    s_pos: torch.Tensor,
    tau2: float,
    others: tuple[torch.Tensor, torch.Tensor, _Segments],
) -> torch.Tensor:
    """Σ_{x ∈ z⁺(anchor), x ≠ x⁺} ℓ2(s⁺ − s(x)) for every positive pair, from a (P, W) block: (P,).

    ``pair_scores``: (P,) the score of every positive pair; ``others``: :meth:`_Pairs.others`
    on the device.
    """
    index, is_real, segments = others
    other_scores = _gather_rows(pair_scores, index.reshape(-1), segments).view(index.shape)
    terms = sigmoid_surrogate(s_pos[:, None] - other_scores, tau2)
    return torch.where(is_real, terms, 0).sum(1)


def _unordered_pairs(
    anchor: torch.Tensor, ref: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each pair of a symmetric pair list once, and where every listed pair finds it (host).

    Returns (first, second, position): the pairs {a, b} with a < b, row-major, and for every
    listed pair (a, b) the position of {a, b} among them.
    """
    a, b = anchor.numpy(), ref.numpy()
    lower = a < b
    first, second = a[lower], b[lower]
    key = np.minimum(a, b) * n + np.maximum(a, b)
    position = np.searchsorted(first * n + second, key)
    return torch.from_numpy(first), torch.from_numpy(second), torch.from_numpy(position)


class _PairScores:
    """Scores of single (anchor, reference) pairs, each computed from its two embeddings alone.

    The last bits of ``emb @ ref.T`` depend on the batch position (BLAS blocking) and the moving
    average of ``v`` would keep them; a per-pair product gives s(a, b) == s(b, a) bit for bit.
    """

    def __init__(self, emb: torch.Tensor, ref: torch.Tensor, similarity: str) -> None:
        # in the dtype of the loss's scores: float16 dot products overflow past 65504
        dtype = score_dtype(emb.dtype)
        same = ref is emb
        emb = emb.detach().to(dtype)
        if similarity == "cosine":
            emb = F.normalize(emb, dim=1)
        if same:  # a batch ranked against itself: one normalisation
            ref = emb
        else:
            ref = ref.detach().to(dtype)
            ref = F.normalize(ref, dim=1) if similarity == "cosine" else ref
        self.emb, self.ref, self.similarity = emb, ref, similarity

    def __call__(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        a, b = self.emb.index_select(0, rows), self.ref.index_select(0, cols)
        if self.similarity == "euclidean":  # the canonical name (rankwise.similarity)
            return -(a - b).norm(dim=1)
        return (a * b).sum(1)


def _one_minus_precision(
    fpr: torch.Tensor, tpr: torch.Tensor, rate: torch.Tensor | None
) -> torch.Tensor:
    """σ(FPR / (rate · TPR)) of Eq. (3)/(8) as FPR / (FPR + rate · TPR), in at least float32.

    At many-class odds (t ~ 1e7) t/(1 + t) overflows float16 and its autograd derivative cancels
    to all digits in float32; :class:`_RatioToSum` has single-term derivatives. ``rate=None``
    stands for 1.
    """
    dtype = torch.promote_types(fpr.dtype, torch.float32)
    tpr = tpr.to(dtype)
    return _RatioToSum.apply(fpr.to(dtype), tpr if rate is None else rate.to(dtype) * tpr)


class _RatioToSum(torch.autograd.Function):
    """a / (a + b) for a ≥ 0, b > 0 with the exact derivatives b/(a + b)², −a/(a + b)²."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        total = a + b
        ctx.save_for_backward(a, b, total)
        return a / total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b, total = ctx.saved_tensors
        scale = grad / (total * total)
        return scale * b, -scale * a


# -- semi-variance regularizer, Eq. (9) -------------------------------------------------------------
class SemiVarianceRegularizer(RankingLoss):
    """Semi-variance regularizer L_var of Eq. (9).

    λ1/n⁺ Σ_{s⁺ < μ⁺} (s⁺ − μ⁺)² + λ2/n⁻ Σ_{s⁻ > μ⁻} (s⁻ − μ⁻)², where s⁺ (s⁻) runs over the
    scores of all positive (negative) pairs of the batch, pooled over anchors as in the authors'
    released configs, and μ± are their means (differentiated through).

    Use it alone (``reg(embeddings, labels)``, a :class:`RankingLoss`), add it to any loss, or pass
    it as ``semi_variance=`` to :class:`SOPRCLoss` / :class:`APLoss`, which call
    :meth:`from_batch` on their own score matrix (then this module's ``similarity`` is not used).

    Args:
        lambda_pos: λ1 ≥ 0, weight on positives below their mean (released configs: 1).
        lambda_neg: λ2 ≥ 0, weight on negatives above their mean (released configs: 5).
        similarity: ``"cosine"``, ``"dot"`` or ``"euclidean"`` (alias ``"neg_euclidean"``; standalone use only).
        normalization: ``"pairs"`` divides by n⁺ / n⁻ as Eq. (9) is written; ``"tail"`` by the
            number of terms of each tail, as the released code does (about twice as strong).

    Example:
        >>> import torch
        >>> from rankwise.losses import SemiVarianceRegularizer
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> round(SemiVarianceRegularizer()(emb, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.2262
    """

    def __init__(
        self,
        lambda_pos: float = 1.0,
        lambda_neg: float = 5.0,
        similarity: str = "cosine",
        normalization: str = "pairs",
    ) -> None:
        super().__init__(similarity)
        self.lambda_pos = check_scalar(lambda_pos, "lambda_pos", _NON_NEGATIVE)
        self.lambda_neg = check_scalar(lambda_neg, "lambda_neg", _NON_NEGATIVE)
        self.normalization = check_choice(normalization, "normalization", SEMI_VARIANCE_NORMS)

    def from_batch(self, batch: PairBatch) -> torch.Tensor:
        """Scalar L_var of a prepared :class:`PairBatch`; both terms also go to ``last_stats``."""
        scores = batch.scores
        zero = scores.new_zeros(())
        tail = self.normalization == "tail"
        host = batch.host
        positives, segments = host.pattern_cached("flat_positives", _flat_positives)
        n_pos = int(positives.numel())
        if n_pos:
            sent = _send_items(batch, {"positives": positives, "segments": segments})
            # scores[pos_mask], row-major, with a gradient written without atomics
            pos = _gather_rows(scores.reshape(-1), sent["positives"], sent["segments"])
            below = (pos - pos.mean()).clamp(max=0)
            count = (below < 0).sum().clamp(min=1) if tail else n_pos
            pos_term = (below**2).sum() / count
        else:
            pos_term = zero
        # negatives are nearly every entry: a dense 0/1 mask is cheaper than gathering them
        n_neg = int(host.negatives_per_anchor.numpy().sum())
        if n_neg:
            is_negative = batch.negative_weights()
            neg_mean = (scores * is_negative).sum() / n_neg
            above = (scores - neg_mean).clamp(min=0) * is_negative
            count = (above > 0).sum().clamp(min=1) if tail else n_neg
            neg_term = (above**2).sum() / count
        else:
            neg_term = zero
        self.last_stats.update(
            semi_variance_pos=pos_term.detach(),
            semi_variance_neg=neg_term.detach(),
            semi_variance_positive_pairs=n_pos,
            semi_variance_negative_pairs=n_neg,
        )
        return self.lambda_pos * pos_term + self.lambda_neg * neg_term

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """L_var of a prepared batch, see :meth:`from_batch`."""
        return self.from_batch(batch)

    def extra_repr(self) -> str:
        """Hyper-parameters shown by ``repr``."""
        return (
            f"lambda_pos={self.lambda_pos}, lambda_neg={self.lambda_neg}, "
            f"normalization={self.normalization!r}, " + super().extra_repr()
        )


def _flat_positives(host: BatchLayout) -> tuple[torch.Tensor, _Segments]:
    """Positions of every positive pair in the flattened score matrix, and their gather's plan."""
    positions = np.flatnonzero(host.pos_mask.numpy())
    return torch.from_numpy(positions), _Segments(positions, host.pos_mask.numel())


def _plus_semi_variance(
    owner: APLoss | SOPRCLoss, loss: torch.Tensor, batch: PairBatch
) -> torch.Tensor:
    """``loss`` plus ``owner.semi_variance`` (Eq. 9, recorded in ``last_stats``) when configured."""
    if owner.semi_variance is None:
        return loss
    reg = owner.semi_variance.from_batch(batch)
    owner.last_stats["semi_variance"] = reg.detach()
    return loss + reg


# -- biased mini-batch AP loss, Eq. (5) -------------------------------------------------------------
class APLoss(RankingLoss):
    """The biased mini-batch AP↓ estimator of Eq. (5), the baseline SOPRC is compared with (Fig. 1).

    For every anchor (query) and each of its positives x⁺ with score s⁺, both rates come from the
    batch::

        σ( Σ_{x ∈ z⁻} ℓ1(s⁺ − s(x)) / (1 + Σ_{x ∈ z⁺, x ≠ x⁺} ℓ2(s⁺ − s(x))) ),  σ(t) = t/(1+t),

    averaged over all (anchor, positive) pairs. The "1 +" counts x⁺ itself exactly (ℓ_{0,1}(0) = 1).
    Written as FPR/TPR odds this is ((1 − π0)/π0) · FPR/TPR with π0 = n⁺/(n⁺ + n⁻) the anchor's
    sampling rate in the batch, which is why it is biased when π0 differs from the class prior
    (Prop. 2); it equals ``SOPRCLoss(unbiased=False, use_v=False)``.

    Args:
        tau1: ℓ1 margin τ1 > 0 (default 0.1).
        tau2: ℓ2 temperature τ2 > 0 (default 0.001).
        semi_variance: optional :class:`SemiVarianceRegularizer` added to the loss (Eq. 9).
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"euclidean"`` (alias ``"neg_euclidean"``).

    Example:
        >>> import torch
        >>> from rankwise.losses import APLoss
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> loss = APLoss()(emb, torch.tensor([0, 0, 1, 1]))
        >>> loss.backward()
        >>> round(loss.item(), 4), emb.grad.shape
        (0.243, torch.Size([4, 2]))
    """

    def __init__(
        self,
        tau1: float = 0.1,
        tau2: float = 0.001,
        semi_variance: SemiVarianceRegularizer | None = None,
        similarity: str = "cosine",
    ) -> None:
        super().__init__(similarity)
        self.tau1 = check_scalar(tau1, "tau1", _POSITIVE)
        self.tau2 = check_scalar(tau2, "tau2", _POSITIVE)
        self.semi_variance = _check_semi_variance(semi_variance)

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """Loss of a prepared batch (see the class docstring)."""
        pairs = _pairs(batch.host)
        index, is_real, by_other = pairs.others()
        sent = _send_items(
            batch,
            {
                "anchor": pairs.anchor,
                "flat": pairs.flat,
                "others": [index, is_real],
                "n_pos": pairs.per_pair("positives", batch.scores.dtype),
                "by_position": pairs.by_position,
                "by_anchor": pairs.by_anchor,
                "by_other": by_other,
            },
        )
        anchor, n_pos = sent["anchor"], sent["n_pos"]
        # scores[anchor, ref], with a gradient written without atomics
        s_pos = _gather_rows(batch.scores.reshape(-1), sent["flat"], sent["by_position"])
        numerator = _negative_huber_sum(batch, anchor, sent["by_anchor"], s_pos, self.tau1)
        denominator = 1 + _other_positive_sigmoid_sum(
            s_pos, s_pos, self.tau2, (*sent["others"], sent["by_other"])
        )
        # σ(Σℓ1 / (1 + Σℓ2)) = Σℓ1 / (Σℓ1 + 1 + Σℓ2): no overflow, no cancellation
        dtype = torch.promote_types(numerator.dtype, torch.float32)
        ap_term = _one_minus_precision(numerator.to(dtype), denominator.to(dtype), None)
        ap_term = ap_term.mean().to(s_pos.dtype)
        self.last_stats.update(
            n_pairs=int(anchor.numel()),
            loss_ap=ap_term.detach(),
            tpr_mean=(denominator / n_pos).detach().mean(),
        )
        return _plus_semi_variance(self, ap_term, batch)

    def extra_repr(self) -> str:
        """Hyper-parameters shown by ``repr``."""
        return f"tau1={self.tau1}, tau2={self.tau2}, " + super().extra_repr()


# -- SOPRC, Eq. (8) + Alg. 1 ------------------------------------------------------------------------
class SOPRCLoss(RankingLoss):
    """SOPRC: the sampling-rate-invariant stochastic AUPRC estimator of Eq. (8), trained by Alg. 1.

    Every sample is a query. For an anchor of class c and each of its positives (score s⁺)::

        σ( (1 − π_c)/π_c · mean_{x ∈ z⁻} ℓ1(s⁺ − s(x)) / TPR(s⁺) ),  σ(t) = t / (1 + t),
        TPR(s⁺) = (1 + (N⁺_c − 1) · mean_j ℓ2(s⁺ − v_{c,j})) / N⁺_c,

    averaged over all (anchor, positive) pairs; anchors without a positive or a negative are skipped
    and counted in ``last_stats``. ``v`` (buffer, never differentiated) holds, per class, ``num_v``
    interpolated quantiles of the positive-pair scores. In training mode, before the loss is
    computed (Alg. 1 uses v_{t+1}), every class c present among the anchors gets
    v_c ← (1 − β) v_c + β φ(scores of all positive pairs whose anchor has class c) (Eq. 10), with
    detached scores and φ = :func:`score_interpolation` (Alg. 2). Pooling all anchors of a class
    makes the update independent of the batch order. Eval mode never changes any buffer.

    Args:
        num_classes: number of classes C ≥ 2; labels must lie in [0, C).
        prior: (C,) class priors π_c ∈ [0, 1] (fraction of the reference set sharing a query's
            class), or None for balanced classes π_c = 1/C. Build it from training labels with
            :meth:`from_labels`. A class with π_c = 0 raises when one of its anchors is used.
        num_v: |v|, values kept per class (default 100).
        beta: moving-average rate β ∈ [0, 1] of Eq. (10) (configs 0.1; paper text 0.001).
        tau1, tau2: ℓ1 margin and ℓ2 temperature, as for :class:`APLoss`.
        unbiased: False replaces π_c by the anchor's batch sampling rate n⁺/(n⁺ + n⁻) (Table 2,
            row 1).
        use_v: False estimates TPR from the anchor's batch positives instead of v, as
            (1 + Σ_{x ∈ z⁺, x ≠ x⁺} ℓ2(s⁺ − s(x))) / n⁺ (Table 2, rows 1–2); v is then neither read
            nor updated.
        detach_tpr: True computes the TPR denominator without gradient, as the released code does;
            False (default) differentiates through it w.r.t. s⁺, as Alg. 1 is written. True
            trained better when fine-tuning a pretrained network with K ≥ 4 views per class
            (docs/losses.md, Evidence 3).
        score_range: (low, high) clip for the extrapolated ends of φ, or None (default (−1, 1), the
            range of cosine similarity).
        semi_variance, similarity: as for :class:`APLoss` (Eq. 9 is Alg. 1's line 6).
        v_init: the start of v: ``"grid"`` (default, the released code's) or ``"uniform"``
            (sorted uniform draws) on ``v_init_range``, forgotten geometrically.
        v_init_range: (low, high) interval of the initial v (default (0, 1): positive-pair
            cosines lie mostly there).
        seed: seed of the generator used by ``v_init="uniform"`` (default 0).
        warm_start: copy φ into v_c at the first update of class c instead of averaging
            (v_1 = E[φ], Remark 1; docs/losses.md).
        positives: (C,) N⁺_c ≥ 1, the number of positives a row of v stands for (a class-c query
            has n_c − 1; :meth:`from_labels` fills it), or None for the released code's |v| + 1
            for every class (then TPR = (1 + Σ_j ℓ2(s⁺ − v_{c,j})) / (|v| + 1)).

    Buffers (carried by ``state_dict()``, ``.to()``, ``.double()``): ``v`` (C, num_v),
    ``prior`` (C,), ``v_updates`` (C,) int64 updates of every row, ``positives`` (C,). With a
    reference set, v is fed with the anchor–reference positive scores.

    Example:
        >>> import torch
        >>> from rankwise.losses import SOPRCLoss
        >>> loss_fn = SOPRCLoss.from_labels(torch.tensor([0, 0, 1, 1]))  # class priors
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> loss = loss_fn(emb, torch.tensor([0, 0, 1, 1]))  # training mode: updates v first
        >>> round(loss.item(), 4), tuple(loss_fn.v.shape), loss_fn.v_updates.tolist()
        (0.3827, (2, 100), [1, 1])
    """

    v: torch.Tensor
    prior: torch.Tensor
    v_updates: torch.Tensor
    positives: torch.Tensor

    def __init__(
        self,
        num_classes: int,
        prior: torch.Tensor | Sequence[float] | None = None,
        num_v: int = 100,
        beta: float = 0.1,
        tau1: float = 0.1,
        tau2: float = 0.001,
        unbiased: bool = True,
        use_v: bool = True,
        detach_tpr: bool = False,
        score_range: tuple[float, float] | None = (-1.0, 1.0),
        semi_variance: SemiVarianceRegularizer | None = None,
        similarity: str = "cosine",
        v_init: str = "grid",
        v_init_range: tuple[float, float] = (0.0, 1.0),
        seed: int = 0,
        warm_start: bool = False,
        positives: torch.Tensor | Sequence[float] | None = None,
    ) -> None:
        super().__init__(similarity)
        self.num_classes = check_scalar(num_classes, "num_classes", Interval("integer", 2, None))
        self.num_v = check_scalar(num_v, "num_v", _COUNT)
        self.beta = check_scalar(beta, "beta", _UNIT)
        self.tau1 = check_scalar(tau1, "tau1", _POSITIVE)
        self.tau2 = check_scalar(tau2, "tau2", _POSITIVE)
        self.unbiased = check_bool(unbiased, "unbiased")
        self.use_v = check_bool(use_v, "use_v")
        self.detach_tpr = check_bool(detach_tpr, "detach_tpr")
        self.warm_start = check_bool(warm_start, "warm_start")
        self.score_range = _check_score_range(score_range)
        self.semi_variance = _check_semi_variance(semi_variance)
        self.v_init = check_choice(v_init, "v_init", V_INITS)
        init_range = check_range_pair(v_init_range, "v_init_range")
        seed = check_scalar(seed, "seed", Interval("integer"))
        num_classes = self.num_classes

        self.register_buffer("prior", self._check_prior(prior, num_classes))
        low, high = init_range
        if v_init == "grid":
            grid = torch.arange(self.num_v, dtype=torch.float32) / self.num_v
            v = (low + (high - low) * grid).expand(num_classes, -1).clone()
        else:
            generator = torch.Generator().manual_seed(int(seed))
            draws = torch.rand(num_classes, self.num_v, generator=generator)
            v = (low + (high - low) * draws).sort(dim=1).values
        self.register_buffer("v", v)
        self.register_buffer("v_updates", torch.zeros(num_classes, dtype=torch.long))
        self.register_buffer("positives", self._check_positives(positives, num_classes))

    # -- construction helpers ------------------------------------------------------------------
    def _check_positives(self, positives: Any, num_classes: int) -> torch.Tensor:
        if positives is None:  # the released code: the positive is 1 of |v| + 1
            return torch.full((num_classes,), float(self.num_v + 1))
        n = _per_class(positives, "positives", num_classes)
        if not bool(torch.isfinite(n).all()) or bool((n < 1).any()):
            raise ValueError(
                "`positives` must hold the number of positives of a query of every class, each "
                ">= 1 (no NaN/inf)."
            )
        return n.clone()

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # checkpoints written before the `positives` buffer existed used |v| + 1 for every class
        key = prefix + "positives"
        if key not in state_dict and prefix + "v" in state_dict:
            state_dict[key] = torch.full_like(self.positives, float(self.num_v + 1))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    @staticmethod
    def _check_prior(prior: Any, num_classes: int) -> torch.Tensor:
        if prior is None:
            return torch.full((num_classes,), 1.0 / num_classes)
        p = _per_class(prior, "prior", num_classes)
        if not bool(torch.isfinite(p).all()) or bool((p < 0).any()) or bool((p >= 1).any()):
            raise ValueError(
                "`prior` must hold class priors in [0, 1) (no NaN/inf; a prior of 1 would leave "
                "the class no negatives)."
            )
        return p.clone()

    @classmethod
    def from_labels(
        cls,
        train_labels: Any,
        num_classes: int | None = None,
        prior_scale: float | None = DEFAULT_PRIOR_SCALE,
        tpr_count: str = "class",
        **kwargs: Any,
    ) -> SOPRCLoss:
        """Build the loss with class priors counted from the training labels.

        By default the released code's ``prior_mul`` rule π_c = prior_scale · n_c / max_c n_c (the
        largest class gets ``prior_scale``); ``prior_scale=None`` gives the theory's raw ratio
        π_c = (n_c − 1)/(N − 1) (~1e-4 on SOP: almost no gradient; docs/losses.md). Classes absent
        from ``train_labels`` (and, with ``prior_scale=None``, singletons) get π_c = 0.

        Args:
            train_labels: (N,) integer class ids of the training set, N ≥ 2.
            num_classes: C, default ``max(train_labels) + 1``.
            prior_scale: the prior of the largest class, in (0, 1), or None for the raw ratio.
            tpr_count: ``"class"`` (default): the TPR term counts the N⁺_c = n_c − 1 positives of
                a class-c query; ``"num_v"``: the released code's |v| + 1.
            **kwargs: any other :class:`SOPRCLoss` argument (not ``prior`` or ``positives``).
        """
        for computed in ("prior", "positives"):
            if computed in kwargs:
                raise ValueError(
                    f"`from_labels` computes `{computed}`; pass it to SOPRCLoss(...) instead."
                )
        tpr_count = check_choice(tpr_count, "tpr_count", TPR_COUNTS)
        labels = as_tensor(train_labels, "train_labels")
        if labels.ndim != 1 or labels.numel() < 2:
            raise ValueError(
                f"`train_labels` must be a 1-D array of at least 2 class ids, got shape "
                f"{tuple(labels.shape)}."
            )
        if labels.is_floating_point() or labels.dtype == torch.bool or labels.is_complex():
            raise ValueError(f"`train_labels` must hold integer class ids, got {labels.dtype}.")
        labels = labels.to(torch.long).cpu()
        if bool((labels < 0).any()):
            raise ValueError("`train_labels` must be non-negative class ids.")
        top = int(labels.max()) + 1
        if num_classes is None:
            num_classes = top
        else:
            num_classes = check_scalar(num_classes, "num_classes", Interval("integer", 2, None))
        if num_classes < top:
            raise ValueError(
                f"`train_labels` holds class id {top - 1} but `num_classes` = {num_classes}; "
                "pass num_classes > max(train_labels)."
            )
        counts = torch.bincount(labels, minlength=num_classes).to(torch.float64)
        if prior_scale is None:
            prior = (counts - 1).clamp(min=0) / (labels.numel() - 1)
        else:
            prior_scale = check_scalar(
                prior_scale, "prior_scale", Interval("real", 0, 1, closed="neither")
            )
            prior = prior_scale * counts / counts.max()
        positives = (counts - 1).clamp(min=1) if tpr_count == "class" else None
        return cls(num_classes, prior=prior, positives=positives, **kwargs)

    # -- host copies of the fixed buffers ------------------------------------------------------------
    def _host_buffer(self, name: str) -> torch.Tensor:
        """A CPU copy of the buffer ``prior`` or ``positives``, read once after it changes.

        The step derives its per-pair priors and positive counts from the labels on the host, so
        it never reads these buffers on the device. The copy is refreshed when the buffer's
        version (in-place writes, ``load_state_dict``) or storage changes; device and dtype moves
        carry it over (:meth:`_apply`).
        """
        buffer = getattr(self, name)
        key = (buffer._version, buffer.data_ptr(), buffer.dtype)
        mirrors = self.__dict__.setdefault("_mirrors", {})
        cached = mirrors.get(name)
        if cached is None or cached[0] != key:
            cached = (key, buffer.detach().to("cpu", copy=True))
            mirrors[name] = cached
        return cached[1]

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> SOPRCLoss:
        # a move keeps the values (a dtype change rounds them the same on the host): carry the
        # host copies over instead of reading the moved buffers back
        copies = {name: self._host_buffer(name) for name in _HOST_BUFFERS}
        out = super()._apply(fn, *args, **kwargs)
        for name, mirror in copies.items():
            buffer = getattr(self, name)
            key = (buffer._version, buffer.data_ptr(), buffer.dtype)
            self.__dict__["_mirrors"][name] = (key, mirror.to(buffer.dtype))
        return out

    # -- forward ---------------------------------------------------------------------------------
    def _check_batch(self, batch: PairBatch) -> None:
        """Class ids in range and the buffers on the embeddings' device (host labels only)."""
        host = batch.host
        for name, lab in (("labels", host.labels), ("ref_labels", host.ref_labels)):
            assert lab is not None  # a prepared batch carries its host labels
            ids = lab.numpy()
            bad = (ids < 0) | (ids >= self.num_classes)
            if bad.any():
                raise ValueError(
                    f"`{name}` must be class ids in [0, num_classes) = [0, {self.num_classes}); "
                    f"got {int(bad.sum())} out of range (e.g. {int(ids[bad][0])}). Build the loss "
                    "with a larger `num_classes` or remap the labels."
                )
        if self.v.device != batch.scores.device:
            raise ValueError(
                f"SOPRCLoss buffers are on {self.v.device} but `embeddings` are on "
                f"{batch.scores.device}; move the loss with loss.to(device)."
            )

    @torch.no_grad()
    def _update_v(
        self,
        batch: PairBatch,
        pair_scores: _PairScores | None,
        pairs: list[torch.Tensor],
        groups: _GroupLayout,
        sent: list[torch.Tensor],
    ) -> int:
        """Moving average of Eq. (10) on the rows of the classes present among the anchors.

        ``pairs``: (anchor, ref) of the positive pairs, or with a third tensor each unordered pair
        once and the positions that spread their scores over the pairs. Where
        ``batch.inputs_ok`` is False (refused embeddings) every row keeps its value.
        """
        classes, *phi_sent = sent
        if pair_scores is None:
            scores = batch.scores[pairs[0], pairs[1]]
        elif len(pairs) == 3:  # each unordered pair once, then in the order of the pairs
            scores = pair_scores(pairs[0], pairs[1]).index_select(0, pairs[2])
        else:
            scores = pair_scores(pairs[0], pairs[1])
        scores = scores.detach().to(self.v.dtype)
        phi = _phi(scores, groups, phi_sent, self.score_range)
        old = self.v.index_select(0, classes)
        if self.warm_start:
            first = self.v_updates.index_select(0, classes)[:, None] == 0
            beta = torch.where(first, 1.0, torch.full_like(first, self.beta, dtype=self.v.dtype))
            new = (1 - beta) * old + beta * phi
        else:
            # the constants of (1 − β) v + β φ, rounded to v's dtype as a (1 − β) tensor would be
            keep, take = _moving_average_weights(self.beta, self.v.dtype)
            new = keep * old + take * phi
        if batch.inputs_ok is None:
            updates = torch.ones_like(classes)
        else:
            new = torch.where(batch.inputs_ok, new, old)
            updates = batch.inputs_ok.to(classes.dtype).expand(classes.shape)
        self.v.index_copy_(0, classes, new)
        self.v_updates.index_add_(0, classes, updates)
        return groups.n_groups

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss of one batch (in training mode, after the update of ``v``).

        Arguments as :meth:`RankingLoss.forward`; labels are class ids in [0, num_classes).
        """
        batch = self.prepare(embeddings, labels, ref_embeddings, ref_labels)
        assert batch.embeddings is not None and batch.ref_embeddings is not None
        pair_scores = _PairScores(batch.embeddings, batch.ref_embeddings, self.similarity)
        return self.finish(self._compute(batch, pair_scores), batch)

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """Loss of a prepared batch; ``v`` is fed with the pair scores of ``batch.scores``."""
        return self._compute(batch, None)

    def _pair_plan(
        self, batch: PairBatch, symmetric: bool
    ) -> tuple[dict[str, Any], _GroupLayout | None]:
        """The step's label-only tensors, computed on the host (numpy) and sent in one copy.

        Returns the device tensors by name: ``anchor, flat`` (the pairs' rows and positions in the
        scores), ``anchor_labels, n_neg, rate``, ``n_class`` (with v) or ``others`` (index,
        is_real, plan; without), the plans ``by_position, by_anchor`` of the gathers, and, when v
        is updated, ``pairs`` (``anchor, ref`` of every positive pair, or with ``symmetric`` each
        unordered pair once and where each ordered pair finds its score), ``update`` (the
        classes and φ's tensors); and φ's layout (None without an update).
        """
        host = batch.host
        assert host.labels is not None
        dtype = batch.scores.dtype
        pairs = _pairs(host)
        # label values change from batch to batch of a pattern: looked up with numpy, on the
        # calling thread (a torch op on the host may wake the intra-op thread pool)
        anchor_labels = host.labels.numpy()[pairs.anchor.numpy()]
        n_neg = pairs.per_pair("negatives", dtype)
        if self.unbiased:
            # checked before v is updated: a call that raises leaves the state as it was
            prior = self._anchor_priors(anchor_labels)
            rate = torch.from_numpy(prior / (1 - prior))  # π/(1 − π), the prior odds of a positive
        else:
            # π0/(1 − π0) with π0 = n⁺/(n⁺ + n⁻), the batch sampling rate
            n_pos = pairs.per_pair("positives", dtype)
            rate = host.pattern_cached(("batch_rate", dtype), lambda h: n_pos / n_neg)
        items: dict[str, Any] = {
            "anchor": pairs.anchor,
            "flat": pairs.flat,
            "anchor_labels": torch.from_numpy(anchor_labels),
            "n_neg": n_neg,
            "rate": rate,
            "by_position": pairs.by_position,
            "by_anchor": pairs.by_anchor,
        }
        if self.use_v:
            positives = _host_array(self._host_buffer("positives"))[anchor_labels]
            items["n_class"] = _host_cast(positives, dtype)
        else:
            index, is_real, by_other = pairs.others()
            items.update(others=[index, is_real], by_other=by_other)
            items["n_pos"] = pairs.per_pair("positives", dtype)
        groups = None
        if self.training and self.use_v:
            groups, update_pairs, group_rows = self._update_plan(host, symmetric)
            items["pairs"] = list(update_pairs)
            classes = torch.from_numpy(host.labels.numpy()[group_rows.numpy()])
            items["update"] = [classes, *groups.device_tensors()]
        return _send_items(batch, items), groups

    def _update_plan(
        self, host: BatchLayout, symmetric: bool
    ) -> tuple[_GroupLayout, tuple[torch.Tensor, ...], torch.Tensor]:
        """φ's layout over the classes of every positive pair and the pairs that feed it.

        Also returns an anchor of each group, whose label is the group's class.
        """

        def build(h: BatchLayout) -> tuple[_GroupLayout, tuple[torch.Tensor, ...], torch.Tensor]:
            anchor, ref = h.positive_pairs(valid_only=False)
            # the pattern's class numbers when the layout is shared by a pattern, else the labels
            classes = h.classes if h.classes is not None else h.labels
            assert classes is not None
            groups = _GroupLayout(classes[anchor], self.num_v)
            pairs = _unordered_pairs(anchor, ref, h.n_anchors) if symmetric else (anchor, ref)
            return groups, pairs, anchor[groups.first]

        key = ("soprc_update", self.num_v, symmetric)
        if host.classes is None:
            return host.cached(str(key), build)
        return host.pattern_cached(key, build)

    def _compute(self, batch: PairBatch, pair_scores: _PairScores | None) -> torch.Tensor:
        self._check_batch(batch)
        # s(a, b) == s(b, a) bit for bit: a batch against itself scores each pair once
        symmetric = pair_scores is not None and batch.self_reference
        sent, groups = self._pair_plan(batch, symmetric)
        anchor, anchor_labels, n_neg = sent["anchor"], sent["anchor_labels"], sent["n_neg"]
        # scores[anchor, ref], with a gradient written without atomics
        s_pos = _gather_rows(batch.scores.reshape(-1), sent["flat"], sent["by_position"])
        rows_updated = 0
        if groups is not None:
            rows_updated = self._update_v(batch, pair_scores, sent["pairs"], groups, sent["update"])

        fpr = _negative_huber_sum(batch, anchor, sent["by_anchor"], s_pos, self.tau1) / n_neg
        s_tpr = s_pos.detach() if self.detach_tpr else s_pos
        if self.use_v:
            # the positive itself (ℓ_{0,1}(0) = 1) plus the share of the class's other
            # N⁺ − 1 positives that v places above s⁺, out of N⁺
            v_rows = self.v.index_select(0, anchor_labels).to(s_pos.dtype)
            above = sigmoid_surrogate(s_tpr[:, None] - v_rows, self.tau2).mean(1)
            n_class = sent["n_class"]
            tpr = (1 + (n_class - 1) * above) / n_class
        else:
            index, is_real = sent["others"]
            positives = _other_positive_sigmoid_sum(
                s_tpr, s_tpr, self.tau2, (index, is_real, sent["by_other"])
            )
            tpr = (1 + positives) / sent["n_pos"]

        auprc_term = _one_minus_precision(fpr, tpr, sent["rate"]).mean().to(s_pos.dtype)
        self.last_stats.update(
            n_pairs=int(anchor.numel()),
            loss_auprc=auprc_term.detach(),
            tpr_mean=tpr.detach().mean(),
            fpr_mean=fpr.detach().mean(),
            n_v_rows_updated=rows_updated,
        )
        return _plus_semi_variance(self, auprc_term, batch)

    def _anchor_priors(self, anchor_labels: np.ndarray) -> np.ndarray:
        """π of every pair's anchor class (host); raises when one of them is 0."""
        prior = _host_array(self._host_buffer("prior"))[anchor_labels]
        if bool((prior <= 0).any()):
            zero = np.unique(anchor_labels[prior <= 0]).tolist()
            raise ValueError(
                f"`prior` is 0 for class(es) {zero[:10]} used in this batch (a class with a "
                "single training sample, or absent from `train_labels`); pass a positive "
                "prior for them, use from_labels(..., prior_scale=...), or unbiased=False."
            )
        return prior

    def extra_repr(self) -> str:
        """Hyper-parameters shown by ``repr``."""
        return (
            f"num_classes={self.num_classes}, num_v={self.num_v}, beta={self.beta}, "
            f"tau1={self.tau1}, tau2={self.tau2}, unbiased={self.unbiased}, use_v={self.use_v}, "
            f"detach_tpr={self.detach_tpr}, score_range={self.score_range}, "
            f"warm_start={self.warm_start}, " + super().extra_repr()
        )
