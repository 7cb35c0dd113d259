"""Galleries of a trained run's retrievals: each row a test query and its top-k, right / wrong marked.

The picture the metric-learning peers draw of where a model fails (e.g. open-metric-learning's
"worst queries"): the queries with the lowest average precision (or chosen ones), each followed by
its ``k`` nearest gallery items with a green (same class) or red (other class) frame, their
scores and the query's AP. The test split is the run's own (:func:`rankwise.training.build.load_splits`
of its ``config.yaml``); it is embedded by the run's checkpoint, each query's AP recomputed exactly
with :func:`rankwise.metrics.retrieval_metrics` (the tie-aware AP of ``report.json`` for the
checkpoint the report evaluated), and the top-k found by :class:`rankwise.search.EmbeddingIndex`
(exact scores, equal scores in gallery order). Leave-one-out test splits never return the query
itself. No paper equation is implemented here.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.base import ArrayDataset, ImageFolderDataset, LabelledDataset
from ..metrics import retrieval_metrics
from ..search import EmbeddingIndex
from ..training.build import load_splits
from ..training.evaluation import embed_batches
from ..training.inference import LoadedRun

__all__ = ["Gallery", "GalleryRow", "build_gallery", "draw_gallery", "gallery_html"]


@dataclass(frozen=True)
class GalleryRow:
    """One query and its top-k.

    Attributes:
        query: the query's row in the test split (the order of ``report.json``'s
            ``per_query_ap``).
        label: its class id.
        ap: its average precision (tie-aware, ``NaN`` when it has no relevant item).
        ids: ``(k,)`` the results' rows in the gallery (the test split itself when leave-one-out).
        scores: ``(k,)`` their similarities, best first.
        labels: ``(k,)`` their class ids.
        correct: ``(k,)`` whether each result is of the query's class.
    """

    query: int
    label: int
    ap: float
    ids: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    correct: np.ndarray


@dataclass(frozen=True)
class Gallery:
    """The rows to draw, with the data they index.

    Attributes:
        rows: the :class:`GalleryRow` s, in drawing order.
        queries: the test split (the queries).
        gallery: what the results index (the test split itself for leave-one-out).
        k: results per row.
        similarity: the similarity of the scores.
        mean_ap: the mean AP over every query with a relevant item (the report's mAP).
    """

    rows: list[GalleryRow]
    queries: LabelledDataset
    gallery: LabelledDataset
    k: int
    similarity: str
    mean_ap: float


def _embed(run: LoadedRun, data: LabelledDataset, batch_size: int) -> torch.Tensor:
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
    batches = (x for x, _ in loader)
    return embed_batches(run.model, batches, run.device, finish=lambda e: e.float().cpu())


def _pick(ap: np.ndarray, worst: int | None, queries: list[int] | None, n: int) -> list[int]:
    """The query rows to draw: the chosen ones, or the ``worst`` by AP (ties by row)."""
    if queries is not None:
        bad = [q for q in queries if not 0 <= q < n]
        if bad:
            raise ValueError(
                f"queries: query {bad[0]} is not a row of the test split (0 .. {n - 1})."
            )
        return list(queries)
    scored = np.flatnonzero(~np.isnan(ap))
    order = scored[np.argsort(ap[scored], kind="stable")]
    return [int(i) for i in order[: int(worst or 8)]]


def build_gallery(
    run: LoadedRun,
    *,
    k: int = 5,
    worst: int | None = 8,
    queries: list[int] | None = None,
    batch_size: int = 256,
) -> Gallery:
    """The worst (or chosen) test queries of ``run`` and their top-k results.

    Args:
        run: a loaded run (:func:`rankwise.training.load_run`).
        k: results per query.
        worst: how many of the lowest-AP queries (ignored when ``queries`` is given).
        queries: test rows to draw instead.
        batch_size: items per forward pass.

    Returns:
        A :class:`Gallery`.

    Raises:
        ValueError: ``k`` larger than the gallery, or a query row out of range.
    """
    splits = load_splits(run.config)
    test, gallery = splits.test, splits.gallery
    q_emb = _embed(run, test, batch_size)
    g_emb = q_emb if gallery is None else _embed(run, gallery, batch_size)
    q_labels = np.asarray(test.labels, dtype=np.int64)
    g_labels = q_labels if gallery is None else np.asarray(gallery.labels, dtype=np.int64)
    report = retrieval_metrics(
        q_emb,
        q_labels,
        None if gallery is None else g_emb,
        None if gallery is None else g_labels,
        ks=(1,),
    )
    ap = report.per_query_ap.double().numpy()
    n_gallery = g_emb.shape[0] - (1 if gallery is None else 0)
    if not 1 <= k <= n_gallery:
        raise ValueError(f"`k` must be 1 .. {n_gallery} (the gallery's size), got {k}.")
    picked = _pick(ap, worst, queries, q_emb.shape[0])
    index = EmbeddingIndex(int(g_emb.shape[1]), "cosine")
    index.add(g_emb, labels=g_labels)
    extra = 1 if gallery is None else 0  # leave-one-out: the query itself is dropped
    result = index.search(q_emb[picked], k + extra) if picked else None
    rows = []
    for j, q in enumerate(picked):
        assert result is not None
        ids, scores = result.ids[j], result.scores[j]
        if gallery is None:
            keep = ids != q
            ids, scores = ids[keep][:k], scores[keep][:k]
        labels = g_labels[ids]
        rows.append(
            GalleryRow(
                q, int(q_labels[q]), float(ap[q]), ids, scores, labels, labels == q_labels[q]
            )
        )
    mean_ap = float(np.nanmean(ap)) if np.isfinite(ap).any() else float("nan")
    return Gallery(rows, test, test if gallery is None else gallery, k, "cosine", mean_ap)


def _picture(data: LabelledDataset, index: int) -> np.ndarray:
    """An item as an ``(H, W)`` or ``(H, W, 3)`` float image in ``[0, 1]`` for drawing."""
    if isinstance(data, ImageFolderDataset):
        image = data.load_image(index)
        image.thumbnail((96, 96))
        return np.asarray(image, dtype=np.float64) / 255.0
    if isinstance(data, ArrayDataset):
        x = data.inputs[index]
        x = x.double().div(255.0) if x.dtype == torch.uint8 else x.double()
        arr = x.numpy()
    else:  # any other dataset: its tensor as the model sees it
        arr = np.asarray(data[index][0], dtype=np.float64)
    if arr.ndim == 3:
        arr = arr[0] if arr.shape[0] == 1 else np.moveaxis(arr[:3], 0, -1)
    elif arr.ndim == 1:
        arr = arr[None, :]
    low, high = float(arr.min()), float(arr.max())
    if low < 0 or high > 1:  # features outside [0, 1] (arrays datasets): shown min-max scaled
        arr = (arr - low) / (high - low) if high > low else np.zeros_like(arr)
    return arr


def _frame(ax: Any, colour: str, width: float = 3.0) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_edgecolor(colour)
        spine.set_linewidth(width)


def draw_gallery(gallery: Gallery, path: str | Path) -> Path:
    """Draw the gallery as one figure (a row per query) and save it to ``path``.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rows, n_cols = max(1, len(gallery.rows)), gallery.k + 1
    fig, axes = plt.subplots(n_rows, n_cols, figsize=(1.6 * n_cols, 1.8 * n_rows), squeeze=False)
    for r in range(n_rows):
        for c in range(n_cols):
            axes[r][c].set_axis_off()
    for r, row in enumerate(gallery.rows):
        ax = axes[r][0]
        ax.set_axis_on()
        ax.imshow(_picture(gallery.queries, row.query), cmap="gray", vmin=0, vmax=1)
        _frame(ax, "black", 1.5)
        ax.set_title(f"query {row.query}\nAP {row.ap:.3f}", fontsize=7)
        for c, (item, score, ok) in enumerate(
            zip(row.ids, row.scores, row.correct, strict=True), start=1
        ):
            ax = axes[r][c]
            ax.set_axis_on()
            ax.imshow(_picture(gallery.gallery, int(item)), cmap="gray", vmin=0, vmax=1)
            _frame(ax, "tab:green" if ok else "tab:red")
            ax.set_title(f"#{c} {score:.3f}", fontsize=7, color="green" if ok else "red")
    fig.suptitle(
        f"{len(gallery.rows)} queries, top {gallery.k} ({gallery.similarity}); green: same "
        f"class, red: other; mAP {gallery.mean_ap:.3f}",
        fontsize=8,
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _png_data(picture: np.ndarray) -> str:
    from PIL import Image

    pixels = np.clip(np.round(picture * 255.0), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    image = Image.fromarray(pixels)
    if min(image.size) < 48:  # tiny arrays (8 x 8 digits) enlarged, pixels kept sharp
        scale = -(-48 // min(image.size))
        image = image.resize(
            (image.size[0] * scale, image.size[1] * scale), Image.Resampling.NEAREST
        )
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def gallery_html(gallery: Gallery) -> str:
    """The gallery as a self-contained HTML page (images inline), a table row per query."""
    cells = []
    for row in gallery.rows:
        parts = [
            f'<td class="q"><img src="{_png_data(_picture(gallery.queries, row.query))}"><br>'
            f"query {row.query} (class {row.label})<br>AP {row.ap:.4f}</td>"
        ]
        for rank, (item, score, ok, label) in enumerate(
            zip(row.ids, row.scores, row.correct, row.labels, strict=True), start=1
        ):
            mark = "right" if ok else "wrong"
            parts.append(
                f'<td class="{mark}"><img src="{_png_data(_picture(gallery.gallery, int(item)))}">'
                f"<br>#{rank} item {int(item)} (class {int(label)})<br>{score:.4f} {mark}</td>"
            )
        cells.append("<tr>" + "".join(parts) + "</tr>")
    title = html.escape(
        f"{len(gallery.rows)} queries and their top {gallery.k} ({gallery.similarity}); "
        f"mAP {gallery.mean_ap:.4f}"
    )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>rankwise gallery</title>'
        "<style>td{text-align:center;font:11px sans-serif;padding:4px}"
        "td img{border:4px solid #888}td.right img{border-color:#2a2}"
        "td.wrong img{border-color:#d22}td.q img{border-color:#000}</style></head><body>"
        f"<h1>{title}</h1><table>\n" + "\n".join(cells) + "\n</table></body></html>\n"
    )
