"""``rankwise train``: one training run from a YAML config, or the resumption of one.

A config with ``KEY=VALUE`` overrides, or ``--resume RUN_DIR``, run by the image-retrieval protocol
of Wen et al. (NeurIPS 2022), Sec. 5.1 (model selection on validation mAUPRC, test report of the
selected model). Ctrl-C / SIGTERM saves a checkpoint; exit codes as
:func:`~rankwise.commands.common.cli_errors`.

Under ``torchrun --nproc-per-node N -m rankwise train ...`` the run is data-parallel
(:class:`~rankwise.training.distributed.DistributedTrainer`): rank 0 writes the run directory and
prints, also the one-line message of a failed or interrupted run (every rank writes it to
torchrun's error file, which torchrun's summary shows); the other ranks print only unexpected
errors. See docs/distributed.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from .common import cli_errors, output_console, signal_name, train_resume_command

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
    "seed": "--seed",
    "data_dir": "--data-dir",
    "resume_from": "--from-checkpoint",
}


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
    """The closing lines of a run: the test table (of the selected model) and where files are."""
    from ..reporting import report_table

    run_dir = result.run_dir
    if result.status == "stopped":
        console.print(
            f"stopped after step {result.steps} (--max-steps) with a checkpoint; continue with: "
            f"{train_resume_command(run_dir)}",
            soft_wrap=True,
        )
        return
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
    console.print(f"run directory: {run_dir}", soft_wrap=True)
    console.print(f"report: {run_dir / 'report.json'}", soft_wrap=True)
    console.print(
        f"plots: {run_dir / 'training_curves.png'}, {run_dir / 'pr_curve.png'}", soft_wrap=True
    )


def _start_line(config: Any, resumed: bool) -> str | None:
    """The line saying that ``model.pretrained`` / ``optimizer.backbone_lr_mult`` took effect."""
    if config is None:
        return None
    said = []
    if config.model.pretrained is not None:
        path = Path(config.model.pretrained)
        path = path / "pretrained.pt" if path.is_dir() else path
        when = "the run started" if resumed else "the model starts"
        said.append(f"{when} from the pretrained weights {path} (model.pretrained)")
    mult, lr = config.optimizer.backbone_lr_mult, config.optimizer.lr
    if mult != 1:
        said.append(
            f"the backbone trains at {mult:g} x the scheduled learning rate "
            f"(optimizer.backbone_lr_mult; {mult * lr:g} at optimizer.lr={lr:g})"
        )
    return "; ".join(said) if said else None


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
    options = {
        "num_workers": num_workers,
        "device": device,
        "overwrite": overwrite,
        "from_checkpoint": from_checkpoint,
        "data_dir": data_dir,
        "seed": seed,
    }
    failure: BaseException | None = None
    try:
        with cli_errors("training", FLAGS) as err:
            trainer, rank = _build_trainer(
                list(overrides or []), config, resume, output, options, err
            )
            if rank != 0:
                console = output_console(140, quiet=True)
            if resume is not None:
                console.print(
                    f"resuming {trainer.run_dir} at step {trainer.step}/{trainer.total_steps}",
                    soft_wrap=True,
                )
            start = _start_line(trainer.config, resumed=resume is not None)
            if start is not None:  # the options that change the start say they took effect
                console.print(start, soft_wrap=True, markup=False, highlight=False)
            with _finish_when_saved(trainer) as saved:
                result = trainer.fit(max_steps=max_steps)
                saved.append(result.status)
                _print_result(console, result)
    except BaseException as exc:
        failure = exc
        raise
    finally:
        trainer = None  # its DDP wrapper holds the process group, which must end now
        from ..training.distributed import launched_by_torchrun, shutdown_distributed

        if launched_by_torchrun():  # leave the process group this command joined
            shutdown_distributed(failure)


@contextmanager
def _finish_when_saved(trainer: Any) -> Iterator[list[str]]:
    """Ctrl-C / SIGTERM once the run's outcome is saved: finish the command, exit 0.

    Once the run completed or stopped at ``--max-steps`` with its checkpoint, the first signal is
    noted and plots and table are finished; a second aborts (128 + its number), saying the results
    are kept. The caller appends the status to the yielded list when ``fit`` returns.
    """
    import signal

    from rich.markup import escape

    from .._signals import handle_signals, signal_number_of

    saved: list[str] = []
    noted: list[int] = []

    def outcome() -> str | None:
        return "completed" if trainer.completed else (saved[0] if saved else None)

    def on_signal(signum: int) -> bool:
        if outcome() is None or noted:
            return False  # the run is not saved yet, or a second signal: raise at once
        noted.append(signum)
        again = "Ctrl-C again" if signum == signal.SIGINT else f"another {signal_name(signum)}"
        trainer.console.print(
            f"[yellow]{signal_name(signum)} after the run {outcome()}: nothing is lost; finishing "
            f"({again} aborts at once).[/yellow]",
            soft_wrap=True,
        )
        return True

    with handle_signals(on_signal):
        try:
            yield saved
        except KeyboardInterrupt as exc:
            if outcome() is None:
                raise
            signum = signal_number_of(exc)
            where = escape(str(trainer.run_dir))
            trainer.console.print(
                f"[yellow]{signal_name(signum)}: aborted after the run {outcome()}; what it saved "
                f"is kept in {where} (plots may be missing).[/yellow]",
                soft_wrap=True,
            )
            raise typer.Exit(128 + signum) from None


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
    from ..training.config import read_config_file
    from ..training.distributed import DistributedTrainer, launched_by_torchrun
    from ..training.rundir import resolve_run_dir
    from ..training.state import RunPaths

    num_workers, device = options["num_workers"], options["device"]
    data_dir, seed = options["data_dir"], options["seed"]
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
    _check_resume_options(resume, options["from_checkpoint"], options["overwrite"], changed)
    trainer_class: Any = DistributedTrainer if launched_by_torchrun() else Trainer
    if resume is not None:
        run_dir = resolve_run_dir(resume)  # a folder holding one run is accepted
        try:  # an unreadable config.yaml: the resume below reports it
            saved = read_config_file(RunPaths(run_dir).config)
        except ConfigError:
            saved = {}
        rank = _join_process_group(saved, device)
        trainer = trainer_class.from_run_dir(
            run_dir,
            num_workers=num_workers,
            device=device,
            console=err,
            checkpoint=options["from_checkpoint"],
        )
        return trainer, rank
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
    run_config = load_config(config, overrides + extra, notes)
    for note in notes:
        err.print(f"note: {note}", soft_wrap=True, markup=False, highlight=False)
    rank = _join_process_group(run_config.to_dict(), None)
    trainer = trainer_class.from_config(run_config, overwrite=options["overwrite"], console=err)
    return trainer, rank
