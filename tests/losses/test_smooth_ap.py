"""Tests of Smooth-AP (Brown et al., ECCV 2020) against a loop re-derivation of its formula, the exact
AP of scikit-learn in the small-temperature limit, numerical gradients, and the layout assumption of
pytorch-metric-learning 2.9.0's SmoothAPLoss."""

from __future__ import annotations

import math

import pytest
import torch
from pytorch_metric_learning.losses import SmoothAPLoss as PMLSmoothAPLoss
from sklearn.metrics import average_precision_score

from rankwise.losses import SmoothAPLoss

UNEVEN_LABELS = [2, 0, 1, 0, 2, 7, 1, 0, 2, 1, 2, 0, 4]  # 7 and 4 are singletons: skipped


def loop_cosine(queries, refs):
    q = queries.detach().cpu().double().tolist()
    r = refs.detach().cpu().double().tolist()
    out = []
    for a in q:
        na = math.sqrt(sum(v * v for v in a))
        row = []
        for b in r:
            nb = math.sqrt(sum(v * v for v in b))
            row.append(sum(x * y for x, y in zip(a, b, strict=True)) / (na * nb))
        out.append(row)
    return out


def loop_smooth_ap_loss(emb, labels, tau, ref_emb=None, ref_labels=None, include_self=False):
    """1 − mean_q AP_q with R_P, R_all of the Smooth-AP paper, one anchor and positive at a time.

    Without a reference set the anchor is excluded from its own ranking unless ``include_self``
    (the convention of the original Smooth-AP code and of pytorch-metric-learning)."""
    self_ref = ref_emb is None
    if self_ref:
        ref_emb, ref_labels = emb, labels
    s = loop_cosine(emb, ref_emb)

    def g(x):
        return 1.0 / (1.0 + math.exp(-x / tau))

    aps = []
    for q in range(len(labels)):
        items = [j for j in range(len(ref_labels)) if include_self or not self_ref or j != q]
        pos = [j for j in items if ref_labels[j] == labels[q]]
        neg = [j for j in items if ref_labels[j] != labels[q]]
        if not pos or not neg:
            continue
        total = 0.0
        for i in pos:
            r_pos = 1.0 + sum(g(s[q][j] - s[q][i]) for j in pos if j != i)
            r_all = r_pos + sum(g(s[q][j] - s[q][i]) for j in neg)
            total += r_pos / r_all
        aps.append(total / len(pos))
    return 1.0 - sum(aps) / len(aps), len(aps)


