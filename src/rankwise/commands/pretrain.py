"""``rankwise pretrain``: a pretrained start for the runs of a config (cross-entropy on categories).

Reads a run config's dataset and model sections (with ``KEY=VALUE`` overrides) and runs
:func:`rankwise.workflows.pretrain.pretrain`. No paper equation is implemented here.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .common import cli_errors, output_console

__all__ = ["pretrain"]

FLAGS = {"output": "--output", "overwrite": "--overwrite", "config": "--config"}


def pretrain(
    overrides: list[str] | None = typer.Argument(
        None, metavar="[KEY=VALUE]...", help="Config overrides, e.g. seed=1.", show_default=False
    ),
    config: Path = typer.Option(..., "--config", "-c", metavar="FILE", help="The runs' config."),
    output: Path = typer.Option(..., "--output", "-o", metavar="DIR", help="Output folder."),
    steps: int = typer.Option(400, "--steps", min=0, help="Adam steps."),
    lr: float = typer.Option(1e-3, "--lr", min=0.0, help="Adam learning rate."),
    batch_size: int = typer.Option(128, "--batch-size", min=1, help="Views per step."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace pretrained.pt."),
) -> None:
    """Pretrain a config's backbone on its training sources' categories; writes pretrained.pt."""
    console = output_console()
    with cli_errors("pretraining", FLAGS):
        from ..training.config import load_config
        from ..workflows.pretrain import pretrain as run_pretrain

        cfg = load_config(config, overrides or [])
        report = run_pretrain(
            cfg.dataset.name,
            output,
            steps=steps,
            lr=lr,
            batch_size=batch_size,
            seed=cfg.seed,
            embedding_dim=cfg.model.embedding_dim,
            backbone=cfg.model.backbone,
            frozen_bn=cfg.model.frozen_bn,
            dataset_options=cfg.dataset.options,
            split_seed=cfg.dataset.split_seed,
            data_dir=cfg.dataset.data_dir,
            threads=cfg.threads,
            overwrite=overwrite,
        )
    scratch, tuned = report["spread_scratch"], report["spread_pretrained"]
    console.print(
        f"wrote {output / 'pretrained.pt'}: train accuracy {report['train_accuracy']:.3f}, val "
        f"accuracy {report['val_accuracy']}, test mean negative cosine "
        f"{scratch['mean_negative_cosine']:.3f} (scratch) -> "
        f"{tuned['mean_negative_cosine']:.3f} (pretrained)",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
