"""``rankwise train``: one training run from a YAML config, or the resumption of one.

``rankwise train``: one training run from a YAML config with ``KEY=VALUE`` overrides, or the
resumption of an interrupted run (``--resume RUN_DIR``), following the image-retrieval protocol of
Wen et al., *Exploring the Algorithm-Dependent Generalization of AUPRC Optimization with List
Stability* (NeurIPS 2022), Sec. 5.1 (model selection on validation mAUPRC, test report of the
selected model). Configuration errors end with a message naming the key and exit code 2; Ctrl-C
saves a checkpoint and exits with code 130; a NaN/inf loss exits with code 1.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .common import cli_errors, output_console

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
}


def train(
    overrides: list[str] | None = typer.Argument(
        None,
        help="KEY=VALUE config overrides, e.g. loss.name=soprc optimizer.lr=0.01 "
        "loss.params.beta=0.1 (values parsed as YAML).",
        show_default=False,
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="YAML config (e.g. configs/digits.yaml)."
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue the run in this directory from checkpoints/last.pt."
    ),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Run directory (default: runs/<dataset>/<loss>-seed<seed>)."
    ),
    num_workers: int | None = typer.Option(
        None, "--num-workers", min=0, help="DataLoader worker processes."
    ),
    device: str | None = typer.Option(None, "--device", help="auto, cpu or cuda."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Start afresh in an output directory that holds a run."
    ),
) -> None:
    """Train an embedding model with a ranking loss; writes checkpoints, metrics and plots."""
    console = output_console(140)
    overrides = list(overrides or [])
    with cli_errors("training", FLAGS) as err:
        from ..training import ConfigError, Trainer, load_config

        if resume is not None:
            if config is not None or overrides or output is not None:
                raise ConfigError(
                    "--resume continues a run with its saved config.yaml; drop --config, "
                    "--output and KEY=VALUE overrides (only --num-workers and --device may change)."
                )
            trainer = Trainer.from_run_dir(
                resume, num_workers=num_workers, device=device, console=err
            )
            console.print(f"resuming {resume} at step {trainer.step}/{trainer.total_steps}")
        else:
            if config is None:
                raise ConfigError("--config: pass a YAML config (or --resume RUN_DIR).")
            extra = []
            if output is not None:
                extra.append(f"output_dir={output}")
            if num_workers is not None:
                extra.append(f"num_workers={num_workers}")
            if device is not None:
                extra.append(f"device={device}")
            trainer = Trainer.from_config(
                load_config(config, overrides + extra), overwrite=overwrite, console=err
            )
        result = trainer.fit()

    console.print(str(result.test))
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
