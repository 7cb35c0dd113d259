"""Evaluation and model selection: embed a dataset once, rank it, test the selected model.

The protocol of Wen et al. (NeurIPS 2022, Sec. 5.1 and App. D.1): validation ranked
leave-one-out with the exact tie-aware metrics, the best validation mAP selected
(:class:`~rankwise.training.callbacks.BestCheckpoint`), the selected model tested (open-set:
leave-one-out; closed-set: against a gallery) with its mean PR curve. :func:`embed_batches` is
the one embedding loop of the Trainer, of :class:`~rankwise.training.inference.LoadedRun` and of
the hash codes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .._threads import preserve_torch_threads
from ..metrics import PRCurve, RetrievalReport
from .callbacks import BestCheckpoint
from .loader import worker_init
from .state import RunState

__all__ = ["Evaluation", "embed_batches", "embed_labelled"]


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


class Evaluation(RunState):
    """The Trainer's evaluation and model selection (a mixin of Trainer)."""

    val_data: Dataset | None
    test_data: Dataset | None
    gallery_data: Dataset | None
    metric_fn: Callable[..., Any]
    curve_fn: Callable[..., Any]
    eval_ks: tuple[int, ...]
    eval_batch_size: int
    num_workers: int
    seed: int

    def embed(self, dataset: Dataset) -> tuple[torch.Tensor, np.ndarray]:
        """Embeddings ``(N, d)`` (on the trainer's device) and ``(N,)`` int64 labels of a dataset.

        Batches of ``eval_batch_size``, as in :func:`embed_batches`.

        Args:
            dataset: a map-style dataset of ``(x, label)`` items.

        Returns:
            ``(embeddings, labels)``.
        """
        loader = DataLoader(
            dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            worker_init_fn=worker_init,
            generator=torch.Generator().manual_seed(self.seed),
            pin_memory=self.device.type == "cuda",
        )
        return embed_labelled(self.model, loader, self.device)

    def _data(self, split: str) -> Dataset:
        data = {"val": self.val_data, "test": self.test_data}.get(split)
        if split not in ("val", "test"):
            raise ValueError(f"`split` must be 'val' or 'test', got {split!r}.")
        if data is None:
            raise ValueError(f"the trainer has no {split!r} data (pass `{split}_data`).")
        return data

    def _rank(
        self, split: str, with_curve: bool = False
    ) -> tuple[RetrievalReport, torch.Tensor, PRCurve | None]:
        query, query_labels = self.strategy.embed_split(self._data(split), self.embed)
        gallery: tuple[torch.Tensor, np.ndarray] | tuple[None, None] = (None, None)
        if split == "test" and self.gallery_data is not None:
            gallery = self.strategy.embed_split(self.gallery_data, self.embed)
        report = self.metric_fn(query, query_labels, *gallery, ks=self.eval_ks)
        curve = self.curve_fn(query, query_labels, *gallery) if with_curve else None
        return report, query, curve

    def evaluate(self, split: str = "val") -> RetrievalReport:
        """The exact retrieval report of the current model on the ``"val"`` or ``"test"`` data.

        Leave-one-out, or test queries against ``gallery_data`` when there is one.

        Args:
            split: ``"val"`` or ``"test"``.

        Returns:
            A :class:`~rankwise.metrics.RetrievalReport`.
        """
        with preserve_torch_threads():
            return self._rank(split)[0]

    def test(self) -> tuple[RetrievalReport, PRCurve]:
        """``(report, curve)``: the current model's test report and mean PR curve (one pass)."""
        with preserve_torch_threads():
            report, _, curve = self._rank("test", with_curve=True)
        assert curve is not None
        return report, curve

    def _validate_and_checkpoint(self) -> None:
        if self.val_data is not None:
            with preserve_torch_threads():
                report, embeddings, _ = self._rank("val")
            with self._naming_what_is_kept():  # best.pt
                self._emit("on_validation_end", report, embeddings)
        if self.run_dir is not None:
            self.save_checkpoint()

    def _selected_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights of the model selected on validation (``None``: the final model)."""
        best = self._callback(BestCheckpoint)
        if best is None:
            return None
        if self.run_dir is None:  # every process kept the same selected weights in memory
            return best.best_model_state(self)
        return self.strategy.from_main_process(partial(best.best_model_state, self))

    def _test_selected(self) -> tuple[RetrievalReport, PRCurve]:
        weights = self._selected_weights()
        final = None
        if weights is not None:
            final = {k: v.clone() for k, v in self.model.state_dict().items()}
            self.model.load_state_dict(weights)
        try:
            return self.test()
        finally:
            if final is not None:
                self.model.load_state_dict(final)
