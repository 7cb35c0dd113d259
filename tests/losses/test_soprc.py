"""Tests of SOPRCLoss, APLoss and SemiVarianceRegularizer against direct re-derivations of Wen et al.
(NeurIPS 2022) Eq. (5), (7)-(10) and Alg. 1-2 written here with explicit Python loops, plus hand
computed moving-average updates of the auxiliary vector v."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rankwise.losses.base as base_module
import rankwise.losses.soprc as soprc_module
from rankwise._dispatch import DispatchCounter, to_device
from rankwise.losses import APLoss, SemiVarianceRegularizer, SOPRCLoss
from rankwise.losses.soprc import (
    _gather_rows,
    _Segments,
    huber_surrogate,
    score_interpolation,
    sigmoid_surrogate,
)

# -- independent re-derivation (loops over pairs, scalar ops only) ---------------------------------


def ref_l1(x, tau1):
    """Eq. (7) ℓ1 with the errata's x < 0 branch 1 − 2x/τ1."""
    if x < 0:
        return 1 - 2 * x / tau1
    if x < tau1:
        return (1 - x / tau1) ** 2
    return x * 0


def ref_l2(x, tau2):
    """Eq. (7) ℓ2 = (e^{−x/τ2} − 1)/(e^{−x/τ2} + 1), rewritten with e^{x/τ2} to avoid overflow."""
    if x < 0:
        e = torch.exp(x / tau2)
        return (1 - e) / (1 + e)
    return x * 0


def ref_scores(emb, ref, similarity="cosine"):
    """Score matrix as nested lists of 0-d tensors, one pair at a time."""
    out = []
    for i in range(emb.shape[0]):
        row = []
        for j in range(ref.shape[0]):
            dot = torch.dot(emb[i], ref[j])
            if similarity == "cosine":
                dot = dot / (torch.linalg.norm(emb[i]) * torch.linalg.norm(ref[j]))
            row.append(dot)
        out.append(row)
    return out


def ref_pairs(labels, ref_labels, self_ref):
    """Positive and negative reference indices of every anchor, loops only."""
    lab = [int(x) for x in labels]
    rlab = [int(x) for x in ref_labels]
    pos, neg = [], []
    for i, c in enumerate(lab):
        pos.append([j for j, d in enumerate(rlab) if d == c and not (self_ref and i == j)])
        neg.append([j for j, d in enumerate(rlab) if d != c])
    return lab, pos, neg


def ref_soprc(
    emb,
    labels,
    v,
    prior,
    tau1,
    tau2,
    *,
    unbiased=True,
    use_v=True,
    detach_tpr=False,
    ref_emb=None,
    ref_labels=None,
    similarity="cosine",
    positives=None,
):
    """Eq. (8) with the errata's TPR term; returns (loss, number of skipped anchors).

    ``positives[c]`` = N⁺_c: the positive counts as 1 of N⁺_c and v's share above it stands for
    the other N⁺_c − 1; None: N⁺_c = |v| + 1 (the released code's (1 + Σ_j ℓ2)/(|v| + 1))."""
    self_ref = ref_emb is None
    S = ref_scores(emb, emb if self_ref else ref_emb, similarity)
    lab, pos, neg = ref_pairs(labels, labels if self_ref else ref_labels, self_ref)
    terms, skipped = [], 0
    for i, c in enumerate(lab):
        if not pos[i] or not neg[i]:
            skipped += 1
            continue
        for j in pos[i]:
            s = S[i][j]
            fpr = sum(ref_l1(s - S[i][k], tau1) for k in neg[i]) / len(neg[i])
            st = s.detach() if detach_tpr else s
            if use_v and positives is None:
                tpr = (1 + sum(ref_l2(st - float(vj), tau2) for vj in v[c])) / (len(v[c]) + 1)
            elif use_v:
                share = sum(ref_l2(st - float(vj), tau2) for vj in v[c]) / len(v[c])
                n = float(positives[c])
                tpr = (1 + (n - 1) * share) / n
            else:
                others = [S[i][p].detach() if detach_tpr else S[i][p] for p in pos[i] if p != j]
                tpr = (1 + sum(ref_l2(st - o, tau2) for o in others)) / len(pos[i])
            if unbiased:
                odds = (1 - float(prior[c])) / float(prior[c])
            else:
                pi0 = len(pos[i]) / (len(pos[i]) + len(neg[i]))
                odds = (1 - pi0) / pi0
            x = odds * fpr / tpr
            terms.append(x / (1 + x))
    return sum(terms) / len(terms), skipped


def ref_ap(emb, labels, tau1, tau2):
    """Eq. (5): Σ_neg ℓ1 / (1 + Σ_{other pos} ℓ2), σ, averaged over (anchor, positive) pairs."""
    S = ref_scores(emb, emb)
    lab, pos, neg = ref_pairs(labels, labels, True)
    terms = []
    for i in range(len(lab)):
        if not pos[i] or not neg[i]:
            continue
        for j in pos[i]:
            s = S[i][j]
            num = sum(ref_l1(s - S[i][k], tau1) for k in neg[i])
            den = 1 + sum(ref_l2(s - S[i][p], tau2) for p in pos[i] if p != j)
            terms.append((num / den) / (1 + num / den))
    return sum(terms) / len(terms)


def ref_semi_variance(emb, labels, lam_pos, lam_neg, tail=False):
    """Eq. (9) over every positive and negative pair of the batch; ``tail``: each sum divided by
    its number of terms instead of n⁺ / n⁻ (the authors' released code)."""
    S = ref_scores(emb, emb)
    lab, pos, neg = ref_pairs(labels, labels, True)
    ps = [S[i][j] for i in range(len(lab)) for j in pos[i]]
    ns = [S[i][j] for i in range(len(lab)) for j in neg[i]]
    mp = sum(ps) / len(ps)
    mn = sum(ns) / len(ns)
    low = [(s - mp) ** 2 for s in ps if s < mp]
    high = [(s - mn) ** 2 for s in ns if s > mn]
    sp = sum(low) / (len(low) if tail else len(ps))
    sn = sum(high) / (len(high) if tail else len(ns))
    return lam_pos * sp + lam_neg * sn


