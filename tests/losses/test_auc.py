"""Tests of the AUC loss and the Wilcoxon loss (Gajić et al., Eq. 7–11, Table 1) against direct
re-derivations of the paper's formulas written with explicit Python loops, scikit-learn's ROC AUC,
and numerical gradients."""

from __future__ import annotations

import math

import pytest
import torch
from sklearn.metrics import roc_auc_score

from rankwise.losses import AUCLoss, WilcoxonLoss, auc_slope
from rankwise.losses.auc import auc_thresholds

UNEVEN_LABELS = [3, 0, 1, 0, 3, 2, 1, 0, 3, 5, 1, 3]  # class 2 and 5 are singletons: skipped


# ---------------------------------------------------------------------------------------------
# independent references (plain Python loops over the paper's formulas)
# ---------------------------------------------------------------------------------------------
def loop_cosine(queries, refs):
    q = queries.detach().cpu().double().tolist()
    r = refs.detach().cpu().double().tolist()
    out = []
    for a in q:
        row = []
        na = math.sqrt(sum(v * v for v in a))
        for b in r:
            nb = math.sqrt(sum(v * v for v in b))
            row.append(sum(x * y for x, y in zip(a, b, strict=True)) / (na * nb))
        out.append(row)
    return out


def loop_score_sets(emb, labels, strategy, ref_emb=None, ref_labels=None):
    """Positive and negative score lists exactly as Sec. 3.3 and the loss docstring define them."""
    self_ref = ref_emb is None
    if self_ref:
        ref_emb, ref_labels = emb, labels
    s = loop_cosine(emb, ref_emb)
    n, m = len(labels), len(ref_labels)

    def is_pair(i, j):
        return not (self_ref and i == j)

    valid = []
    for i in range(n):
        has_pos = any(labels[i] == ref_labels[j] and is_pair(i, j) for j in range(m))
        has_neg = any(labels[i] != ref_labels[j] for j in range(m))
        valid.append(has_pos and has_neg)
    pos, neg = [], []
    if strategy == "hard":
        for i in range(n):
            if not valid[i]:
                continue
            pos.append(
                min(s[i][j] for j in range(m) if labels[i] == ref_labels[j] and is_pair(i, j))
            )
            neg.append(max(s[i][j] for j in range(m) if labels[i] != ref_labels[j]))
    elif self_ref:
        for i in range(n):
            for j in range(i + 1, n):
                if valid[i] or valid[j]:
                    (pos if labels[i] == labels[j] else neg).append(s[i][j])
    else:
        for i in range(n):
            if valid[i]:
                for j in range(m):
                    (pos if labels[i] == ref_labels[j] else neg).append(s[i][j])
    return pos, neg, valid


def loop_auc_loss(pos, neg, delta_s, slope, t_min=-1.0, t_max=1.0):
    n_steps = round((t_max - t_min) / delta_s)
    thresholds = [t_min + k * delta_s for k in range(n_steps + 1)]

    def sigma(x, t):
        return 1.0 / (1.0 + math.exp(-slope * (x - t)))

    tpr = [sum(sigma(x, t) for x in pos) / len(pos) for t in thresholds]
    fpr = [sum(sigma(x, t) for x in neg) / len(neg) for t in thresholds]
    area = 0.0
    for k in range(n_steps):
        area += 0.5 * (tpr[k] + tpr[k + 1]) * (fpr[k] - fpr[k + 1])
    return 1.0 - area


def loop_wilcoxon_loss(pos, neg, slope):
    total = 0.0
    for p in pos:
        for q in neg:
            total += 1.0 / (1.0 + math.exp(-slope * (p - q)))
    return 1.0 - total / (len(pos) * len(neg))


