"""``rankwise tune``: hyper-parameter selection on the validation split.

As Wen et al. (NeurIPS 2022), Sec. 5.1 and App. D.1, tuned every loss: each point of a ``--grid`` is
trained per loss by the ``rankwise bench`` protocol and scored by its mean validation mAUPRC over
the seeds (:mod:`rankwise.workflows.tune`); writes ``tune.json`` and ``tuned.yaml`` (the winners as
``bench.overrides``) for ``rankwise bench --config tuned.yaml``.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import typer

from .bench import (
    FLAGS,
    option_overrides,
    print_outputs,
    read_base_config,
    refuse_resume_options,
)
from .common import cli_errors, loss_list, output_console, sweep_first_line

__all__ = ["bench_command", "tune"]


def _fresh_settings(
    overrides: list[str],
    dataset: str | None,
    config: Path | None,
    losses: str | None,
    grid: list[str],
    options: dict,
) -> dict:
    """The tuning settings from the command line (base config, losses, grid).

    The ``KEY=VALUE`` overrides win over ``--quick``'s budget, as in ``rankwise bench``
    (:func:`~rankwise.workflows.tune.overrides_over_quick`); the tuning makes ``model.pretrained``
    absolute, so ``tuned.yaml`` loads from any directory.
    """
    from ..training import ConfigError
    from ..training.config import apply_overrides, parse_overrides
    from ..workflows.tune import overrides_over_quick, parse_grid_values

    base = read_base_config(dataset, config)
    extra = parse_overrides(overrides)
    for key in extra:
        if key == "loss" or key.startswith("loss."):
            raise ConfigError(
                f"{key}: the loss is chosen per trial; pass --losses, and a fixed loss "
                f"parameter as --grid {key}=VALUE."
            )
    extra.update(options)
    base = overrides_over_quick(apply_overrides(base, extra), extra)
    parsed_grid: dict[str, list] = {}
    for item in grid:
        key, values = parse_grid_values(item)
        if key in parsed_grid:
            raise ConfigError(f"--grid {key} is given twice; list all its values once.")
        parsed_grid[key] = values
    return {"base": base, "losses": loss_list(losses), "grid": parsed_grid}


def bench_command(tuned_path: Path, quick: bool) -> str:
    """How ``tuned.yaml``'s header says to reproduce the test table: the ``rankwise bench`` command.

    >>> bench_command(Path("runs/tune/tuned.yaml"), True)
    '`rankwise bench --config runs/tune/tuned.yaml --seeds 3` (tuned with --quick budgets)'
    """
    command = f"`rankwise bench --config {tuned_path} --seeds 3`"
    return command + (" (tuned with --quick budgets)" if quick else "")


def tune(
    overrides: list[str] | None = typer.Argument(
        None,
        metavar="[KEY=VALUE]...",
        help="Overrides of the base config (not loss.*: use --grid KEY=VALUE "
        "for a fixed loss parameter).",
        show_default=False,
    ),
    dataset: str | None = typer.Option(
        None, "--dataset", "-d", help="digits, fashion-mnist, ... (selects configs/<dataset>.yaml)."
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", metavar="FILE", help="Base YAML config."
    ),
    losses: str | None = typer.Option(
        None,
        "--losses",
        help="Comma-separated losses, or `all` (default): every loss of the config's bench.losses.",
    ),
    grid: list[str] | None = typer.Option(
        None,
        "--grid",
        "-g",
        metavar="KEY=V1,V2,...",
        help="Values parsed as YAML, repeatable; e.g. "
        "optimizer.lr=0.0003,0.001,0.003 or loss.params.beta=0.01,0.1. A loss.params key is "
        "skipped for losses that do not take it.",
    ),
    seeds: int | None = typer.Option(
        None, "--seeds", min=1, help="Number of tuning seeds 0..n-1 (default 1)."
    ),
    quick: bool = typer.Option(False, "--quick", help="Short budget (bench.quick in the config)."),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        metavar="DIR",
        help="Output directory (default runs/tune/<dataset>).",
    ),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        metavar="DIR",
        help="Continue the interrupted sweep in DIR with its saved settings.",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Delete the results of a previous sweep in the output directory."
    ),
    data_dir: str | None = typer.Option(
        None, "--data-dir", metavar="DIR", help="Dataset directory."
    ),
    device: str | None = typer.Option(None, "--device", help="auto, cpu or cuda."),
    num_workers: int | None = typer.Option(None, "--num-workers", min=0),
) -> None:
    """Select each loss's hyper-parameters on validation mAP; write tune.json and tuned.yaml."""
    console = output_console(160)
    first = sweep_first_line(
        "tune",
        "hyper-parameter selection on validation mAP",
        dataset=dataset,
        config=config,
        output=output,
        resume=resume,
    )
    if first is not None:  # at once: torch, the data and numba's warm-up take seconds
        console.print(first, soft_wrap=True, markup=False, highlight=False)
    with cli_errors("tune", FLAGS):
        from ..reporting import print_tune_table
        from ..training import TrainingInterrupted
        from ..workflows.sweepdir import SweepPaths
        from ..workflows.tune import resume_tune
        from ..workflows.tune import tune as run_tune

        if resume is not None:
            given = {
                "--dataset": dataset,
                "--config": config,
                "--losses": losses,
                "--grid": grid,
                "--seeds": seeds,
                "--quick": quick,
                "--output": output,
                "--overwrite": overwrite,
                "--data-dir": data_dir,
                "KEY=VALUE overrides": overrides,
            }
            refuse_resume_options("tune", given)
            out = resume
            # the sweep engine locks the folder, then reads its sweep.json
            run = partial(
                resume_tune, resume, device=device, num_workers=num_workers, argument="resume"
            )
        else:
            options = option_overrides(dataset, data_dir, device, num_workers)
            plan = _fresh_settings(
                list(overrides or []), dataset, config, losses, list(grid or []), options
            )
            plan.update(seeds=list(range(seeds or 1)), quick=quick)
            name = str((plan["base"].get("dataset") or {}).get("name", "tune")).replace("_", "-")
            out = output if output is not None else Path("runs") / "tune" / name
            run = partial(run_tune, **plan, output=out, overwrite=overwrite)
        try:
            summary = run(console=console, reproduce=bench_command)
        except TrainingInterrupted as exc:
            exc.resume_command = f"rankwise tune --resume {out}"
            raise
    print_tune_table(summary, console)
    for loss, winner in summary["winners"].items():
        if winner is None:
            console.print(
                f"[red]{loss}: every trial diverged; its bench overrides are "
                "unchanged in tuned.yaml[/red]",
                soft_wrap=True,
            )
    print_outputs(console, results=[SweepPaths(out).tune_json, Path(summary["tuned_config"])])
