"""``rankwise train``: one training run from a YAML config, or the resumption of one.

``rankwise train``: one training run from a YAML config with ``KEY=VALUE`` overrides, or the
resumption of an interrupted run (``--resume RUN_DIR``), following the image-retrieval protocol of
Wen et al., *Exploring the Algorithm-Dependent Generalization of AUPRC Optimization with List
Stability* (NeurIPS 2022), Sec. 5.1 (model selection on validation mAUPRC, test report of the
selected model). Configuration errors end with a message naming the key and exit code 2; Ctrl-C
(SIGTERM) saves a checkpoint and exits with code 130 (143); a NaN/inf loss exits with code 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from .common import cli_errors, output_console

if TYPE_CHECKING:
    from rich.console import Console

    from ..training import RunResult

__all__ = ["FLAGS", "train"]

# argument / config key of the library -> flag of this command (see common.to_flags)
FLAGS = {
    "output_dir": "--output",
    "run_dir": "--resume",
    "resume": "--resume",
    "overwrite": "--overwrite",
    "config": "--config",
    "num_workers": "--num-workers",
    "device": "--device",
    "seed": "--seed",
    "data_dir": "--data-dir",
    "resume_from": "--from-checkpoint",
}


def _print_result(console: Console, result: RunResult) -> None:
    """The closing lines of a run: the test table (of the selected model) and where files are."""
    from ..reporting import report_table

    if result.test is not None:
        selected = (
            f"the model selected on validation mAP (step {result.best_step} of {result.steps})"
            if result.best_step is not None
            else f"the final model (step {result.steps}; no validation data)"
        )
        console.print(report_table(result.test, title=f"Test results of {selected}"))
    if result.best_step is not None:
        console.print(
            f"best validation mAP {result.best_val['map']:.4f} at step {result.best_step} "
            f"of {result.steps}; {result.seconds:.1f} s"
        )
    run_dir = result.run_dir
    console.print(f"run directory: {run_dir}", soft_wrap=True)
    console.print(f"report: {run_dir / 'report.json'}", soft_wrap=True)
    console.print(
        f"plots: {run_dir / 'training_curves.png'}, {run_dir / 'pr_curve.png'}", soft_wrap=True
    )


def _check_resume_options(
    resume: Path | None,
    from_checkpoint: Path | None,
    overwrite: bool,
    changed: list[str],
) -> None:
    from ..training import ConfigError

    if resume is None:
        if from_checkpoint is not None:
            raise ConfigError("--from-checkpoint names the checkpoint of a --resume; add --resume.")
        return
    if overwrite:
        raise ConfigError(
            "--resume continues a run and --overwrite deletes its results to start afresh; "
            "pass one of them."
        )
    if changed:
        raise ConfigError(
            "--resume continues a run with its saved config.yaml; drop "
            f"{', '.join(changed)} (only --num-workers and --device may change)."
        )


def train(
    overrides: list[str] | None = typer.Argument(
        None,
        metavar="[KEY=VALUE]...",
        help="Config overrides, e.g. loss.name=soprc optimizer.lr=0.01 "
        "loss.params.beta=0.1 (values parsed as YAML).",
        show_default=False,
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", metavar="FILE", help="YAML config (e.g. configs/digits.yaml)."
    ),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        metavar="RUN_DIR",
        help="Continue the run in this directory (or the one run below it) from "
        "checkpoints/last.pt.",
    ),
    from_checkpoint: Path | None = typer.Option(
        None,
        "--from-checkpoint",
        metavar="FILE",
        help="With --resume: continue from this checkpoint instead of last.pt "
        "(e.g. RUN_DIR/checkpoints/previous.pt).",
    ),
    output: Path | None = typer.Option(
        None,
        "--output",
        "-o",
        metavar="DIR",
        help="Run directory (default: runs/<dataset>/<loss>-seed<seed>).",
    ),
    data_dir: str | None = typer.Option(
        None, "--data-dir", metavar="DIR", help="Dataset folder (dataset.data_dir)."
    ),
    seed: int | None = typer.Option(None, "--seed", min=0, help="Training seed (seed=)."),
    num_workers: int | None = typer.Option(
        None, "--num-workers", min=0, help="DataLoader worker processes."
    ),
    device: str | None = typer.Option(None, "--device", help="auto, cpu or cuda."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Delete the results of a run in the output directory and start afresh.",
    ),
) -> None:
    """Train an embedding model with a ranking loss; writes checkpoints, metrics and plots."""
    console = output_console(140)
    overrides = list(overrides or [])
    with cli_errors("training", FLAGS) as err:
        from ..training import ConfigError, Trainer, load_config

        changed = [
            flag
            for flag, value in (
                ("--config", config),
                ("--output", output),
                ("--data-dir", data_dir),
                ("--seed", seed),
                ("KEY=VALUE overrides", overrides or None),
            )
            if value is not None
        ]
        _check_resume_options(resume, from_checkpoint, overwrite, changed)
        if resume is not None:
            trainer = Trainer.from_run_dir(
                resume,
                num_workers=num_workers,
                device=device,
                console=err,
                checkpoint=from_checkpoint,
            )
            console.print(
                f"resuming {trainer.run_dir} at step {trainer.step}/{trainer.total_steps}",
                soft_wrap=True,
            )
        else:
            if config is None:
                raise ConfigError("--config: pass a YAML config (or --resume RUN_DIR).")
            shortcuts = {
                "output_dir": output,
                "dataset.data_dir": data_dir,
                "seed": seed,
                "num_workers": num_workers,
                "device": device,
            }
            extra = [f"{key}={value}" for key, value in shortcuts.items() if value is not None]
            notes: list[str] = []
            loaded = load_config(config, overrides + extra, notes)
            for note in notes:
                err.print(f"note: {note}", soft_wrap=True, markup=False, highlight=False)
            trainer = Trainer.from_config(loaded, overwrite=overwrite, console=err)
        result = trainer.fit()
    _print_result(console, result)
