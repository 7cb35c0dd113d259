"""The sharded-evaluation cases run once per session by 2 gloo ranks (tests/metrics/sharded_worker.py)."""

from __future__ import annotations

import pickle
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the spawned ranks import sharded_worker by name (and the tests)

TIMEOUT_S = 300


@pytest.fixture(scope="session")
def sharded_results(tmp_path_factory):
    """Every case of sharded_worker.py: ``[rank 0's results, rank 1's results]``."""
    import sharded_worker
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("sharded")
    context = mp.spawn(sharded_worker.main, args=(2, str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:  # a rank waits in a collective the other never joined
            for process in context.processes:
                process.kill()
            pytest.fail(f"the sharded-evaluation ranks did not finish in {TIMEOUT_S} s")
    results = []
    for rank in range(2):
        with open(out / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results
