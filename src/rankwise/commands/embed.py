"""``rankwise embed``: embed new data with a trained run.

Loads a run directory's model and preprocessing (:func:`rankwise.training.load_run`) and writes the
embeddings of INPUT as a ``.npy`` file. INPUT is an array file (``.npy``, ``.npz[:key]``,
``.pt[:key]``) of raw inputs as the dataset ships them (digits pixels 0-16, MNIST / CIFAR
``uint8``) or, for a run on an image dataset, a folder of images (embedded in sorted path order,
listed beside the output). No paper equation is implemented here.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .common import cli_errors, output_console

__all__ = ["embed"]

FLAGS = {"run_dir": "RUN_DIR", "checkpoint": "--checkpoint", "inputs": "INPUT"}


def embed(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="A run directory (or a folder holding one run)."
    ),
    inputs: str = typer.Argument(
        ...,
        metavar="INPUT",
        help="Raw inputs: .npy / .npz[:key] / .pt[:key], or a folder of images for an image run.",
    ),
    output: Path = typer.Option(
        ..., "--output", "-o", metavar="FILE", help="Where to write the embeddings (.npy)."
    ),
    checkpoint: str = typer.Option(
        "auto",
        "--checkpoint",
        help="auto (best.pt, the model the run's test evaluated, else last.pt), best, last, "
        "or a checkpoint file.",
    ),
    batch_size: int = typer.Option(256, "--batch-size", min=1, help="Items per forward pass."),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (default cpu)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
) -> None:
    """Embed new data with a trained run's model and preprocessing; writes a .npy file."""
    import numpy as np

    console = output_console()
    with cli_errors("embedding", FLAGS, bad_input=(ValueError, FileNotFoundError)) as err:
        from ..training.inference import image_paths, load_run
        from .evaluate import load_array

        if output.suffix.lower() != ".npy":
            raise ValueError(f"--output must name a .npy file, got {output}.")
        if output.exists() and not overwrite:
            raise ValueError(f"--output {output} exists; pass --overwrite to replace it.")
        run = load_run(run_dir, checkpoint=checkpoint, device=device)
        listing = None
        if run.input_kind == "images":
            paths = image_paths(inputs)
            if not paths:
                raise FileNotFoundError(f"INPUT: no image files in {inputs}.")
            embeddings = run.embed(paths, batch_size=batch_size)
            listing = output.with_suffix(".paths.txt")
        else:
            embeddings = run.embed(load_array(inputs, "INPUT"), batch_size=batch_size)
        output.parent.mkdir(parents=True, exist_ok=True)
        np.save(output, embeddings.numpy())
        if listing is not None:
            listing.write_text("".join(f"{p}\n" for p in paths))
        err.print(
            f"{run.config.loss.name} model of {run.run_dir} ({run.checkpoint.name}, step "
            f"{run.step})",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
    console.print(
        f"wrote {output}: {embeddings.shape[0]} x {embeddings.shape[1]} float32"
        + (f"; row order in {listing}" if listing is not None else ""),
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
