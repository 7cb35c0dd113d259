"""Benchmark of sharded data-parallel evaluation: 2 CPU processes against 1, identical reports.

What a data-parallel trainer evaluates: every rank holds the whole gathered split (here the
Fashion-MNIST test split, 10,000 images, 10 classes), and ranks it leave-one-out with the exact
tie-aware metrics (He et al., CVPR 2018, Prop. 1; MAP@R of Musgrave et al., ECCV 2020) and the
mean PR curve (Wen et al., NeurIPS 2022, Fig. 2). One process calls ``retrieval_metrics`` and
``pr_curve`` on everything; with 2 gloo ranks ``sharded_metric`` / ``sharded_curve`` rank each
rank's half of the queries against the whole gallery and merge the reports
(``merge_retrieval_reports``), so every rank gets the one-process report, field for field.

Each configuration runs in fresh processes with torch and numba limited to 1 thread per process
(``NUMBA_NUM_THREADS=1``), numba compiled on a small warm-up first; the wall time of a repeat is
the slowest rank's, between two barriers; the best of ``--repeats`` is reported (the median too).
A 1-process run with 2 threads is shown for reference (the thread-parallel peer), and the CPU
seconds of the slowest rank (``time.process_time``) show how the work itself was split. On a
shared machine the wall-time ratio also depends on how much of a second core is free: the run
measures that too ("parallel capacity": two concurrent copies of a CPU-bound loop against one,
2.0 on two idle cores), before and after the evaluations. Where that capacity is short, the
"work split" row says what two idle cores would give: in one 1-thread process, each rank's block
call timed one after the other, plus the merge, against the whole call.

    python benchmarks/bench_sharded_eval.py                       # untrained small_cnn embeddings
    python benchmarks/bench_sharded_eval.py --embeddings random   # N(0, 1) embeddings, same labels

Results go to the "## Sharded evaluation" section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from _report import machine_info, write_section

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Sharded evaluation"
KS = (1, 10, 100)
TARGET = 0.6
LOADED = 1.8  # parallel capacity below which the wall-time ratio is the machine's load


def make_embeddings(kind: str, dim: int, path: Path) -> None:
    """Fashion-MNIST test labels and embeddings (untrained small_cnn or N(0, 1)), saved to path."""
    import torch

    from rankwise.data.array_datasets import read_mnist_family
    from rankwise.models import build_model

    _, _, images, labels = read_mnist_family("fashion-mnist")
    torch.manual_seed(0)
    if kind == "random":
        embeddings = torch.randn(images.shape[0], dim, generator=torch.Generator().manual_seed(0))
    else:
        model = build_model("small_cnn", (1, 28, 28), dim).eval()
        x = torch.from_numpy(np.array(images)).float().div(255.0).unsqueeze(1)
        with torch.no_grad():
            embeddings = torch.cat([model(batch) for batch in x.split(500)])
    torch.save({"embeddings": embeddings, "labels": torch.from_numpy(labels)}, path)


def evaluate(data: dict[str, Any], group_size: int) -> tuple[Any, Any]:
    """The report and curve, one process or sharded (the latter a collective)."""
    from rankwise.metrics import pr_curve, retrieval_metrics, sharded_curve, sharded_metric

    x, y = data["embeddings"], data["labels"]
    if group_size == 1:
        return retrieval_metrics(x, y, ks=KS), pr_curve(x, y)
    return sharded_metric(retrieval_metrics, x, y, ks=KS), sharded_curve(pr_curve, x, y)


def warm_up() -> None:
    """Compile numba's kernels (cached per process) outside the timed calls."""
    import torch

    from rankwise.metrics import pr_curve, retrieval_metrics

    x, y = torch.randn(64, 8), torch.arange(64) % 4
    retrieval_metrics(x, y, ks=KS)
    pr_curve(x, y)


