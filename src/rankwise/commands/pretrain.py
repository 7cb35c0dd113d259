"""``rankwise pretrain``: a pretrained start for the runs of a config (cross-entropy on categories).

Reads a run config's dataset and model sections (with ``KEY=VALUE`` overrides) and runs
:func:`rankwise.workflows.pretrain.pretrain` in the Trainer's loop: progress as ``rankwise train``
shows it, checkpoints, Ctrl-C / SIGTERM stop with a checkpoint and ``rankwise pretrain --resume
DIR`` continues bit for bit. Exit codes as :func:`~rankwise.commands.common.cli_errors`. No paper
equation is implemented here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from .common import cli_errors, output_console

__all__ = ["pretrain"]

FLAGS = {
    "output": "--output",
    "overwrite": "--overwrite",
    "config": "--config",
    "resume": "--resume",
    "steps": "--steps",
    "output_dir": "--output",
    "run_dir": "--resume",
    "data_dir": "dataset.data_dir=DIR",  # no flag: a KEY=VALUE override
}


def _fresh(
    config: Path | None, output: Path | None, overrides: list[str], options: dict[str, Any]
) -> dict[str, Any]:
    """The pretraining's arguments from a config, its overrides and the options."""
    from ..training.config import ConfigError, load_config

    if config is None or output is None:
        missing = " and ".join(f for f, v in (("--config", config), ("--output", output)) if not v)
        raise ConfigError(
            f"{missing}: pass the runs' config and an output folder (or --resume DIR)."
        )
    cfg = load_config(config, overrides)
    if cfg.model.backbone_options:  # not dropped silently: the pretrained backbone would differ
        raise ConfigError(
            f"model.backbone_options: rankwise pretrain builds model.backbone without options, "
            f"this config sets {cfg.model.backbone_options}; give the backbone these values as "
            "its defaults and clear model.backbone_options."
        )
    return {
        "dataset": cfg.dataset.name,
        "output": output,
        "seed": cfg.seed,
        "embedding_dim": cfg.model.embedding_dim,
        "backbone": cfg.model.backbone,
        "frozen_bn": cfg.model.frozen_bn,
        "dataset_options": cfg.dataset.options,
        "split_seed": cfg.dataset.split_seed,
        "data_dir": cfg.dataset.data_dir,
        "threads": cfg.threads,
        **options,
    }


def _refuse_with_resume(given: dict[str, object]) -> None:
    from ..training.config import ConfigError

    changed = [flag for flag, value in given.items() if value not in (None, False, [])]
    if changed:
        raise ConfigError(
            f"--resume continues a pretraining with its saved settings; drop {', '.join(changed)}."
        )


def pretrain(
    overrides: list[str] | None = typer.Argument(
        None, metavar="[KEY=VALUE]...", help="Config overrides, e.g. seed=1.", show_default=False
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", metavar="FILE", help="The runs' config."
    ),
    output: Path | None = typer.Option(
        None, "--output", "-o", metavar="DIR", help="Output folder."
    ),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        metavar="DIR",
        help="Continue the interrupted pretraining in DIR from its last checkpoint.",
    ),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Adam steps (default 400)."),
    lr: float | None = typer.Option(
        None, "--lr", min=0.0, help="Adam learning rate (default 0.001)."
    ),
    batch_size: int | None = typer.Option(
        None, "--batch-size", min=1, help="Views per step (default 128)."
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Delete the pretraining in the output folder and start afresh."
    ),
) -> None:
    """Pretrain a config's backbone on its training sources' categories; writes pretrained.pt.

    Progress: a bar in a terminal, a line every 10 s otherwise. Ctrl-C / SIGTERM stop after the
    current step with a checkpoint; rankwise pretrain --resume DIR continues it bit for bit.
    """
    console = output_console()
    with cli_errors("pretraining", FLAGS) as err:
        from ..training import ConfigError, TrainingInterrupted
        from ..training.errors import CorruptCheckpointError
        from ..workflows.pretrain import pretrain as run_pretrain
        from ..workflows.pretrain import read_pretrain_settings

        options = {"steps": steps, "lr": lr, "batch_size": batch_size}
        if resume is not None:
            _refuse_with_resume(
                {
                    "--config": config,
                    "--output": output,
                    "--overwrite": overwrite,
                    **{f"--{k.replace('_', '-')}": v for k, v in options.items()},
                    "KEY=VALUE overrides": overrides,
                }
            )
            arguments = {**read_pretrain_settings(resume), "output": resume}
        else:
            defaults = {"steps": 400, "lr": 1e-3, "batch_size": 128}
            chosen = {k: defaults[k] if v is None else v for k, v in options.items()}
            arguments = _fresh(config, output, list(overrides or []), chosen)
        folder = Path(arguments.pop("output"))
        _announce(err, arguments, folder, resume is not None)
        try:
            report = run_pretrain(
                arguments.pop("dataset"),
                folder,
                resume=resume is not None,
                overwrite=overwrite,
                console=err,
                **arguments,
            )
        except TrainingInterrupted as exc:
            exc.resume_command = f"rankwise pretrain --resume {folder}"
            raise
        except CorruptCheckpointError as exc:  # its advice would name `rankwise train`
            raise ConfigError(
                f"--resume: checkpoint {exc.path} is corrupt: {exc.reason}; the pretraining "
                f"cannot continue from it: start it afresh with --overwrite."
            ) from None
    _print_result(console, folder, report)


def _announce(err: Any, arguments: dict[str, Any], folder: Path, resume: bool) -> None:
    what = "resuming the pretraining" if resume else "pretraining"
    err.print(
        f"{what} of {arguments['backbone']} on the training sources' categories of "
        f"{arguments['dataset']}: {arguments['steps']} steps of {arguments['batch_size']} views "
        f"-> {folder} (Ctrl-C / SIGTERM stop with a checkpoint; continue with rankwise pretrain "
        f"--resume {folder})",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )


def _print_result(console: Any, folder: Path, report: dict[str, Any]) -> None:
    scratch, tuned = report["spread_scratch"], report["spread_pretrained"]
    val = report["val_accuracy"]
    console.print(
        f"wrote {folder / 'pretrained.pt'}: train accuracy {report['train_accuracy']:.3f}, "
        + ("no validation split" if val is None else f"val accuracy {val:.3f}")
        + f", test mean negative cosine {scratch['mean_negative_cosine']:.3f} (scratch) -> "
        f"{tuned['mean_negative_cosine']:.3f} (pretrained)",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
