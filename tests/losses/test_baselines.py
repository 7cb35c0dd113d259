"""PML baselines: each builds and matches calling pytorch-metric-learning directly, the reference
path maps to PML's ref_emb, counts are reported, and the XBM memory travels with the module."""

import pytest
import torch
from pytorch_metric_learning import distances, losses, miners

from rankwise.losses.baselines import (
    BASELINES,
    CrossBatchMemoryBaseline,
    PMLBaseline,
    baseline,
    baseline_parameters,
)


def pk_batch(p=4, k=4, dim=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(p).repeat_interleave(k)
    return torch.randn(p * k, dim, generator=g, dtype=dtype), labels


def direct_pml(name, embedding_size=8):
    """The same baselines assembled straight from PML, as the documentation of baseline() says."""
    if name == "contrastive":
        return losses.ContrastiveLoss(
            pos_margin=1.0, neg_margin=0.5, distance=distances.CosineSimilarity()
        ), None
    if name == "triplet":
        return losses.TripletMarginLoss(), miners.BatchHardMiner()
    if name == "triplet_semihard":
        return losses.TripletMarginLoss(), miners.TripletMarginMiner(
            margin=0.05, type_of_triplets="semihard"
        )
    if name == "multi_similarity":
        return losses.MultiSimilarityLoss(), miners.MultiSimilarityMiner()
    if name == "fastap":
        return losses.FastAPLoss(), None
    if name == "xbm":
        inner = losses.ContrastiveLoss(
            pos_margin=1.0, neg_margin=0.5, distance=distances.CosineSimilarity()
        )
        return losses.CrossBatchMemory(inner, embedding_size, memory_size=1024), None
    raise AssertionError(name)


# XBM in PML's form (memory from the first call, no batch term): what direct PML computes
PML_FORM = {"start_iteration": 0, "batch_loss": False}


def build(name, **kw):
    """The baseline; XBM with embedding_size 8 and, unless ``kw`` says otherwise, PML's form."""
    return (
        baseline(name, **{"embedding_size": 8, **PML_FORM, **kw})
        if name == "xbm"
        else baseline(name, **kw)
    )


@pytest.mark.parametrize("name", BASELINES)
def test_each_baseline_matches_direct_pml_call(name):
    emb, labels = pk_batch()
    module = build(name)
    emb_req = emb.clone().requires_grad_(True)
    value = module(emb_req, labels)
    assert value.ndim == 0 and torch.isfinite(value)
    value.backward()
    assert emb_req.grad is not None and emb_req.grad.abs().sum() > 0
    loss, miner = direct_pml(name)
    indices = miner(emb, labels) if miner is not None else None
    expected = loss(emb, labels, indices) if name != "xbm" else loss(emb, labels)
    assert value.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    assert module.last_stats["n_anchors"] == 16
    assert module.last_stats["n_anchors_used"] == 16


def test_xbm_matches_direct_pml_over_several_batches():
    module, (direct, _) = build("xbm", memory_size=40), direct_pml("xbm")
    direct = losses.CrossBatchMemory(direct.loss, 8, memory_size=40)
    for seed in range(4):  # 4 x 16 rows overflow the 40-slot queue
        emb, labels = pk_batch(seed=seed)
        assert module(emb, labels).item() == pytest.approx(direct(emb, labels).item(), rel=1e-6)
    assert module.last_stats["n_memory_items"] == 40
    assert int(module.memory_queue_index) == direct.queue_idx == 64 % 40
    assert bool(module.memory_filled) and direct.has_been_filled


@pytest.mark.parametrize("batch_loss", [False, True])
def test_xbm_warm_up_ranks_the_batch_alone_then_follows_pml(batch_loss):
    # the released XBM code: no memory for START_ITERATION steps, then batch loss + memory loss
    module = build("xbm", memory_size=40, start_iteration=2, batch_loss=batch_loss)
    inner, _ = direct_pml("contrastive")
    direct = losses.CrossBatchMemory(inner, 8, memory_size=40)
    for seed in range(5):
        emb, labels = pk_batch(seed=seed)
        value = module(emb, labels).item()
        if seed < 2:  # warm-up: the batch against itself, nothing enqueued
            assert value == pytest.approx(inner(emb, labels).item(), rel=1e-6)
            assert int(module.memory_queue_index) == 0 and not bool(module.memory_filled)
        else:  # the memory starts empty at the end of the warm-up
            expected = direct(emb, labels).item() + (inner(emb, labels).item() if batch_loss else 0)
            assert value == pytest.approx(expected, rel=1e-6)
    assert int(module.iterations_seen) == 5
    assert int(module.memory_queue_index) == direct.queue_idx == 48 % 40


def test_xbm_default_is_the_released_form():
    # Issue 21: PML's form (memory from step 0) collapses a from-scratch network, so the default
    # is the released XBM code's: 75 warm-up calls on the batch alone, then batch + memory loss.
    module = baseline("xbm", embedding_size=8, memory_size=40)
    assert (module.start_iteration, module.batch_loss) == (75, True)
    inner, _ = direct_pml("contrastive")
    emb, labels = pk_batch()
    assert module(emb, labels).item() == pytest.approx(inner(emb, labels).item(), rel=1e-6)
    assert int(module.memory_queue_index) == 0  # nothing enqueued during the warm-up
    # the stats keep their keys during the warm-up (docs/losses.md prints n_memory_items)
    assert module.last_stats["n_memory_items"] == 0


def test_xbm_warm_up_counter_is_state_and_eval_calls_do_not_advance_it():
    module = build("xbm", memory_size=40, start_iteration=3)
    emb, labels = pk_batch()
    module(emb, labels)
    module.eval()
    inner, _ = direct_pml("contrastive")
    # eval during the warm-up: the batch loss (the memory is still empty), no step counted
    assert module(emb, labels).item() == pytest.approx(inner(emb, labels).item(), rel=1e-6)
    assert int(module.iterations_seen) == 1
    restored = build("xbm", memory_size=40, start_iteration=3)
    restored.load_state_dict(module.state_dict())
    assert int(restored.iterations_seen) == 1
    restored.train()
    for _ in range(2):
        restored(emb, labels)
    assert int(restored.memory_queue_index) == 0  # still warming up after 3 calls in all
    restored(emb, labels)
    assert int(restored.memory_queue_index) == 16


def test_xbm_warm_up_arguments_are_checked():
    assert {"start_iteration", "batch_loss"} <= set(baseline_parameters("xbm"))
    with pytest.raises(ValueError, match="start_iteration"):
        build("xbm", start_iteration=-1)
    with pytest.raises(ValueError, match="batch_loss"):
        build("xbm", batch_loss="yes")


def test_batch_hard_mining_counts_one_triplet_per_anchor():
    emb, labels = pk_batch(p=3, k=5)
    module = baseline("triplet")
    module(emb, labels)
    assert module.last_stats["n_mined_triplets"] == 15
    ms = baseline("multi_similarity")
    ms(emb, labels)
    a1, p, a2, n = miners.MultiSimilarityMiner()(emb, labels)
    assert ms.last_stats["n_mined_positive_pairs"] == len(a1)
    assert ms.last_stats["n_mined_negative_pairs"] == len(a2)


@pytest.mark.parametrize("name", ["contrastive", "triplet", "triplet_semihard", "multi_similarity"])
def test_reference_set_maps_to_pml_ref_emb(name):
    emb, labels = pk_batch(p=3, k=2, seed=1)
    ref, ref_labels = pk_batch(p=4, k=3, seed=2)
    module = baseline(name)
    value = module(emb, labels, ref, ref_labels)
    loss, miner = direct_pml(name)
    indices = miner(emb, labels, ref, ref_labels) if miner is not None else None
    expected = loss(emb, labels, indices, ref, ref_labels)
    assert value.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    # Anchors of labels 0-2 all have positives and negatives among the 4-class reference set.
    assert module.last_stats["n_anchors_used"] == 6
    assert module.last_stats["n_positive_pairs"] == 6 * 3


@pytest.mark.parametrize("name", ["fastap", "xbm"])
def test_reference_set_rejected_where_pml_cannot_use_it(name):
    emb, labels = pk_batch()
    with pytest.raises(ValueError, match="ref_embeddings"):
        build(name)(emb, labels, emb, labels)


def test_skipped_anchors_are_counted_and_empty_batches_raise():
    emb = torch.randn(7, 4)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 3])
    module = baseline("contrastive")
    module(emb, labels)
    assert module.last_stats["n_skipped_no_positive"] == 2
    assert module.last_stats["n_anchors_used"] == 5
    with pytest.raises(ValueError, match="no anchor"):
        module(torch.randn(3, 4), torch.tensor([0, 1, 2]))


