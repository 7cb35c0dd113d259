"""Benchmark of exact retrieval evaluation against argsort, PML and torchmetrics baselines.

rankwise's tie-aware ``retrieval_metrics`` against a chunked argsort baseline,
pytorch-metric-learning's ``AccuracyCalculator`` and torchmetrics' ``RetrievalMAP``.

The metrics are the tie-aware AP_T of He et al., *Hashing as Tie-Aware Learning to Rank* (CVPR 2018,
Prop. 1, Eq. 6 as corrected in docs/errata.md), recall@k and MAP@R (Musgrave et al., ECCV 2020),
on the leave-one-out protocol of Stanford Online Products used by the SOPRC paper (Wen et al.,
NeurIPS 2022, Table 1). Every method runs in a fresh subprocess so that its peak resident memory
(``ru_maxrss``) is its own; a "data only" subprocess measures what generating the embeddings costs.

    python benchmarks/bench_retrieval.py --sizes quick    # smoke test, about a minute
    python benchmarks/bench_retrieval.py --sizes mid      # a third of SOP, a few minutes
    python benchmarks/bench_retrieval.py --sizes full     # SOP-sized, a few minutes on 2 cores

Results go to the "## Retrieval evaluation" section of ``docs/benchmarks.md`` (other sections of
that file are kept). pytorch-metric-learning's ``AccuracyCalculator`` rows need faiss (the
``faiss-cpu`` package); without it they are skipped with a note.

    python benchmarks/bench_retrieval.py --device cuda --sizes full
    python benchmarks/bench_retrieval.py --device cpu --sizes quick

``--device`` instead compares, on that device and in one process, rankwise's torch backend
(``retrieval_metrics(..., backend="torch")``: exact, tie-aware) with a chunked torch argsort + AP
(not tie-aware) on the same queries, in issue 31's three regimes (SOP-like many classes, an
iNaturalist-like case, few classes; the issue's sizes with ``--sizes full``), prints the kernels,
host syncs and numpy / numba calls per chunk of both and their number of chunks (counted by
``rankwise._dispatch_count``), and writes the "## Retrieval evaluation: torch backend on
<device>" section.

``--degenerate`` times degenerate embeddings on one thread (``torch.set_num_threads(1)``, numba
likewise): 30 distinct rows each repeated 100 times and all rows identical (a collapsed model),
beside distinct rows as a control, leave-one-out, d = 64, 300 classes, cosine (N = 3,000 with
``--sizes mid`` or ``full``, 600 with ``quick``). rankwise's torch and numba backends are given
as ratios to a plain ``torch.argsort`` of the same float32 score matrix (and to the chunked
argsort + AP); the section is "## Retrieval evaluation: degenerate embeddings (one thread)".

    python benchmarks/bench_retrieval.py --degenerate --sizes full
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from _report import machine_info, peak_rss_mb, write_section

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Retrieval evaluation"

# Case sizes. "sop": SOP-like leave-one-out (classes of 5-6 items); "few": few large classes;
# "tm": a query x gallery evaluation small enough for torchmetrics' per-query loop.
SIZES: dict[str, dict[str, Any]] = {
    "quick": {
        "sop": {"n": 6_000, "classes": 1_100, "dim": 128, "noise": 1.5, "baseline_queries": 1_000},
        "pml_full_k": [1_000, 2_000],
        "few": {"n": 4_000, "classes": 10, "dim": 128, "noise": 3.0},
        "tm": {"n": 500, "classes": 50, "dim": 64, "noise": 1.5, "code_bits": 16},
    },
    "mid": {
        "sop": {"n": 20_000, "classes": 3_667, "dim": 128, "noise": 1.5, "baseline_queries": 2_000},
        "pml_full_k": [1_000, 2_000],
        "few": {"n": 10_000, "classes": 10, "dim": 128, "noise": 3.0},
        "tm": {"n": 1_000, "classes": 50, "dim": 64, "noise": 1.5, "code_bits": 16},
    },
    "full": {
        "sop": {
            "n": 60_000,
            "classes": 11_000,
            "dim": 128,
            "noise": 1.5,
            "baseline_queries": 3_000,
        },
        "pml_full_k": [2_500, 5_000],
        "few": {"n": 20_000, "classes": 10, "dim": 128, "noise": 3.0},
        "tm": {"n": 2_000, "classes": 100, "dim": 64, "noise": 1.5, "code_bits": 16},
    },
}
# --device: many-class cases with fewer classes than SOP (the regime the issue names, ~1,600+)
DEVICE_MANY = {"quick": (6_000, 1_100), "mid": (10_000, 1_833), "full": (60_000, 11_000)}
# --device: the iNaturalist-sized case (issue 31) scaled alike (classes of ~24)
DEVICE_INAT = {"quick": (13_600, 569), "mid": (34_000, 1_423), "full": (136_000, 5_690)}
KS = (1, 10, 100)
# profiler range of one chunk of the argsort baseline (its operations are counted like ours)
BASELINE_CHUNK = "bench.argsort.chunk"
# --degenerate: N per --sizes, and the cases (distinct rows, each repeated how often)
DEGENERATE_N = {"quick": 600, "mid": 3_000, "full": 3_000}
DEGENERATE_CASES = {
    "distinct": "distinct rows (control)",
    "repeated": "30 distinct rows × {copies}",
    "identical": "all rows identical",
}
DEGENERATE_SECTION = "## Retrieval evaluation: degenerate embeddings (one thread)"


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


def clustered_embeddings(n: int, classes: int, dim: int, noise: float, seed: int = 0):
    """L2-normalized Gaussian clusters with class sizes as equal as possible (SOP: 5 or 6)."""
    rng = np.random.default_rng(seed)
    sizes = np.full(classes, n // classes)
    sizes[: n - int(sizes.sum())] += 1
    labels = rng.permutation(np.repeat(np.arange(classes), sizes))
    centers = rng.standard_normal((classes, dim), dtype=np.float32)
    x = centers[labels] + noise * rng.standard_normal((n, dim), dtype=np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, labels.astype(np.int64)


def baseline_query_subset(n: int, size: int) -> np.ndarray:
    """Sorted, seeded random subset of ``size`` query rows out of ``n``."""
    return np.sort(np.random.default_rng(1).choice(n, size=min(n, size), replace=False))


# ----------------------------------------------------------------------------------------------
# the argsort baseline
# ----------------------------------------------------------------------------------------------


def argsort_retrieval(
    x, labels, query_rows, ks=KS, chunk_bytes=256 * 2**20, device=None
) -> dict[str, float]:
    """Exact leave-one-out mAP / R@k / MAP@R by sorting every score row (no tie handling).

    Queries are processed in chunks; each chunk's (b, n) score block is argsorted and the
    relevance of the sorted items gives precision at every relevant position.
    """
    import torch

    x = torch.as_tensor(x, device=device)
    labels = torch.as_tensor(labels, device=x.device)
    query_rows = torch.as_tensor(query_rows, device=x.device)
    n = x.shape[0]
    # score block + sort indices + relevance + cumulative counts + precision: ~ 32 bytes per entry
    chunk = max(1, chunk_bytes // (32 * n))
    positions = torch.arange(1, n, dtype=torch.float64, device=x.device)
    ap, map_at_r = [], []
    hits = {k: [] for k in ks}
    for start in range(0, query_rows.shape[0], chunk):
        with torch.profiler.record_function(BASELINE_CHUNK):
            _argsort_chunk(
                x, labels, query_rows[start : start + chunk], ks, positions, ap, map_at_r, hits
            )
    out = {"map": float(torch.cat(ap).mean()), "map_at_r": float(torch.cat(map_at_r).mean())}
    out.update({f"r@{k}": float(torch.cat(hits[k]).mean()) for k in ks})
    return out


def _argsort_chunk(x, labels, rows, ks, positions, ap, map_at_r, hits) -> None:
    """One chunk of :func:`argsort_retrieval` (its per-query values appended to the lists)."""
    import torch

    n = x.shape[0]
    scores = x[rows] @ x.T
    scores[torch.arange(rows.shape[0], device=x.device), rows] = -torch.inf  # query goes last
    order = torch.argsort(scores, dim=1, descending=True)[:, : n - 1]
    relevant = labels[order] == labels[rows][:, None]
    n_relevant = relevant.sum(1)
    keep = n_relevant > 0
    relevant, n_relevant = relevant[keep], n_relevant[keep].to(torch.float64)
    precision = relevant.cumsum(1, dtype=torch.float64) / positions
    hit_precision = precision * relevant
    ap.append(hit_precision.sum(1) / n_relevant)
    within_r = positions[None, :] <= n_relevant[:, None]
    map_at_r.append((hit_precision * within_r).sum(1) / n_relevant)
    for k in ks:
        hits[k].append(relevant[:, : min(k, n - 1)].any(1).to(torch.float64))


# ----------------------------------------------------------------------------------------------
# workers (one per subprocess)
# ----------------------------------------------------------------------------------------------


def _report_values(report) -> dict[str, float]:
    out = {"map": report.map, "map_at_r": report.map_at_r}
    out.update({f"r@{k}": v for k, v in report.recall_at.items()})
    return out


def worker(method: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run one benchmark method (in its own subprocess) and return its results."""
    import torch

    result: dict[str, Any] = {}
    if method == "degenerate_compare":
        result.update(degenerate_compare(params))
        result["peak_rss_mb"] = peak_rss_mb()
        return result
    if method.startswith("tm_"):
        x, labels = clustered_embeddings(
            2 * params["n"], params["classes"], params["dim"], params["noise"]
        )
    else:
        copies = params.get("copies", 1)  # every embedding that many times: exact duplicates
        x, labels = clustered_embeddings(
            params["n"] // copies, params["classes"], params["dim"], params["noise"]
        )
        x, labels = np.concatenate([x] * copies), np.concatenate([labels] * copies)
    x_t, labels_t = torch.from_numpy(x), torch.from_numpy(labels)

    if method == "data":
        pass
    elif method == "ours":
        from rankwise.metrics.retrieval import retrieval_metrics

        tiny = clustered_embeddings(200, 20, params["dim"], params["noise"])
        t0 = time.perf_counter()
        retrieval_metrics(torch.from_numpy(tiny[0]), torch.from_numpy(tiny[1]), ks=KS)
        result["warmup_s"] = time.perf_counter() - t0  # numba compilation / cache load
        t0 = time.perf_counter()
        report = retrieval_metrics(x_t, labels_t, ks=KS)
        result["time_s"] = time.perf_counter() - t0
        result["values"] = _report_values(report)
        if "baseline_queries" in params:  # the same queries the baseline runs on (not timed)
            rows = torch.from_numpy(baseline_query_subset(params["n"], params["baseline_queries"]))
            sub = retrieval_metrics(
                x_t[rows], labels_t[rows], x_t, labels_t, ks=KS, exclude_self=rows
            )
            result["subset_values"] = _report_values(sub)
    elif method == "argsort":
        rows = baseline_query_subset(params["n"], params.get("baseline_queries", params["n"]))
        t0 = time.perf_counter()
        result["values"] = argsort_retrieval(x_t, labels_t, torch.from_numpy(rows))
        elapsed = time.perf_counter() - t0
        result["measured_s"] = elapsed
        result["measured_queries"] = int(rows.shape[0])
        result["time_s"] = elapsed * params["n"] / rows.shape[0]  # linear in the query count
    elif method.startswith("pml"):
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

        k = "max_bin_count" if method == "pml_max_bin_count" else None
        calc = AccuracyCalculator(
            include=("mean_average_precision", "mean_average_precision_at_r", "precision_at_1"),
            k=k,
            device=torch.device("cpu"),
        )
        t0 = time.perf_counter()
        acc = calc.get_accuracy(x_t, labels_t)
        result["time_s"] = time.perf_counter() - t0
        result["values"] = {
            "map": float(acc["mean_average_precision"]),
            "map_at_r": float(acc["mean_average_precision_at_r"]),
            "r@1": float(acc["precision_at_1"]),
        }
        if k is None:  # the exact value to compare with (not timed)
            from rankwise.metrics.retrieval import retrieval_metrics

            result["ours_map"] = retrieval_metrics(x_t, labels_t, ks=(1,)).map
    elif method == "device_compare":
        result.update(device_compare(params, x_t, labels_t))
    elif method.startswith("tm_"):
        result.update(_torchmetrics_case(method, params, x_t, labels_t))
    else:
        raise ValueError(f"unknown method {method!r}")
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def _loop_counts(counter, name: str) -> dict[str, Any]:
    """Chunks, kernels / syncs / host calls per chunk of the ranges ``name`` of a counter."""
    ranges = counter.named(name)
    return {
        "chunks": len(ranges),
        "kernels": sorted({r.kernels for r in ranges}),
        "syncs": sorted({len(r.syncs) for r in ranges}),
        "sync_ops": sorted({op for r in ranges for op in r.syncs}),
        "host_calls": sorted({len(r.host_calls) for r in ranges}),
    }


