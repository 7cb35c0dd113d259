"""PNG figures of evaluation curves (precision-recall, ROC) and of tie-breaking ranges.

Precision-recall curves of the retrieval view (the AP that SOPRC, Wen et al. NeurIPS 2022, and
tie-aware AP_T, He et al. CVPR 2018, optimize), ROC curves of the pair view (Gajić et al., Eq.
1-3; Vogel et al., ICML 2018, pointwise ROC at FPR = alpha) and the mAP range over every
tie-breaking of Hamming rankings (He et al., CVPR 2018, Fig. 3).

Drawn with matplotlib's object API on an Agg canvas (no pyplot state, window or backend
switch), so safe on headless machines and inside training loops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._extras import require

require(("matplotlib",), "train", "rankwise.plots")

import matplotlib  # noqa: E402 - after the dependency check
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = ["plot_pr_curves", "plot_roc_curves", "plot_tie_ranges"]


def _legend_text(name: str, labels: Mapping[str, float | str] | None, default: str) -> str:
    if labels is None or name not in labels:
        return default
    value = labels[name]
    if isinstance(value, str):
        return value
    return f"{name} (mAP {100 * float(value):.2f} %)"  # in %, as every table shows it


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ValueError(f"`path` must end in .png, got {str(path)!r}.")
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=120, bbox_inches="tight")  # keeps a legend placed beside the axes
    return out


def _xy(curve: Any, name: str, x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
    """The curve's ``x`` and ``y`` arrays, checked to be 1-D of the same length."""
    xs, ys = (np.asarray(getattr(curve, key), dtype=np.float64) for key in (x, y))
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError(
            f"curve {name!r}: `{x}` and `{y}` must be 1-D of the same length, got "
            f"{xs.shape} and {ys.shape}."
        )
    return xs, ys


# after tab10's 10 colours: other dashes and markers, never a pale shade (the 11th must read too)
_DASHES = ("-", "--", "-.", ":")
_MARKERS = (None, "o", "s", "^")


