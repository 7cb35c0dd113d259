"""One similarity vocabulary: names, the losses' score matrix and the metrics' exact keys.

Three similarities, one spelling: ``"cosine"`` (the inner product of L2-normalised rows; the score
of Wen et al., NeurIPS 2022, Sec. 5, and of the AUC loss of Gajić et al., Eq. 1-3), ``"dot"`` (the
raw inner product, e.g. of binary codes, He et al., CVPR 2018, Eq. 2) and ``"euclidean"`` (score
``-||q - g||``; alias ``"neg_euclidean"``, :data:`SIMILARITY_ALIASES`).

:func:`similarity_matrix` is the losses' differentiable score matrix (one matmul, input dtype).
:func:`ranking_keys` gives the metrics' exact float64 keys, which rank and tie exactly like the
similarity: ``q . g`` (dot), ``cos * |cos| = (q . g) |q . g| / (||q||^2 ||g||^2)`` (cosine, no
square root) and ``-||q - g||^2`` (euclidean, differences first). Every sum runs over
``k = 0, 1, ..., d - 1`` in order in float64, one rounding per operation, in the numba kernels and
the torch code alike, so a pair's key depends on its two rows only (docs/metrics.md, "Exact
scores"). :func:`similarity_from_keys` turns keys back into similarities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ._threads import keeps_torch_threads
from ._validation import check_choice, check_embeddings

__all__ = [
    "SIMILARITIES",
    "SIMILARITY_ALIASES",
    "ExactOperands",
    "check_similarity",
    "exact_similarity",
    "ranking_keys",
    "similarity_from_keys",
    "similarity_matrix",
]

SIMILARITIES = ("cosine", "dot", "euclidean")
SIMILARITY_ALIASES = {"neg_euclidean": "euclidean"}

# Kernel codes (rankwise._similarity_kernels uses the same numbers).
_CODES = {"dot": 0, "cosine": 1, "euclidean": 2}
# float64 keys of float64 inputs overflow past ~1.8e308; refuse anything whose bound exceeds this.
_OVERFLOW_LIMIT = 2.0**1000
# IEEE 754 binary64: exponent bias, stored significand bits, smallest normal and subnormal exponents
_EXPONENT_BIAS = 1023
_SIGNIFICAND_BITS = 52
_MIN_NORMAL_EXPONENT = -1022
_SMALLEST_EXPONENT = -1074
_STEP_DOWN = _MIN_NORMAL_EXPONENT + _SIGNIFICAND_BITS + 1  # 2^-969: keeps |x| >= 2^-53 normal


def check_similarity(similarity: Any, name: str = "similarity") -> str:
    """The canonical name of ``similarity`` (``"neg_euclidean"`` becomes ``"euclidean"``).

    Raises:
        ValueError: naming ``name`` and the accepted values.
    """
    if isinstance(similarity, str):
        similarity = SIMILARITY_ALIASES.get(similarity, similarity)
    try:
        return check_choice(similarity, name, SIMILARITIES)
    except ValueError:
        raise ValueError(
            f"`{name}` must be one of 'cosine', 'dot' or 'euclidean' ('neg_euclidean' is an alias "
            f"of 'euclidean'), got {similarity!r}."
        ) from None


def similarity_matrix(
    queries: torch.Tensor, refs: torch.Tensor, similarity: str = "cosine"
) -> torch.Tensor:
    """Differentiable score matrix (n_queries, n_refs) of the losses: higher means more similar.

    Args:
        queries: (n_q, d) float tensor.
        refs: (n_r, d) float tensor (``refs is queries`` normalises once for cosine).
        similarity: ``"cosine"``, ``"dot"`` or ``"euclidean"`` (alias ``"neg_euclidean"``):
            ``-||q - r||``, computed by expanding the square and clamping at 1e-12 before the
            square root (``cdist`` has an unstable gradient at distance 0).

    Returns:
        (n_q, n_r) tensor in the input dtype. For exact evaluation use :func:`ranking_keys`.

    Example:
        >>> import torch
        >>> from rankwise.similarity import similarity_matrix
        >>> x = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 2.0]])
        >>> similarity_matrix(x, x).double().round(decimals=4).tolist()  # cosine
        [[1.0, 0.6, 0.0], [0.6, 1.0, 0.8], [0.0, 0.8, 1.0]]
    """
    similarity = check_similarity(similarity)
    if similarity == "cosine":
        unit_queries = F.normalize(queries, dim=1)
        # a batch ranked against itself is normalized once (half the work, forward and backward)
        unit_refs = unit_queries if refs is queries else F.normalize(refs, dim=1)
        return unit_queries @ unit_refs.T
    if similarity == "dot":
        return queries @ refs.T
    sq = (queries * queries).sum(1, keepdim=True) + (refs * refs).sum(1) - 2 * queries @ refs.T
    return -sq.clamp_min(1e-12).sqrt()


# -- exact evaluation keys -------------------------------------------------------------------------


def power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """float64 ``2^e`` of an integer tensor, exactly, built from the IEEE 754 bits on any device.

    ``torch.ldexp`` multiplies by ``pow(2, e)``, which CUDA computes inexactly in float64
    (``ldexp(1, -4)`` gives 0.06249999999999999 there). Here the bits are written directly: the
    biased exponent ``e + 1023`` for normal powers (``e >= -1022``), the single significand bit
    ``2^(e + 1074)`` for subnormal ones (``-1074 <= e < -1022``); 0 below -1074, inf above 1023
    (the correctly rounded values).

    Example:
        >>> import torch
        >>> from rankwise.similarity import power_of_two
        >>> power_of_two(torch.tensor([-1075, -1074, -4, 0, 1023, 1024])).tolist()
        [0.0, 5e-324, 0.0625, 1.0, 8.98846567431158e+307, inf]
    """
    e = exponent.to(torch.int64)
    normal = (e + _EXPONENT_BIAS).clamp(1, 2 * _EXPONENT_BIAS) << _SIGNIFICAND_BITS
    subnormal = torch.ones_like(e) << (e - _SMALLEST_EXPONENT).clamp(0, _SIGNIFICAND_BITS - 1)
    value = torch.where(e >= _MIN_NORMAL_EXPONENT, normal, subnormal).view(torch.float64)
    value = torch.where(e > _EXPONENT_BIAS, torch.full_like(value, float("inf")), value)
    return torch.where(e < _SMALLEST_EXPONENT, torch.zeros_like(value), value)


def times_power_of_two(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """``x * 2^e`` correctly rounded (as C's ``ldexp``) for float64 ``x`` and any integer ``e``.

    Three multiplications by normal powers of two (:func:`power_of_two`), as musl's ``scalbn``:
    a shift beyond the normal range is taken in steps of ``2^1023`` up or ``2^-969`` down first.
    A step up is exact (the result only grows); a step down rounds only an intermediate below
    ``2^-1022``, whose final value is then below ``2^-1075`` and rounds to 0 either way, so the one
    rounding is that of the exact product.

    Example:
        >>> import torch
        >>> from rankwise.similarity import times_power_of_two
        >>> x = torch.tensor([5e-324, 3.0, -1.5], dtype=torch.float64)
        >>> times_power_of_two(x, torch.tensor([1074, -4, -1074])).tolist()  # ties to even
        [1.0, 0.1875, -1e-323]
    """
    e = exponent.to(torch.int64)
    zero = torch.zeros_like(e)
    for _ in range(2):
        down = torch.where(e < _MIN_NORMAL_EXPONENT, zero + _STEP_DOWN, zero)
        step = torch.where(e > _EXPONENT_BIAS, zero + _EXPONENT_BIAS, down)
        x = x * power_of_two(step)
        e = e - step
    return x * power_of_two(e.clamp(_MIN_NORMAL_EXPONENT, _EXPONENT_BIAS))


def _power_of_two_row_scale(x: torch.Tensor) -> torch.Tensor:
    """Rows multiplied by powers of two so that their largest |entry| lies in [0.5, 1) (exact).

    Pure torch on every device (the CPU runs the code CUDA runs): ``frexp`` of the row maxima,
    then :func:`times_power_of_two`, never ``torch.ldexp`` (inexact on CUDA).
    """
    _, exponent = torch.frexp(x.abs().amax(dim=1))
    return times_power_of_two(x, -exponent.to(torch.int64)[:, None])


def safe_row_norms(x: torch.Tensor) -> torch.Tensor:
    """(n,) float64 Euclidean norms without overflow or underflow of the squares (to rounding)."""
    x = x.to(torch.float64)
    largest = x.abs().amax(dim=1)
    scale = torch.where(largest > 0, largest, torch.ones_like(largest))
    return largest * torch.linalg.vector_norm(x / scale[:, None], dim=1)


def sequential_column_sums(terms: torch.Tensor) -> torch.Tensor:
    """(m,) float64 ``sum_k terms[k, j]`` added in the order k = 0, 1, ..., one rounding per step.

    One ``cumsum`` over the leading dimension of a (d, m) tensor, on any device: the CPU kernel
    scans each column in order, and so does CUDA's along a dimension that is not the innermost
    (a 1-D scan would take CUB's tree-shaped one, so a lone column gets a zero companion). The
    result is the definition's sequential sum bit for bit, in a constant number of kernels.
    """
    if terms.shape[1] == 1:
        return sequential_column_sums(torch.cat([terms, torch.zeros_like(terms)], dim=1))[:1]
    return torch.cumsum(terms, dim=0)[-1]


def _sequential_norms2(x: torch.Tensor) -> torch.Tensor:
    """(n,) sum_k x[:, k] * x[:, k] in the order k = 0, 1, ... (the definition's own norms)."""
    if x.device.type == "cpu":
        from ._similarity_kernels import squared_norms

        return torch.from_numpy(squared_norms(x.numpy()))
    xt = x.T
    return sequential_column_sums(xt * xt)


def transposed_pair_keys(
    code: int, q_t: torch.Tensor, g_t: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """(m,) float64 keys of the pairs (query ``rows[i]``, gallery ``cols[i]``), m >= 2.

    Args:
        code: kernel code of the similarity (:attr:`ExactOperands.code`).
        q_t: (d + 1, n_q) float64: the query operands transposed, then (cosine) their squared
            norms with 0 replaced by 1 (a zero row has inner products 0, so its keys stay 0).
        g_t: (d + 1, n_g) float64, the same for the gallery.
        rows: (m,) int64 query rows.
        cols: (m,) int64 gallery rows.

    A constant number of kernels whatever ``d``: the (d, m) products, then
    :func:`sequential_column_sums`; the same operations as the definition, so the same bits.
    """
    d = q_t.shape[0] - 1
    q = q_t.index_select(1, rows)
    g = g_t.index_select(1, cols)
    if code == _CODES["euclidean"]:
        t = q[:d] - g[:d]
        return -torch.cumsum(t * t, dim=0)[-1]
    prod = q * g
    acc = torch.cumsum(prod[:d], dim=0)[-1]
    if code == _CODES["dot"]:
        return acc
    return (acc * acc.abs()) / prod[d]  # prod[d]: the product of the two squared norms


def _torch_keys(
    code: int,
    q: torch.Tensor,
    g: torch.Tensor,
    q_norm2: torch.Tensor,
    g_norm2: torch.Tensor,
    pairs: bool = False,
) -> torch.Tensor:
    """(B, N) keys, or with ``pairs`` the (B,) keys of (q[i], g[i]).

    Pairs: the (d, B) products summed by :func:`sequential_column_sums` (a constant number of
    kernels). Blocks: one elementwise operation per step of the sum (a (d, B, N) tensor would
    not fit). No fused multiply-add either way.
    """
    if pairs:
        qt, gt = q.T, g.T
        if code == _CODES["euclidean"]:
            diff = qt - gt
            acc = sequential_column_sums(diff * diff)
        else:
            acc = sequential_column_sums(qt * gt)
        if code == _CODES["dot"]:
            return acc
        if code == _CODES["euclidean"]:
            return -acc
        den = q_norm2 * g_norm2
        return torch.where(den == 0, torch.zeros_like(acc), (acc * acc.abs()) / den)
    # (B, N) spelled out: torch.broadcast_shapes imports sympy on its first call (0.5 s)
    shape = (q.shape[0], g.shape[0])
    q, g, q_norm2, g_norm2 = q[:, None], g[None], q_norm2[:, None], g_norm2[None]
    acc = torch.zeros(shape, dtype=torch.float64, device=q.device)
    for k in range(q.shape[-1]):
        if code == _CODES["euclidean"]:
            t = q[..., k] - g[..., k]
            acc = acc + t * t
        else:
            acc = acc + q[..., k] * g[..., k]
    if code == _CODES["dot"]:
        return acc
    if code == _CODES["euclidean"]:
        return -acc
    den = q_norm2 * g_norm2
    return torch.where(den == 0, torch.zeros_like(acc), (acc * acc.abs()) / den)


@dataclass(frozen=True)
class ExactOperands:
    """The float64 rows and norms from which the exact keys of a query set and a gallery follow.

    Build with :meth:`build`. For cosine the rows are multiplied by powers of two (max |entry| in
    [0.5, 1)), which leaves every key unchanged and keeps float64 inputs from overflowing.

    Attributes:
        similarity: canonical similarity name.
        query: (n_q, d) float64.
        gallery: (n_g, d) float64.
        query_norm2: (n_q,) float64 sequential squared norms of ``query`` (cosine; else zeros).
        gallery_norm2: (n_g,) float64, likewise.
    """

    similarity: str
    query: torch.Tensor
    gallery: torch.Tensor
    query_norm2: torch.Tensor
    gallery_norm2: torch.Tensor

    @property
    def code(self) -> int:
        """Kernel code of the similarity."""
        return _CODES[self.similarity]

    @classmethod
    def build(cls, query: torch.Tensor, gallery: torch.Tensor, similarity: str) -> ExactOperands:
        """Operands of checked (n, d) floating tensors on one device.

        Raises:
            ValueError: float64 inputs whose keys would overflow float64.
        """
        similarity = check_similarity(similarity)
        same = gallery is query  # leave-one-out: one set of operands serves both sides
        q = query.detach().to(torch.float64)
        g = q if same else gallery.detach().to(torch.float64)
        if similarity == "cosine":
            q = _power_of_two_row_scale(q).contiguous()
            g = q if same else _power_of_two_row_scale(g).contiguous()
            q_norm2 = _sequential_norms2(q)
            g_norm2 = q_norm2 if same else _sequential_norms2(g)
        else:
            _check_no_overflow(q, g, similarity, query.dtype, gallery.dtype)
            q, g = q.contiguous(), (q.contiguous() if same else g.contiguous())
            q_norm2 = torch.zeros(q.shape[0], dtype=torch.float64, device=q.device)
            g_norm2 = (
                q_norm2 if same else torch.zeros(g.shape[0], dtype=torch.float64, device=g.device)
            )
        return cls(similarity, q, g, q_norm2, g_norm2)

    def keys(self, lo: int = 0, hi: int | None = None, col_lo: int = 0) -> torch.Tensor:
        """(hi - lo, n_g - col_lo) float64 keys of query rows ``lo:hi``, gallery rows ``col_lo:``."""
        hi = self.query.shape[0] if hi is None else hi
        q = self.query[lo:hi]
        qn = self.query_norm2[lo:hi]
        gn = self.gallery_norm2[col_lo:]
        if q.device.type == "cpu":
            from ._similarity_kernels import block_keys

            out = torch.empty(q.shape[0], gn.shape[0], dtype=torch.float64)
            block_keys(
                self.code,
                q.numpy(),
                self.gallery_transposed[:, col_lo:].numpy(),
                qn.numpy(),
                gn.numpy(),
                out.numpy(),
            )
            return out
        return _torch_keys(self.code, q, self.gallery[col_lo:], qn, gn)

    def _cached(self, name: str, compute: Any) -> Any:
        """``compute()`` once per operands (the dataclass is frozen; the cache is not a field)."""
        if name not in self.__dict__:
            object.__setattr__(self, name, compute())
        return self.__dict__[name]

    @property
    def shared(self) -> bool:
        """True when the gallery is the query set itself (leave-one-out): one set of operands."""
        return self.gallery is self.query

    def lowest_bit_exponents(self) -> tuple[int | None, int | None]:
        """(query, gallery): smallest e with every entry a multiple of 2^e (None: all zero).

        Scanned once per side (once in all for leave-one-out), on the operands' device: no copy
        of the embeddings to the host.
        """

        def scan() -> tuple[int | None, int | None]:
            lq = _lowest_bit_exponent(self.query)
            return lq, lq if self.shared else _lowest_bit_exponent(self.gallery)

        return self._cached("_lsb", scan)

    def max_row_norms(self) -> tuple[float, float]:
        """(query, gallery) largest Euclidean row norm (float64, overflow-safe), computed once."""

        def norms() -> tuple[float, float]:
            nq = float(safe_row_norms(self.query).max())
            return nq, nq if self.shared else float(safe_row_norms(self.gallery).max())

        return self._cached("_max_norms", norms)

    def transposed_operands(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d + 1, n_q) and (d + 1, n_g) float64 for :func:`transposed_pair_keys` (built once)."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            def side(x: torch.Tensor, norm2: torch.Tensor) -> torch.Tensor:
                safe = torch.where(norm2 == 0, torch.ones_like(norm2), norm2)
                return torch.cat([x.T, safe[None]]).contiguous()

            qt = side(self.query, self.query_norm2)
            return qt, qt if self.shared else side(self.gallery, self.gallery_norm2)

        return self._cached("_transposed", build)

    @property
    def gallery_transposed(self) -> torch.Tensor:
        """(d, n_g) contiguous copy of the gallery (built once; the CPU block kernel reads it)."""
        cached = self.__dict__.get("_gallery_t")
        if cached is None:
            cached = self.gallery.T.contiguous()
            object.__setattr__(self, "_gallery_t", cached)
        return cached

    def pair_keys(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """(m,) float64 keys of the pairs (query ``rows[i]``, gallery ``cols[i]``)."""
        if self.query.device.type == "cpu":
            from ._similarity_kernels import pair_keys

            out = torch.empty(rows.shape[0], dtype=torch.float64)
            pair_keys(
                self.code,
                self.query.numpy(),
                self.gallery.numpy(),
                rows.to(torch.int64).numpy(),
                cols.to(torch.int64).numpy(),
                self.query_norm2.numpy(),
                self.gallery_norm2.numpy(),
                out.numpy(),
            )
            return out
        qn, gn = self.query_norm2[rows], self.gallery_norm2[cols]
        return _torch_keys(self.code, self.query[rows], self.gallery[cols], qn, gn, pairs=True)


def _lowest_bit_exponent(x: torch.Tensor) -> int | None:
    """Smallest e such that every entry of the float64 tensor is a multiple of 2^e (None: all 0).

    On the CPU the numba kernel; elsewhere :func:`_lowest_bit_exponent_torch` on the device, so
    the embeddings are not copied to the host. One scalar is read back.
    """
    if x.device.type == "cpu":
        from ._similarity_kernels import lowest_bit_exponent

        found = int(lowest_bit_exponent(x.detach().contiguous().numpy()))
    else:
        found = int(_lowest_bit_exponent_torch(x))
    return None if found == 1 << 30 else found


def _lowest_bit_exponent_torch(x: torch.Tensor) -> torch.Tensor:
    """0-d int64 tensor: the lowest-bit exponent of a finite float64 tensor (2^30 when all 0)."""
    bits = _entry_lowest_bit_exponents(x.detach().reshape(-1))
    return bits.min() if bits.numel() else torch.tensor(1 << 30)


def _entry_lowest_bit_exponents(flat: torch.Tensor) -> torch.Tensor:
    """(n,) int64: per entry of a finite float64 vector, the largest t with it a multiple of 2^t.

    2^30 for an entry 0.

    ``frexp`` gives each entry as ``m 2^e`` with ``|m|`` in [0.5, 1); ``|m| 2^53`` is its 53-bit
    integer significand, whose lowest set bit ``s & -s`` is a power of two ``2^t``: the entry is
    a multiple of ``2^(e - 53 + t)``.
    """
    mantissa, exponent = torch.frexp(flat)
    # times the constant 2^53, exact on every device (torch.ldexp is not on CUDA)
    significand = (mantissa.abs() * 2.0**53).to(torch.int64)
    lowest = (significand & -significand).to(torch.float64)
    shift = torch.frexp(lowest)[1] - 1
    return torch.where(flat != 0, exponent.to(torch.int64) - 53 + shift, 1 << 30)


def _check_no_overflow(
    q: torch.Tensor, g: torch.Tensor, similarity: str, q_dtype: torch.dtype, g_dtype: torch.dtype
) -> None:
    """float64 keys of dot / euclidean can overflow only for float64 inputs; refuse those."""
    if q_dtype != torch.float64 and g_dtype != torch.float64:
        return  # |q_k g_k| <= 1.2e77 and d terms: float64 never overflows for float32 inputs
    if similarity == "dot":
        bound = float(safe_row_norms(q).max()) * float(safe_row_norms(g).max())
        what = "inner products"
    else:
        center = g.mean(0, keepdim=True)
        spread = float(safe_row_norms(q - center).max()) + float(safe_row_norms(g - center).max())
        bound = spread * spread
        what = "squared distances"
    if not bound < _OVERFLOW_LIMIT:
        raise ValueError(
            f"the {what} of `query` and `gallery` overflow float64 (bound {bound:.3g}); rescale "
            "the embeddings (e.g. divide them by their largest absolute value) or use "
            "similarity='cosine', which is scale-free."
        )


@keeps_torch_threads
def ranking_keys(query: Any, gallery: Any = None, similarity: str = "cosine") -> torch.Tensor:
    """Exact float64 keys ranking every (query, gallery) pair like ``similarity`` (ties included).

    Args:
        query: (n_q, d) embeddings (tensor or array; fp16 / bf16 / integer codes accepted).
        gallery: (n_g, d) embeddings, or None for the query set itself.
        similarity: ``"cosine"`` (key ``cos * |cos|``), ``"dot"`` (``q . g``) or ``"euclidean"``
            (``-||q - g||^2``); alias ``"neg_euclidean"``.

    Returns:
        (n_q, n_g) float64 tensor on the query's device; see the module docstring for the exact
        sequence of operations that defines each key.
    """
    q = check_embeddings(query, "query")
    g = q if gallery is None else check_embeddings(gallery, "gallery", device=q.device)
    if g.shape[1] != q.shape[1]:
        raise ValueError(
            f"`gallery` has dimension {g.shape[1]} but `query` has {q.shape[1]}; embed both with "
            "the same model."
        )
    return ExactOperands.build(q, g, similarity).keys()


def similarity_from_keys(keys: torch.Tensor, similarity: str) -> torch.Tensor:
    """The similarity values of keys: ``cos``, ``q . g`` or ``-||q - g||`` (float64).

    Equal keys give equal values; the square roots of cosine and euclidean are correctly rounded
    and monotone, so the order is kept (keys one float64 ulp apart can round to one value).
    """
    similarity = check_similarity(similarity)
    if similarity == "dot":
        return keys
    if similarity == "cosine":
        return torch.copysign(_correctly_rounded_sqrt(keys.abs()), keys)
    return -_correctly_rounded_sqrt(-keys)


def _correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded (IEEE) square root of a float64 tensor.

    torch's vectorised CPU kernel is off by one ulp for ~1% of float64 inputs (torch 2.13), which
    could even swap the order of neighbouring keys; numpy's is exact, and so is CUDA's
    double-precision sqrt.
    """
    if x.device.type == "cpu":
        return torch.from_numpy(np.sqrt(x.numpy()))
    return torch.sqrt(x)


@keeps_torch_threads
def exact_similarity(query: Any, gallery: Any = None, similarity: str = "cosine") -> torch.Tensor:
    """(n_q, n_g) float64 similarities from the exact keys (see :func:`ranking_keys`)."""
    similarity = check_similarity(similarity)
    return similarity_from_keys(ranking_keys(query, gallery, similarity), similarity)
