"""Cost of the streamed verification metrics (ROC AUC, TPR@FPR) of an evaluation.

Times, on the same clustered embeddings and leave-one-out: ``retrieval_metrics`` (the report the
verification view is added to), ``verification_metrics`` (streamed pair counts: memory O(positive
pairs + one block)) and the materialised peer, ``pair_scores`` + ``roc_auc`` + ``tpr_at_fpr`` on
the explicit list of the n(n-1)/2 unordered pairs (memory O(pairs)). Results are ratios within
one run (docs/benchmarks.md); the values agree exactly.

    python benchmarks/bench_verification.py --n 3000 --dim 64
"""

from __future__ import annotations

import argparse
import time

import torch

from rankwise.metrics import (
    pair_scores,
    retrieval_metrics,
    roc_auc,
    tpr_at_fpr,
    verification_metrics,
)


def clustered(n: int, dim: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters: embeddings and labels."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=generator)
    centers = torch.randn(classes, dim, generator=generator)
    return centers[labels] + 0.8 * torch.randn(n, dim, generator=generator), labels


def timed(call):
    """``(call(), seconds)``."""
    start = time.perf_counter()
    value = call()
    return value, time.perf_counter() - start


def main() -> None:
    """Time the three on one split and print the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--classes", type=int, default=100)
    args = parser.parse_args()
    x, y = clustered(args.n, args.dim, args.classes)
    small = clustered(50, args.dim, 5)  # numba compilation outside the timings
    retrieval_metrics(*small, ks=(1,))
    verification_metrics(*small, fpr=(0.01,))
    _, t_report = timed(lambda: retrieval_metrics(x, y, ks=(1, 10)))
    ours, t_ours = timed(lambda: verification_metrics(x, y, fpr=(1e-3,)))

    def peer():
        scores, positive = pair_scores(x, y)
        return roc_auc(scores, positive), tpr_at_fpr(scores, positive, 1e-3)

    (auc, tpr), t_peer = timed(peer)
    # the peer scores by similarity values, the streamed form by exact keys: equal here
    print(f"n={args.n} d={args.dim}: pairs {ours.n_positive_pairs + ours.n_negative_pairs:,}")
    print(
        f"  AUC {ours.roc_auc:.6f} (peer {auc:.6f}), TPR@1e-3 {ours.tpr_at(1e-3):.4f} ({tpr:.4f})"
    )
    print(f"  retrieval_metrics        {t_report:7.2f} s")
    print(f"  verification_metrics     {t_ours:7.2f} s  ({t_ours / t_report:.2f} x the report)")
    print(f"  pair_scores + roc_auc    {t_peer:7.2f} s  ({t_peer / t_report:.2f} x the report)")


if __name__ == "__main__":
    main()