def random_batch(n=12, d=4, dtype=torch.float64, device="cpu", seed=0, labels=None):
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(n, d, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    lab = torch.tensor(labels if labels is not None else UNEVEN_LABELS[:n], device=device)
    return emb, lab


# ---------------------------------------------------------------------------------------------
# slope of Eq. (10), threshold grid
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("delta_s, table_r", [(0.05, 42.2), (0.1, 22.47), (0.2, 12.02)])
def test_auc_slope_reproduces_table_1(delta_s, table_r):
    assert auc_slope(delta_s) == pytest.approx(table_r, rel=0.01)


def test_auc_slope_is_cached():
    auc_slope.cache_clear()
    first = auc_slope(0.1)
    misses = auc_slope.cache_info().misses
    second = auc_slope(0.1, score_range=[-1, 1])  # a list is accepted and hits the same entry
    info = auc_slope.cache_info()
    assert first == second
    assert info.misses == misses and info.hits >= 1


def test_auc_slope_depends_only_on_step_count():
    # Eq. (10) is invariant to an affine change of the score axis: 20 steps of 0.05 on [0, 1]
    # give twice the slope of 20 steps of 0.1 on [-1, 1].
    assert auc_slope(0.05, (0.0, 1.0)) == pytest.approx(2 * auc_slope(0.1), rel=1e-4)


@pytest.mark.parametrize("delta_s", [0.0, -0.1, 2.0, 3.0, float("nan"), "a"])
def test_auc_slope_rejects_bad_delta_s(delta_s):
    with pytest.raises(ValueError, match="delta_s"):
        auc_slope(delta_s)


@pytest.mark.parametrize("score_range", [(1, -1), (0, 0), (0, float("inf")), (1,), "ab"])
def test_auc_slope_rejects_bad_score_range(score_range):
    with pytest.raises(ValueError, match="score_range"):
        auc_slope(0.05, score_range)


def test_threshold_grid_spans_the_range():
    grid = auc_thresholds(0.05)
    assert len(grid) == 41 and grid[0] == -1.0 and grid[-1] == pytest.approx(1.0)
    uneven = auc_thresholds(0.3)  # 2 / 0.3 is not an integer: the grid goes one step past t_max
    assert uneven[-2] < 1.0 <= uneven[-1] < 1.3


# ---------------------------------------------------------------------------------------------
# AUC loss against the loop reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["hard", "all"])
@pytest.mark.parametrize("delta_s, slope", [(0.05, None), (0.25, 7.5), (0.1, 60.0)])
def test_auc_loss_matches_loop_reference(device, strategy, delta_s, slope):
    emb, lab = random_batch(device=device)
    loss_fn = AUCLoss(delta_s=delta_s, slope=slope, strategy=strategy)
    got = loss_fn(emb, lab)
    pos, neg, valid = loop_score_sets(emb, lab.tolist(), strategy)
    r = auc_slope(delta_s) if slope is None else slope
    assert got.item() == pytest.approx(loop_auc_loss(pos, neg, delta_s, r), abs=1e-10)
    assert got.device.type == device.type and got.dtype == torch.float64
    stats = loss_fn.last_stats
    assert stats["n_skipped_no_positive"] == 2 and stats["n_anchors_used"] == sum(valid)
    assert stats["n_positive_scores"] == len(pos) and stats["n_negative_scores"] == len(neg)


@pytest.mark.parametrize("strategy", ["hard", "all"])
def test_auc_loss_with_reference_set_matches_loop_reference(device, strategy):
    emb, lab = random_batch(n=7, seed=1, labels=[0, 1, 2, 0, 1, 4, 2], device=device)
    ref, ref_lab = random_batch(n=9, seed=2, labels=[2, 0, 0, 1, 3, 1, 2, 3, 0], device=device)
    loss_fn = AUCLoss(delta_s=0.1, slope=20.0, strategy=strategy)
    got = loss_fn(emb, lab, ref, ref_lab)
    pos, neg, _ = loop_score_sets(emb, lab.tolist(), strategy, ref, ref_lab.tolist())
    assert got.item() == pytest.approx(loop_auc_loss(pos, neg, 0.1, 20.0), abs=1e-10)
    assert loss_fn.last_stats["n_skipped_no_positive"] == 1  # label 4 is not in the reference set


def test_auc_loss_approaches_exact_auc_of_the_pairs():
    # Batch all on well-spread scores, fine steps and a sharp sigmoid: 1 − loss ≈ empirical AUC.
    gen = torch.Generator().manual_seed(3)
    centers = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    lab = torch.arange(6).repeat_interleave(6)
    emb = centers[lab] + 0.9 * torch.randn(36, 8, generator=gen, dtype=torch.float64)
    loss_fn = AUCLoss(delta_s=0.01, slope=400.0, strategy="all")
    relaxed = 1.0 - loss_fn(emb, lab).item()
    pos, neg, _ = loop_score_sets(emb, lab.tolist(), "all")
    exact = roc_auc_score([1] * len(pos) + [0] * len(neg), pos + neg)
    assert 0.6 < exact < 0.98  # a non-trivial ranking
    assert relaxed == pytest.approx(exact, abs=5e-3)


def test_auc_loss_float32_agrees_with_float64(device):
    emb, lab = random_batch(device=device)
    for strategy in ("hard", "all"):
        loss_fn = AUCLoss(strategy=strategy)
        l64 = loss_fn(emb, lab)
        l32 = loss_fn(emb.float(), lab)
        assert l32.dtype == torch.float32
        assert l32.item() == pytest.approx(l64.item(), abs=1e-5)


@pytest.mark.parametrize(
    "loss_fn",
    [AUCLoss(strategy="hard"), AUCLoss(strategy="all"), WilcoxonLoss(slope=4.0)],
    ids=["hard", "all", "wilcoxon"],
)
def test_losses_are_invariant_to_batch_permutation(loss_fn):
    emb, lab = random_batch(seed=4)
    perm = torch.randperm(len(lab), generator=torch.Generator().manual_seed(5))
    assert loss_fn(emb[perm], lab[perm]).item() == pytest.approx(
        loss_fn(emb, lab).item(), abs=1e-12
    )


@pytest.mark.parametrize("strategy", ["hard", "all"])
@pytest.mark.parametrize("slope", [None, 9.0])
def test_auc_loss_gradcheck(strategy, slope):
    emb, lab = random_batch(n=10, d=3, seed=6)
    emb.requires_grad_(True)
    loss_fn = AUCLoss(delta_s=0.2, slope=slope, strategy=strategy)
    assert torch.autograd.gradcheck(lambda e: loss_fn(e, lab), (emb,))


def test_auc_loss_gradcheck_with_reference_set():
    emb, lab = random_batch(n=5, d=3, seed=7, labels=[0, 1, 2, 0, 1])
    ref, ref_lab = random_batch(n=6, d=3, seed=8, labels=[0, 1, 2, 2, 1, 0])
    emb.requires_grad_(True)
    ref.requires_grad_(True)
    loss_fn = AUCLoss(delta_s=0.1, strategy="all")
    assert torch.autograd.gradcheck(lambda e, r: loss_fn(e, lab, r, ref_lab), (emb, ref))


def test_auc_loss_gradient_moves_toward_better_ranking():
    emb, lab = random_batch(seed=9)
    emb.requires_grad_(True)
    loss_fn = AUCLoss(delta_s=0.1, strategy="all")
    before = loss_fn(emb, lab)
    before.backward()
    with torch.no_grad():
        after = loss_fn(emb - 0.05 * emb.grad, lab)
    assert after.item() < before.item()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"strategy": "semi"}, "strategy"),
        ({"slope": 0.0}, "slope"),
        ({"slope": -3}, "slope"),
        ({"delta_s": 2.5}, "delta_s"),
        ({"score_range": (2, 1)}, "score_range"),
        ({"similarity": "l1"}, "similarity"),
    ],
)
def test_auc_loss_rejects_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AUCLoss(**kwargs)


