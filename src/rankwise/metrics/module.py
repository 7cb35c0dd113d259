"""Accumulating retrieval evaluator: collect embeddings batch by batch, compute the report once.

A torchmetrics-style ``nn.Module`` around :func:`rankwise.metrics.retrieval.retrieval_metrics`,
whose AP is the tie-aware AP_T of He et al., *Hashing as Tie-Aware Learning to Rank* (CVPR 2018,
Prop. 1; per-tie term as corrected in docs/errata.md, McSherry & Najork 2008). Retrieval metrics
are not decomposable over batches (every query is ranked against the whole gallery), so the module
only stores detached copies of the batches and defers all work to :meth:`RetrievalMetric.compute`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._validation import check_embeddings
from ..similarity import check_similarity
from ._inputs import check_ks, check_label_array
from .ranking import check_ties
from .retrieval import RetrievalReport, retrieval_metrics

__all__ = ["RetrievalMetric"]

_GALLERY_MODES = ("self", "separate")


class _Store:
    """Detached copies of embedding / label batches with the shape and label kind of the first."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.clear()

    def clear(self) -> None:
        self.embeddings: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.n_samples = 0
        self.dim: int | None = None
        self.label_kind: tuple[str, int] | None = None  # ("ids", 0) or ("multi_hot", n_columns)

    def append(self, embeddings: Any, labels: Any, store_device: torch.device | None) -> None:
        name = "embeddings" if self.role == "query" else "gallery embeddings"
        emb = check_embeddings(embeddings, name)
        # the same label rules as retrieval_metrics (multi-hot 0/1 only, a hint for (n, 1) ids)
        lab = check_label_array(labels, emb.shape[0], "labels", emb.device)
        if self.dim is not None and emb.shape[1] != self.dim:
            raise ValueError(
                f"`embeddings` has dimension {emb.shape[1]} but the earlier {self.role} batches "
                f"have {self.dim}; every batch must come from the same model."
            )
        kind = ("multi_hot", int(lab.shape[1])) if lab.ndim == 2 else ("ids", 0)
        if self.label_kind is not None and kind != self.label_kind:
            raise ValueError(
                f"`labels` are {_describe(kind)} but the earlier {self.role} batches had "
                f"{_describe(self.label_kind)}; use one label format for the whole evaluation."
            )
        target = emb.device if store_device is None else store_device
        # copy=True: the caller may reuse / modify its batch tensors in place after update().
        self.embeddings.append(emb.detach().to(target, copy=True))
        self.labels.append(lab.to(target, copy=True))
        self.n_samples += int(emb.shape[0])
        self.dim = int(emb.shape[1])
        self.label_kind = kind

    def concatenated(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.embeddings), torch.cat(self.labels)


def _describe(kind: tuple[str, int]) -> str:
    return "1-D class ids" if kind[0] == "ids" else f"multi-hot with {kind[1]} columns"


