"""The numba kernels must not change torch's intra-op thread count: numba's OpenMP layer shares
the runtime with torch, and a changed count breaks bit-for-bit reproducible training."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize(
    "calls",
    [
        "retrieval_metrics(x, y); pr_curve(x, y)",
        "pair_scores(x, y)",
        "roc_curve_from_embeddings(x, y, bins=50)",
        "ranking_keys(x); exact_similarity(x)",
    ],
)
def test_numba_entry_points_keep_torch_threads_in_a_fresh_process(calls):
    # a fresh interpreter: numba's first parallel launch is the one that resets the runtime
    code = textwrap.dedent(f"""
        import numpy as np, torch
        torch.set_num_threads(1)
        from rankwise.metrics import pair_scores, pr_curve, retrieval_metrics
        from rankwise.metrics import roc_curve_from_embeddings
        from rankwise.similarity import exact_similarity, ranking_keys
        x = np.random.default_rng(0).normal(size=(300, 8)).astype(np.float32)
        y = np.arange(300) % 7
        {calls}
        print(torch.get_num_threads())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