def device_compare(params: dict[str, Any], x, labels) -> dict[str, Any]:
    """The torch backend of rankwise vs the chunked argsort + AP on one device, on the same queries.

    Leave-one-out over ``params["queries"]`` query rows (all rows when None) against the whole
    set. Both methods get a warm-up call, counted by rankwise._dispatch_count (kernels, host
    syncs and host calls per chunk, chunks), then ``params["repeats"]`` interleaved timed calls
    (CUDA synchronised); the median and the minimum of each are reported, with the load average.
    """
    import os

    import torch

    from rankwise._dispatch_count import DispatchCounter
    from rankwise.metrics import _device
    from rankwise.metrics.retrieval import retrieval_metrics

    device = torch.device(params["device"])
    x, labels = x.to(device), labels.to(device)
    n = x.shape[0]
    rows = (
        torch.arange(n)
        if params.get("queries") is None
        else torch.from_numpy(baseline_query_subset(n, params["queries"]))
    )
    rows = rows.to(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def ours():
        return retrieval_metrics(
            x[rows], labels[rows], x, labels, ks=KS, exclude_self=rows, backend="torch"
        )

    def base():
        return argsort_retrieval(x, labels, rows)

    # warm-up (CUDA context, kernels, allocator), the operations of each chunk counted
    with DispatchCounter("rankwise.retrieval.", watch_host=True) as counter:
        ours()
    with DispatchCounter("bench.", watch_host=True) as base_counter:
        base()
    load = [os.getloadavg()[0]]
    times: dict[str, list[float]] = {"ours": [], "argsort": []}
    for _ in range(params["repeats"]):
        for name, fn in (("ours", ours), ("argsort", base)):
            sync()
            t0 = time.perf_counter()
            out = fn()
            sync()
            times[name].append(time.perf_counter() - t0)
            if name == "ours":
                ours_values = _report_values(out)
            else:
                base_values = out
    load.append(os.getloadavg()[0])
    return {
        "ours_s": float(np.median(times["ours"])),
        "argsort_s": float(np.median(times["argsort"])),
        "ours_min_s": min(times["ours"]),
        "argsort_min_s": min(times["argsort"]),
        "all_s": times,
        "load": load,
        "ours_values": ours_values,
        "argsort_values": base_values,
        "n_queries": int(rows.shape[0]),
        "loop": _loop_counts(counter, _device.CHUNK_RECORD),
        "near_tie": {
            name: _loop_counts(counter, record)
            for name, record in (
                ("window", _device.WINDOW_RECORD),
                ("pairs", _device.PAIRS_RECORD),
                ("groups", _device.GROUP_RECORD),
            )
        },
        "readbacks": len(counter.named(_device.READBACK_RECORD)),
        "baseline_loop": _loop_counts(base_counter, BASELINE_CHUNK),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }


def degenerate_embeddings(case: str, n: int, dim: int, classes: int, seed: int = 0):
    """(n, dim) float32 rows and (n,) labels of a --degenerate case.

    ``distinct``: Gaussian rows; ``repeated``: 30 distinct Gaussian rows, row i the (i mod 30)-th
    (each repeated n / 30 times); ``identical``: one row n times. Labels: i mod ``classes``,
    permuted (so every class mixes copies of several rows).
    """
    rng = np.random.default_rng(seed)
    distinct = {"distinct": n, "repeated": 30, "identical": 1}[case]
    base = rng.standard_normal((distinct, dim)).astype(np.float32)
    x = base[np.arange(n) % distinct]
    labels = rng.permutation(np.arange(n) % classes).astype(np.int64)
    return np.ascontiguousarray(x), labels


def degenerate_compare(params: dict[str, Any]) -> dict[str, Any]:
    """One --degenerate case on one thread: rankwise torch and numba against plain argsorts.

    Timed (median of ``params["repeats"]`` interleaved calls after a warm-up call of each):
    ``retrieval_metrics`` leave-one-out with ``backend="torch"`` and ``"numba"``; a plain
    ``torch.argsort`` of the (N, N) float32 score matrix of the unit rows (the scores computed
    outside the timing); the chunked argsort + AP of :func:`argsort_retrieval`. The warm-up call
    of the torch backend is counted by ``rankwise._dispatch_count`` (kernels per chunk, chunks of
    the near-tie loops).
    """
    import numba
    import torch

    from rankwise._dispatch_count import DispatchCounter
    from rankwise.metrics import _device
    from rankwise.metrics.retrieval import retrieval_metrics

    torch.set_num_threads(1)
    numba.set_num_threads(1)
    x_np, labels_np = degenerate_embeddings(
        params["case"], params["n"], params["dim"], params["classes"]
    )
    x, labels = torch.from_numpy(x_np), torch.from_numpy(labels_np)
    unit = torch.nn.functional.normalize(x, dim=1)
    scores = unit @ unit.T
    rows = torch.arange(x.shape[0])

    def method(name: str):
        if name in ("torch", "numba"):
            return lambda: _report_values(retrieval_metrics(x, labels, ks=KS, backend=name))
        if name == "argsort":
            return lambda: torch.argsort(scores, dim=1)
        return lambda: argsort_retrieval(x, labels, rows)

    names = ("torch", "numba", "argsort", "argsort_ap")
    with DispatchCounter("rankwise.retrieval.", watch_host=True) as counter:
        values = {"torch": method("torch")()}
    values["numba"] = method("numba")()
    values["argsort_ap"] = method("argsort_ap")()
    method("argsort")()
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(params["repeats"]):
        for name in names:
            fn = method(name)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {
        "times": times,
        "median": {name: float(np.median(t)) for name, t in times.items()},
        "map": {name: v["map"] for name, v in values.items()},
        "loop": _loop_counts(counter, _device.CHUNK_RECORD),
        "near_tie": {
            name: _loop_counts(counter, record)
            for name, record in (
                ("window", _device.WINDOW_RECORD),
                ("pairs", _device.PAIRS_RECORD),
                ("groups", _device.GROUP_RECORD),
            )
        },
        "threads": torch.get_num_threads(),
    }


def run_degenerate(sizes: str, repeats: int, cases: list[str]) -> str:
    """The --degenerate table (each case in its own subprocess)."""
    started = time.perf_counter()
    info = machine_info()
    n = DEGENERATE_N[sizes]
    rows = []
    for case in cases:
        params = {"case": case, "n": n, "dim": 64, "classes": 300, "repeats": repeats}
        print(DEGENERATE_CASES[case].format(copies=n // 30), flush=True)
        rows.append((case, run_worker("degenerate_compare", params)))
    total = time.perf_counter() - started
    info["torch threads"] = "1"
    lines = [
        DEGENERATE_SECTION,
        "",
        f"Command: `python benchmarks/bench_retrieval.py --degenerate --sizes {sizes} --repeats "
        f"{repeats}` ({total:.0f} s in all). "
        + ", ".join(f"{k}: {v}" for k, v in info.items())
        + ".",
        "",
        f"Leave-one-out, N = {n:,}, d = 64, 300 classes (label i mod 300, permuted), cosine, "
        "one thread (`torch.set_num_threads(1)`, `numba.set_num_threads(1)`); median of "
        f"{repeats} interleaved timed calls after a warm-up call of each. argsort: "
        "`torch.argsort` of the (N, N) float32 score matrix of the unit rows (scores computed "
        "outside the timing); argsort + AP: the chunked baseline of the --device section (not "
        "tie-aware). Loops as in that section, counted during the torch backend's warm-up call.",
        "",
        "| case | rankwise torch (s) | rankwise numba (s) | argsort (s) | argsort + AP (s) | "
        "torch / argsort | torch / numba | main loop | near-tie loops | mAP torch | mAP numba |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for case, r in rows:
        t = r["median"]
        lines.append(
            f"| {DEGENERATE_CASES[case].format(copies=n // 30)} | {t['torch']:.3f} | {t['numba']:.3f} | "
            f"{t['argsort']:.3f} | {t['argsort_ap']:.3f} | {t['torch'] / t['argsort']:.2f}× | "
            f"{t['torch'] / t['numba']:.2f}× | {_per_chunk(r['loop'])} | "
            f"{_near_tie_cell(r['near_tie'])} | {_fmt(r['map']['torch'], 6)} | "
            f"{_fmt(r['map']['numba'], 6)} |"
        )
    for case, r in rows:
        print(f"{case}: {r['times']}", flush=True)
    return "\n".join(lines) + "\n"


def _torchmetrics_case(method, params, x, labels) -> dict[str, Any]:
    """2n samples split into n queries and n gallery items; float and binary-code scores."""
    import torch

    from rankwise.metrics.retrieval import retrieval_metrics

    n = params["n"]
    q, g, ql, gl = x[:n], x[n:], labels[:n], labels[n:]
    # binary codes (sign of a random projection): integer inner products with many ties
    proj = torch.randn(x.shape[1], params["code_bits"], generator=torch.Generator().manual_seed(2))
    qc, gc = torch.sign(q @ proj), torch.sign(g @ proj)
    relevant = ql[:, None] == gl[None, :]
    indexes = torch.arange(n).repeat_interleave(n)
    out: dict[str, Any] = {}
    if method == "tm_ours":
        retrieval_metrics(q[:50], ql[:50], g[:50], gl[:50], ks=(1,))  # numba warm-up
        t0 = time.perf_counter()
        out["map_float"] = retrieval_metrics(q, ql, g, gl, ks=(1,)).map
        out["time_s"] = time.perf_counter() - t0
        for ties in ("expected", "optimistic", "pessimistic"):
            out[f"map_codes_{ties}"] = retrieval_metrics(
                qc, ql, gc, gl, ks=(1,), similarity="dot", ties=ties
            ).map
        return out
    from torchmetrics.retrieval import RetrievalMAP

    def tm_map(scores: torch.Tensor) -> float:
        metric = RetrievalMAP(empty_target_action="skip")
        metric.update(scores.reshape(-1), relevant.reshape(-1), indexes=indexes)
        return float(metric.compute())

    cosine = q @ g.T
    # all scores > 0 so no item is zeroed; float64 so the shift creates no new ties
    shifted = cosine.double() + 2.0
    t0 = time.perf_counter()
    out["map_float_shifted"] = tm_map(shifted)
    out["time_s"] = time.perf_counter() - t0
    out["map_float_raw"] = tm_map(cosine)  # relevant items with cosine <= 0 count as irrelevant
    codes = qc @ gc.T + params["code_bits"] + 1.0
    out["map_codes"] = tm_map(codes)
    # the same tied scores, gallery presented in reverse order: position-dependent tie-breaking
    out["map_codes_reversed"] = tm_map_reversed(codes, relevant, indexes)
    return out


def tm_map_reversed(scores, relevant, indexes) -> float:
    """The torchmetrics mAP with the gallery presented in reverse order (its tie-breaking)."""
    from torchmetrics.retrieval import RetrievalMAP

    metric = RetrievalMAP(empty_target_action="skip")
    metric.update(scores.flip(1).reshape(-1), relevant.flip(1).reshape(-1), indexes=indexes)
    return float(metric.compute())


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------


def run_worker(method: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run ``method`` in a fresh subprocess and return its JSON result."""
    print(f"  [{time.strftime('%H:%M:%S')}] {method} {json.dumps(params)} ...", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", method, "--params", json.dumps(params)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"worker {method} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shown = f"{result['time_s']:.2f} s" if "time_s" in result else "done"
    print(
        f"      {shown}, peak RSS {result['peak_rss_mb']:.0f} MB "
        f"(wall {time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    return result


def _fmt(v: float | None, digits: int = 4) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _ratio(t: float, ours: float) -> str:
    return f"{t / ours:.1f}×"


def _pml_full_k_lines(cfg: dict[str, Any], sop: dict[str, Any]) -> list[str]:
    """pytorch-metric-learning ``AccuracyCalculator(k=None)``: time and memory at two sizes."""
    lines: list[str] = []
    print("pytorch-metric-learning AccuracyCalculator(k=None)", flush=True)
    rows = []
    for n in cfg["pml_full_k"]:
        params = dict(sop, n=n, classes=max(2, round(n * sop["classes"] / sop["n"])))
        params.pop("baseline_queries")
        data_n = run_worker("data", params)
        full = run_worker("pml_full_k", params)
        rows.append((n, full, full["peak_rss_mb"] - data_n["peak_rss_mb"]))
    n_big = 20_000
    (n1, _, m1), (n2, _, m2) = rows[0], rows[-1]
    exponent = np.log(max(m2, 1e-9) / max(m1, 1e-9)) / np.log(n2 / n1)
    projected_gb = m2 * (n_big / n2) ** 2 / 1024
    lines += [
        "`AccuracyCalculator(k=None)` (all neighbours: exact mAP) builds dense N × N "
        "tensors; its memory grows quadratically:",
        "",
        "| N | time (s) | peak RSS − data (MB) | PML mAP | rankwise mAP |",
        "|---:|---:|---:|---:|---:|",
    ]
    for n, full, extra in rows:
        lines.append(
            f"| {n:,} | {full['time_s']:.2f} | {extra:,.0f} | "
            f"{_fmt(full['values']['map'], 6)} | {_fmt(full['ours_map'], 6)} |"
        )
    if exponent > 1.5:
        growth = (
            f"Measured growth exponent {exponent:.2f}; quadratic projection to "
            f"N = {n_big:,}: ≈ {projected_gb:.0f} GB"
        )
    else:
        growth = (
            f"At these sizes fixed overheads still dominate (measured exponent "
            f"{exponent:.2f}); `--sizes full` measures where the N × N tensors dominate"
        )
    lines += [
        "",
        f"{growth}. At N = {n_big:,} it is reported to run out of memory on a 24 GB machine (not "
        "run here). rankwise's memory is bounded by its chunk size (256 MB of scores per chunk).",
        "",
    ]
    return lines


def have_faiss() -> bool:
    """Whether faiss (needed by pytorch-metric-learning's AccuracyCalculator) is importable."""
    import importlib.util

    return importlib.util.find_spec("faiss") is not None


NO_FAISS_NOTE = (
    "*pytorch-metric-learning's `AccuracyCalculator` rows were skipped: faiss is not installed "
    "(`pip install -e .[faiss]`).*"
)


def run(sizes: str) -> str:
    """The CPU retrieval benchmark at ``sizes``: the markdown section."""
    cfg = SIZES[sizes]
    lines: list[str] = []
    info = machine_info("pytorch_metric_learning", "torchmetrics")
    started = time.perf_counter()

    # -- SOP-sized -------------------------------------------------------------------------------
    sop = cfg["sop"]
    print(f"SOP-sized leave-one-out, N={sop['n']:,}", flush=True)
    data = run_worker("data", sop)
    ours = run_worker("ours", sop)
    base = run_worker("argsort", sop)
    pml = run_worker("pml_max_bin_count", sop) if have_faiss() else None
    base_mb = data["peak_rss_mb"]
    v, sv = ours["values"], ours["subset_values"]
    lines += [
        f"### SOP-sized leave-one-out: N = {sop['n']:,}, d = {sop['dim']}, "
        f"{sop['classes']:,} classes of {sop['n'] // sop['classes']}-"
        f"{-(-sop['n'] // sop['classes'])}",
        "",
        "Random Gaussian clusters, L2-normalized, cosine similarity; every sample queries the "
        f"other {sop['n'] - 1:,}. Peak RSS is the whole subprocess (Python, torch and the data "
        f"included); generating the data alone peaks at {base_mb:,.0f} MB.",
        "",
        "| method | time (s) | time / ours | peak RSS (MB) | mAP | R@1 | R@10 | R@100 | MAP@R |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| rankwise `retrieval_metrics` (exact, tie-aware) | {ours['time_s']:.2f} | 1.0× | "
        f"{ours['peak_rss_mb']:,.0f} | {_fmt(v['map'])} | {_fmt(v['r@1'])} | {_fmt(v['r@10'])} "
        f"| {_fmt(v['r@100'])} | {_fmt(v['map_at_r'])} |",
    ]
    bv = base["values"]
    extrapolated = base["measured_queries"] < sop["n"]
    note = (
        f" (measured on {base['measured_queries']:,} queries in {base['measured_s']:.1f} s, "
        "×{:.0f} linear extrapolation)".format(sop["n"] / base["measured_queries"])
        if extrapolated
        else ""
    )
    lines.append(
        f"| chunked torch argsort of every row{note} | {base['time_s']:.2f} | "
        f"{_ratio(base['time_s'], ours['time_s'])} | {base['peak_rss_mb']:,.0f} | "
        f"{_fmt(bv['map'])} | {_fmt(bv['r@1'])} | {_fmt(bv['r@10'])} | {_fmt(bv['r@100'])} | "
        f"{_fmt(bv['map_at_r'])} |"
    )
    if pml is not None:
        pv = pml["values"]
        lines.append(
            f'| pytorch-metric-learning `AccuracyCalculator(k="max_bin_count")` (faiss k-NN) | '
            f"{pml['time_s']:.2f} | {_ratio(pml['time_s'], ours['time_s'])} | "
            f"{pml['peak_rss_mb']:,.0f} | {_fmt(pv['map'])} (truncated) | {_fmt(pv['r@1'])} | "
            f"— | — | {_fmt(pv['map_at_r'])} |"
        )
    if extrapolated:
        lines += [
            "",
            f"On the baseline's {base['measured_queries']:,} queries rankwise gives mAP "
            f"{_fmt(sv['map'], 6)}, R@1 {_fmt(sv['r@1'], 6)}, MAP@R {_fmt(sv['map_at_r'], 6)}; the "
            f"argsort baseline {_fmt(bv['map'], 6)}, {_fmt(bv['r@1'], 6)}, "
            f"{_fmt(bv['map_at_r'], 6)} (|Δ mAP| = {abs(sv['map'] - bv['map']):.1e}; random "
            "float scores have essentially no ties, so the two must agree).",
        ]
    if pml is not None:
        lines += [
            "",
            "pytorch-metric-learning's `mean_average_precision` only looks at the k = max class "
            "size − 1 nearest neighbours: relevant items ranked below are counted as never "
            f"retrieved, so it is a lower bound ({_fmt(pml['values']['map'])} vs the exact "
            f"{_fmt(v['map'])}). Its MAP@R needs only the top R and is exact when there are no "
            "ties.",
            "",
        ]
        lines += _pml_full_k_lines(cfg, sop)
    else:
        lines += ["", NO_FAISS_NOTE, ""]

    # -- few classes -----------------------------------------------------------------------------
    few = cfg["few"]
    print(f"Few classes, N={few['n']:,}", flush=True)
    ours_f = run_worker("ours", few)
    base_f = run_worker("argsort", few)
    vf, bf = ours_f["values"], base_f["values"]
    lines += [
        f"### Few classes: N = {few['n']:,}, {few['classes']} classes of "
        f"{few['n'] // few['classes']:,}, leave-one-out",
        "",
        "| method | time (s) | time / ours | peak RSS (MB) | mAP | R@1 | MAP@R |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| rankwise `retrieval_metrics` | {ours_f['time_s']:.2f} | 1.0× | "
        f"{ours_f['peak_rss_mb']:,.0f} | {_fmt(vf['map'], 6)} | {_fmt(vf['r@1'], 6)} | "
        f"{_fmt(vf['map_at_r'], 6)} |",
        f"| chunked torch argsort (all queries) | {base_f['time_s']:.2f} | "
        f"{_ratio(base_f['time_s'], ours_f['time_s'])} | {base_f['peak_rss_mb']:,.0f} | "
        f"{_fmt(bf['map'], 6)} | {_fmt(bf['r@1'], 6)} | {_fmt(bf['map_at_r'], 6)} |",
        "",
    ]

    # -- torchmetrics ----------------------------------------------------------------------------
    tm = cfg["tm"]
    print(f"torchmetrics RetrievalMAP, {tm['n']:,} x {tm['n']:,}", flush=True)
    ours_t = run_worker("tm_ours", tm)
    tm_t = run_worker("tm_torchmetrics", tm)
    lines += [
        f"### torchmetrics `RetrievalMAP`: {tm['n']:,} queries × {tm['n']:,} gallery items, "
        f"{tm['classes']} classes",
        "",
        "| scores | rankwise mAP | torchmetrics mAP | note |",
        "|---|---:|---:|---|",
        f"| cosine + 2 (all > 0) | {_fmt(ours_t['map_float'], 6)} | "
        f"{_fmt(tm_t['map_float_shifted'], 6)} | no ties: must agree (float64 shift) |",
        f"| raw cosine | {_fmt(ours_t['map_float'], 6)} | {_fmt(tm_t['map_float_raw'], 6)} | "
        "torchmetrics zeroes the relevance of items scored ≤ 0 |",
        f"| {tm['code_bits']}-bit binary codes (inner product, heavy ties) | "
        f"{_fmt(ours_t['map_codes_expected'], 6)} (expected; optimistic "
        f"{_fmt(ours_t['map_codes_optimistic'], 4)}, pessimistic "
        f"{_fmt(ours_t['map_codes_pessimistic'], 4)}) | {_fmt(tm_t['map_codes'], 6)}; gallery "
        f"reversed: {_fmt(tm_t['map_codes_reversed'], 6)} | torchmetrics breaks ties by position |",
        "",
        f"Time (cosine scores): rankwise {ours_t['time_s']:.3f} s (including the similarity "
        f"matmul) vs torchmetrics {tm_t['time_s']:.3f} s given the score matrix "
        f"({_ratio(tm_t['time_s'], ours_t['time_s'])}).",
        "",
    ]
    total = time.perf_counter() - started
    header = [
        SECTION,
        "",
        f"Command: `python benchmarks/bench_retrieval.py --sizes {sizes}` ({total:.0f} s in all). "
        + ", ".join(f"{k}: {v}" for k, v in info.items())
        + ".",
        "",
    ]
    if sizes != "full":
        header += [
            f"*Reduced sizes (`--sizes {sizes}`); `--sizes full` is the SOP-sized run.*",
            "",
        ]
    return "\n".join(header + lines)


def device_cases(sizes: str) -> list[tuple[str, dict[str, Any]]]:
    """(title, params) of the --device comparison: issue 31's three cases, at ``sizes``."""
    cfg = SIZES[sizes]
    n_many, c_many = DEVICE_MANY[sizes]
    n_inat, c_inat = DEVICE_INAT[sizes]
    many = dict(cfg["sop"], n=n_many, classes=c_many)
    return [
        (f"many classes (SOP-like): N = {n_many:,}, {c_many:,} classes", many),
        (
            f"iNaturalist-like: N = {n_inat:,}, {c_inat:,} classes",
            dict(many, n=n_inat, classes=c_inat),
        ),
        (
            f"few classes: N = {cfg['few']['n']:,}, {cfg['few']['classes']} classes",
            dict(cfg["few"]),
        ),
        (
            f"near ties (every embedding twice): N = {n_many:,}, {c_many // 2:,} classes",
            dict(many, classes=c_many // 2, copies=2),
        ),
    ]


def _per_chunk(loop: dict[str, Any], host_calls: bool = True) -> str:
    """'4 × 57 / 0 / 0': chunks × (kernels / host syncs / numpy-numba calls) per chunk.

    Ranges when they vary; without ``host_calls`` the last figure is left out.
    """
    if not loop["chunks"]:
        return "—"

    def one(values: list[int]) -> str:
        return str(values[0]) if len(values) == 1 else f"{values[0]}–{values[-1]}"

    out = f"{loop['chunks']} × {one(loop['kernels'])} / {one(loop['syncs'])}"
    return out + (f" / {one(loop['host_calls'])}" if host_calls else "")


def _near_tie_cell(near: dict[str, dict[str, Any]]) -> str:
    """The three near-tie loops' chunks and per-chunk counts, or — when no query needed them."""
    if not any(loop["chunks"] for loop in near.values()):
        return "—"
    return "; ".join(f"{name} {_per_chunk(loop)}" for name, loop in near.items())


def run_device(sizes: str, device: str, repeats: int) -> tuple[str, str]:
    """The torch backend vs the argsort baseline on ``device``: (section title, markdown)."""
    started = time.perf_counter()
    info = machine_info("pytorch_metric_learning", "torchmetrics")
    rows = []
    for title, params in device_cases(sizes):
        # on the CPU the argsort of every row is slow: both methods run on a query subset
        queries = None if device.startswith("cuda") else params.get("baseline_queries")
        params = dict(params, device=device, repeats=repeats, queries=queries)
        params.pop("baseline_queries", None)
        print(title, flush=True)
        rows.append((title, run_worker("device_compare", params)))
    device_name = rows[0][1]["device_name"] if rows else device
    section = f"## Retrieval evaluation: torch backend on {device.split(':')[0]}"
    total = time.perf_counter() - started
    loads = [v for _, r in rows for v in r["load"]]
    lines = [
        section,
        "",
        f"Command: `python benchmarks/bench_retrieval.py --device {device} --sizes {sizes} "
        f"--repeats {repeats}` ({total:.0f} s in all). Device: {device_name}. "
        + ", ".join(f"{k}: {v}" for k, v in info.items())
        + f". Load average {min(loads):.1f}–{max(loads):.1f} during the timed calls.",
        "",
        'rankwise `retrieval_metrics(..., backend="torch")` (exact keys, tie-aware, the path '
        "chosen automatically for CUDA tensors) against a chunked torch argsort + AP (not "
        "tie-aware), leave-one-out, d = 128, cosine, in one process on the same queries; "
        f"median of {repeats} interleaved timed calls after a warm-up call (minimum in "
        "brackets). Loops: chunks × (aten kernels per chunk, views and bare allocations not "
        "counted / operations that make the host wait for the device / numpy or numba calls), "
        "counted by `rankwise._dispatch_count` during the warm-up call; the near-tie pass's "
        "three loops (window, pairs, groups) run only for queries with near-tied items; the "
        "argsort baseline counted alike.",
        "",
        "| case | queries | rankwise torch (s) | argsort + AP (s) | rankwise / argsort | "
        "main loop | near-tie loops | argsort loop | mAP rankwise | mAP argsort |",
        "|---|---:|---:|---:|---:|---|---|---|---:|---:|",
    ]
    for title, r in rows:
        lines.append(
            f"| {title} | {r['n_queries']:,} | {r['ours_s']:.3f} ({r['ours_min_s']:.3f}) | "
            f"{r['argsort_s']:.3f} ({r['argsort_min_s']:.3f}) | "
            f"{r['ours_s'] / r['argsort_s']:.2f}× | {_per_chunk(r['loop'])} | "
            f"{_near_tie_cell(r['near_tie'])} | {_per_chunk(r['baseline_loop'], False)} | "
            f"{_fmt(r['ours_values']['map'], 6)} | {_fmt(r['argsort_values']['map'], 6)} |"
        )
    for title, r in rows:
        print(
            f"{title}: rankwise {r['all_s']['ours']}, argsort {r['all_s']['argsort']}, "
            f"baseline syncs {r['baseline_loop']['sync_ops']}",
            flush=True,
        )
    return section, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", choices=sorted(SIZES), default="quick")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "docs" / "benchmarks.md",
        help="markdown file whose retrieval section is (re)written",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="compare the torch backend with an argsort baseline on this device (cpu, cuda, ...)",
    )
    parser.add_argument(
        "--degenerate",
        action="store_true",
        help="time degenerate embeddings (repeated / identical rows) on one thread",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=sorted(DEGENERATE_CASES),
        default=list(DEGENERATE_CASES),
        help="the --degenerate cases to run",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed calls per method (--device, --degenerate)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, json.loads(args.params))))
        return
    if args.degenerate:
        section = run_degenerate(args.sizes, args.repeats, args.cases)
        write_section(args.out, section, DEGENERATE_SECTION)
        print(f"\nwrote the {DEGENERATE_SECTION!r} section of {args.out}\n", flush=True)
        print(section)
        return
    if args.device is not None:
        title, section = run_device(args.sizes, args.device, args.repeats)
        write_section(args.out, section, title)
        print(f"\nwrote the {title!r} section of {args.out}\n", flush=True)
        print(section)
        return
    section = run(args.sizes)
    write_section(args.out, section, SECTION)
    print(f"\nwrote the retrieval section of {args.out}\n", flush=True)
    print(section)


if __name__ == "__main__":
    main()
