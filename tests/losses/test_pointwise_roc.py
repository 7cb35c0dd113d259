"""PointwiseROCLoss (Vogel et al., ICML 2018, problem (1) with the Lagrangian of Eq. (2)): the value
against a loop over the pairs i < j of Eq. (4)/(5), gradcheck in float64, the projected dual
ascent on the multiplier buffer (train vs eval, validate-then-mutate), the bounds of the softplus
surrogate, from_labels / the registry, and a small training problem where the constraint binds."""

from __future__ import annotations

import math

import pytest
import torch

from rankwise.losses import PointwiseROCLoss, build_loss
from rankwise.losses.pointwise_roc import surrogate_risks

LABELS = [0, 0, 1, 1, 1, 2, 0, 2, 3]


def batch(n=9, d=5, dtype=torch.float64, seed=0, labels=None):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)
    return emb, torch.tensor(labels if labels is not None else LABELS[:n])


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def softplus(x):
    return math.log1p(math.exp(x))


def loop_loss(
    emb, labels, alpha, threshold, temperature, lam, surrogate, ref=None, ref_labels=None
):
    """−(R̃⁺ − λ(R̃⁻ − α)) with the pairs i < j of Eq. (4)/(5) (or all anchor-reference pairs)."""
    e = emb.detach().double().tolist()
    r = ref.detach().double().tolist() if ref is not None else e
    rl = ref_labels.tolist() if ref is not None else labels.tolist()
    lab = labels.tolist()

    def cos(a, b):
        dot = sum(x * y for x, y in zip(a, b, strict=True))
        return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    pos, neg = [], []
    for i in range(len(e)):
        for j in range(len(r)):
            if ref is None and j <= i:
                continue
            u = (cos(e[i], r[j]) - threshold) / temperature
            (pos if lab[i] == rl[j] else neg).append(u)
    if surrogate == "sigmoid":
        tpr = sum(sigmoid(u) for u in pos) / len(pos)
        fpr = sum(sigmoid(u) for u in neg) / len(neg)
    else:
        tpr = sum(1 - softplus(1 - u) / softplus(1) for u in pos) / len(pos)
        fpr = sum(softplus(1 + u) / softplus(1) for u in neg) / len(neg)
    return -(tpr - lam * (fpr - alpha)), len(pos), len(neg)


