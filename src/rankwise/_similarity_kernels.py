"""numba kernels of the exact evaluation scores defined in :mod:`rankwise.similarity`.

Every kernel evaluates, for each (query, gallery) pair it touches, the same sequence of IEEE-754
float64 operations as the definition (``acc = 0.0``, then ``acc = acc + q[k] * g[k]`` or
``acc = acc + (q[k] - g[k]) * (q[k] - g[k])`` for ``k = 0, 1, ..., d - 1``), each operation rounded
once: no fused multiply-add (numba emits separate multiplications and additions unless fastmath is
on, and it is not here), no reassociation. The kernels only change *which* pairs run side by side
(several gallery columns or several pairs at once), never the operations of one pair, so a pair's
key does not depend on the block, the chunk or the position it is computed in, and the torch
implementation in :mod:`rankwise.similarity` returns the same bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = [
    "DOT",
    "COSINE",
    "EUCLIDEAN",
    "exact_key",
    "squared_norms",
    "block_keys",
    "pair_keys",
    "lowest_bit_exponent",
]

# Similarity codes of the kernels (the names live in rankwise.similarity).
DOT = 0
COSINE = 1
EUCLIDEAN = 2

# Columns per tile and queries per tile of the block kernel: 4 x 64 float64 accumulators (2 KiB)
# stay in L1 while a tile of the transposed gallery streams through.
_TILE = 64
_QUERIES = 4


@njit(cache=True, inline="always")
def exact_key(code, q, g, q_norm2, g_norm2):  # pragma: no cover - numba
    """Key of one pair: the definition, operation by operation (q, g: 1-D float64 rows)."""
    acc = 0.0
    if code == EUCLIDEAN:
        for k in range(q.shape[0]):
            t = q[k] - g[k]
            acc += t * t
        return -acc
    for k in range(q.shape[0]):
        acc += q[k] * g[k]
    if code == DOT:
        return acc
    den = q_norm2 * g_norm2
    if den == 0.0:  # a zero vector: cosine 0, as F.normalize
        return 0.0
    return (acc * abs(acc)) / den


@njit(parallel=True, cache=True)
def squared_norms(x):  # pragma: no cover - numba
    """(n,) sum_k x[i, k] * x[i, k] in the order k = 0, 1, ... (the key's own norms)."""
    n, d = x.shape
    out = np.empty(n)
    for i in prange(n):
        acc = 0.0
        for k in range(d):
            acc += x[i, k] * x[i, k]
        out[i] = acc
    return out


@njit(cache=True)
def _tile_sums(code, q, g_t, i0, n_q, j0, n_cols, acc):  # pragma: no cover - numba
    """acc[r, c] = sum_k of the term of (query i0 + r, gallery column j0 + c), k ascending."""
    d = q.shape[1]
    acc[:, :] = 0.0
    if code == EUCLIDEAN:
        for k in range(d):
            for r in range(n_q):
                qk = q[i0 + r, k]
                for c in range(n_cols):
                    t = qk - g_t[k, j0 + c]
                    acc[r, c] += t * t
    else:
        for k in range(d):
            for r in range(n_q):
                qk = q[i0 + r, k]
                for c in range(n_cols):
                    acc[r, c] += qk * g_t[k, j0 + c]


@njit(parallel=True, cache=True)
def block_keys(code, q, g_t, q_norm2, g_norm2, out):  # pragma: no cover - numba
    """out[i, j] = key of (q[i], gallery column j) for a (B, d) query block and a (d, N) gallery.

    Vectorised across gallery columns (each column's sum is still sequential in k), tiled over
    4 queries x 64 columns so the accumulators stay in L1.
    """
    n_rows = q.shape[0]
    n_items = g_t.shape[1]
    n_col_tiles = (n_items + _TILE - 1) // _TILE
    n_row_tiles = (n_rows + _QUERIES - 1) // _QUERIES
    for t in prange(n_row_tiles * n_col_tiles):
        i0 = (t // n_col_tiles) * _QUERIES
        j0 = (t % n_col_tiles) * _TILE
        n_q = min(_QUERIES, n_rows - i0)
        n_cols = min(_TILE, n_items - j0)
        acc = np.empty((_QUERIES, _TILE))
        _tile_sums(code, q, g_t, i0, n_q, j0, n_cols, acc)
        for r in range(n_q):
            for c in range(n_cols):
                a = acc[r, c]
                if code == DOT:
                    out[i0 + r, j0 + c] = a
                elif code == EUCLIDEAN:
                    out[i0 + r, j0 + c] = -a
                else:
                    den = q_norm2[i0 + r] * g_norm2[j0 + c]
                    out[i0 + r, j0 + c] = 0.0 if den == 0.0 else (a * abs(a)) / den


@njit(parallel=True, cache=True)
def pair_keys(code, q, g, rows, cols, q_norm2, g_norm2, out):  # pragma: no cover - numba
    """out[m] = key of (q[rows[m]], g[cols[m]]) for listed pairs."""
    for m in prange(rows.shape[0]):
        i = rows[m]
        j = cols[m]
        out[m] = exact_key(code, q[i], g[j], q_norm2[i], g_norm2[j])


@njit(parallel=True, cache=True)
def lowest_bit_exponent(x):  # pragma: no cover - numba
    """Smallest e such that every entry of the float64 array is an integer multiple of 2^e.

    Returns 2**30 when every entry is 0 (no constraint), and -2**30 for non-finite entries.
    """
    flat = x.reshape(-1)
    bits = flat.view(np.int64)
    n = flat.shape[0]
    n_chunks = max(1, min(n, 64))
    per_chunk = np.full(n_chunks, 1 << 30, dtype=np.int64)
    for c in prange(n_chunks):
        best = 1 << 30
        for t in range(c * n // n_chunks, (c + 1) * n // n_chunks):
            b = bits[t] & 0x7FFFFFFFFFFFFFFF  # drop the sign
            if b == 0:
                continue
            biased = b >> 52
            if biased == 0x7FF:  # inf / NaN
                best = -(1 << 30)
                continue
            significand = b & 0xFFFFFFFFFFFFF
            if biased > 0:
                significand |= 1 << 52
                scale = biased - 1075
            else:  # subnormal
                scale = -1074
            low = significand & -significand  # 2^(trailing zeros), at most 2^52
            e = scale + ((np.float64(low).view(np.int64) >> 52) - 1023)
            best = min(best, e)
        per_chunk[c] = best
    return per_chunk.min()