def ref_phi(values, k, score_range):
    """Alg. 2 (errata): sorted values at i/(n+1), extrapolated ends at 0 and 1, read at j/(k+1)."""
    u = sorted(float(x) for x in values)
    n = len(u)
    lo = 2 * u[0] - u[1] if n > 1 else u[0]
    hi = 2 * u[-1] - u[-2] if n > 1 else u[-1]
    if score_range is not None:
        lo = max(lo, min(score_range[0], u[0]))
        hi = min(hi, max(score_range[1], u[-1]))
    xp = [i / (n + 1) for i in range(n + 2)]
    return np.interp([j / (k + 1) for j in range(1, k + 1)], xp, [lo, *u, hi])


def ref_v_update(
    emb, labels, v, beta, k, score_range, ref_emb=None, ref_labels=None, similarity="cosine"
):
    """Eq. (10) per class, fed with every positive-pair score of that class's anchors."""
    self_ref = ref_emb is None
    S = ref_scores(emb, emb if self_ref else ref_emb, similarity)
    lab, pos, _ = ref_pairs(labels, labels if self_ref else ref_labels, self_ref)
    new = v.detach().double().cpu().numpy().copy()
    for c in sorted(set(lab)):
        vals = [float(S[i][j].detach()) for i in range(len(lab)) if lab[i] == c for j in pos[i]]
        if vals:
            new[c] = (1 - beta) * new[c] + beta * ref_phi(vals, k, score_range)
    return new


# -- fixtures --------------------------------------------------------------------------------------

# classes with 5, 2, 1 and 3 samples: anchor 7 (class 2) has no positive and must be skipped
UNEVEN = [0, 1, 0, 2, 0, 3, 1, 0, 3, 0, 3]


def batch(device, dtype, seed=0, labels=UNEVEN, dim=4):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(len(labels), dim, generator=g, dtype=torch.float64)
    return emb.to(device=device, dtype=dtype), torch.tensor(labels, device=device)


def tol(dtype):
    return {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-9, "atol": 1e-10}


def trained_soprc(device, dtype, steps=2, **kw):
    """A SOPRCLoss whose v has been fed a few random batches (so v is not the initial grid)."""
    kw = {"num_v": 9, "beta": 0.5, **kw}
    loss = SOPRCLoss(4, prior=torch.tensor([0.3, 0.1, 0.05, 0.2]), **kw).to(device, dtype)
    for s in range(steps):
        e, y = batch(device, dtype, seed=100 + s)
        loss(e, y)
    return loss


# -- surrogates and φ ------------------------------------------------------------------------------


def test_surrogates_match_eq7(device):
    x = torch.linspace(-0.5, 0.5, 101, dtype=torch.float64, device=device)
    for tau in (0.1, 0.03):
        exp1 = torch.stack([torch.as_tensor(ref_l1(xi, tau)) for xi in x])
        exp2 = torch.stack([torch.as_tensor(ref_l2(xi, tau)) for xi in x])
        torch.testing.assert_close(huber_surrogate(x, tau), exp1)
        torch.testing.assert_close(sigmoid_surrogate(x, tau), exp2)
    step = (x <= 0).double()
    assert bool((huber_surrogate(x, 0.1) >= step).all())  # ℓ1 ≥ ℓ01
    assert bool((sigmoid_surrogate(x, 0.1) <= step).all())  # ℓ2 ≤ ℓ01
    # ℓ1 continuous at 0 and τ1 (errata)
    assert huber_surrogate(torch.tensor([-1e-12, 0.0]), 0.1).tolist() == pytest.approx([1, 1])


def test_score_interpolation_by_hand():
    # sorted [1, 2, 4] at positions 1/4, 2/4, 3/4; ends 2*1-2 = 0 at 0 and 2*4-2 = 6 at 1
    phi = score_interpolation(torch.tensor([4.0, 1.0, 2.0]), 7, score_range=None)
    assert phi.tolist() == pytest.approx([0.5, 1, 1.5, 2, 3, 4, 5])
    # upper end clipped to 4.5: last point 4 + (4.5 - 4)/2
    phi = score_interpolation(torch.tensor([4.0, 1.0, 2.0]), 7, score_range=(-1.0, 4.5))
    assert phi.tolist() == pytest.approx([0.5, 1, 1.5, 2, 3, 4, 4.25])
    assert score_interpolation(torch.tensor([0.3]), 4).tolist() == pytest.approx([0.3] * 4)


def force_packing(monkeypatch):
    """Send host tensors as off the CPU: packed into one buffer (``to_device(..., pack=True)``)."""
    packed = functools.partial(to_device, pack=True)
    monkeypatch.setattr(soprc_module, "to_device", packed)
    monkeypatch.setattr(base_module, "to_device", packed)


@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("n,k", [(1, 5), (2, 100), (5, 100), (7, 3), (40, 100), (150, 100)])
def test_score_interpolation_matches_np_interp_and_is_monotone(device, n, k, pack, monkeypatch):
    """φ against np.interp. Guards the 6 CUDA failures of issue 36: off the CPU the host tensors
    are packed into one copy, and φ's (1, 1) column of a single group (numpy strides (8, 0))
    made the packing raise; ``packed`` runs that path on the CPU."""
    if pack:
        force_packing(monkeypatch)
    g = torch.Generator().manual_seed(n * 1000 + k)
    scores = (torch.rand(n, generator=g, dtype=torch.float64) * 1.8 - 0.9).to(device)
    phi = score_interpolation(scores, k)
    np.testing.assert_allclose(phi.cpu().numpy(), ref_phi(scores.tolist(), k, (-1, 1)), atol=1e-12)
    assert bool((phi.diff() >= 0).all())
    assert float(phi.min()) >= -1 and float(phi.max()) <= 1


