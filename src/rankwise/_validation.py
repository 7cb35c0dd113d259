"""Input validation shared by metrics, losses and data code.

Every public entry point converts its inputs with these helpers so that bad input fails early with a
``ValueError`` that names the offending argument and says how to fix it, instead of producing NaN or
a shape error deep inside a kernel.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = [
    "as_tensor",
    "check_embeddings",
    "check_labels",
    "check_same_length",
    "check_finite",
]


def as_tensor(x: Any, name: str, device: torch.device | str | None = None) -> torch.Tensor:
    """Convert a numpy array / tensor / nested sequence to a tensor without copying when possible."""
    if isinstance(x, torch.Tensor):
        t = x
    elif isinstance(x, np.ndarray):
        if x.dtype == object:
            raise ValueError(f"`{name}` has dtype object; pass a numeric array.")
        t = torch.from_numpy(np.ascontiguousarray(x))
    else:
        try:
            t = torch.as_tensor(np.asarray(x))
        except Exception as exc:  # pragma: no cover - message path
            raise ValueError(f"`{name}` could not be converted to a tensor: {exc}") from exc
    if device is not None:
        t = t.to(device)
    return t


def check_finite(t: torch.Tensor, name: str) -> None:
    """Raise if ``t`` holds NaN or inf, naming the argument and counting the bad rows."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = ~torch.isfinite(t)
        n_bad = int(bad.reshape(bad.shape[0], -1).any(dim=1).sum()) if t.ndim > 0 else 1
        raise ValueError(
            f"`{name}` contains NaN or inf values in {n_bad} row(s); check the model output "
            "(a diverged loss or an fp16 overflow) or drop those rows before calling."
        )


def check_embeddings(
    x: Any, name: str = "embeddings", device: torch.device | str | None = None, allow_empty=False
) -> torch.Tensor:
    """Validate a 2-D floating (n, d) embedding matrix; integer / bool codes are cast to float32."""
    t = as_tensor(x, name, device)
    if t.ndim == 1:
        raise ValueError(
            f"`{name}` must be 2-D (n_samples, dim), got shape {tuple(t.shape)}; "
            "use x.reshape(-1, 1) for 1-D scores."
        )
    if t.ndim != 2:
        raise ValueError(f"`{name}` must be 2-D (n_samples, dim), got shape {tuple(t.shape)}.")
    if not allow_empty and t.shape[0] == 0:
        raise ValueError(f"`{name}` is empty (0 rows); pass at least one sample.")
    if t.dtype == torch.bool or not t.is_floating_point():
        if t.is_complex():
            raise ValueError(f"`{name}` must be real-valued, got {t.dtype}.")
        t = t.to(torch.float32)
    check_finite(t, name)
    return t


def check_labels(
    y: Any,
    n: int,
    name: str = "labels",
    device: torch.device | str | None = None,
    allow_multi_hot: bool = True,
) -> torch.Tensor:
    """Validate labels: 1-D integer class ids of length ``n``, or an (n, C) multi-hot 0/1 matrix."""
    t = as_tensor(y, name, device)
    if t.ndim == 2 and allow_multi_hot:
        if t.shape[0] != n:
            raise ValueError(f"`{name}` has {t.shape[0]} rows but the embeddings have {n}.")
        if t.is_floating_point():
            if not bool(((t == 0) | (t == 1)).all()):
                raise ValueError(
                    f"multi-hot `{name}` must contain only 0 and 1; got other values "
                    "(pass a bool / 0-1 matrix, one column per label)."
                )
        t = t.to(torch.bool)
        return t
    if t.ndim != 1:
        hint = " or an (n, C) multi-hot matrix" if allow_multi_hot else ""
        raise ValueError(
            f"`{name}` must be a 1-D array of integer class ids{hint}, got shape {tuple(t.shape)}."
        )
    if t.shape[0] != n:
        raise ValueError(
            f"`{name}` has length {t.shape[0]} but the embeddings have {n} rows; "
            "pass one label per embedding."
        )
    if t.is_floating_point():
        if not bool(torch.isfinite(t).all()) or not bool((t == t.round()).all()):
            raise ValueError(
                f"`{name}` must hold integer class ids, got non-integer floats ({t.dtype}); "
                "convert with labels.astype(int) or map class names to ids first."
            )
        t = t.to(torch.int64)
    elif t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"`{name}` must hold integer class ids, got dtype {t.dtype}.")
    else:
        t = t.to(torch.int64)
    return t


def check_same_length(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"`{name_a}` has {a.shape[0]} rows but `{name_b}` has {b.shape[0]}; they must match."
        )
