"""Smoothed ranks of each anchor's positives, in bounded blocks: the kernel of ROADMAP and Recall@k.

The rank surrogates of ROADMAP (Ramzi et al., NeurIPS 2021, Eq. 4-5) and of the Recall@k surrogate
(Patel et al., CVPR 2022, Eq. 5) both sum, for every pair of an anchor q and one of its positives
i, a function of the score differences d_qz = s_qz − s_qi over the references z that count in the
ranking: S_qi = Σ_{z ≠ i} m_qz f(d_qz). :func:`pair_sums` computes these sums in blocks of at most
``_BLOCK_ELEMENTS`` differences and recomputes each block in the backward pass, so a call holds the
(B, M) scores and one block instead of the (pairs, M) differences and autograd's copies of them
(what makes the Recall@k surrogate's large batches fit, docs/losses.md). :func:`positive_pairs`
enumerates the pairs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import once_differentiable

__all__ = ["pair_sums", "positive_pairs"]

# Entries of one (pairs, M) block of differences: 2**22 float32 values are 16 MiB (the AUC loss's
# chunk, docs/losses.md "Memory of every loss"); a P x K batch of 224 is one block.
_BLOCK_ELEMENTS = 2**22

Elementwise = Callable[[torch.Tensor], torch.Tensor]


def positive_pairs(pos_mask: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchor_idx, pos_idx)`` of every positive of the anchors selected by ``rows``.

    Args:
        pos_mask: (B, M) bool, the positives of each anchor.
        rows: (B,) bool, the anchors whose pairs are wanted (the rankable ones).

    ``nonzero``'s output size is read on the host: a device sync. The losses take the same pairs
    from :meth:`~rankwise.losses.base.BatchLayout.positive_pairs` (computed on the host from the
    labels) instead; this serves a caller that has only the device masks.
    """
    anchors, positives = (pos_mask & rows[:, None]).nonzero(as_tuple=True)
    return anchors, positives


def _block(
    scores: torch.Tensor,
    masks: tuple[torch.Tensor, ...],
    anchors: torch.Tensor,
    positives: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differences s_qz − s_qi (rows: pairs (q, i); columns: references z) and which z count."""
    rows = scores.index_select(0, anchors)
    diff = rows - rows.gather(1, positives[:, None])
    keep = masks[0].index_select(0, anchors)
    for mask in masks[1:]:  # a union of masks is taken per block, never as a (B, M) tensor
        keep |= mask.index_select(0, anchors)
    # the positive itself is never ranked above itself (f(0) would be added otherwise)
    keep = keep.scatter(1, positives[:, None], False)
    return diff, keep


def _rows_per_block(n_columns: int) -> int:
    return max(1, _BLOCK_ELEMENTS // max(1, n_columns))


class _PairSums(torch.autograd.Function):
    """S_p = Σ_z keep_pz f(d_pz) over blocks of pairs; backward recomputes each block.

    Gradient: ∂S_p/∂s_qz = keep_pz f'(d_pz) and ∂S_p/∂s_qi = −Σ_z keep_pz f'(d_pz), gathered into
    the (B, M) score gradient with ``index_add_`` (no host transfer). Not twice differentiable.
    """

    @staticmethod
    def forward(
        ctx: Any,
        scores: torch.Tensor,
        anchors: torch.Tensor,
        positives: torch.Tensor,
        fn: Elementwise,
        dfn: Elementwise,
        *masks: torch.Tensor,
    ) -> torch.Tensor:
        rows = _rows_per_block(scores.shape[1])
        out = scores.new_empty(anchors.shape[0])
        zero = scores.new_zeros(())
        for start in range(0, anchors.shape[0], rows):
            part = slice(start, start + rows)
            diff, keep = _block(scores, masks, anchors[part], positives[part])
            out[part] = torch.where(keep, fn(diff), zero).sum(dim=1)
        ctx.save_for_backward(scores, anchors, positives, *masks)
        ctx.dfn = dfn
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        scores, anchors, positives, *masks = ctx.saved_tensors
        n_columns = scores.shape[1]
        rows = _rows_per_block(n_columns)
        grad_scores = scores.new_zeros(scores.shape)  # contiguous, so its flat view indexes it
        flat = grad_scores.view(-1)
        zero = scores.new_zeros(())
        for start in range(0, anchors.shape[0], rows):
            part = slice(start, start + rows)
            a, i = anchors[part], positives[part]
            diff, keep = _block(scores, tuple(masks), a, i)
            contribution = torch.where(keep, ctx.dfn(diff), zero) * grad[part, None]
            grad_scores.index_add_(0, a, contribution)
            # the positive's own score enters every difference of its row with a minus sign
            flat.index_add_(0, a * n_columns + i, -contribution.sum(dim=1))
        return (grad_scores, None, None, None, None, *[None] * len(masks))


def pair_sums(
    scores: torch.Tensor,
    anchors: torch.Tensor,
    positives: torch.Tensor,
    masks: torch.Tensor | tuple[torch.Tensor, ...],
    fn: Elementwise,
    dfn: Elementwise | None = None,
) -> torch.Tensor:
    """(P,) sums S_p = Σ_{z ≠ i_p} mask[q_p, z] fn(s_{q_p z} − s_{q_p i_p}) of the pairs p.

    Args:
        scores: (B, M) scores.
        anchors: (P,) anchor row q_p of each pair.
        positives: (P,) positive column i_p of each pair.
        masks: (B, M) bool, the references that count in anchor q's sum (i_p is always left
            out), or a tuple of such masks whose union counts (formed block by block).
        fn: the elementwise function of the differences.
        dfn: its derivative; ``None`` for a step function: the sums are then constants (no
            gradient), as the Heaviside counts of ROADMAP's positives.

    Returns:
        (P,) sums in ``scores``' dtype, differentiable with respect to ``scores`` when ``dfn``
        is given.
    """
    masks = (masks,) if isinstance(masks, torch.Tensor) else tuple(masks)
    if dfn is None:
        with torch.no_grad():
            return _PairSums.apply(scores.detach(), anchors, positives, fn, fn, *masks)
    return _PairSums.apply(scores, anchors, positives, fn, dfn, *masks)
