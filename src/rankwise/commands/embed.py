"""``rankwise embed``: embed new data with a trained run.

Loads a run directory's model and preprocessing (:func:`rankwise.training.load_run`) and writes the
embeddings of INPUT as a ``.npy`` file. INPUT is an array file (``.npy``, ``.npz[:key]``,
``.pt[:key]``) of raw inputs as the dataset ships them (digits pixels 0-16, MNIST / CIFAR
``uint8``) or, for a run on an image dataset, a folder of images (embedded in sorted path order,
listed beside the output; a class-per-folder tree also gets ``<out>.labels.npy``, the class ids
of its folders in sorted name order, so ``rankwise evaluate OUT OUT.labels.npy`` follows). No
paper equation is implemented here.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .common import cli_errors, output_console

__all__ = ["embed"]

FLAGS = {"run_dir": "RUN_DIR", "checkpoint": "--checkpoint", "inputs": "INPUT"}


def folder_labels(folder: Path, paths: list[Path]) -> tuple[list[int], list[str]] | None:
    """Class ids of ``paths`` when every one lies in a class folder directly below ``folder``.

    Returns:
        (label of every path, class folder names in id order: sorted), or None for any other
        layout (images directly in ``folder``, or nested deeper).
    """
    parents = [p.relative_to(folder).parts for p in paths]
    if not parents or any(len(parts) != 2 for parts in parents):
        return None
    classes = sorted({parts[0] for parts in parents})
    ids = {name: i for i, name in enumerate(classes)}
    return [ids[parts[0]] for parts in parents], classes


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
        listing = labelled = None
        if run.input_kind == "images":
            paths = image_paths(inputs)
            if not paths:
                raise FileNotFoundError(f"INPUT: no image files in {inputs}.")
            embeddings = run.embed(paths, batch_size=batch_size)
            listing = output.with_suffix(".paths.txt")
            labelled = folder_labels(Path(inputs), paths) if Path(inputs).is_dir() else None
        else:
            embeddings = run.embed(load_array(inputs, "INPUT"), batch_size=batch_size)
        output.parent.mkdir(parents=True, exist_ok=True)
        np.save(output, embeddings.numpy())
        if listing is not None:
            listing.write_text("".join(f"{p}\n" for p in paths))
        if labelled is not None:
            labels_file = output.with_suffix(".labels.npy")
            np.save(labels_file, np.asarray(labelled[0], dtype=np.int64))
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
    if labelled is not None:
        names = labelled[1]
        shown = ", ".join(f"{n}={i}" for i, n in enumerate(names[:5]))
        console.print(
            f"wrote {output.with_suffix('.labels.npy')}: the class folder of every row, "
            f"{len(names)} classes in sorted name order ({shown}{', ...' if len(names) > 5 else ''})"
            f"; evaluate with: rankwise evaluate {output} {output.with_suffix('.labels.npy')}",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
