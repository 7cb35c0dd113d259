"""Tables of issue 21's sampling-rate study (benchmarks/studies/sampling_rate.sh).

Reads ``OUT/<start>/<cell>/<loss>/seed<k>/report.json`` and prints, per start (pretrained,
scratch) and regime (fixed batch of 64; fixed 16 classes per batch), the test mAUPRC in % as
mean ± sample std over the finished seeds for K = 2, 4, 8, the drop from K = 2 to K = 8 in points
and relative to K = 2, how many runs selected their last checkpoint (the budget is long enough
when few do) and how much validation mAP the runs still gained over the last 20 % of their steps
(points, mean over the row's runs: how far from converged a run that selected its last step is).
Unfinished runs are counted, never silently dropped. Each regime's heading gives the positive share of every cell: the fraction of an anchor's batch
partners that are its positives, (K − 1) / (B − 1), which is what K changes for a batch loss.
``--paired`` adds the evidence for SOPRC's
defaults: per cell, each variant (``tpr_count=num_v``, ``detach_tpr=true``) minus the defaults,
paired by seed (same seed, same data order and initialisation), and over the whole study how many
paired runs the variant wins, ties and loses.

    python benchmarks/studies/summarize_sampling_rate.py runs/study21 [--paired] [--markdown FILE]

``--pretrainings OUT_0 OUT_1 ...`` (issue 30) summarises instead one study folder per pretraining
seed (``sampling_rate.sh``'s ``PRETRAIN_SEED``), each with the same cells, losses and fine-tuning
seed (``--seed``, default 0): per loss and cell the test mAUPRC of each pretraining and their
mean ± sample std, the drop from K = 2 to K = 8 under each pretraining, and which loss drops the
most under each — the pretraining variance the fine-tuning seeds of one pretraining leave out.

A study run on a subset (the script's STARTS / CELLS_RUN / LOSSES_RUN) is summarised with the same
subset (``--starts``, ``--cells``, ``--losses``): the other rows are left out, a cell outside the
subset reads "not run", and the unfinished count is over the subset's runs. ROADMAP and the Recall@k
surrogate (labels ``roadmap``, ``recall_at_k``; not in the study's default list) are summarised only
when named in ``--losses``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

LOSSES = {
    "soprc": "SOPRC (defaults)",
    "soprc_numv": "SOPRC, `tpr_count=num_v`",
    "ap": "AP loss (biased)",
    "smooth_ap": "Smooth-AP",
    "fastap": "FastAP (PML)",
    "contrastive": "contrastive (PML)",
    "soprc_detach": "SOPRC, `detach_tpr=true`",
    "roadmap": "ROADMAP",
    "recall_at_k": "Recall@k surrogate",
    "recall_at_k_detach": "Recall@k surrogate, `detach_positive_ranks=true`",
}
# the study's default list (sampling_rate.sh's LOSSES_RUN); ROADMAP and Recall@k (issue 33, and
# its detach_positive_ranks form, issue 38) are summarised when asked for with --losses
_ASKED_ONLY = ("roadmap", "recall_at_k", "recall_at_k_detach")
DEFAULT_LOSSES = tuple(loss for loss in LOSSES if loss not in _ASKED_ONLY)
# regime -> {K: cell}; the K = 4 cell is shared (16 classes x 4 = a batch of 64)
REGIMES = {
    "fixed batch of 64 (32 / 16 / 8 classes per batch)": {2: "fb_k2", 4: "fb_k4", 8: "fb_k8"},
    "fixed 16 classes per batch (batches of 32 / 64 / 128)": {2: "fc_k2", 4: "fb_k4", 8: "fc_k8"},
}
STARTS = {"pretrained": "pretrained start", "scratch": "from scratch"}
# cell -> (K, batch size), in the order of the paired table
CELLS = {"fb_k2": (2, 64), "fb_k4": (4, 64), "fb_k8": (8, 64), "fc_k2": (2, 32), "fc_k8": (8, 128)}
PAIRED_VARIANTS = ("soprc_numv", "soprc_detach")
SEEDS = range(3)


def positive_share(cell: str) -> float:
    """Fraction of an anchor's batch partners that are positives: (K − 1) / (B − 1)."""
    k, batch = CELLS[cell]
    return (k - 1) / (batch - 1)


