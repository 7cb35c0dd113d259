"""Tables of sweep results, as Markdown and as rich tables.

The Table 1 / Table 2 layout of Wen et al. (NeurIPS 2022), Sec. 5.2-5.3 (test mAUPRC = tie-aware
mAP, R@1, R@10, MAP@R, mean ± std over seeds, in %), and the validation table of a tuning sweep.

The functions read the plain ``bench.json`` / ``tune.json`` summaries, so a finished sweep's
table can be re-rendered; rich is imported only by the functions that print.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .metrics import RetrievalReport

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "REPORT_NAMES",
    "bench_table_markdown",
    "print_bench_table",
    "print_tune_table",
    "report_rows",
    "report_table",
]

# the names the command line (and every table) gives a RetrievalReport's fields (declared with
# the fields: RetrievalReport.FIELDS)
REPORT_NAMES = {f.attribute: f.label for f in RetrievalReport.FIELDS}


def report_rows(report: Any) -> list[tuple[str, float]]:
    """``(name, value)`` of every metric of a retrieval report, named as the command line does.

    Args:
        report: a :class:`~rankwise.metrics.RetrievalReport` (or a subclass: its own fields too).

    Returns:
        mAP, recall@k..., precision@k..., MAP@R, R-precision, ..., in the order of the report's
        ``FIELDS`` (:meth:`~rankwise.metrics.RetrievalReport.rows`).
    """
    return report.rows()


def report_table(report: Any, title: str | None = None) -> Any:
    """A rich table of a retrieval report (the metrics as fractions, 4 decimals).

    The title and the caption are lines of their own, above and below the table: a two-column
    table's own title and caption would wrap to its width (25 columns), three lines each.

    Args:
        report: a :class:`~rankwise.metrics.RetrievalReport`.
        title: the line above the table, e.g. ``"Test results of the selected model"``.

    Returns:
        A rich renderable (``rich.console.Group``): the title, the ``rich.table.Table`` and the
        caption counting the queries (and those excluded).
    """
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    evaluated = report.n_queries - report.n_queries_without_relevant
    caption = f"{report.n_queries} queries x {report.n_gallery} gallery items"
    if report.n_queries_without_relevant:
        caption += (
            f"; {report.n_queries_without_relevant} queries without a relevant item excluded, "
            f"means over {evaluated}"
        )
    table = Table(show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in report_rows(report):
        table.add_row(name, f"{value:.4f}")
    parts: list[Any] = [Text(title, style="italic")] if title else []
    return Group(*parts, table, Text(caption, style="dim"))


def _pct(mean: float, std: float, n: int = 2) -> str:
    """``mean ± std`` in %; the spread is left out when there are fewer than 2 values."""
    if n < 2:
        return f"{100 * mean:.2f}"
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def _check(flag: bool) -> str:
    return "✓" if flag else "✗"


def _verification_columns(summary: Mapping[str, Any]) -> list[str]:
    """The verification metrics the rows carry (runs evaluated with ``eval_fpr``): extra columns."""
    rows = summary.get("rows") or []
    if not rows:
        return []
    names = [key[: -len("_mean")] for key in rows[0] if key.endswith("_mean")]
    return [n for n in names if n == "roc_auc" or n.startswith("tpr@fpr=")]


def _table_columns(
    ablation: bool, monitor: str | None = None, verification: Sequence[str] = ()
) -> list[str]:
    head = ["No.", "Unb. Est.", "with v", "with L_var", "Opt."] if ablation else ["Loss"]
    # a sweep selecting on another metric shows that metric's test value too
    extra = [] if monitor is None or monitor in verification else [monitor]
    pairs = ["ROC AUC" if name == "roc_auc" else name for name in verification]
    return head + ["mAUPRC", "R@1", "R@10", "MAP@R", *extra, *pairs, "s / run"]


def _table_cells(
    row: Mapping[str, Any],
    ablation: bool,
    monitor: str | None = None,
    verification: Sequence[str] = (),
) -> list[str]:
    if ablation:
        head = [
            str(row["variant"]),
            _check(row["unbiased_estimator"]),
            _check(row["with_v"]),
            _check(row["with_semi_variance"]),
            "SGD" if row["optimizer"] == "sgd" else "Adam",
        ]
    else:
        head = [row["loss"]]
    n = len(row["seeds"]) if "seeds" in row else 2  # a seedless reference row has none
    metrics = ("map", "recall_at_1", "recall_at_10", "map_at_r")
    cells = [_pct(row[f"{key}_mean"], row[f"{key}_std"], n) for key in metrics]
    if monitor is not None and monitor not in verification:  # a reference row: a dash
        cells.append(
            _pct(row["monitor_mean"], row["monitor_std"], n) if "monitor_mean" in row else "—"
        )
    for name in verification:  # a row without it (a reference row) shows a dash
        mean = row.get(f"{name}_mean")
        cells.append("—" if mean is None else _pct(mean, row[f"{name}_std"], n))
    return [*head, *cells, f"{row['seconds']:.1f}"]


def _spread_note(summary: Mapping[str, Any]) -> str:
    seeds = summary["seeds"]
    if len(seeds) < 2:
        return "one seed, so no spread is shown"
    return f"mean ± sample std over {len(seeds)} seeds"


def _status_note(summary: Mapping[str, Any]) -> str:
    notes = []
    if summary.get("complete") is False:
        notes.append(
            f"PARTIAL: {summary.get('runs_finished', '?')} of {summary.get('runs_planned', '?')} "
            "runs finished"
        )
    if "precision" in summary:  # a bench.json of before it: float32, one pass
        sub = summary.get("sub_batch_size")
        notes.append(
            f"trained in precision {summary['precision']}"
            + ("" if sub is None else f", embedded in sub-batches of {sub}")
        )
    if summary.get("warm_up_seconds") is not None:
        notes.append(
            f"s / run excludes the {summary['warm_up_seconds']:.1f} s of numba compilation "
            "done before the first run"
        )
    return "".join(f" {note[0].upper()}{note[1:]}." for note in notes)


def bench_table_markdown(summary: Mapping[str, Any], ablation: bool = False) -> str:
    """Markdown table of a ``bench.json`` summary (values in %, mean ± std over seeds).

    Args:
        summary: the content of ``bench.json`` (``dataset``, ``protocol``, ``seeds``, ``rows``
            and optionally ``reference_rows``).
        ablation: render the Table 2 columns (variant, estimator, v, L_var, optimizer).

    Returns:
        The Markdown text, ending with a newline; reference rows are italic, without timing.
    """
    monitor = summary.get("monitor")
    pairs = _verification_columns(summary)
    columns = _table_columns(ablation, monitor, pairs)
    lines = [
        f"# rankwise bench: {summary['dataset']} ({summary['protocol']})",
        "",
        f"Seeds: {summary['seeds']}. Test metrics of the checkpoint with the best validation "
        f"{monitor or 'mAP'}, in %, {_spread_note(summary)}; mAUPRC is the tie-aware mAP."
        + _status_note(summary),
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "|".join("---" for _ in columns) + "|",
    ]
    for row in summary["rows"]:
        lines.append("| " + " | ".join(_table_cells(row, ablation, monitor, pairs)) + " |")
    for row in summary.get("reference_rows", []) if not ablation else []:
        cells = _table_cells(row, ablation, monitor, pairs)
        lines.append("| " + " | ".join([f"*{cells[0]}*", *cells[1:-1], "—"]) + " |")
    return "\n".join(lines) + "\n"


def print_bench_table(summary: Mapping[str, Any], console: Console, ablation: bool = False) -> None:
    """Print a ``bench.json`` summary on ``console``; the best mAUPRC row is bold.

    ``summary`` and ``ablation`` as :func:`bench_table_markdown`.
    """
    from rich.table import Table

    title = (
        f"{'Ablation (Table 2)' if ablation else 'Table 1'}: {summary['dataset']} "
        f"({summary['protocol']}), test metrics in %, {_spread_note(summary)}"
    )
    table = Table(title=title, caption=_status_note(summary).strip() or None)
    monitor = summary.get("monitor")
    pairs = _verification_columns(summary)
    for i, name in enumerate(_table_columns(ablation, monitor, pairs)):
        table.add_column(name, justify="left" if i == 0 and not ablation else "right")
    best = max((row["map_mean"] for row in summary["rows"]), default=math.nan)
    for row in summary["rows"]:
        style = "bold" if row["map_mean"] == best else None
        table.add_row(*_table_cells(row, ablation, monitor, pairs), style=style)
    references = summary.get("reference_rows", []) if not ablation else []
    if references:
        table.add_section()  # a rule between the trained rows and the no-learning references
    for row in references:
        table.add_row(*_table_cells(row, ablation, monitor, pairs)[:-1], "—", style="dim italic")
    console.print(table)


def _fmt(value: Any) -> str:
    return "null" if value is None else (f"{value:g}" if isinstance(value, float) else str(value))


def print_tune_table(summary: Mapping[str, Any], console: Console) -> None:
    """Print a ``tune.json`` summary: validation mAP in %, the winner of each loss marked ★.

    Args:
        summary: the content of ``tune.json`` (``grid``, ``trials`` and, once complete,
            ``winners``).
        console: the rich console to print to.
    """
    from rich.table import Table

    winners = {loss: w["trial"] for loss, w in (summary.get("winners") or {}).items() if w}
    keys = list(summary["grid"])
    table = Table(
        title=(
            f"rankwise tune: {summary['dataset']} ({summary['protocol']}), "
            f"{len(summary['seeds'])} seed(s), validation mAP in % (test never read); ★ = winner"
        )
    )
    table.add_column("", justify="center")
    table.add_column("Loss")
    for name in ["Trial", *keys, "val mAP", "per seed", "s"]:
        table.add_column(name, justify="right")
    for trial in summary["trials"]:
        won = winners.get(trial["loss"]) == trial["trial"]
        cells = ["—" if key in trial["skipped"] else _fmt(trial["params"].get(key)) for key in keys]
        mean = trial["val_map_mean"]
        per_seed = " ".join(
            "nan" if v is None else f"{100 * v:.2f}" for v in trial["val_map_per_seed"]
        )
        table.add_row(
            "★" if won else "",
            trial["loss"],
            str(trial["trial"]),
            *cells,
            "diverged" if mean is None else f"{100 * mean:.2f}",
            per_seed,
            f"{trial['seconds']:.1f}",
            style="bold" if won else None,
        )
    console.print(table)
