"""``rankwise evaluate``: exact, tie-aware retrieval report of saved embeddings.

Loads embeddings and labels from .npy / .npz / .pt files (labels also from .txt / .csv / .tsv: one
per line, or a column of a table), ranks every query against the gallery
(or leave-one-out) and prints :func:`rankwise.metrics.retrieval.retrieval_metrics`: mAP (the
tie-aware AP_T of He et al., *Hashing as Tie-Aware Learning to Rank*, CVPR 2018, Prop. 1 with Eq. 6
as corrected in docs/errata.md), recall@k, precision@k, MAP@R and R-precision. Optionally writes
the report as JSON and the mean PR curve as a PNG. Bad input: a one-line error naming the
command's argument (``EMBEDDINGS``, ``LABELS``, ``--gallery``, ``--gallery-labels``) and its file,
exit code 2; an embeddings file and a labels file given in each other's place are recognised.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pickle
import sys
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .._validation import resolve_device
from ..reporting import report_rows
from .common import cli_errors

__all__ = ["evaluate", "load_array", "load_labels", "parse_fprs", "parse_ks"]

_EXTENSIONS = (".npy", ".npz", ".pt", ".pth")
# text tables of labels (load_labels): one label per line, or a column of a table
_TEXT_EXTENSIONS = (".txt", ".csv", ".tsv")
# the library's argument names -> this command's arguments, for messages not caught before
FLAGS = {
    "query": "EMBEDDINGS",
    "query_labels": "LABELS",
    "gallery": "--gallery",
    "gallery_labels": "--gallery-labels",
    "ks": "--ks",
    "similarity": "--similarity",
    "ties": "--ties",
    "device": "--device",
    "fpr": "--fpr",
}


def _split_key(spec: str) -> tuple[Path, str | None]:
    """``"file.npz:key"`` -> (Path("file.npz"), "key"); a plain path -> (Path, None)."""
    path = Path(spec)
    if path.exists() or ":" not in spec:
        return path, None
    head, _, key = spec.rpartition(":")
    if Path(head).suffix.lower() in (*_EXTENSIONS, *_TEXT_EXTENSIONS) and key:
        return Path(head), key
    return path, None


def load_array(spec: str, name: str) -> torch.Tensor:
    """Load one array from a ``.npy``, ``.npz`` or ``.pt`` / ``.pth`` file.

    ``.npz`` takes ``file.npz:key`` or a single-array archive; ``.pt`` / ``.pth`` a tensor, or
    ``file.pt:key`` for a dict of tensors.

    Args:
        spec: the path, optionally followed by ``:key``.
        name: what the array is (used in error messages), e.g. ``"EMBEDDINGS"``.

    Returns:
        The array as a CPU tensor.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: unsupported extension, missing key, content that is not one numeric
            array, or NaN / inf values (the rows are named).
    """
    path, key = _split_key(spec)
    if not path.is_file():
        raise FileNotFoundError(f"{name}: file not found: {path}")
    try:
        tensor = _load(path, key, name)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        raise ValueError(f"{name}: could not read {path.name}: {exc}") from exc
    _check_finite(tensor, spec, name)
    return tensor


def _check_finite(tensor: torch.Tensor, spec: str, name: str) -> None:
    """NaN / inf named by file and row (the library would name its Python argument)."""
    if not tensor.is_floating_point():
        return
    bad = ~torch.isfinite(tensor)
    if bad.ndim > 1:
        bad = bad.flatten(1).any(dim=1)
    rows = torch.nonzero(bad).flatten().tolist()
    if rows:
        shown = ", ".join(map(str, rows[:5])) + (", ..." if len(rows) > 5 else "")
        raise ValueError(
            f"{name}: {spec} has NaN or inf values in {len(rows)} row(s) (row {shown}, counted "
            "from 0); check the model that produced it (a diverged loss, an fp16 overflow) or "
            "drop those rows."
        )


def _load_npy(path: Path, key: str | None, name: str) -> np.ndarray:
    if key is not None:
        raise ValueError(f"{name}: a .npy file holds one array; drop the ':{key}' suffix.")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError:  # pickled objects or a corrupt header
        # numpy's message advises allow_pickle=True (running the file's code): never repeat it
        raise ValueError(
            f"{name}: {path.name} is not a numeric .npy array (a corrupt file, or pickled "
            "Python objects, which are never loaded); save the array with "
            "numpy.save(path, array)."
        ) from None


def _load_npz(path: Path, key: str | None, name: str) -> np.ndarray:
    with np.load(path, allow_pickle=False) as archive:
        keys = list(archive.keys())
        if key is None:
            if len(keys) != 1:
                raise ValueError(
                    f"{name}: {path.name} holds {len(keys)} arrays ({', '.join(keys) or 'none'}); "
                    f"choose one with {path.name}:KEY."
                )
            key = keys[0]
        if key not in keys:
            raise ValueError(
                f"{name}: {path.name} has no array {key!r}; available: {', '.join(keys)}."
            )
        return archive[key]


def _load_pt(path: Path, key: str | None, name: str) -> torch.Tensor:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{name}: could not read {path.name} with torch.load(weights_only=True); save "
            "a plain tensor (torch.save(tensor, path)) or a dict of tensors."
        ) from exc
    if isinstance(obj, dict):
        if key is None or key not in obj:
            keys = ", ".join(map(str, obj.keys()))
            raise ValueError(
                f"{name}: {path.name} holds a dict ({keys}); choose a tensor with {path.name}:KEY."
            )
        obj = obj[key]
    elif key is not None:
        raise ValueError(f"{name}: {path.name} holds a single tensor; drop ':{key}'.")
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"{name}: {path.name} must hold a tensor, got {type(obj).__name__}.")
    return obj


def _load(path: Path, key: str | None, name: str) -> torch.Tensor:
    suffix = path.suffix.lower()
    if suffix in (".pt", ".pth"):
        return _load_pt(path, key, name)
    if suffix not in (".npy", ".npz"):
        raise ValueError(
            f"{name}: unsupported file type {suffix or '(none)'!r} for {path.name}; use one of "
            f"{', '.join(_EXTENSIONS)}."
        )
    array = (_load_npy if suffix == ".npy" else _load_npz)(path, key, name)
    if array.dtype == object or array.dtype.kind not in "biuf":
        raise ValueError(f"{name}: {path.name} must hold a numeric array, got dtype {array.dtype}.")
    return torch.from_numpy(np.ascontiguousarray(array))


def load_labels(spec: str, name: str) -> torch.Tensor:
    """Load labels: an array file as :func:`load_array`, or a ``.txt`` / ``.csv`` / ``.tsv`` table.

    A text file holds one label per row: a ``.txt`` file one per line, a ``.csv`` / ``.tsv`` file
    in its first column, or in the column named by ``file.csv:COLUMN`` (its first row is then the
    header). Without a column name a first row with no integer, above rows with one, is a header
    and skipped; a table's column named ``label`` / ``class`` (``labels``, ``class_id``,
    ``target``) is then read instead of the first. Integer labels are class ids; other values
    are class names, numbered in sorted order (only equality matters to the metrics).

    Args:
        spec: the path, optionally followed by ``:COLUMN`` (or ``:key`` for an array file).
        name: the argument, for error messages (``"LABELS"``, ``"--gallery-labels"``).

    Returns:
        The labels as a CPU tensor (int64 for a text file).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: an empty row, a missing column, or a non-integer number (row named).
    """
    path, column = _split_key(spec)
    if path.suffix.lower() not in _TEXT_EXTENSIONS:
        return load_array(spec, name)
    if not path.is_file():
        raise FileNotFoundError(f"{name}: file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{name}: could not read {path.name} as text: {exc}") from exc
    values, first_row = _text_column(text, path, column, name)
    return _labels_from_strings(values, first_row, path, name)


def _text_column(text: str, path: Path, column: str | None, name: str) -> tuple[list[str], int]:
    """The cells of the label column and the file row (1-based) of its first cell."""
    lines = text.splitlines()
    while lines and not lines[-1].strip():  # trailing blank lines are no rows
        lines.pop()
    suffix = path.suffix.lower()
    if suffix == ".txt" and column is None:
        rows = [[line.strip()] for line in lines]
    else:
        delimiter = "\t" if suffix == ".tsv" else ","
        rows = [
            [c.strip() for c in r]
            for r in csv.reader(io.StringIO("\n".join(lines)), delimiter=delimiter)
        ]
    if not rows:
        raise ValueError(f"{name}: {path.name} holds no labels.")
    index, start = 0, 0
    if column is not None:
        if column not in rows[0]:
            raise ValueError(
                f"{name}: {path.name} has no column {column!r} in its header row; columns: "
                f"{', '.join(repr(c) for c in rows[0])}."
            )
        index, start = rows[0].index(column), 1
    elif _has_header(rows):
        start = 1
        # a table of paths and labels: its label column, else the first
        named = [i for i, c in enumerate(rows[0]) if c.lower() in _LABEL_COLUMNS]
        index = named[0] if named else 0
    values = [_cell(r, index) for r in rows[start:]]
    for row, value in enumerate(values, start + 1):
        if not value:
            raise ValueError(
                f"{name}: {path.name} row {row} has no label; give every row one (or delete it)."
            )
    return values, start + 1


_LABEL_COLUMNS = ("label", "labels", "class", "class_id", "target")


def _has_header(rows: list[list[str]]) -> bool:
    """A first row without an integer above rows with one: a header, not labels.

    A column of class names under a header cannot be told apart: it needs ``FILE:COLUMN``.
    """
    if len(rows) < 2 or any(_is_int(c) for c in rows[0]):
        return False
    return any(_is_int(c) for r in rows[1:] for c in r)


def _cell(row: list[str], index: int) -> str:
    return row[index] if index < len(row) else ""


def _is_int(value: str) -> bool:
    try:
        int(value)
    except ValueError:
        return False
    return True


def _labels_from_strings(values: list[str], first_row: int, path: Path, name: str) -> torch.Tensor:
    """Integer class ids as they are; class names numbered in sorted order."""
    if not values:
        raise ValueError(f"{name}: {path.name} holds a header but no labels.")
    if all(_is_int(v) for v in values):
        return torch.tensor([int(v) for v in values], dtype=torch.int64)
    for row, value in enumerate(values, first_row):
        try:
            number = float(value)
        except ValueError:
            continue
        if number.is_integer():  # a class id among names (or "3.0")
            continue
        # a fractional number among names is a score or an embedding, not a class
        raise ValueError(
            f"{name}: {path.name} row {row} holds {value!r}, a number that is not an integer "
            f"(as float {number:g}); labels are integer class ids or class names."
        )
    _, ids = np.unique(np.array(values), return_inverse=True)
    return torch.from_numpy(ids.astype(np.int64).reshape(-1))


def parse_ks(text: str) -> tuple[int, ...]:
    """``"1,10,100"`` -> (1, 10, 100); raises ValueError on anything but cut-offs in range."""
    from ..metrics._inputs import MAX_CUTOFF

    message = (
        f"--ks must be comma-separated integers from 1 to 2**63 - 1 ({MAX_CUTOFF}), got {text!r}."
    )
    try:
        ks = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(message) from exc
    if not ks or any(not 1 <= k <= MAX_CUTOFF for k in ks):
        raise ValueError(message)
    return ks


def parse_fprs(text: str | None) -> tuple[float, ...]:
    """``"1e-3,1e-4"`` -> (0.0001, 0.001); ``None`` -> (); raises ValueError naming --fpr.

    Example:
        >>> parse_fprs("1e-3,1e-4")
        (0.0001, 0.001)
    """
    if text is None:
        return ()
    message = (
        "--fpr must be comma-separated false positive rates strictly between 0 and 1, e.g. "
        f"--fpr 1e-3,1e-4; got {text!r}"
    )
    parts = [part.strip() for part in text.split(",")]
    if not parts or any(not part for part in parts):
        raise ValueError(message + " (an empty value).")
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise ValueError(message + f" ({part!r} is not a number).") from None
        if not 0.0 < value < 1.0:  # NaN fails this too
            raise ValueError(message + f" ({part} is outside (0, 1)).")
        values.append(value)
    return tuple(sorted(set(values)))


def _check_device(device: str | None) -> torch.device | None:
    if device is None:
        return None
    return resolve_device(device, "--device")


def _check_output_path(path: Path | None, flag: str) -> None:
    """Fail before any work when ``path`` cannot be written (a directory, a file as a parent)."""
    if path is None or (flag == "--json" and str(path) == "-"):  # `--json -`: stdout
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; name a file to write.")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(
            f"{flag} {path}: {ancestor} is not a directory, so {path.name} cannot be written."
        )
    if not os.access(ancestor, os.W_OK | os.X_OK) or (
        path.exists() and not os.access(path, os.W_OK)
    ):
        raise ValueError(f"{flag} {path}: no permission to write there; choose another path.")


def _write_outputs(
    report: Any,
    curve: Any,
    json_out: Path | None,
    plot_pr: Path | None,
    embeddings: str,
    mode: str,
    console: Console,
) -> None:
    """Write the JSON report and the PR plot (an OSError becomes a one-line error in evaluate)."""
    from ..plots import plot_pr_curves

    text = json.dumps(report.to_dict(), indent=2) + "\n" if json_out is not None else ""
    if json_out is not None and str(json_out) == "-":
        # `--json -`: stdout carries the JSON alone, so a script can parse it
        sys.stdout.write(text)
        sys.stdout.flush()
    elif json_out is not None:
        try:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(text)
        except OSError as exc:
            raise ValueError(
                f"--json {json_out}: could not write the report ({exc.strerror or exc})."
            ) from exc
        console.print(f"wrote {json_out}", soft_wrap=True)
    if curve is not None and plot_pr is not None:
        name = Path(_split_key(embeddings)[0]).stem
        try:
            written = plot_pr_curves(
                {name: curve},
                plot_pr,
                title=f"Precision-recall ({mode})",
                labels={name: report.map},
            )
        except OSError as exc:
            raise ValueError(
                f"--plot-pr {plot_pr}: could not write the plot ({exc.strerror or exc})."
            ) from exc
        console.print(f"wrote {written}", soft_wrap=True)


def _looks_like_embeddings(t: torch.Tensor) -> bool:
    """2-D floats that are not a 0/1 multi-hot matrix."""
    if t.ndim != 2 or not t.is_floating_point() or t.numel() == 0:
        return False
    return not bool(((t == 0) | (t == 1)).all())


def _check_pair(
    embeddings: torch.Tensor, labels: torch.Tensor, specs: tuple[str, str], names: tuple[str, str]
) -> None:
    """An embeddings / labels pair as the command takes them, in its own words (files named).

    Catches what the library would report in its parameter names, and the arguments given in
    each other's place (its reshape hint would then point the wrong way).
    """
    (emb_spec, lab_spec), (emb_name, lab_name) = specs, names
    emb = f"{emb_name} ({emb_spec}, shape {tuple(embeddings.shape)})"
    lab = f"{lab_name} ({lab_spec}, shape {tuple(labels.shape)})"
    if embeddings.ndim == 1 and _looks_like_embeddings(labels):
        raise ValueError(
            f"{emb} looks like labels and {lab} like embeddings: the two are swapped; give the "
            f"embeddings first: {lab_spec} {emb_spec}."
        )
    if embeddings.ndim != 2:
        hint = (
            "it holds integers, one per row, like labels: give the (n, d) embeddings file here"
            if embeddings.ndim == 1 and not embeddings.is_floating_point()
            else "save (n, d) embeddings (1-D scores as x.reshape(-1, 1))"
        )
        raise ValueError(f"{emb} must be 2-D (n, d); {hint}.")
    if _looks_like_embeddings(labels):
        raise ValueError(
            f"{lab} holds real numbers in {labels.shape[1]} columns, like embeddings, not class "
            f"ids or 0/1 multi-hot rows: give the labels file here (one label per row of "
            f"{emb_name})."
        )
    if labels.ndim not in (1, 2) or labels.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"{lab} must hold one label per row of {emb}; pass the labels of those "
            f"{embeddings.shape[0]} rows."
        )


def _report_table(report: Any) -> Table:
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in report_rows(report):
        table.add_row(name, f"{value:.4f}")
    return table


def evaluate(
    embeddings: str = typer.Argument(
        ..., help="Query embeddings (n, d): .npy, .npz (file.npz:key), .pt/.pth (a tensor)."
    ),
    labels: str = typer.Argument(
        ...,
        help="Labels (n,) class ids or (n, C) multi-hot, same formats; or .txt / .csv / .tsv: one "
        "per line, or a column (file.csv:COLUMN; default the first, a header row skipped).",
    ),
    gallery: str | None = typer.Option(
        None, "--gallery", help="Gallery embeddings; default: leave-one-out over EMBEDDINGS."
    ),
    gallery_labels: str | None = typer.Option(
        None, "--gallery-labels", help="Gallery labels (required with --gallery), as LABELS."
    ),
    ks: str = typer.Option("1,10,100", "--ks", help="Cut-offs for recall@k / precision@k."),
    similarity: str = typer.Option("cosine", "--similarity", help="cosine, dot or euclidean."),
    ties: str = typer.Option(
        "expected", "--ties", help="expected (tie-aware), optimistic or pessimistic."
    ),
    json_out: Path | None = typer.Option(
        None,
        "--json",
        metavar="FILE",
        help="Write the report as JSON; '-' writes it to stdout (the table then goes to stderr).",
    ),
    plot_pr: Path | None = typer.Option(
        None, "--plot-pr", help="Write the mean precision-recall curve as a PNG."
    ),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ..."),
    fpr: str | None = typer.Option(
        None,
        "--fpr",
        metavar="FPRS",
        help="Also the verification metrics of the query-gallery pairs: ROC AUC and TPR "
        "(1 - FNMR) at each false positive rate (FMR), e.g. 1e-3,1e-4; exact, streamed.",
    ),
) -> None:
    """Exact tie-aware retrieval metrics (mAP, recall@k, MAP@R) of saved embeddings."""
    from ..metrics.retrieval import pr_curve, retrieval_metrics
    from ..metrics.verification import verification_metrics

    # `--json -`: stdout carries the JSON alone; people read the table on stderr
    console = Console(stderr=json_out is not None and str(json_out) == "-")
    with cli_errors("evaluation", FLAGS, bad_input=(ValueError, FileNotFoundError)):
        ks_tuple = parse_ks(ks)
        fprs = parse_fprs(fpr)
        dev = _check_device(device)
        if (gallery is None) != (gallery_labels is None):
            raise ValueError("pass both --gallery and --gallery-labels, or neither.")
        if plot_pr is not None and plot_pr.suffix.lower() != ".png":
            raise ValueError(f"--plot-pr must name a .png file, got {plot_pr}.")
        _check_output_path(json_out, "--json")
        _check_output_path(plot_pr, "--plot-pr")
        query = load_array(embeddings, "EMBEDDINGS")
        query_labels = load_labels(labels, "LABELS")
        _check_pair(query, query_labels, (embeddings, labels), ("EMBEDDINGS", "LABELS"))
        gallery_t = gallery_labels_t = None
        if gallery is not None and gallery_labels is not None:
            gallery_t = load_array(gallery, "--gallery")
            gallery_labels_t = load_labels(gallery_labels, "--gallery-labels")
            pair = (gallery, gallery_labels), ("--gallery", "--gallery-labels")
            _check_pair(gallery_t, gallery_labels_t, *pair)
        arrays = (query, query_labels, gallery_t, gallery_labels_t)
        options: dict[str, Any] = {"similarity": similarity, "ties": ties, "device": dev}
        report = retrieval_metrics(*arrays, ks=ks_tuple, **options)
        if fprs:  # the pair view of the same pairs, under the same similarity
            pairs = verification_metrics(*arrays, fpr=fprs, similarity=similarity, device=dev)
            report = report.with_verification(pairs)
        curve = pr_curve(*arrays, **options) if plot_pr is not None else None

    mode = "leave-one-out" if gallery is None else f"gallery {gallery}"
    console.print(
        f"[bold]{escape(embeddings)}[/bold]: {escape(mode)}, {report.similarity} similarity, "
        f"ties={report.ties}",
        soft_wrap=True,
    )
    console.print(_report_table(report))
    console.print(
        f"queries: {report.n_queries}, gallery items: {report.n_gallery}, "
        f"excluded queries (no relevant item in the gallery): {report.n_queries_without_relevant}",
        soft_wrap=True,
    )
    for k, used in report.clamped_ks.items():
        console.print(f"k={k} exceeds the ranked list; evaluated at k={used}.", soft_wrap=True)
    if report.verification is not None:
        view = report.verification
        console.print(
            f"verification pairs: {view.n_positive_pairs} positive, {view.n_negative_pairs} "
            f"negative, {view.n_excluded_pairs} excluded ({view.pairs}); FNMR = 1 - TPR",
            soft_wrap=True,
        )
    with cli_errors("evaluation", bad_input=(ValueError,)):  # a write that fails after all
        _write_outputs(report, curve, json_out, plot_pr, embeddings, mode, console)
