"""Count the torch operations of each profiler range of a computation, and its host round trips.

:class:`DispatchCounter` is a ``TorchDispatchMode``: every aten operation of the code it wraps
passes through it, on any device, so counting on the CPU counts what a GPU would launch. Code
marks its units of work with ``torch.profiler.record_function(name)`` (the exact evaluation loop
of :mod:`rankwise.metrics._device` marks each chunk); the counter keeps, for every range whose
name starts with ``prefix``:

* the aten operations run in it, split into *kernels* (operations that compute: everything but
  views and bare allocations), views (``func.is_view``: no kernel) and allocations
  (``empty*``: memory, no kernel);
* the operations that force the host to wait for the device (``.item()`` and its kin
  ``aten._local_scalar_dense``, ``nonzero``, ``unique*``, ``masked_select``, indexing with a
  boolean mask, ``repeat_interleave`` without ``output_size``, ``bincount``, a copy to the CPU);
* with ``watch_host=True``, the calls that leave torch inside the range: ``Tensor.numpy()``,
  ``Tensor.tolist()``, ``torch.from_numpy`` and any numba kernel (patched on entry, restored on
  exit).

Used by the tests of the evaluation loop and by ``benchmarks/bench_retrieval.py --device``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DispatchCounter", "RangeCount", "SYNC_OPS"]

# aten operations that return data the host must wait for (or whose output size depends on data)
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "unique_dim_consecutive",
        "masked_select",
        "bincount",
        "equal",
        "is_nonzero",
        "allclose",
        "_assert_async",
    }
)
ALLOCATION_OPS = frozenset({"empty", "empty_strided", "empty_like", "new_empty"})
_ENTER = "_record_function_enter_new"
_EXIT = "_record_function_exit"


@dataclass
class RangeCount:
    """The operations of one profiler range.

    Attributes:
        name: the range's name.
        ops: aten operation (``namespace.name.overload``) -> times run, every kind.
        kernels: operations that compute (no views, no bare allocations).
        views: view operations (no kernel).
        allocations: ``empty*`` allocations (no kernel).
        syncs: the operations that make the host wait, in order.
        host_calls: numpy / numba / list conversions made inside the range, in order.
    """

    name: str
    ops: Counter = field(default_factory=Counter)
    kernels: int = 0
    views: int = 0
    allocations: int = 0
    syncs: list[str] = field(default_factory=list)
    host_calls: list[str] = field(default_factory=list)

    def kernel_ops(self) -> Counter:
        """The kernel operations by name (for reports)."""
        return Counter(
            {
                name: n
                for name, n in self.ops.items()
                if not name.startswith("view:") and not name.startswith("alloc:")
            }
        )


def _is_bool_index(func_name: str, args: tuple) -> bool:
    if not func_name.startswith("index") or len(args) < 2:
        return False
    indices = args[1]
    if not isinstance(indices, (list, tuple)):
        return False
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices
    )


def _is_sync(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the operation makes the host wait for the device (or sizes its output by data)."""
    if name in SYNC_OPS or _is_bool_index(name, args):
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    if name == "_to_copy" and args and isinstance(args[0], torch.Tensor):
        target = kwargs.get("device")
        return (
            target is not None
            and args[0].device.type != "cpu"
            and torch.device(target).type == "cpu"
        )
    if name == "copy_" and len(args) > 1 and isinstance(args[1], torch.Tensor):
        return args[1].device.type != "cpu" and args[0].device.type == "cpu"
    return False


class DispatchCounter(TorchDispatchMode):
    """Count the aten operations of every ``record_function`` range named ``prefix...``.

    Args:
        prefix: ranges whose name starts with it are counted (innermost one wins).
        watch_host: also record numpy / numba / ``tolist`` calls made inside those ranges.

    Example:
        >>> import torch
        >>> from rankwise._dispatch_count import DispatchCounter
        >>> with DispatchCounter("work") as counter:
        ...     with torch.profiler.record_function("work.step"):
        ...         y = (torch.ones(3) * 2).sum()
        >>> counter.ranges[0].kernels, counter.ranges[0].syncs
        (3, [])
    """

    def __init__(self, prefix: str, watch_host: bool = False) -> None:
        super().__init__()
        self.prefix = prefix
        self.watch_host = watch_host
        self.ranges: list[RangeCount] = []
        self._stack: list[RangeCount | None] = []
        self._patches: list[tuple[Any, str, Any]] = []

    # -- the ranges ------------------------------------------------------------------------------
    @property
    def current(self) -> RangeCount | None:
        """The innermost counted range being run (None outside every counted range)."""
        for entry in reversed(self._stack):
            if entry is not None:
                return entry
        return None

    def named(self, name: str) -> list[RangeCount]:
        """The ranges called ``name``, in order."""
        return [r for r in self.ranges if r.name == name]

    # -- dispatch --------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket.__name__
        if packet == _ENTER:
            name = str(args[0])
            entry = RangeCount(name) if name.startswith(self.prefix) else None
            if entry is not None:
                self.ranges.append(entry)
                if self.current is None and self.watch_host:
                    self._patch()
            self._stack.append(entry)
            return func(*args, **kwargs)
        if packet == _EXIT:
            out = func(*args, **kwargs)
            if self._stack:
                self._stack.pop()
                if self.current is None and self._patches:
                    self._unpatch()
            return out
        entry = self.current
        if entry is not None:
            self._record(entry, func, packet, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, entry: RangeCount, func, packet: str, args, kwargs) -> None:
        qualified = f"{func.namespace}.{packet}"
        if getattr(func, "is_view", False):
            entry.views += 1
            entry.ops[f"view:{qualified}"] += 1
        elif packet in ALLOCATION_OPS:
            entry.allocations += 1
            entry.ops[f"alloc:{qualified}"] += 1
        else:
            entry.kernels += 1
            entry.ops[qualified] += 1
        if _is_sync(packet, args, kwargs):
            entry.syncs.append(qualified)

    # -- host calls ------------------------------------------------------------------------------
    def _note(self, what: str) -> None:
        entry = self.current
        if entry is not None:
            entry.host_calls.append(what)

    def _patch(self) -> None:
        counter = self

        def wrap(owner: Any, attr: str, label: str) -> None:
            original = owner.__dict__.get(attr, getattr(owner, attr))

            def spy(*a, **k):
                counter._note(label if label else f"numba:{getattr(a[0], '__name__', a[0])}")
                return original(*a, **k)

            self._patches.append((owner, attr, owner.__dict__.get(attr)))
            setattr(owner, attr, spy)

        wrap(torch.Tensor, "numpy", "Tensor.numpy")
        wrap(torch.Tensor, "tolist", "Tensor.tolist")
        wrap(torch.Tensor, "__array__", "Tensor.__array__")
        wrap(torch, "from_numpy", "torch.from_numpy")
        try:
            from numba.core.registry import CPUDispatcher
        except ImportError:  # pragma: no cover - numba is a core dependency
            return
        wrap(CPUDispatcher, "__call__", "")

    def _unpatch(self) -> None:
        while self._patches:
            owner, attr, previous = self._patches.pop()
            if previous is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, previous)
