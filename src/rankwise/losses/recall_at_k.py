"""The Recall@k surrogate loss with optional similarity mixup (Patel, Tolias, Matas, CVPR 2022).

Patel, Tolias and Matas, *Recall@k Surrogate Loss with Large Batches and Similarity Mixup* (CVPR
2022), Sec. 3: recall@k of an anchor's ranking, R@k_q = |{i ∈ P_q : rank(i) ≤ k}| / min(k, |P_q|),
with both steps replaced by sigmoids: the rank of positive i, 1 + Σ_{z≠i} H(s_qz − s_qi) over the
anchor's whole ranking (positives and negatives), becomes 1 + Σ_{z≠i} σ((s_qz − s_qi)/τ2), and
"rank(i) ≤ k" becomes σ((k − rank(i))/τ1); the loss is 1 − R@k averaged over a set of k and over
the anchors. SiMix (the paper's similarity mixup) adds, for every pair of same-class samples of the
batch, a virtual sample whose similarities are the α-mix of theirs (α uniform in [0, 1]). The
defaults, the clipping of each count at k and the normalisation are the authors' released code's
(``src/losses.py``, ``src/main.py``, ``src/mixup.py``; docs/losses.md names the commit and where
this departs from it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .._validation import Interval, check_bool, check_scalar
from ._pair_ranks import pair_sums, positive_pairs
from .base import BatchLayout, PairBatch, RankingLoss

__all__ = ["RecallAtKLoss", "simix_scores"]

_POSITIVE = Interval("real", 0, None, closed="neither")


def _check_k_values(k_values: Any) -> tuple[int, ...]:
    """``k_values``: a non-empty sequence of distinct integers >= 1 (numpy integers accepted)."""
    message = (
        "`k_values` must be a non-empty sequence of distinct integers >= 1, e.g. (1, 2, 4, 8, 16), "
        f"got {k_values!r}."
    )
    if isinstance(k_values, (str, bytes)):
        raise ValueError(message)
    try:
        ks = tuple(check_scalar(k, "k_values", Interval("integer", 1, None)) for k in k_values)
    except (TypeError, ValueError):
        raise ValueError(message) from None
    if not ks or len(set(ks)) != len(ks):
        raise ValueError(message)
    return ks


def simix_scores(
    scores: torch.Tensor,
    labels: torch.Tensor,
    first: torch.Tensor,
    second: torch.Tensor,
    alpha: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (B + V, B + V) scores and (B + V,) labels of a batch with V virtual samples appended.

    Virtual sample v mixes the samples ``first[v]`` and ``second[v]`` (same label) with weight
    ``alpha[v]`` on the first: s(v, z) = α s(first, z) + (1 − α) s(second, z) for every z, real or
    virtual (bilinear, so for cosine or dot scores it is the dot product with the mixed
    normalised embedding, as the released code computes it).

    Args:
        scores: (B, B) scores of the batch against itself, diagonal included.
        labels: (B,) labels.
        first: (V,) index of the first sample of each virtual pair.
        second: (V,) index of the second.
        alpha: (V,) mixing weights in [0, 1], in ``scores``' dtype.
    """
    weight = alpha[None, :]
    cross = weight * scores[:, first] + (1 - weight) * scores[:, second]  # real x virtual
    top = torch.cat([scores, cross], dim=1)
    bottom = alpha[:, None] * top[first] + (1 - alpha)[:, None] * top[second]
    return torch.cat([top, bottom]), torch.cat([labels, labels[first]])


def _simix_layout(host: BatchLayout) -> tuple[torch.Tensor, ...]:
    """SiMix's label-only structure, on the host (:meth:`BatchLayout.cached`).

    The virtual pairs (``first``, ``second``: every unordered same-class pair of the batch), then
    for the batch with the virtual samples appended: the positives mask, the anchors that can be
    ranked (a positive and a negative) and their positive pairs, row-major.
    """
    if host.labels is None:  # pragma: no cover - a batch prepared by RankingLoss has labels
        raise ValueError("SiMix needs the batch's class labels.")
    first, second = np.nonzero(np.triu(host.pos_mask.numpy(), k=1))
    labels = host.labels.numpy()
    extended = np.concatenate([labels, labels[first]])
    same = extended[:, None] == extended[None, :]
    pos_mask = same.copy()
    np.fill_diagonal(pos_mask, False)
    rows = pos_mask.any(axis=1) & ~same.all(axis=1)
    anchors, positives = np.nonzero(pos_mask & rows[:, None])
    return tuple(
        torch.from_numpy(np.ascontiguousarray(a))
        for a in (first, second, pos_mask, rows, anchors, positives)
    )


