"""``rankwise evaluate``: exact, tie-aware retrieval report of saved embeddings.

Loads embeddings and labels from .npy / .npz / .pt files, ranks every query against the gallery
(or leave-one-out) and prints :func:`rankwise.metrics.retrieval.retrieval_metrics`: mAP (the
tie-aware AP_T of He et al., *Hashing as Tie-Aware Learning to Rank*, CVPR 2018, Prop. 1 with Eq. 6
as corrected in docs/errata.md), recall@k, precision@k, MAP@R and R-precision. Optionally writes
the report as JSON and the mean PR curve as a PNG. Bad input: a one-line error, exit code 2.
"""

from __future__ import annotations

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

__all__ = ["evaluate", "load_array", "parse_ks"]

_EXTENSIONS = (".npy", ".npz", ".pt", ".pth")


def _split_key(spec: str) -> tuple[Path, str | None]:
    """``"file.npz:key"`` -> (Path("file.npz"), "key"); a plain path -> (Path, None)."""
    path = Path(spec)
    if path.exists() or ":" not in spec:
        return path, None
    head, _, key = spec.rpartition(":")
    if Path(head).suffix.lower() in _EXTENSIONS and key:
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
        ..., help="Labels (n,) class ids or (n, C) multi-hot, same formats."
    ),
    gallery: str | None = typer.Option(
        None, "--gallery", help="Gallery embeddings; default: leave-one-out over EMBEDDINGS."
    ),
    gallery_labels: str | None = typer.Option(
        None, "--gallery-labels", help="Gallery labels (required with --gallery)."
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
) -> None:
    """Exact tie-aware retrieval metrics (mAP, recall@k, MAP@R) of saved embeddings."""
    from ..metrics.retrieval import pr_curve, retrieval_metrics

    # `--json -`: stdout carries the JSON alone; people read the table on stderr
    console = Console(stderr=json_out is not None and str(json_out) == "-")
    with cli_errors("evaluation", bad_input=(ValueError, FileNotFoundError)):
        ks_tuple = parse_ks(ks)
        dev = _check_device(device)
        if (gallery is None) != (gallery_labels is None):
            raise ValueError("pass both --gallery and --gallery-labels, or neither.")
        if plot_pr is not None and plot_pr.suffix.lower() != ".png":
            raise ValueError(f"--plot-pr must name a .png file, got {plot_pr}.")
        _check_output_path(json_out, "--json")
        _check_output_path(plot_pr, "--plot-pr")
        query = load_array(embeddings, "EMBEDDINGS")
        query_labels = load_array(labels, "LABELS")
        gallery_t = load_array(gallery, "--gallery") if gallery is not None else None
        gallery_labels_t = (
            load_array(gallery_labels, "--gallery-labels") if gallery_labels is not None else None
        )
        arrays = (query, query_labels, gallery_t, gallery_labels_t)
        options: dict[str, Any] = {"similarity": similarity, "ties": ties, "device": dev}
        report = retrieval_metrics(*arrays, ks=ks_tuple, **options)
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
    with cli_errors("evaluation", bad_input=(ValueError,)):  # a write that fails after all
        _write_outputs(report, curve, json_out, plot_pr, embeddings, mode, console)