def _line_styles(n: int) -> list[dict[str, Any]]:  # Line2D keyword properties
    """A distinct, readable style per curve: tab10's colours, then other dashes and markers."""
    cmap = matplotlib.colormaps["tab10"]
    styles: list[dict[str, Any]] = []
    for i in range(n):
        group = (i // 10) % len(_DASHES)
        style: dict[str, Any] = {"color": cmap(i % 10), "linestyle": _DASHES[group]}
        if _MARKERS[group] is not None:
            style.update(marker=_MARKERS[group], markevery=0.1, markersize=4)
        styles.append(style)
    return styles


# no-learning reference curves (raw input, untrained network): grey and black, dotted
_REFERENCE_STYLES = (
    {"color": "0.25", "linestyle": ":", "linewidth": 2.2},
    {"color": "0.55", "linestyle": (0, (1, 3)), "linewidth": 2.2},
)


def plot_pr_curves(
    curves: Mapping[str, Any],
    path: str | Path,
    title: str | None = None,
    labels: Mapping[str, float | str] | None = None,
    references: Sequence[str] = (),
) -> Path:
    """Draw several precision-recall curves on one figure and save it as a PNG.

    Args:
        curves: method name -> ``PRCurve`` (anything with 1-D ``recall`` and ``precision`` arrays
            of the same length, e.g. the result of :func:`rankwise.metrics.retrieval.pr_curve`).
        path: output ``.png`` file (parent folders are created).
        title: figure title.
        labels: optional method name -> mAP (a fraction, shown in % as "name (mAP 12.34 %)")
            or a full legend string.
        references: names in ``curves`` that are no-learning references (raw input, untrained
            network): drawn grey and dotted, after the methods.

    Returns:
        The path written, as a :class:`pathlib.Path`.
    """
    if not curves:
        raise ValueError("`curves` is empty; pass at least one name -> PRCurve.")
    unknown = [name for name in references if name not in curves]
    if unknown:
        raise ValueError(f"`references` {unknown} are not in `curves`.")
    methods = [name for name in curves if name not in references]
    styles = dict(zip(methods, _line_styles(len(methods)), strict=True))
    for i, name in enumerate(references):
        styles[name] = dict(_REFERENCE_STYLES[i % len(_REFERENCE_STYLES)])
    many = len(curves) > 6  # a long legend goes beside the axes, never over the curves
    fig = Figure(figsize=(10.0 if many else 6.4, 5.2 if many else 4.8))
    ax = fig.add_subplot()
    for name in [*methods, *references]:
        recall, precision = _xy(curves[name], name, "recall", "precision")
        style = {"linewidth": 1.8, **styles[name]}
        ax.plot(recall, precision, label=_legend_text(name, labels, name), **style)
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("recall")
    ax.set_ylabel("precision (mean over queries)")
    ax.grid(True, alpha=0.3)
    if many:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small", frameon=False)
    else:
        ax.legend(loc="best", fontsize="small")
    ax.set_title(title or "Precision-recall")
    fig.tight_layout()
    return _save(fig, path)


def plot_roc_curves(
    curves: Mapping[str, Any],
    path: str | Path,
    title: str | None = None,
    log_fpr: bool = True,
) -> Path:
    """Draw several ROC curves (pair view) on one figure and save it as a PNG.

    Args:
        curves: method name -> :class:`rankwise.metrics.curves.RocCurve` (``fpr``, ``tpr`` arrays;
            the legend shows its ``auc``).
        path: output ``.png`` file (parent folders are created).
        title: figure title.
        log_fpr: logarithmic FPR axis (where verification systems operate), starting at the
            smallest non-zero FPR over all curves (FPR = 0 cannot be drawn on it).

    Returns:
        The path written, as a :class:`pathlib.Path`.
    """
    if not curves:
        raise ValueError("`curves` is empty; pass at least one name -> RocCurve.")
    fig = Figure(figsize=(6.4, 4.8))
    ax = fig.add_subplot()
    smallest_fpr = 1.0
    for style, (name, curve) in zip(_line_styles(len(curves)), curves.items(), strict=True):
        fpr, tpr = _xy(curve, name, "fpr", "tpr")
        positive = fpr[fpr > 0]
        if positive.size:
            smallest_fpr = min(smallest_fpr, float(positive.min()))
        auc = getattr(curve, "auc", None)
        label = f"{name} (AUC {auc:.4f})" if isinstance(auc, float) else name
        ax.plot(fpr, tpr, linewidth=1.8, label=label, **style)
    low = min(smallest_fpr, 0.1) if log_fpr else 0.0
    chance = np.geomspace(low, 1.0, 100) if log_fpr else np.array([0.0, 1.0])
    ax.plot(chance, chance, "k:", linewidth=1.0, label="chance")
    if log_fpr:
        ax.set_xscale("log")
    ax.set_xlim(low, 1.0)
    ax.set_ylim(0.0, 1.02)
    ax.set_xlabel("false positive rate" + (" (log scale)" if log_fpr else ""))
    ax.set_ylabel("true positive rate")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(title or "ROC (pairs)")
    fig.tight_layout()
    return _save(fig, path)


def plot_tie_ranges(results: Sequence[Any], path: str | Path, title: str = "") -> Path:
    """The paper's Fig. 3: per code length, each method's mAP range over all tie-breakings.

    A horizontal bar spans ``[worst, best]`` mAP attainable by reordering ties; the dot is the
    tie-aware mAP.

    Args:
        results: hash sweep results (``method``, ``bits``, ``map``, ``map_range``), e.g.
            :class:`~rankwise.workflows.hashing.MethodResult`.
        path: the ``.png`` to write.
        title: the figure's title.
    """
    bits = sorted({r.bits for r in results})
    methods = list(dict.fromkeys(r.method for r in results))
    fig = Figure(figsize=(3.2 * len(bits), 0.45 * len(methods) + 1.2))
    axes = np.atleast_1d(fig.subplots(1, len(bits), sharey=True))
    colours = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, b in zip(axes, bits, strict=True):
        for i, m in enumerate(methods):
            r = next((r for r in results if r.method == m and r.bits == b), None)
            if r is None or not np.isfinite(r.map):
                continue
            lo, hi = r.map_range
            ax.plot([lo, hi], [i, i], color=colours[i % len(colours)], linewidth=6, alpha=0.5)
            ax.plot([r.map], [i], "o", color="black", markersize=4)
        ax.set_title(f"{b} bits")
        ax.set_xlabel("mAP")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(methods)), methods)
    axes[0].invert_yaxis()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, path)
