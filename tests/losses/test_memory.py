"""RankingMemory: a cross-batch memory for every ranking loss (issue 38, item 4).

Checked: the memory's state is in buffers (state_dict, .double(), a reloaded memory continues
exactly, a Trainer run resumed from a checkpoint equals the uninterrupted one); with an empty
memory it is the plain loss; each call equals the loss with the hand-built reference set
``[batch; memory]`` (and, for the per-anchor losses, the brute-force mean over anchors ranked one
at a time); the gradient flows through the batch only; gradcheck in float64 through the wrapper;
the queue order and wrap-around; ``start_step``; eval mode; errors and the config group.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rankwise.losses import MEMORY_LOSSES, RankingMemory, build_loss
from rankwise.losses.recall_at_k import RecallAtKLoss
from rankwise.training import ConfigError, Trainer

DIM = 5
TRAIN_LABELS = torch.arange(8).repeat_interleave(10)


def make(name: str, size: int = 16, start_step: int = 0, **params) -> RankingMemory:
    kw = {"train_labels": TRAIN_LABELS} if name == "soprc" else {}
    memory = {"size": size, "start_step": start_step}
    return build_loss(name, embedding_dim=DIM, memory=memory, **kw, **params).double()


def plain(name: str):
    kw = {"train_labels": TRAIN_LABELS} if name == "soprc" else {}
    return build_loss(name, **kw).double()


def batch(seed: int, classes=(0, 1, 2, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.tensor(classes).repeat_interleave(2)
    return torch.randn(labels.numel(), DIM, generator=generator, dtype=torch.float64), labels


def hand_built(loss, emb, labels, memory_emb, memory_labels):
    """The wrapped loss on the reference set [batch; memory], each anchor's own row excluded."""
    with loss.reference_leads_with_batch():
        return loss(emb, labels, torch.cat([emb, memory_emb]), torch.cat([labels, memory_labels]))


@pytest.mark.parametrize("name", MEMORY_LOSSES)
def test_the_state_is_in_buffers_and_a_reloaded_memory_continues_exactly(name):
    loss_fn = make(name)
    for step in range(3):
        loss_fn(*batch(step))
    state = loss_fn.state_dict()
    for key in ("memory_embeddings", "memory_labels", "memory_position", "memory_count",
                "steps_seen"):  # fmt: skip
        assert key in state, key
    assert int(state["memory_count"]) == 16 and int(state["memory_position"]) == 8
    assert int(state["steps_seen"]) == 3
    assert state["memory_embeddings"].dtype == torch.float64  # follows .double()
    # a fresh memory loaded from the state gives the same next value and the same next state
    fresh = make(name)
    fresh.load_state_dict(copy.deepcopy(state))
    emb, labels = batch(10)
    assert torch.equal(loss_fn(emb, labels), fresh(emb, labels))
    for key, value in loss_fn.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key


@pytest.mark.parametrize("name", MEMORY_LOSSES)
def test_with_an_empty_memory_it_is_the_plain_loss(name):
    emb, labels = batch(0)
    got = make(name)(emb, labels)
    want = plain(name)(emb, labels)
    # the same terms; AUC's pairs are summed in another order against a reference set
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", MEMORY_LOSSES)
def test_each_call_is_the_loss_against_the_hand_built_reference_set(name):
    loss_fn = make(name, size=12)  # 8 rows a batch: the second call wraps around
    reference = copy.deepcopy(loss_fn.loss)
    # the queue as it should be: 12 slots written cyclically, the oldest overwritten
    queue_emb = torch.zeros(12, DIM, dtype=torch.float64)
    queue_labels = torch.zeros(12, dtype=torch.int64)
    filled = 0
    for step, classes in enumerate([(0, 1, 2, 3), (2, 3, 4, 5), (0, 5, 6, 7), (1, 2, 6, 7)]):
        emb, labels = batch(step, classes)
        got = loss_fn(emb, labels)
        want = hand_built(reference, emb, labels, queue_emb[:filled], queue_labels[:filled])
        assert torch.equal(got, want), step
        assert loss_fn.last_stats["n_memory_items"] == filled
        slots = (8 * step + torch.arange(8)) % 12
        queue_emb[slots], queue_labels[slots] = emb, labels
        filled = min(12, filled + 8)
        assert torch.equal(loss_fn.memory_embeddings, queue_emb)
        assert torch.equal(loss_fn.memory_labels, queue_labels)
        assert int(loss_fn.memory_position) == 8 * (step + 1) % 12


