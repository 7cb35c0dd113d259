"""Backbones, embedding head / model, frozen batch normalization."""

import numpy as np
import pytest
import torch
from torch import nn

from rankwise.models import (
    EmbeddingHead,
    EmbeddingModel,
    FrozenBatchNorm,
    MLPBackbone,
    SmallCNN,
    freeze_batchnorm,
)


@pytest.mark.parametrize("size", [8, 28, 32])
def test_small_cnn_shapes(size, device):
    net = SmallCNN(in_channels=1, input_size=size, width=4).to(device)
    out = net(torch.rand(3, 1, size, size, device=device))
    assert out.shape == (3, net.out_features) == (3, 32)
    assert out.device.type == device.type


def test_small_cnn_rejects_wrong_channels():
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        SmallCNN(in_channels=3, input_size=8)(torch.rand(2, 1, 8, 8))
    with pytest.raises(ValueError, match="input_size"):
        SmallCNN(input_size=3)


def test_mlp_backbone_flattens_and_checks():
    net = MLPBackbone(64, hidden=(16, 5), dropout=0.1)
    assert net(torch.rand(4, 1, 8, 8)).shape == (4, 5) and net.out_features == 5
    assert MLPBackbone(6, hidden=()).out_features == 6
    with pytest.raises(ValueError, match="64 features"):
        net(torch.rand(4, 10))


def test_embedding_head_matches_linear_then_normalize():
    torch.manual_seed(0)
    head = EmbeddingHead(10, 3)
    feats = torch.randn(5, 10)
    out = head(feats)
    z = feats @ head.linear.weight.T + head.linear.bias
    expected = z / torch.sqrt((z**2).sum(dim=1, keepdim=True))
    torch.testing.assert_close(out, expected)
    raw = EmbeddingHead(10, 3, normalize=False)
    assert not torch.allclose(raw(feats).norm(dim=1), torch.ones(5))


def test_embedding_model_unit_norm_and_gradients(device):
    model = EmbeddingModel(SmallCNN(1, 8, width=4), EmbeddingHead(32, 6)).to(device)
    out = model(torch.rand(7, 1, 8, 8, device=device))
    assert out.shape == (7, 6) and model.embedding_dim == 6
    torch.testing.assert_close(out.norm(dim=1), torch.ones(7, device=device))
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def _bn_with_stats():
    torch.manual_seed(1)
    bn = nn.BatchNorm2d(3)
    bn.train()
    for _ in range(5):  # give it non-trivial running statistics
        bn(torch.randn(8, 3, 4, 4) * 3 + 2)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    return bn


def test_frozen_batchnorm_equals_formula_and_stays_frozen_in_train():
    bn = _bn_with_stats()
    mean, var = bn.running_mean.clone(), bn.running_var.clone()
    net = nn.Sequential(nn.Conv2d(3, 3, 1), bn, nn.ReLU())
    net = freeze_batchnorm(net)
    frozen = net[1]
    assert isinstance(frozen, FrozenBatchNorm)
    net.train()
    x = torch.randn(6, 3, 4, 4)
    y = frozen(x)
    # Direct re-derivation: (x - mean) / sqrt(var + eps) * weight + bias per channel.
    w = torch.tensor([0.5, 2.0, -1.0]).view(1, 3, 1, 1)
    b = torch.tensor([0.1, -0.2, 0.3]).view(1, 3, 1, 1)
    expected = (x - mean.view(1, 3, 1, 1)) / torch.sqrt(var.view(1, 3, 1, 1) + bn.eps) * w + b
    torch.testing.assert_close(y, expected)
    net(x * 5 + 1)  # a training-mode forward must not move the statistics
    torch.testing.assert_close(frozen.running_mean, mean)
    torch.testing.assert_close(frozen.running_var, var)
    # Frozen BN has no trainable parameters by default; the conv still trains.
    assert [n for n, _ in net.named_parameters()] == ["0.weight", "0.bias"]
    assert "1.running_mean" in net.state_dict()


def test_freeze_batchnorm_trainable_affine_and_1d():
    bn1d = nn.BatchNorm1d(4)
    frozen = freeze_batchnorm(bn1d, trainable_affine=True)
    assert isinstance(frozen, FrozenBatchNorm)
    assert {n for n, _ in frozen.named_parameters()} == {"weight", "bias"}
    x = torch.randn(5, 4)
    bn1d.eval()
    torch.testing.assert_close(frozen(x), bn1d(x))


def test_frozen_batchnorm_matches_eval_mode_batchnorm_double():
    bn = _bn_with_stats().double().eval()
    frozen = FrozenBatchNorm.from_batchnorm(bn)
    assert frozen.running_mean.dtype == torch.float64
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    np.testing.assert_allclose(frozen(x).numpy(), bn(x).detach().numpy(), rtol=1e-12, atol=1e-12)