@pytest.mark.parametrize("surrogate", ["sigmoid", "softplus"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_value_matches_the_pair_loop(surrogate, dtype):
    emb, labels = batch(dtype=dtype)
    loss = PointwiseROCLoss(alpha=0.1, threshold=0.2, temperature=0.3, surrogate=surrogate)
    loss.eval()
    value = loss(emb, labels)
    expected, n_pos, n_neg = loop_loss(emb, labels, 0.1, 0.2, 0.3, 1.0, surrogate)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert value.dtype == dtype
    assert float(value) == pytest.approx(expected, abs=tol)
    assert loss.last_stats["n_positive_pairs"] == n_pos == 7
    assert loss.last_stats["n_negative_pairs"] == n_neg == 29


def test_value_with_a_reference_set_matches_the_pair_loop():
    emb, labels = batch(n=4)
    ref, ref_labels = batch(n=7, seed=1, labels=[0, 1, 2, 0, 1, 3, 3])
    loss = PointwiseROCLoss(alpha=0.2, threshold=0.0, temperature=0.5).eval()
    value = loss(emb, labels, ref, ref_labels)
    expected, _, _ = loop_loss(emb, labels, 0.2, 0.0, 0.5, 1.0, "sigmoid", ref, ref_labels)
    assert float(value) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("surrogate", ["sigmoid", "softplus"])
def test_gradcheck_float64(surrogate):
    emb, labels = batch()
    emb.requires_grad_(True)
    loss = PointwiseROCLoss(alpha=0.1, threshold=0.1, temperature=0.4, surrogate=surrogate).eval()
    assert torch.autograd.gradcheck(lambda e: loss(e, labels), (emb,))


def test_dual_ascent_step_in_training_mode_only():
    emb, labels = batch()
    loss = PointwiseROCLoss(alpha=0.05, threshold=0.0, dual_lr=0.5, initial_multiplier=1.0)
    value = loss(emb, labels)
    fpr = loss.last_stats["fpr"]
    assert loss.last_stats["multiplier"] == 1.0  # the call used λ from before its step
    assert float(loss.multiplier) == pytest.approx(max(0.0, 1.0 + 0.5 * (fpr - 0.05)))
    assert int(loss.n_dual_steps) == 1
    expected, _, _ = loop_loss(emb, labels, 0.05, 0.0, 0.05, 1.0, "sigmoid")
    assert float(value) == pytest.approx(expected, abs=1e-12)
    loss.eval()
    before = float(loss.multiplier)
    loss(emb, labels)
    assert float(loss.multiplier) == before and int(loss.n_dual_steps) == 1


def test_multiplier_is_projected_onto_non_negative_values_and_surrogate_update():
    emb, labels = batch()
    # a threshold no pair reaches: FPR 0 < α, λ decreases to 0 and stays there
    loss = PointwiseROCLoss(alpha=0.5, threshold=0.99, dual_lr=10.0, initial_multiplier=1.0)
    loss(emb, labels)
    assert float(loss.multiplier) == 0.0
    surrogate = PointwiseROCLoss(alpha=0.05, threshold=0.0, dual_update="surrogate")
    surrogate(emb, labels)
    step = surrogate.last_stats["negative_risk"] - 0.05
    assert float(surrogate.multiplier) == pytest.approx(1.0 + 0.5 * step)


def test_a_call_that_raises_changes_no_buffer():
    emb, labels = batch()
    loss = PointwiseROCLoss()
    loss(emb, labels)
    state = {k: v.clone() for k, v in loss.state_dict().items()}
    bad = emb.clone()
    bad[0, 0] = float("nan")
    # refused on the device: NaN returned, λ kept, the error raised when last_stats is read
    with pytest.raises(ValueError, match="NaN"):
        assert torch.isnan(loss(bad, labels))
        dict(loss.last_stats)
    with pytest.raises(ValueError, match="no anchor"):
        loss(emb[:3], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="length"):
        loss(emb, labels[:-1])
    for key, value in loss.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_state_dict_round_trip_and_device_move():
    emb, labels = batch()
    loss = PointwiseROCLoss(dual_lr=0.3)
    for _ in range(3):
        loss(emb, labels)
    restored = PointwiseROCLoss(dual_lr=0.3)
    restored.load_state_dict(loss.state_dict())
    assert float(restored.multiplier) == float(loss.multiplier)
    assert int(restored.n_dual_steps) == 3
    assert set(loss.state_dict()) == {"multiplier", "n_dual_steps"}


def test_softplus_surrogates_bound_the_indicator_rates():
    u = torch.linspace(-6, 6, 241, dtype=torch.float64)
    for shift in (-2.0, 0.0, 1.5):
        pos, neg = u + shift, u - shift
        tpr, fpr = surrogate_risks(pos, neg, "softplus")
        assert float(tpr) <= float((pos >= 0).double().mean()) + 1e-12
        assert float(fpr) >= float((neg >= 0).double().mean()) - 1e-12


@pytest.mark.parametrize("surrogate", ["sigmoid", "softplus"])
def test_weighted_negative_surrogate_counts_whole_weights_as_repeated_pairs(surrogate):
    """A weighted sample of negative pairs (tuples: n_k n_l / n⁻) enters R̃⁻ with its weights."""
    g = torch.Generator().manual_seed(0)
    pos, neg = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(5, generator=g)
    neg = neg.double()
    counts = torch.tensor([3, 1, 4, 1, 5])
    repeated = surrogate_risks(pos, neg.repeat_interleave(counts), surrogate)
    for weight in (counts, counts / counts.sum()):
        weighted = surrogate_risks(pos, neg, surrogate, neg_weight=weight)
        torch.testing.assert_close(weighted[0], repeated[0])
        torch.testing.assert_close(weighted[1], repeated[1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"alpha": 0.0}, r"`alpha` must be a finite number in \(0, 1\)"),
        ({"alpha": 1.0}, r"`alpha` must be a finite number in \(0, 1\)"),
        ({"alpha": float("nan")}, "`alpha`"),
        ({"alpha": True}, "`alpha`"),
        ({"threshold": 1.0}, r"`threshold` must lie in \(-1, 1\)"),
        ({"temperature": 0.0}, "`temperature` must be a finite number > 0"),
        ({"surrogate": "hinge"}, "`surrogate` must be one of"),
        ({"dual_lr": -1.0}, "`dual_lr`"),
        ({"initial_multiplier": -0.1}, "`initial_multiplier`"),
        ({"dual_update": "x"}, "`dual_update` must be one of"),
        ({"similarity": "l1"}, "`similarity`"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PointwiseROCLoss(**kwargs)


def test_threshold_outside_the_cosine_range_is_allowed_for_dot():
    assert PointwiseROCLoss(threshold=3.0, similarity="dot").threshold == 3.0


def test_from_labels_and_the_registry():
    loss = PointwiseROCLoss.from_labels(torch.tensor([0, 0, 1, 2]), alpha=0.1)
    assert loss.alpha == 0.1
    with pytest.raises(ValueError, match="single class"):
        PointwiseROCLoss.from_labels([1, 1, 1])
    with pytest.raises(ValueError, match="no class with two samples"):
        PointwiseROCLoss.from_labels([0, 1, 2])
    with pytest.raises(ValueError, match="1-D"):
        PointwiseROCLoss.from_labels([[0, 1]])
    built = build_loss("pointwise_roc", train_labels=[0, 0, 1, 1], alpha=0.02, surrogate="softplus")
    assert isinstance(built, PointwiseROCLoss) and built.surrogate == "softplus"
    with pytest.raises(ValueError, match="single class"):
        build_loss("pointwise_roc", train_labels=[0, 0, 0])
    with pytest.raises(ValueError, match="unknown parameter 'tau'"):
        build_loss("pointwise_roc", train_labels=[0, 0, 1, 1], tau=0.1)


def train_toy_embedding(dual_lr, initial_multiplier, steps=400):
    """A linear map R² → R³ (then L2-normalized) of 4 Gaussian classes, trained with the loss."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)

    def data(n):
        labels = torch.randint(0, 4, (n,), generator=g)
        angles = labels.double() * (math.pi / 2)
        centers = torch.stack([torch.cos(angles), torch.sin(angles)], 1)
        return centers + 0.3 * torch.randn(n, 2, generator=g, dtype=torch.float64), labels

    X, y = data(2000)
    X_test, y_test = data(1500)
    model = torch.nn.Linear(2, 3).double()
    loss = PointwiseROCLoss(
        alpha=0.1,
        threshold=0.5,
        temperature=0.1,
        dual_lr=dual_lr,
        initial_multiplier=initial_multiplier,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(steps):
        rows = torch.randint(0, 2000, (64,), generator=g)
        value = loss(model(X[rows]), y[rows])
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    with torch.no_grad():
        emb = torch.nn.functional.normalize(model(X_test), dim=1)
    i, j = torch.triu_indices(1500, 1500, 1)
    scores = (emb[i] * emb[j]).sum(1)
    negatives = y_test[i] != y_test[j]
    fpr = float((scores[negatives] >= 0.5).double().mean())
    tpr = float((scores[~negatives] >= 0.5).double().mean())
    return fpr, tpr, loss


def test_dual_ascent_holds_the_held_out_fpr_near_alpha():
    """Maximizing the TPR alone (λ = 0) accepts every pair (FPR 1); with the dual ascent the FPR at
    the threshold on held-out pairs ends close to α = 0.1, with a high TPR."""
    fpr, tpr, loss = train_toy_embedding(dual_lr=0.2, initial_multiplier=1.0)
    assert abs(fpr - 0.1) < 0.03
    assert tpr > 0.9
    assert int(loss.n_dual_steps) == 400
    unconstrained_fpr, _, _ = train_toy_embedding(dual_lr=0.0, initial_multiplier=0.0, steps=100)
    assert unconstrained_fpr > 0.5


def test_rankwise_train_with_loss_pointwise_roc(tmp_path):
    # `loss: pointwise_roc` in a training config: the multiplier is trained by the dual steps and
    # travels in the checkpoint (a registered buffer)
    import yaml
    from typer.testing import CliRunner

    from rankwise.cli import app

    config = {
        "dataset": {"name": "digits"},
        "model": {"backbone": "small_cnn", "embedding_dim": 16},
        "loss": {"name": "pointwise_roc", "params": {"alpha": 0.1}},
        "sampler": {"m": 4, "batch_size": 20},
        "optimizer": {"name": "adam", "lr": 1e-3},
        "budget": {"iterations": 4},
        "eval_every": 2,
        "threads": 1,
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    result = CliRunner().invoke(
        app, ["train", "--config", str(tmp_path / "config.yaml"), "--output", str(out)]
    )
    assert result.exit_code == 0, result.output
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)["loss"]
    assert int(state["n_dual_steps"]) == 4
    assert float(state["multiplier"]) >= 0 and float(state["multiplier"]) != 1.0  # λ₀ = 1 moved
