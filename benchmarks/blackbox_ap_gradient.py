"""How the BlackBox-AP gradient of rankwise compares with the authors' original one.

Rolínek et al., *Optimizing Rank-based Metrics with Blackbox Differentiation* (CVPR 2020), Sec. 3
and Eq. 4: the original backward pass differentiates the full normalised rank ``rk(i)`` of every
positive in ``AP = mean_{i ∈ pos} rk_pos(i) / rk(i)`` with the blackbox rule
``−(rk(s) − rk(s + λ ∂L/∂rk)) / λ`` (the authors' ``TrueRanker``, here
:class:`rankwise.losses.blackbox_ap.BlackBoxRank`), where ``∂L/∂rk`` is the gradient of the
batch-averaged loss. :class:`rankwise.losses.BlackBoxAPLoss` differentiates the rank only
through the negatives above each positive and applies ``λ`` to each anchor's own ``1 − AP``
(:class:`rankwise.losses.blackbox_ap.BlackBoxAP`). Both have the same forward value. This script
draws random P x K batches (Gaussian class centres plus Gaussian noise of scale ``noise``; one
nearly collapsed setting: a common offset 1 plus centres and noise of scale 0.02) and
prints, per setting, the cosine similarity between the two gradients w.r.t. the embeddings
(min / median / max over the ``--batches`` batches where both are non-zero; a batch already
ranked perfectly with the margin has no gradient and is counted apart). ``λ original = B·λ``
perturbs every anchor's ranking as strongly as rankwise's ``λ`` does (the original ``λ`` acts on
the batch mean, i.e. ``λ/B`` per anchor), so that row isolates the change of the rank that is
differentiated.

Usage::

    python benchmarks/blackbox_ap_gradient.py                     # markdown table
    python benchmarks/blackbox_ap_gradient.py --batches 50 --dim 64
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from rankwise.losses import BlackBoxAPLoss
from rankwise.losses.blackbox_ap import BlackBoxRank, _ranks_and_positive_ranks


def original_loss(
    emb: torch.Tensor, labels: torch.Tensor, lambda_val: float, margin: float
) -> torch.Tensor:
    """``1 − mean AP`` with the authors' backward: ``TrueRanker`` on the full rank, rk_pos fixed.

    Args:
        emb: (B, d) embeddings (cosine similarity, the batch ranked against itself).
        labels: (B,) class ids; every anchor must have a positive and a negative.
        lambda_val: interpolation strength λ of the blackbox gradient.
        margin: score margin α (positives −α/2, negatives +α/2).

    Returns:
        The scalar loss, differentiable w.r.t. ``emb`` through the blackbox rank.
    """
    unit = F.normalize(emb, dim=1)
    scores = unit @ unit.T
    same = labels[:, None] == labels[None, :]
    pos = same.clone().fill_diagonal_(False)
    ranked = ~torch.eye(len(labels), dtype=torch.bool)
    shifted = (scores - margin * (pos.to(scores.dtype) - 0.5)).masked_fill(~ranked, float("-inf"))
    _, rank_pos = _ranks_and_positive_ranks(shifted.detach(), pos)
    rank_all = BlackBoxRank.apply(shifted, lambda_val)
    precision = torch.where(pos, rank_pos / rank_all, 0)
    ap = precision.sum(1) / pos.sum(1)
    return 1 - ap.mean()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Cosine similarity of two flat tensors, None when either is zero."""
    if not bool(a.any()) or not bool(b.any()):
        return None
    return float(F.cosine_similarity(a, b, dim=0))


def gradient_cosines(
    n_classes: int,
    per_class: int,
    dim: int,
    spread: float,
    lambda_library: float,
    lambda_original: float,
    batches: int,
    margin: float = 0.02,
    offset: float = 0.0,
) -> list[float | None]:
    """Cosine similarity of the two embedding gradients on ``batches`` random batches.

    Args:
        n_classes: P, classes per batch.
        per_class: K, samples per class.
        dim: embedding dimension.
        spread: standard deviation of the noise around the unit-variance class centres.
        lambda_library: λ of :class:`BlackBoxAPLoss`.
        lambda_original: λ of the original backward.
        batches: number of random batches (seeds 0, 1, ...).
        margin: score margin of both.
        offset: a common vector of this size in every coordinate is added to all embeddings;
            with a small ``spread`` and centres scaled down it gives a nearly collapsed batch.

    Returns:
        One cosine per batch, None where a gradient is zero.
    """
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    cosines = []
    for seed in range(batches):
        generator = torch.Generator().manual_seed(seed)
        centres = torch.randn(n_classes, dim, generator=generator, dtype=torch.float64)
        noise = torch.randn(len(labels), dim, generator=generator, dtype=torch.float64)
        base = offset + centres[labels] * (1.0 if offset == 0 else spread) + spread * noise
        grads = []
        for loss_of in (
            lambda e: BlackBoxAPLoss(lambda_val=lambda_library, margin=margin)(e, labels),
            lambda e: original_loss(e, labels, lambda_original, margin),
        ):
            emb = base.clone().requires_grad_(True)
            loss_of(emb).backward()
            grads.append(emb.grad.flatten())
        cosines.append(_cosine(grads[0], grads[1]))
    return cosines


def main() -> None:
    """Print the table of cosine similarities (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--dim", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| batch (P x K) | noise | λ rankwise | λ original | cosine min / median / max | zero |")
    print("|---|---|---|---|---|---|")
    settings = [((8, 4), 3.0, 0.0), ((8, 4), 1.0, 0.0), ((16, 4), 3.0, 0.0), ((32, 2), 3.0, 0.0)]
    settings.append(((8, 4), 0.02, 1.0))  # nearly collapsed: centres and noise 2% of the offset
    for (p, k), spread, offset in settings:
        batch = p * k
        for lam_lib, lam_orig in [(1.0, 1.0), (1.0, 4.0), (4.0, 4.0), (1.0, float(batch))]:
            found = gradient_cosines(
                p, k, args.dim, spread, lam_lib, lam_orig, args.batches, offset=offset
            )
            c = [x for x in found if x is not None]
            summary = f"{min(c):.3f} / {statistics.median(c):.3f} / {max(c):.3f}" if c else "-"
            print(
                f"| {p} x {k}{' collapsed' if offset else ''} | {spread} | {lam_lib:g} | "
                f"{lam_orig:g} | {summary} | {len(found) - len(c)}/{len(found)} |"
            )


if __name__ == "__main__":
    main()
