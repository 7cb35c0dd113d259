"""Input validation shared by metrics, losses and data code.

Every public entry point converts its inputs with these helpers so that bad input fails early with a
``ValueError`` that names the offending argument and says how to fix it, instead of producing NaN or
a shape error deep inside a kernel.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

__all__ = [
    "as_tensor",
    "check_embeddings",
    "check_labels",
    "check_finite",
    "Interval",
    "check_scalar",
    "check_choice",
    "check_bool",
    "check_range_pair",
    "resolve_device",
]


def as_tensor(x: Any, name: str, device: torch.device | str | None = None) -> torch.Tensor:
    """Convert a numpy array / tensor / nested sequence to a tensor without copying when possible."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        try:
            array = x if isinstance(x, np.ndarray) else np.asarray(x)
        except Exception as exc:  # pragma: no cover - message path (ragged nested lists)
            raise ValueError(f"`{name}` could not be converted to an array: {exc}") from exc
        if array.dtype.kind not in "biufc":
            what = "strings" if array.dtype.kind in "US" else f"dtype {array.dtype}"
            raise ValueError(
                f"`{name}` holds {what}; pass a numeric array (map class names to integer ids "
                f"first, e.g. np.unique({name}, return_inverse=True)[1])."
            )
        t = torch.from_numpy(np.ascontiguousarray(array))
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
    x: Any,
    name: str = "embeddings",
    device: torch.device | str | None = None,
    allow_empty=False,
    *,
    finite: bool = True,
) -> torch.Tensor:
    """Validate a 2-D floating (n, d) embedding matrix; integer / bool codes are cast to float64.

    float64 keeps integer codes exact up to 2^53 (float32 would merge ``2^24`` and ``2^24 + 1``,
    and the metrics promise exact scores of codes). Floating inputs keep their dtype.

    ``finite=False`` checks the shape and dtype only and reads no value, so it never waits for
    the device (the losses check the values on the device and raise later, see
    ``rankwise.losses.base``).
    """
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
    if t.shape[1] == 0:
        raise ValueError(
            f"`{name}` has shape {tuple(t.shape)}: 0 dimensions, so every similarity would tie; "
            "pass embeddings with at least one column."
        )
    if t.dtype == torch.bool or not t.is_floating_point():
        if t.is_complex():
            raise ValueError(f"`{name}` must be real-valued, got {t.dtype}.")
        t = t.to(torch.float64)
    if finite:
        check_finite(t, name)
    return t


# float64 and float32 represent -2^63 and 2^63 exactly: the int64 range is [-2^63, 2^63)
_INT64_LOW, _INT64_END = -(2.0**63), 2.0**63


def _check_fits_int64(t: torch.Tensor, name: str) -> None:
    """Refuse integer-valued float labels outside int64.

    The cast would merge them: 1e20 and 2e20 both become -2^63, so every item would count as
    relevant.
    """
    wide = t.to(torch.float64) if t.dtype != torch.float64 else t
    outside = (wide < _INT64_LOW) | (wide >= _INT64_END)
    if bool(outside.any()):
        value = int(wide[outside][0])  # an integer-valued float: exact as a Python int
        raise ValueError(
            f"`{name}` holds the {t.dtype} class id {value}, outside the int64 range "
            "[-2**63, 2**63); "
            "distinct ids there cannot be told apart. Map them to small ids first, e.g. "
            f"np.unique({name}, return_inverse=True)[1]."
        )


def check_labels(
    y: Any,
    n: int,
    name: str = "labels",
    device: torch.device | str | None = None,
    allow_multi_hot: bool = True,
) -> torch.Tensor:
    """Validate labels: 1-D integer class ids of length ``n``, or an (n, C) multi-hot 0/1 matrix.

    The one rule for multi-hot labels everywhere (metrics, hashing metrics, losses): a 2-D array
    of any dtype other than bool must hold only 0 and 1 (an integer 2 or -1 is not silently read
    as "has the label"); an ``(n, 1)`` array of other values gets a hint towards 1-D class ids.
    """
    t = as_tensor(y, name, device)
    if t.ndim == 2 and allow_multi_hot:
        if t.shape[0] != n:
            raise ValueError(f"`{name}` has {t.shape[0]} rows but the embeddings have {n}.")
        if t.dtype != torch.bool and not bool(((t == 0) | (t == 1)).all()):
            if t.shape[1] == 1:
                raise ValueError(
                    f"`{name}` has shape {tuple(t.shape)}: a 2-D label array is read as multi-hot "
                    "(0/1 per label), but it holds other values; pass 1-D class ids instead "
                    f"({name}.reshape(-1))."
                )
            raise ValueError(
                f"multi-hot `{name}` must contain only 0 and 1; got other values "
                "(pass a bool / 0-1 matrix, one column per label, or 1-D class ids)."
            )
        return t.to(torch.bool)
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
        _check_fits_int64(t, name)
        t = t.to(torch.int64)
    elif t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"`{name}` must hold integer class ids, got dtype {t.dtype}.")
    else:
        t = t.to(torch.int64)
    return t