def test_auc_loss_raises_when_no_anchor_can_be_ranked():
    emb, _ = random_batch(n=4)
    with pytest.raises(ValueError, match="no anchor"):
        AUCLoss()(emb, torch.tensor([0, 1, 2, 3]))


def test_auc_loss_moves_with_module_dtype_and_has_no_hidden_state():
    loss_fn = AUCLoss().double()
    assert dict(loss_fn.state_dict()) == {}
    assert "slope=42.14" in repr(loss_fn)


# ---------------------------------------------------------------------------------------------
# Wilcoxon loss (Eq. 11)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("slope", [1.0, 5.0])
def test_wilcoxon_matches_loop_reference(device, slope):
    emb, lab = random_batch(device=device, seed=10)
    loss_fn = WilcoxonLoss(slope=slope)
    got = loss_fn(emb, lab)
    pos, neg, _ = loop_score_sets(emb, lab.tolist(), "hard")
    assert got.item() == pytest.approx(loop_wilcoxon_loss(pos, neg, slope), abs=1e-12)
    assert loss_fn.last_stats["n_skipped_no_positive"] == 2


def test_wilcoxon_with_reference_set_matches_loop_reference(device):
    emb, lab = random_batch(n=6, seed=11, labels=[0, 1, 2, 0, 1, 2], device=device)
    ref, ref_lab = random_batch(n=8, seed=12, labels=[2, 0, 0, 1, 3, 1, 2, 3], device=device)
    got = WilcoxonLoss(slope=3.0)(emb, lab, ref, ref_lab)
    pos, neg, _ = loop_score_sets(emb, lab.tolist(), "hard", ref, ref_lab.tolist())
    assert got.item() == pytest.approx(loop_wilcoxon_loss(pos, neg, 3.0), abs=1e-12)


