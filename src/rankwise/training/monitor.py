"""The validation scalar a run monitors: model selection, early stopping, the progress line, tables.

Any scalar of a :class:`~rankwise.metrics.RetrievalReport` can be monitored: its float fields by
name (``"map"``, the tie-aware mAUPRC selection of Wen et al., NeurIPS 2022, Sec. 5.1;
``"map_at_r"``, ``"r_precision"``, ``"mrr"``, ...) and every per-cutoff field ``<name>_at`` as
``"<name>@<k>"`` for an evaluated cutoff ``k`` (``"recall@1"``, ``"precision@10"``, ...). The names
are read from the report's fields, so a metric added to the report is a monitor without a change
here. The verification metrics of a run evaluated at FPR budgets (``eval_fpr``) are monitors too:
``"roc_auc"`` and ``"tpr@fpr=<fpr>"`` for an evaluated budget (``"tpr@fpr=1e-3"``). A value is read from the report itself or from its summary dict (``best_val``,
``metrics.jsonl``'s ``val`` records, ``report.json``'s ``test``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

__all__ = ["DEFAULT_MONITOR", "check_monitor", "monitor_label", "monitor_names", "monitor_value"]

DEFAULT_MONITOR = "map"

# how the progress line and the tables write a monitor (the others are written as named)
_LABELS = {"map": "mAP", "map_at_r": "MAP@R", "r_precision": "R-precision", "roc_auc": "ROC AUC"}
# the verification scalars (RetrievalReport.verification, evaluated at FPR budgets: eval_fpr)
_AUC = "roc_auc"
_TPR = "tpr@fpr="


def _tpr_budget(name: str) -> float | None:
    """The FPR of a ``"tpr@fpr=<fpr>"`` name (``None`` for any other name or a bad number)."""
    if not name.startswith(_TPR):
        return None
    try:
        value = float(name[len(_TPR) :])
    except ValueError:
        return None
    return value if 0.0 < value < 1.0 else None


def _check_verification(name: str, fprs: Iterable[float] | None, argument: str) -> str | None:
    """``name`` when it is a verification monitor the evaluation reports, else ``None``."""
    budget = _tpr_budget(name)
    if name != _AUC and budget is None:
        return None
    if fprs is None:
        return name
    evaluated = sorted({float(f) for f in fprs})
    if not evaluated or (budget is not None and budget not in evaluated):
        wanted = "a budget" if budget is None else f"{budget!r}"
        raise ValueError(
            f"`{argument}`: {name!r} is a verification metric, reported only at the FPR budgets "
            f"the evaluation is given (eval_fpr={evaluated}); add {wanted} to eval_fpr."
        )
    return name


def _report_fields() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The scalar fields and the per-cutoff families (``recall`` of ``recall_at``) of the report."""
    from ..metrics import RetrievalReport

    scalars, families = [], []
    for f in fields(RetrievalReport):
        kind = str(f.type).replace(" ", "")
        if kind == "float":
            scalars.append(f.name)
        elif f.name.endswith("_at") and kind == "dict[int,float]":
            families.append(f.name[: -len("_at")])
    return tuple(scalars), tuple(families)


def monitor_names(ks: Iterable[int]) -> tuple[str, ...]:
    """Every name that can be monitored when the evaluation reports the cutoffs ``ks``.

    Args:
        ks: the evaluated cutoffs (``eval_ks``).

    Returns:
        The scalar names, then ``"<family>@<k>"`` for each family and cutoff.

    Example:
        >>> monitor_names([1, 10])  # doctest: +NORMALIZE_WHITESPACE
        ('map', 'map_at_r', 'r_precision', 'mrr', 'recall@1', 'recall@10', 'precision@1',
         'precision@10', 'ndcg@1', 'ndcg@10')
    """
    scalars, families = _report_fields()
    ks = sorted({int(k) for k in ks})
    return scalars + tuple(f"{family}@{k}" for family in families for k in ks)


