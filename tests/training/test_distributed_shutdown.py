"""Leaving the process group stops its threads, also when the run failed (issue 19, item 5).

A gloo thread still running while the interpreter shut down aborted a rank of the 2-process CLI
test under load (exit -6, "terminate called without an active exception"). The group only ends
when nothing holds it: the frames of a failure hold the trainer and its DDP wrapper, so
``shutdown_distributed(failure)`` must release them. One gloo rank in this process; the success
path of ``rankwise train`` is checked with 2 ranks in tests/test_cli_train_distributed.py.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rankwise.training.distributed import init_distributed, shutdown_distributed

TASKS = Path("/proc/self/task")


def group_threads() -> list[str]:
    """The native threads of a process group in this process (gloo, TCPStore)."""
    names = []
    for task in TASKS.iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if "gloo" in name or "tcpstore" in name:
            names.append(name)
    return sorted(names)


@pytest.fixture
def one_rank_group(monkeypatch):
    """A one-rank gloo group joined like torchrun's workers; destroyed if the test did not."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        monkeypatch.setenv(key, value)
    init_distributed(backend="gloo", device="cpu")
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.skipif(not TASKS.is_dir(), reason="native threads are listed from /proc (Linux)")
def test_shutdown_after_a_failure_stops_the_threads_of_the_group_the_failed_run_held(
    one_rank_group,
):
    def failing_fit():
        model = DistributedDataParallel(nn.Linear(3, 2))  # holds the group, as a trainer does
        model(torch.randn(4, 3)).sum().backward()
        raise RuntimeError("the run failed")

    try:
        failing_fit()
    except RuntimeError as exc:
        failure = exc
    assert group_threads()  # gloo's workers and transport loop, the TCPStore server
    shutdown_distributed(failure)
    assert not dist.is_initialized()
    assert group_threads() == []
    assert str(failure) == "the run failed"  # the error itself is untouched


def test_shutdown_without_a_process_group_does_nothing():
    assert not dist.is_initialized()
    shutdown_distributed()
    shutdown_distributed(RuntimeError("failed before joining"))
