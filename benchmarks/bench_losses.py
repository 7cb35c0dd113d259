"""Speed and memory of the rankwise ranking losses beside their pytorch-metric-learning peers.

Times forward + backward of every loss in ``rankwise.losses.LOSSES`` (built with
``rankwise.losses.build_loss``) and of pytorch-metric-learning's FastAP (Cakir et al., CVPR 2019,
Eq. 7), multi-similarity loss + miner (Wang et al., CVPR 2019, Eq. 12 and Eq. 4-5) and triplet
loss + batch-hard miner (Hermans et al., 2017, Eq. 5), called directly, on one P x K batch
(56 classes x 4 samples = 224, dimension 512, float32, CPU) in the same process with the calls
interleaved, so machine load affects every loss alike. It checks the target that the SOPRC
estimator (Wen et al., NeurIPS 2022, Alg. 1), the AP loss and the AUC loss (Gajić et al., Eq. 9)
are no slower than PML FastAP, counts the operations and host syncs of one step of each loss
(``rankwise._dispatch.DispatchCounter``: embeddings and buffers on the device, labels on the host,
as the data loader gives them; torch kernels on the host too, and those large enough to wake torch's
intra-op thread pool), times the label side every rankwise call shares (process CPU time, the host's
cost beside an accelerator; issue 36), and measures in fresh subprocesses the peak memory against the
batch size of Smooth-AP (Brown et al., ECCV 2020, Eq. 5; ours vs PML's ``SmoothAPLoss``) and of
ROADMAP (Ramzi et al., NeurIPS 2021) and the Recall@k surrogate (Patel et al., CVPR 2022) beside
PML FastAP, and the largest batch whose Recall@k surrogate call stays within a memory budget
(2 GiB), the large-batch regime of that paper.

Usage::

    python benchmarks/bench_losses.py            # full run, rewrites the "## Losses" section of
                                                 # docs/benchmarks.md
    python benchmarks/bench_losses.py --quick    # smoke run, prints the section only
    python benchmarks/bench_losses.py --budget-mib 0   # full run without the largest-batch search
    python benchmarks/bench_losses.py --device cuda   # the same timings on a GPU, written to
                                                      # the "## Losses on cuda" section (no
                                                      # memory sweep: it measures CPU RSS)
    python benchmarks/bench_losses.py --losses soprc ap auc --threads 16   # these rankwise
                                                      # losses only, beside the PML ones
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _report import cpu_name
from rankwise._dispatch import PARALLEL_GRAIN, DispatchCounter

SECTION_START = "<!-- losses:start -->"
SECTION_END = "<!-- losses:end -->"
SECTION_HEADING = "## Losses"


def section_markers(device: str) -> tuple[str, str, str]:
    """(heading, start marker, end marker) of the section of ``device`` (``"cpu"``: the default)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return SECTION_HEADING, SECTION_START, SECTION_END
    return (
        f"{SECTION_HEADING} on {kind}",
        f"<!-- losses-{kind}:start -->",
        f"<!-- losses-{kind}:end -->",
    )


DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
# Losses the speed target is about, and the reference they must not be slower than.
TARGET_LOSSES = ("soprc", "ap", "auc")
TARGET_REFERENCE = "PML FastAPLoss"
SMOOTH_AP_IMPLEMENTATIONS = ("rankwise", "pml")
# the rank surrogates of issue 33 beside the PML loss the timing target compares against
SURROGATE_IMPLEMENTATIONS = ("roadmap", "recall_at_k", "pml_fastap")
MEMORY_LABELS = {
    "rankwise": "rankwise SmoothAPLoss",
    "pml": "PML SmoothAPLoss",
    "roadmap": "rankwise ROADMAPLoss",
    "recall_at_k": "rankwise RecallAtKLoss",
    "pml_fastap": "PML FastAPLoss",
}
# the loss whose largest batch within --budget-mib is searched
LARGE_BATCH_LOSS = "recall_at_k"


@dataclass
class Case:
    """One timed loss: ``run(embeddings, labels)`` returns the scalar loss."""

    name: str
    source: str
    run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    error: str | None = None


def pk_labels(n_classes: int, m: int) -> torch.Tensor:
    """Class-contiguous P x K labels ``[0]*m + [1]*m + ...``, the layout PML's Smooth-AP needs."""
    return torch.arange(n_classes).repeat_interleave(m)


