"""Issue 31: a step of a rankwise loss never waits for the device.

Counted with :class:`rankwise._dispatch.DispatchCounter`, a CPU run that simulates the embeddings
and the loss's buffers on an accelerator and the labels on the host (where the data loader gives
them): a forward + backward step, with the batch ranked against itself and against a reference
set, in training mode (state updates included) and in eval mode, performs no device sync (no
``.item()`` / ``bool()`` / ``.tolist()`` of device data, no ``nonzero`` / ``unique`` / boolean-mask
indexing of it); label-only structure is computed on the host. The values of the embeddings are
checked on the device: a refused call returns NaN, changes no state and raises its error, naming
the argument, when ``last_stats`` is read. ``last_stats`` keeps its values as tensors until read.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from rankwise._dispatch import DispatchCounter
from rankwise.losses import LOSSES, SOPRCLoss, build_loss
from rankwise.losses._deferred import LossStats
from rankwise.losses.baselines import BASELINES

RANKWISE = [name for name in LOSSES if name not in BASELINES]
N_CLASSES, DIM = 6, 8
TRAIN_LABELS = np.repeat(np.arange(N_CLASSES), 10)
# one sample of classes 3 and 5: anchors without a positive, skipped (the restricted path)
UNEVEN = (0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4, 5)


def make(name):
    return build_loss(name, train_labels=TRAIN_LABELS, num_classes=N_CLASSES, embedding_dim=DIM)


def pk_batch(seed=0, classes=(0, 1, 2), m=4):
    """Codes inside (-1, 1) (valid for every loss, the hashing ones included), labels on the host."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.tensor(classes).repeat_interleave(m)
    centres = torch.randn(N_CLASSES, DIM, generator=generator)
    x = centres[labels] + 0.5 * torch.randn(len(labels), DIM, generator=generator)
    return (0.95 * torch.tanh(x)).requires_grad_(True), labels


def uneven_batch(seed):
    x, _ = pk_batch(seed=seed, classes=(0,), m=len(UNEVEN))
    return x, torch.tensor(UNEVEN)


def counted(loss_fn, *args):
    """The counter of one forward + backward ``loss_fn(*args)``; embeddings and buffers on the
    (simulated) device, labels on the host."""
    embeddings = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    with DispatchCounter() as counter:
        counter.mark_device(*embeddings, *loss_fn.buffers())
        loss_fn(*args).backward()
    return counter


def calls(seed):
    """(label, args) of the calls a step is checked on: P x K, uneven, with a reference set."""
    x, y = pk_batch(seed=seed)
    xu, yu = uneven_batch(seed)
    ref, ref_y = pk_batch(seed=seed + 50, classes=(1, 2, 3))
    return {"pk": (x, y), "uneven": (xu, yu), "reference-set": (x, y, ref, ref_y)}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", RANKWISE)
def test_a_step_performs_no_device_sync(name, training):
    loss_fn = make(name).train(training)
    for case, args in calls(seed=1).items():
        loss_fn(*args).backward()  # the first call may read fixed buffers once (below)
        counter = counted(loss_fn, *args)
        assert counter.n_syncs == 0, (case, counter.summary())
        assert counter.n_kernels > 10, (case, counter.summary())


@pytest.mark.parametrize("name", RANKWISE)
def test_the_first_call_reads_fixed_buffers_only(name):
    """SOPRC reads its prior and positive counts to the host once (they are fixed after
    construction: the step derives per-pair values from the labels on the host); every other loss
    reads nothing. Moves and dtype changes carry that host copy over."""
    loss_fn = make(name)
    x, y = pk_batch(seed=2)
    first = counted(loss_fn, x, y)
    expected = {"copy_to_host": 2} if name == "soprc" else {}
    assert dict(first.syncs) == expected, first.summary()
    loss_fn = loss_fn.double().to("cpu")
    x64 = x.detach().double().requires_grad_(True)
    moved = counted(loss_fn, x64, y)
    assert moved.n_syncs == 0, moved.summary()