def random_batch(n, d=5, seed=0, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


@pytest.mark.parametrize("tau", [0.05, 0.5])
def test_smooth_ap_matches_loop_reference(device, tau):
    lab = torch.tensor(UNEVEN_LABELS, device=device)
    emb = random_batch(len(lab), device=device)
    loss_fn = SmoothAPLoss(temperature=tau)
    got = loss_fn(emb, lab)
    expected, n_used = loop_smooth_ap_loss(emb, UNEVEN_LABELS, tau)
    assert got.item() == pytest.approx(expected, abs=1e-12)
    assert got.device.type == device.type
    assert loss_fn.last_stats["n_anchors_used"] == n_used == 11
    assert loss_fn.last_stats["n_skipped_no_positive"] == 2


def test_smooth_ap_with_reference_set_matches_loop_reference(device):
    lab = [0, 1, 2, 0, 3, 1]
    ref_lab = [1, 0, 0, 2, 2, 1, 5, 0, 1]
    emb = random_batch(len(lab), seed=1, device=device)
    ref = random_batch(len(ref_lab), seed=2, device=device)
    loss_fn = SmoothAPLoss(temperature=0.1)
    got = loss_fn(emb, torch.tensor(lab, device=device), ref, torch.tensor(ref_lab, device=device))
    expected, _ = loop_smooth_ap_loss(emb, lab, 0.1, ref, ref_lab)
    assert got.item() == pytest.approx(expected, abs=1e-12)
    assert loss_fn.last_stats["n_skipped_no_positive"] == 1  # class 3 has no reference


def test_small_temperature_gives_exact_average_precision():
    lab = torch.tensor(UNEVEN_LABELS)
    emb = random_batch(len(lab), seed=3)
    scores = loop_cosine(emb, emb)
    aps, gaps = [], []
    for q in range(len(lab)):
        others = [j for j in range(len(lab)) if j != q]
        y = [int(lab[j] == lab[q]) for j in others]
        if 0 < sum(y) < len(y):
            row = sorted(scores[q][j] for j in others)
            gaps.append(min(b - a for a, b in zip(row, row[1:], strict=False)))
            aps.append(average_precision_score(y, [scores[q][j] for j in others]))
    assert min(gaps) > 5e-5  # tie-free: the relaxation with τ = 1e-6 is then a step function
    loss_fn = SmoothAPLoss(temperature=1e-6)
    assert loss_fn(emb, lab).item() == pytest.approx(1.0 - sum(aps) / len(aps), abs=1e-9)
    assert loss_fn.last_stats["mean_smooth_ap"] == pytest.approx(sum(aps) / len(aps), abs=1e-9)


def test_pml_agrees_only_when_class_count_equals_samples_per_class():
    """PML 2.9.0 reshapes the batch into groups of (#classes) consecutive items and treats each
    group as a class, with the query kept in its own ranking. That is right only when the batch is
    sorted into blocks and #classes == samples per class; it matches our loss evaluated with the
    batch as its own reference set (query included) in that layout, and nothing otherwise."""
    tau = 0.1
    # 3 classes × 3 samples: PML's assumption holds.
    lab = torch.arange(3).repeat_interleave(3)
    emb = random_batch(9, seed=4, dtype=torch.float32)
    pml = PMLSmoothAPLoss(temperature=tau)(emb, lab).item()
    with_self, _ = loop_smooth_ap_loss(emb, lab.tolist(), tau, include_self=True)
    ours_with_self = SmoothAPLoss(temperature=tau)(emb, lab, emb, lab).item()
    assert pml == pytest.approx(with_self, abs=1e-5)
    assert ours_with_self == pytest.approx(with_self, abs=1e-5)

    # 2 classes × 4 samples, each class a tight cluster (true AP ≈ 1): PML groups items in pairs
    # as if there were 4 classes of 2, so two true positives of every query count as negatives.
    lab = torch.arange(2).repeat_interleave(4)
    centers = random_batch(2, seed=5, dtype=torch.float32)
    emb = centers[lab] + 0.15 * random_batch(8, seed=6, dtype=torch.float32)
    pml = PMLSmoothAPLoss(temperature=tau)(emb, lab).item()
    with_self, _ = loop_smooth_ap_loss(emb, lab.tolist(), tau, include_self=True)
    without_self, _ = loop_smooth_ap_loss(emb, lab.tolist(), tau)
    assert SmoothAPLoss(temperature=tau)(emb, lab, emb, lab).item() == pytest.approx(
        with_self, abs=1e-5
    )
    assert SmoothAPLoss(temperature=tau)(emb, lab).item() == pytest.approx(without_self, abs=1e-5)
    assert with_self < 0.05 and without_self < 0.05
    assert pml > with_self + 0.15


def test_smooth_ap_is_invariant_to_batch_permutation():
    lab = torch.tensor(UNEVEN_LABELS)
    emb = random_batch(len(lab), seed=6)
    perm = torch.randperm(len(lab), generator=torch.Generator().manual_seed(7))
    loss_fn = SmoothAPLoss(temperature=0.05)
    assert loss_fn(emb[perm], lab[perm]).item() == pytest.approx(
        loss_fn(emb, lab).item(), abs=1e-12
    )


def test_smooth_ap_float32_agrees_with_float64(device):
    lab = torch.tensor(UNEVEN_LABELS, device=device)
    emb = random_batch(len(lab), seed=8, device=device)
    loss_fn = SmoothAPLoss(temperature=0.05)
    l32 = loss_fn(emb.float(), lab)
    assert l32.dtype == torch.float32
    assert l32.item() == pytest.approx(loss_fn(emb, lab).item(), abs=1e-5)


def test_smooth_ap_gradcheck():
    lab = torch.tensor([0, 1, 0, 2, 1, 0, 2, 3])
    emb = random_batch(len(lab), d=3, seed=9).requires_grad_(True)
    loss_fn = SmoothAPLoss(temperature=0.5)
    assert torch.autograd.gradcheck(lambda e: loss_fn(e, lab), (emb,))


def test_smooth_ap_gradcheck_with_reference_set():
    lab, ref_lab = torch.tensor([0, 1, 2, 0]), torch.tensor([1, 0, 2, 2, 0, 1])
    emb = random_batch(4, d=3, seed=10).requires_grad_(True)
    ref = random_batch(6, d=3, seed=11).requires_grad_(True)
    loss_fn = SmoothAPLoss(temperature=0.5)
    assert torch.autograd.gradcheck(lambda e, r: loss_fn(e, lab, r, ref_lab), (emb, ref))


def test_tiny_temperature_keeps_gradients_finite():
    lab = torch.tensor(UNEVEN_LABELS)
    emb = random_batch(len(lab), seed=12, dtype=torch.float32).requires_grad_(True)
    loss = SmoothAPLoss(temperature=1e-6)(emb, lab)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(emb.grad).all()


@pytest.mark.parametrize("tau", [0, -0.1, float("nan"), "x"])
def test_smooth_ap_rejects_bad_temperature(tau):
    with pytest.raises(ValueError, match="temperature"):
        SmoothAPLoss(temperature=tau)


def test_float16_dot_similarity_with_norms_past_the_float16_range():
    """Issue 14 §3: float16 rows with squared norms > 65504 and similarity='dot' (scores ~1e5,
    the temperature scaled to them): the float16 dot products would be inf and the loss NaN; the
    loss scores in float32 and equals the float64 value and gradient of the same inputs."""
    g = torch.Generator().manual_seed(3)
    y = torch.arange(4).repeat_interleave(4)
    centres = torch.randn(4, 16, generator=g)
    rows = centres[y] + 0.5 * torch.randn(16, 16, generator=g)
    e = (300 * rows / rows.norm(dim=1, keepdim=True)).half()  # squared norms 9e4
    assert float((e.double() ** 2).sum(1).min()) > 65504
    scale = float((e.double() ** 2).sum(1).mean())
    results = []
    for dtype in (torch.float16, torch.float64):
        x = e.detach().to(dtype, copy=True).requires_grad_(True)
        value = SmoothAPLoss(temperature=0.01 * scale, similarity="dot")(x, y)
        (value * scale).backward()  # a loss scale that fits the gradient into float16
        results.append((value, x.grad))
    (value, grad), (reference, ref_grad) = results
    assert value.dtype == torch.float32 and torch.isfinite(value)
    assert 0.01 < float(reference) < 0.99
    assert float(value.detach()) == pytest.approx(float(reference), rel=1e-5)
    torch.testing.assert_close(
        grad.double(), ref_grad.to(torch.float16).double(), rtol=1e-2, atol=1e-3
    )
