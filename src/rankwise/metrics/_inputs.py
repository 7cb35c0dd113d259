"""One argument check for every metric that ranks a query set against a gallery.

``retrieval_metrics``, ``pr_curve``, ``pair_scores``, ``roc_curve_from_embeddings`` and
``RetrievalMetric`` all take ``(query, query_labels, gallery=None, gallery_labels=None)`` plus a
similarity, a device and a chunk size; this module validates them once, with one set of messages
naming the argument (the retrieval protocol is that of Musgrave et al., *A Metric Learning Reality
Check*, ECCV 2020: leave-one-out when no gallery is given).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._validation import Interval, check_embeddings, check_labels, check_scalar, resolve_device
from ..similarity import check_similarity

__all__ = [
    "MAX_CUTOFF",
    "QueryGallery",
    "block_relevance",
    "check_chunk_size",
    "check_device",
    "check_gallery_pair",
    "check_ks",
    "check_label_array",
    "check_query_gallery",
]


@dataclass
class QueryGallery:
    """Checked query / gallery embeddings and labels on one device.

    Attributes:
        query: (n_q, d) floating tensor (fp16 / bf16 kept; integer / bool codes cast to float64).
        query_labels: (n_q,) int64 class ids or (n_q, C) bool multi-hot.
        gallery: (n_g, d) floating tensor; the query tensor itself for leave-one-out.
        gallery_labels: labels of the gallery, same kind as ``query_labels``.
        leave_one_out: True when no gallery was given.
        similarity: canonical similarity name.
        device: where the tensors live.
    """

    query: torch.Tensor
    query_labels: torch.Tensor
    gallery: torch.Tensor
    gallery_labels: torch.Tensor
    leave_one_out: bool
    similarity: str
    device: torch.device

    @property
    def multi_hot(self) -> bool:
        """True for (n, C) multi-hot labels."""
        return self.query_labels.ndim == 2


def block_relevance(ql: torch.Tensor, gl: torch.Tensor) -> torch.Tensor:
    """(b, m) bool: same class id, or (multi-hot) at least one shared label."""
    if ql.ndim == 2:
        return (ql.to(torch.float32) @ gl.to(torch.float32).T) > 0
    return ql[:, None] == gl[None, :]


def check_device(device: Any, query: Any) -> torch.device:
    """The device to compute on: ``device`` (``"auto"``: CUDA if any), else the query's, else CPU.

    Raises:
        ValueError: an unknown device string, or a device this machine does not have.
    """
    if device is None:
        return query.device if isinstance(query, torch.Tensor) else torch.device("cpu")
    return resolve_device(device)


# class ids (n,) or multi-hot (n, C) of 0/1 values: the one rule of ``check_labels``
check_label_array = check_labels


def check_gallery_pair(gallery: Any, gallery_labels: Any) -> None:
    """Refuse a ``gallery`` without ``gallery_labels`` or the reverse."""
    if (gallery is None) != (gallery_labels is None):
        missing = "gallery" if gallery is None else "gallery_labels"
        raise ValueError(
            f"`{missing}` is missing: pass both `gallery` and `gallery_labels`, or neither "
            "(leave-one-out over the queries)."
        )


def check_query_gallery(
    query: Any,
    query_labels: Any,
    gallery: Any,
    gallery_labels: Any,
    *,
    similarity: Any = "cosine",
    device: Any = None,
) -> QueryGallery:
    """Validate the query / gallery arguments shared by every embedding metric.

    Raises:
        ValueError: naming the argument: NaN / inf / empty / zero-dimensional embeddings, label
            shape or kind, a lone ``gallery`` or ``gallery_labels``, mismatched dimensions or label
            vocabularies, an unknown similarity or device.
    """
    similarity = check_similarity(similarity)
    dev = check_device(device, query)
    # detached once: leave-one-out keeps `gallery is query` through the checks, so the exact
    # operands, norms and bit scans downstream are computed once for both sides
    q = check_embeddings(query, "query", dev).detach()
    ql = check_label_array(query_labels, q.shape[0], "query_labels", dev)
    check_gallery_pair(gallery, gallery_labels)
    if gallery is None:
        g, gl = q, ql
    else:
        g = q if gallery is query else check_embeddings(gallery, "gallery", dev).detach()
        gl = check_label_array(gallery_labels, g.shape[0], "gallery_labels", dev)
        if g.shape[1] != q.shape[1]:
            raise ValueError(
                f"`gallery` has dimension {g.shape[1]} but `query` has {q.shape[1]}; embed both "
                "with the same model."
            )
        if ql.ndim != gl.ndim:
            raise ValueError(
                "`query_labels` and `gallery_labels` must be the same kind: both 1-D class ids or "
                f"both (n, C) multi-hot; got {ql.ndim}-D and {gl.ndim}-D."
            )
        if ql.ndim == 2 and ql.shape[1] != gl.shape[1]:
            raise ValueError(
                f"multi-hot `query_labels` has {ql.shape[1]} columns but `gallery_labels` has "
                f"{gl.shape[1]}; use the same label vocabulary."
            )
    return QueryGallery(q, ql, g, gl, gallery is None, similarity, dev)


# the largest cut-off: cut-offs become int64 on their way to the kernels; a cut-off past a ranked
# list counts the whole list, so nothing is lost by this bound
MAX_CUTOFF = 2**63 - 1


def check_ks(ks: Any, name: str = "ks") -> tuple[int, ...]:
    """Cut-offs of R@k / P@k (a positive integer or a non-empty sequence) as Python ints, in order.

    Duplicates are removed; a ``ValueError`` names ``name`` (``"eval_ks"`` for the trainer's) for
    non-integers, cut-offs < 1 or past :data:`MAX_CUTOFF`.
    """
    if isinstance(ks, (int, np.integer)) and not isinstance(ks, (bool, np.bool_)):
        ks = (ks,)
    try:
        ks = tuple(ks)
    except TypeError:
        raise ValueError(f"`{name}` must be a sequence of positive integers, got {ks!r}.") from None
    if not ks:
        raise ValueError(f"`{name}` is empty; pass at least one cut-off, e.g. {name}=(1, 10, 100).")
    checked = [check_scalar(k, name, Interval("integer", 1, None)) for k in ks]
    too_large = [k for k in checked if k > MAX_CUTOFF]
    if too_large:
        raise ValueError(
            f"`{name}` must hold integers from 1 to 2**63 - 1 ({MAX_CUTOFF}), got {too_large[0]}; "
            "a cut-off at least as long as the ranked list counts the whole list."
        )
    return tuple(dict.fromkeys(checked))


def check_chunk_size(chunk_size: Any) -> int | None:
    """``None`` or a positive number of query rows per chunk."""
    if chunk_size is None:
        return None
    return check_scalar(chunk_size, "chunk_size", Interval("integer", 1, None))