class RecallAtKLoss(RankingLoss):
    """Recall@k surrogate loss: 1 − mean over valid anchors q and k ∈ K of the smooth R@k_q.

    For anchor q with positives P_q and ranking set Ω_q (every reference but q itself):

        rank(i) = 1 + Σ_{z∈Ω_q, z≠i} σ((s_qz − s_qi) / τ2)
        R@k_q = min(Σ_{i∈P_q} σ((k − rank(i)) / τ1), k) / min(k, |P_q|)
        loss = 1 − mean_q (1/|K|) Σ_{k∈K} R@k_q

    τ2 (``rank_temperature``) sharpens the rank, τ1 (``k_temperature``) the cut at k; the count
    is clipped at k as in the released code (a top-k list holds at most k positives).

    SiMix (``simix=True``, training mode only, the batch as its own reference set): every
    unordered pair of same-class samples of the batch adds a virtual sample of that class whose
    scores are the α-mix of the pair's (:func:`simix_scores`, α drawn uniformly in [0, 1] from
    torch's generator at every call); virtual samples are ranked, and act as anchors, like real
    ones. A P x K batch grows from B to B (1 + (K − 1)/2) samples (2.5 B for K = 4).

    Memory: the (B, M) scores plus blocks of at most 2²² (anchor-positive pair, reference)
    differences, recomputed in the backward pass (``rankwise.losses._pair_ranks``): the
    paper's large batches fit (docs/benchmarks.md gives the largest batch within 2 GiB).

    Args:
        k_values: the set K, distinct integers >= 1; (1, 2, 4, 8, 16), the released code's
            training set.
        rank_temperature: τ2 > 0 of the rank sigmoid; 0.01.
        k_temperature: τ1 > 0 of the sigmoid at k; 1, a fine-tuning setting: from a collapsed
            untrained network every rank is far beyond k and this sigmoid has no gradient (the
            from-scratch configs use 16, docs/losses.md).
        simix: add the SiMix virtual samples in training mode; off by default (as in the
            released code; docs/losses.md says why).
        similarity: ``"cosine"`` (default, the paper's L2-normalised embeddings), ``"dot"`` or
            ``"neg_euclidean"``.
        detach_positive_ranks: stop the gradient through the terms σ((s_qj − s_qi)/τ2) of a
            positive i's rank whose z = j is another positive (the positives' ranks among
            themselves); the value is unchanged bit for bit and only the terms of the non-positives
            carry gradient. Off by default (the paper's and the released code's gradient); an
            opt-in departure (docs/losses.md: with many positives per anchor these terms push
            positives down).

    ``last_stats`` adds ``mean_recall_surrogate`` (the mean smooth recall, a detached 0-d
    tensor: nothing is read back to the host during the step) and ``n_virtual`` (SiMix's virtual
    samples, 0 without it).

    Example:
        >>> import torch
        >>> from rankwise.losses import RecallAtKLoss
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]], requires_grad=True)
        >>> loss_fn = RecallAtKLoss(k_values=(1, 2))
        >>> round(loss_fn(emb, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.4431
    """

    k_tensor: torch.Tensor  # K as a buffer (registered in __init__)

    def __init__(
        self,
        k_values: Sequence[int] = (1, 2, 4, 8, 16),
        rank_temperature: float = 0.01,
        k_temperature: float = 1.0,
        simix: bool = False,
        similarity: str = "cosine",
        detach_positive_ranks: bool = False,
    ) -> None:
        super().__init__(similarity)
        self.k_values = _check_k_values(k_values)
        self.rank_temperature = check_scalar(rank_temperature, "rank_temperature", _POSITIVE)
        self.k_temperature = check_scalar(k_temperature, "k_temperature", _POSITIVE)
        self.simix = check_bool(simix, "simix")
        self.detach_positive_ranks = check_bool(detach_positive_ranks, "detach_positive_ranks")
        # on the loss's device, so no call copies it from the host; derived from k_values, so it
        # is no part of the state_dict
        self.register_buffer(
            "k_tensor", torch.tensor(self.k_values, dtype=torch.float32), persistent=False
        )

    def _rank_sigmoid(self, diff: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(diff / self.rank_temperature)

    def _rank_sigmoid_grad(self, diff: torch.Tensor) -> torch.Tensor:
        sig = torch.sigmoid(diff / self.rank_temperature)
        return sig * (1 - sig) / self.rank_temperature

    def _rank_sums(
        self,
        scores: torch.Tensor,
        pos_mask: torch.Tensor,
        rank_mask: torch.Tensor | tuple[torch.Tensor, ...],
        anchors: torch.Tensor,
        positives: torch.Tensor,
    ) -> torch.Tensor:
        """(P,) Σ_{z∈Ω_q, z≠i} σ((s_qz − s_qi)/τ2) of each pair; see ``detach_positive_ranks``."""
        fn, dfn = self._rank_sigmoid, self._rank_sigmoid_grad
        if not self.detach_positive_ranks:
            return pair_sums(scores, anchors, positives, rank_mask, fn, dfn)
        masks = (rank_mask,) if isinstance(rank_mask, torch.Tensor) else rank_mask
        # the value is the full sum, computed exactly as without the option (same blocks, same
        # order); the gradient is that of the non-positives' terms only: full + (x − x) adds an
        # exact zero, so the value is the default's bit for bit
        full = pair_sums(scores, anchors, positives, masks, fn, None)
        others = pair_sums(scores, anchors, positives, tuple(m & ~pos_mask for m in masks), fn, dfn)
        return full + (others - others.detach())

    def recall_per_anchor(
        self,
        scores: torch.Tensor,
        pos_mask: torch.Tensor,
        rank_mask: torch.Tensor | tuple[torch.Tensor, ...],
        rows: torch.Tensor,
        pairs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(B,) smooth recall of each anchor of ``rows``, averaged over K (0 for the others).

        Args:
            scores: (B, M) scores.
            pos_mask: (B, M) bool positives of each anchor.
            rank_mask: (B, M) bool references in each anchor's ranking set Ω_q, or a tuple of
                masks whose union is Ω_q (formed block by block, not as a (B, M) tensor).
            rows: (B,) bool anchors to compute (those with a positive and a negative).
            pairs: ``(anchors, positives)`` (P,) int64 on the scores' device, the positive pairs
                of the ``rows`` in row-major order, as computed on the host from the labels
                (:meth:`compute` passes them); None computes them here from the masks, one
                device sync (``nonzero``).
        """
        anchors, positives = positive_pairs(pos_mask, rows) if pairs is None else pairs
        rank = 1.0 + self._rank_sums(scores, pos_mask, rank_mask, anchors, positives)
        k = self.k_tensor.to(scores.dtype)
        hits = torch.sigmoid((k[None, :] - rank[:, None]) / self.k_temperature)  # (pairs, |K|)
        counts = scores.new_zeros(scores.shape[0], k.shape[0]).index_add(0, anchors, hits)
        n_pos = pos_mask.sum(dim=1).to(scores.dtype)
        norm = torch.minimum(k[None, :], n_pos[:, None]).clamp(min=1)
        return (torch.minimum(counts, k[None, :]) / norm).mean(dim=1)

    def _simix_batch(
        self, batch: PairBatch
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | tuple[torch.Tensor, ...],
        torch.Tensor,
        tuple[torch.Tensor, torch.Tensor],
    ]:
        """The batch plus its SiMix virtual samples: scores, positives, ranking sets, anchors, pairs.

        One virtual sample per unordered same-class pair of the batch, mixed with a fresh α.
        """
        if not batch.self_reference:
            raise ValueError(
                "RecallAtKLoss(simix=True) mixes pairs of the batch ranked against itself; it "
                "takes no `ref_embeddings` (build it with simix=False to rank against a "
                "reference set)."
            )
        # everything that depends on the labels only is computed on the host and sent in one
        # copy: the virtual pairs, the extended batch's positives, anchors and positive pairs
        first, second, pos_mask, rows, anchors, positives = batch.send(
            *batch.host.cached("simix", _simix_layout)
        )
        alpha = torch.rand(first.shape[0], dtype=batch.scores.dtype, device=batch.scores.device)
        scores, _ = simix_scores(batch.scores, batch.labels, first, second, alpha)
        eye = torch.eye(pos_mask.shape[0], dtype=torch.bool, device=pos_mask.device)
        return scores, pos_mask, ~eye, rows, (anchors, positives)

    def compute(self, batch: PairBatch) -> torch.Tensor:
        """The loss of a validated batch (see the class docstring)."""
        if self.simix and self.training:
            scores, pos_mask, rank_mask, rows, pairs = self._simix_batch(batch)
        else:
            scores, pos_mask, rows = batch.scores, batch.pos_mask, batch.valid
            rank_mask = (batch.pos_mask, batch.neg_mask)
            anchors, positives = batch.send(*batch.host.positive_pairs())
            pairs = (anchors, positives)
        recall = self.recall_per_anchor(scores, pos_mask, rank_mask, rows, pairs)
        weight = rows.to(recall.dtype)
        mean_recall = (recall * weight).sum() / weight.sum()
        stats: dict[str, Any] = self.last_stats  # detached tensors, read when logged
        stats["mean_recall_surrogate"] = mean_recall.detach()
        stats["n_virtual"] = scores.shape[0] - batch.scores.shape[0]  # a host int: no transfer
        return 1.0 - mean_recall

    def extra_repr(self) -> str:
        """The constructor arguments, shown by ``repr``."""
        return (
            f"k_values={self.k_values}, rank_temperature={self.rank_temperature:g}, "
            f"k_temperature={self.k_temperature:g}, simix={self.simix}, "
            f"similarity={self.similarity!r}, detach_positive_ranks={self.detach_positive_ranks}"
        )
