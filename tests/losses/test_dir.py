"""DIRLoss (Revaud et al., ICCV 2019, Eq. 5-8) against a loop re-derivation of the quantized AP,
against scikit-learn's exact AP, and with gradcheck."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import average_precision_score

from rankwise.losses.dir import DIRLoss, quantized_average_precision


def loop_quantized_ap(scores, positive, ranked, num_bins, lo, hi):
    """AP_Q of one anchor, written from the paper's formulas with plain Python loops.

    scores: list of floats; positive / ranked: lists of bools (ranked = counted at all)."""
    centres = [hi - m * (hi - lo) / (num_bins - 1) for m in range(num_bins)]
    width = (hi - lo) / (num_bins - 1)

    def kernel(s, m):
        if m == 0 and s >= centres[0]:
            return 1.0
        if m == num_bins - 1 and s <= centres[-1]:
            return 1.0
        return max(0.0, 1.0 - abs(s - centres[m]) / width)

    n_pos = sum(1 for p, r in zip(positive, ranked, strict=True) if p and r)
    items = list(zip(scores, positive, ranked, strict=True))
    pos_hist = [sum(kernel(s, m) for s, p, r in items if p and r) for m in range(num_bins)]
    all_hist = [sum(kernel(s, m) for s, _, r in items if r) for m in range(num_bins)]
    ap = 0.0
    for m in range(num_bins):
        cum_pos = sum(pos_hist[: m + 1])
        cum_all = sum(all_hist[: m + 1])
        if cum_all > 0:
            ap += cum_pos / cum_all * pos_hist[m] / n_pos
    return ap


def loop_dir_loss(
    emb, labels, ref=None, ref_labels=None, num_bins=20, lo=-1.0, hi=1.0, similarity="cosine"
):
    self_ref = ref is None
    if self_ref:
        ref, ref_labels = emb, labels
    if similarity == "cosine":
        s = (F.normalize(emb, dim=1) @ F.normalize(ref, dim=1).T).tolist()
    else:
        s = (emb @ ref.T).tolist()
    aps, skipped = [], 0
    for i in range(len(labels)):
        ranked = [not (self_ref and j == i) for j in range(len(ref_labels))]
        positive = [
            int(ref_labels[j]) == int(labels[i]) and ranked[j] for j in range(len(ref_labels))
        ]
        negative = [int(ref_labels[j]) != int(labels[i]) for j in range(len(ref_labels))]
        if not any(positive) or not any(negative):
            skipped += 1
            continue
        aps.append(loop_quantized_ap(s[i], positive, ranked, num_bins, lo, hi))
    return 1 - sum(aps) / len(aps), skipped


def test_matches_loop_rederivation_with_uneven_classes_and_skipped_anchor():
    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 3, 4])  # 3 and 4 are singletons
    emb = torch.randn(len(labels), 6, generator=g, dtype=torch.float64)
    loss = DIRLoss(num_bins=20)
    value = loss(emb, labels)
    expected, skipped = loop_dir_loss(emb, labels)
    assert value.item() == pytest.approx(expected, abs=1e-12)
    assert skipped == 2
    assert loss.last_stats["n_skipped_no_positive"] == 2
    assert loss.last_stats["n_anchors_used"] == 10
    assert loss.last_stats["mean_ap_q"] == pytest.approx(1 - expected, abs=1e-12)


def test_matches_loop_with_reference_set_few_bins_and_out_of_range_dot_scores():
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(5, 4, generator=g, dtype=torch.float64)
    ref = torch.randn(9, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1, 2, 0, 1])
    ref_labels = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 0])
    # Dot products reach beyond [-1, 1]: the end bins must absorb them.
    loss = DIRLoss(num_bins=5, similarity="dot")
    value = loss(emb, labels, ref, ref_labels)
    expected, _ = loop_dir_loss(emb, labels, ref, ref_labels, num_bins=5, similarity="dot")
    assert value.item() == pytest.approx(expected, abs=1e-12)
    assert (emb @ ref.T).abs().max() > 1  # the test does exercise out-of-range scores


def test_scores_on_bin_centres_give_exact_average_precision():
    num_bins = 41
    centres = torch.linspace(1, -1, num_bins, dtype=torch.float64)
    rng = np.random.default_rng(2)
    scores = torch.stack([centres[rng.permutation(num_bins)[:25]] for _ in range(4)])
    pos = torch.from_numpy(rng.random((4, 25)) < 0.3)
    pos[:, 0] = True
    pos[:, 1] = False
    ap_q = quantized_average_precision(scores, pos, ~pos, num_bins, (-1.0, 1.0))
    for row in range(4):
        exact = average_precision_score(pos[row].numpy(), scores[row].numpy())
        assert ap_q[row].item() == pytest.approx(exact, abs=1e-12)


def test_many_bins_approach_exact_average_precision_from_below():
    rng = np.random.default_rng(3)
    # Well separated: 30 distinct scores at least 0.05 apart, bins 0.004 wide.
    grid = np.linspace(-0.95, 0.95, 39)
    gaps = []
    for _ in range(10):
        s = np.sort(rng.choice(grid, 30, replace=False)) + rng.uniform(-0.01, 0.01, 30)
        pos = rng.random(30) < 0.4
        pos[0], pos[1] = True, False
        exact = average_precision_score(pos, s)
        ap_q = quantized_average_precision(
            torch.from_numpy(s)[None],
            torch.from_numpy(pos)[None],
            torch.from_numpy(~pos)[None],
            num_bins=501,
        ).item()
        # Splitting one item over two bins can only lower its precision (Eq. 6 mixes in the
        # precision just above the item), and by less than 1/4 / (items above + 1) per positive.
        assert ap_q <= exact + 1e-12
        gaps.append(exact - ap_q)
    assert max(gaps) < 0.05
    assert np.mean(gaps) < 0.02


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(4)
    emb = torch.randn(8, 3, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    assert torch.autograd.gradcheck(lambda e: DIRLoss(num_bins=10)(e, labels), (emb,))
    ref = torch.randn(6, 3, generator=g, dtype=torch.float64, requires_grad=True)
    ref_labels = torch.tensor([0, 1, 2, 0, 1, 3])
    assert torch.autograd.gradcheck(lambda e, r: DIRLoss()(e, labels, r, ref_labels), (emb, ref))


def test_device_and_dtype_follow_input(device):
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(12, 5, generator=g)
    labels = torch.arange(12) % 3
    cpu_value = DIRLoss()(emb, labels)
    emb_d = emb.to(device).requires_grad_(True)
    value = DIRLoss()(emb_d, labels.to(device))
    value.backward()
    assert value.device.type == device.type and value.dtype == torch.float32
    assert emb_d.grad is not None and torch.isfinite(emb_d.grad).all()
    assert value.item() == pytest.approx(cpu_value.item(), abs=1e-5)


def test_perfect_and_inverted_rankings():
    # Two tight, opposite clusters: every positive outranks every negative -> AP_Q = 1.
    emb = torch.tensor(
        [[1.0, 0.0], [1.0, 0.01], [1.0, -0.01], [-1.0, 0.0], [-1.0, 0.01], [-1.0, -0.01]],
        dtype=torch.float64,
    )
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    assert DIRLoss()(emb, labels).item() == pytest.approx(0.0, abs=1e-12)
    assert DIRLoss()(emb, torch.tensor([0, 1, 2, 0, 1, 2])).item() > 0.5


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_bins"):
        DIRLoss(num_bins=1)
    with pytest.raises(ValueError, match="score_range"):
        DIRLoss(score_range=(1.0, -1.0))
    with pytest.raises(ValueError, match="similarity"):
        DIRLoss(similarity="manhattan")
    with pytest.raises(ValueError, match="no anchor"):
        DIRLoss()(torch.randn(4, 3), torch.tensor([0, 1, 2, 3]))


def dense_histograms(scores, mask, num_bins, score_range):
    """The (B, num_bins, M) form of P_m / N_m the sparse histograms replace."""
    from rankwise.losses.dir import triangular_bin_weights

    return (triangular_bin_weights(scores, num_bins, score_range) * mask[:, None]).sum(-1)


@pytest.mark.parametrize(
    "num_bins,score_range", [(20, (-1.0, 1.0)), (2, (-1.0, 1.0)), (7, (-0.5, 0.3)), (9, (-4, 4))]
)
def test_sparse_histograms_equal_the_dense_kernel_values_and_gradients(num_bins, score_range):
    """Issue 14 §6: O(B·M) histograms instead of the (B, num_bins, M) block, the same values and
    gradients up to rounding, also for scores on bin centres and knots (the integer dot scores of
    binary codes) and beyond the range."""
    from rankwise.losses.dir import _bin_histograms

    g = torch.Generator().manual_seed(num_bins)
    lo, hi = score_range
    centres = torch.linspace(hi, lo, num_bins, dtype=torch.float64)
    s = torch.cat(
        [
            torch.rand(40, 30, generator=g, dtype=torch.float64) * (hi - lo) * 1.4 + lo * 1.2,
            centres.expand(40, -1),  # on every centre
            torch.full((40, 2), hi + 0.5, dtype=torch.float64),  # beyond both ends
            torch.full((40, 2), lo - 0.5, dtype=torch.float64),
        ],
        dim=1,
    )
    mask = (torch.rand(s.shape, generator=g) > 0.3).double()
    weights = torch.randn(40, num_bins, generator=g, dtype=torch.float64)
    dense_in, sparse_in = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
    dense = dense_histograms(dense_in, mask, num_bins, score_range)
    (sparse,) = _bin_histograms(sparse_in, (mask,), num_bins, score_range)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=1e-13)
    (dense * weights).sum().backward()
    (sparse * weights).sum().backward()
    # the backward pass applies −sign(s − b)/Δ in one step: equal up to rounding
    torch.testing.assert_close(sparse_in.grad, dense_in.grad, rtol=1e-13, atol=1e-12)
    assert torch.equal(sparse_in.grad == 0, dense_in.grad == 0)  # same zero pattern (knots)


def test_dir_loss_equals_the_dense_form_and_keeps_no_cubic_block():
    """The loss and gradient of DIRLoss equal AP_Q computed from the dense (B, bins, M) weights;
    the largest tensor autograd keeps is the two (B, M) masks, not a (B, bins, M) block."""
    from rankwise.losses.dir import triangular_bin_weights

    g = torch.Generator().manual_seed(0)
    labels = torch.arange(8).repeat_interleave(4)
    emb = torch.randn(32, 6, generator=g, dtype=torch.float64)

    def dense_loss(e):
        s = F.normalize(e, dim=1) @ F.normalize(e, dim=1).T
        pos = (labels[:, None] == labels[None, :]).fill_diagonal_(False)
        ranked = ~torch.eye(32, dtype=torch.bool)
        w = triangular_bin_weights(s, 20, (-1.0, 1.0))
        p_m = (w * pos.double()[:, None]).sum(-1)
        n_m = (w * ranked.double()[:, None]).sum(-1)
        precision = p_m.cumsum(-1) / n_m.cumsum(-1).clamp_min(1e-300)
        return 1 - ((precision * p_m / pos.sum(1, keepdim=True)).sum(-1)).mean()

    a, b = emb.clone().requires_grad_(True), emb.clone().requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = DIRLoss()(a, labels)
    expected = dense_loss(b)
    assert float(value.detach()) == pytest.approx(float(expected.detach()), abs=1e-13)
    value.backward()
    expected.backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-13)
    assert max(saved) <= 2 * 32 * 32