def rank_main(rank: int, world: int, data_path: str, out: str, repeats: int) -> None:
    """One gloo rank: warm up, then ``repeats`` timed sharded evaluations between barriers."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank, world_size=world)
    try:
        data = torch.load(data_path)
        warm_up()
        seconds, cpu, result = [], [], None
        for _ in range(repeats):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            result = evaluate(data, world)
            cpu.append(time.process_time() - start_cpu)
            dist.barrier()
            seconds.append(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()
    with open(f"{out}.rank{rank}", "wb") as f:
        pickle.dump({"seconds": seconds, "cpu": cpu, "result": result}, f)


def work_split(data: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Each of 2 ranks' block calls and the merge, timed one after the other in this process."""
    from rankwise.metrics import (
        merge_pr_curves,
        merge_retrieval_reports,
        pr_curve,
        query_share,
        retrieval_metrics,
    )

    x, y = data["embeddings"], data["labels"]
    blocks, merges, cpu, result = [], [], [], None
    for _ in range(repeats):
        seconds, cpu_seconds, reports, curves = [], [], [], []
        for rank in range(2):
            lo, hi = query_share(x.shape[0], rank, 2)
            rows = np.arange(lo, hi)
            start, start_cpu = time.perf_counter(), time.process_time()
            reports.append(retrieval_metrics(x[lo:hi], y[lo:hi], x, y, exclude_self=rows, ks=KS))
            curves.append(
                pr_curve(x[lo:hi], y[lo:hi], x, y, exclude_self=rows, keep_per_query=True)
            )
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - start_cpu)
        start, start_cpu = time.perf_counter(), time.process_time()
        merged_curve = merge_pr_curves(curves)
        result = (merge_retrieval_reports(reports), merged_curve)
        merges.append(time.perf_counter() - start)
        cpu.append(max(cpu_seconds) + time.process_time() - start_cpu)
        blocks.append(max(seconds))
    curve = result[1]
    curve.per_query_precision = None  # as sharded_curve returns it
    return {
        "seconds": [b + m for b, m in zip(blocks, merges, strict=True)],
        "cpu": cpu,
        "result": result,
    }


def worker(args: argparse.Namespace) -> None:
    """A fresh process: the 1-process evaluation, or the parent of the gloo ranks."""
    import torch

    if args.world == 0:  # the work split, one process
        torch.set_num_threads(1)
        data = torch.load(args.data)
        warm_up()
        with open(f"{args.out}.rank0", "wb") as f:
            pickle.dump(work_split(data, args.repeats), f)
        return
    if args.world == 1:
        torch.set_num_threads(args.threads)
        data = torch.load(args.data)
        warm_up()
        seconds, cpu, result = [], [], None
        for _ in range(args.repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            result = evaluate(data, 1)
            cpu.append(time.process_time() - start_cpu)
            seconds.append(time.perf_counter() - start)
        with open(f"{args.out}.rank0", "wb") as f:
            pickle.dump({"seconds": seconds, "cpu": cpu, "result": result}, f)
        return
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(args.world, args.data, args.out, args.repeats), nprocs=args.world)


def run_config(data: Path, out: Path, world: int, threads: int, repeats: int) -> list[dict]:
    """Run one configuration in fresh processes; every rank's timings and result."""
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    command = [sys.executable, __file__, "--worker", "--data", str(data), "--out", str(out)]
    command += ["--world", str(world), "--threads", str(threads), "--repeats", str(repeats)]
    subprocess.run(command, check=True, env=env)
    ranks = []
    for rank in range(max(world, 1)):
        with open(f"{out}.rank{rank}", "rb") as f:
            ranks.append(pickle.load(f))
    return ranks


WORK_SPLIT = "work split: slowest rank's block + merge, timed in 1 process"
SPIN = "import time\nt = time.perf_counter()\nfor i in range(20_000_000): pass\nprint(time.perf_counter() - t)"