def _shares(cells: dict[int, str]) -> str:
    return ", ".join(f"K = {k}: {100 * positive_share(cell):.1f} %" for k, cell in cells.items())


def _late_gain(run: Path, steps: int) -> float:
    """Validation mAP (points) at the last evaluation minus at the first one at >= 80 % of steps."""
    vals = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "val":
            vals[record["step"]] = record["map"]
    late = min(step for step in vals if step >= 0.8 * steps)
    return 100 * (vals[max(vals)] - vals[late])


def _finished(out: Path, start: str, cell: str, loss: str) -> dict[int, tuple[Path, dict]]:
    """Seed -> (run folder, report) of each completed run of one cell and loss."""
    runs = {}
    for seed in SEEDS:
        run = out / start / cell / loss / f"seed{seed}"
        report = run / "report.json"
        data = json.loads(report.read_text()) if report.exists() else None
        if data is not None and data.get("status") == "completed":
            runs[seed] = (run, data)
    return runs


def _runs(out: Path, start: str, cell: str, loss: str) -> tuple[list[float], int, int, list[float]]:
    """Per finished seed: test mAUPRC (%), selected-last count, unfinished count, late val gain."""
    finished = _finished(out, start, cell, loss).values()
    maps = [100 * data["test"]["map"] for _, data in finished]
    last = sum(data["best_step"] == data["steps"] for _, data in finished)
    gains = [_late_gain(run, data["steps"]) for run, data in finished]
    return maps, last, len(SEEDS) - len(maps), gains


def _cell(maps: list[float]) -> str:
    if not maps:
        return "—"
    if len(maps) == 1:
        return f"{maps[0]:.2f} (1 seed)"
    return f"{statistics.mean(maps):.2f} ± {statistics.stdev(maps):.2f}" + (
        "" if len(maps) == 3 else f" ({len(maps)} seeds)"
    )


