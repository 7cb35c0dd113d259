"""Convergence figure of a training run (training loss and validation mAP).

Training loss and validation mAUPRC (tie-aware mAP) against the step: the right panel of Fig. 2
of Wen et al. (NeurIPS 2022). Matplotlib's object API on an Agg canvas, like :mod:`rankwise.plots`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .monitor import monitor_label, monitor_value

__all__ = ["MIN_LOSS_SPAN", "MIN_MAP_SPAN", "plot_training_curves", "training_figure"]


# the narrowest y range of the mAP panel: a wobble of a few thousandths must not fill the axis
# and read as a trend (matplotlib autoscales to the data's own range)
MIN_MAP_SPAN = 0.1
# the narrowest y range of the loss panel, relative to the largest |loss|
MIN_LOSS_SPAN = 0.1


def _span_at_least(low: float, high: float, span: float) -> tuple[float, float]:
    """``(low, high)`` widened symmetrically to at least ``span``."""
    if high - low >= span:
        pad = 0.05 * (high - low)
        return low - pad, high + pad
    middle = (low + high) / 2.0
    return middle - span / 2.0, middle + span / 2.0


def training_figure(
    records: Sequence[Mapping[str, Any]],
    title: str | None = None,
    selected_step: int | None = None,
    monitor: str = "map",
) -> Figure:
    """The two-panel figure of :func:`plot_training_curves` (not saved).

    Args:
        records: see :func:`plot_training_curves`.
        title: figure title.
        selected_step: see :func:`plot_training_curves`.
        monitor: see :func:`plot_training_curves`.

    Returns:
        The matplotlib figure; the mAP panel spans at least :data:`MIN_MAP_SPAN` (within
        [0, 1]) and the loss panel at least :data:`MIN_LOSS_SPAN` of its largest value.
    """
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], monitor_value(r, monitor)) for r in records if r.get("kind") == "val"]
    fig = Figure(figsize=(9.6, 3.8))
    ax_loss, ax_map = fig.subplots(1, 2)
    if train:
        losses = [v for _, v in train]
        ax_loss.plot([s for s, _ in train], losses, linewidth=1.4)
        scale = max(abs(v) for v in losses) or 1.0
        ax_loss.set_ylim(*_span_at_least(min(losses), max(losses), MIN_LOSS_SPAN * scale))
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (mean over the logging window)")
    ax_loss.grid(True, alpha=0.3)
    if val:
        maps = [v for _, v in val]
        ax_map.plot([s for s, _ in val], maps, marker="o", markersize=3, linewidth=1.4)
        low, high = _span_at_least(min(maps), max(maps), MIN_MAP_SPAN)
        if low < 0.0:
            low, high = 0.0, max(high - low, high)
        if high > 1.0:
            low, high = min(low, 1.0 - (high - low)), 1.0
        ax_map.set_ylim(max(low, 0.0), high)
    if selected_step is not None:
        chosen = dict(val).get(selected_step)
        label = f"selected: step {selected_step}" + (
            f", val {monitor_label(monitor)} {chosen:.4f}" if chosen is not None else ""
        )
        for ax in (ax_loss, ax_map):
            ax.axvline(selected_step, color="tab:red", linestyle="--", linewidth=1.0, label=label)
        if chosen is not None:
            ax_map.plot([selected_step], [chosen], marker="*", markersize=11, color="tab:red")
        ax_map.legend(loc="lower right", fontsize="small")
    ax_map.set_xlabel("step")
    ax_map.set_ylabel(
        "validation mAUPRC (tie-aware mAP)"
        if monitor == "map"
        else f"validation {monitor_label(monitor)}"
    )
    ax_map.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_training_curves(
    records: Sequence[Mapping[str, Any]],
    path: str | Path,
    title: str | None = None,
    selected_step: int | None = None,
    monitor: str = "map",
) -> Path:
    """Save a two-panel PNG: mean training loss and validation mAP against the step.

    Args:
        records: the rows of ``metrics.jsonl``: ``{"kind": "train", "step", "loss", ...}`` and
            ``{"kind": "val", "step", "map", ...}``; other kinds are ignored.
        path: output ``.png`` file (parent folders are created).
        title: figure title.
        selected_step: the step of the model selected on validation (the one the test report
            evaluates), marked with a dashed line and a star.
        monitor: the validation scalar drawn (:mod:`rankwise.training.monitor`; the one
            that selected the model).

    Returns:
        The path written.
    """
    fig = training_figure(records, title, selected_step, monitor)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=110)
    return out