def test_input_validation():
    module = baseline("contrastive")
    with pytest.raises(ValueError, match="labels"):
        module(torch.randn(4, 3), torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="embeddings"):
        module(torch.tensor([[float("nan"), 0.0], [1.0, 0.0]]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="ref_labels"):
        module(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), torch.randn(4, 3))
    xbm = baseline("xbm", embedding_size=3, memory_size=4)
    with pytest.raises(ValueError, match="embedding_size"):
        xbm(torch.randn(4, 5), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match="memory_size"):
        xbm(torch.randn(6, 3), torch.tensor([0, 0, 1, 1, 2, 2]))


def test_bad_names_and_parameters():
    with pytest.raises(ValueError, match="contrastive, triplet"):
        baseline("arcface")
    with pytest.raises(ValueError, match="'margn'.*margin"):
        baseline("triplet", margn=0.2)
    with pytest.raises(ValueError, match="'eps'.*epsilon"):
        baseline("multi_similarity", miner_kwargs={"eps": 0.2})
    with pytest.raises(ValueError, match="embedding_size"):
        baseline("xbm")
    assert "embedding_size" in baseline_parameters("xbm")
    assert "miner_kwargs" in baseline_parameters("triplet")
    assert "miner_kwargs" not in baseline_parameters("fastap")