def test_soprc_sees_its_buffers_changed_in_place_and_by_load_state_dict():
    loss_fn = SOPRCLoss.from_labels(TRAIN_LABELS).eval()
    other = SOPRCLoss.from_labels(np.repeat(np.arange(6), np.arange(2, 8)), prior_scale=0.5)
    other.eval()
    x, y = pk_batch(seed=3)
    before = loss_fn(x, y).detach()
    loss_fn.load_state_dict(other.state_dict())
    assert torch.equal(loss_fn(x, y).detach(), other(x, y).detach())
    assert not torch.equal(before, other(x, y).detach())
    loss_fn.prior[1] = 0.0  # an in-place edit: the class is refused, as from the start
    with pytest.raises(ValueError, match="prior"):
        loss_fn(x, y)


@pytest.mark.parametrize("name", RANKWISE)
@pytest.mark.parametrize("argument", ["embeddings", "ref_embeddings"])
def test_refused_values_return_nan_and_raise_when_last_stats_is_read(name, argument):
    loss_fn = make(name).train()
    for _ in range(2):  # some state to keep
        loss_fn(*pk_batch(seed=4)).backward()
    state = {k: v.clone() for k, v in loss_fn.state_dict().items()}
    x, y = pk_batch(seed=5)
    ref, ref_y = pk_batch(seed=6, classes=(0, 1, 2))
    nan = torch.full_like(x, math.nan)
    args = (nan, y, ref, ref_y) if argument == "embeddings" else (x, y, nan, ref_y)
    counter = counted(loss_fn, *args)
    assert counter.n_syncs == 0, counter.summary()
    stats = loss_fn.last_stats
    assert isinstance(stats, LossStats) and len(stats) > 0  # keys: no read
    key = next(iter(stats))
    for read in (lambda: stats[key], lambda: dict(stats), lambda: list(stats.items())):
        with pytest.raises(ValueError, match=f"`{argument}`"):
            read()
    assert loss_fn.state_dict().keys() == state.keys()
    for key in state:
        assert torch.equal(loss_fn.state_dict()[key], state[key]), key
    with DispatchCounter():  # as on an accelerator
        value = loss_fn(*args)
    assert torch.isnan(value)
    # on the CPU reading the flag waits for nothing: the call itself raises, changing nothing
    with pytest.raises(ValueError, match=f"`{argument}`"):
        loss_fn(*args)
    for key in state:
        assert torch.equal(loss_fn.state_dict()[key], state[key]), key
    # the next good call is unaffected
    good = loss_fn(x, y)
    assert torch.isfinite(good) and all(math.isfinite(v) for v in dict(loss_fn.last_stats).values())


@pytest.mark.parametrize("name", RANKWISE)
def test_last_stats_keep_tensors_until_read(name):
    loss_fn = make(name)
    x, y = pk_batch(seed=7)
    loss_fn(x, y).backward()
    stats = loss_fn.last_stats
    pending = [k for k, v in dict.items(stats) if isinstance(v, torch.Tensor)]
    assert pending, "a loss records at least one value of its step"
    assert all(not dict.__getitem__(stats, k).requires_grad for k in pending)
    plain = dict(stats)  # one read on the host
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in plain.values())
    assert all(isinstance(v, (int, float)) for v in dict.values(stats))
    assert json.loads(json.dumps(stats)) == plain
    counts = ("n_anchors", "n_anchors_used", "n_positive_pairs")
    assert all(isinstance(plain[k], int) for k in counts if k in plain)


def test_the_training_log_reads_floats():
    """metrics_log keeps the int / float values of last_stats: read through .items()."""
    loss_fn = make("soprc")
    loss_fn(*pk_batch(seed=8))
    stats = {k: v for k, v in loss_fn.last_stats.items() if isinstance(v, (int, float))}
    assert {"loss_auprc", "tpr_mean", "fpr_mean", "semi_variance", "n_anchors"} <= stats.keys()


