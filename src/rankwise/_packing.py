"""Binary codes: validation, bit packing and Hamming distances by XOR + popcount.

He, Cakir, Bargal & Sclaroff (CVPR 2018), Sec. 3.1, Eq. (1): for codes ``φ, φ' ∈ {-1, +1}^b`` the
Hamming distance is ``(b - φᵀφ') / 2``, the number of differing bits. Stored as bits (``+1 -> 1``,
``-1 -> 0``) it is ``popcount(x XOR y)``: one instruction per 64 bits, and 8 bytes per 64-bit code.

Bit layout (the same for every packed form): code bit ``i`` is bit ``i % 8`` of byte ``i // 8``
(``numpy.packbits(..., bitorder="little")``), equivalently bit ``i % 64`` of little-endian
``uint64`` word ``i // 64``. Padding bits beyond ``b`` are 0, so they never add to a distance.

Accepted code inputs (numpy or torch; docs/hashing.md, "Accepted code inputs"): ``(n, b)`` codes
in ``{-1, +1}`` or ``{0, 1}``, packed unsigned words with ``bits``, or a :class:`PackedCodes`.
:mod:`rankwise.hashing.codes` is the public path of these names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import intrinsic

from ._threads import keeps_torch_threads

__all__ = [
    "PackedCodes",
    "as_packed_codes",
    "pack_codes",
    "unpack_codes",
    "hamming_distances",
    "popcount",
    "code_distance",
    "distance_dtype",
]

_UNSIGNED = (np.uint8, np.uint16, np.uint32, np.uint64)
# Distances of a chunk of queries against the database are computed in blocks of at most this
# many entries (uint8 / uint16 each), so the working memory of hamming_distances stays bounded
# when the caller only needs chunks.
_DISTANCE_CHUNK_ENTRIES = 1 << 26


@intrinsic
def popcount(typingctx, x):  # pragma: no cover - numba intrinsic
    """Number of set bits of an unsigned integer (LLVM ``ctpop``: one POPCNT instruction)."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.int64(x)

    def codegen(context, builder, signature, args):
        count = builder.ctpop(args[0])
        target = context.get_value_type(types.int64)
        if x.bitwidth < 64:  # type: ignore[attr-defined]  # numba does not annotate Integer.bitwidth
            return builder.zext(count, target)
        return count

    return sig, codegen


@njit(cache=True, inline="always")
def code_distance(a, i, b, j):  # pragma: no cover - numba
    """Hamming distance between row ``i`` of words ``a`` and row ``j`` of words ``b``."""
    d = 0
    for w in range(a.shape[1]):
        d += popcount(a[i, w] ^ b[j, w])  # type: ignore[call-arg]  # numba supplies typingctx
    return d