@pytest.mark.parametrize("name", ["smooth_ap", "recall_at_k", "ap"])
def test_an_anchor_is_ranked_against_the_other_rows_and_the_memory_brute_force(name):
    # independent of reference_leads_with_batch: each anchor alone against the batch without
    # its row, plus the memory; Smooth-AP and Recall@k average over anchors, AP over
    # (anchor, positive) pairs
    loss_fn = make(name)
    memory_emb, memory_labels = batch(1, (0, 1, 4, 5))
    loss_fn(memory_emb, memory_labels)
    emb, labels = batch(2, (0, 1, 2, 3))
    got = loss_fn(emb, labels)
    single = plain(name)
    values, weights = [], []
    for i in range(labels.numel()):
        keep = torch.arange(labels.numel()) != i
        ref = torch.cat([emb[keep], memory_emb])
        ref_labels = torch.cat([labels[keep], memory_labels])
        values.append(single(emb[i : i + 1], labels[i : i + 1], ref, ref_labels))
        weights.append(float((ref_labels == labels[i]).sum()) if name == "ap" else 1.0)
    weights_t = torch.tensor(weights, dtype=torch.float64)
    want = (torch.stack(values) * weights_t).sum() / weights_t.sum()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", MEMORY_LOSSES)
def test_the_gradient_flows_through_the_batch_only(name):
    loss_fn = make(name)
    loss_fn(*batch(0, (0, 1, 4, 5)))
    reference = copy.deepcopy(loss_fn.loss)
    memory_emb = loss_fn.memory_embeddings[:8].clone()
    memory_labels = loss_fn.memory_labels[:8].clone()
    emb, labels = batch(1)
    emb.requires_grad_(True)
    loss_fn(emb, labels).backward()
    # the memory is detached: it holds the batch's values and no graph
    assert not loss_fn.memory_embeddings.requires_grad
    assert torch.equal(loss_fn.memory_embeddings[8:16], emb.detach())
    # the same gradient as the hand-built call with the memory as a constant
    emb2 = emb.detach().clone().requires_grad_(True)
    hand_built(reference, emb2, labels, memory_emb, memory_labels).backward()
    torch.testing.assert_close(emb.grad, emb2.grad, rtol=1e-12, atol=1e-15)
    assert float(emb.grad.abs().max()) > 0


@pytest.mark.parametrize("name", MEMORY_LOSSES)
def test_gradcheck_in_float64_through_the_memory(name):
    params = {"tau2": 0.05} if name in ("ap", "soprc") else {}
    if name == "soprc":
        # training mode moves v with the (detached) scores before the loss: a finite difference
        # would see that move, the gradient (as Alg. 1 defines it) does not; beta 0 holds v
        params["beta"] = 0.0
    if name == "recall_at_k":
        params = {"k_temperature": 4.0, "rank_temperature": 0.1}
    loss_fn = make(name, **params)
    loss_fn(*batch(0, (0, 1, 4, 5)))
    state = copy.deepcopy(loss_fn.state_dict())
    emb, labels = batch(1)

    def f(x):
        loss_fn.load_state_dict(state)  # every evaluation against the same memory
        return loss_fn(x, labels)

    assert loss_fn.last_stats is not None
    assert torch.autograd.gradcheck(f, (emb.requires_grad_(True),), eps=1e-6, atol=1e-6)


def test_before_start_step_the_plain_loss_and_the_memory_fills():
    loss_fn = make("smooth_ap", start_step=2)
    single = plain("smooth_ap")
    for step in range(2):
        emb, labels = batch(step)
        assert torch.equal(loss_fn(emb, labels), single(emb, labels))
        assert loss_fn.last_stats["n_memory_items"] == 0
    assert int(loss_fn.memory_count) == 16  # filled meanwhile
    loss_fn(*batch(2))
    assert loss_fn.last_stats["n_memory_items"] == 16


