"""``rankwise bench``: compare losses (Table 1) or ablate SOPRC (Table 2) on one dataset.

Every loss trained with the same backbone, sampler, budget and seeds on one dataset, reported
Table 1-style (mAUPRC = tie-aware mAP, R@1, R@10, MAP@R, mean ± std over seeds), or, with
``--ablation``, Table 2's SOPRC ablation (Wen et al., NeurIPS 2022, Sec. 5.2-5.3). Writes
``bench.json``, ``bench.md`` and ``pr_curves.png`` (Fig. 2 style) to the output directory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .common import cli_errors, loss_list, output_console, sweep_first_line

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "FLAGS",
    "bench",
    "default_config_path",
    "option_overrides",
    "print_outputs",
    "read_base_config",
    "refuse_resume_options",
]

# argument / config key of the library -> flag of bench and tune (see common.to_flags)
FLAGS = {
    "losses": "--losses",
    "seeds": "--seeds",
    "output": "--output",
    "quick": "--quick",
    "grid": "--grid",
    "overwrite": "--overwrite",
    "resume": "--resume",
    "data_dir": "--data-dir",
}


def default_config_path(dataset: str) -> Path:
    """The default config of a dataset: ``configs/<dataset>.yaml`` (``-`` read as ``_``).

    Looked up in the working directory, then in the source checkout rankwise is installed from.
    """
    name = f"{dataset.lower().replace('-', '_')}.yaml"
    candidates = [Path("configs") / name, Path(__file__).resolve().parents[3] / "configs" / name]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"--dataset {dataset}: no default config {name} in ./configs or "
        f"{candidates[1].parent}; pass --config base.yaml."
    )


def read_base_config(dataset: str | None, config: Path | None) -> dict:
    """The base config of a sweep (``bench`` / ``tune``), read by ``read_config_file``.

    ``--config FILE``, else the dataset's default ``configs/<dataset>.yaml``.

    Raises:
        ConfigError: neither option given, a missing file, invalid YAML, or not a mapping.
    """
    from ..training import ConfigError
    from ..training.config import read_config_file

    if config is None and dataset is None:
        raise ConfigError("pass --dataset NAME or --config base.yaml.")
    try:
        path = config if config is not None else default_config_path(str(dataset))
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    if not path.is_file():
        raise ConfigError(f"--config: file {str(path)!r} does not exist.")
    return read_config_file(path)


def option_overrides(
    dataset: str | None, data_dir: str | None, device: str | None, num_workers: int | None
) -> dict:
    """The dotted overrides the shared ``--dataset/--data-dir/--device/--num-workers`` stand for."""
    keys = ("dataset.name", "dataset.data_dir", "device", "num_workers")
    values = (dataset, data_dir, device, num_workers)
    return {key: value for key, value in zip(keys, values, strict=True) if value is not None}


def refuse_resume_options(kind: str, given: Mapping[str, object]) -> None:
    """Refuse ``--resume`` with an option that defines a sweep (its settings are the saved ones).

    Args:
        kind: ``"bench"`` or ``"tune"``.
        given: flag -> value of the options that define a sweep (all must be unset).

    Raises:
        ConfigError: one of them was given; the message names them.
    """
    from ..training import ConfigError

    changed = [flag for flag, value in given.items() if value not in (None, False, [], ())]
    if changed:
        raise ConfigError(
            f"--resume continues the {kind} sweep with its saved settings; drop "
            f"{', '.join(changed)} (only --device and --num-workers may change)."
        )


def bench(
    overrides: list[str] | None = typer.Argument(
        None,
        metavar="[KEY=VALUE]...",
        help="Overrides of the base config, applied to every run.",
        show_default=False,
    ),
    dataset: str | None = typer.Option(
        None, "--dataset", "-d", help="digits, fashion-mnist, ... (selects configs/<dataset>.yaml)."
    ),
    losses: str | None = typer.Option(
        None,
        "--losses",
        help="Comma-separated losses, or `all` (default): every loss of the config's bench.losses.",
    ),
    seeds: int | None = typer.Option(
        None, "--seeds", min=1, help="Number of seeds 0..n-1 (default 3; 1 with --quick)."
    ),
    quick: bool = typer.Option(False, "--quick", help="Short budget (bench.quick in the config)."),
    ablation: bool = typer.Option(False, "--ablation", help="Table 2 SOPRC ablation rows."),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        metavar="DIR",
        help="Output directory (default runs/bench/<dataset>).",
    ),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        metavar="DIR",
        help="Continue the interrupted sweep in DIR with its saved settings: finished runs are "
        "kept, the interrupted one continues from its checkpoint.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Delete the results of a previous sweep in the output directory."
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", metavar="FILE", help="Base YAML config."
    ),
    data_dir: str | None = typer.Option(
        None, "--data-dir", metavar="DIR", help="Dataset directory."
    ),
    device: str | None = typer.Option(None, "--device", help="auto, cpu or cuda."),
    num_workers: int | None = typer.Option(None, "--num-workers", min=0),
) -> None:
    """Compare losses (Table 1) or ablate SOPRC (Table 2) on one dataset."""
    console = output_console(140)
    what = "SOPRC ablation (Table 2)" if ablation else "loss comparison (Table 1)"
    first = sweep_first_line(
        "bench",
        what,
        dataset=dataset,
        config=config,
        output=output,
        resume=resume,
        suffix="-ablation" if ablation else "",
    )
    if first is not None:  # at once: torch, the data and numba's warm-up take seconds
        console.print(first, soft_wrap=True, markup=False, highlight=False)
    with cli_errors("bench", FLAGS):
        from ..reporting import print_bench_table
        from ..training import TrainingInterrupted
        from ..training.config import apply_overrides, parse_overrides
        from ..workflows.bench import resume_bench, run_bench
        from ..workflows.sweepdir import SweepPaths, read_sweep

        if resume is not None:
            given = {
                "--dataset": dataset,
                "--config": config,
                "--losses": losses,
                "--seeds": seeds,
                "--quick": quick,
                "--ablation": ablation,
                "--output": output,
                "--overwrite": overwrite,
                "--data-dir": data_dir,
                "KEY=VALUE overrides": overrides,
            }
            refuse_resume_options("bench", given)
            out = resume
            # the sweep engine locks the folder, then reads its sweep.json
            run = partial(
                resume_bench, resume, device=device, num_workers=num_workers, argument="resume"
            )
        else:
            base = read_base_config(dataset, config)
            extra = parse_overrides(list(overrides or []))
            # KEY=VALUE overrides go to every run last (on the base, `loss.*` values would be
            # dropped with the base loss); only `bench.*` keys shape the plan
            run_overrides = {k: v for k, v in extra.items() if not k.startswith("bench.")}
            extra = {k: v for k, v in extra.items() if k not in run_overrides}
            extra.update(option_overrides(dataset, data_dir, device, num_workers))
            base = apply_overrides(base, extra)
            n_seeds = seeds if seeds is not None else (1 if quick else 3)
            name = str((base.get("dataset") or {}).get("name", "bench")).replace("_", "-")
            out = (
                output
                if output is not None
                else (Path("runs") / "bench" / f"{name}{'-ablation' if ablation else ''}")
            )
            run = partial(
                run_bench,
                base,
                losses=loss_list(losses),
                seeds=list(range(n_seeds)),
                quick=quick,
                ablation=ablation,
                run_overrides=run_overrides,
                output=out,
                overwrite=overwrite,
            )
        try:
            summary = run(console=console)
        except TrainingInterrupted as exc:
            exc.resume_command = f"rankwise bench --resume {out}"
            raise
        if resume is not None:
            ablation = bool(read_sweep(out, "bench")["settings"]["ablation"])
    paths = SweepPaths(out)
    print_bench_table(summary, console, ablation)
    print_outputs(
        console,
        results=[paths.bench_json, paths.bench_table],
        plots=f"{paths.pr_curves_plot} (per run: <run>/pr_curve.png, <run>/training_curves.png)",
    )


def print_outputs(console: Console, *, results: Sequence[Path], plots: str | None = None) -> None:
    """Print the closing lines of a sweep: its ``results`` files (and ``plots``, one line)."""
    # soft_wrap: paths are printed whole, never broken across lines
    console.print(f"results: {', '.join(str(p) for p in results)}", soft_wrap=True)
    if plots is not None:
        console.print(f"plots: {plots}", soft_wrap=True)
