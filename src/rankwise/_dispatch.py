"""Count the aten operations and the host syncs of a piece of torch code, on any device.

A host sync is an operation after which the host must wait for the device: reading a value
(``aten._local_scalar_dense``: ``.item()``, ``int()`` / ``float()`` / ``bool()`` of a tensor), an
output whose size depends on the values (``nonzero``, ``unique*``, ``masked_select``, indexing with
a boolean mask, ``repeat_interleave`` without ``output_size``, ``bincount``), ``.tolist()`` /
``.numpy()``, or a copy to the host. On the CPU none of them waits for anything, so a CPU run
cannot tell a sync from a harmless host computation by timing; :class:`DispatchCounter` tells them
apart by where the data comes from, simulating a run whose inputs live on an accelerator:

- tensors passed to :meth:`DispatchCounter.mark_device` (the embeddings, a module's buffers) are
  on the device, and so is every tensor computed from one of them, every tensor moved with
  ``.to(device)`` / ``.to(other)`` / ``.cuda()`` and every tensor created with an explicit
  ``device=`` (``torch.arange(n, device=...)``);
- everything else (labels from the data loader, constants) lives on the host, and so does the
  result of ``.cpu()`` / ``.to("cpu")`` (a copy to the host, itself a sync when its source is on
  the device). A CPU run cannot tell ``.to(x.device)`` from a move to the host, so code that
  copies to the host writes ``.cpu()`` or ``.to("cpu")``.

A sync operation on a device tensor is a **device sync** (:attr:`DispatchCounter.syncs`); on host
tensors only it is a **host read** (:attr:`DispatchCounter.host_reads`), free when those tensors
are on the CPU (labels, which the data loader gives on the host). Both are counted by name. The
count covers what runs under the modes on the current thread: forward and, for CPU tensors,
backward (the autograd engine runs CPU work on the calling thread).

Example:
    >>> import torch
    >>> from rankwise._dispatch import DispatchCounter
    >>> x, labels = torch.randn(4, 3), torch.tensor([0, 0, 1, 1])
    >>> with DispatchCounter() as counter:
    ...     counter.mark_device(x)
    ...     _ = int((labels == 0).sum())  # a host read: labels are on the host
    ...     _ = float(x.sum())  # a device sync
    >>> dict(counter.host_reads), dict(counter.syncs)
    ({'_local_scalar_dense': 1}, {'_local_scalar_dense': 1})
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "DispatchCounter",
    "PARALLEL_GRAIN",
    "SYNC_OPS",
    "VIEW_OPS",
    "count_dispatch",
    "simulating_device",
    "to_device",
]

aten = torch.ops.aten

#: from this many elements on, a CPU operation may split its work over torch's intra-op thread
#: pool (``at::internal::GRAIN_SIZE``); below it, it runs on the calling thread
PARALLEL_GRAIN = 2**15
#: operations that read a value to the host or whose output size depends on the values
SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "nonzero",
        "argwhere",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "bincount",  # sized from the largest value on every device, minlength or not
        "histc",  # CUDA reads the range of the values when min == max
    }
)
#: operations that only make a new view of a tensor's data: no kernel
VIEW_OPS = frozenset(
    {
        "_reshape_alias",
        "_unsafe_view",
        "alias",
        "as_strided",
        "detach",
        "diagonal",
        "expand",
        "permute",
        "select",
        "slice",
        "split",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unsqueeze",
        "view",
        "view_as",
    }
)
# Python-level methods that hand tensor data to the host
_HOST_METHODS = {
    torch.Tensor.tolist: "tolist",
    torch.Tensor.numpy: "numpy",
    torch.Tensor.__array__: "numpy",
}
_FACTORIES = {
    torch.arange,
    torch.empty,
    torch.full,
    torch.linspace,
    torch.ones,
    torch.rand,
    torch.randn,
    torch.tensor,
    torch.as_tensor,
    torch.zeros,
    torch.eye,
}


def _is_sync(func: Any, args: tuple, kwargs: dict) -> bool:
    name = func.__name__.split(".")[0]
    if name in SYNC_OPS:
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        # t[mask] / t[mask] = v: a boolean index becomes nonzero(mask)
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in indices or ()
        )
    return False


def _move_target(func: Any, args: tuple, kwargs: dict) -> Any:
    """The target of a move (``t.to(device / other)``, ``.cpu()``, ``.cuda()``), else None."""
    if func is torch.Tensor.cpu:
        return torch.device("cpu")
    if func is torch.Tensor.cuda:
        return "cuda"
    if func is not torch.Tensor.to:
        return None
    for target in (kwargs.get("device"), kwargs.get("other"), *args[1:]):
        if isinstance(target, (torch.device, str, torch.Tensor)):
            return target
    return None


class _FunctionLevel(TorchFunctionMode):
    """Python-level calls: moves between host and device, ``.tolist()`` / ``.numpy()``."""

    def __init__(self, owner: DispatchCounter) -> None:
        super().__init__()
        self.owner = owner

    def _side_after_move(self, func: Any, source: Any, target: Any) -> str:
        """Where a move puts its result in the simulated run: ``"device"`` or ``"host"``.

        ``.cpu()`` and ``.to("cpu")`` (the string) go to the host; ``.to(tensor)`` to that
        tensor's side; ``.to(device)`` with a ``torch.device`` (``x.device``: "cpu" in a CPU run
        too) takes a host tensor to the device and keeps a device tensor there.
        """
        if func is torch.Tensor.cpu or (isinstance(target, str) and target == "cpu"):
            return "host"
        if isinstance(target, torch.Tensor):
            return "device" if self.owner.on_device(target) else "host"
        return "device"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        method = _HOST_METHODS.get(func)
        if method is not None:
            owner._record_sync(method, owner.on_device(args[0]))
        target = _move_target(func, args, kwargs)
        side = None if target is None else self._side_after_move(func, args[0], target)
        made_on_device = func in _FACTORIES and kwargs.get("device") is not None
        counted_on_device = side == "device" or made_on_device
        owner._device_calls += counted_on_device
        try:
            out = func(*args, **kwargs)
        finally:
            owner._device_calls -= counted_on_device
        if side is not None and out is args[0]:
            # a move to the CPU's own device returns the tensor itself: the simulated move gives
            # a new tensor (a view), so the source keeps its side
            with _disable_current_modes():
                out = out.view_as(out)
        if counted_on_device:
            owner._mark(out)
        elif side == "host" and isinstance(out, torch.Tensor):
            if owner.on_device(args[0]):
                owner._record_sync("copy_to_host", True)
            owner._host_copies[out] = True
        return out


class _DispatchLevel(TorchDispatchMode):
    """aten operations: counts, syncs, and which outputs are on the device."""

    def __init__(self, owner: DispatchCounter) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        name = func.__name__.split(".")[0]
        owner.ops[name] += 1
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        on_device = owner._device_calls > 0 or any(owner.on_device(t) for t in tensors)
        if on_device:
            owner.device_ops[name] += 1
        if _is_sync(func, args, kwargs):
            owner._record_sync(name, on_device)
        out = func(*args, **kwargs)
        if on_device:
            owner._mark(out)
        elif name not in VIEW_OPS and name != "lift_fresh":  # lift_fresh: torch.tensor's no-op
            owner.host_ops[name] += 1
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if max((t.numel() for t in tensors + outputs), default=0) >= PARALLEL_GRAIN:
                owner.parallel_host_ops[name] += 1
        return out


# how many DispatchCounter contexts are open (on any thread): while one is, CPU tensors stand for
# device data, so code that reads a CPU value at once because it costs nothing there defers the
# read as it would on an accelerator (simulating_device)
_open_counters = 0


def simulating_device() -> bool:
    """Whether a :class:`DispatchCounter` is counting: CPU tensors stand for device data.

    Code that reads a value of CPU data at once (free on the CPU) and defers the read on an
    accelerator asks this, so that a counted CPU run takes the accelerator's path.
    """
    return _open_counters > 0


class DispatchCounter:
    """Context manager counting aten operations and host syncs (see the module docstring).

    Attributes:
        ops: ``Counter`` of every aten operation by name (``"mm"``, ``"sum"``, ...).
        device_ops: ``Counter`` of the operations on the device (the rest run on the host);
            :attr:`n_kernels` leaves out views, which launch nothing.
        syncs: ``Counter`` of the sync operations that read device data, by name.
        host_reads: ``Counter`` of the sync operations on host data only, by name.
        host_ops: ``Counter`` of the operations on the host that are not views (torch CPU
            kernels: the labels' bookkeeping; numpy work is not seen).
        parallel_host_ops: the part of :attr:`host_ops` with an input of at least
            :data:`PARALLEL_GRAIN` elements: where torch may wake its intra-op thread pool, whose
            threads then spin on the host's cores after the work.
    """

    def __init__(self) -> None:
        self.ops: Counter[str] = Counter()
        self.device_ops: Counter[str] = Counter()
        self._device_calls = 0
        self.syncs: Counter[str] = Counter()
        self.host_reads: Counter[str] = Counter()
        self.host_ops: Counter[str] = Counter()
        self.parallel_host_ops: Counter[str] = Counter()
        self._device = WeakTensorKeyDictionary()
        self._host_copies = WeakTensorKeyDictionary()
        self._modes = (_FunctionLevel(self), _DispatchLevel(self))

    def __enter__(self) -> DispatchCounter:
        global _open_counters
        for mode in self._modes:
            mode.__enter__()
        _open_counters += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        global _open_counters
        _open_counters -= 1
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def mark_device(self, *tensors: torch.Tensor | None) -> None:
        """Treat ``tensors`` (None ignored) as living on the device, like all their results."""
        for t in tensors:
            if t is not None:
                self._device[t] = True

    def on_device(self, t: Any) -> bool:
        """Whether ``t`` is a tensor on the (simulated) device."""
        return isinstance(t, torch.Tensor) and t in self._device and t not in self._host_copies

    @property
    def n_ops(self) -> int:
        """Total aten operations."""
        return sum(self.ops.values())

    @property
    def n_device_ops(self) -> int:
        """Operations on the device, views included."""
        return sum(self.device_ops.values())

    @property
    def n_kernels(self) -> int:
        """Operations on the device that are not views (on an accelerator: kernel launches)."""
        return sum(n for name, n in self.device_ops.items() if name not in VIEW_OPS)

    @property
    def n_syncs(self) -> int:
        """Total device syncs."""
        return sum(self.syncs.values())

    @property
    def n_host_reads(self) -> int:
        """Total host reads (sync operations on host data)."""
        return sum(self.host_reads.values())

    def _record_sync(self, name: str, on_device: bool) -> None:
        (self.syncs if on_device else self.host_reads)[name] += 1

    def _mark(self, out: Any) -> None:
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor):
                self._device[t] = True

    def summary(self) -> str:
        """One line: operations, device syncs and host reads, with the names of the syncs."""
        syncs = ", ".join(f"{k} x{v}" for k, v in sorted(self.syncs.items())) or "none"
        reads = ", ".join(f"{k} x{v}" for k, v in sorted(self.host_reads.items())) or "none"
        return (
            f"{self.n_ops} ops ({self.n_kernels} device kernels, "
            f"{self.n_device_ops - self.n_kernels} device views, "
            f"{self.n_ops - self.n_device_ops} on the host), {self.n_syncs} device syncs "
            f"({syncs}), {self.n_host_reads} host reads ({reads})"
        )


def count_dispatch(
    fn: Callable[[], Any], device_tensors: Iterable[torch.Tensor | None] = ()
) -> DispatchCounter:
    """Run ``fn()`` under a :class:`DispatchCounter` with ``device_tensors`` on the device."""
    with DispatchCounter() as counter:
        counter.mark_device(*device_tensors)
        fn()
    return counter


def to_device(
    tensors: list[torch.Tensor], device: torch.device, *, pack: bool | None = None
) -> list[torch.Tensor]:
    """Host tensors on ``device`` in one host-to-device copy (the same tensors on the CPU).

    Off the CPU, and on the CPU while a :class:`DispatchCounter` simulates a device
    (:func:`simulating_device`: a counted CPU run takes the accelerator's path), the tensors'
    bytes go in one buffer (each part aligned to 8 bytes), copied with ``non_blocking=True``
    (from pageable memory the host stages the bytes and goes on: no wait for the device), and
    come back as views of it; a tensor passed twice is sent once. The buffer is filled by numpy,
    from each tensor whatever its strides (a (1, 1) array of numpy can have strides (8, 0)),
    on the calling thread: a torch copy of a mask of 2**15 entries or more would wake the
    intra-op thread pool, whose threads then spin on the host's cores. ``pack`` forces (True) or
    skips (False) the packing, for tests on the CPU.
    """
    device = torch.device(device)
    if pack is None:
        pack = device.type != "cpu" or simulating_device()
    if not pack:
        return [t.to(device) for t in tensors]
    unique: dict[int, int] = {}
    sources: list[tuple[int, np.ndarray]] = []
    layout: list[tuple[int, int, torch.dtype, torch.Size]] = []
    offset = 0
    for t in tensors:
        if id(t) in unique:
            layout.append(layout[unique[id(t)]])
            continue
        source = _host_array(t)
        unique[id(t)] = len(layout)
        layout.append((offset, source.nbytes, t.dtype, t.shape))
        sources.append((offset, source))
        offset += source.nbytes + (-source.nbytes % 8)
    host = np.zeros(offset, dtype=np.uint8)
    for start, source in sources:
        part = host[start : start + source.nbytes].view(source.dtype).reshape(source.shape)
        np.copyto(part, source)
    buffer = torch.from_numpy(host).to(device, non_blocking=True)
    return [
        buffer[start : start + nbytes].view(dtype).view(shape)
        for start, nbytes, dtype, shape in layout
    ]


# numpy stand-ins of the same size for the dtypes numpy lacks (their bits are copied as is)
_BITS_AS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _host_array(t: torch.Tensor) -> np.ndarray:
    """The values of the CPU tensor ``t`` as a numpy array (no copy), any strides, any dtype."""
    t = t.detach()
    try:
        return t.numpy()
    except TypeError:  # bfloat16 and the like: the same bits as an integer of their size
        return t.view(_BITS_AS[t.element_size()]).numpy()