def tables(
    out: Path,
    starts: tuple[str, ...] = tuple(STARTS),
    cells_run: tuple[str, ...] = tuple(CELLS),
    losses: tuple[str, ...] = DEFAULT_LOSSES,
) -> str:
    """The markdown tables, one per start and regime, over the given subset of the study."""
    lines = []
    for start in starts:
        start_name = STARTS[start]
        for regime, cells in REGIMES.items():
            lines += [
                f"**{start_name}, {regime}** (test mAUPRC %, mean ± sample std over seeds 0-2)",
                "",
                f"Positive share of an anchor's batch partners, (K − 1) / (B − 1): {_shares(cells)}.",
                "",
                "| loss | K = 2 | K = 4 | K = 8 | drop K=2→8 (points) | drop (relative) "
                "| runs selecting the last step | late validation gain (points) |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for loss in losses:
                name = LOSSES[loss]
                cols, means, last, done, gains = [], {}, 0, 0, []
                for k, cell in cells.items():
                    if cell not in cells_run:
                        cols.append("not run")
                        continue
                    maps, n_last, _, run_gains = _runs(out, start, cell, loss)
                    cols.append(_cell(maps))
                    if maps:
                        means[k] = statistics.mean(maps)
                    last, done, gains = last + n_last, done + len(maps), gains + run_gains
                if 2 in means and 8 in means:
                    drop = means[2] - means[8]
                    drops = [f"{drop:.2f}", f"{100 * drop / means[2]:.0f} %"]
                else:
                    drops = ["—", "—"]
                gain = f"{statistics.mean(gains):+.2f}" if gains else "—"
                lines.append(
                    f"| {name} | " + " | ".join(cols + drops) + f" | {last} of {done} | {gain} |"
                )
            lines.append("")
    return "\n".join(lines)


def _maps_by_seed(out: Path, start: str, cell: str, loss: str) -> dict[int, float]:
    """Seed -> test mAUPRC (%) of each completed run of one cell and loss."""
    return {
        seed: 100 * data["test"]["map"]
        for seed, (_, data) in _finished(out, start, cell, loss).items()
    }


def paired(out: Path, against: str = "soprc", variants: tuple[str, ...] = PAIRED_VARIANTS) -> str:
    """Each variant minus ``against`` in test mAUPRC points, paired by seed, per start and cell."""
    header = " | ".join(f"{LOSSES[v]} − defaults" for v in variants)
    lines = [
        "**SOPRC's variants against its defaults, paired by seed** (test mAUPRC points: per seed "
        "0 / 1 / 2, then the mean; a seed missing in either run is left out and counted)",
        "",
        f"| start | cell (K, batch) | {header} |",
        "|---|---|" + "---|" * len(variants),
    ]
    diffs: dict[str, list[float]] = {v: [] for v in variants}
    unpaired = dict.fromkeys(variants, 0)
    for start, start_name in STARTS.items():
        for cell, (k, batch) in CELLS.items():
            base = _maps_by_seed(out, start, cell, against)
            cols = []
            for variant in variants:
                other = _maps_by_seed(out, start, cell, variant)
                seeds = sorted(set(base) & set(other))
                unpaired[variant] += len(SEEDS) - len(seeds)
                ds = [other[s] - base[s] for s in seeds]
                diffs[variant] += ds
                per_seed = " / ".join(f"{d:+.2f}" for d in ds)
                cols.append(f"{per_seed} (mean {statistics.mean(ds):+.2f})" if ds else "—")
            lines.append(f"| {start_name} | K = {k}, batch {batch} | " + " | ".join(cols) + " |")
    summary = []
    for variant in variants:
        ds = diffs[variant]
        if ds:
            wins, ties = sum(d > 0 for d in ds), sum(d == 0 for d in ds)
            summary.append(
                f"{statistics.mean(ds):+.2f} over {len(ds)} pairs: {wins} better, {ties} equal, "
                f"{len(ds) - wins - ties} worse"
            )
        else:
            summary.append("—")
        if unpaired[variant]:
            summary[-1] += f" ({unpaired[variant]} pairs unfinished)"
    lines.append("| **all** | | " + " | ".join(summary) + " |")
    return "\n".join(lines)


def _spread(values: list[float]) -> str:
    if len(values) < 2:
        return "—"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _drops(
    maps: dict[tuple[str, str], list[float | None]],
    first: str,
    last: str,
    regime: str,
    losses: tuple[str, ...],
    n_outs: int,
) -> list[str]:
    """The drop from K = 2 to K = 8 of each loss under each pretraining, and the largest."""
    heads = " | ".join(f"pretraining {i}" for i in range(n_outs))
    lines = [
        f"**Drop from K = 2 to K = 8, {regime}, under each pretraining** (points)",
        "",
        f"| loss | {heads} | mean ± std |",
        "|---|" + "---|" * (n_outs + 1),
    ]
    drops: dict[str, list[float | None]] = {}
    for loss in losses:
        pairs = zip(maps[loss, first], maps[loss, last], strict=True)
        drops[loss] = [None if a is None or b is None else a - b for a, b in pairs]
        shown = " | ".join("—" if d is None else f"{d:.2f}" for d in drops[loss])
        lines.append(
            f"| {LOSSES[loss]} | {shown} | {_spread([d for d in drops[loss] if d is not None])} |"
        )
    largest = []
    for i in range(n_outs):
        known = {loss: d[i] for loss, d in drops.items() if d[i] is not None}
        complete = len(known) == len(losses)
        largest.append(LOSSES[max(known, key=lambda loss: known[loss])] if complete else "—")
    lines.append("| *largest drop* | " + " | ".join(largest) + " | |")
    return lines


def pretraining_variance(
    outs: list[Path],
    cells: tuple[str, ...] = ("fb_k2", "fb_k8"),
    losses: tuple[str, ...] = ("soprc", "ap", "smooth_ap"),
    seed: int = 0,
    start: str = "pretrained",
) -> tuple[str, int]:
    """Tables over pretraining seeds (one study folder each) and the number of missing runs."""
    heads = " | ".join(f"pretraining {i}" for i in range(len(outs)))
    lines = [
        f"**Pretraining variance** (test mAUPRC %, fine-tuning seed {seed}; one column per "
        "pretraining seed, then the mean ± sample std over pretrainings)",
        "",
        f"| loss | cell (K, batch, positive share) | {heads} | mean ± std |",
        "|---|---|" + "---|" * (len(outs) + 1),
    ]
    maps: dict[tuple[str, str], list[float | None]] = {}
    missing = 0
    for loss in losses:
        for cell in cells:
            row: list[float | None] = []
            for out in outs:
                value = _maps_by_seed(out, start, cell, loss).get(seed)
                missing += value is None
                row.append(value)
            maps[loss, cell] = row
            k, batch = CELLS[cell]
            shown = " | ".join("—" if v is None else f"{v:.2f}" for v in row)
            found = [v for v in row if v is not None]
            lines.append(
                f"| {LOSSES[loss]} | K = {k}, batch {batch}, {100 * positive_share(cell):.1f} % "
                f"| {shown} | {_spread(found)} |"
            )
    for regime, by_k in REGIMES.items():
        if by_k[2] in cells and by_k[8] in cells:
            lines += ["", *_drops(maps, by_k[2], by_k[8], regime, losses, len(outs))]
    return "\n".join(lines), missing


def main(argv: list[str] | None = None) -> int:
    """Print (and optionally write) the tables; exit 2 without a study folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--markdown", type=Path, help="also write the tables to this file")
    parser.add_argument(
        "--paired", action="store_true", help="add SOPRC's variants against its defaults by seed"
    )
    for option, choices, default in (
        ("starts", STARTS, tuple(STARTS)),
        ("cells", CELLS, tuple(CELLS)),
        ("losses", LOSSES, DEFAULT_LOSSES),
    ):
        parser.add_argument(
            f"--{option}",
            nargs="+",
            choices=list(choices),
            default=list(default),
            help=f"summarise only these {option} (default: {', '.join(default)})",
        )
    parser.add_argument(
        "--pretrainings",
        nargs="+",
        type=Path,
        metavar="OUT",
        help="one study folder per pretraining seed (OUT is the first): the pretraining variance, "
        "by default of the fixed-batch cells fb_k2 / fb_k8 and soprc / ap / smooth_ap",
    )
    parser.add_argument("--seed", type=int, default=0, help="fine-tuning seed for --pretrainings")
    args = parser.parse_args(argv)
    if args.pretrainings:
        return _main_pretrainings(args)
    if not args.out.is_dir():
        print(
            f"no study folder {args.out}; run benchmarks/studies/sampling_rate.sh", file=sys.stderr
        )
        return 2
    starts, cells, losses = tuple(args.starts), tuple(args.cells), tuple(args.losses)
    text = tables(args.out, starts, cells, losses)
    total = sum(
        len(SEEDS) - len(_finished(args.out, s, c, loss))
        for s in starts
        for c in cells
        for loss in losses
    )
    text += (
        f"\n\nUnfinished runs: {total} of {len(starts) * len(cells) * len(SEEDS) * len(losses)}.\n"
    )
    if args.paired:
        text += "\n" + paired(args.out) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


def _main_pretrainings(args: argparse.Namespace) -> int:
    outs = [args.out, *args.pretrainings]
    absent = [str(out) for out in outs if not out.is_dir()]
    if absent:
        print(
            f"no study folder {', '.join(absent)}; run benchmarks/studies/sampling_rate.sh "
            "with PRETRAIN_SEED",
            file=sys.stderr,
        )
        return 2
    # the defaults of this mode: the fixed-batch cells and the losses the claim is about
    cells = ("fb_k2", "fb_k8") if args.cells == list(CELLS) else tuple(args.cells)
    losses = (
        ("soprc", "ap", "smooth_ap") if args.losses == list(DEFAULT_LOSSES) else tuple(args.losses)
    )
    text, missing = pretraining_variance(outs, cells, losses, args.seed)
    text += f"\n\nMissing runs: {missing} of {len(outs) * len(cells) * len(losses)}.\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