def sop_like_train_labels(n_classes: int, seed: int) -> np.ndarray:
    """Training labels shaped like Stanford Online Products (2 to 12 images per class)."""
    rng = np.random.default_rng(seed)
    return np.repeat(np.arange(n_classes), rng.integers(2, 13, size=n_classes))


def rankwise_cases(
    train_labels: np.ndarray, dim: int, names: list[str] | None = None
) -> list[Case]:
    """Every loss of the registry (or ``names``); one that fails to build is reported, not skipped."""
    from rankwise.losses import BASELINES, LOSSES, build_loss

    if not LOSSES:
        return [Case("rankwise.losses.LOSSES", "rankwise", None, f"LOSSES is {LOSSES!r}")]
    cases = []
    for name in LOSSES if names is None else names:
        # XBM past its warm-up (75 calls by default): the memory form is what is timed
        params = {"start_iteration": 0} if name == "xbm" else {}
        try:
            loss = build_loss(name, train_labels=train_labels, embedding_dim=dim, **params)
        except Exception as exc:  # reported in the table and in the exit status
            cases.append(Case(name, "rankwise", None, f"build failed: {type(exc).__name__}: {exc}"))
            continue
        source = "rankwise (PML wrapper)" if name in BASELINES else "rankwise"
        cases.append(Case(name, source, loss))
    return cases


def pml_cases() -> list[Case]:
    """PML losses called directly (no rankwise wrapper), with their usual miners."""
    from pytorch_metric_learning import losses, miners

    fastap = losses.FastAPLoss()
    multi_similarity, ms_miner = losses.MultiSimilarityLoss(), miners.MultiSimilarityMiner()
    triplet, batch_hard = losses.TripletMarginLoss(), miners.BatchHardMiner()
    return [
        Case(TARGET_REFERENCE, "PML", fastap),
        Case(
            "PML MultiSimilarityLoss + MultiSimilarityMiner",
            "PML",
            lambda e, y: multi_similarity(e, y, ms_miner(e, y)),
        ),
        Case(
            "PML TripletMarginLoss + BatchHardMiner",
            "PML",
            lambda e, y: triplet(e, y, batch_hard(e, y)),
        ),
    ]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cases_to(cases: list[Case], device: torch.device) -> None:
    """Move the losses (modules holding state, e.g. SOPRC's per-class buffers) to ``device``."""
    for case in cases:
        if isinstance(case.run, torch.nn.Module):
            case.run.to(device)


