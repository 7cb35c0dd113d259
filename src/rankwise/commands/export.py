"""``rankwise export``: a trained run's model as ONNX, TorchScript or a torch.export program.

The work is :func:`rankwise.workflows.export.export_run`: the model file, its metadata (input,
preprocessing, similarity, run) in ``OUT.json`` and a parity check of the written file against the
run's own embeddings, reported here. No paper equation is implemented here.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .common import EXIT_FAILED, cli_errors, output_console

__all__ = ["export"]

FLAGS = {
    "run_dir": "RUN_DIR",
    "format": "--format",
    "output": "--output",
    "overwrite": "--overwrite",
    "tolerance": "--tolerance",
    "checkpoint": "--checkpoint",
}


def export(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="A run directory (or a folder holding one run)."
    ),
    format: str = typer.Option(
        ..., "--format", "-f", help="onnx (needs the 'export' extra), torchscript or pt2."
    ),
    output: Path = typer.Option(
        ...,
        "--output",
        "-o",
        metavar="OUT",
        help="The model file to write (e.g. model.onnx, model.pt, model.pt2); its metadata "
        "goes to OUT.json.",
    ),
    checkpoint: str = typer.Option(
        "auto",
        "--checkpoint",
        help="auto (best.pt, the model the run's test evaluated, else last.pt), best, last, "
        "or a checkpoint file.",
    ),
    tolerance: float = typer.Option(
        1e-5, "--tolerance", help="Largest absolute difference from the run's embeddings."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing files."),
) -> None:
    """Export a trained run's embedding model and check its outputs against the run's."""
    console = output_console()
    with cli_errors("export", FLAGS, bad_input=(ValueError, FileNotFoundError)):
        from ..workflows.export import export_run

        result = export_run(
            run_dir,
            format.strip().lower(),
            output,
            checkpoint=checkpoint,
            tolerance=tolerance,
            overwrite=overwrite,
        )
    verdict = "passed" if result.passed else "FAILED"
    console.print(
        f"wrote {result.model_path} ({result.format}) and {result.metadata_path}\n"
        f"parity {verdict}: largest |exported - run| = {result.max_abs_diff:.3g} over "
        f"{result.n_checked} inputs (tolerance {result.tolerance:g})",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
    if not result.passed:
        raise typer.Exit(EXIT_FAILED)
