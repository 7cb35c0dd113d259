"""``optimizer.name``: SGD, Adam (coupled L2 weight decay) and AdamW (decoupled weight decay,
Loshchilov & Hutter, ICLR 2019), built by the trainer from the config."""

from __future__ import annotations

import pytest
import torch

from rankwise.training import ConfigError, Trainer
from rankwise.training.build import build_optimizer
from rankwise.training.config import OptimizerConfig

# the tiny run of tests/conftest.py with the AP loss on 16 dimensions, AdamW and 2 steps
CHANGES = {
    "model.embedding_dim": 16,
    "loss.name": "ap",
    "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.01},
    "budget.iterations": 2,
    "eval_ks": [1, 10, 100],
}


@pytest.fixture
def base(tiny_config):
    return lambda tmp_path, **extra: tiny_config(tmp_path / "run", **{**CHANGES, **extra})


@pytest.mark.parametrize(
    ("name", "cls"),
    [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)],
)
def test_the_trainer_builds_the_named_optimizer(tmp_path, name, cls, base):
    config = base(tmp_path, **{"optimizer.name": name.upper()})
    trainer = Trainer.from_config(config)
    assert type(trainer.optimizer) is cls
    group = trainer.optimizer.param_groups[0]
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.01


def test_unknown_optimizer_is_named(tmp_path, base):
    with pytest.raises(ConfigError, match="optimizer.name"):
        base(tmp_path, **{"optimizer.name": "lamb"})


def one_step_with_zero_loss_gradient(name: str) -> torch.Tensor:
    """Weights after one step whose loss gradient is 0: only the weight decay acts."""
    w = torch.nn.Parameter(torch.tensor([0.5, -0.2, 0.05]))
    optimizer = build_optimizer(OptimizerConfig(name=name, lr=0.01, weight_decay=1e-4), [w])
    w.grad = torch.zeros_like(w)
    optimizer.step()
    return w.detach()


def test_adamw_decay_is_decoupled_and_adam_decay_is_normalised_away():
    w0 = torch.tensor([0.5, -0.2, 0.05])
    # AdamW: w <- w (1 - lr wd), independent of how small the loss gradient is
    torch.testing.assert_close(one_step_with_zero_loss_gradient("adamw"), w0 * (1 - 0.01 * 1e-4))
    # Adam with coupled L2: the decay term IS the gradient, Adam normalises it to unit size, so
    # every weight moves by the full lr towards 0 -- what collapses a network whose loss gradient
    # is tiny (SOPRC at SOP-sized priors)
    torch.testing.assert_close(
        one_step_with_zero_loss_gradient("adam"), w0 - 0.01 * torch.sign(w0), atol=1e-4, rtol=0
    )