def time_cases(
    cases: list[Case],
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    repeats: int,
    warmup: int,
    cpu_times: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per forward + backward for every runnable case, calls interleaved across cases.

    ``cpu_times``, when given, receives the process CPU seconds of each timed call: on a machine
    shared with other jobs the wall clock also counts the time the process waited for a core.
    """
    times: dict[str, list[float]] = {c.name: [] for c in cases if c.run is not None}
    if cpu_times is not None:
        cpu_times.update({name: [] for name in times})
    leaf = embeddings.detach().clone().requires_grad_(True)
    for round_index in range(warmup + repeats):
        for case in cases:
            if case.run is None:
                continue
            leaf.grad = None
            try:
                _synchronize(leaf.device)
                start, start_cpu = time.perf_counter(), time.process_time()
                case.run(leaf, labels).backward()
                _synchronize(leaf.device)
                elapsed = time.perf_counter() - start
                elapsed_cpu = time.process_time() - start_cpu
            except Exception as exc:  # reported in the table and in the exit status
                case.error = f"call failed: {type(exc).__name__}: {exc}"
                case.run = None
                times.pop(case.name, None)
                if cpu_times is not None:
                    cpu_times.pop(case.name, None)
                continue
            if round_index >= warmup:
                times[case.name].append(elapsed)
                if cpu_times is not None:
                    cpu_times[case.name].append(elapsed_cpu)
    return times


def time_label_side(labels: torch.Tensor, repeats: int) -> float:
    """Median process CPU seconds of the label side every rankwise loss call shares.

    The host structure of the batch's label pattern (``BatchLayout.from_labels``, the pattern
    seen before) and the one packed copy of its masks and labels an accelerator receives
    (``to_device(..., pack=True)``, here onto the CPU): host work only, which on a GPU machine is
    what the call costs the host's cores beside launching kernels.
    """
    from rankwise._dispatch import to_device
    from rankwise.losses.base import BatchLayout

    BatchLayout.from_labels(labels, labels, True)
    seconds = []
    for _ in range(max(repeats, 1) * 10):
        start = time.process_time()
        layout = BatchLayout.from_labels(labels, labels, True)
        to_device(
            [layout.pos_mask, layout.neg_mask, labels, labels, layout.valid],
            torch.device("cpu"),
            pack=True,
        )
        seconds.append(time.process_time() - start)
    return statistics.median(seconds)


def count_cases(
    cases: list[Case], embeddings: torch.Tensor, labels: torch.Tensor
) -> dict[str, DispatchCounter]:
    """One more forward + backward of every runnable case under a :class:`DispatchCounter`.

    The embeddings and the case's buffers (SOPRC's v, XBM's memory) count as device data, the
    labels as host data: the counter's device syncs are what would stall an accelerator.
    """
    counts: dict[str, DispatchCounter] = {}
    for case in cases:
        if case.run is None:
            continue
        leaf = embeddings.detach().clone().requires_grad_(True)
        buffers = list(case.run.buffers()) if isinstance(case.run, torch.nn.Module) else []
        with DispatchCounter() as counter:
            counter.mark_device(leaf, *buffers)
            case.run(leaf, labels).backward()
        counts[case.name] = counter
    return counts


# -- peak memory, one fresh subprocess per (implementation, batch size) -------------------------
def _proc_status_bytes(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process from /proc (Linux), or None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's resident high-water mark (Linux >= 4.0, ``clear_refs`` value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _proc_status_bytes("VmHWM") is not None


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def _memory_loss(implementation: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss of a memory probe (a key of ``MEMORY_LABELS``), with its default settings."""
    if implementation in ("pml", "pml_fastap"):
        from pytorch_metric_learning import losses

        return losses.SmoothAPLoss() if implementation == "pml" else losses.FastAPLoss()
    from rankwise.losses import build_loss

    return build_loss("smooth_ap" if implementation == "rankwise" else implementation)


def memory_probe(implementation: str, batch_size: int, m: int, dim: int) -> dict[str, float]:
    """Run in a fresh process: peak resident-memory growth of one forward + backward of a loss.

    Imports, the loss, the inputs and a warm-up call on a batch of 2 classes (which loads the
    kernels) come first; then the resident high-water mark is reset to the current resident size,
    so its growth during the call is the call's own peak: intermediates and autograd's saved
    tensors. Where the mark cannot be reset, ``ru_maxrss`` is used and the number is an upper
    bound when the call stayed below the process's earlier peak.
    """
    loss = _memory_loss(implementation)
    generator = torch.Generator().manual_seed(0)
    warm = torch.randn(2 * m, dim, generator=generator, requires_grad=True)
    loss(warm, pk_labels(2, m)).backward()
    embeddings = torch.randn(batch_size, dim, generator=generator, requires_grad=True)
    labels = pk_labels(batch_size // m, m)
    exact = _reset_peak_rss()
    if exact:
        rss_before = peak_before = _proc_status_bytes("VmRSS")
    else:
        rss_before = _proc_status_bytes("VmRSS") or _ru_maxrss_bytes()
        peak_before = _ru_maxrss_bytes()
    start = time.perf_counter()
    loss(embeddings, labels).backward()
    elapsed = time.perf_counter() - start
    peak_after = _proc_status_bytes("VmHWM") if exact else _ru_maxrss_bytes()
    return {
        "peak_growth_mib": max(0, peak_after - rss_before) / 2**20,
        "upper_bound": (not exact) and peak_after <= peak_before,
        "seconds": elapsed,
    }


def run_probe(
    implementation: str, batch_size: int, m: int, dim: int, threads: int
) -> dict[str, float] | str:
    """:func:`memory_probe` in a fresh subprocess: its result, or the error's last line."""
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--memory-probe",
        implementation,
        "--probe-batch",
        str(batch_size),
        "--m",
        str(m),
        "--dim",
        str(dim),
        "--threads",
        str(threads),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"probe failed: {tail}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_memory(
    batch_sizes: list[int],
    m: int,
    dim: int,
    threads: int,
    implementations: tuple[str, ...] = SMOOTH_AP_IMPLEMENTATIONS,
) -> dict[tuple[str, int], dict[str, float] | str]:
    """Peak memory per (implementation, batch size), one fresh subprocess each."""
    results: dict[tuple[str, int], dict[str, float] | str] = {}
    for batch_size in batch_sizes:
        for implementation in implementations:
            results[(implementation, batch_size)] = run_probe(
                implementation, batch_size, m, dim, threads
            )
    return results