def test_eval_mode_is_the_plain_loss_and_changes_nothing():
    loss_fn = make("soprc")
    loss_fn(*batch(0))
    before = copy.deepcopy(loss_fn.state_dict())
    loss_fn.eval()
    emb, labels = batch(1)
    want = plain("soprc").eval()
    want.load_state_dict(loss_fn.loss.state_dict())
    assert torch.equal(loss_fn(emb, labels), want(emb, labels))
    for key, value in loss_fn.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_call_that_raises_leaves_the_memory_as_it_was():
    loss_fn = make("ap")
    loss_fn(*batch(0))
    before = copy.deepcopy(loss_fn.state_dict())
    emb, _ = batch(1)
    with pytest.raises(ValueError, match="finite|NaN"):
        loss_fn(emb.clone().fill_(float("nan")), torch.arange(8) % 4)
    for key, value in loss_fn.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_host_labels_on_an_accelerator_copy_and_float32_memory_with_half_rows():
    loss_fn = build_loss("ap", embedding_dim=DIM, memory={"size": 16})
    emb, labels = batch(0)
    value = loss_fn(emb.to(torch.bfloat16), labels)
    assert value.dtype == torch.float32
    assert loss_fn.memory_embeddings.dtype == torch.float32
    assert torch.equal(loss_fn.memory_embeddings[:8], emb.to(torch.bfloat16).float())


def test_bad_use_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="at least the batch size"):
        make("ap", size=4)(*batch(0))
    with pytest.raises(ValueError, match="embedding_dim=3"):
        make("ap")(torch.randn(8, 3, dtype=torch.float64), batch(0)[1])
    with pytest.raises(ValueError, match="takes no `ref_embeddings`"):
        make("ap")(*batch(0), *batch(1))
    with pytest.raises(ValueError, match="takes no memory.*soprc, ap, smooth_ap"):
        build_loss("triplet", embedding_dim=DIM, memory={"size": 16})
    with pytest.raises(ValueError, match="unknown key 'sise'"):
        build_loss("ap", embedding_dim=DIM, memory={"sise": 16})
    with pytest.raises(ValueError, match="embedding_dim"):
        build_loss("ap", memory={"size": 16})
    with pytest.raises(ValueError, match="simix=False"):
        RankingMemory(RecallAtKLoss(simix=True), size=16, embedding_dim=DIM)
    with pytest.raises(ValueError, match="WilcoxonLoss"):
        RankingMemory(build_loss("wilcoxon"), size=16, embedding_dim=DIM)
    loss = build_loss("ap")
    with pytest.raises(ValueError, match="begin with the batch"):
        with loss.reference_leads_with_batch():
            loss(*batch(0), *batch(1, (4, 5, 6, 7)))


def test_the_config_group_is_validated_and_built(tiny_config, tmp_path):
    config = tiny_config(tmp_path / "a", **{"loss.memory": {"size": 60, "start_step": 2}})
    assert config.loss.memory.size == 60 and config.loss.memory.start_step == 2
    with pytest.raises(ConfigError, match=r"loss.memory.size: 10 is smaller than sampler.batch"):
        tiny_config(tmp_path / "b", **{"loss.memory": {"size": 10}})
    with pytest.raises(ConfigError, match="loss 'contrastive' takes no memory"):
        tiny_config(tmp_path / "c", **{"loss.name": "contrastive", "loss.memory.size": 60})
    with pytest.raises(ConfigError, match="start_step"):
        tiny_config(tmp_path / "d", **{"loss.memory": {"size": 60, "start_step": -1}})
    trainer = Trainer.from_config(config)
    assert isinstance(trainer.loss_fn, RankingMemory) and trainer.loss_fn.size == 60


def test_a_resumed_trainer_run_with_memory_equals_the_uninterrupted_one(tiny_config, tmp_path):
    # 20-row batches, a memory of 40: by step 5 it has wrapped (position 20 of 40)
    overrides = {"loss.name": "ap", "loss.memory": {"size": 40, "start_step": 2}}
    full = Trainer.from_config(tiny_config(tmp_path / "full", **overrides)).fit()
    Trainer.from_config(tiny_config(tmp_path / "cut", **overrides)).fit(max_steps=5)
    resumed = Trainer.from_run_dir(tmp_path / "cut").fit()
    assert resumed.test.to_dict() == full.test.to_dict()
    last = [torch.load(d / "checkpoints" / "last.pt", weights_only=False)
            for d in (tmp_path / "full", tmp_path / "cut")]  # fmt: skip
    for part in ("model", "loss"):
        for key, value in last[0][part].items():
            assert torch.equal(value, last[1][part][key]), (part, key)
    assert int(last[0]["loss"]["steps_seen"]) == 8 and int(last[0]["loss"]["memory_count"]) == 40
