"""What a Trainer step waits for (docs/training.md, "What a step waits for").

Counted as tests/losses/test_host_syncs.py counts a loss: a CPU run under
:class:`rankwise._dispatch.DispatchCounter`, the model's parameters and the loss's buffers on the
(simulated) device. A rankwise loss gets the data loader's labels on the host, so the loss adds no
wait for the device to the step (issue 31): before, the trainer moved the labels to the device and
the loss read them back (a ``numpy`` sync every step). What remains are the trainer's own documented
reads: finite embeddings, the collapse check of the batch, finite loss.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from rankwise._dispatch import DispatchCounter
from rankwise.losses import build_loss
from rankwise.training import Trainer

LABELS = torch.arange(4).repeat_interleave(16)


def trainer_of(loss_fn: torch.nn.Module, **options) -> Trainer:
    generator = torch.Generator().manual_seed(0)
    points = 3 * torch.randn(4, 8, generator=generator)[LABELS]
    points = points + torch.randn(64, 8, generator=generator)
    data = TensorDataset(points, LABELS)
    torch.manual_seed(0)
    return Trainer(torch.nn.Linear(8, 4), loss_fn, data, iterations=10, progress=False, **options)


def counted_step(trainer: Trainer) -> DispatchCounter:
    """The counter of the second ``train_step`` (the first may read fixed buffers once)."""
    batches = iter(trainer._training_batches())
    x, y, _ = next(batches)
    trainer.train_step(x, y)
    x, y, _ = next(batches)
    with DispatchCounter() as counter:
        counter.mark_device(*trainer.model.parameters(), *trainer.loss_fn.buffers())
        trainer.train_step(x, y)
    return counter


@pytest.mark.parametrize("name", ["ap", "soprc", "auc"])
def test_a_training_step_waits_only_for_the_trainers_documented_reads(name):
    loss_fn = build_loss(name, train_labels=LABELS.numpy(), num_classes=4, embedding_dim=4)
    assert loss_fn.takes_host_labels
    counter = counted_step(trainer_of(loss_fn))
    # finite embeddings, the collapse check's spread, finite loss: nothing from the loss
    assert dict(counter.syncs) == {"_local_scalar_dense": 3}, counter.summary()
    counter = counted_step(trainer_of(loss_fn, detect_collapse=False))
    assert dict(counter.syncs) == {"_local_scalar_dense": 2}, counter.summary()


class _SeesLabels(torch.nn.Module):
    """A loss of one's own (no ``takes_host_labels``): it gets the labels on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.seen.append(labels)
        same = (labels[:, None] == labels[None, :]).float()
        return ((embeddings @ embeddings.T) * (1 - 2 * same)).mean()


def test_which_labels_a_loss_gets():
    own = _SeesLabels()
    trainer = trainer_of(own)
    batches = iter(trainer._training_batches())
    x, y, _ = next(batches)
    with DispatchCounter() as counter:
        counter.mark_device(*trainer.model.parameters())
        trainer.train_step(x, y)
    assert counter.on_device(own.seen[0])  # moved, as before: the loss may need them there

    rankwise_loss = build_loss("ap")
    seen = []
    rankwise_loss.register_forward_pre_hook(lambda _module, args: seen.append(args[1]))
    trainer = trainer_of(rankwise_loss)
    x, y, _ = next(iter(trainer._training_batches()))
    with DispatchCounter() as counter:
        counter.mark_device(*trainer.model.parameters())
        trainer.train_step(x, y)
    assert seen[0] is y and not counter.on_device(seen[0])  # the loader's labels, on the host