def check_monitor(
    name: Any,
    ks: Iterable[int] | None = None,
    argument: str = "monitor",
    *,
    fprs: Iterable[float] | None = None,
) -> str:
    """Validate a monitor name; with ``ks``, its cutoff must be evaluated.

    Args:
        name: the name, e.g. ``"map"``, ``"recall@1"``, ``"roc_auc"`` or ``"tpr@fpr=1e-3"``.
        ks: the evaluated cutoffs (``None``: any cutoff ``k >= 1``).
        argument: the argument or config key the error names.
        fprs: the evaluated FPR budgets (``eval_fpr``; ``None``: any budget in (0, 1)); a
            verification monitor needs one (``tpr@fpr=<fpr>``: that one).

    Returns:
        ``name``.

    Raises:
        ValueError: an unknown name, listing the valid ones.

    Example:
        >>> check_monitor("recall@1", ks=[1, 10])
        'recall@1'
    """
    scalars, families = _report_fields()
    if isinstance(name, str):
        if _check_verification(name, fprs, argument) is not None:
            return name
        if name in scalars:
            return name
        family, at, k = name.partition("@")
        if at and family in families and k.isdigit() and int(k) >= 1:
            if ks is None or int(k) in {int(c) for c in ks}:
                return name
    valid = (
        ", ".join(monitor_names(ks))
        if ks is not None
        else ", ".join(scalars + tuple(f"{f}@<k>" for f in families))
    )
    valid += f", {_AUC}, {_TPR}<fpr> (with eval_fpr)"
    cutoffs = "" if ks is None else f" (the cutoffs evaluated: eval_ks={sorted(ks)})"
    raise ValueError(
        f"`{argument}`: unknown validation metric {name!r}; choose one of {valid}{cutoffs}."
    )


def monitor_value(report: Any, name: str) -> float:
    """The monitored value of a report, or of its summary dict (``report.to_dict()``).

    Args:
        report: a :class:`~rankwise.metrics.RetrievalReport` (or a report with the same fields)
            or a mapping as ``to_dict()`` gives it.
        name: a monitor name (:func:`check_monitor`).

    Returns:
        The value, a float.

    Raises:
        ValueError: the report has no such value (e.g. a cutoff it did not evaluate), naming
            the ones it has.

    Example:
        >>> monitor_value({"map": 0.5, "recall_at": {"1": 0.75}}, "recall@1")
        0.75
    """
    verification = _verification_value(report, name)
    if verification is not None:
        return verification
    family, at, k = name.partition("@")
    try:
        if at:
            values = (
                report[f"{family}_at"]
                if isinstance(report, Mapping)
                else getattr(report, f"{family}_at")
            )
            by_k = {int(key): value for key, value in values.items()}
            return float(by_k[int(k)])
        return float(report[name] if isinstance(report, Mapping) else getattr(report, name))
    except (KeyError, AttributeError, TypeError, ValueError):
        pass
    summary = report if isinstance(report, Mapping) else getattr(report, "to_dict", dict)()
    have = [
        key if not isinstance(v, Mapping) else f"{key[: -len('_at')]}@{{{','.join(map(str, v))}}}"
        for key, v in summary.items()
        if isinstance(v, float) or (key.endswith("_at") and isinstance(v, Mapping))
    ]
    raise ValueError(
        f"the validation report has no {name!r} (the monitored metric); it has: "
        f"{', '.join(have) or 'nothing monitorable'}. Monitor one of those, or add the cutoff "
        "to eval_ks."
    )


def _verification_value(report: Any, name: str) -> float | None:
    """The value of a verification monitor (``None`` for another name).

    Raises:
        ValueError: the report has no verification metrics, or not at that budget.
    """
    budget = _tpr_budget(name)
    if name != _AUC and budget is None:
        return None
    view = report.get("verification") if isinstance(report, Mapping) else None
    if not isinstance(report, Mapping) and getattr(report, "verification", None) is not None:
        view = report.verification.to_dict()
    if view is not None:
        if budget is None:
            return float(view["roc_auc"])
        by_fpr = {float(k): v for k, v in (view.get("tpr_at_fpr") or {}).items()}
        if budget in by_fpr:
            return float(by_fpr[budget])
    have = "none" if view is None else ", ".join(view.get("tpr_at_fpr") or {}) or "none"
    raise ValueError(
        f"the validation report has no {name!r} (the monitored metric): its verification "
        f"metrics were evaluated at the FPR budgets: {have}. Add the budget to eval_fpr."
    )


def monitor_label(name: str) -> str:
    """How messages and tables write the monitor: ``"mAP"`` for ``"map"``, else the name.

    Example:
        >>> monitor_label("map"), monitor_label("recall@1")
        ('mAP', 'recall@1')
    """
    return _LABELS.get(name, name)


def monitor_of(record: Mapping[str, Any] | None) -> str:
    """The monitor of a run from its config record (``selection.monitor``; default ``"map"``)."""
    if not record:
        return DEFAULT_MONITOR
    selection = record.get("selection") or {}
    return str(selection.get("monitor") or DEFAULT_MONITOR)
