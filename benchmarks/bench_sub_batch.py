"""Peak memory and time of one training step against the sub-batch size (and the precision).

The step of :class:`rankwise.training.step.OptimizerStep` (issue 38 items 2 and 3): one P x K
batch through an embedding network (``rankwise.models.build_model``), the AP loss, SGD. With
``sub_batch_size`` the batch is embedded in chunks without gradients, the loss's gradient with
respect to the embeddings computed once, then each chunk re-run with gradients (gradient caching,
Gao et al., RepL4NLP 2021, as the Recall@k surrogate's code of Patel et al., CVPR 2022 does):
the backbone's activations are those of one chunk, at the cost of a second forward pass.

Each setting runs in a fresh subprocess: a one-pass warm-up step on 4 rows (lazy allocations,
the loss's compilation; fewer rows than any sub-batch), then, on the CPU, the resident high-water
mark is reset to the current resident size (``/proc/self/clear_refs``) so its growth during the
measured step is that step's own peak (activations, autograd's saved tensors, gradients); on CUDA,
``torch.cuda.max_memory_allocated`` above the memory allocated before the step. The step time
is the median of ``--repeats`` further steps. Results are ratios to the one-pass step of the
same run (float32), so they compare across machines.

Usage::

    python benchmarks/bench_sub_batch.py                 # CPU: small_cnn, batch 128, 48 x 48;
                                                         # rewrites its docs/benchmarks.md section
    python benchmarks/bench_sub_batch.py --quick         # smoke run, prints the table only
    # the GPU tables: the ResNet-50 recipe's step, sub-batches and precisions
    python benchmarks/bench_sub_batch.py --device cuda --backbone resnet50 --image-size 224
        --batch 128 --sub-batches 64 32 16 --precisions 32 bf16 16   # (one command line)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from _report import machine_info, write_section  # same folder (sys.path[0])
from bench_losses import _proc_status_bytes, _reset_peak_rss

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
TITLE = "## Sub-batches and precision (issue 38)"
K = 4  # samples per class
WARM = 4  # rows of the warm-up step


def _setup(args: argparse.Namespace, batch: int):
    from rankwise.losses import build_loss
    from rankwise.models import build_model
    from rankwise.training.step import OptimizerStep

    torch.manual_seed(0)
    device = torch.device(args.device)
    channels = 3 if args.backbone == "resnet50" else 1
    shape = (channels, args.image_size, args.image_size)
    model = build_model(args.backbone, shape, 128).to(device).train()
    loss_fn = build_loss("ap")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    sub = None if args.sub_batch == 0 else args.sub_batch
    step = OptimizerStep(args.precision, sub, device=device, model=model)
    x = torch.randn(batch, *shape, device=device)
    y = torch.arange(batch // K).repeat_interleave(K)
    return step, model, loss_fn, optimizer, x, y


def probe(args: argparse.Namespace) -> dict[str, float]:
    """In a fresh process: the peak memory growth (MiB) and median time of one step."""
    step, model, loss_fn, optimizer, x, y = _setup(args, args.batch)
    cuda = args.device.startswith("cuda")
    # warm-up in one pass on 2 classes of 2 (lazy allocations, the loss's compilation): fewer
    # rows than any sub-batch, so the allocator keeps little of a chunk's activations from it
    warm = type(step)(args.precision, device=step.device)
    warm.run(x[:WARM], torch.tensor([0, 0, 1, 1]), model, loss_fn, optimizer)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        if not _reset_peak_rss():
            raise RuntimeError("needs Linux /proc/self/clear_refs to reset the peak resident size")
        before = _proc_status_bytes("VmRSS") or 0
    step.run(x, y, model, loss_fn, optimizer)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _proc_status_bytes("VmHWM") or 0
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step.run(x, y, model, loss_fn, optimizer)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"mib": max(0, peak - before) / 2**20, "seconds": statistics.median(times)}


def measure(args: argparse.Namespace, precision: str, sub_batch: int) -> dict[str, float] | str:
    """:func:`probe` of one setting in a subprocess; its numbers, or the error's last line."""
    command = [
        sys.executable, str(Path(__file__).resolve()), "--probe",
        "--device", args.device, "--backbone", args.backbone,
        "--image-size", str(args.image_size), "--batch", str(args.batch),
        "--repeats", str(args.repeats), "--precision", precision, "--sub-batch", str(sub_batch),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return "failed: " + (done.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(args: argparse.Namespace) -> str:
    """The markdown table: one row per (precision, sub-batch size), ratios to the first row."""
    settings = [("32", 0)] + [("32", s) for s in args.sub_batches]
    settings += [(p, 0) for p in args.precisions if p != "32"]
    rows = []
    reference: dict[str, float] | None = None
    for precision, sub in settings:
        result = measure(args, precision, sub)
        label = "one pass" if sub == 0 else f"sub-batches of {sub}"
        if isinstance(result, str):
            rows.append(f"| {precision} | {label} | {result} | | | |")
            continue
        reference = reference if reference is not None else result
        rows.append(
            f"| {precision} | {label} | {result['mib']:.1f} | "
            f"{result['mib'] / max(reference['mib'], 1e-9):.2f} | {result['seconds']:.3f} | "
            f"{result['seconds'] / reference['seconds']:.2f} |"
        )
        print(rows[-1], flush=True)
    head = [
        "| precision | batch embedded in | peak MiB | × one pass | step s | × one pass |",
        "|---|---|---|---|---|---|",
    ]
    return "\n".join(head + rows)


def main() -> None:
    """Measure every setting; print the section and, unless ``--quick``, write it to the docs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backbone", default="small_cnn")
    parser.add_argument("--image-size", type=int, default=48)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--sub-batches", type=int, nargs="+", default=[64, 32, 16, 8])
    parser.add_argument("--precisions", nargs="+", default=["32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="32", help=argparse.SUPPRESS)
    parser.add_argument("--sub-batch", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.probe:
        print(json.dumps(probe(args)))
        return
    if args.quick:
        args.batch, args.sub_batches, args.repeats, args.image_size = 32, [8], 1, 28
    info = machine_info()
    body = table(args)
    shape = f"{args.image_size} x {args.image_size}"
    section = "\n".join(
        [
            TITLE,
            "",
            f"`python benchmarks/bench_sub_batch.py` on `{args.device}`: one step of "
            f"`{args.backbone}` (128-d head) on a P x K batch of {args.batch} ({K} per class), "
            f"{shape} random inputs, the AP loss, SGD; one torch thread. Peak memory: the growth "
            f"of the resident set during the step after a one-pass warm-up on {WARM} rows (CPU; "
            "`cuda`: `max_memory_allocated` above the "
            "memory before it), each setting in a fresh process; step time: median of "
            f"{args.repeats}. Ratios are to the first row, float32 in one pass.",
            "",
            body,
            "",
            "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + ".",
        ]
    )
    print(section)
    if not args.quick:
        name = TITLE if args.device == "cpu" else f"{TITLE} on {args.device}"
        write_section(DOCS, section.replace(TITLE, name, 1), name)


if __name__ == "__main__":
    main()