def largest_batch_within(
    budget_mib: float, m: int, dim: int, threads: int, resolution: int = 256, start: int = 1024
) -> dict[str, Any]:
    """The largest batch within ``budget_mib`` MiB for ``LARGE_BATCH_LOSS`` (doubling, bisection).

    The batch is a multiple of ``resolution`` whose forward + backward grows the peak resident
    memory by at most ``budget_mib``; the search doubles from ``start``, then bisects.
    Returns the largest batch that fits and its probe, the smallest that does not and its probe,
    and every probe made (batch -> MiB or the error).
    """
    probes: dict[int, dict[str, float] | str] = {}

    def fits(batch: int) -> bool:
        probes[batch] = run_probe(LARGE_BATCH_LOSS, batch, m, dim, threads)
        result = probes[batch]
        return isinstance(result, dict) and result["peak_growth_mib"] <= budget_mib

    low, high = 0, start
    while high <= 2**17 and fits(high):  # 2**17: a (B, B) float32 block of 64 GiB
        low, high = high, 2 * high
    while high - low > resolution:
        middle = (low + high) // 2 // resolution * resolution
        low, high = (middle, high) if fits(middle) else (low, middle)
    return {
        "budget_mib": budget_mib,
        "largest": low,
        "largest_probe": probes.get(low),
        "too_large": high,
        "too_large_probe": probes[high],
        "probes": dict(sorted(probes.items())),
    }