def test_score_interpolation_divides_nothing_on_the_device():
    """φ's knot weights r/(K+1) come from the host: CUDA divides a tensor by a Python number as a
    product with the reciprocal (one rounding more), so a division on the device gave CUDA
    another last bit than the CPU (issue 36). Counted on the CPU with the values on a simulated
    device; and the float64 weight rounded to float32 / float16 is the CPU's division in that
    dtype, the weight of before (no double-rounding error)."""
    scores = torch.rand(37, dtype=torch.float64)
    with DispatchCounter() as counter:
        counter.mark_device(scores)
        score_interpolation(scores, 100)
    assert not {"div", "reciprocal"} & set(counter.device_ops), counter.device_ops
    for k in (1, 2, 6, 99, 100, 255, 1000, 2047):
        r = torch.arange(k + 1)
        weights = torch.from_numpy(r.numpy() / (k + 1))
        for dtype in (torch.float32, torch.float16):
            assert torch.equal(weights.to(dtype), r.to(dtype) / (k + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_score_interpolation_is_bit_identical_on_every_device(device, dtype):
    """Every step of φ is one IEEE operation per element (no division, no fused multiply-add
    across torch calls): the device gives the CPU's bits (issue 36, on CUDA)."""
    g = torch.Generator().manual_seed(5)
    for n, k in ((1, 5), (3, 7), (40, 100), (150, 100)):
        scores = (torch.rand(n, generator=g, dtype=torch.float64) * 1.8 - 0.9).to(dtype)
        on_cpu = score_interpolation(scores, k)
        assert torch.equal(score_interpolation(scores.to(device), k).cpu(), on_cpu)


@pytest.mark.parametrize("n,m", [(1, 3), (4, 2), (6, 5), (9, 10)])
def test_score_interpolation_hits_scores_at_their_quantiles(n, m):
    # with |v| + 1 = m (n + 1), position j/(|v|+1) = i/(n+1) for j = m i: φ returns u_i exactly
    scores = torch.randn(n, dtype=torch.float64) * 0.3
    k = m * (n + 1) - 1
    phi = score_interpolation(scores, k, score_range=None)
    hits = phi[m - 1 :: m][:n]
    assert torch.equal(hits, scores.sort().values)


def test_score_interpolation_rejects_bad_input():
    with pytest.raises(ValueError, match="scores"):
        score_interpolation(torch.zeros(0), 5)
    with pytest.raises(ValueError, match="num_points"):
        score_interpolation(torch.zeros(3), 0)
    with pytest.raises(ValueError, match="score_range"):
        score_interpolation(torch.zeros(3), 4, score_range=(1, -1))


# -- v: moving average, eval mode, permutation -----------------------------------------------------


def test_v_moving_average_by_hand(device):
    # 1-D embeddings, dot similarity: class 0 = {1, 2, 3} -> positive scores 2, 3, 6 (each twice,
    # once per anchor); class 1 = {-1, -0.5} -> 0.5 twice; class 2 absent
    emb = torch.tensor([[1.0], [2.0], [3.0], [-1.0], [-0.5]], device=device)
    lab = torch.tensor([0, 0, 0, 1, 1], device=device)
    loss = SOPRCLoss(3, num_v=4, beta=0.25, score_range=None, similarity="dot").to(device)
    v0 = [0.0, 0.25, 0.5, 0.75]
    assert loss.v.tolist() == [v0] * 3
    loss(emb, lab)
    # class 0: u = [2,2,3,3,6,6] at i/7, read at j/5 -> x = 1.4, 2.8, 4.2, 5.6 -> [2, 2.8, 3.6, 6]
    phi0 = [2.0, 2.8, 3.6, 6.0]
    exp0 = [0.75 * a + 0.25 * b for a, b in zip(v0, phi0, strict=True)]
    exp1 = [0.75 * a + 0.25 * 0.5 for a in v0]
    assert exp0 == pytest.approx([0.5, 0.8875, 1.275, 2.0625])
    torch.testing.assert_close(loss.v.cpu(), torch.tensor([exp0, exp1, v0]))
    assert loss.v_updates.tolist() == [1, 1, 0]
    assert loss.last_stats["n_v_rows_updated"] == 2
    loss(emb, lab)
    exp0 = [0.75 * a + 0.25 * b for a, b in zip(exp0, phi0, strict=True)]
    exp1 = [0.75 * a + 0.25 * 0.5 for a in exp1]
    torch.testing.assert_close(loss.v.cpu(), torch.tensor([exp0, exp1, v0]))
    assert loss.v_updates.tolist() == [2, 2, 0]


def test_warm_start_copies_phi_first(device):
    emb = torch.tensor([[1.0], [2.0], [3.0], [-1.0], [-0.5]], device=device)
    lab = torch.tensor([0, 0, 0, 1, 1], device=device)
    loss = SOPRCLoss(3, num_v=4, beta=0.25, score_range=None, similarity="dot", warm_start=True)
    loss.to(device)(emb, lab)
    assert loss.v[0].tolist() == pytest.approx([2.0, 2.8, 3.6, 6.0])
    loss(emb, lab)  # second update averages: φ is unchanged so v stays
    assert loss.v[0].tolist() == pytest.approx([2.0, 2.8, 3.6, 6.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_v_update_matches_rederivation(device, dtype):
    loss = SOPRCLoss(4, num_v=13, beta=0.3).to(device, dtype)
    for seed in range(3):
        e, y = batch(device, dtype, seed=seed)
        expected = ref_v_update(e.double(), y, loss.v, 0.3, 13, (-1, 1))
        loss(e, y)
        np.testing.assert_allclose(loss.v.double().cpu().numpy(), expected, **tol(dtype))
    # class 2 has a single sample: its anchor has no positive, so its row never moves
    assert loss.v_updates.tolist() == [3, 3, 0, 3]


def test_v_update_with_memory_bank(device):
    dtype = torch.float64
    e, y = batch(device, dtype, seed=5, labels=[0, 1, 2, 0])
    ref, ref_y = batch(device, dtype, seed=6, labels=[0, 0, 1, 1, 1, 2, 3, 3])
    loss = SOPRCLoss(4, num_v=6, beta=0.4).to(device, dtype)
    expected = ref_v_update(e, y, loss.v, 0.4, 6, (-1, 1), ref_emb=ref, ref_labels=ref_y)
    value = loss(e, y, ref, ref_y)
    np.testing.assert_allclose(loss.v.cpu().numpy(), expected, rtol=1e-10)
    exp_value, _ = ref_soprc(e, y, loss.v, loss.prior, 0.1, 0.001, ref_emb=ref, ref_labels=ref_y)
    torch.testing.assert_close(value, exp_value)


def test_eval_mode_does_not_change_state(device):
    loss = trained_soprc(device, torch.float64)
    state = {k: t.clone() for k, t in loss.state_dict().items()}
    loss.eval()
    e, y = batch(device, torch.float64, seed=7)
    loss(e, y)
    for k, t in loss.state_dict().items():
        assert torch.equal(t, state[k]), k
    assert loss.last_stats["n_v_rows_updated"] == 0


def test_permutation_invariance(device):
    dtype = torch.float64
    e, y = batch(device, dtype, seed=3)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1)).to(device)
    # training mode: the v update and the loss
    a, b = (SOPRCLoss(4, num_v=11).to(device, dtype) for _ in range(2))
    torch.testing.assert_close(a(e, y), b(e[perm], y[perm]))
    assert torch.equal(a.v, b.v)  # bit for bit: v keeps every bit it is fed
    # eval mode with a trained v
    loss = trained_soprc(device, dtype).eval()
    torch.testing.assert_close(loss(e, y), loss(e[perm], y[perm]))


@pytest.mark.parametrize("similarity", ["cosine", "dot", "neg_euclidean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_v_is_bitwise_independent_of_the_batch_order(device, dtype, similarity):
    """A matrix product's entry s(i, j) depends in its last bits on where i and j sit in the batch
    (and s(i, j) != s(j, i) there); v is fed pair by pair so that it does not."""
    g = torch.Generator().manual_seed(5)
    labels = torch.arange(16).repeat_interleave(4)
    e = torch.randn(64, 48, generator=g, dtype=torch.float64).to(device, dtype)
    y = labels.to(device)
    a, b = (SOPRCLoss(16, num_v=20, similarity=similarity).to(device, dtype) for _ in range(2))
    for _ in range(3):
        perm = torch.randperm(64, generator=g).to(device)
        a(e, y)
        b(e[perm], y[perm])
        assert torch.equal(a.v, b.v)


# -- loss values against the re-derivation --------------------------------------------------------

ABLATIONS = [
    {},
    {"unbiased": False},
    {"use_v": False},
    {"unbiased": False, "use_v": False},
    {"detach_tpr": True},
    {"detach_tpr": True, "use_v": False},
    {"positives": [3.0, 1.0, 7.0, 2.0]},
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("options", ABLATIONS)
@pytest.mark.parametrize("train", [True, False])
def test_soprc_matches_rederivation(device, dtype, options, train):
    loss = trained_soprc(device, dtype, tau2=0.02, **options)
    loss.train(train)
    e, y = batch(device, dtype, seed=11)
    e64 = e.detach().double().requires_grad_(True)
    if train and loss.use_v:  # Alg. 1: the loss uses v_{t+1}, updated from this batch first
        v = torch.as_tensor(ref_v_update(e64, y, loss.v, 0.5, 9, (-1, 1)))
    else:
        v = loss.v.double().cpu()
    flags = {k: getattr(loss, k) for k in ("unbiased", "use_v", "detach_tpr")}
    flags["positives"] = options.get("positives")
    expected, skipped = ref_soprc(e64, y, v, loss.prior.double(), 0.1, 0.02, **flags)
    e_in = e.detach().clone().requires_grad_(True)
    value = loss(e_in, y)
    torch.testing.assert_close(value.double(), expected.detach(), **tol(dtype))
    assert loss.last_stats["n_skipped_no_positive"] == skipped == 1
    assert loss.last_stats["n_anchors_used"] == len(y) - 1
    # gradients (detach_tpr changes them, not the value)
    (grad_ref,) = torch.autograd.grad(expected, e64)
    (grad,) = torch.autograd.grad(value, e_in)
    torch.testing.assert_close(
        grad.double(),
        grad_ref,
        rtol=1e-3 if dtype == torch.float32 else 1e-7,
        atol=1e-4 if dtype == torch.float32 else 1e-9,
    )


def test_detach_tpr_changes_gradient_not_value(device):
    e, y = batch(device, torch.float64, seed=2)
    grads, values = [], []
    for detach in (False, True):
        loss = trained_soprc(device, torch.float64, tau2=0.05, detach_tpr=detach).eval()
        x = e.clone().requires_grad_(True)
        value = loss(x, y)
        values.append(value)
        grads.append(torch.autograd.grad(value, x)[0])
    torch.testing.assert_close(values[0], values[1])
    assert not torch.allclose(grads[0], grads[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ap_loss_matches_eq5(device, dtype):
    e, y = batch(device, dtype, seed=4)
    loss = APLoss(tau2=0.01)
    expected = ref_ap(e.double(), y, 0.1, 0.01)
    torch.testing.assert_close(loss(e, y).double(), expected, **tol(dtype))
    assert loss.last_stats["n_skipped_no_positive"] == 1
    # Eq. (5) is Eq. (8) with the batch sampling rate and batch TPR (Table 2, row 1)
    ablation = SOPRCLoss(4, unbiased=False, use_v=False, tau2=0.01).to(device, dtype)
    torch.testing.assert_close(ablation(e, y), loss(e, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_semi_variance_matches_eq9(device, dtype):
    e, y = batch(device, dtype, seed=8)
    reg = SemiVarianceRegularizer(lambda_pos=1.0, lambda_neg=5.0)
    expected = ref_semi_variance(e.double(), y, 1.0, 5.0)
    torch.testing.assert_close(reg(e, y).double(), expected, **tol(dtype))
    reg_b = SemiVarianceRegularizer(lambda_pos=0.5, lambda_neg=0.0)
    torch.testing.assert_close(
        reg_b(e, y).double(), ref_semi_variance(e.double(), y, 0.5, 0.0), **tol(dtype)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_semi_variance_tail_normalization_matches_the_released_code(device, dtype):
    e, y = batch(device, dtype, seed=8)
    reg = SemiVarianceRegularizer(lambda_pos=1.0, lambda_neg=5.0, normalization="tail")
    expected = ref_semi_variance(e.double(), y, 1.0, 5.0, tail=True)
    torch.testing.assert_close(reg(e, y).double(), expected, **tol(dtype))
    # a tail holds part of the pairs: "tail" is the larger of the two normalizations
    assert float(reg(e, y)) > float(SemiVarianceRegularizer(1.0, 5.0)(e, y))
    e.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: SemiVarianceRegularizer(normalization="tail")(x, y), (e.double(),)
    )


def test_semi_variance_composes_without_recomputing(device):
    e, y = batch(device, torch.float64, seed=9)
    reg = SemiVarianceRegularizer(lambda_pos=1.0, lambda_neg=5.0)
    plain = trained_soprc(device, torch.float64).eval()
    combined = trained_soprc(device, torch.float64, semi_variance=reg).eval()
    torch.testing.assert_close(combined(e, y), plain(e, y) + reg(e, y))
    assert combined.last_stats["semi_variance"] == pytest.approx(float(reg(e, y)))
    ap = APLoss(semi_variance=reg)
    torch.testing.assert_close(ap(e, y), APLoss()(e, y) + reg(e, y))


# -- gradcheck -------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"unbiased": False}, {"unbiased": False, "use_v": False}])
def test_gradcheck_soprc(device, options):
    loss = trained_soprc(device, torch.float64, tau2=0.05, **options).eval()
    e, y = batch(device, torch.float64, seed=12, dim=3)
    e.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: loss(x, y), (e,))


@pytest.mark.parametrize("detach_tpr", [False, True])
def test_gradcheck_soprc_detach_tpr(device, detach_tpr):
    # detaching the TPR denominator is exact only where the TPR is locally constant: put every
    # v value far below (ℓ2 = 0) or far above (ℓ2 saturated at 1) all cosine scores
    loss = SOPRCLoss(4, num_v=6, tau2=0.001, detach_tpr=detach_tpr).to(device, torch.float64)
    loss.v.copy_(torch.tensor([-3.0, -2.0, -1.5, 1.5, 2.0, 3.0]).expand(4, -1))
    loss.eval()
    e, y = batch(device, torch.float64, seed=12, dim=3)
    e.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: loss(x, y), (e,))
    assert loss.last_stats["tpr_mean"] == pytest.approx(4 / 7)


def test_gradcheck_soprc_beta_zero_training_mode(device):
    loss = SOPRCLoss(4, num_v=7, beta=0.0, tau2=0.05).to(device, torch.float64)
    e, y = batch(device, torch.float64, seed=13, dim=3)
    e.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: loss(x, y), (e,))


def test_gradcheck_ap_and_semi_variance(device):
    e, y = batch(device, torch.float64, seed=14, dim=3)
    e.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: APLoss(tau2=0.05)(x, y), (e,))
    assert torch.autograd.gradcheck(lambda x: SemiVarianceRegularizer()(x, y), (e,))


def test_a_step_with_one_class_of_positive_pairs_runs_packed_as_unpacked(monkeypatch):
    """The loss path of the issue-36 packing failure: when one class has positive pairs, φ's
    layout has one group, whose (1, 1) column made the packed copy (CUDA's) raise. Packed on the
    CPU: the step runs and gives the unpacked step's value, gradient and v bit for bit."""
    results = []
    for pack in (False, True):
        if pack:
            force_packing(monkeypatch)
        loss = SOPRCLoss(4, num_v=5)
        e, y = batch("cpu", torch.float32, labels=[0, 0, 0, 1, 2, 3])
        e.requires_grad_(True)
        value = loss(e, y)
        value.backward()
        results.append((value.detach(), e.grad, loss.v.clone(), loss.v_updates.tolist()))
    assert results[1][3] == [1, 0, 0, 0]
    for plain, packed in zip(*results, strict=True):
        assert plain == packed if isinstance(plain, list) else torch.equal(plain, packed)


# -- deterministic gradients (issue 36) ------------------------------------------------------------

# aten operations that add into their output: on CUDA with atomic additions in the order the threads
# come, so a float sum changes its last bits from call to call (index_put / put: with accumulate)
ACCUMULATING = {"index_add", "scatter_add", "embedding_dense_backward", "_embedding_bag_backward"}
ACCUMULATING_IF_FLAGGED = {"index_put", "_index_put_impl", "_unsafe_index_put", "put"}


class AccumulatingWrites(TorchDispatchMode):
    """Records the accumulating writes into floating-point tensors (integer sums are exact in
    any order)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0].rstrip("_")
        if isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            if name in ACCUMULATING_IF_FLAGGED:
                flag = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
                if flag:
                    self.seen.append(f"{name}(accumulate=True)")
            elif name in ACCUMULATING or (
                name in ("scatter_reduce", "index_reduce")
                and (args[4] if len(args) > 4 else kwargs.get("reduce")) in ("sum", "mean", "prod")
            ):
                self.seen.append(name)
        return func(*args, **kwargs)


def determinism_cases():
    """(label, loss factory, call arguments) of SOPRC / AP / semi-variance calls, float64."""
    e, y = batch("cpu", torch.float64, seed=12, dim=3)
    r, ry = batch("cpu", torch.float64, seed=13, labels=[0, 1, 3, 3, 0, 2], dim=3)
    reg = SemiVarianceRegularizer()
    soprc = {
        "soprc": {},
        "biased": {"unbiased": False},
        "batch-tpr": {"unbiased": False, "use_v": False},
        "detach": {"detach_tpr": True, "use_v": False},
        "semi-variance": {"semi_variance": reg},
    }
    cases = []
    for label, options in soprc.items():
        for training in (False, True):
            make = functools.partial(trained_soprc, "cpu", torch.float64, tau2=0.05, **options)
            cases.append((f"{label}-{'train' if training else 'eval'}", make, training, (e, y)))
    cases.append(("soprc-reference-set", trained_soprc_cpu64, True, (e, y, r, ry)))
    cases.append(("ap", lambda: APLoss(tau2=0.05, semi_variance=reg), False, (e, y)))
    cases.append(
        ("semi-variance", lambda: SemiVarianceRegularizer(normalization="tail"), False, (e, y))
    )
    return cases


def trained_soprc_cpu64():
    return trained_soprc("cpu", torch.float64, tau2=0.05)


def gradient_of(loss, args, device="cpu"):
    x = args[0].to(device).clone().requires_grad_(True)
    rest = [a.to(device) for a in args[1:]]
    loss(x, *rest).backward()
    return x.grad


@pytest.mark.parametrize("case", determinism_cases(), ids=lambda c: c[0])
def test_loss_backward_adds_nothing_with_atomics(case):
    """Guards the 2 CUDA gradcheck failures of issue 36 ("Backward is not reentrant"): the
    backward of ``index_select`` / ``gather`` / indexing accumulates with ``index_add_`` /
    ``scatter_add_`` / ``index_put_(accumulate=True)``, atomic on CUDA, so the float64 gradient
    changed its last bits between two calls. The losses gather through :class:`_Segments`, whose
    sums are plain reductions; checked on the CPU by the aten operations of forward + backward."""
    _, make, training, args = case
    loss = make().train(training)
    with AccumulatingWrites() as mode:
        gradient_of(loss, args)
    assert mode.seen == [], mode.seen


@pytest.mark.parametrize("case", determinism_cases(), ids=lambda c: c[0])
def test_gradients_are_bit_identical_from_call_to_call(device, case):
    """The same call twice gives the same gradient bit for bit (on CUDA this is what gradcheck's
    reentrancy check failed, issue 36; each training call starts from the same v)."""
    _, make, training, args = case
    first, second = (gradient_of(make().to(device).train(training), args, device) for _ in "12")
    assert torch.equal(first, second)


def interleaved(index, rng):
    """The entries of ``index`` moved to other positions, each row's in their order: (new index,
    where every old position went)."""
    new_index = index[rng.permutation(index.size)]
    moved = np.empty(index.size, dtype=np.int64)
    for row in np.unique(index):
        moved[np.flatnonzero(index == row)] = np.flatnonzero(new_index == row)
    return new_index, moved


@pytest.mark.parametrize("kind", ["view", "scatter", "slots", "slots-with-padding"])
def test_segment_sums_do_not_depend_on_where_the_rows_sit(kind):
    """:class:`_Segments` sums the gradient rows of each source row in their own order, whatever
    the positions of the other rows: bit-identical sums after the entries are interleaved
    differently (atomics add them in thread order instead, issue 36), equal to ``index_add_`` on
    integer values (exact sums), and a gather whose gradcheck passes."""
    rng = np.random.default_rng(3)
    size = 7
    keep = None
    if kind == "view":
        index = np.repeat(np.arange(size), 4)
    elif kind == "scatter":
        index = rng.permutation(size)[:5]
    else:
        index = rng.integers(0, size - 1, size=40)  # row size - 1 never gathered
        keep = rng.random(40) < 0.7 if kind == "slots-with-padding" else None
    segments = _Segments(index, size, keep)
    assert segments.mode == kind.split("-")[0]
    values = torch.from_numpy(
        rng.standard_normal((index.size, 3)) * 10.0 ** rng.integers(-8, 9, (index.size, 1))
    )
    if keep is not None:
        values[~torch.from_numpy(keep)] = 0  # padding: the caller gives it no gradient
    index_t = torch.from_numpy(index)
    summed = segments.sum_back(values, index_t)
    integers = values.round()
    torch.testing.assert_close(
        segments.sum_back(integers, index_t),
        torch.zeros(size, 3, dtype=torch.float64).index_add_(0, index_t, integers),
        rtol=0,
        atol=0,
    )
    if kind != "view":  # a view is one arrangement by definition
        new_index, moved = interleaved(index, rng)
        new_keep = None
        if keep is not None:
            new_keep = np.empty_like(keep)
            new_keep[moved] = keep
        new_values = torch.empty_like(values)
        new_values[torch.from_numpy(moved)] = values
        again = _Segments(new_index, size, new_keep).sum_back(
            new_values, torch.from_numpy(new_index)
        )
        assert torch.equal(again, summed)
    x = torch.randn(size, 3, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(index.size, 3, dtype=torch.float64)
    if keep is not None:
        weights[~torch.from_numpy(keep)] = 0
    assert torch.autograd.gradcheck(lambda t: _gather_rows(t, index_t, segments) * weights, (x,))


# -- priors, labels, buffers -----------------------------------------------------------------------


def test_from_labels_priors():
    train = np.array([0, 0, 0, 1, 1, 2, 0, 1])  # counts 4, 3, 1 of N = 8
    loss = SOPRCLoss.from_labels(train, num_v=5, prior_scale=None)
    assert loss.num_classes == 3 and loss.num_v == 5
    assert loss.prior.tolist() == pytest.approx([3 / 7, 2 / 7, 0.0])
    # a query of class c has n_c - 1 positives (at least 1 kept, so the TPR stays defined)
    assert loss.positives.tolist() == [3.0, 2.0, 1.0]
    released = SOPRCLoss.from_labels(train, num_v=5, tpr_count="num_v")
    assert released.positives.tolist() == [6.0] * 3
    with pytest.raises(ValueError, match="tpr_count"):
        SOPRCLoss.from_labels(train, tpr_count="all")
    with pytest.raises(ValueError, match="positives"):
        SOPRCLoss.from_labels(train, positives=[1, 1, 1])
    # default: the released code's default prior_mul, 0.1 for the largest class
    assert SOPRCLoss.from_labels(train).prior.tolist() == pytest.approx([0.1, 0.075, 0.025])
    scaled = SOPRCLoss.from_labels(train, prior_scale=0.1, num_classes=5)
    assert scaled.num_classes == 5
    assert scaled.prior.tolist() == pytest.approx([0.1, 0.075, 0.025, 0.0, 0.0])
    with pytest.raises(ValueError, match="num_classes"):
        SOPRCLoss.from_labels(train, num_classes=2)
    with pytest.raises(ValueError, match="prior_scale"):
        SOPRCLoss.from_labels(train, prior_scale=0.0)


def test_zero_prior_of_used_class_raises():
    loss = SOPRCLoss(3, prior=torch.tensor([0.2, 0.0, 0.1]))
    e, _ = batch("cpu", torch.float32, labels=[0, 0, 1, 1])
    state = {k: v.clone() for k, v in loss.state_dict().items()}
    with pytest.raises(ValueError, match="prior"):
        loss(e, torch.tensor([0, 0, 1, 1]))
    # validated before v is updated: the failed call changed nothing
    for key, value in loss.state_dict().items():
        assert torch.equal(value, state[key]), key
    # a zero-prior class that is only a negative is fine
    loss(e, torch.tensor([0, 0, 2, 2]))


@pytest.mark.parametrize(
    "make",
    [
        lambda: SOPRCLoss(8, prior=torch.full((8,), 1e-3)),
        lambda: SOPRCLoss(1000),
        lambda: SOPRCLoss(8, prior=torch.full((8,), 1e-4), use_v=False),
    ],
)
def test_half_precision_at_small_priors_stays_finite(make):
    """The odds FPR/(rate TPR) reach ~1e6 here, past float16's 65504: t/(1+t) would be inf/inf."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1, 16, generator=g)
    e = (base + 1e-3 * torch.randn(32, 16, generator=g)).half().requires_grad_(True)
    y = torch.arange(8).repeat_interleave(4)
    loss = make().eval()
    value = loss(e, y)
    assert torch.isfinite(value) and 0.99 < float(value.detach()) <= 1.0
    value.backward()
    assert bool(torch.isfinite(e.grad).all())
    # and it agrees with float64
    reference = make().double().eval()(e.detach().double(), y)
    assert float(value.detach()) == pytest.approx(float(reference), abs=2e-3)


def test_one_minus_precision_gradient_has_no_cancellation():
    """At odds t ~ 1e7 the autograd derivative of t/(1+t), 1/(1+t) - t/(1+t)^2, loses every digit
    in float32; the library's form keeps the exact derivative rate TPR / (FPR + rate TPR)^2."""
    from rankwise.losses.soprc import _one_minus_precision

    fpr = torch.tensor([10.0], requires_grad=True)
    tpr, rate = torch.tensor([0.01]), torch.tensor([1e-4])
    _one_minus_precision(fpr, tpr, rate).backward()
    exact = 1e-6 / (10 + 1e-6) ** 2
    assert float(fpr.grad) == pytest.approx(exact, rel=1e-5)


def test_default_prior_is_balanced():
    assert SOPRCLoss(4).prior.tolist() == pytest.approx([0.25] * 4)


def test_labels_out_of_range_raise(device):
    loss = SOPRCLoss(3).to(device)
    e, _ = batch(device, torch.float32, labels=[0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"`labels`.*num_classes"):
        loss(e, torch.tensor([0, 0, 3, 3], device=device))
    with pytest.raises(ValueError, match=r"`labels`.*num_classes"):
        loss(e, torch.tensor([0, 0, -1, -1], device=device))
    with pytest.raises(ValueError, match=r"`ref_labels`.*num_classes"):
        loss(e, torch.tensor([0, 0, 1, 1], device=device), e, torch.tensor([0, 5, 1, 1]))


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"num_classes": 1}, "num_classes"),
        ({"num_classes": 3, "prior": [0.5, 0.5]}, "prior"),
        ({"num_classes": 2, "prior": [0.5, 1.5]}, "prior"),
        ({"num_classes": 2, "num_v": 0}, "num_v"),
        ({"num_classes": 2, "beta": 1.5}, "beta"),
        ({"num_classes": 2, "tau1": 0}, "tau1"),
        ({"num_classes": 2, "tau2": -1}, "tau2"),
        ({"num_classes": 2, "score_range": (1, 0)}, "score_range"),
        ({"num_classes": 2, "semi_variance": APLoss()}, "semi_variance"),
        ({"num_classes": 2, "v_init": "zeros"}, "v_init"),
        ({"num_classes": 2, "similarity": "l1"}, "similarity"),
        ({"num_classes": 2, "prior": [0.5, 1.0]}, "prior"),
        ({"num_classes": 2, "beta": float("nan")}, "beta"),
        ({"num_classes": 2, "tau1": float("inf")}, "tau1"),
        ({"num_classes": 2, "unbiased": 1}, "unbiased"),
        ({"num_classes": 2, "warm_start": "yes"}, "warm_start"),
        ({"num_classes": 2, "v_init_range": (0.0, float("inf"))}, "v_init_range"),
        ({"num_classes": True}, "num_classes"),
        ({"num_classes": 2, "positives": [0.5, 3]}, "positives"),
        ({"num_classes": 2, "positives": [3]}, "positives"),
    ],
)
def test_constructor_validation(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SOPRCLoss(**kwargs)


def test_uniform_v_init_is_seeded():
    a = SOPRCLoss(3, num_v=20, v_init="uniform", seed=3)
    b = SOPRCLoss(3, num_v=20, v_init="uniform", seed=3)
    c = SOPRCLoss(3, num_v=20, v_init="uniform", seed=4)
    assert torch.equal(a.v, b.v) and not torch.equal(a.v, c.v)
    assert bool((a.v.diff(dim=1) >= 0).all()) and 0 <= float(a.v.min()) and float(a.v.max()) < 1
    grid = SOPRCLoss(2, num_v=4, v_init_range=(-1.0, 1.0))
    assert grid.v.tolist() == [[-1.0, -0.5, 0.0, 0.5]] * 2


def test_state_dict_round_trip_and_dtype(device):
    loss = trained_soprc(device, torch.float32, steps=3)
    state = loss.state_dict()
    assert set(state) == {"v", "prior", "v_updates", "positives"}
    fresh = SOPRCLoss(4, num_v=9, beta=0.5).to(device)
    fresh.load_state_dict(state)
    for key in state:
        assert torch.equal(fresh.state_dict()[key], state[key])
    # a checkpoint written before the `positives` buffer existed loads with |v| + 1 positives
    old = {k: v for k, v in state.items() if k != "positives"}
    older = SOPRCLoss(4, num_v=9, positives=[2, 2, 2, 2]).to(device)
    older.load_state_dict(old)
    assert older.positives.tolist() == [10.0] * 4
    e, y = batch(device, torch.float32, seed=20)
    torch.testing.assert_close(fresh.eval()(e, y), loss.eval()(e, y))
    double = fresh.double()
    assert double.v.dtype == torch.float64 and double.prior.dtype == torch.float64
    assert double.v_updates.dtype == torch.long
    assert double(e.double(), y).dtype == torch.float64


@pytest.mark.cuda
def test_buffers_on_wrong_device_raise():
    loss = SOPRCLoss(4)
    e, y = batch("cuda", torch.float32)
    with pytest.raises(ValueError, match="loss.to"):
        loss(e, y)


def test_last_stats_and_no_valid_anchor(device):
    loss = SOPRCLoss(4, num_v=5).to(device)
    e, y = batch(device, torch.float32)
    loss(e, y)
    stats = loss.last_stats
    assert stats["n_pairs"] == stats["n_positive_pairs"] == 5 * 4 + 2 * 1 + 3 * 2
    assert stats["n_v_rows_updated"] == 3
    assert 0 < stats["tpr_mean"] <= 1 and stats["loss_auprc"] > 0
    with pytest.raises(ValueError, match="no anchor"):
        loss(e[:3], torch.tensor([0, 1, 2], device=device))


def test_loss_decreases_when_ranking_improves(device):
    # a well separated embedding must have a lower SOPRC and AP loss than a mixed one
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2], device=device)
    centers = torch.eye(3, device=device, dtype=torch.float64)
    noise = 0.05 * torch.randn(
        9, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    ).to(device)
    good = centers[y] + noise
    bad = centers[(y + torch.arange(9, device=device)) % 3] + noise
    for make in (lambda: SOPRCLoss(3, warm_start=True), APLoss):
        loss = make().to(device, torch.float64)
        assert float(loss(good, y)) < float(loss(bad, y))
    assert math.isfinite(float(SOPRCLoss(3).to(device)(good.float(), y)))