class RetrievalMetric(nn.Module):
    """Accumulate embeddings over batches and compute the exact retrieval report at the end.

    Example:
        >>> import torch
        >>> from rankwise.metrics import RetrievalMetric
        >>> metric = RetrievalMetric(ks=(1,))
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> for batch in (slice(0, 2), slice(2, 4)):  # e.g. `for images, labels in loader:`
        ...     metric.update(emb[batch], torch.tensor([0, 0, 1, 1])[batch])
        >>> report = metric.compute()  # RetrievalReport: map, recall_at, map_at_r, ...
        >>> report.map, report.recall_at, report.n_queries
        (0.875, {1: 0.75}, 4)
        >>> metric.reset()

    Args:
        ks, similarity, ties, exclude_self: as :func:`retrieval_metrics`.
        gallery_mode: ``"self"`` -- every accumulated sample queries all the others
            (leave-one-out); ``"separate"`` -- the batches given to :meth:`update` are queries
            and those given to :meth:`update_gallery` the gallery.
        store_device: where the accumulated copies live (default ``"cpu"`` to spare accelerator
            memory; ``None`` keeps each batch on its own device).
        chunk_size: query rows per block in :func:`retrieval_metrics`.
        compute_device: where :meth:`compute` runs (default: where the samples are stored).

    The stored batches are Python lists, not buffers: they are not part of ``state_dict()`` and
    ``.to()`` does not move them (``store_device`` decides where they live).

    Data-parallel use: each process accumulates its own shard; override :meth:`_gathered` to
    ``all_gather`` them so that :meth:`compute` ranks every query against the whole gallery.
    """

    def __init__(
        self,
        ks: tuple[int, ...] = (1, 10, 100),
        similarity: str = "cosine",
        ties: str = "expected",
        exclude_self: bool | None = None,
        gallery_mode: str = "self",
        store_device: torch.device | str | None = "cpu",
        chunk_size: int | None = None,
        compute_device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if gallery_mode not in _GALLERY_MODES:
            raise ValueError(
                f"`gallery_mode` must be one of {_GALLERY_MODES}, got {gallery_mode!r}."
            )
        similarity = check_similarity(similarity)
        check_ties(ties)
        self.ks = check_ks(ks)  # the rules of retrieval_metrics: non-empty positive integers
        self.similarity = similarity
        self.ties = ties
        self.exclude_self = exclude_self
        self.gallery_mode = gallery_mode
        self.store_device = torch.device(store_device) if store_device is not None else None
        self.chunk_size = chunk_size
        self.compute_device = compute_device
        self._queries = _Store("query")
        self._gallery = _Store("gallery")

    # -- accumulation ----------------------------------------------------------------------------
    @property
    def n_samples(self) -> int:
        """Number of query (or, in ``"self"`` mode, query-and-gallery) samples accumulated."""
        return self._queries.n_samples

    @property
    def n_gallery_samples(self) -> int:
        """Gallery samples accumulated by :meth:`update_gallery` (``"separate"`` mode)."""
        return self._gallery.n_samples

    @torch.no_grad()
    def update(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Append a batch of queries (and, in ``"self"`` mode, gallery items).

        Args:
            embeddings: (B, d) float embeddings; NaN / inf rows raise ``ValueError``.
            labels: (B,) integer class ids or (B, C) multi-hot, same kind in every batch.
        """
        self._queries.append(embeddings, labels, self.store_device)

    @torch.no_grad()
    def update_gallery(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Append a batch of gallery items (``gallery_mode="separate"`` only)."""
        if self.gallery_mode != "separate":
            raise ValueError(
                "update_gallery() needs gallery_mode='separate'; with gallery_mode='self' every "
                "sample given to update() is already part of the gallery."
            )
        self._gallery.append(embeddings, labels, self.store_device)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Same as :meth:`update` (so the module can be called like a function)."""
        self.update(embeddings, labels)

    def reset(self) -> None:
        """Forget every accumulated batch (queries and gallery)."""
        self._queries.clear()
        self._gallery.clear()

    # -- computation -----------------------------------------------------------------------------
    def _gathered(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(query, query_labels, gallery, gallery_labels)``, gallery None in ``"self"`` mode."""
        query, query_labels = self._queries.concatenated()
        if self.gallery_mode == "self":
            return query, query_labels, None, None
        gallery, gallery_labels = self._gallery.concatenated()
        return query, query_labels, gallery, gallery_labels

    def compute(self) -> RetrievalReport:
        """Exact retrieval report of everything accumulated since the last :meth:`reset`.

        Raises:
            ValueError: nothing accumulated, no gallery in ``"separate"`` mode, or query and
                gallery of different dimension / label kind.
        """
        if self._queries.n_samples == 0:
            raise ValueError(
                "RetrievalMetric.compute() called before any update(): there is nothing to "
                "evaluate; call update(embeddings, labels) for each batch first."
            )
        if self.gallery_mode == "separate":
            if self._gallery.n_samples == 0:
                raise ValueError(
                    "gallery_mode='separate' but update_gallery() was never called; add the "
                    "gallery batches with update_gallery(embeddings, labels)."
                )
            if self._gallery.dim != self._queries.dim:
                raise ValueError(
                    f"the gallery embeddings have dimension {self._gallery.dim} but the queries "
                    f"have {self._queries.dim}."
                )
            gallery_kind, query_kind = self._gallery.label_kind, self._queries.label_kind
            if gallery_kind != query_kind:
                assert gallery_kind is not None and query_kind is not None  # both hold batches
                raise ValueError(
                    f"the gallery labels are {_describe(gallery_kind)} but the query "
                    f"labels are {_describe(query_kind)}."
                )
        query, query_labels, gallery, gallery_labels = self._gathered()
        return retrieval_metrics(
            query,
            query_labels,
            gallery,
            gallery_labels,
            ks=self.ks,
            similarity=self.similarity,
            ties=self.ties,
            exclude_self=self.exclude_self,
            chunk_size=self.chunk_size,
            device=self.compute_device,
        )

    def extra_repr(self) -> str:
        """Settings and the number of accumulated samples, shown in the module's repr."""
        return (
            f"ks={self.ks}, similarity={self.similarity!r}, ties={self.ties!r}, "
            f"gallery_mode={self.gallery_mode!r}, n_samples={self.n_samples}"
        )
