"""Convergence figure of a training run (training loss and validation mAP).

Convergence figure of a training run: training loss and validation mAUPRC (tie-aware mAP)
against the optimizer step, the right panel of Fig. 2 of Wen et al., *Exploring the
Algorithm-Dependent Generalization of AUPRC Optimization with List Stability* (NeurIPS 2022).

Drawn with matplotlib's object API on an Agg canvas (no pyplot state), like :mod:`rankwise.plots`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["plot_training_curves"]


def plot_training_curves(
    records: Sequence[Mapping[str, Any]], path: str | Path, title: str | None = None
) -> Path:
    """Save a two-panel PNG: mean training loss and validation mAP against the step.

    Args:
        records: the rows of ``metrics.jsonl``: ``{"kind": "train", "step", "loss", ...}`` and
            ``{"kind": "val", "step", "map", ...}``; other kinds are ignored.
        path: output ``.png`` file (parent folders are created).
        title: figure title.

    Returns:
        The path written.
    """
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train"]
    val = [(r["step"], r["map"]) for r in records if r.get("kind") == "val"]
    fig = Figure(figsize=(9.6, 3.8))
    ax_loss, ax_map = fig.subplots(1, 2)
    if train:
        ax_loss.plot([s for s, _ in train], [v for _, v in train], linewidth=1.4)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (mean over the logging window)")
    ax_loss.grid(True, alpha=0.3)
    if val:
        ax_map.plot(
            [s for s, _ in val], [v for _, v in val], marker="o", markersize=3, linewidth=1.4
        )
    ax_map.set_xlabel("step")
    ax_map.set_ylabel("validation mAUPRC (tie-aware mAP)")
    ax_map.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(out, dpi=110)
    return out