def test_soprc_is_sampling_rate_invariant_unlike_ap():
    # Prop. 2 / Fig. 1 on binormal scores (s- ~ N(0,1), s+ ~ N(1,1), pi = 0.1): one query ranked
    # against batches of 200 drawn at positive sampling rates 0.02 and 0.3. With v and the prior
    # taken from the full data, SOPRC's mean barely moves; the biased AP estimator drops sharply.
    rng = np.random.default_rng(1)
    pos, neg = rng.normal(1, 1, 300), rng.normal(0, 1, 2700)
    soprc = SOPRCLoss(2, prior=[0.1, 0.9], tau2=0.01, score_range=None, similarity="dot")
    soprc.double().eval()
    soprc.v.copy_(score_interpolation(torch.tensor(pos), 100, None).expand(2, -1))
    ap = APLoss(tau2=0.01, similarity="dot")
    query, query_label = torch.ones(1, 1, dtype=torch.float64), torch.tensor([0])
    means = {}
    for rate in (0.02, 0.3):
        k = round(rate * 200)
        values = []
        for _ in range(30):
            scores = np.concatenate(
                [rng.choice(pos, k, replace=False), rng.choice(neg, 200 - k, replace=False)]
            )
            ref, ref_labels = torch.tensor(scores)[:, None], torch.tensor([0] * k + [1] * (200 - k))
            values.append([float(f(query, query_label, ref, ref_labels)) for f in (soprc, ap)])
        means[rate] = np.mean(values, axis=0)
    soprc_drift, ap_drift = np.abs(means[0.02] - means[0.3])
    assert ap_drift > 0.08
    assert soprc_drift < 0.4 * ap_drift


