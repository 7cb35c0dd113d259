"""The cross-batch memory table of docs/results.md (issue 38, item 4).

Reads ``OUT/<loss>_<plain|mem>_s<seed>/`` of benchmarks/studies/memory_bench.sh: test metrics of
the checkpoint chosen on validation, mean ± sample std over seeds, the per-seed values, the
paired difference (memory − plain, per seed), the best step and the late validation gain (last
validation mAP minus the one before it, in points: near 0 when the run has stopped moving).
Missing or unfinished runs are listed, never silently dropped.

    python benchmarks/studies/memory_table.py OUT [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROWS = [
    ("ap", "plain", "AP loss (biased)"),
    ("ap", "mem", "AP loss + memory 256 (from step 800)"),
    ("soprc", "plain", "SOPRC (defaults)"),
    ("soprc", "mem", "SOPRC + memory 256 (from step 400)"),
]


def _report(run: Path) -> dict | None:
    path = run / "report.json"
    data = json.loads(path.read_text()) if path.exists() else None
    return data if data is not None and data.get("status") == "completed" else None


def _late_gain(run: Path) -> float:
    vals = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    maps = [r["map"] for r in vals if r.get("kind") == "val"]
    return 100 * (maps[-1] - maps[-2]) if len(maps) >= 2 else float("nan")


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def table(out: Path, seeds: int = 3) -> tuple[str, list[str]]:
    """The markdown table (test metrics in %) and the missing or unfinished runs."""
    lines = [
        "| loss (π = 1/3,200, K = 4, batch 64) | mAUPRC | R@1 | R@10 | MAP@R "
        "| per seed (mAUPRC) | memory − plain per seed | best step per seed | late val gain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    missing: list[str] = []
    maps_of: dict[tuple[str, str], dict[int, float]] = {}
    for loss, form, label in ROWS:
        reports = {}
        for seed in range(seeds):
            run = out / f"{loss}_{form}_s{seed}"
            data = _report(run)
            if data is None:
                missing.append(str(run))
            else:
                reports[seed] = (data, _late_gain(run))
        if not reports:
            lines.append(f"| {label} | — | — | — | — | — | — | — | — |")
            continue
        runs = [r for r, _ in reports.values()]
        maps = {s: 100 * r["test"]["map"] for s, (r, _) in reports.items()}
        maps_of[(loss, form)] = maps
        diff = "—"
        if form == "mem":
            plain = maps_of.get((loss, "plain"), {})
            diff = ", ".join(f"{maps[s] - plain[s]:+.2f}" for s in maps if s in plain) or "—"
        gains = [g for _, g in reports.values()]
        lines.append(
            f"| {label}{'' if len(runs) == seeds else f' ({len(runs)} of {seeds} seeds)'} "
            f"| {_mean_std(list(maps.values()))} "
            f"| {_mean_std([100 * r['test']['recall_at']['1'] for r in runs])} "
            f"| {_mean_std([100 * r['test']['recall_at']['10'] for r in runs])} "
            f"| {_mean_std([100 * r['test']['map_at_r'] for r in runs])} "
            f"| {', '.join(f'{m:.2f}' for m in maps.values())} | {diff} "
            f"| {' / '.join(str(r['best_step']) for r in runs)} of {runs[0]['steps']} "
            f"| {', '.join(f'{g:+.2f}' for g in gains)} |"
        )
    return "\n".join(lines), missing


def main(argv: list[str] | None = None) -> int:
    """Print (and optionally write) the table; exit 2 when OUT does not exist."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the OUT folder of memory_bench.sh")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        print(f"no such folder: {args.out} (run memory_bench.sh first)", file=sys.stderr)
        return 2
    text, missing = table(args.out)
    text += f"\n\nMissing or unfinished runs: {len(missing)}" + "".join(f"\n- {m}" for m in missing)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
