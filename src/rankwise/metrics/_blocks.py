"""The query-block marker: which ``metric_fn`` / ``curve_fn`` may rank a block of the queries.

A retrieval metric is a mean of per-query values, each depending only on the query's scores
against the whole gallery (He et al., CVPR 2018, Prop. 1 for the tie-aware AP), so a block of the
query rows ranked against the full gallery gives exactly those rows' per-query values.
A function marked by :func:`query_blocks` promises the block call of
:func:`rankwise.metrics.sharded_metric` / :func:`~rankwise.metrics.sharded_curve` (see there and
docs/metrics.md, "Sharded evaluation"); an unmarked one is only ever called on every query.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["BLOCK_KEYWORDS", "query_blocks", "supports_query_blocks"]

_F = TypeVar("_F", bound=Callable[..., Any])

# keywords the block call passes; a partial that presets one of them cannot take the block call
BLOCK_KEYWORDS = ("exclude_self", "keep_per_query")
_MARK = "supports_query_blocks"


def query_blocks(fn: _F) -> _F:
    """Mark ``fn`` as taking the block call of :func:`~rankwise.metrics.sharded_metric`.

    The promise: ``fn(query[lo:hi], query_labels[lo:hi], gallery, gallery_labels,
    exclude_self=rows, **kwargs)`` (``gallery`` never ``None``; ``rows`` the ``(hi - lo,)``
    gallery row of each query, ``-1`` for none, or ``False``) returns the report of those queries
    ranked against the whole gallery, carrying its per-query values (``per_query_ap`` and
    ``per_query``) so that :func:`~rankwise.metrics.merge_retrieval_reports` of the blocks equals
    the call on every query; a curve function also takes ``keep_per_query=True`` and returns a
    :class:`~rankwise.metrics.PRCurve` with ``per_query_precision``.

    Args:
        fn: the function to mark (returned unchanged, with ``supports_query_blocks = True``).

    Returns:
        ``fn``.

    Example:
        >>> from rankwise.metrics import query_blocks, retrieval_metrics, supports_query_blocks
        >>> @query_blocks
        ... def dot_metrics(query, query_labels, gallery=None, gallery_labels=None, **kwargs):
        ...     return retrieval_metrics(
        ...         query, query_labels, gallery, gallery_labels, similarity="dot", **kwargs
        ...     )
        >>> supports_query_blocks(dot_metrics), supports_query_blocks(print)
        (True, False)
    """
    setattr(fn, _MARK, True)
    return fn


def supports_query_blocks(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is marked by :func:`query_blocks` (through ``functools.partial`` layers).

    A partial presetting ``exclude_self`` or ``keep_per_query`` is not: the block call would
    override the preset rows.

    Args:
        fn: a ``metric_fn`` / ``curve_fn``.

    Returns:
        ``True`` when the block call may be used.

    Example:
        >>> import functools
        >>> from rankwise.metrics import retrieval_metrics, supports_query_blocks
        >>> supports_query_blocks(functools.partial(retrieval_metrics, similarity="dot"))
        True
        >>> supports_query_blocks(functools.partial(retrieval_metrics, exclude_self=False))
        False
    """
    while isinstance(fn, functools.partial):
        if any(key in fn.keywords for key in BLOCK_KEYWORDS):
            return False
        fn = fn.func
    return getattr(fn, _MARK, False) is True