@pytest.mark.parametrize("name", RANKWISE)
def test_batches_of_one_label_pattern_share_structure_not_classes(name, monkeypatch):
    """Batches whose labels have the same pattern share their label structure (BatchLayout); the
    losses, SOPRC's per-class state included, come out bit for bit as without the sharing."""
    from rankwise.losses import base

    def run():
        base._LAYOUTS.clear()
        loss_fn = make(name).train()
        out = []
        for seed, classes in enumerate([(0, 1, 2), (3, 4, 5), (2, 0, 5), (5, 2, 0)]):
            x, y = pk_batch(seed=seed, classes=classes)
            value = loss_fn(x, y)
            value.backward()
            out.append((value.detach(), x.grad, dict(loss_fn.last_stats)))
        return out, {k: v.clone() for k, v in loss_fn.state_dict().items()}

    shared, shared_state = run()
    monkeypatch.setattr(base, "_LAYOUT_CACHE_ENTRIES", 0)  # every batch builds its own
    alone, alone_state = run()
    for (v1, g1, s1), (v2, g2, s2) in zip(shared, alone, strict=True):
        assert torch.equal(v1, v2) and torch.equal(g1, g2) and s1 == s2
    assert shared_state.keys() == alone_state.keys()
    for key in shared_state:
        assert torch.equal(shared_state[key], alone_state[key]), key


# losses of class ids whose label bookkeeping runs in numpy (issue 36, item 7)
NUMPY_BOOKKEEPING = ("soprc", "ap", "auc", "wilcoxon", "smooth_ap", "pointwise_roc", "roadmap")
# the torch operations a step may run on the host: wrapping Python numbers for device operations
SCALAR_WRAPPING = {"scalar_tensor", "promote_types"}


@pytest.mark.parametrize("name", NUMPY_BOOKKEEPING)
def test_a_step_runs_no_torch_kernel_on_the_labels(name):
    """Issue 36, item 7: on an H200 host the rankwise losses took 50-64 ms of process CPU time per
    call against 3.7 ms for PML FastAP. Their label bookkeeping ran as torch CPU kernels, and the
    ones on the (B, B) masks (their copies for a repeated label pattern, the packed copy's
    concatenation) split over torch's 16 intra-op threads, which then spin. Counted on one
    training step of a repeated 56 x 4 pattern (B = 224: masks of 50,176 entries, past torch's
    2**15-element grain) with the packed copy an accelerator takes: no host kernel on 2**15
    elements or more, and no host kernel at all but the wrapping of Python numbers."""
    n_classes = 56
    train_labels = np.repeat(np.arange(n_classes), 10)
    loss_fn = build_loss(
        name, train_labels=train_labels, num_classes=n_classes, embedding_dim=DIM
    ).train()
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(n_classes).repeat_interleave(4)
    x = (0.95 * torch.tanh(torch.randn(224, DIM, generator=generator))).requires_grad_(True)
    loss_fn(x, labels).backward()  # the first call of a pattern builds its structure
    counter = counted(loss_fn, x, labels)
    assert counter.parallel_host_ops == {}, counter.parallel_host_ops
    assert set(counter.host_ops) <= SCALAR_WRAPPING, counter.host_ops


@pytest.mark.parametrize("name", ["soprc", "ap", "auc"])
def test_a_step_with_a_memory_performs_no_device_sync(name):
    # the memory's labels and positions are mirrored on the host: after the first call (which
    # reads the fresh buffers once) a step reads nothing back, the memory filling and full
    loss_fn = build_loss(
        name,
        train_labels=TRAIN_LABELS,
        embedding_dim=DIM,
        memory={"size": 24, "start_step": 0},
    )
    loss_fn(*pk_batch(seed=0))
    for seed in (1, 2, 3):
        counter = counted(loss_fn, *pk_batch(seed=seed, classes=(seed % 3, 3, 4)))
        assert counter.n_syncs == 0, (seed, counter.summary())
        assert loss_fn.last_stats["n_memory_items"] == min(24, 12 * seed)
