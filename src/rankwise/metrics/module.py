"""Accumulating retrieval evaluator: collect embeddings batch by batch, compute the report once.

A torchmetrics-style ``nn.Module`` around :func:`rankwise.metrics.retrieval.retrieval_metrics`,
whose AP is the tie-aware AP_T of He et al., *Hashing as Tie-Aware Learning to Rank* (CVPR 2018,
Prop. 1; per-tie term as corrected in docs/errata.md, McSherry & Najork 2008). Retrieval metrics
are not decomposable over batches (every query is ranked against the whole gallery), so the module
only stores detached copies of the batches and defers all work to :meth:`RetrievalMetric.compute`.
Its stores are declared states in the torchmetrics manner (``add_state(name, default=[],
dist_reduce_fx="cat")``), which :meth:`RetrievalMetric.sync` all-gathers across the ranks of a
process group.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._distributed import all_gather_rows, is_distributed
from .._validation import check_embeddings
from ..similarity import check_similarity
from ._inputs import check_ks, check_label_array
from .ranking import check_ties
from .retrieval import RetrievalReport, retrieval_metrics

__all__ = ["RetrievalMetric"]

_GALLERY_MODES = ("self", "separate")


class _Store:
    """Detached copies of embedding / label batches with the shape and label kind of the first.

    ``embeddings`` and ``labels`` are the metric's declared list states (changed in place).
    """

    def __init__(
        self, role: str, embeddings: list[torch.Tensor], labels: list[torch.Tensor]
    ) -> None:
        self.role = role
        self.embeddings = embeddings
        self.labels = labels
        self.clear()

    def clear(self) -> None:
        self.embeddings.clear()
        self.labels.clear()
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

    def signature(self) -> tuple[int, int | None, tuple[str, int] | None, str, str]:
        """``(n_samples, dim, label kind, embedding dtype, label dtype)``, sent to every rank."""
        if not self.n_samples:
            return 0, None, None, "", ""
        return (
            self.n_samples,
            self.dim,
            self.label_kind,
            str(self.embeddings[0].dtype),
            str(self.labels[0].dtype),
        )

    def agreed(self, signatures: list[Any]) -> tuple[Any, ...] | None:
        """The signature every rank with batches shares (None: no rank has any); else raise."""
        filled = [(r, sig) for r, sig in enumerate(signatures) if sig[0]]
        if not filled:
            return None
        kinds = {sig[1:] for _, sig in filled}
        if len(kinds) > 1:
            described = "; ".join(
                f"rank {r}: dimension {sig[1]}, {_describe(sig[2])} labels, {sig[3]} / {sig[4]}"
                for r, sig in filled
            )
            raise ValueError(
                f"the {self.role} batches differ across ranks ({described}); every rank must "
                "update the metric with embeddings of one model and one label format."
            )
        return tuple(filled[0][1])

    def gather(self, agreed: tuple[Any, ...], device: torch.device | None, group: Any) -> None:
        """Replace the batches by every rank's rows in rank order (a collective).

        ``agreed``: the signature of :meth:`agreed`.
        """
        _, dim, kind, emb_dtype, label_dtype = agreed
        if self.n_samples:
            embeddings, labels = self.concatenated()
        else:  # a rank without batches still joins the gather, with empty rows of the same kind
            where = torch.device("cpu") if device is None else device
            embeddings = torch.empty((0, dim), dtype=_dtype(emb_dtype), device=where)
            shape = (0,) if kind[0] == "ids" else (0, kind[1])
            labels = torch.empty(shape, dtype=_dtype(label_dtype), device=where)
        all_embeddings, sizes = all_gather_rows(embeddings, group)
        all_labels = all_gather_rows(labels, group)[0]
        self.embeddings[:] = [all_embeddings]
        self.labels[:] = [all_labels]
        self.n_samples, self.dim, self.label_kind = sum(sizes), dim, kind


def _dtype(name: str) -> torch.dtype:
    """The torch dtype named ``str(dtype)`` (``"torch.float32"``)."""
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype


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

    The stored batches are declared list states (:meth:`add_state`; ``query_embeddings``,
    ``query_labels``, ``gallery_embeddings``, ``gallery_labels``, see :attr:`metric_state`), not
    buffers: they are not part of ``state_dict()`` and ``.to()`` does not move them
    (``store_device`` decides where they live).

    Data-parallel use: each process updates with its own shard, then every process calls
    :meth:`sync` (a collective that all-gathers the states, in rank order) and :meth:`compute`
    ranks every query against the whole gallery, the same report on every rank;
    :meth:`unsync` restores the local shard. (Overriding ``_gathered``, the former hook, still
    works and is deprecated.)
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
        self._states: dict[str, list[torch.Tensor]] = {}
        self._reductions: dict[str, str] = {}
        self._local: dict[str, list[torch.Tensor]] | None = None  # the shard, while synced
        self._local_stores: list[tuple[int, int | None, tuple[str, int] | None]] = []
        for role in ("query", "gallery"):
            self.add_state(f"{role}_embeddings", default=[], dist_reduce_fx="cat")
            self.add_state(f"{role}_labels", default=[], dist_reduce_fx="cat")
        self._queries = _Store(
            "query", self._states["query_embeddings"], self._states["query_labels"]
        )
        self._gallery = _Store(
            "gallery", self._states["gallery_embeddings"], self._states["gallery_labels"]
        )
        if type(self)._gathered is not RetrievalMetric._gathered:
            warnings.warn(
                f"{type(self).__name__} overrides RetrievalMetric._gathered, which is deprecated: "
                "call metric.sync() on every rank before compute() instead.",
                DeprecationWarning,
                stacklevel=2,
            )

    # -- declared states (the torchmetrics manner) ---------------------------------------------
    def add_state(self, name: str, default: list[Any], dist_reduce_fx: str = "cat") -> None:
        """Declare an accumulated state: a list of tensors that :meth:`sync` concatenates.

        Retrieval metrics do not decompose over batches or ranks, so the only reduction is
        ``"cat"`` (every rank's rows, in rank order) of a list that starts empty.

        Args:
            name: the state's name (a key of :attr:`metric_state`).
            default: ``[]``.
            dist_reduce_fx: ``"cat"``.

        Raises:
            ValueError: another default or reduction, or a name declared twice.
        """
        if not isinstance(default, list) or default:
            raise ValueError(f"`default` of state {name!r} must be an empty list, got {default!r}.")
        if dist_reduce_fx != "cat":
            raise ValueError(
                f"`dist_reduce_fx` of state {name!r} must be 'cat' (retrieval metrics do not "
                f"decompose over ranks), got {dist_reduce_fx!r}."
            )
        if name in self._states:
            raise ValueError(f"state {name!r} is already declared.")
        self._states[name] = []
        self._reductions[name] = dist_reduce_fx

    @property
    def metric_state(self) -> dict[str, list[torch.Tensor]]:
        """The declared states: ``{name: list of stored tensors}`` (the lists themselves)."""
        return dict(self._states)

    @property
    def synced(self) -> bool:
        """Whether the states hold every rank's rows (after :meth:`sync`, before :meth:`unsync`)."""
        return self._local is not None

    def sync(self, group: Any = None) -> None:
        """All-gather every declared state across the ranks of ``group``, in rank order.

        A collective: every rank calls it (after its last :meth:`update`). Afterwards each rank
        holds the rows of all ranks, so :meth:`compute` gives the one-process report of their
        union (rank 0's rows first) on every rank. Without an initialized multi-rank process
        group it does nothing. Every rank's batches must share the dimension, label kind and
        dtypes (else the same ``ValueError`` on every rank, before any tensor moves); a rank
        without batches takes part with none.

        Args:
            group: the process group (``None``: the default one).

        Raises:
            RuntimeError: the metric is already synced (call :meth:`unsync` first).
            ValueError: the ranks' batches differ in kind.
        """
        if self._local is not None:
            raise RuntimeError("the metric is already synced; call unsync() before syncing again.")
        if not is_distributed(group):
            return
        stores = (self._queries, self._gallery)
        signatures: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(signatures, [s.signature() for s in stores], group=group)
        local = {name: list(values) for name, values in self._states.items()}
        local_stores = [(s.n_samples, s.dim, s.label_kind) for s in stores]
        agreed = [store.agreed([sig[i] for sig in signatures]) for i, store in enumerate(stores)]
        for store, kind in zip(stores, agreed, strict=True):
            if kind is not None:
                store.gather(kind, self.store_device, group)
        self._local, self._local_stores = local, local_stores

    def unsync(self) -> None:
        """Restore this rank's own batches after :meth:`sync` (no-op when not synced)."""
        if self._local is None:
            return
        for name, values in self._local.items():
            self._states[name][:] = values
        for store, (n_samples, dim, kind) in zip(
            (self._queries, self._gallery), self._local_stores, strict=True
        ):
            store.n_samples, store.dim, store.label_kind = n_samples, dim, kind
        self._local = None

    def _check_not_synced(self) -> None:
        if self._local is not None:
            raise RuntimeError(
                "the metric holds every rank's rows after sync(); call unsync() (or reset()) "
                "before update()."
            )

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
        self._check_not_synced()
        self._queries.append(embeddings, labels, self.store_device)

    @torch.no_grad()
    def update_gallery(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Append a batch of gallery items (``gallery_mode="separate"`` only)."""
        if self.gallery_mode != "separate":
            raise ValueError(
                "update_gallery() needs gallery_mode='separate'; with gallery_mode='self' every "
                "sample given to update() is already part of the gallery."
            )
        self._check_not_synced()
        self._gallery.append(embeddings, labels, self.store_device)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        """Same as :meth:`update` (so the module can be called like a function)."""
        self.update(embeddings, labels)

    def reset(self) -> None:
        """Forget every accumulated batch (queries and gallery) and leave the synced state."""
        self._local = None
        self._queries.clear()
        self._gallery.clear()

    # -- computation -----------------------------------------------------------------------------
    def _gathered(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(query, query_labels, gallery, gallery_labels)``, gallery None in ``"self"`` mode.

        Deprecated as a data-parallel hook (an override still takes effect): use :meth:`sync`.
        """
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
