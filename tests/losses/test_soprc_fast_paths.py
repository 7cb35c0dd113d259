"""Tests of the vectorised pieces behind SOPRCLoss and APLoss (Wen et al., NeurIPS 2022, Eq. (5),
(7), (8)): the hand-differentiated ℓ1 block sum, the grouping of positive pairs by anchor, and both
losses on a P x K batch against a dense re-derivation written here with the paper's piecewise
formulas (`torch.where` branches, a (B, M, M) block), values and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rankwise.losses import APLoss, SOPRCLoss
from rankwise.losses.soprc import (
    _MaskedHuberSum,
    _other_pairs_of_same_anchor,
    huber_surrogate,
)


def piecewise_l1(x, tau1):
    """Eq. (7) ℓ1 with the errata's x < 0 branch, one branch per `where`."""
    quadratic = (1 - x.clamp(0, tau1) / tau1) ** 2
    return torch.where(x < 0, 1 - 2 * x / tau1, torch.where(x < tau1, quadratic, 0 * x))


def piecewise_l2(x, tau2):
    """Eq. (7) ℓ2 = (e^{−x/τ2} − 1)/(e^{−x/τ2} + 1) for x < 0, written with e^{x/τ2}."""
    e = torch.exp(x.clamp(max=0) / tau2)
    return torch.where(x < 0, (1 - e) / (1 + e), 0 * x)


def dense_terms(emb, labels, tau1, tau2):
    """(B, M, M) blocks: ℓ1(S[i,j] − S[i,k]) over negatives k, ℓ2 over other positives k."""
    unit = emb / emb.norm(dim=1, keepdim=True)
    scores = unit @ unit.T
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool, device=emb.device)
    pos, neg = same & ~eye, ~same
    diff = scores[:, :, None] - scores[:, None, :]  # [i, j, k] = S[i,j] − S[i,k]
    other_pos = pos[:, None, :] & ~torch.eye(len(labels), dtype=torch.bool)[None]
    neg_sum = (piecewise_l1(diff, tau1) * neg[:, None, :]).sum(2)
    pos_sum = (piecewise_l2(diff, tau2) * other_pos).sum(2)
    return scores, pos, neg, neg_sum, pos_sum


def dense_ap(emb, labels, tau1, tau2):
    _, pos, _, neg_sum, pos_sum = dense_terms(emb, labels, tau1, tau2)
    ratio = neg_sum / (1 + pos_sum)
    return (ratio / (1 + ratio))[pos].mean()


def dense_soprc_batch_tpr(emb, labels, prior, tau1, tau2):
    """SOPRC with use_v=False: TPR from the anchor's batch positives, priors π_c."""
    _, pos, neg, neg_sum, pos_sum = dense_terms(emb, labels, tau1, tau2)
    fpr = neg_sum / neg.sum(1, keepdim=True)
    tpr = (1 + pos_sum) / pos.sum(1, keepdim=True)
    odds = ((1 - prior) / prior)[labels][:, None]
    x = odds * fpr / tpr
    return (x / (1 + x))[pos].mean()


def pk_batch(n_classes, m, dim, seed):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(n_classes * m, dim, generator=g, dtype=torch.float64)
    return emb, torch.arange(n_classes).repeat_interleave(m)


@pytest.mark.parametrize("m", [2, 4])
def test_ap_loss_matches_dense_rederivation_on_pk_batch(m):
    emb, labels = pk_batch(12, m, 16, seed=3)
    x1 = emb.clone().requires_grad_(True)
    x2 = emb.clone().requires_grad_(True)
    ours = APLoss(tau1=0.1, tau2=0.01)(x1, labels)
    ref = dense_ap(x2, labels, 0.1, 0.01)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-8, atol=1e-12)


def test_soprc_batch_tpr_matches_dense_rederivation_on_uneven_batch():
    labels = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4])
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(len(labels), 8, generator=g, dtype=torch.float64)
    # dyadic priors: the buffer is stored in the default dtype, these survive it exactly
    prior = torch.tensor([0.25, 0.125, 0.5, 0.375, 0.0625], dtype=torch.float64)
    loss = SOPRCLoss(5, prior=prior, tau2=0.02, use_v=False).double()
    x1 = emb.clone().requires_grad_(True)
    x2 = emb.clone().requires_grad_(True)
    ours = loss(x1, labels)
    ref = dense_soprc_batch_tpr(x2, labels, prior, 0.1, 0.02)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    ours.backward()
    ref.backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-8, atol=1e-12)


def test_other_pairs_of_same_anchor_by_hand():
    anchor = np.array([0, 0, 0, 2, 5, 5])
    others, is_real = _other_pairs_of_same_anchor(anchor)
    got = [row[real].tolist() for row, real in zip(others, is_real, strict=True)]
    assert got == [[1, 2], [0, 2], [0, 1], [], [5], [4]]
    assert bool((others >= 0).all()) and bool((others < len(anchor)).all())
    # one pair per anchor: nothing to compare with, an empty block
    others, is_real = _other_pairs_of_same_anchor(np.array([1, 3, 4]))
    assert others.shape == is_real.shape == (3, 0)


def test_huber_surrogate_gradient_matches_eq7_derivative_including_knots():
    tau = 0.25
    x = torch.tensor([-1.0, -1e-3, 0.0, 0.1, 0.2, tau, 0.3, 2.0], dtype=torch.float64)
    x.requires_grad_(True)
    huber_surrogate(x, tau).sum().backward()
    # dℓ1/dx: −2/τ for x < 0, −2(1 − x/τ)/τ on [0, τ), 0 beyond; both knots are C¹
    expected = [-2 / tau if xi < 0 else -2 * max(1 - xi / tau, 0) / tau for xi in x.tolist()]
    torch.testing.assert_close(x.grad, torch.tensor(expected, dtype=torch.float64))


def test_masked_huber_sum_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    margin = torch.randn(7, 9, generator=g, dtype=torch.float64) * 1.5 + 0.5
    margin[0, :3] = torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)  # knots u = 0 and u = 1
    mask = (torch.rand(7, 9, generator=g) < 0.6).double()
    margin.requires_grad_(True)
    sums = _MaskedHuberSum.apply(margin, mask)
    # u = 1 − x/τ1, so x = τ1(1 − u); ℓ1 from the piecewise Eq. (7)
    expected = (piecewise_l1(0.1 * (1 - margin.detach()), 0.1) * mask).sum(1)
    torch.testing.assert_close(sums, expected)
    weights = torch.randn(7, generator=g, dtype=torch.float64)
    (sums * weights).sum().backward()
    slope = 2 * margin.detach().clamp(0, 1) * mask  # dℓ1/du
    torch.testing.assert_close(margin.grad, weights[:, None] * slope)
    away_from_knots = margin.detach()[1:].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda u: _MaskedHuberSum.apply(u, mask[1:]), (away_from_knots,)
    )
