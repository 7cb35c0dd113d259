"""``rankwise train``: one training run from a YAML config, or the resumption of one.

A config with ``KEY=VALUE`` overrides, or ``--resume RUN_DIR``, run by the image-retrieval protocol
of Wen et al. (NeurIPS 2022), Sec. 5.1 (model selection on validation mAUPRC, test report of the
selected model). Ctrl-C / SIGTERM saves a checkpoint; exit codes as
:func:`~rankwise.commands.common.cli_errors`.

Under ``torchrun --nproc-per-node N -m rankwise train ...`` the run is data-parallel (the training
factory chooses the strategy and joins the process group, :mod:`rankwise.training.launch`): rank 0
writes the run directory and prints, also the one-line message of a failed or interrupted run
(every rank writes it to torchrun's error file, which torchrun's summary shows); the other ranks
print only unexpected errors. See docs/distributed.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from .common import cli_errors, output_console, train_resume_command

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


def _print_result(console: Any, result: Any) -> None:
    """The closing lines of a run: the test table (of the selected model) and where files are."""
    from ..reporting import report_table

    run_dir = result.run_dir
    overflow = getattr(result, "overflow_steps", None)
    if overflow is not None:  # precision "16": the steps the loss scaler skipped
        console.print(
            f"precision 16: {overflow} of {result.steps} steps skipped (float16 gradient overflow)",
            soft_wrap=True,
        )
    if result.status == "stopped":
        console.print(
            f"stopped after step {result.steps} (--max-steps) with a checkpoint; continue with: "
            f"{train_resume_command(run_dir)}",
            soft_wrap=True,
        )
        return
    from ..training.monitor import monitor_label, monitor_of, monitor_value

    monitor = monitor_of(result.config)
    label = monitor_label(monitor)
    if result.status == "stopped_early":
        console.print(f"stopped early at step {result.steps}: {result.stop_reason}", soft_wrap=True)
    if result.test is not None:
        selected = (
            f"the model selected on validation {label} (step {result.best_step} of {result.steps})"
            if result.best_step is not None
            else f"the final model (step {result.steps}; no validation data)"
        )
        console.print(report_table(result.test, title=f"Test results of {selected}"))
    if result.best_step is not None:
        console.print(
            f"best validation {label} {monitor_value(result.best_val, monitor):.4f} at step "
            f"{result.best_step} "
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


def _resume_line(trainer: Any) -> str:
    """What a resumption does: continue, start again, train on past the budget, or test again."""
    run, step, total = trainer.run_dir, trainer.step, trainer.total_steps
    store = trainer.store
    if store.restarted:
        return (
            f"{run} stopped before its first checkpoint: training it again from step 0 to "
            f"{total} with its config.yaml"
        )
    if trainer.stopped_early is not None:
        return (
            f"{run} is finished: it stopped early at step {step} of {total} "
            f"({trainer.stopped_early}); testing its selected model again"
        )
    if store.extended_from is not None:
        return f"resuming {run} at step {step}: {_extension(trainer, store.extended_from)}"
    if step >= total:
        return (
            f"{run} completed its {total} steps: testing its selected model again (to train "
            f"on, pass --max-steps N above {total})"
        )
    return f"resuming {run} at step {step}/{total}"


def _extension(trainer: Any, old: int) -> str:
    """The sentence saying how a budget was extended and what the learning rate does."""
    from ..training.build import learning_rate_at

    new = trainer.total_steps
    replaced = (
        f"; the {old}-step report.json is replaced at the end"
        if trainer.paths.report.is_file()
        else ""
    )
    said = (
        f"its budget of {old} steps is extended to {new} (budget.iterations={new} in its "
        f"config.yaml{replaced})"
    )
    config = trainer.config
    if config is not None and config.schedule.name == "cosine":
        ended = learning_rate_at(config, old - 1, total_steps=old)
        said += (
            f"; the cosine learning rate follows the {new}-step schedule from step {old + 1}: "
            f"{trainer.learning_rate(old):.3g}, where the {old}-step one ended at {ended:.3g}"
        )
    return said


def _first_line(
    config: Path | None, resume: Path | None, overrides: list[str], shortcuts: dict[str, Any]
) -> str | None:
    """What the command runs and where, from the YAML alone: before torch and the data load.

    None when the file cannot be read as a mapping (the full load then says why). The run
    folder is the one :meth:`Config.resolved_output_dir` gives (a test checks they agree).
    """
    import yaml

    if resume is not None:
        return f"rankwise train: resuming the run in {resume} (loading it)"
    try:
        data: Any = yaml.safe_load(Path(config).read_text(encoding="utf-8")) if config else None
        for item in overrides + [f"{k}={v}" for k, v in shortcuts.items() if v is not None]:
            key, _, raw = item.partition("=")
            *sections, last = key.strip().split(".")
            node: Any = data
            for part in sections:
                node = node.setdefault(part, {})
            node[last] = yaml.safe_load(raw) if raw.strip() else None
        dataset, loss = data["dataset"]["name"], data["loss"]["name"]
        seed, budget = data.get("seed", 0), data.get("budget") or {}
        out = data.get("output_dir") or Path("runs") / str(dataset) / f"{loss}-seed{seed}"
    except Exception:  # noqa: BLE001 - an announcement only; the real load reports the error
        return None
    length = (
        f"{budget['iterations']} steps"
        if budget.get("iterations")
        else f"{budget.get('epochs')} epochs"
    )
    return f"rankwise train: {loss} on {dataset}, {length}, seed {seed} -> run folder {out}"


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
            f"{', '.join(changed)} (only --num-workers and --device may change, --data-dir "
            "may point at the same data moved, --max-steps may extend the budget)."
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
        None,
        "--data-dir",
        metavar="DIR",
        help="Dataset folder (dataset.data_dir). With --resume: the run's data moved here "
        "(checked against the run's data.json).",
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
        help="Stop after this many steps in total, with a checkpoint (continue with --resume). "
        "With --resume: train on to this step, extending a smaller budget to it.",
    ),
    no_preflight: bool = typer.Option(
        False,
        "--no-preflight",
        help="Do not open every image file before the first step (dataset.preflight=false).",
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
        "max_steps": max_steps,
        "preflight": False if no_preflight else None,
    }
    failure: BaseException | None = None
    # the first line at once, before torch loads and the data is read (seconds to minutes)
    shortcuts = {"output_dir": output, "seed": seed}
    first = _first_line(config, resume, list(overrides or []), shortcuts)
    # under torchrun rank 0 alone speaks (RANK read here: _distributed would import torch)
    if first is not None and os.environ.get("RANK", "0") == "0":
        console.print(first, soft_wrap=True, markup=False, highlight=False)
    try:
        with cli_errors("training", FLAGS) as err:
            trainer = _build_trainer(list(overrides or []), config, resume, output, options, err)
            if not trainer.is_main_process:
                console = output_console(140, quiet=True)
            said = _resume_line(trainer) if resume is not None else None
            if said is None and max_steps is not None and max_steps > trainer.total_steps:
                said = (
                    f"note: --max-steps {max_steps} is past the run's budget of "
                    f"{trainer.total_steps} steps: it completes at step {trainer.total_steps} "
                    f"(to train {max_steps} steps set budget.iterations={max_steps})"
                )
            if said is not None:
                console.print(said, soft_wrap=True, markup=False, highlight=False)
            start = _start_line(trainer.config, resumed=resume is not None)
            if start is not None:  # the options that change the start say they took effect
                console.print(start, soft_wrap=True, markup=False, highlight=False)
            # the run's one signal handler, also over the closing lines: once the outcome is
            # saved a signal lets them finish (exit 0), a second aborts saying what is kept
            with trainer.stop_control.handling():
                result = trainer.fit(max_steps=max_steps)
                _print_result(console, result)
    except BaseException as exc:
        failure = exc
        raise
    finally:
        trainer = None  # its DDP wrapper holds the process group, which must end now
        from ..training.launch import leave_process_group

        leave_process_group(failure)  # the group the training factory joined under torchrun


def _build_trainer(
    overrides: list[str],
    config: Path | None,
    resume: Path | None,
    output: Path | None,
    options: dict[str, Any],
    err: Any,
) -> Any:
    """The trainer of the command (data-parallel under torchrun: the factory's choice)."""
    from ..training import ConfigError, Trainer, load_config

    num_workers, device = options["num_workers"], options["device"]
    data_dir, seed = options["data_dir"], options["seed"]
    changed = [
        flag
        for flag, value in (
            ("--config", config),
            ("--output", output),
            ("--seed", seed),
            ("--no-preflight", options["preflight"]),
            ("KEY=VALUE overrides", overrides or None),
        )
        if value is not None
    ]
    _check_resume_options(resume, options["from_checkpoint"], options["overwrite"], changed)
    if resume is not None:
        trainer = Trainer.from_run_dir(
            resume,  # a folder holding one run is accepted
            num_workers=num_workers,
            device=device,
            console=err,
            checkpoint=options["from_checkpoint"],
            data_dir=data_dir,
            max_steps=options["max_steps"],
        )
        max_steps = options["max_steps"]
        if max_steps is not None and max_steps < trainer.step:
            trainer.store.release()
            raise ConfigError(
                f"--max-steps {max_steps}: {trainer.run_dir} is already at step {trainer.step} "
                f"(of {trainer.total_steps}); pass a larger number to train it on, or drop "
                "--max-steps."
            )
        return trainer
    if config is None:
        raise ConfigError("--config: pass a YAML config (or --resume RUN_DIR).")
    shortcuts = {
        "output_dir": output,
        "dataset.data_dir": data_dir,
        "dataset.preflight": options["preflight"],
        "seed": seed,
        "num_workers": num_workers,
        "device": device,
    }
    extra = [f"{key}={value}" for key, value in shortcuts.items() if value is not None]
    notes: list[str] = []
    run_config = load_config(config, overrides + extra, notes)
    for note in notes:
        err.print(f"note: {note}", soft_wrap=True, markup=False, highlight=False)
    return Trainer.from_config(run_config, overwrite=options["overwrite"], console=err)
