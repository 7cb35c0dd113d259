"""rankwise._dispatch: the counter of operations and host syncs, and the one-copy transfer.

Each kind of sync the issue-31 losses must avoid is seen on device data and counted as a host read
on host data; views launch no kernel; backward is counted; moves follow the documented rules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rankwise._dispatch import PARALLEL_GRAIN, DispatchCounter, count_dispatch, to_device


def syncs_of(fn, on_device=True):
    x = torch.tensor([[0.5, -1.0, 2.0], [0.0, 3.0, 1.0]], requires_grad=True)
    labels = torch.tensor([0, 1, 1])
    counter = count_dispatch(lambda: fn(x, labels), [x] if on_device else [])
    return counter


@pytest.mark.parametrize(
    ("name", "fn"),
    [
        ("_local_scalar_dense", lambda x, y: float(x.detach().sum())),
        ("_local_scalar_dense", lambda x, y: bool((x > 0).any())),
        ("_local_scalar_dense", lambda x, y: x.max().item()),
        ("nonzero", lambda x, y: (x > 0).nonzero()),
        ("_unique2", lambda x, y: torch.unique(x.detach(), return_counts=True)),
        ("index", lambda x, y: x[x > 0]),
        ("index_put_", lambda x, y: x.detach().clone().__setitem__(x > 0, 0.0)),
        ("masked_select", lambda x, y: x.masked_select(x > 0)),
        ("repeat_interleave", lambda x, y: torch.repeat_interleave(x.detach().long().abs()[0])),
        ("bincount", lambda x, y: torch.bincount(x.detach().long().flatten().abs())),
        ("tolist", lambda x, y: x.tolist()),
        ("copy_to_host", lambda x, y: x.cpu()),
        ("copy_to_host", lambda x, y: x.to("cpu")),
    ],
)
def test_each_kind_of_sync_is_seen_on_device_data_and_is_a_host_read_elsewhere(name, fn):
    on_device = syncs_of(fn)
    assert on_device.syncs[name] >= 1, on_device.summary()
    if name != "copy_to_host":
        on_host = syncs_of(fn, on_device=False)
        assert on_host.n_syncs == 0 and on_host.host_reads[name] >= 1, on_host.summary()


def test_sync_free_operations_are_not_syncs():
    def work(x, y):
        rows = x.index_select(0, torch.tensor([1, 0, 1]))  # host indices, sent implicitly
        masked = x.masked_fill(x > 0, 0.0)  # a boolean mask without a size read
        sized = torch.tensor([1, 2]).repeat_interleave(torch.tensor([2, 1]), output_size=3)
        (rows.sum() + masked.sum()).backward()
        return sized

    counter = syncs_of(work)
    assert counter.n_syncs == 0, counter.summary()
    assert counter.n_kernels > 0 and counter.device_ops["index_select"] == 1
    assert counter.host_reads == {}  # output_size given: nothing read


def test_labels_moved_to_the_device_are_device_data():
    x, labels = torch.randn(3, 2), torch.tensor([0, 1, 1])
    with DispatchCounter() as counter:
        counter.mark_device(x)
        (labels == 1).nonzero()  # host: a host read
        (labels.to(x.device) == 1).nonzero()  # moved: a device sync (on an accelerator it is)
        (torch.arange(3, device=x.device) > 0).nonzero()  # created on the device
    assert counter.host_reads["nonzero"] == 1 and counter.syncs["nonzero"] == 2


def test_views_are_not_kernels_and_backward_is_counted():
    x = torch.randn(4, 3, requires_grad=True)
    with DispatchCounter() as counter:
        counter.mark_device(x)
        y = x.view(-1).unsqueeze(0).t()  # views only
        forward = counter.n_kernels
        (y * 2).sum().backward()
    assert forward == 0 and counter.n_device_ops > 0
    assert counter.n_kernels >= 3  # mul, sum, and their backward


@pytest.mark.parametrize("pack", [False, True])
def test_to_device_sends_every_tensor_unchanged(pack):
    tensors = [
        torch.tensor([[True, False, True]]),
        torch.arange(5),
        torch.randn(2, 3, dtype=torch.float64),
        torch.zeros(0, dtype=torch.long),
        torch.tensor([1.5], dtype=torch.float16),
    ]
    tensors.append(tensors[1])  # twice: sent once
    out = to_device(tensors, torch.device("cpu"), pack=pack)
    for sent, original in zip(out, tensors, strict=True):
        assert sent.dtype == original.dtype and sent.shape == original.shape
        assert torch.equal(sent, original)


def test_to_device_packs_tensors_of_any_strides():
    """Issue 36: the packed copy (the path every loss takes off the CPU) raised on a tensor of one
    element with a zero stride: numpy gives ``array([n])[:, None]`` strides (8, 0), torch calls
    it contiguous, and viewing its bytes failed ("stride(-1) must be 1"), so on CUDA
    ``score_interpolation`` and every SOPRC update of a single class raised. Packed on the CPU
    here, as a counted run also packs."""
    column = torch.from_numpy(np.array([5])[:, None])
    assert column.stride() == (1, 0)
    tensors = [
        column,
        torch.zeros(()).expand(3),  # stride 0
        torch.arange(6.0).view(2, 3).t(),  # not contiguous
        torch.tensor([1.5, -2.25], dtype=torch.bfloat16),  # a dtype numpy lacks
        torch.tensor(7),  # 0-d
        torch.ones(2, 0, 3),
    ]
    out = to_device(tensors, torch.device("cpu"), pack=True)
    for sent, original in zip(out, tensors, strict=True):
        assert sent.dtype == original.dtype and sent.shape == original.shape
        assert torch.equal(sent, original)
    with DispatchCounter():  # a counted run takes the accelerator's (packed) path
        again = to_device(tensors[:1], torch.device("cpu"))
    assert again[0] is not tensors[0] and torch.equal(again[0], tensors[0])


def test_host_kernels_and_those_past_the_parallel_grain_are_counted():
    """Issue 36: torch operations on host data (not views) are counted, and apart those on
    PARALLEL_GRAIN elements or more, where torch may wake its intra-op thread pool."""
    x = torch.randn(3, 4)
    mask = torch.zeros(300, 300, dtype=torch.bool)  # 90,000 entries
    with DispatchCounter() as counter:
        counter.mark_device(x)
        mask.clone()
        torch.arange(5) + 1
        mask.view(-1)  # a view: no kernel
        torch.zeros(PARALLEL_GRAIN)  # a large output
        x * 2  # on the device
    assert counter.host_ops == {"clone": 1, "arange": 1, "add": 1, "zeros": 1}
    assert counter.parallel_host_ops == {"clone": 1, "zeros": 1}
    assert counter.device_ops == {"mul": 1}
