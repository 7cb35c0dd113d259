"""``rankwise show``: a picture of a trained run's retrievals, worst queries first.

Each row is a test query and its top-k gallery items, framed green (same class) or red (another),
with their scores and the query's AP (:mod:`rankwise.workflows.gallery`). No paper equation is
implemented here.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .common import cli_errors, output_console

__all__ = ["show"]

FLAGS = {
    "run_dir": "RUN_DIR",
    "worst": "--worst",
    "queries": "--queries",
    "k": "--k",
    "output": "--output",
    "html": "--html",
    "checkpoint": "--checkpoint",
}


def _query_rows(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        rows = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--queries must be comma-separated test rows, e.g. 0,5,17; got {text!r}."
        ) from None
    if not rows:
        raise ValueError("--queries is empty; give test rows, e.g. 0,5,17.")
    return rows


def show(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="A run directory (or a folder holding one run)."
    ),
    worst: int = typer.Option(8, "--worst", min=1, help="Draw the N queries of lowest AP."),
    queries: str | None = typer.Option(
        None, "--queries", metavar="I,J,...", help="Draw these test rows instead of the worst."
    ),
    k: int = typer.Option(5, "--k", min=1, help="Results per query."),
    output: Path | None = typer.Option(
        None, "--output", "-o", metavar="FILE", help="Write the picture here (.png, .pdf, .svg)."
    ),
    html_path: Path | None = typer.Option(
        None, "--html", metavar="FILE", help="Write a self-contained HTML page here."
    ),
    checkpoint: str = typer.Option(
        "auto", "--checkpoint", help="auto (best.pt, else last.pt), best, last, or a file."
    ),
    batch_size: int = typer.Option(256, "--batch-size", min=1, help="Items per forward pass."),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (default cpu)."),
) -> None:
    """Draw test queries and their top-k results, right / wrong marked (worst AP first)."""
    console = output_console()
    with cli_errors("show", FLAGS, bad_input=(ValueError, FileNotFoundError)):
        from .._disk import atomic_write
        from ..training.inference import load_run
        from ..workflows.gallery import build_gallery, draw_gallery, gallery_html

        if output is None and html_path is None:
            raise ValueError("say where to draw: -o FILE.png and / or --html FILE.html.")
        rows = _query_rows(queries)
        run = load_run(run_dir, checkpoint=checkpoint, device=device)
        gallery = build_gallery(run, k=k, worst=worst, queries=rows, batch_size=batch_size)
        if output is not None:
            draw_gallery(gallery, output)
        if html_path is not None:
            page = gallery_html(gallery).encode()
            atomic_write(html_path, lambda handle: handle.write(page))
    for row in gallery.rows:
        hits = "".join("+" if ok else "-" for ok in row.correct)
        console.print(
            f"query {row.query:>5}  class {row.label:>4}  AP {row.ap:.4f}  top {k}: {hits}",
            markup=False,
            highlight=False,
        )
    written = ", ".join(str(p) for p in (output, html_path) if p is not None)
    console.print(
        f"wrote {written}: {len(gallery.rows)} queries (+ right, - wrong), test mAP "
        f"{gallery.mean_ap:.4f}",
        soft_wrap=True,
        markup=False,
        highlight=False,
    )
