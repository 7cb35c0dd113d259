"""TieAwareAPLoss / TieAwareNDCGLoss (TALR Eq. 11-12) and the DPSH baseline: gradcheck in float64,
hard codes give exactly the tie-aware metrics of rankwise.metrics, the midpoint form against a
direct re-derivation of the released formula, and the special functions behind the exact form."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rankwise.losses import DPSHLoss, TieAwareAPLoss, TieAwareNDCGLoss, build_loss
from rankwise.losses.tie_aware import (
    _within_tie_term,
    logarithmic_integral,
    relaxed_cumulative_discount,
    relaxed_harmonic,
    soft_histograms,
)
from rankwise.metrics import EuclideanThresholdAffinity, hamming_retrieval_metrics

LOSSES = (TieAwareAPLoss, TieAwareNDCGLoss)


def relaxed_codes(n, bits, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.tanh(scale * torch.randn(n, bits, generator=g, dtype=torch.float64))


def balanced_labels(n_classes, per_class):
    return torch.arange(n_classes).repeat_interleave(per_class)


# -- exactness with hard codes ---------------------------------------------------------------------


def hard_codes(n, bits, seed):
    """Codes a HashingHead gives with γ -> ∞: tanh(γ f / 2) is exactly ±1 in float64."""
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(n, bits, generator=g, dtype=torch.float64)
    f = torch.where(f.abs() < 0.05, torch.sign(f) * 0.05 + (f == 0) * 0.05, f)
    return torch.tanh(1e4 * f / 2)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bits", [3, 6, 12])
def test_hard_codes_give_exactly_the_tie_aware_metrics(seed, bits):
    codes = hard_codes(15, bits, seed)
    assert set(codes.unique().tolist()) == {-1.0, 1.0}
    labels = balanced_labels(3, 5)
    report = hamming_retrieval_metrics(codes, labels)  # leave-one-out, the batch's protocol
    for delta in (1.0, 0.3):  # Δ = the bin spacing, and Δ -> 0
        ap = 1 - TieAwareAPLoss(bits, delta=delta)(codes, labels).item()
        ndcg = 1 - TieAwareNDCGLoss(bits, delta=delta)(codes, labels).item()
        assert ap == pytest.approx(report.map, abs=1e-12)
        assert ndcg == pytest.approx(report.ndcg, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_hard_codes_multi_level_and_reference_set(seed):
    rng = np.random.default_rng(seed)
    bits = 8
    codes, refs = hard_codes(9, bits, seed), hard_codes(30, bits, seed + 100)
    hot = torch.from_numpy(rng.random((9, 4)) < 0.5)
    ref_hot = torch.from_numpy(rng.random((30, 4)) < 0.5)
    hot[:, 0] = True
    ref_hot[:3, 0] = True
    ref_hot[3:6] = False  # some references share nothing with anyone
    report = hamming_retrieval_metrics(codes, hot, refs, ref_hot, affinity="shared_labels")
    ndcg = 1 - TieAwareNDCGLoss(bits)(codes, hot, refs, ref_hot).item()
    ap = 1 - TieAwareAPLoss(bits)(codes, hot, refs, ref_hot).item()
    assert ndcg == pytest.approx(report.ndcg, abs=1e-12)
    assert ap == pytest.approx(report.map, abs=1e-12)


def test_hard_codes_euclidean_threshold_affinity():
    rng = np.random.default_rng(0)
    features = torch.from_numpy(rng.normal(size=(40, 3)))
    aff = EuclideanThresholdAffinity.from_quantiles(features, quantiles=(0.3, 0.1, 0.05, 0.02))
    codes = hard_codes(40, 10, 3)
    loss = TieAwareNDCGLoss(10, affinity=aff)
    value = 1 - loss(codes, features).item()
    report = hamming_retrieval_metrics(codes, features, affinity=aff)
    used = loss.last_stats["n_anchors_used"]
    assert (
        used == 40 - report.n_queries_without_relevant
    )  # every anchor with a neighbour has a non-neighbour
    assert value == pytest.approx(report.ndcg, abs=1e-12)


# -- gradients -------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["exact", "midpoint"])
@pytest.mark.parametrize("loss_cls", LOSSES)
@pytest.mark.parametrize("setting", ["self", "reference", "coarse_bins", "wide_kernel"])
def test_gradcheck_float64(form, loss_cls, setting):
    bits = 5
    labels = balanced_labels(3, 3)
    kwargs = {"form": form}
    if setting == "coarse_bins":
        kwargs["num_bins"] = 3
    if setting == "wide_kernel":
        kwargs["delta"] = 2.5
    loss = loss_cls(bits, **kwargs)
    codes = relaxed_codes(9, bits, seed=1).requires_grad_()
    if setting == "reference":
        refs = relaxed_codes(6, bits, seed=2).requires_grad_()
        ref_labels = balanced_labels(2, 3)
        assert torch.autograd.gradcheck(lambda a, b: loss(a, labels, b, ref_labels), (codes, refs))
    else:
        assert torch.autograd.gradcheck(lambda a: loss(a, labels), (codes,))


def test_gradcheck_multi_level_ndcg():
    rng = np.random.default_rng(2)
    hot = torch.from_numpy(rng.random((8, 5)) < 0.5)
    codes = relaxed_codes(8, 4, seed=3).requires_grad_()
    loss = TieAwareNDCGLoss(4, affinity="shared_labels")
    assert torch.autograd.gradcheck(lambda a: loss(a, hot), (codes,))


def test_gradient_is_finite_where_a_bin_holds_exactly_one_item():
    # item distances at exact bin centres: every soft count is an integer, the within-tie term
    # sits on its removable singularity (n = 1) and the histogram kernels on their kinks
    codes = hard_codes(8, 4, 0).clone().requires_grad_()
    labels = balanced_labels(2, 4)
    for loss_cls in LOSSES:
        value = loss_cls(4)(codes, labels)
        (grad,) = torch.autograd.grad(value, codes)
        assert torch.isfinite(grad).all()


def test_loss_decreases_when_optimizing_free_codes():
    torch.manual_seed(0)
    labels = balanced_labels(4, 8)
    logits = torch.randn(32, 16, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.05)
    loss = TieAwareAPLoss(16)
    first = None
    for _ in range(30):
        value = loss(torch.tanh(logits / 2), labels)
        first = first if first is not None else value.item()
        opt.zero_grad()
        value.backward()
        opt.step()
    assert value.item() < first - 0.2
    assert hamming_retrieval_metrics(torch.sign(logits.detach()), labels).map > 0.9


# -- the relaxed objectives, re-derived ----------------------------------------------------------------


def released_midpoint_ap(codes, labels, bits, num_bins):
    """The released apr_s_forward, transcribed from its formula: loops, no vectorisation."""
    n = codes.shape[0]
    width = bits / num_bins
    centres = [k * width for k in range(num_bins + 1)]
    dist = (bits - codes @ codes.T) / 2
    total, used = 0.0, 0
    for i in range(n):
        pos = [j for j in range(n) if j != i and labels[j] == labels[i]]
        neg = [j for j in range(n) if labels[j] != labels[i]]
        if not pos or not neg:
            continue
        cp = [sum(max(0.0, 1 - abs(float(dist[i, j]) - c) / width) for j in pos) for c in centres]
        cn = [sum(max(0.0, 1 - abs(float(dist[i, j]) - c) / width) for j in neg) for c in centres]
        value, cum_p, cum = 0.0, 0.0, 0.0
        for d in range(num_bins + 1):
            prev_p, prev = cum_p, cum
            cum_p += cp[d]
            cum += cp[d] + cn[d]
            value += cp[d] * (prev_p + cum_p + 1) / (prev + cum + 1)
        total += value / len(pos)
        used += 1
    return total / used


def released_midpoint_ndcg(codes, labels, bits):
    n = codes.shape[0]
    dist = (bits - codes @ codes.T) / 2
    total = 0.0
    for i in range(n):
        gains = [1.0 if labels[j] == labels[i] else 0.0 for j in range(n) if j != i]
        others = [j for j in range(n) if j != i]
        c = [sum(max(0.0, 1 - abs(float(dist[i, j]) - d)) for j in others) for d in range(bits + 1)]
        g = [
            sum(gains[t] * max(0.0, 1 - abs(float(dist[i, j]) - d)) for t, j in enumerate(others))
            for d in range(bits + 1)
        ]
        cum, dcg = 0.0, 0.0
        for d in range(bits + 1):
            dcg += g[d] / math.log2(cum + (c[d] + 1) / 2 + 1)
            cum += c[d]
        ideal = sum(v / math.log2(t + 2) for t, v in enumerate(sorted(gains, reverse=True)))
        total += dcg / ideal
    return total / n


@pytest.mark.parametrize("num_bins", [8, 4])
def test_midpoint_ap_is_the_released_formula(num_bins):
    codes = relaxed_codes(12, 8, seed=4)
    labels = balanced_labels(3, 4)
    ours = 1 - TieAwareAPLoss(8, num_bins=num_bins, form="midpoint")(codes, labels).item()
    assert ours == pytest.approx(released_midpoint_ap(codes, labels, 8, num_bins), abs=1e-12)


def test_midpoint_ndcg_is_the_released_formula():
    codes = relaxed_codes(10, 6, seed=5)
    labels = balanced_labels(2, 5)
    ours = 1 - TieAwareNDCGLoss(6, form="midpoint")(codes, labels).item()
    assert ours == pytest.approx(released_midpoint_ndcg(codes, labels, 6), abs=1e-12)


def test_exact_ap_matches_the_per_position_sum_on_integer_soft_counts():
    # Eq. 6 (errata form) summed position by position, for integer counts given as histograms
    pos = torch.tensor([[0.0, 2.0, 1.0, 0.0, 3.0]], dtype=torch.float64)
    neg = torch.tensor([[1.0, 3.0, 0.0, 2.0, 1.0]], dtype=torch.float64)
    from rankwise.losses.tie_aware import tie_aware_ap_relaxation

    value = float(tie_aware_ap_relaxation(pos, pos + neg, pos.sum(1))[0])
    expected, above, above_pos = 0.0, 0, 0
    for r, q in zip(pos[0].tolist(), neg[0].tolist(), strict=True):
        n = int(r + q)
        beta = (r - 1) / (n - 1) if n > 1 else 0.0
        for t in range(above + 1, above + n + 1):
            expected += r / n * (above_pos + 1 + (t - above - 1) * beta) / t
        above += n
        above_pos += int(r)
    assert value == pytest.approx(expected / 6, abs=1e-14)


# -- special functions ---------------------------------------------------------------------------


def test_relaxed_cumulative_discount_is_exact_at_integers_and_satisfies_the_recurrence():
    n = torch.arange(0, 400, dtype=torch.float64)
    exact = torch.tensor(
        [math.fsum(1 / math.log2(t + 1) for t in range(1, int(k) + 1)) for k in n],
        dtype=torch.float64,
    )
    assert torch.allclose(relaxed_cumulative_discount(n), exact, atol=1e-12, rtol=0)
    x = torch.linspace(-0.9, 50.0, 301, dtype=torch.float64)
    step = relaxed_cumulative_discount(x + 1) - relaxed_cumulative_discount(x)
    assert torch.allclose(step, 1 / torch.log2(x + 2), atol=1e-12, rtol=0)
    y = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(relaxed_cumulative_discount(y).sum(), y)
    assert (grad > 0).all()  # a cumulative sum of positive discounts grows


def test_relaxed_harmonic_and_logarithmic_integral():
    n = torch.arange(0, 50, dtype=torch.float64)
    exact = torch.tensor(
        [math.fsum(1 / t for t in range(1, int(k) + 1)) for k in n], dtype=torch.float64
    )
    assert torch.allclose(relaxed_harmonic(n), exact, atol=1e-13, rtol=0)
    x = torch.tensor([1.5, 2.0, 10.0, 65.0, 1e3, 1e6], dtype=torch.float64)
    expected = torch.tensor([float(mpmath.li(float(v))) for v in x], dtype=torch.float64)
    assert torch.allclose(logarithmic_integral(x), expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize("g", [0.0, 0.4, 3.0, 120.5])
@pytest.mark.parametrize("eps", [-3e-4, -2e-5, 0.0, 1e-7, 5e-5, 2e-4, 0.3])
def test_within_tie_term_is_continuous_through_its_removable_pole(g, eps):
    mpmath.mp.dps = 40
    n = 1 + eps
    above = torch.tensor([g], dtype=torch.float64)
    size = torch.tensor([n], dtype=torch.float64)
    delta_h = relaxed_harmonic(above + size) - relaxed_harmonic(above)
    ours = float(_within_tie_term(above, size, delta_h)[0])
    if eps == 0:
        expected = 1 - (g + 1) * mpmath.psi(1, g + 2)
    else:
        exact_n, exact_g = mpmath.mpf(n), mpmath.mpf(g)  # the floats the loss sees, exactly
        dh = mpmath.digamma(exact_g + exact_n + 1) - mpmath.digamma(exact_g + 1)
        expected = (exact_n - (exact_g + 1) * dh) / (exact_n - 1)
    assert ours == pytest.approx(float(expected), abs=1e-11)


def test_soft_histograms_conserve_mass():
    dist = torch.rand(4, 9, dtype=torch.float64) * 12
    ones = torch.ones(4, 9, 1, dtype=torch.float64)
    for num_bins, delta in ((12, 1.0), (6, 2.0), (12, 2.7), (4, 1.5)):
        hist = soft_histograms(dist, ones, 12, num_bins, delta)
        assert hist.shape == (4, num_bins + 1, 1)
        assert torch.allclose(hist.sum(1), torch.full((4, 1), 9.0, dtype=torch.float64))


# -- behaviour and validation ----------------------------------------------------------------------


def test_float32_codes_give_a_float32_loss_and_stats():
    codes = relaxed_codes(16, 12).float().requires_grad_()
    labels = balanced_labels(4, 4)
    for loss_cls in LOSSES:
        loss = loss_cls(12)
        value = loss(codes, labels)
        assert value.dtype == torch.float32 and torch.isfinite(value)
        value.backward()
        key = "mean_ap_r" if loss_cls is TieAwareAPLoss else "mean_ndcg_r"
        assert 0 < loss.last_stats[key] <= 1 and loss.last_stats["n_anchors_used"] == 16


def test_anchors_without_positives_are_skipped_and_counted():
    labels = torch.tensor([0, 0, 1, 1, 2])
    loss = TieAwareAPLoss(6)
    loss(relaxed_codes(5, 6), labels)
    assert loss.last_stats["n_anchors_used"] == 4 and loss.last_stats["n_skipped_no_positive"] == 1
    with pytest.raises(
        ValueError, match="no anchor in this batch has both a positive and a negative"
    ):
        loss(relaxed_codes(3, 6), torch.tensor([0, 1, 2]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": 0}, "`bits` must be an integer >= 1"),
        ({"bits": 8, "num_bins": 0}, "`num_bins`"),
        ({"bits": 8, "delta": 0.0}, "`delta`"),
        ({"bits": 8, "delta": float("inf")}, "`delta`"),
        ({"bits": 8, "form": "log"}, "`form` must be one of 'exact', 'midpoint'"),
        ({"bits": 8, "affinity": "euclid"}, "`affinity` must be one of"),
        ({"bits": 8, "affinity": 3}, "`affinity` must be one of"),
    ],
)
def test_arguments_are_validated(kwargs, match):
    for loss_cls in LOSSES:
        with pytest.raises(ValueError, match=match):
            loss_cls(**kwargs)


def test_inputs_are_validated():
    """Shapes and labels are refused at the call; the codes' values are checked on the device
    and refused when ``last_stats`` is read (the call returns NaN: no host sync in the step)."""
    loss = TieAwareAPLoss(8)
    labels = balanced_labels(2, 3)
    with pytest.raises(ValueError, match="relaxed codes in \\[-1, 1\\].*HashingHead"):
        assert torch.isnan(loss(torch.randn(6, 8) * 3, labels))
        dict(loss.last_stats)
    with pytest.raises(ValueError, match="has 6 columns but the loss was built for bits=8"):
        loss(relaxed_codes(6, 6), labels)
    with pytest.raises(ValueError, match="`labels` has length 5"):
        loss(relaxed_codes(6, 8), labels[:5])
    with pytest.raises(ValueError, match="NaN"):
        assert torch.isnan(loss(torch.full((6, 8), float("nan")), labels))
        dict(loss.last_stats)
    with pytest.raises(ValueError, match="pass both"):
        loss(relaxed_codes(6, 8), labels, relaxed_codes(3, 8))


def test_registry_builds_the_losses_with_bits_from_the_embedding_dim():
    loss = build_loss("tie_aware_ap", embedding_dim=24, form="midpoint", num_bins=12)
    assert isinstance(loss, TieAwareAPLoss) and loss.bits == 24 and loss.delta == 2.0
    assert isinstance(build_loss("tie_aware_ndcg", embedding_dim=12), TieAwareNDCGLoss)
    assert isinstance(build_loss("dpsh", eta=0.5), DPSHLoss)


# -- DPSH ------------------------------------------------------------------------------------------


def test_dpsh_is_the_pair_likelihood_plus_quantization():
    codes = relaxed_codes(7, 5, seed=9)
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 0])
    value = DPSHLoss(eta=0.3)(codes, labels).item()
    total, pairs = 0.0, 0
    for i in range(7):
        for j in range(7):
            if i != j:
                theta = float(codes[i] @ codes[j]) / 2
                s = float(labels[i] == labels[j])
                total += math.log1p(math.exp(theta)) - s * theta
                pairs += 1
    quant = float(((torch.sign(codes) - codes) ** 2).mean())
    assert value == pytest.approx(total / pairs + 0.3 * quant, abs=1e-12)
    codes.requires_grad_()
    assert torch.autograd.gradcheck(lambda a: DPSHLoss()(a, labels), (codes,))


def test_dpsh_multi_hot_similarity_and_validation():
    hot = torch.tensor([[1, 0], [1, 1], [0, 1], [0, 0]], dtype=torch.bool)
    codes = relaxed_codes(4, 3)
    loss = DPSHLoss()
    loss(codes, hot)
    assert loss.last_stats["n_similar_pairs"] == 4  # (0,1), (1,2) both ways
    with pytest.raises(ValueError, match="`eta`"):
        DPSHLoss(eta=-1)
    with pytest.raises(ValueError, match="no pair"):
        loss(codes[:1], hot[:1])
    assert F.softplus(torch.tensor(1000.0)).isfinite()  # the stable form never overflows


@pytest.mark.parametrize("bad", [2, -1])
@pytest.mark.parametrize("make_loss", [TieAwareAPLoss, TieAwareNDCGLoss, lambda bits: DPSHLoss()])
def test_integer_multi_hot_labels_must_be_zero_one_as_for_the_metrics(make_loss, bad):
    """An integer multi-hot matrix was cast to bool unchecked (2 -> 1, -1 -> has the label),
    while hamming_retrieval_metrics rejects it: both now apply the same rule."""
    hot = torch.tensor([[1, 0], [1, 1], [0, 1], [0, 1], [1, 0], [0, 1]])
    wrong = hot.clone()
    wrong[0, 1] = bad
    codes = relaxed_codes(6, 4)
    loss = make_loss(4)
    loss(codes, hot)  # 0 / 1 integers are fine
    with pytest.raises(ValueError, match="multi-hot `labels` must contain only 0 and 1"):
        loss(codes, wrong)
    with pytest.raises(ValueError, match="multi-hot `ref_labels` must contain only 0 and 1"):
        loss(codes, hot, codes, wrong)
    with pytest.raises(ValueError, match="multi-hot `query_labels` must contain only 0 and 1"):
        hamming_retrieval_metrics(torch.sign(codes), wrong)
