"""Forward + backward time of TieAwareAPLoss, exact (harmonic-number) form vs released midpoint form.

He, Cakir, Bargal & Sclaroff, "Hashing as Tie-Aware Learning to Rank" (CVPR 2018), Eq. 11 and the
authors' simplified objective: a batch of 250 relaxed codes (10 classes x 25, the paper's batch),
one torch thread, best of 5 repeats of 5 steps each; the ratio midpoint / exact is what the docs
quote (docs/hashing.md).

    python benchmarks/bench_tie_aware_forms.py
"""

from __future__ import annotations

import time

import torch

from rankwise.losses import TieAwareAPLoss


def time_step(loss: TieAwareAPLoss, codes: torch.Tensor, labels: torch.Tensor) -> float:
    """Best per-step seconds of forward + backward over 5 repeats of 5 steps (after warm-up)."""
    for _ in range(3):
        loss(codes, labels).backward()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(5):
            loss(codes, labels).backward()
        best = min(best, (time.perf_counter() - start) / 5)
    return best


def main() -> None:
    """Print the per-step times of both forms and their ratio for 12 and 48 bits."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    labels = torch.arange(10).repeat_interleave(25)
    for bits in (12, 48):
        codes = torch.randn(250, bits).tanh().requires_grad_()
        times = {
            form: time_step(TieAwareAPLoss(bits, form=form), codes, labels)
            for form in ("exact", "midpoint")
        }
        print(
            f"{bits} bits: exact {times['exact'] * 1e3:.1f} ms, midpoint "
            f"{times['midpoint'] * 1e3:.1f} ms, midpoint / exact "
            f"{times['midpoint'] / times['exact']:.2f}"
        )


if __name__ == "__main__":
    main()
