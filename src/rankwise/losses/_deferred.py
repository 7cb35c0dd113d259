"""What a loss call reports without waiting for the device: deferred value checks and ``last_stats``.

A loss step that reads a value computed on an accelerator (``float(t)``, ``bool(t)``) makes the
host wait until the device has finished everything queued before it. The rankwise losses read
nothing of the embeddings during a step (issue 31): the checks of their values (finite, in range)
are computed on the device as one flag, a :class:`DeferredCheck`, and ``last_stats`` keeps its
values as detached tensors in a :class:`LossStats`, read on the host, together with the flag, in
one transfer when somebody reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import torch

__all__ = ["DeferredCheck", "LossStats"]


class DeferredCheck:
    """A check of input values computed on the device and read on the host only when asked.

    Args:
        ok: 0-dim bool tensor, True when the values passed.
        explain: called on the error path only: raises the ``ValueError`` that names the argument
            and the fix (it may read device data: by then the step is over).
    """

    __slots__ = ("explain", "ok")

    def __init__(self, ok: torch.Tensor, explain: Callable[[], None]) -> None:
        self.ok = ok.detach()
        self.explain = explain

    def raise_error(self) -> NoReturn:
        """Raise the error of a failed check."""
        self.explain()
        raise ValueError("the inputs of this loss call failed a value check.")  # pragma: no cover

    def raise_if_failed(self) -> None:
        """Read the flag (one host read) and raise the error when it is False."""
        if not bool(self.ok):
            self.raise_error()


def _is_integral(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex())


class LossStats(dict):
    """``loss.last_stats``: a dict whose tensor values are read on the host when first read.

    A loss stores host numbers (counts known from the labels) and detached one-element tensors
    (values of the step); the first read of a value (``stats[key]``, ``.get``, ``.items()``,
    ``.values()``, ``dict(stats)``, ``repr``, ``==``) reads every pending tensor and the call's
    :class:`DeferredCheck` in one transfer and replaces them by Python floats (ints for integer
    tensors). When the check failed, every read raises its ``ValueError`` instead. Writing
    (``stats[key] = value``, ``update``) stores the value as given: a loss records its stats
    without a host sync.
    """

    def __init__(self, *args: Any, check: DeferredCheck | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.check = check

    def resolve(self) -> None:
        """Read the pending tensors and the check on the host (one transfer); raise if it failed."""
        pending = [(k, v) for k, v in dict.items(self) if isinstance(v, torch.Tensor)]
        check = self.check
        if not pending and check is None:
            return
        flat = [v.detach().reshape(-1)[0] for _, v in pending]
        if check is not None:
            flat.append(check.ok)
        device = flat[0].device
        values = torch.stack([t.to(device, torch.float64) for t in flat]).tolist()
        if check is not None:
            if not values.pop():
                check.raise_error()
            self.check = None
        for (key, tensor), value in zip(pending, values, strict=True):
            dict.__setitem__(self, key, int(value) if _is_integral(tensor) else value)

    # -- every read goes through resolve() -------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        self.resolve()
        return dict.__getitem__(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        """``stats[key]`` or ``default``."""
        self.resolve()
        return dict.get(self, key, default)

    def items(self):
        """(key, value) pairs, values read on the host."""
        self.resolve()
        return dict.items(self)

    def values(self):
        """Values read on the host."""
        self.resolve()
        return dict.values(self)

    def __iter__(self) -> Iterator[str]:
        # overriding __iter__ makes dict(stats), {**stats} and dict.update(stats) read through
        # keys() and __getitem__ instead of copying the raw (tensor) values
        return dict.__iter__(self)

    def pop(self, key: str, *default: Any) -> Any:
        """Remove ``key`` and return its value (read on the host)."""
        self.resolve()
        return dict.pop(self, key, *default)

    def copy(self) -> dict[str, Any]:
        """A plain dict of the values read on the host."""
        self.resolve()
        return dict(dict.items(self))

    def __eq__(self, other: object) -> bool:
        self.resolve()
        return dict.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None

    def __repr__(self) -> str:
        self.resolve()
        return dict.__repr__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # copy / deepcopy keep the values as they are, pending ones included (no host read)
        return (LossStats, (dict(dict.items(self)),), {"check": self.check})