def parallel_capacity() -> float:
    """How many cores' worth two concurrent CPU-bound processes get (2.0 on two idle cores)."""
    alone = float(
        subprocess.run(
            [sys.executable, "-c", SPIN], capture_output=True, text=True, check=True
        ).stdout
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    together = max(float(p.communicate()[0]) for p in procs)
    return 2.0 * alone / together


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, field by field and bit for bit (NaN equal to NaN)."""
    if hasattr(a, "__dataclass_fields__"):
        if type(a) is not type(b):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        return [
            d
            for n in a.__dataclass_fields__
            for d in differences(getattr(a, n), getattr(b, n), f"{where}.{n}")
        ]
    if hasattr(a, "shape"):
        a_np, b_np = np.asarray(a), np.asarray(b)
        same = a_np.dtype == b_np.dtype and a_np.shape == b_np.shape
        return [] if same and np.array_equal(a_np, b_np, equal_nan=True) else [where]
    if isinstance(a, dict):
        if list(a) != list(b):
            return [where]
        return [d for k in a for d in differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return [where]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{where}[{i}]")
        ]
    if isinstance(a, float) and isinstance(b, float) and np.isnan(a) and np.isnan(b):
        return []
    return [] if a == b else [where]


def main() -> None:
    """Make the embeddings, time every configuration in fresh processes, report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--embeddings", choices=("untrained", "random"), default="untrained")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-docs", action="store_true", help="print only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "embeddings.pt"
        make_embeddings(args.embeddings, args.dim, data)
        capacity = [parallel_capacity()]
        configs = {"1 process, 1 thread": (1, 1), "2 processes, 1 thread each": (2, 1)}
        configs["1 process, 2 threads (reference)"] = (1, 2)
        configs[WORK_SPLIT] = (0, 1)
        runs = {
            name: run_config(data, Path(tmp) / f"run{i}", world, threads, args.repeats)
            for i, (name, (world, threads)) in enumerate(configs.items())
        }
        capacity.append(parallel_capacity())
    report(args, runs, capacity)


def report(args: argparse.Namespace, runs: dict[str, list[dict]], capacity: list[float]) -> None:
    """Print the table and the identity check; write the docs section."""
    single = runs["1 process, 1 thread"][0]["result"]
    rows, times = [], {}
    for name, ranks in runs.items():
        per_repeat = [max(r["seconds"][i] for r in ranks) for i in range(args.repeats)]
        cpu = min(max(r["cpu"][i] for r in ranks) for i in range(args.repeats))
        times[name] = min(per_repeat)
        diffs = sorted({d for r in ranks for d in differences(r["result"], single)})
        identical = "yes" if not diffs else "NO: " + ", ".join(diffs[:4])
        rows.append(
            f"| {name} | {min(per_repeat):.2f} | {statistics.median(per_repeat):.2f} | {cpu:.2f} "
            f"| {identical} |"
        )
    ratio = times["2 processes, 1 thread each"] / times["1 process, 1 thread"]
    split = times[WORK_SPLIT] / times["1 process, 1 thread"]
    report_, curve = single
    info = machine_info()
    lines = [
        SECTION,
        "",
        f"Leave-one-out evaluation of the Fashion-MNIST test split ({report_.n_queries} queries x "
        f"{report_.n_gallery} gallery items, {args.dim}-d embeddings of "
        + ("an untrained `small_cnn`" if args.embeddings == "untrained" else "N(0, 1) noise")
        + f"): `retrieval_metrics` (ks={KS}) and `pr_curve` in one process, against "
        "`sharded_metric` / `sharded_curve` on 2 gloo ranks that each rank half of the queries "
        "against the whole gallery and merge the reports. Wall time of the slowest rank, best "
        f'(and median) of {args.repeats}; "identical" compares every field of the report and '
        "curve on every rank with the 1-process run, bit for bit.",
        "",
        "| configuration | wall, best (s) | wall, median (s) | CPU of the slowest rank (s) "
        "| identical |",
        "|---|---:|---:|---:|---|",
        *rows,
        "",
        f"**2 processes / 1 process: {ratio:.2f}** (target <= {TARGET}); work split / 1 process: "
        f"{split:.2f} (the ratio on two idle cores, less the gather). mAP {report_.map:.4f}, "
        f"{curve.n_queries} curve queries. Parallel capacity of the machine during the run: "
        f"{capacity[0]:.2f} before, {capacity[1]:.2f} after (2.00 = two idle cores).",
        "",
        *(
            [
                "The machine lent less than two cores' worth to two processes during this run "
                "(other jobs were running), so the wall-time ratio measures its load, not the "
                "sharding; the CPU column and the work split are what the sharding does.",
                "",
            ]
            if min(capacity) < LOADED
            else []
        ),
        f"Command: `python benchmarks/bench_sharded_eval.py --embeddings {args.embeddings} "
        f"--repeats {args.repeats}`; "
        f"{time.strftime('%Y-%m-%d')}, {info['cpu']} ({info['cores']} cores), torch "
        f"{info['torch']}.",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_docs:
        write_section(REPO / "docs" / "benchmarks.md", text, SECTION)


if __name__ == "__main__":
    main()