# -- report ------------------------------------------------------------------------------------
def _fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def render_section(
    args: argparse.Namespace,
    cases: list[Case],
    times: dict[str, list[float]],
    memory: dict[tuple[str, int], dict[str, float] | str],
    n_train_classes: int,
    surrogate_memory: dict[tuple[str, int], dict[str, float] | str] | None = None,
    largest: dict[str, Any] | None = None,
    counts: dict[str, DispatchCounter] | None = None,
    load: tuple[float, float] | None = None,
    cpu_times: dict[str, list[float]] | None = None,
    label_side: float | None = None,
) -> tuple[str, list[str]]:
    """The markdown of the "## Losses" section, and the target check lines."""
    import pytorch_metric_learning

    medians = {name: statistics.median(v) for name, v in times.items() if v}
    reference = medians.get(TARGET_REFERENCE)
    cpu = {name: statistics.median(v) for name, v in (cpu_times or {}).items() if v}
    cpu_reference = cpu.get(TARGET_REFERENCE)
    # The heading stays outside the markers: the retrieval benchmark replaces its own section up
    # to the next "## " heading, which must not swallow the start marker.
    heading, start, end = section_markers(args.device)
    device_flag = "" if heading == SECTION_HEADING else f" --device {args.device}"
    lines = [
        heading,
        "",
        start,
        f"Generated by `python benchmarks/bench_losses.py{' --quick' if args.quick else ''}"
        f"{device_flag}{_flags(args)}` on "
        f"{time.strftime('%Y-%m-%d')}: torch {torch.__version__}, pytorch-metric-learning "
        f"{pytorch_metric_learning.__version__}, {cpu_name()}, "
        f"`torch.set_num_threads({torch.get_num_threads()})`"
        + (
            f", load average {load[0]:.1f} at the start and {load[1]:.1f} at the end "
            f"({os.cpu_count()} cores)."
            if load
            else "."
        ),
        "",
        f"### Forward + backward time, batch {args.classes * args.m} "
        f"({args.classes} classes x {args.m}), dimension {args.dim}, float32, "
        f"{_device_name(args.device)}",
        "",
        f"Median of {args.repeats} repeats after {args.warmup} warm-up call(s); the calls of all "
        "losses are interleaved in one process; the embeddings are 0.95 tanh of Gaussian values "
        "(inside (-1, 1), valid for the hashing losses too). rankwise losses come from "
        "`rankwise.losses.build_loss(name, train_labels=..., embedding_dim="
        f"{args.dim})` (SOPRC's per-class state sized by a {n_train_classes}-class "
        "training set shaped like Stanford Online Products); PML losses are called directly. "
        "Labels are on the host, as the data loader gives them (PML moves them to the device). "
        "The last two columns count one more step (forward + backward, training mode) with "
        "`rankwise._dispatch.DispatchCounter`: aten operations on the embeddings' side that are "
        "not views (kernel launches on an accelerator), and device syncs (`.item()`, `nonzero`, "
        "boolean-mask indexing, ... on data derived from the embeddings or the loss's buffers; "
        "on the labels they are host work, not counted). CPU ms is the process CPU time of "
        "the same calls (`time.process_time`), which leaves out the time spent waiting for a "
        "core on a shared machine. Host kernels are the torch operations of the same counted "
        "step on host data (the labels' bookkeeping, not views), and how many of them touch "
        f"{PARALLEL_GRAIN:,} elements or more, where torch may split the work over its intra-op "
        "thread pool, whose threads then spin on the host's cores (numpy work is not counted).",
        "",
        "| loss | source | median ms | min ms | ratio to PML FastAP | median CPU ms | CPU ratio "
        f"| device kernels | device syncs | host kernels | host kernels >= {PARALLEL_GRAIN:,} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    counts = counts or {}
    for case in cases:
        if case.name in medians:
            ratio = f"{medians[case.name] / reference:.2f}" if reference else "n/a"
            cpu_ms = _fmt_ms(cpu[case.name]) if case.name in cpu else "n/a"
            cpu_ratio = (
                f"{cpu[case.name] / cpu_reference:.2f}"
                if case.name in cpu and cpu_reference
                else "n/a"
            )
            counter = counts.get(case.name)
            ops = (
                f"{counter.n_kernels} | {counter.n_syncs} | {sum(counter.host_ops.values())} | "
                f"{sum(counter.parallel_host_ops.values())}"
                if counter
                else "n/a | n/a | n/a | n/a"
            )
            lines.append(
                f"| {case.name} | {case.source} | {_fmt_ms(medians[case.name])} | "
                f"{_fmt_ms(min(times[case.name]))} | {ratio} | {cpu_ms} | {cpu_ratio} | {ops} |"
            )
        else:
            lines.append(f"| {case.name} | {case.source} | {case.error} | | | | | | | | |")

    checks = []
    for name in TARGET_LOSSES:
        if name in medians and reference:
            ratio = medians[name] / reference
            verdict = "met" if ratio <= 1.0 else "NOT met"
            cpu_note = (
                f"; CPU time ratio {cpu[name] / cpu_reference:.2f}"
                if name in cpu and cpu_reference
                else ""
            )
            checks.append(
                f"target: {name} no slower than {TARGET_REFERENCE}: time ratio {ratio:.2f} "
                f"({_fmt_ms(medians[name])} ms vs {_fmt_ms(reference)} ms{cpu_note}) -- {verdict}"
            )
        else:
            checks.append(f"target: {name} no slower than {TARGET_REFERENCE}: not measured")
    for name in (*TARGET_LOSSES, TARGET_REFERENCE):
        if name in counts:
            counter = counts[name]
            checks.append(
                f"counts: {name}: {counter.summary()}; host kernels "
                f"{dict(counter.host_ops) or 'none'}, of >= {PARALLEL_GRAIN:,} elements "
                f"{dict(counter.parallel_host_ops) or 'none'}"
            )
    if label_side is not None:
        lines += [
            "",
            f"Label side of every rankwise call (the host structure of the repeated label pattern "
            f"and the packed copy of its masks and labels an accelerator receives, "
            f"`time_label_side`): {label_side * 1e3:.3f} ms of process CPU per call (median of "
            f"{max(args.repeats, 1) * 10}).",
        ]
    lines += ["", "Target: SOPRC, AP and AUC losses no slower than PML FastAP.", ""]
    lines += [f"- {c}" for c in checks]
    if args.memory_batch_sizes:
        lines += _memory_lines(args, memory)
    if args.surrogate_batch_sizes:
        lines += _surrogate_lines(args, surrogate_memory or {}, largest)
    lines.append(end)
    return "\n".join(lines) + "\n", checks


def _memory_table(
    implementations: tuple[str, ...],
    batch_sizes: list[int],
    memory: dict[tuple[str, int], dict[str, float] | str],
) -> list[str]:
    """Rows of MiB and one-call ms per batch size, then the growth exponent of each column."""
    names = [MEMORY_LABELS[i] for i in implementations]
    lines = [
        "| batch | " + " | ".join(f"{n} MiB" for n in names) + " | "
        + " | ".join(f"{n} ms (1 call)" for n in names) + " |",
        "|---:|" + "---:|" * (2 * len(names)),
    ]  # fmt: skip
    for batch_size in batch_sizes:
        cells_mem, cells_time = [], []
        for implementation in implementations:
            result = memory.get((implementation, batch_size))
            if isinstance(result, dict):
                prefix = "<= " if result["upper_bound"] else ""
                cells_mem.append(f"{prefix}{result['peak_growth_mib']:.1f}")
                cells_time.append(_fmt_ms(result["seconds"]))
            else:
                cells_mem.append(str(result))
                cells_time.append("")
        lines.append(f"| {batch_size} | {' | '.join(cells_mem)} | {' | '.join(cells_time)} |")
    exponents = []
    for implementation in implementations:
        first, last = (
            memory.get((implementation, batch_sizes[0])),
            memory.get((implementation, batch_sizes[-1])),
        )
        if (
            len(batch_sizes) > 1
            and isinstance(first, dict)
            and isinstance(last, dict)
            and min(first["peak_growth_mib"], last["peak_growth_mib"]) > 0
        ):
            slope = np.log(last["peak_growth_mib"] / first["peak_growth_mib"]) / np.log(
                batch_sizes[-1] / batch_sizes[0]
            )
            exponents.append(f"{MEMORY_LABELS[implementation]} ~ B^{slope:.2f}")
    if exponents:
        lines += [
            "",
            f"Growth from batch {batch_sizes[0]} to {batch_sizes[-1]}: {', '.join(exponents)} "
            "(memory ~ B^k; small batches are dominated by fixed overheads, so k is an "
            "underestimate).",
        ]
    return lines


_PROBE_METHOD = (
    "Each cell is one forward + backward in a fresh subprocess, after imports, input "
    "creation and a warm-up call on 2 classes: the growth of the peak resident set size "
    "during the call (`VmHWM` reset to the current size through `/proc/self/clear_refs` "
    "just before it; `ru_maxrss` where that is unavailable, `<=` marking an upper bound). "
    "This counts every byte the call really touches at its peak (intermediates and "
    "autograd's saved tensors), which `torch.profiler`'s per-operator allocation counts do "
    "not add up to."
)


def _memory_lines(
    args: argparse.Namespace, memory: dict[tuple[str, int], dict[str, float] | str]
) -> list[str]:
    """The Smooth-AP peak-memory table (CPU resident memory)."""
    lines = [
        "",
        f"### Smooth-AP peak memory vs batch size (m = {args.m}, dimension {args.dim})",
        "",
        _PROBE_METHOD + " PML's Smooth-AP materialises (B, B, B) tensors; ours works on (anchor, "
        "positive, reference) triples, B x (m - 1) x B for a fixed m.",
        "",
    ]
    return lines + _memory_table(SMOOTH_AP_IMPLEMENTATIONS, args.memory_batch_sizes, memory)


def _surrogate_lines(
    args: argparse.Namespace,
    memory: dict[tuple[str, int], dict[str, float] | str],
    largest: dict[str, Any] | None,
) -> list[str]:
    """The ROADMAP / Recall@k / PML FastAP memory table and the largest Recall@k batch."""
    lines = [
        "",
        f"### ROADMAP and Recall@k surrogate peak memory vs batch size, beside PML FastAP "
        f"(m = {args.m}, dimension {args.dim})",
        "",
        _PROBE_METHOD + " ROADMAP and Recall@k hold the (B, B) scores and masks and build their "
        "(anchor-positive pair, reference) differences in blocks of at most 2^22 entries, "
        "recomputed in the backward pass; PML FastAP builds (bins + 1, B, B) histogram tensors.",
        "",
    ]
    lines += _memory_table(SURROGATE_IMPLEMENTATIONS, args.surrogate_batch_sizes, memory)
    if largest is not None:
        lines += ["", _largest_batch_line(args, largest)]
    return lines


def _largest_batch_line(args: argparse.Namespace, largest: dict[str, Any]) -> str:
    """The sentence stating the largest Recall@k batch within the budget, with its probes."""
    fit, over = largest["largest_probe"], largest["too_large_probe"]
    probes = ", ".join(
        f"{b}: {r['peak_growth_mib']:.0f} MiB" if isinstance(r, dict) else f"{b}: {r}"
        for b, r in largest["probes"].items()
    )
    fit_text = (
        f"{fit['peak_growth_mib']:.0f} MiB, {fit['seconds']:.1f} s for the call"
        if isinstance(fit, dict)
        else str(fit)
    )
    over_text = f"{over['peak_growth_mib']:.0f} MiB" if isinstance(over, dict) else str(over)
    return (
        f"**Recall@k surrogate, large batches:** the largest batch (a multiple of 256, "
        f"{args.m} samples per class, dimension {args.dim}, float32, CPU) whose forward + "
        f"backward grows the peak resident memory by at most {largest['budget_mib']:.0f} MiB "
        f"is **{largest['largest']}** ({fit_text}); {largest['too_large']} takes {over_text}. "
        f"Probes (doubling from 1024, then bisection): {probes}."
    )


def _flags(args: argparse.Namespace) -> str:
    """The options of this run that change its numbers (threads, repeats), as typed."""
    flags = "" if args.threads is None else f" --threads {args.threads}"
    if args.losses:
        flags += " --losses " + " ".join(args.losses)
    if args.repeats != (3 if args.quick else 30):
        flags += f" --repeats {args.repeats}"
    return flags


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"CUDA ({torch.cuda.get_device_name(torch.device(device))})"
    return "CPU" if torch.device(device).type == "cpu" else device


def write_section(path: Path, section: str, device: str = "cpu") -> None:
    """Replace the losses section of ``device`` (heading and marked text), or append it.

    The rest of the file is kept.
    """
    heading, start, end = section_markers(device)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(
        rf"(^{re.escape(heading)}\n+)?{re.escape(start)}.*?{re.escape(end)}\n?",
        re.S | re.M,
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options, validated."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: few repeats, small memory sweep, print only",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per loss")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls per loss first")
    parser.add_argument("--classes", type=int, default=56, help="classes per batch")
    parser.add_argument("--m", type=int, default=4, help="samples per class")
    parser.add_argument("--dim", type=int, default=512, help="embedding dimension")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads value (default: torch's own choice)",
    )
    parser.add_argument(
        "--memory-batch-sizes",
        type=int,
        nargs="*",
        default=None,
        help="batch sizes of the Smooth-AP memory sweep (multiples of --m)",
    )
    parser.add_argument(
        "--surrogate-batch-sizes",
        type=int,
        nargs="*",
        default=None,
        help="batch sizes of the ROADMAP / Recall@k / PML FastAP memory sweep (multiples of --m)",
    )
    parser.add_argument(
        "--budget-mib",
        type=float,
        default=None,
        help="search the largest Recall@k batch within this peak-memory growth (default 2048; "
        "--quick and 0: no search)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"markdown file to update (default {DEFAULT_OUTPUT}; --quick: none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--losses",
        nargs="+",
        default=None,
        help="time only these rankwise losses (names of rankwise.losses.LOSSES) beside the PML "
        "losses (default: all)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="device of the timed calls (cpu, cuda, ...); off the CPU the memory sweeps and the "
        "largest-batch search (CPU resident memory) are skipped and the section is "
        "'## Losses on <device type>'",
    )
    parser.add_argument(
        "--memory-probe", choices=tuple(MEMORY_LABELS), default=None, help=argparse.SUPPRESS
    )
    parser.add_argument("--probe-batch", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _fill_defaults(args)
    _check(parser, args)
    return args


def _fill_defaults(args: argparse.Namespace) -> None:
    """The defaults that depend on --quick and --device."""
    if args.repeats is None:
        args.repeats = 3 if args.quick else 30
    if args.warmup is None:
        args.warmup = 1 if args.quick else 5
    if args.memory_batch_sizes is None:
        args.memory_batch_sizes = [64, 128] if args.quick else [64, 128, 224, 448]
    if args.surrogate_batch_sizes is None:
        args.surrogate_batch_sizes = [64, 128] if args.quick else [224, 448, 896, 1792]
    if args.budget_mib is None:
        args.budget_mib = 0.0 if args.quick else 2048.0
    if torch.device(args.device).type != "cpu":
        args.memory_batch_sizes, args.surrogate_batch_sizes, args.budget_mib = [], [], 0.0
    if args.output is None and not args.quick:
        args.output = DEFAULT_OUTPUT


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse values the measurements cannot use (parser.error exits)."""
    for name in ("repeats", "classes", "m", "dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if args.classes < 2:
        parser.error("--classes must be >= 2 (ranking needs negatives)")
    if args.losses:
        from rankwise.losses import LOSSES

        unknown = [name for name in args.losses if name not in LOSSES]
        if unknown:
            parser.error(f"--losses {unknown}: not in rankwise.losses.LOSSES {sorted(LOSSES)}")
    for option in ("memory_batch_sizes", "surrogate_batch_sizes"):
        bad = [b for b in getattr(args, option) if b < 2 * args.m or b % args.m]
        if bad:
            flag = "--" + option.replace("_", "-")
            parser.error(f"{flag} {bad}: each must be a multiple of --m and >= 2 * m")
    if args.budget_mib < 0 or (args.budget_mib and 256 % args.m):
        parser.error("--budget-mib must be >= 0 (0: no search), with --m dividing 256")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; the exit status is 1 when a measurement failed."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.memory_probe is not None:
        print(json.dumps(memory_probe(args.memory_probe, args.probe_batch, args.m, args.dim)))
        return 0

    n_train_classes = 11318  # Stanford Online Products training classes
    train_labels = sop_like_train_labels(n_train_classes, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    device = torch.device(args.device)
    # inside (-1, 1), as the common loss tests use: valid for every registered loss, the TALR
    # hashing losses included (they take relaxed codes, tanh outputs, and refuse the rest)
    gaussian = torch.randn(args.classes * args.m, args.dim, generator=generator)
    embeddings = (0.95 * torch.tanh(gaussian)).to(device)
    labels = pk_labels(args.classes, args.m)  # on the host, as a data loader gives them

    cases = rankwise_cases(train_labels, args.dim, args.losses) + pml_cases()
    cases_to(cases, device)
    load_start = os.getloadavg()[0]
    cpu_times: dict[str, list[float]] = {}
    times = time_cases(cases, embeddings, labels, args.repeats, args.warmup, cpu_times)
    load = (load_start, os.getloadavg()[0])
    counts = count_cases(cases, embeddings, labels)
    label_side = time_label_side(labels, args.repeats)
    threads = torch.get_num_threads()
    memory = measure_memory(args.memory_batch_sizes, args.m, args.dim, threads)
    surrogate_memory = measure_memory(
        args.surrogate_batch_sizes, args.m, args.dim, threads, SURROGATE_IMPLEMENTATIONS
    )
    largest = (
        largest_batch_within(args.budget_mib, args.m, args.dim, threads)
        if args.budget_mib
        else None
    )
    section, checks = render_section(
        args,
        cases,
        times,
        memory,
        n_train_classes,
        surrogate_memory,
        largest,
        counts=counts,
        load=load,
        cpu_times=cpu_times,
        label_side=label_side,
    )

    print(section)
    for line in checks:
        print(line)
    failures = [c for c in cases if c.error] + [
        v for v in (*memory.values(), *surrogate_memory.values()) if isinstance(v, str)
    ]
    if failures:
        print(
            f"{len(failures)} measurement(s) failed (see the table); "
            f"{'not writing ' + str(args.output) if args.output else 'nothing written'}.",
            file=sys.stderr,
        )
        return 1
    if args.output is not None:
        write_section(args.output, section, args.device)
        print(f"wrote the losses section of {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
