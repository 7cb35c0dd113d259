"""Reader for the IDX file format of MNIST and Fashion-MNIST.

Format (LeCun et al., "The MNIST database of handwritten digits"; Xiao et al. 2017,
Fashion-MNIST, which keeps the same files): a big-endian int32 magic number whose third byte is
the element type (0x08 = unsigned byte) and fourth byte the number of dimensions, then one
big-endian uint32 per dimension, then the data in C order. Image files have magic 2051
(0x00000803, 3 dims), label files 2049 (0x00000801, 1 dim). Files may be gzip-compressed. The
header is checked against the file size so a truncated download fails loudly, naming the file.
"""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from .base import CorruptDatasetError

__all__ = ["IDX_IMAGES_MAGIC", "IDX_LABELS_MAGIC", "read_idx", "write_idx"]

IDX_IMAGES_MAGIC = 2051
IDX_LABELS_MAGIC = 2049


def _read_bytes(path: str) -> bytes:
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            return f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise CorruptDatasetError(
            f"IDX file {path!r} is not a valid gzip stream ({exc}); it is truncated or "
            "corrupt, re-download it."
        ) from exc


def read_idx(path: str | os.PathLike, expected_magic: int) -> np.ndarray:
    """Read an unsigned-byte IDX file (optionally ``.gz``) into a ``uint8`` array.

    Args:
        path: the file.
        expected_magic: 2051 for an image file ``(N, rows, cols)``, 2049 for a label file ``(N,)``.

    Returns:
        ``np.uint8`` array with the shape given by the header.

    Raises:
        CorruptDatasetError: wrong magic number, a header shorter than announced, or a payload
            whose size does not match the header (the message names the file).
    """
    path = os.fspath(path)
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise CorruptDatasetError(
            f"IDX file {path!r} is {len(raw)} bytes long, too short for a header; re-download it."
        )
    magic = int.from_bytes(raw[:4], "big")
    if magic != expected_magic:
        kind = {IDX_IMAGES_MAGIC: "image", IDX_LABELS_MAGIC: "label"}.get(expected_magic, "IDX")
        raise CorruptDatasetError(
            f"IDX file {path!r} has magic number {magic}, expected {expected_magic} for an "
            f"unsigned-byte {kind} file; the file is corrupt or is not the {kind} file."
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise CorruptDatasetError(
            f"IDX file {path!r} is truncated inside its header ({len(raw)} bytes, header needs "
            f"{header}); re-download it."
        )
    dims = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(dims, dtype=np.int64))
    if len(raw) != expected:
        state = "truncated" if len(raw) < expected else "longer than its header says"
        raise CorruptDatasetError(
            f"IDX file {path!r} is {state}: the header announces dims {dims} "
            f"({expected} bytes in all) but the file holds {len(raw)} bytes; re-download it."
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def write_idx(path: str | os.PathLike, array: np.ndarray) -> None:
    """Write a ``uint8`` array as an IDX file (``.gz`` suffix -> gzip), the inverse of read_idx."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    if array.ndim not in (1, 3):
        raise ValueError(f"`array` must be 1-D (labels) or 3-D (images), got shape {array.shape}.")
    header = (0x0800 | array.ndim).to_bytes(4, "big") + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    path = os.fspath(path)
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as f:
        f.write(header + array.tobytes())