def test_parameters_reach_pml():
    module = baseline("triplet_semihard", margin=0.3)
    assert module.loss.margin == 0.3 and module.miner.margin == 0.3
    assert module.miner.type_of_triplets == "semihard"
    assert baseline("fastap", num_bins=20).loss.num_bins == 20
    assert isinstance(baseline("fastap"), PMLBaseline)


def test_xbm_state_dict_round_trip_and_dtype_move():
    module = build("xbm", memory_size=24)
    for seed in range(2):
        module(*pk_batch(seed=seed))
    state = module.state_dict()
    assert {
        "memory_queue_index",
        "memory_filled",
        "loss.embedding_memory",
        "loss.label_memory",
    } <= set(state)
    restored = build("xbm", memory_size=24)
    restored.load_state_dict(state)
    emb, labels = pk_batch(seed=5)
    assert restored(emb, labels).item() == pytest.approx(module(emb, labels).item(), rel=1e-6)
    assert restored.last_stats["n_memory_items"] == module.last_stats["n_memory_items"] == 24
    restored.double()
    assert restored.loss.embedding_memory.dtype == torch.float64
    assert isinstance(restored, CrossBatchMemoryBaseline)
    restored.reset_memory()
    assert int(restored.memory_queue_index) == 0 and restored.loss.embedding_memory.abs().sum() == 0


def test_xbm_memory_moves_with_module(device):
    module = build("xbm", memory_size=32).to(device)
    assert module.loss.embedding_memory.device.type == device.type
    assert module.memory_queue_index.device.type == device.type
    emb, labels = pk_batch()
    value = module(emb.to(device), labels.to(device))
    assert value.device.type == device.type and torch.isfinite(value)


@pytest.mark.parametrize("name", ["contrastive", "multi_similarity", "fastap"])
def test_device(device, name):
    emb, labels = pk_batch()
    cpu_value = baseline(name)(emb, labels)
    value = baseline(name).to(device)(emb.to(device), labels.to(device))
    assert value.item() == pytest.approx(cpu_value.item(), rel=1e-5, abs=1e-6)


def test_xbm_half_precision_keeps_the_memory_dtype_and_matches_float32():
    """A float16 batch is enqueued in the memory's dtype (PML would turn the whole memory into
    float16, a lossy change of state); the loss is computed in float32 like every loss."""
    half, full = (build("xbm", memory_size=24) for _ in range(2))
    for seed in range(3):
        emb, labels = pk_batch(seed=seed)
        emb = emb.half()
        value = half(emb.requires_grad_(True), labels)
        reference = full(emb.detach().float(), labels)
        assert value.dtype == torch.float32
        assert float(value.detach()) == pytest.approx(float(reference), rel=1e-6, abs=1e-7)
        value.backward()
        assert emb.grad.dtype == torch.float16 and bool(torch.isfinite(emb.grad).all())
    assert half.loss.embedding_memory.dtype == torch.float32
    assert torch.equal(half.loss.embedding_memory, full.loss.embedding_memory)


def test_xbm_batch_with_nothing_to_rank_leaves_the_memory_as_it_was():
    """Issue 14 §2: the anchor counts are taken on the memory as the enqueue would leave it, so
    the ValueError comes before PML writes the memory or moves the queue."""
    module = build("xbm", memory_size=24)
    emb, _ = pk_batch()
    with pytest.raises(ValueError, match="no anchor"):
        module(emb[:4], torch.zeros(4, dtype=torch.long))  # one class, empty memory
    assert int(module.memory_queue_index) == 0 and int(module.memory_filled) == 0
    assert module.loss.embedding_memory.abs().sum() == 0
    # the same batch is fine once the memory holds other classes, and the counts agree with PML's
    module(*pk_batch(seed=1))
    value = module(emb[:4], torch.zeros(4, dtype=torch.long))
    assert torch.isfinite(value) and module.last_stats["n_memory_items"] == 20


def test_xbm_counts_before_the_enqueue_agree_with_the_memory_after_it():
    """The pre-enqueue prediction of the memory (slots, filled flag) matches PML's state after
    the call, across wrap-arounds of the queue (memory 24, batches of 16 and 8)."""
    module = build("xbm", memory_size=24)
    for seed, (p, k) in enumerate([(4, 4), (4, 4), (2, 4), (4, 4), (4, 2)]):
        module(*pk_batch(p=p, k=k, seed=seed))
        xbm = module.loss
        n_memory = xbm.memory_size if xbm.has_been_filled else xbm.queue_idx
        assert module.last_stats["n_memory_items"] == n_memory
        assert int(module.memory_queue_index) == xbm.queue_idx
        assert bool(module.memory_filled) == xbm.has_been_filled
