"""Peak memory of one forward + backward of every loss against the batch size.

Every loss of ``rankwise.losses.LOSSES`` (built with ``rankwise.losses.build_loss``; the AUC loss
of Gajić et al. also with its batch-all strategy, Sec. 3.3) on a P x K batch (K = 4 samples per
class, dimension 128, float32, CPU), each (loss, batch size) in a fresh subprocess. After imports,
the inputs and a warm-up call on a small batch, the resident high-water mark is reset to the
current resident size (``/proc/self/clear_refs``), so its growth during the call is the call's own
peak: intermediates and autograd's saved tensors. The method is that of
``benchmarks/bench_losses.py`` (Smooth-AP memory), whose helpers it reuses. Prints a markdown
table in MiB with the growth exponent k of memory ~ B^k between the two largest batches.

Usage::

    python benchmarks/bench_loss_memory.py                       # batches 256, 1024, 2048
    python benchmarks/bench_loss_memory.py --batches 512 2048 --losses dir auc-all
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from bench_losses import _proc_status_bytes, _reset_peak_rss  # same folder (sys.path[0])

K = 4
DIM = 128


def _cases() -> dict[str, tuple[str, dict]]:
    """Case name -> (registry name, build_loss parameters)."""
    from rankwise.losses import LOSSES

    cases = {name: (name, {}) for name in LOSSES}
    cases["auc-all"] = ("auc", {"strategy": "all"})
    # XBM past its warm-up (75 calls by default): the memory form is what is measured
    cases["xbm"] = ("xbm", {"start_iteration": 0})
    return cases


def probe(case: str, batch_size: int) -> dict[str, float]:
    """In a fresh process: peak resident growth (MiB) of one forward + backward of ``case``."""
    from rankwise.losses import build_loss

    name, params = _cases()[case]
    n_classes = batch_size // K
    train_labels = np.repeat(np.arange(n_classes), K)
    loss = build_loss(
        name, train_labels=train_labels, num_classes=n_classes, embedding_dim=DIM, **params
    )
    generator = torch.Generator().manual_seed(0)
    warm_labels = torch.arange(4).repeat_interleave(K)
    warm = torch.randn(len(warm_labels), DIM, generator=generator, requires_grad=True)
    loss(warm, warm_labels).backward()
    labels = torch.arange(n_classes).repeat_interleave(K)
    embeddings = torch.randn(batch_size, DIM, generator=generator, requires_grad=True)
    if not _reset_peak_rss():
        raise RuntimeError("needs Linux /proc/self/clear_refs to reset the peak resident size")
    before = _proc_status_bytes("VmRSS")
    loss(embeddings, labels).backward()
    peak = _proc_status_bytes("VmHWM")
    return {"mib": max(0, peak - before) / 2**20}


def measure(case: str, batch_size: int) -> float | str:
    """Run :func:`probe` in a subprocess; MiB or the error's last line."""
    command = [sys.executable, str(Path(__file__).resolve()), "--probe", case, str(batch_size)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return "failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(done.stdout.strip().splitlines()[-1])["mib"]


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--losses", nargs="+", default=None)
    parser.add_argument("--probe", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.probe:
        print(json.dumps(probe(args.probe[0], int(args.probe[1]))))
        return
    cases = args.losses or list(_cases())
    header = " | ".join(f"B = {b} MiB" for b in args.batches)
    print(f"| loss | {header} | k |")
    print("|---|" + "---:|" * (len(args.batches) + 1))
    for case in cases:
        values = [measure(case, b) for b in args.batches]
        cells = [f"{v:.1f}" if isinstance(v, float) else v for v in values]
        (b1, v1), (b2, v2) = list(zip(args.batches, values, strict=True))[-2:]
        ok = isinstance(v1, float) and isinstance(v2, float) and v1 > 0 and v2 > 0
        k = f"{math.log(v2 / v1) / math.log(b2 / b1):.2f}" if ok else "-"
        print(f"| {case} | " + " | ".join(cells) + f" | {k} |", flush=True)


if __name__ == "__main__":
    main()