def test_numpy_integer_sizes_are_accepted_as_ints():
    import numpy as np

    loss = SOPRCLoss(np.int64(6), num_v=np.int32(20))
    assert (loss.num_classes, loss.num_v) == (6, 20)
    assert type(loss.num_classes) is int and loss.v.shape == (6, 20)
    with pytest.raises(ValueError, match="num_classes"):
        SOPRCLoss(2.5)
    with pytest.raises(ValueError, match="num_v"):
        SOPRCLoss(4, num_v=True)


@pytest.mark.parametrize(
    "make",
    [lambda: SOPRCLoss(8, prior=torch.full((8,), 1e-3)), lambda: SOPRCLoss(1000)],
    ids=["prior-1e-3", "1000-classes"],
)
def test_half_precision_training_mode_keeps_v_and_the_value_finite(make):
    """Issue 14 §1 in training mode: v is updated from float16 pair scores, the loss (float32)
    equals the float64 loss of the same inputs, and the moving average is the float64 one."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(1, 16, generator=g)
    e = (base + 1e-3 * torch.randn(32, 16, generator=g)).half()
    y = torch.arange(8).repeat_interleave(4)
    half, double = make().train(), make().double().train()
    for _ in range(3):
        value = half(e.detach().requires_grad_(True), y)
        reference = double(e.double(), y)
        assert value.dtype == torch.float32 and torch.isfinite(value)
        assert float(value.detach()) == pytest.approx(float(reference), abs=1e-5)
    assert bool(torch.isfinite(half.v).all())
    torch.testing.assert_close(half.v.double(), double.v, rtol=0, atol=1e-6)
    assert torch.equal(half.v_updates, double.v_updates)


def test_float16_dot_similarity_with_norms_past_the_float16_range():
    """Issue 14 §3: float16 rows with squared norms > 65504 and similarity='dot' (scores ~1e5,
    temperatures scaled to them) give the float64 value and gradient, and a finite v."""
    g = torch.Generator().manual_seed(2)
    y = torch.arange(4).repeat_interleave(4)
    centres = torch.randn(4, 16, generator=g)
    rows = centres[y] + 1.0 * torch.randn(16, 16, generator=g)
    e = (300 * rows / rows.norm(dim=1, keepdim=True)).half()  # squared norms 9e4
    assert float((e.double() ** 2).sum(1).min()) > 65504
    scale = float((e.double() ** 2).sum(1).mean())
    options = dict(similarity="dot", tau1=0.1 * scale, tau2=0.01 * scale, score_range=None)
    results = []
    for dtype in (torch.float16, torch.float64):
        loss = SOPRCLoss(4, prior=torch.full((4,), 0.05), v_init_range=(0, scale), **options)
        loss = loss.double() if dtype == torch.float64 else loss
        x = e.detach().to(dtype, copy=True).requires_grad_(True)
        value = loss(x, y)
        (value * scale).backward()  # a loss scale that fits the gradient into float16
        results.append((value, x.grad, loss.v))
    (value, grad, v), (reference, ref_grad, ref_v) = results
    assert value.dtype == torch.float32 and torch.isfinite(value)
    assert 0.01 < float(reference) < 0.99  # not saturated: the scores matter
    assert float(value.detach()) == pytest.approx(float(reference), rel=1e-5)
    assert bool(torch.isfinite(v).all())
    torch.testing.assert_close(v.double(), ref_v, rtol=1e-5, atol=0)
    torch.testing.assert_close(
        grad.double(), ref_grad.to(torch.float16).double(), rtol=1e-2, atol=1e-3
    )


@pytest.mark.parametrize("warm_start", [False, True])
def test_every_raising_call_leaves_the_buffers_bitwise_unchanged(warm_start):
    """Issue 14 §2: validate first, then mutate. A trained loss in training mode; each call below
    raises ValueError and v, v_updates, prior and positives keep every bit (warm_start included,
    whose first update of a class would copy φ)."""
    loss = trained_soprc("cpu", torch.float32, warm_start=warm_start)
    loss.prior[3] = 0.0  # class 3: a zero prior
    e, _ = batch("cpu", torch.float32, labels=[0, 0, 1, 1, 2, 2, 3, 3])
    bad_calls = {
        "zero prior": (e, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])),
        "label out of range": (e, torch.tensor([0, 0, 1, 1, 2, 2, 4, 4])),
        "ref_labels out of range": (
            e,
            torch.tensor([0, 0, 1, 1, 2, 2, 0, 1]),
            e,
            torch.full((8,), 9),
        ),
        "NaN ref_embeddings": (
            e,
            torch.tensor([0, 0, 1, 1, 2, 2, 0, 1]),
            torch.full_like(e, math.nan),
            torch.tensor([0, 0, 1, 1, 2, 2, 0, 1]),
        ),
        "nothing to rank": (e[:3], torch.tensor([0, 1, 2])),
    }
    for case, args in bad_calls.items():
        before = {k: v.clone() for k, v in loss.state_dict().items()}
        with pytest.raises(ValueError):
            loss(*args)
            dict(loss.last_stats)  # the values of the embeddings are refused when read
        for key, value in loss.state_dict().items():
            old = before[key]
            assert torch.equal(
                value.flatten().view(torch.uint8), old.flatten().view(torch.uint8)
            ), (
                case,
                key,
            )
