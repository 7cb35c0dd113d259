"""Fixtures of the training tests: a launcher of 2-process (gloo, CPU) torch.distributed runs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("distributed_worker.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for a worker, one intra-op thread each (2 shared cores)."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }


def run_ranks(args: list[str], world_size: int = 2, timeout: float = 240) -> list[str]:
    """Run ``python *args`` as ``world_size`` ranks; fail with every rank's output if one fails.

    Returns:
        Each rank's combined stdout and stderr.
    """
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env=rank_environment(rank, world_size, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:  # a rank hung (a collective another rank never joined)
                proc.kill()
                proc.wait()
    codes = [proc.returncode for proc in procs]
    if any(codes):
        details = "\n".join(f"--- rank {r} (exit {c}) ---\n{o[-4000:]}" for r, (c, o) in
                            enumerate(zip(codes, outputs, strict=True)))
        pytest.fail(f"a distributed worker failed:\n{details}")
    return outputs


@pytest.fixture(scope="session")
def distributed_results(tmp_path_factory):
    """Every case of distributed_worker.py, run once per session by 2 gloo ranks.

    Returns:
        A function ``(case, rank) -> the rank's saved result``.
    """
    import torch

    out = tmp_path_factory.mktemp("distributed")
    cases = ["losses", "errors"]
    run_ranks([str(WORKER), ",".join(cases), str(out)])

    def load(case: str, rank: int):
        return torch.load(out / f"{case}-rank{rank}.pt", weights_only=True)

    return load
