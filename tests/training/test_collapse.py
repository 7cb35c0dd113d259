"""The trainer's collapse detector: when every score ties (the embeddings of a training batch or of
the validation split all point in one direction) the run stops with a message naming the likely
cause and the fix, logs an error record, and keeps the last good checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from rankwise.training import (
    CollapsedEmbeddingsError,
    NonFiniteLossError,
    Trainer,
    load_checkpoint,
)
from rankwise.training.callbacks import COLLAPSE_SPREAD, embedding_spread

# the tiny run of tests/conftest.py with the AP loss on 16 dimensions and coupled weight decay
CHANGES = {
    "model.embedding_dim": 16,
    "loss.name": "ap",
    "optimizer.weight_decay": 4e-4,
    "log_every": 1,
    "eval_ks": [1, 10, 100],
}


@pytest.fixture
def make_config(tiny_config):
    return lambda run_dir, **extra: tiny_config(run_dir, **{**CHANGES, **extra})


def error_records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "error"]


def test_embedding_spread():
    e = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    assert embedding_spread(e) > 0.5
    same = e[:1].repeat(10, 1) * torch.arange(1, 11.0)[:, None]  # one direction, other norms
    assert embedding_spread(same) < 1e-6
    assert embedding_spread(torch.zeros(5, 3)) == 0.0  # every score is 0: tied
    mixed = torch.cat([torch.zeros(1, 3), torch.ones(4, 3)])  # scores 0 and 1: not tied
    assert embedding_spread(mixed) > 0.5
    assert embedding_spread(e[:1]) == float("inf")
    # just above the threshold the scores still differ by more than float32 resolution near 1
    u = torch.tensor([[1.0, 0.0], [1.0, 2 * COLLAPSE_SPREAD]])
    assert embedding_spread(u) > COLLAPSE_SPREAD


def collapse_at(trainer, monkeypatch, step, *, training):
    """From model call number ``step`` on, the model outputs one direction (in train or eval)."""
    real_forward = trainer.model.forward
    calls = {"train": 0}

    def forward(x):
        out = real_forward(x)
        if trainer.model.training:
            calls["train"] += 1
            if training and calls["train"] >= step:
                return out[:1].expand_as(out) * 1.0
        elif not training and calls["train"] >= step:
            return out[:1].expand_as(out) * 1.0
        return out

    monkeypatch.setattr(trainer.model, "forward", forward)


def test_a_collapsed_training_batch_stops_the_run_with_cause_and_fix(
    tmp_path, monkeypatch, make_config
):
    trainer = Trainer.from_config(make_config(tmp_path / "run"))
    collapse_at(trainer, monkeypatch, 5, training=True)
    with pytest.raises(CollapsedEmbeddingsError) as info:
        trainer.fit()
    message = str(info.value)
    assert "every score ties at step 5" in message
    assert "20 embeddings of the training batch" in message
    # coupled weight decay under Adam is named, with the fix
    assert "weight decay coupled to the gradient (optimizer.name=adam" in message
    assert "optimizer.name=adamw" in message and "lower optimizer.lr" in message
    assert "last good checkpoint" in message and "step 4" in message
    assert info.value.step == 5 and info.value.where == "training batch"
    assert isinstance(info.value, NonFiniteLossError)  # every handler of a failed run catches it
    (record,) = error_records(tmp_path / "run")
    assert record["error"] == "collapsed embeddings" and record["step"] == 5
    assert record["where"] == "training batch" and record["spread"] <= COLLAPSE_SPREAD
    kept = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert kept["step"] == 4  # the step with the collapsed batch was not applied


def test_a_collapsed_validation_split_stops_the_run(tmp_path, monkeypatch, make_config):
    config = make_config(tmp_path / "run", **{"optimizer.name": "adamw"})
    trainer = Trainer.from_config(config)
    collapse_at(trainer, monkeypatch, 3, training=False)
    with pytest.raises(CollapsedEmbeddingsError, match="embeddings of the validation split") as e:
        trainer.fit()
    assert e.value.step == 4 and e.value.where == "validation split"
    # AdamW's decay is decoupled: it is not blamed; the learning rate is
    assert "weight decay coupled" not in str(e.value) and "optimizer.lr=0.001" in str(e.value)
    (record,) = error_records(tmp_path / "run")
    assert record["where"] == "validation split" and record["step"] == 4
    kept = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert kept["step"] == 2


def test_a_healthy_run_is_not_stopped(tmp_path, make_config):
    result = Trainer.from_config(make_config(tmp_path / "run", **{"budget.iterations": 4})).fit()
    assert result.status == "completed"
    assert error_records(tmp_path / "run") == []


def test_soprc_advice_names_v_starting_below_the_scores(tmp_path, make_config):
    """Issue 40: SOPRC's grid v below an untrained network's scores left the loss at ~1."""
    from rankwise.training.callbacks import config_collapse_advice

    config = make_config(tmp_path / "run", **{"loss.name": "soprc"})
    assert "loss.params.warm_start=true" in config_collapse_advice(config)
    warm = make_config(tmp_path / "run", **{"loss.name": "soprc", "loss.params.warm_start": True})
    assert "warm_start" not in config_collapse_advice(warm)
    no_v = make_config(tmp_path / "run", **{"loss.name": "soprc", "loss.params.use_v": False})
    assert "warm_start" not in config_collapse_advice(no_v)
    assert "warm_start" not in config_collapse_advice(make_config(tmp_path / "run"))  # AP loss
