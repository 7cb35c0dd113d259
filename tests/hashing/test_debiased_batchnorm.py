"""The hashing head's centring is debiased in eval mode (the TALR hash sweep's early collapse).

torch's ``BatchNorm1d`` running statistics start at mean 0 / variance 1 and keep
``(1 - momentum)^t`` of those values after ``t`` batches, so a head evaluated after two training
steps barely centred its activations and gave every digit the same code (the hash sweep's TALR run
stopped as "collapsed" at its first validation). These tests fail with the plain ``BatchNorm1d``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rankwise.hashing.head import DebiasedBatchNorm1d, HashingHead


def _train(norm: nn.Module, batches: list[torch.Tensor]) -> None:
    norm.train()
    for batch in batches:
        norm(batch)
    norm.eval()


def test_debiased_statistics_are_the_weighted_batch_statistics():
    torch.manual_seed(0)
    batches = [torch.randn(16, 3, dtype=torch.float64) * 2 + 5 for _ in range(3)]
    norm = DebiasedBatchNorm1d(3).double()
    _train(norm, batches)
    weights = torch.tensor([0.1 * 0.9**2, 0.1 * 0.9, 0.1], dtype=torch.float64)
    weights = weights / weights.sum()
    means = torch.stack([b.mean(0) for b in batches])
    variances = torch.stack([b.var(0, unbiased=True) for b in batches])
    mean, var = norm.debiased_running_stats()
    torch.testing.assert_close(mean, (weights[:, None] * means).sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(var, (weights[:, None] * variances).sum(0), rtol=1e-12, atol=1e-12)


def test_after_one_batch_eval_centres_on_that_batch():
    batch = torch.tensor([[1.0, 10.0], [3.0, 14.0]], dtype=torch.float64)
    norm = DebiasedBatchNorm1d(2).double()
    _train(norm, [batch])
    out = norm(batch.mean(0, keepdim=True))
    torch.testing.assert_close(out, torch.zeros(1, 2, dtype=torch.float64))


def test_untrained_norm_is_the_identity_up_to_eps():
    norm = DebiasedBatchNorm1d(4).eval()
    x = torch.randn(5, 4)
    torch.testing.assert_close(norm(x), x / (1 + 1e-5) ** 0.5)


def test_a_plain_batchnorm_checkpoint_loads_with_its_batch_count():
    torch.manual_seed(2)
    batches = [torch.randn(8, 3) + 4 for _ in range(3)]
    plain, debiased = nn.BatchNorm1d(3, affine=False), DebiasedBatchNorm1d(3)
    _train(plain, batches)
    _train(debiased, batches)
    loaded = DebiasedBatchNorm1d(3)
    loaded.load_state_dict(plain.state_dict())
    assert float(loaded.initial_weight) == pytest.approx(0.9**3, rel=1e-12)
    loaded.eval()
    x = torch.randn(4, 3) + 4
    torch.testing.assert_close(loaded(x), debiased(x))


def test_a_cumulative_pass_is_not_debiased_again():
    """calibrate_batch_norm averages with momentum None: those statistics are already exact."""
    batches = [torch.randn(8, 2, dtype=torch.float64) + 2 for _ in range(3)]
    norm = DebiasedBatchNorm1d(2).double()
    norm.reset_running_stats()
    norm.momentum = None
    _train(norm, batches)
    norm.momentum = 0.1
    mean, _ = norm.debiased_running_stats()
    torch.testing.assert_close(mean, torch.cat(batches).mean(0))


def test_early_codes_of_shifted_features_differ():
    """Features with a large common offset (ReLU outputs): after two steps the codes must vary."""
    torch.manual_seed(1)
    head = HashingHead(6, bits=8)
    batches = [torch.rand(32, 6) + 3.0 for _ in range(2)]
    head.train()
    for batch in batches:
        head(batch)
    head.eval()
    codes = head.encode(torch.rand(100, 6) + 3.0)
    assert torch.unique(codes, dim=0).shape[0] > 10
    # training mode keeps torch's batch statistics: the relaxation of a batch is centred per bit
    head.train()
    relaxed = head(batches[0])
    assert (relaxed > 0).any(0).all() and (relaxed < 0).any(0).all()
