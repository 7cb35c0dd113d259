"""``rankwise search``: the k nearest gallery items of each query, embedded by a trained run.

QUERIES and ``--gallery`` are each a folder of images (sorted path order, as ``rankwise embed``),
a CSV table with a ``path`` column (paths relative to the table's folder; an optional ``label``
column is carried into the results), a single image, or an array file (``.npy``,
``.npz[:key]``, ``.pt[:key]``) of raw inputs or of embeddings; the gallery may also be an index
saved by ``--save-index`` (its ``.json`` file). Both are embedded with the run's model and
preprocessing (:func:`rankwise.training.load_run`) and searched exactly with
:class:`rankwise.search.EmbeddingIndex`. No paper equation is implemented here.
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from .common import cli_errors, output_console

if TYPE_CHECKING:
    import numpy as np
    import torch
    from rich.console import Console

    from ..search import EmbeddingIndex, SearchResult
    from ..training.inference import LoadedRun

__all__ = ["search"]

FLAGS = {
    "run_dir": "RUN_DIR",
    "queries": "QUERIES",
    "gallery": "--gallery",
    "k": "--k",
    "similarity": "--similarity",
    "arrays": "--arrays",
    "backend": "--backend",
    "save_index": "--save-index",
    "overwrite": "--overwrite",
    "checkpoint": "--checkpoint",
}
ARRAY_ROLES = ("auto", "inputs", "embeddings")


@dataclass
class Items:
    """A source embedded by the run: embeddings, and the paths / labels where the source has them."""

    embeddings: torch.Tensor
    paths: list[str] | None
    labels: np.ndarray | None


def _table_rows(table: Path, name: str) -> tuple[list[Path], list[str] | None]:
    """The image paths (and labels) of a CSV table with a ``path`` column."""
    try:
        with open(table, newline="") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            if "path" not in columns:
                raise ValueError(
                    f"{name}: {table} has no 'path' column (its columns: "
                    f"{', '.join(columns) or 'none'}); add one naming each image file."
                )
            records = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ValueError(f"{name}: could not read {table}: {exc}") from None
    if not records:
        raise ValueError(f"{name}: {table} has no rows.")
    paths = []
    for row, record in enumerate(records, start=1):
        cell = (record.get("path") or "").strip()
        if not cell:
            raise ValueError(f"{name}: {table} row {row}, column 'path': empty.")
        path = Path(cell) if Path(cell).is_absolute() else table.parent / cell
        if not path.is_file():
            raise FileNotFoundError(f"{name}: {table} row {row}, column 'path': no file {path}.")
        paths.append(path)
    labels = None
    if "label" in columns:
        labels = [(record.get("label") or "").strip() for record in records]
    return paths, labels


def _as_labels(labels: list[str] | None) -> np.ndarray | None:
    """Integer labels where every label is an integer, else the strings."""
    import numpy as np

    if labels is None:
        return None
    try:
        return np.asarray([int(label) for label in labels], dtype=np.int64)
    except ValueError:
        return np.asarray(labels, dtype=str)


def _embed_images(
    run: LoadedRun, paths: list[Path], name: str, batch_size: int, places: list[str]
) -> torch.Tensor:
    """The images' embeddings; a missing or undecodable file is a data error naming ``name``.

    ``places[i]`` says where ``paths[i]`` comes from (``"table.csv row 3"``, ``"item 2 of
    folder"``). The run's preprocessing raises a :class:`~rankwise.data.DataError` that names
    the file only; the files are then opened again, one by one, to find the first that fails and
    say which argument and row it is.
    """
    from ..data.base import DataError, open_image

    try:
        return run.embed(paths, batch_size=batch_size)
    except DataError as exc:
        for path, place in zip(paths, places, strict=True):
            try:
                open_image(path, place)
            except DataError as named:
                # the same type (MissingImageError / UnreadableImageError), led by the argument
                raise type(named)(f"{name}: {DataError.one_line(named)}") from exc
        raise


def _array_role(run: LoadedRun, shape: tuple[int, ...], spec: str, name: str, role: str) -> str:
    """Whether an array of ``shape`` holds the run's raw inputs or embeddings."""
    dim = int(run.config.model.embedding_dim)
    item, expected = shape[1:], run.input_shape
    fits_inputs = run.input_kind != "images" and (
        item == expected or (expected[0] == 1 and item == expected[1:])
    )
    fits_embeddings = len(shape) == 2 and shape[1] == dim
    if role == "auto":
        if fits_inputs and fits_embeddings:
            raise ValueError(
                f"{name}: {spec} of shape {shape} could be inputs or embeddings of this run; "
                "say which with --arrays inputs or --arrays embeddings."
            )
        if fits_inputs or fits_embeddings:
            return "inputs" if fits_inputs else "embeddings"
    elif role == "inputs" and fits_inputs or role == "embeddings" and fits_embeddings:
        return role
    inputs = (
        "" if run.input_kind == "images" else f"inputs (N, {', '.join(map(str, expected))}) or "
    )
    raise ValueError(
        f"{name}: {spec} has shape {shape}; this run takes {inputs}embeddings (N, {dim})."
    )


def read_items(
    run: LoadedRun, spec: str, name: str, *, arrays: str = "auto", batch_size: int = 256
) -> Items:
    """Embed a source (folder, table, image or array file; see the module docstring) with ``run``.

    Args:
        run: the loaded run.
        spec: the source as typed on the command line.
        name: how messages name it (``"QUERIES"``, ``"--gallery"``).
        arrays: what an array file holds: ``"auto"``, ``"inputs"`` or ``"embeddings"``.
        batch_size: items per forward pass.

    Raises:
        ValueError / FileNotFoundError: naming ``name``, the file and, for tables, the row.
    """
    from ..training.inference import IMAGE_SUFFIXES, image_paths
    from .evaluate import load_array

    path = Path(spec)
    is_image = path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()
    is_table = path.suffix.lower() == ".csv"
    if path.is_dir() or is_image or is_table:
        if run.input_kind != "images":
            raise ValueError(
                f"{name}: {spec} holds images but the run was trained on "
                f"{run.config.dataset.name} arrays; pass an array file (.npy / .npz) of its "
                "inputs or embeddings."
            )
        labels: list[str] | None = None
        if is_table:
            paths, labels = _table_rows(path, name)
            places = [f"{spec} row {row}" for row in range(1, len(paths) + 1)]
        else:
            paths = image_paths(path)
            if not paths:
                raise FileNotFoundError(f"{name}: no image files in {spec}.")
            places = [f"item {row} of {spec}" for row in range(1, len(paths) + 1)]
        embeddings = _embed_images(run, paths, name, batch_size, places)
        return Items(embeddings, [str(p) for p in paths], _as_labels(labels))
    array = load_array(spec, name)
    if _array_role(run, tuple(array.shape), spec, name, arrays) == "inputs":
        return Items(run.embed(array.numpy(), batch_size=batch_size), None, None)
    return Items(array.float(), None, None)


def _load_index(spec: str, run_meta: dict[str, Any], backend: str) -> EmbeddingIndex:
    """A saved gallery index, refused unless it was embedded by this run's model."""
    from ..search import EmbeddingIndex

    index = EmbeddingIndex.load(spec, backend=backend)
    built = index.metadata.get("model_id")
    if built != run_meta["model_id"]:
        raise ValueError(
            f"--gallery: {spec} was built with model {built or 'unknown'} "
            f"({index.metadata.get('checkpoint', 'no checkpoint recorded')}), not this run's "
            f"model {run_meta['model_id']} ({run_meta['checkpoint']}); rebuild it from the "
            "images with --save-index."
        )
    return index


def _gallery_index(
    run: LoadedRun,
    spec: str,
    options: dict[str, Any],
    run_meta: dict[str, Any],
) -> EmbeddingIndex:
    from ..search import EmbeddingIndex

    if spec.lower().endswith(".json"):
        index = _load_index(spec, run_meta, options["backend"])
        similarity = options["similarity"]
        if similarity is not None and similarity != index.similarity:
            raise ValueError(
                f"--similarity {similarity}: {spec} was built for {index.similarity}; leave "
                "--similarity out or rebuild the index."
            )
        return index
    items = read_items(
        run, spec, "--gallery", arrays=options["arrays"], batch_size=options["batch_size"]
    )
    index = EmbeddingIndex(
        items.embeddings.shape[1],
        options["similarity"] or run_meta["similarity"],
        backend=options["backend"],
        metadata=run_meta,
    )
    index.add(items.embeddings, paths=items.paths, labels=items.labels)
    return index


def _report(
    result: SearchResult, index: EmbeddingIndex, queries: Items, run_meta: dict[str, Any], k: int
) -> dict[str, Any]:
    """The JSON document of a search."""
    entries = []
    for i, rows in enumerate(result.rows()):
        entry: dict[str, Any] = {"query": i}
        if queries.paths is not None:
            entry["path"] = queries.paths[i]
        if queries.labels is not None:
            entry["label"] = queries.labels[i].item()
        entry["results"] = rows
        entry["ties_at_cut"] = (
            int(result.ties_at_cut[i]) if result.ties_at_cut is not None else None
        )
        entry["cut_tied"] = bool(result.cut_tied[i])
        entries.append(entry)
    return {
        "run": run_meta,
        "similarity": index.similarity,
        "backend": index.backend,
        "k": k,
        "gallery_size": index.ntotal,
        "queries": entries,
    }


def _print_table(console: Console, report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(
        title=f"{report['k']} nearest of {report['gallery_size']} ({report['similarity']})"
    )
    named = any("path" in r or "label" in r for q in report["queries"] for r in q["results"])
    columns = ["query", "rank", "id", "score", *(["gallery item"] if named else [])]
    for column in columns:
        table.add_column(column, justify="right" if column in ("rank", "id", "score") else "left")
    notes = []
    for entry in report["queries"]:
        query = entry.get("path", str(entry["query"]))
        for item in entry["results"]:
            shown = item.get("path", "")
            if "label" in item:
                shown = f"{shown} [{item['label']}]".strip()
            first = item["rank"] == 1
            cells = [query if first else "", str(item["rank"]), str(item["id"])]
            table.add_row(*cells, f"{item['score']:.6g}", *([shown] if named else []))
        if entry["cut_tied"]:
            count = entry["ties_at_cut"]
            more = f"{count} more gallery item(s)" if count is not None else "more gallery items"
            notes.append(
                f"query {entry['query']}: {more} score exactly the score at rank "
                f"{report['k']}; the earliest added were kept"
            )
    console.print(table)
    for note in notes:
        console.print(note, soft_wrap=True, markup=False, highlight=False)


def search(
    run_dir: Path = typer.Argument(
        ..., metavar="RUN_DIR", help="A run directory (or a folder holding one run)."
    ),
    queries: str = typer.Argument(
        ...,
        metavar="QUERIES",
        help="A folder of images, a CSV table with a path column, an image, or an array file "
        "(.npy / .npz[:key] / .pt[:key]) of raw inputs or embeddings.",
    ),
    gallery: str = typer.Option(
        ...,
        "--gallery",
        metavar="GALLERY",
        help="What to search: as QUERIES, or an index saved with --save-index (its .json).",
    ),
    k: int = typer.Option(10, "--k", min=1, help="Results per query."),
    json_path: str | None = typer.Option(
        None, "--json", metavar="FILE", help="Write the results as JSON ('-': stdout)."
    ),
    similarity: str | None = typer.Option(
        None, "--similarity", help="cosine, dot or euclidean (default: the run's, cosine)."
    ),
    arrays: str = typer.Option(
        "auto", "--arrays", help="What array files hold: auto, inputs or embeddings."
    ),
    backend: str = typer.Option(
        "exact", "--backend", help="exact, or faiss (a flat faiss index; the 'faiss' extra)."
    ),
    save_index: Path | None = typer.Option(
        None,
        "--save-index",
        metavar="FILE",
        help="Also save the gallery's index (FILE.npz + FILE.json).",
    ),
    checkpoint: str = typer.Option(
        "auto", "--checkpoint", help="auto (best.pt, else last.pt), best, last, or a file."
    ),
    batch_size: int = typer.Option(256, "--batch-size", min=1, help="Items per forward pass."),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (default cpu)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing output files."),
) -> None:
    """Search a gallery for the k nearest items of each query, embedded by a trained run."""
    console = output_console()
    with cli_errors("search", FLAGS, bad_input=(ValueError, FileNotFoundError)):
        from .._disk import atomic_write
        from ..similarity import check_similarity
        from ..training.inference import load_run
        from ..workflows.export import run_metadata

        if arrays not in ARRAY_ROLES:
            raise ValueError(f"--arrays must be one of {', '.join(ARRAY_ROLES)}, got {arrays!r}.")
        from ..search import EmbeddingIndex

        targets = [] if json_path in (None, "-") else [Path(f"{json_path}")]
        if save_index is not None:
            targets += EmbeddingIndex.files(save_index)
        for target in targets:
            if target.exists() and not overwrite:
                raise ValueError(f"{target} exists; pass --overwrite to replace it.")
        options = {
            "similarity": None if similarity is None else check_similarity(similarity),
            "backend": backend,
            "arrays": arrays,
            "batch_size": batch_size,
        }
        run = load_run(run_dir, checkpoint=checkpoint, device=device)
        run_meta = run_metadata(run)
        index = _gallery_index(run, gallery, options, run_meta)
        query_items = read_items(run, queries, "QUERIES", arrays=arrays, batch_size=batch_size)
        if k > index.ntotal:
            raise ValueError(
                f"--k {k} exceeds the {index.ntotal} gallery items; pass a smaller --k."
            )
        result = index.search(query_items.embeddings, k, device=device)
        report = _report(result, index, query_items, run_meta, k)
        if save_index is not None:
            index.save(save_index)
        if json_path == "-":
            sys.stdout.write(json.dumps(report, indent=1) + "\n")
            return
        if json_path is not None:
            text = json.dumps(report, indent=1) + "\n"
            atomic_write(Path(json_path), lambda handle: handle.write(text.encode()))
    if json_path is None:
        _print_table(console, report)
    else:
        console.print(
            f"wrote {json_path}: {k} results for each of {len(report['queries'])} queries",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