# -- scalar parameters ---------------------------------------------------------------------------
# One way to check the scalar arguments of every loss, sampler and estimator, in the manner of
# scikit-learn's ``Interval`` / ``StrOptions`` parameter constraints: Python and numpy scalars of the
# right kind are accepted (``np.float32(0.1)`` like ``0.1``, ``np.int64(4)`` like ``4``), ``bool``
# is never a number, NaN is never accepted and infinity only where a bound is explicitly infinite.


@dataclass(frozen=True)
class Interval:
    """A numeric constraint: ``kind`` ("real" or "integer") within ``[low, high]``.

    ``closed`` says which ends belong to the interval ("both", "left", "right", "neither");
    ``None`` bounds are unbounded. Infinite values are rejected unless ``allow_inf`` is set.

    Example: ``Interval("real", 0, None, closed="neither")`` is a finite number > 0.
    """

    kind: Literal["real", "integer"]
    low: float | None = None
    high: float | None = None
    closed: Literal["both", "left", "right", "neither"] = "both"
    allow_inf: bool = False

    def describe(self) -> str:
        what = "an integer" if self.kind == "integer" else "a finite number"
        if self.allow_inf and self.kind == "real":
            what = "a number"
        if self.low is None and self.high is None:
            return what
        if self.high is None:
            return f"{what} {'>=' if self.closed in ('both', 'left') else '>'} {self.low:g}"
        if self.low is None:
            return f"{what} {'<=' if self.closed in ('both', 'right') else '<'} {self.high:g}"
        left = "[" if self.closed in ("both", "left") else "("
        right = "]" if self.closed in ("both", "right") else ")"
        return f"{what} in {left}{self.low:g}, {self.high:g}{right}"

    def contains(self, value: float) -> bool:
        closed_low, closed_high = self.closed in ("both", "left"), self.closed in ("both", "right")
        if self.low is not None and not (value >= self.low if closed_low else value > self.low):
            return False
        return self.high is None or (value <= self.high if closed_high else value < self.high)


def _scalar_value(value: Any, kind: str) -> float | int | None:
    """``value`` as a Python int / float when it is a scalar of ``kind``, else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.ndim > 0 or value.dtype == torch.bool:
            return None
        value = value.item()
    if kind == "integer":
        try:
            return operator.index(value)
        except TypeError:
            return None
    if isinstance(value, (numbers.Real, np.floating, np.integer)):
        return float(value)
    return None


def check_scalar(value: Any, name: str, interval: Interval) -> Any:
    """Validate one scalar argument against ``interval``; return it as a Python int / float.

    Raises:
        ValueError: naming ``name``, what was expected and what was given, e.g.
            "`tau1` must be a finite number > 0, got inf."
    """
    converted = _scalar_value(value, interval.kind)
    ok = (
        converted is not None
        and not (isinstance(converted, float) and math.isnan(converted))
        and not (isinstance(converted, float) and math.isinf(converted) and not interval.allow_inf)
        and interval.contains(converted)
    )
    if not ok:
        raise ValueError(f"`{name}` must be {interval.describe()}, got {value!r}.")
    return converted


def check_choice(value: Any, name: str, choices: Sequence[str]) -> str:
    """Validate a string option against ``choices`` (case-sensitive); return it."""
    if not isinstance(value, str) or value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {listed}, got {value!r}.")
    return value


def check_bool(value: Any, name: str) -> bool:
    """Validate a flag (``bool`` or ``np.bool_``; 0 / 1 integers are not flags)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")
    return bool(value)


def check_range_pair(
    value: Any, name: str, *, low: float | None = None, high: float | None = None
) -> tuple[float, float]:
    """Validate a finite ``(lo, hi)`` pair with ``lo < hi``, each end within ``[low, high]``."""
    bounds = Interval("real", low, high)
    within = "" if low is None and high is None else f" ({bounds.describe()[2:]} each)"
    message = f"`{name}` must be a pair (low, high) of finite numbers{within} with low < high"
    try:
        lo, hi = (check_scalar(v, name, bounds) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{message}, got {value!r}.") from None
    if not lo < hi:
        raise ValueError(f"{message}, got {value!r}.")
    return lo, hi


def resolve_device(device: str | torch.device, name: str = "`device`") -> torch.device:
    """``device`` as a ``torch.device``: ``"auto"`` is CUDA when available, else the CPU.

    The one place every entry point (config key, Trainer / pipeline argument, distributed setup,
    ``--device``) turns a device name into a device, so all of them refuse the same inputs with
    the same message, naming ``name``.

    Raises:
        ValueError: an unknown device name, a CUDA device on a machine without one, or a device
            torch cannot allocate on (``cuda:5`` on a machine with one GPU).
    """
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"{name}: unknown device {device!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'."
        ) from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{name}: {str(device)!r} requested but no CUDA device is available on this machine; "
            "use 'cpu' or 'auto'."
        )
    # an explicit index (cuda:5 on a one-GPU machine) is probed; a bare `cuda` is not, so no rank
    # of a distributed run opens a context on GPU 0 before it selects its own GPU
    if dev.type != "cpu" and (dev.type != "cuda" or dev.index is not None):
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as exc:
            raise ValueError(
                f"{name}: {str(device)!r} cannot be used on this machine ({exc}); use 'cpu' or "
                "'auto'."
            ) from exc
    return dev
