"""The pretrained-start benchmark table of docs/results.md (issue 21, item 5).

Every loss of ``configs/fashion_mnist_instances.yaml``'s ``bench.losses`` fine-tunes the backbone
pretrained by ``rankwise pretrain`` (its learning rate the head's, chosen on validation) at
π = 1/3,200, K = 4, batches of 64, 800 steps, seeds 0-2; the checkpoint is chosen on open-set
validation mAP and only then is the test split ranked. AP, SOPRC (defaults and two variants),
Smooth-AP, FastAP and contrastive are the K = 4 cell of the sampling-rate study
(benchmarks/studies/sampling_rate.sh, the same config and overrides, so the same runs); the other
losses come from ``rankwise bench`` sweeps (benchmarks/studies/pretrained_bench.sh). Missing runs
are listed, never silently dropped.

    python benchmarks/studies/pretrained_table.py --study runs/study21 \
        --bench runs/bench21_pre/xbm runs/bench21_pre/others [--markdown FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# (run folder name, row label), in the config's bench.losses order, SOPRC's released
# normalisation after the library default
ROWS = [
    ("contrastive", "contrastive (PML)"),
    ("triplet", "triplet, batch-hard (PML)"),
    ("multi_similarity", "multi-similarity (PML)"),
    ("xbm", "XBM, released form (warm-up 400 steps)"),
    ("fastap", "FastAP (PML)"),
    ("smooth_ap", "Smooth-AP"),
    ("roadmap", "ROADMAP"),
    ("recall_at_k", "Recall@k surrogate"),
    ("dir", "DIR"),
    ("blackbox_ap", "BlackBox-AP (λ = 4)"),
    ("auc", "AUC loss (batch-all)"),
    ("ap", "AP loss (biased)"),
    ("soprc", "SOPRC (defaults)"),
    ("soprc_numv", "SOPRC, `tpr_count=num_v`"),
    ("soprc_detach", "SOPRC, `detach_tpr=true`"),
]
STUDY_CELL = ("pretrained", "fb_k4")


def _report(run: Path) -> dict | None:
    path = run / "report.json"
    data = json.loads(path.read_text()) if path.exists() else None
    return data if data is not None and data.get("status") == "completed" else None


def _run_dir(loss: str, study: Path | None, benches: list[Path], seed: int) -> Path | None:
    """Where seed ``seed`` of ``loss`` was run: a bench sweep first, else the study cell."""
    for bench in benches:
        if (bench / loss / f"seed{seed}").is_dir():
            return bench / loss / f"seed{seed}"
    if study is not None:
        return study.joinpath(*STUDY_CELL, loss, f"seed{seed}")
    return None


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def table(study: Path | None, benches: list[Path], seeds: int = 3) -> tuple[str, list[str]]:
    """The markdown table (test metrics in %) and the runs that are missing or unfinished."""
    lines = [
        "| loss (π = 1/3,200, K = 4, pretrained) | mAUPRC | R@1 | R@10 | MAP@R "
        "| per seed (mAUPRC) | best step per seed |",
        "|---|---|---|---|---|---|---|",
    ]
    missing = []
    for loss, label in ROWS:
        reports = []
        for seed in range(seeds):
            run = _run_dir(loss, study, benches, seed)
            data = _report(run) if run is not None else None
            if data is None:
                missing.append(f"{loss} seed {seed} ({run})")
            else:
                reports.append(data)
        if not reports:
            lines.append(f"| {label} | — | — | — | — | — | — |")
            continue
        maps = [100 * r["test"]["map"] for r in reports]
        r1 = [100 * r["test"]["recall_at"]["1"] for r in reports]
        r10 = [100 * r["test"]["recall_at"]["10"] for r in reports]
        map_r = [100 * r["test"]["map_at_r"] for r in reports]
        seeds_note = "" if len(reports) == seeds else f" ({len(reports)} of {seeds} seeds)"
        lines.append(
            f"| {label}{seeds_note} | {_mean_std(maps)} | {_mean_std(r1)} | {_mean_std(r10)} "
            f"| {_mean_std(map_r)} | {', '.join(f'{m:.2f}' for m in maps)} "
            f"| {' / '.join(str(r['best_step']) for r in reports)} of {reports[0]['steps']} |"
        )
    lines += _reference_rows(benches)
    return "\n".join(lines), missing


def _reference_rows(benches: list[Path]) -> list[str]:
    """The no-learning rows of the first bench sweep, whose network is the pretrained one."""
    for bench in benches:
        summary = bench / "bench.json"
        if summary.exists():
            rows = json.loads(summary.read_text())["reference_rows"]
            names = {"untrained network": "pretrained network, before fine-tuning"}
            return [
                f"| *{names.get(row['label'], row['label'])}* | {100 * row['map_mean']:.2f} "
                f"| {100 * row['recall_at_1_mean']:.2f} | {100 * row['recall_at_10_mean']:.2f} "
                f"| {100 * row['map_at_r_mean']:.2f} | — | — |"
                for row in rows
            ]
    return []


def main(argv: list[str] | None = None) -> int:
    """Print (and optionally write) the table; exit 2 when no source folder exists."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--study", type=Path, help="the sampling-rate study's OUT folder")
    parser.add_argument("--bench", type=Path, nargs="*", default=[], help="rankwise bench outputs")
    parser.add_argument("--markdown", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    folders = [p for p in [args.study, *args.bench] if p is not None]
    absent = [str(p) for p in folders if not p.is_dir()]
    if not folders or absent:
        print(f"no such folder: {', '.join(absent) or '(none given)'}", file=sys.stderr)
        return 2
    text, missing = table(args.study, args.bench)
    text += f"\n\nMissing or unfinished runs: {len(missing)}" + "".join(f"\n- {m}" for m in missing)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
