"""``rankwise train``: one training run from a YAML config, or the resumption of one.

``rankwise train``: one training run from a YAML config with ``KEY=VALUE`` overrides, or the
resumption of an interrupted run (``--resume RUN_DIR``), following the image-retrieval protocol of
Wen et al., *Exploring the Algorithm-Dependent Generalization of AUPRC Optimization with List
Stability* (NeurIPS 2022), Sec. 5.1 (model selection on validation mAUPRC, test report of the
selected model). Configuration errors end with a message naming the key and exit code 2; Ctrl-C
saves a checkpoint and exits with code 130; a NaN/inf loss exits with code 1.

Under ``torchrun --nproc-per-node N -m rankwise train ...`` every process runs this command and
the run is data-parallel (:class:`~rankwise.training.distributed.DistributedTrainer`, backend
``distributed.backend``): rank 0 writes the run directory and prints, the other ranks print only
errors. See docs/distributed.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    "max_steps": "--max-steps",
}


def _read_run_config(run_dir: Path) -> dict[str, Any]:
    """The saved config of a run as a dict (empty when missing: the resume reports it)."""
    import yaml

    path = run_dir / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text()) if path.is_file() else {}
    except yaml.YAMLError:
        data = {}
    return data if isinstance(data, dict) else {}


def _join_process_group(config: dict[str, Any], device: str | None) -> int:
    """Under torchrun, join the process group (``config``'s backend and device); the rank."""
    from ..training.distributed import init_distributed, launched_by_torchrun

    if not launched_by_torchrun():
        return 0
    settings = config.get("distributed") or {}
    context = init_distributed(
        backend=settings.get("backend", "auto"), device=device or config.get("device", "auto")
    )
    return context.rank


def _print_result(console: Any, result: Any) -> None:
    run_dir = result.run_dir
    if result.status == "stopped":
        console.print(
            f"stopped after step {result.steps} (--max-steps) with a checkpoint; continue with: "
            f"rankwise train --resume {run_dir}",
            soft_wrap=True,
        )
        return
    console.print(str(result.test))
    if result.best_step is not None:
        console.print(
            f"best validation mAP {result.best_val['map']:.4f} at step {result.best_step} "
            f"of {result.steps}; {result.seconds:.1f} s"
        )
    console.print(f"run directory: {run_dir}", soft_wrap=True)
    console.print(f"report: {run_dir / 'report.json'}", soft_wrap=True)
    console.print(
        f"plots: {run_dir / 'training_curves.png'}, {run_dir / 'pr_curve.png'}", soft_wrap=True
    )


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
    max_steps: int | None = typer.Option(
        None,
        "--max-steps",
        min=0,
        help="Stop after this many steps in total, with a checkpoint (continue with --resume).",
    ),
) -> None:
    """Train an embedding model with a ranking loss; writes checkpoints, metrics and plots.

    Data-parallel on several processes: torchrun --nproc-per-node N -m rankwise train ...
    """
    console = output_console(140)
    options = {"num_workers": num_workers, "device": device, "overwrite": overwrite}
    try:
        with cli_errors("training", FLAGS) as err:
            trainer, rank = _build_trainer(
                list(overrides or []), config, resume, output, options, err
            )
            if rank != 0:
                console = output_console(140, quiet=True)
            if resume is not None:
                console.print(f"resuming {resume} at step {trainer.step}/{trainer.total_steps}")
            result = trainer.fit(max_steps=max_steps)
        _print_result(console, result)
    finally:
        _leave_process_group()


def _leave_process_group() -> None:
    """Under torchrun, leave the process group this command joined."""
    import torch.distributed as dist

    from ..training.distributed import launched_by_torchrun

    if launched_by_torchrun() and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _build_trainer(
    overrides: list[str],
    config: Path | None,
    resume: Path | None,
    output: Path | None,
    options: dict[str, Any],
    err: Any,
) -> tuple[Any, int]:
    """The trainer of the command (data-parallel under torchrun) and this process's rank."""
    from ..training import ConfigError, Trainer, load_config
    from ..training.distributed import DistributedTrainer, launched_by_torchrun

    num_workers, device = options["num_workers"], options["device"]
    trainer_class: Any = DistributedTrainer if launched_by_torchrun() else Trainer
    if resume is not None:
        if config is not None or overrides or output is not None:
            raise ConfigError(
                "--resume continues a run with its saved config.yaml; drop --config, "
                "--output and KEY=VALUE overrides (only --num-workers and --device may change)."
            )
        rank = _join_process_group(_read_run_config(resume), device)
        trainer = trainer_class.from_run_dir(
            resume, num_workers=num_workers, device=device, console=err
        )
        return trainer, rank
    if config is None:
        raise ConfigError("--config: pass a YAML config (or --resume RUN_DIR).")
    extra = [
        f"{key}={value}"
        for key, value in (("output_dir", output), ("num_workers", num_workers), ("device", device))
        if value is not None
    ]
    run_config = load_config(config, overrides + extra)
    rank = _join_process_group(run_config.to_dict(), None)
    trainer = trainer_class.from_config(run_config, overwrite=options["overwrite"], console=err)
    return trainer, rank