def test_wilcoxon_gradcheck_and_float32():
    emb, lab = random_batch(n=10, d=3, seed=13)
    emb.requires_grad_(True)
    loss_fn = WilcoxonLoss(slope=6.0)
    assert torch.autograd.gradcheck(lambda e: loss_fn(e, lab), (emb,))
    assert loss_fn(emb.float(), lab).item() == pytest.approx(loss_fn(emb, lab).item(), abs=1e-6)


@pytest.mark.parametrize("slope", [0, -1.0, float("inf"), None])
def test_wilcoxon_rejects_bad_slope(slope):
    with pytest.raises(ValueError, match="slope"):
        WilcoxonLoss(slope=slope)


# ---------------------------------------------------------------------------------------------
# batch-all in chunks (issue 14 §6)
# ---------------------------------------------------------------------------------------------
def test_chunked_batch_all_equals_the_one_block_form(monkeypatch):
    """Above _BLOCK_ELEMENTS the (n_scores, K) sigmoid block is built chunk by chunk, forward and
    backward: the same value and gradient as the one-block form (up to the order of the sums)."""
    import rankwise.losses.auc as auc_module

    emb, lab = random_batch(n=24, d=5, seed=9, labels=[i % 6 for i in range(24)])
    results = []
    for block in (auc_module._BLOCK_ELEMENTS, 41 * 7):  # one block, then chunks of 7 scores
        monkeypatch.setattr(auc_module, "_BLOCK_ELEMENTS", block)
        e = emb.clone().requires_grad_(True)
        value = AUCLoss(strategy="all")(e, lab)
        value.backward()
        results.append((value.detach(), e.grad))
    (one_block, one_grad), (chunked, chunked_grad) = results
    assert float(chunked) == pytest.approx(float(one_block), abs=1e-14)
    torch.testing.assert_close(chunked_grad, one_grad, rtol=1e-12, atol=1e-15)


def test_chunked_batch_all_gradcheck(monkeypatch):
    import rankwise.losses.auc as auc_module

    monkeypatch.setattr(auc_module, "_BLOCK_ELEMENTS", 11 * 3)
    emb, lab = random_batch(n=10, d=3, seed=6)
    emb.requires_grad_(True)
    loss_fn = AUCLoss(delta_s=0.2, strategy="all")  # 11 thresholds: chunks of 3 scores
    assert torch.autograd.gradcheck(lambda e: loss_fn(e, lab), (emb,))
