"""Evaluation: embed a dataset once and rank it with the run's metric (:class:`Evaluator`).

The protocol of Wen et al. (NeurIPS 2022, Sec. 5.1 and App. D.1): validation ranked
leave-one-out with the exact tie-aware metrics (the model selection of
:class:`~rankwise.training.callbacks.BestCheckpoint`), the selected model tested (open-set:
leave-one-out; closed-set: against a gallery) with its mean PR curve. :func:`embed_batches` is
the one embedding loop of the Trainer, of :class:`~rankwise.training.inference.LoadedRun` and of
the hash codes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .._threads import preserve_torch_threads
from ..metrics import (
    PRCurve,
    RetrievalReport,
    pr_curve,
    retrieval_metrics,
    sharded_curve,
    sharded_metric,
    sharded_verification,
)
from ..metrics._inputs import check_ks
from ..metrics.verification import check_fprs
from ..similarity import SIMILARITIES
from .arguments import positive_int
from .loader import worker_init
from .strategy import SingleProcess

__all__ = ["Evaluator", "Ranking", "embed_batches", "embed_labelled"]


def embed_batches(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    device: torch.device,
    *,
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    name: str = "inputs",
) -> torch.Tensor:
    """The embeddings of every batch of inputs, concatenated (eval mode, then restored; no grad).

    Args:
        model: the embedding model.
        batches: input batches, moved to ``device``.
        device: where the model is.
        finish: applied to each batch's embeddings (e.g. to the CPU as float32).
        name: what the batches are, for the error.

    Returns:
        ``(N, d)`` embeddings.

    Raises:
        ValueError: there was no batch.
    """
    was_training = model.training
    model.eval()
    chunks = []
    try:
        with torch.no_grad():
            for x in batches:
                out = model(x.to(device, non_blocking=True))
                chunks.append(out if finish is None else finish(out))
    finally:
        model.train(was_training)
    if not chunks:
        raise ValueError(f"`{name}` is empty.")
    return torch.cat(chunks)


def embed_labelled(
    model: nn.Module,
    loader: Iterable[tuple[torch.Tensor, Any]],
    device: torch.device,
    *,
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, np.ndarray]:
    """:func:`embed_batches` of a loader of ``(x, label)`` batches, with the ``(N,)`` int64 labels.

    Args:
        model: see :func:`embed_batches`.
        loader: ``(inputs, labels)`` batches.
        device: see :func:`embed_batches`.
        finish: see :func:`embed_batches`.

    Returns:
        ``(embeddings (N, d), labels (N,))``.
    """
    labels: list[torch.Tensor] = []

    def inputs() -> Iterator[torch.Tensor]:
        for x, y in loader:
            labels.append(torch.as_tensor(y).reshape(-1))
            yield x

    embeddings = embed_batches(model, inputs(), device, finish=finish, name="dataset")
    return embeddings, torch.cat(labels).numpy().astype(np.int64, copy=False)


@dataclass(frozen=True)
class Ranking:
    """What :meth:`Evaluator.rank` found.

    Attributes:
        report: the ``metric_fn`` report (a :class:`~rankwise.metrics.RetrievalReport`).
        embeddings: the ``(N, d)`` embeddings of the queries (the collapse detector reads them).
        curve: the ``curve_fn`` curve (``None`` unless asked for).
    """

    report: Any
    embeddings: torch.Tensor
    curve: Any = None


class Evaluator:
    """The evaluation of a run: embed the data, rank it with ``metric_fn``, draw ``curve_fn``.

    Queries are ranked leave-one-out, or against a gallery (closed-set). Under data parallelism
    (the ``strategy``) every process embeds a contiguous shard and the embeddings are gathered in
    order, so ``metric_fn`` sees the whole split on every process and a custom one is honoured.

    This is the one place evaluation happens. Under data parallelism a ``metric_fn`` marked with
    :func:`rankwise.metrics.query_blocks` (the default ones are) ranks only this process's share of
    the queries against the gathered gallery and the reports are merged exactly
    (:func:`rankwise.metrics.sharded_metric`), so every process gets the one-process report; an
    unmarked custom one ranks the whole split on every process, with a one-time warning.

    Args:
        metric_fn: called as ``metric_fn(query, query_labels, gallery, gallery_labels, ks=ks)``
            (``gallery`` ``None`` for leave-one-out); default
            :func:`rankwise.metrics.retrieval_metrics`. Its report needs ``map`` (what the
            selection monitors) and ``to_dict()``.
        curve_fn: the test curve, called like ``metric_fn`` without ``ks``; default
            :func:`rankwise.metrics.pr_curve`.
        ks: cut-offs of recall@k / precision@k in the reports.
        fpr: FPR budgets of the verification metrics (each in (0, 1)); when given, every report
            also carries its pair view (:attr:`RetrievalReport.verification`: ROC AUC and TPR at
            each FPR of the same query-gallery pairs, under the report's similarity; counted in
            shares and merged exactly under data parallelism). Default none.
        batch_size: batch size when embedding.
        strategy: the processes of the run (default: one process).
        num_workers: DataLoader worker processes.
        seed: seeds the loaders' generator.
        val_data: the run's validation data (:meth:`rank_split` ``"val"``).
        test_data: the run's test queries (:meth:`rank_split` ``"test"``).
        gallery_data: the gallery of a closed-set test.

    Example:
        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> labels = torch.arange(3).repeat_interleave(4)
        >>> data = TensorDataset(torch.eye(3)[labels] + 0.01 * torch.randn(12, 3), labels)
        >>> ranking = Evaluator(ks=(1,)).rank(torch.nn.Identity(), torch.device("cpu"), data)
        >>> float(ranking.report.map)
        1.0
    """

    def __init__(
        self,
        metric_fn: Callable[..., RetrievalReport] | None = None,
        curve_fn: Callable[..., PRCurve] | None = None,
        *,
        ks: Sequence[int] = (1, 10, 100),
        fpr: Sequence[float] = (),
        batch_size: int = 256,
        strategy: SingleProcess | None = None,
        num_workers: int = 0,
        seed: int = 0,
        val_data: Dataset | None = None,
        test_data: Dataset | None = None,
        gallery_data: Dataset | None = None,
    ) -> None:
        for fn, fn_name in ((metric_fn, "metric_fn"), (curve_fn, "curve_fn")):
            if fn is not None and not callable(fn):
                raise ValueError(f"`{fn_name}` must be a function, got {type(fn).__name__}.")
        self.metric_fn: Callable[..., Any] = (
            metric_fn if metric_fn is not None else retrieval_metrics
        )
        self.curve_fn: Callable[..., Any] = curve_fn if curve_fn is not None else pr_curve
        self.ks = tuple(sorted(check_ks(ks, "ks")))
        self.fpr = check_fprs(fpr, "fpr")
        self.batch_size = positive_int(batch_size, "batch_size")
        self.strategy = strategy if strategy is not None else SingleProcess()
        self.num_workers = positive_int(num_workers, "num_workers", 0)
        self.seed = positive_int(seed, "seed", 0)
        self.val_data, self.test_data, self.gallery_data = val_data, test_data, gallery_data

    def embed(
        self, model: nn.Module, dataset: Dataset, device: torch.device
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Embeddings ``(N, d)`` (on ``device``) and ``(N,)`` int64 labels of ``dataset``.

        This process's pass over the whole of ``dataset``, in batches of ``batch_size``, as in
        :func:`embed_batches`.

        Args:
            model: the embedding model.
            dataset: a map-style dataset of ``(x, label)`` items.
            device: where the model is.

        Returns:
            ``(embeddings, labels)``.
        """
        loader = DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            worker_init_fn=worker_init,
            generator=torch.Generator().manual_seed(self.seed),
            pin_memory=device.type == "cuda",
        )
        return embed_labelled(model, loader, device)

    def embed_split(
        self, model: nn.Module, dataset: Dataset, device: torch.device
    ) -> tuple[torch.Tensor, np.ndarray]:
        """The embeddings and labels of the whole of ``dataset``, in order, on every process."""
        return self.strategy.embed_split(dataset, partial(self.embed, model, device=device))

    def rank(
        self,
        model: nn.Module,
        device: torch.device,
        queries: Dataset,
        gallery: Dataset | None = None,
        *,
        with_curve: bool = False,
    ) -> Ranking:
        """Rank ``queries`` leave-one-out, or against ``gallery``, with ``metric_fn``.

        Args:
            model: the embedding model.
            device: where it is.
            queries: the query data.
            gallery: the gallery of a closed-set evaluation (``None``: leave-one-out).
            with_curve: draw ``curve_fn`` too.

        Returns:
            The :class:`Ranking`.
        """
        with preserve_torch_threads():
            query, query_labels = self.embed_split(model, queries, device)
            others: tuple[torch.Tensor, np.ndarray] | tuple[None, None] = (None, None)
            if gallery is not None:
                others = self.embed_split(model, gallery, device)
            report, curve = self._ranked(query, query_labels, others, with_curve)
        return Ranking(report, query, curve)

    def rank_split(
        self, model: nn.Module, device: torch.device, split: str, *, with_curve: bool = False
    ) -> Ranking:
        """Rank the run's ``"val"`` data leave-one-out, or its ``"test"`` queries (with the gallery).

        Raises:
            ValueError: an unknown ``split``, or one the evaluator has no data for.
        """
        if split not in ("val", "test"):
            raise ValueError(f"`split` must be 'val' or 'test', got {split!r}.")
        data = self.val_data if split == "val" else self.test_data
        if data is None:
            raise ValueError(f"the trainer has no {split!r} data (pass `{split}_data`).")
        gallery = self.gallery_data if split == "test" else None
        return self.rank(model, device, data, gallery, with_curve=with_curve)

    def test_weights(
        self,
        model: nn.Module,
        device: torch.device,
        weights: Mapping[str, torch.Tensor] | None,
    ) -> tuple[RetrievalReport, PRCurve]:
        """The test report and curve of ``model`` with ``weights`` loaded (``None``: its own).

        The model's own weights are back in it afterwards.
        """
        final = None
        if weights is not None:
            final = {k: v.clone() for k, v in model.state_dict().items()}
            model.load_state_dict(weights)
        try:
            ranking = self.rank_split(model, device, "test", with_curve=True)
        finally:
            if final is not None:
                model.load_state_dict(final)
        assert ranking.curve is not None
        return ranking.report, ranking.curve

    def _ranked(
        self,
        query: torch.Tensor,
        query_labels: np.ndarray,
        others: tuple[torch.Tensor, np.ndarray] | tuple[None, None],
        with_curve: bool,
    ) -> tuple[Any, Any]:
        """The report (and curve) of the gathered split.

        Under data parallelism each process ranks its share of the queries and the merged report
        is the one-process report bit for bit.

        A ``metric_fn`` / ``curve_fn`` not marked with :func:`rankwise.metrics.query_blocks` ranks
        the whole split on every process, as before (``sharded_metric`` warns once on rank 0).
        """
        if self.strategy.world_size == 1:
            report = self.metric_fn(query, query_labels, *others, ks=self.ks)
            curve = self.curve_fn(query, query_labels, *others) if with_curve else None
            return self._verified(report, query, query_labels, others), curve
        group = self.strategy.group
        report = sharded_metric(
            self.metric_fn, query, query_labels, *others, ks=self.ks, group=group
        )
        curve = (
            sharded_curve(self.curve_fn, query, query_labels, *others, group=group)
            if with_curve
            else None
        )
        return self._verified(report, query, query_labels, others), curve

    def _verified(
        self,
        report: Any,
        query: torch.Tensor,
        query_labels: np.ndarray,
        others: tuple[torch.Tensor, np.ndarray] | tuple[None, None],
    ) -> Any:
        """The report with its pair view at the FPRs ``fpr`` (unchanged when none is asked for)."""
        if not self.fpr:
            return report
        similarity = getattr(report, "similarity", None)
        if similarity not in SIMILARITIES or not hasattr(report, "with_verification"):
            raise ValueError(
                f"`fpr`: the verification metrics score pairs by a similarity of {SIMILARITIES}, "
                f"but this metric_fn's report ranks by {similarity!r}; evaluate without `fpr`."
            )
        group = self.strategy.group if self.strategy.world_size > 1 else None
        verification = sharded_verification(
            query, query_labels, *others, fpr=self.fpr, similarity=similarity, group=group
        )
        return report.with_verification(verification)
