"""Scores for a block of queries: exact keys, or an approximation with a proven error bound.

The metrics rank by the exact keys of :mod:`rankwise.similarity`, which cost about ten times a
float32 matmul, so a block is produced in one of three ways (on any device) that all count
exactly like the keys (docs/metrics.md, "Exact scores"):

* **exact matmul** -- when every product and partial sum of the inner products is representable
  (binary / integer codes, low-precision embeddings; :func:`_exact_matmul_precision`).
* **approximation + bound** -- otherwise a float32 matmul of normalised (cosine, dot) or centred
  (euclidean) rows gives ``a_ij`` with ``|a_ij - phi_i(key_ij)| <= bound_i``, ``phi_i`` strictly
  increasing (Higham, *Accuracy and Stability of Numerical Algorithms*, 2002, Eq. 3.5); the
  counting kernels ask :meth:`BlockScorer.pair_keys` for the exact keys of the few pairs closer
  than ``2 bound_i`` to a relevant item.
* **keys** -- with ``approximate=False``, every key by the definition.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..similarity import ExactOperands, safe_row_norms, times_power_of_two

__all__ = ["BlockScorer", "LoopOperands", "ScoreBlock"]

_U32 = 2.0**-24
_U64 = 2.0**-53
# Safety factor over the proven bounds (covers the rounding of the bound's own arithmetic).
_SAFETY = 1.03
# Beyond this inner-product length a float32 approximation is too coarse to be worth verifying.
_MAX_FLOAT32_DIM = 16_384


# relative slack on the window half-width (the float64 arithmetic of the window's own ends)
_WINDOW_SLACK = 1.0 + 2.0**-40


@dataclass
class LoopOperands:
    """A score block is ``query[lo:hi] @ gallery.T`` (then cosine keys when ``query_norm2``).

    Attributes:
        query: (n_q, d') operand rows.
        gallery: (n_g, d') operand rows.
        half_window: (n_q,) tensor in the block's dtype: items whose value lies within it of a
            relevant item's value may rank either way or tie with it; 0 when the values are exact.
        exact: the values rank and tie exactly like the keys (no window needed).
        query_norm2, gallery_norm2: float64 squared norms (0 made 1) when the block must be turned
            into cosine keys ``v |v| / (|q|^2 |g|^2)``, else None.
    """

    query: torch.Tensor
    gallery: torch.Tensor
    half_window: torch.Tensor
    exact: bool
    query_norm2: torch.Tensor | None = None
    gallery_norm2: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the blocks."""
        return self.query.dtype if self.query_norm2 is None else torch.float64

    def block(self, lo: int, hi: int) -> torch.Tensor:
        """(hi - lo, n_g) values of query rows lo..hi-1: one matmul (+4 ops for cosine keys)."""
        values = self.query[lo:hi] @ self.gallery.T
        if self.query_norm2 is None:
            return values
        assert self.gallery_norm2 is not None
        d = values.to(torch.float64)
        return (d * d.abs()) / (self.query_norm2[lo:hi, None] * self.gallery_norm2[None])

    def rows(self, index: torch.Tensor) -> LoopOperands:
        """The operands of the query rows ``index`` (the gallery shared)."""
        qn = None if self.query_norm2 is None else self.query_norm2[index]
        return LoopOperands(
            self.query[index],
            self.gallery,
            self.half_window[index],
            self.exact,
            qn,
            self.gallery_norm2,
        )


@dataclass
class ScoreBlock:
    """Scores of query rows ``lo:hi`` against the whole gallery.

    Attributes:
        values: (B, N) tensor. With ``bound=None`` the values rank and tie exactly like the keys of
            :mod:`rankwise.similarity` (they are the keys, or a per-row increasing function of them
            computed exactly); otherwise they approximate them.
        bound: None, or (B,) float64 numpy array: ``|values[i, j] - phi_i(key_ij)| <= bound[i]``
            for a strictly increasing ``phi_i``.
        lo: first query row of the block.
    """

    values: torch.Tensor
    bound: np.ndarray | None
    lo: int


def _exact_matmul_precision(ops: ExactOperands) -> torch.dtype | None:
    """float32 / float64 when a matmul of the operands (augmented for euclidean) is exact, else None.

    Entries of the query are multiples of 2^lq and of the gallery of 2^lg; every product and every
    partial sum of ``q . g`` is then a multiple of 2^(lq + lg) bounded by ``|q| |g|``, hence exactly
    representable with p significand bits as long as ``|q| |g| <= 2^(p + lq + lg)``, in any
    summation order. For euclidean the terms ``2 q_k g_k``, ``|q|^2`` and ``|g|^2`` are multiples
    of ``2^(2 min(lq, lg))`` bounded by ``(|q| + |g|)^2``.
    """
    lq, lg = ops.lowest_bit_exponents()
    if lq is None or lg is None:
        return torch.float32  # an all-zero side: every score is exactly 0
    nq, ng = (norm * (1 + 1e-9) for norm in ops.max_row_norms())
    if ops.similarity == "euclidean":
        grid, magnitude = 2 * min(lq, lg), (nq + ng) ** 2
    else:
        grid, magnitude = lq + lg, nq * ng
    for dtype, bits, smallest, largest in (
        (torch.float32, 24, -126, 127),
        (torch.float64, 53, -1022, 1023),
    ):
        if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
            continue  # a TF32 / bf16 float32 matmul rounds its inputs: not exact
        if (
            math.log2(magnitude) <= bits + grid
            and grid >= smallest
            and min(lq, lg) >= smallest
            and bits + grid + 2 < largest
        ):
            return dtype
    return None


class BlockScorer:
    """Produces :class:`ScoreBlock` s of a query set against a gallery, exact in what they count.

    Args:
        query: (n_q, d) checked floating tensor.
        gallery: (n_g, d) checked floating tensor on the same device.
        similarity: canonical similarity name.
        approximate: allow the approximation + bound mode (False: exact matmul or keys only).
        float64_approximation: approximate with a float64 matmul (twice the cost of float32,
            a bound ~1e9 times tighter): cheaper overall when queries have many relevant items,
            since fewer pairs then need their exact key. The counts are the same either way.
    """

    def __init__(
        self,
        query: torch.Tensor,
        gallery: torch.Tensor,
        similarity: str,
        *,
        approximate: bool = True,
        float64_approximation: bool = False,
    ) -> None:
        self.similarity = similarity
        self.exact = ExactOperands.build(query, gallery, similarity)
        self.d = int(query.shape[1])
        self.n_gallery = int(gallery.shape[0])
        self.mode = "keys"
        precision = _exact_matmul_precision(self.exact)
        if precision is not None:
            self.mode = "exact_matmul"
            self._prepare_exact_matmul(precision)
        elif approximate:
            self.mode = "approximate"
            self._prepare_approximation(float64_approximation)

    # -- public ----------------------------------------------------------------------------------
    @property
    def bytes_per_score(self) -> int:
        """Bytes one score of a block occupies while it is produced (for chunk sizing)."""
        if self.mode == "approximate":
            return self._approx_q.element_size()
        if self.mode == "exact_matmul":
            # cosine keys: the products, then float64 inner products, norm products and keys
            return self._matmul_dtype.itemsize + (24 if self._cosine_keys else 0)
        return 8 * 4  # keys: accumulator, product and comparison temporaries

    def block(self, lo: int, hi: int, col_lo: int = 0, *, keys: bool = False) -> ScoreBlock:
        """Scores of query rows ``lo:hi`` against gallery rows ``col_lo:`` (see :class:`ScoreBlock`).

        With ``keys=True`` an exact block holds the keys themselves (not merely values that rank
        like them within a row).
        """
        if self.mode == "exact_matmul":
            return ScoreBlock(self._exact_matmul_block(lo, hi, col_lo, keys), None, lo)
        if self.mode == "approximate":
            values = self._approx_q[lo:hi] @ self._approx_g[col_lo:].T
            return ScoreBlock(values, self._bound[lo:hi].copy(), lo)
        return ScoreBlock(self.exact.keys(lo, hi, col_lo), None, lo)

    def keys(self, lo: int, hi: int, col_lo: int = 0) -> torch.Tensor:
        """(hi - lo, N - col_lo) float64 exact keys: the matmul when exact, else the definition."""
        if self.mode == "exact_matmul":
            return self._exact_matmul_block(lo, hi, col_lo, True).to(torch.float64)
        return self.exact.keys(lo, hi, col_lo)

    def value_interval(self, block: ScoreBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """Lower and upper float64 bounds of the exact similarity values of an approximate block.

        The values are those of :func:`rankwise.similarity.similarity_from_keys` (``cos``,
        ``q . g``, ``-||q - g||``); the interval is widened by a relative 1e-12 for the rounding
        of its own arithmetic.
        """
        x = block.values.to(torch.float64)
        e = torch.from_numpy(block.bound).to(x.device)[:, None]
        if self.similarity == "cosine":
            low, high = x - e, x + e
        elif self.similarity == "dot":
            scale = self._value_scale[block.lo : block.lo + x.shape[0], None]
            low, high = (x - e) * scale, (x + e) * scale
        else:
            low = -torch.sqrt((e - x).clamp_min(0)) * self._distance_scale
            high = -torch.sqrt((-x - e).clamp_min(0)) * self._distance_scale
        slack = 1e-12 * torch.maximum(low.abs(), high.abs()) + 1e-300
        return low - slack, high + slack

    def pair_keys_tensor(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """float64 exact keys of (query ``rows[m]``, gallery ``cols[m]``) on the operands' device."""
        return self.exact.pair_keys(rows, cols)

    def pair_keys(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """float64 exact keys of (query ``rows[m]``, gallery ``cols[m]``) (absolute query rows)."""
        keys = self.exact.pair_keys(torch.from_numpy(rows), torch.from_numpy(cols))
        return keys.cpu().numpy()

    def loop_operands(self) -> LoopOperands:
        """What the device chunk loop needs to score a block (:mod:`rankwise.metrics._device`)."""
        if self.mode == "exact_matmul":
            ops = self.exact
            q, g = self._matmul_q, self._matmul_g
            if self.similarity == "cosine" and self._cosine_keys:
                # zero norms made 1: a zero row's inner products are 0, so its keys stay 0
                qn, gn = (
                    torch.where(x == 0, torch.ones_like(x), x)
                    for x in (ops.query_norm2, ops.gallery_norm2)
                )
                return LoopOperands(
                    q,
                    g,
                    torch.zeros(q.shape[0], dtype=torch.float64, device=q.device),
                    True,
                    qn,
                    gn,
                )
            zero = torch.zeros(q.shape[0], dtype=self._matmul_dtype, device=q.device)
            return LoopOperands(q, g, zero, True)
        if self.mode != "approximate":
            raise ValueError(
                "the device loop scores blocks by one matmul: build with approximate=True"
            )
        q, g = self._approx_q, self._approx_g
        # |fl(v -+ h) - (v -+ h)| <= 2^-53 (|v| + h) for float64 values |v| <= limit, so the
        # window ends computed on the device enclose +-2 bound (slack included) exactly
        limit = float(safe_row_norms(q).max()) * float(safe_row_norms(g).max()) * 1.001
        if q.dtype != torch.float64:
            raise ValueError("the device loop needs the float64 approximation")
        half = (2.0 * _WINDOW_SLACK * self._bound + 2.0**-52 * limit) * (1 + 2.0**-50)
        return LoopOperands(q, g, torch.from_numpy(half).to(q.device), False)

    # -- exact matmul ----------------------------------------------------------------------------
    def _prepare_exact_matmul(self, dtype: torch.dtype) -> None:
        ops = self.exact
        self._matmul_dtype = dtype
        q = ops.query.to(dtype)  # exact: the grid fits the precision
        g = q if ops.shared else ops.gallery.to(dtype)
        self._cosine_keys = False
        if ops.similarity == "euclidean":
            # -(|q - g|^2) = 2 q.g - |q|^2 - |g|^2 as one exact matmul of augmented rows
            qn = (ops.query * ops.query).sum(1, keepdim=True).to(dtype)
            gn = qn if ops.shared else (ops.gallery * ops.gallery).sum(1, keepdim=True).to(dtype)
            q = torch.cat([2 * q, -qn, -torch.ones_like(qn)], dim=1)
            g = torch.cat([g, torch.ones_like(gn), gn], dim=1)
        elif ops.similarity == "cosine":
            # Within a row, key = D |D| / (|q|^2 |g|^2). With every |g|^2 equal the inner product D
            # ranks and ties like the key as long as D |D| is an exact integer multiple below 2^52
            # of the grid (distinct multiples then stay distinct after the one division).
            equal_norms = bool((ops.gallery_norm2 == ops.gallery_norm2[0]).all()) and bool(
                ops.gallery_norm2[0] > 0
            )
            lq, lg = ops.lowest_bit_exponents()
            nq, ng = ops.max_row_norms()
            bound = nq * ng
            small = lq is not None and lg is not None and bound**2 < 2.0 ** (52 + 2 * (lq + lg))
            self._cosine_keys = not (equal_norms and small)
        self._matmul_q, self._matmul_g = q, g

    def _exact_matmul_block(self, lo: int, hi: int, col_lo: int, keys: bool) -> torch.Tensor:
        # exact whatever kernel BLAS picks for this shape (gemv for one row, gemm otherwise)
        dots = self._matmul_q[lo:hi] @ self._matmul_g[col_lo:].T
        if self.similarity != "cosine" or not (self._cosine_keys or keys):
            return dots
        ops = self.exact
        d = dots.to(torch.float64)
        den = ops.query_norm2[lo:hi, None] * ops.gallery_norm2[None, col_lo:]
        return torch.where(den == 0, torch.zeros_like(d), (d * d.abs()) / den)

    # -- approximation + bound -------------------------------------------------------------------
    def _prepare_approximation(self, float64: bool) -> None:
        ops = self.exact
        d = self.d
        # a reduced float32 matmul precision (TF32 / bf16 passes) would void the float32 bound
        use_float32 = (
            not float64
            and torch.get_float32_matmul_precision() == "highest"
            and d <= _MAX_FLOAT32_DIM
        )
        dtype = torch.float32 if use_float32 else torch.float64
        u = _U32 if use_float32 else _U64
        # what the float64 keys themselves may differ from the exact real values, in the same units
        key_error = (3 * d + 12) * _U64
        # float32 products of normal numbers never underflow here (|entries| <= 1); subnormal
        # entries flushed to zero by the BLAS change a sum by at most d * 2^-126
        flush = (d + 2) * 2.0**-125 if use_float32 else (d + 2) * 2.0**-1021
        n_q = ops.query.shape[0]
        if ops.similarity in ("cosine", "dot"):
            unit_q = _unit_rows(ops.query)
            if ops.similarity == "cosine":
                g = unit_q if ops.gallery is ops.query else _unit_rows(ops.gallery)
            else:
                # one power of two for the whole gallery: the approximation is then (q . g) /
                # (|q| 2^s), strictly increasing in the key within a row
                largest = float(safe_row_norms(ops.gallery).max())
                exponent = math.frexp(largest)[1] if largest > 0 else 0
                g = times_power_of_two(ops.gallery, _int_on(-exponent, ops.gallery.device))
                self._value_scale = safe_row_norms(ops.query) * 2.0**exponent
            scale = 1.001 if g is unit_q else float(safe_row_norms(g).max()) * 1.001
            bound = _SAFETY * ((d + 3) * u + key_error) * max(scale, 1e-300) + flush
            self._bound = np.full(n_q, bound)
            self._approx_q = unit_q.to(dtype)
            self._approx_g = self._approx_q if g is unit_q else g.to(dtype)
            return
        # euclidean: centre on the gallery mean and scale by a power of two, then
        # -|q - g|^2 = 2 q.g - |q|^2 - |g|^2 as one matmul of augmented rows
        # leave-one-out (one set of operands): each step once, the gallery side is the query's
        shared = ops.shared
        center = ops.gallery.mean(0, keepdim=True).to(dtype).to(torch.float64)
        q_c = ops.query - center
        g_c = q_c if shared else ops.gallery - center
        q_c_norm = float(safe_row_norms(q_c).max())
        largest = q_c_norm if shared else max(q_c_norm, float(safe_row_norms(g_c).max()))
        exponent = math.frexp(largest)[1] if largest > 0 else 0
        power = _int_on(-exponent, q_c.device)
        q_s = times_power_of_two(q_c, power).to(dtype)
        g_s = q_s if shared else times_power_of_two(g_c, power).to(dtype)
        q_norm = safe_row_norms(q_s) * 1.001
        g_norm = float(q_norm.max()) if shared else float(safe_row_norms(g_s).max()) * 1.001
        qn = (q_s.double() ** 2).sum(1, keepdim=True).to(dtype)
        gn = qn if shared else (g_s.double() ** 2).sum(1, keepdim=True).to(dtype)
        self._approx_q = torch.cat([2 * q_s, -qn, -torch.ones_like(qn)], dim=1)
        self._approx_g = torch.cat([g_s, torch.ones_like(gn), gn], dim=1)
        spread = (q_norm + g_norm) ** 2
        self._distance_scale = 2.0**exponent
        self._bound = (_SAFETY * ((d + 8) * u + key_error) * spread + flush).cpu().numpy()


def _int_on(value: int, device: torch.device) -> torch.Tensor:
    """0-d int64 tensor filled on ``device`` (no host copy).

    An exponent of the scalings, which go through :func:`rankwise.similarity.times_power_of_two`
    (``torch.ldexp`` is inexact on CUDA).
    """
    return torch.full((), value, dtype=torch.int64, device=device)


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    """float64 rows divided by their norm (zero rows stay zero)."""
    norm = safe_row_norms(x)
    return x / torch.where(norm > 0, norm, torch.ones_like(norm))[:, None]