@dataclass(frozen=True)
class PackedCodes:
    """``n`` binary codes of ``bits`` bits, packed into unsigned words (see module docstring).

    Attributes:
        words: ``(n, W)`` C-contiguous unsigned integer array, ``W = ceil(bits / word_bits)``.
        bits: the code length ``b``.
    """

    words: np.ndarray
    bits: int

    def __post_init__(self) -> None:
        if self.words.ndim != 2 or self.words.dtype.type not in _UNSIGNED:
            raise ValueError("PackedCodes.words must be a 2-D unsigned integer array.")
        word_bits = self.words.dtype.itemsize * 8
        if self.words.shape[1] != -(-self.bits // word_bits):
            raise ValueError(
                f"PackedCodes: {self.words.shape[1]} words of {word_bits} bits do not hold "
                f"exactly {self.bits} bits."
            )

    def __len__(self) -> int:
        return int(self.words.shape[0])

    @property
    def nbytes_per_code(self) -> int:
        """Bytes one code occupies in ``words``."""
        return int(self.words.shape[1] * self.words.dtype.itemsize)

    def to(self, dtype: str | np.dtype) -> PackedCodes:
        """The same codes packed into words of ``dtype`` (``"uint8"`` ... ``"uint64"``)."""
        return PackedCodes(_repack(self.words, self.bits, np.dtype(dtype)), self.bits)

    def rows(self, index: Any) -> PackedCodes:
        """A subset of the codes (``index``: slice, integer array or boolean mask)."""
        return PackedCodes(np.ascontiguousarray(self.words[index]), self.bits)


def _word_dtype(bits: int) -> np.dtype:
    """Narrowest unsigned word holding a whole code of ``bits`` bits, or uint64 words beyond 64."""
    for dtype in _UNSIGNED:
        if bits <= np.dtype(dtype).itemsize * 8:
            return np.dtype(dtype)
    return np.dtype(np.uint64)


def _to_bytes(words: np.ndarray, bits: int) -> np.ndarray:
    """Little-endian byte form ``(n, ceil(bits / 8))`` of packed words."""
    little = words.astype(words.dtype.newbyteorder("<"), copy=False)
    width = words.shape[1] * words.dtype.itemsize
    raw = np.ascontiguousarray(little).view(np.uint8).reshape(words.shape[0], width)
    return np.ascontiguousarray(raw[:, : -(-bits // 8)])


def _repack(words: np.ndarray, bits: int, dtype: np.dtype) -> np.ndarray:
    if words.dtype == dtype:
        return np.ascontiguousarray(words)
    raw = _to_bytes(words, bits)
    size = dtype.itemsize
    n_words = -(-bits // (size * 8))
    padded = np.zeros((raw.shape[0], n_words * size), dtype=np.uint8)
    padded[:, : raw.shape[1]] = raw
    little = padded.view(dtype.newbyteorder("<"))
    return np.ascontiguousarray(little.astype(dtype, copy=False))


def _as_numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_complex():
            raise ValueError(f"`{name}` must be real-valued codes, got {x.dtype}.")
        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.to(torch.float32)
        return x.numpy()
    arr = np.asarray(x)
    if arr.dtype == object or arr.dtype.kind in "USc":
        raise ValueError(f"`{name}` must be a numeric array of codes, got dtype {arr.dtype}.")
    return arr


def _check_padding(words: np.ndarray, bits: int, name: str) -> None:
    word_bits = words.dtype.itemsize * 8
    spare = words.shape[1] * word_bits - bits
    if spare <= 0 or words.shape[0] == 0:
        return
    mask = words.dtype.type((1 << (word_bits - spare)) - 1)  # the bits used in the last word
    if bool((words[:, -1] & ~mask).any()):
        raise ValueError(
            f"`{name}` has bits set beyond bit {bits} (the padding of its last word must be 0); "
            "pass the `bits` the codes were packed with, or pack them with "
            "rankwise.hashing.pack_codes."
        )


def _from_packed(arr: np.ndarray, bits: int | None, name: str) -> PackedCodes:
    word_bits = arr.dtype.itemsize * 8
    # an unsigned array of 0s and 1s may as well be unpacked {0, 1} codes (e.g. `x.byte()`):
    # 12 such columns are 12-bit codes or 96-bit packed codes, so the caller has to say which
    zero_one = arr.size > 0 and int(arr.max()) <= 1
    if bits is None:
        if zero_one:
            raise ValueError(
                f"`{name}` is an unsigned integer ({arr.dtype}) array holding only 0 and 1: "
                f"unpacked {{0, 1}} codes of {arr.shape[1]} bits, or packed words of "
                f"{arr.shape[1] * word_bits} bits? Pass unpacked codes as bool or ±1 (e.g. "
                "codes.bool()), packed words with bits= (or as a PackedCodes)."
            )
        bits = arr.shape[1] * word_bits
    expected = -(-bits // word_bits)
    if arr.shape[1] != expected and zero_one and arr.shape[1] == bits:
        raise ValueError(
            f"`{name}` has {bits} columns of {arr.dtype} 0s and 1s, but unsigned integers are read "
            f"as packed words ({bits}-bit codes take {expected}); pass unpacked {{0, 1}} codes as "
            "bool or ±1 (e.g. codes.bool())."
        )
    if arr.shape[1] != expected:
        raise ValueError(
            f"`{name}` holds {arr.shape[1]} {arr.dtype} words per code, but {bits}-bit codes "
            f"take {expected}; pass the `bits` the codes were packed with."
        )
    arr = np.ascontiguousarray(arr)
    _check_padding(arr, bits, name)
    return PackedCodes(_repack(arr, bits, _word_dtype(bits)), bits)


def _bits_from_values(arr: np.ndarray, name: str) -> np.ndarray:
    """``(n, b)`` bool bits of ``{-1, +1}`` or ``{0, 1}`` codes; anything else is an error."""
    if arr.dtype == np.bool_:
        return arr
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise ValueError(f"`{name}` contains NaN or inf; binary codes are needed.")
    if not np.isin(arr, (-1, 0, 1)).all():
        raise ValueError(
            f"`{name}` must hold binary codes in {{-1, +1}} or {{0, 1}}; got values such as "
            f"{_offending(arr)}. For real-valued (relaxed) codes use HashingHead.encode() or "
            "sign(); packed codes must be an unsigned integer array."
        )
    if (arr < 0).any() and (arr == 0).any():
        raise ValueError(
            f"`{name}` mixes -1 and 0; codes must be either in {{-1, +1}} or in {{0, 1}}."
        )
    return arr > 0


def _offending(arr: np.ndarray) -> str:
    bad = arr[~np.isin(arr, (-1, 0, 1))]
    return ", ".join(f"{v:g}" for v in np.unique(bad)[:3])


def pack_bits(bits_matrix: np.ndarray, dtype: np.dtype | None = None) -> PackedCodes:
    """Pack an ``(n, b)`` boolean matrix (True = +1) into words (narrowest type by default)."""
    n, bits = bits_matrix.shape
    raw = np.packbits(bits_matrix, axis=1, bitorder="little")
    packed = PackedCodes(_repack(raw.reshape(n, -(-bits // 8)), bits, np.dtype(np.uint8)), bits)
    return packed.to(dtype if dtype is not None else _word_dtype(bits))


def as_packed_codes(codes: Any, name: str = "codes", bits: int | None = None) -> PackedCodes:
    """Validate binary codes in any accepted form (module docstring) and pack them.

    Args:
        codes: ``(n, b)`` codes or ``(n, W)`` packed words, numpy or torch.
        name: argument name used in error messages.
        bits: code length of packed input (default every bit of the words); for unpacked codes it
            must equal the number of columns when given.

    Returns:
        :class:`PackedCodes` with the narrowest word type (uint8 / 16 / 32 for codes of up to
        8 / 16 / 32 bits, uint64 words beyond); a :class:`PackedCodes` is returned as it is.

    Raises:
        ValueError: not 2-D, no columns, values outside ``{-1, +1}`` / ``{0, 1}``, non-zero
            padding bits, ``bits`` inconsistent with the array, or an unsigned array of only 0
            and 1 without ``bits`` (unpacked ``{0, 1}`` codes or packed words? see above).
    """
    if bits is not None and (
        isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or bits < 1
    ):
        raise ValueError(f"`bits` must be a positive integer or None, got {bits!r}.")
    if isinstance(codes, PackedCodes):
        if bits is not None and bits != codes.bits:
            raise ValueError(f"`{name}` holds {codes.bits}-bit codes but bits={bits} was passed.")
        return codes
    arr = _as_numpy(codes, name)
    if arr.ndim != 2:
        raise ValueError(
            f"`{name}` must be 2-D (n_codes, bits) or packed (n_codes, n_words), got shape "
            f"{arr.shape}."
        )
    if arr.shape[1] == 0:
        raise ValueError(f"`{name}` has 0 columns; codes need at least one bit.")
    if arr.dtype.type in _UNSIGNED:
        return _from_packed(arr, None if bits is None else int(bits), name)
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"`{name}` must be a numeric array of codes, got dtype {arr.dtype}.")
    if bits is not None and bits != arr.shape[1]:
        raise ValueError(
            f"`{name}` has {arr.shape[1]} columns (bits) but bits={bits} was passed; bits is only "
            "needed for packed codes."
        )
    return pack_bits(_bits_from_values(arr, name))


def pack_codes(codes: Any, dtype: str = "uint8", bits: int | None = None) -> np.ndarray:
    """Pack binary codes into ``uint8`` bytes or ``uint64`` words (``+1 -> 1``, ``-1 -> 0``).

    Args:
        codes: ``(n, b)`` codes in ``{-1, +1}`` or ``{0, 1}`` (numpy / torch), or packed words.
        dtype: ``"uint8"`` (``ceil(b / 8)`` bytes per code, ``numpy.packbits`` little bit order),
            ``"uint16"``, ``"uint32"`` or ``"uint64"`` (``ceil(b / 64)`` words per code).
        bits: code length of already-packed input.

    Returns:
        ``(n, ceil(b / word_bits))`` numpy array of ``dtype``; a 64-bit code takes 8 bytes.
    """
    choices = ("uint8", "uint16", "uint32", "uint64")
    if dtype not in choices:
        raise ValueError(f"`dtype` must be one of {choices}, got {dtype!r}.")
    return as_packed_codes(codes, "codes", bits).to(dtype).words


def unpack_codes(codes: Any, bits: int | None = None, dtype: torch.dtype = torch.int8):
    """``(n, b)`` tensor of ``{-1, +1}`` codes from packed words (inverse of :func:`pack_codes`).

    Args:
        codes: packed words (unsigned integer array) or any accepted code form.
        bits: code length (default every bit of the words).
        dtype: torch dtype of the result.
    """
    packed = as_packed_codes(codes, "codes", bits)
    raw = _to_bytes(packed.words, packed.bits)
    bit_matrix = np.unpackbits(raw, axis=1, count=packed.bits, bitorder="little")
    signs = bit_matrix.astype(np.int8) * 2 - 1
    return torch.from_numpy(signs).to(dtype)


def distance_dtype(bits: int) -> np.dtype:
    """Smallest unsigned dtype holding every distance ``0..bits``."""
    return np.dtype(np.uint8) if bits <= 255 else np.dtype(np.uint16 if bits <= 65535 else np.int64)


@njit(parallel=True, cache=True)
def _distance_kernel(queries, database, out):  # pragma: no cover - numba
    for i in prange(queries.shape[0]):
        for j in range(database.shape[0]):
            out[i, j] = code_distance(queries, i, database, j)


def check_same_bits(a: PackedCodes, b: PackedCodes, name_a: str, name_b: str) -> None:
    """Raise when two code sets have different lengths."""
    if a.bits != b.bits:
        raise ValueError(
            f"`{name_a}` has {a.bits}-bit codes but `{name_b}` has {b.bits}-bit codes; encode "
            "both with the same hashing model (or pass the right `bits` for packed codes)."
        )


@keeps_torch_threads
def hamming_distances(
    queries: Any, database: Any = None, *, bits: int | None = None, chunk_size: int | None = None
) -> np.ndarray:
    """All Hamming distances ``(n_queries, n_database)`` by XOR + popcount of packed codes.

    Equal to ``(b - qᵀx) / 2`` for ``{-1, +1}`` codes (TALR paper, Eq. 1), computed exactly on
    integers. Queries are processed in chunks (parallel over queries within a chunk).

    Args:
        queries: ``(n_q, b)`` codes or packed words (any form of :func:`as_packed_codes`).
        database: ``(n, b)`` codes or packed words; None = the queries themselves.
        bits: code length of packed input.
        chunk_size: queries per chunk (default: chunks of about 64 M distances).

    Returns:
        ``uint8`` array (``uint16`` beyond 255 bits) of shape ``(n_q, n)``.
    """
    q = as_packed_codes(queries, "queries", bits)
    db = q if database is None else as_packed_codes(database, "database", bits)
    check_same_bits(q, db, "queries", "database")
    db_words = db.words if db.words.dtype == q.words.dtype else db.to(q.words.dtype).words
    n_q, n = len(q), len(db)
    out = np.empty((n_q, n), dtype=distance_dtype(q.bits))
    if chunk_size is None:
        chunk_size = max(1, _DISTANCE_CHUNK_ENTRIES // max(n, 1))
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise ValueError(f"`chunk_size` must be a positive integer or None, got {chunk_size!r}.")
    elif chunk_size < 1:
        raise ValueError(f"`chunk_size` must be a positive integer or None, got {chunk_size!r}.")
    for lo in range(0, n_q, int(chunk_size)):
        hi = min(n_q, lo + int(chunk_size))
        _distance_kernel(q.words[lo:hi], db_words, out[lo:hi])
    return out
