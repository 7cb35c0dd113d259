"""DistributedLoss with 2 gloo ranks: the loss and gradients of the global batch, for every loss.

The ranks run tests/distributed_worker.py (once per session, see conftest.py): a float64
MLP in DistributedDataParallel, each rank embedding its slice of a 6-class x 4 batch (even: 3
classes each; uneven: 16 and 8 rows), the loss wrapped in DistributedLoss. The reference is one
process on the concatenated batch without torch.distributed.
"""

from __future__ import annotations

import pytest
import torch

from rankwise.losses import LOSSES, MEMORY_LOSSES

LOSS_RTOL = 1e-13  # measured: <= 2.1e-16 after 1-3 steps (SOPRC 2.1e-15 after 6 steps)
# gradients relative to their largest entry; measured: <= 1.0e-13 (SOPRC, 6 steps), ~4e-16 others
GRAD_RTOL = 1e-12
STATE_ATOL = 1e-13  # loss buffers (SOPRC v, XBM memory); measured: <= 3.3e-16


def close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(b), 1e-300)


def assert_matches_reference(run, ref, steps=None):
    steps = len(ref["losses"]) if steps is None else steps
    for step in range(steps):
        assert close(run["losses"][step], ref["losses"][step], LOSS_RTOL), (step, run, ref)
        for got, want in zip(run["grads"][step], ref["grads"][step], strict=True):
            scale = float(want.abs().max().clamp(min=1e-300))
            assert float((got - want).abs().max()) <= GRAD_RTOL * scale, step


def assert_ranks_identical(a, b):
    assert a["losses"] == b["losses"]
    for grads_a, grads_b in zip(a["grads"], b["grads"], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(grads_a, grads_b, strict=True))
    assert a["loss_state"].keys() == b["loss_state"].keys()
    assert all(torch.equal(a["loss_state"][k], b["loss_state"][k]) for k in a["loss_state"])


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("layout", ["even", "uneven"])
def test_every_loss_gives_the_single_process_value_and_gradient(distributed_results, name, layout):
    rank0, rank1 = distributed_results("losses", 0), distributed_results("losses", 1)
    assert name in rank0, f"the worker did not run loss {name!r}"
    ref = rank0[name]["reference"]
    run0, run1 = rank0[name][layout], rank1[name][layout]
    assert_matches_reference(run0, ref)
    # both ranks computed the same loss and hold the same (DDP-averaged) gradient
    assert_ranks_identical(run0, run1)
    assert run0["in_sync"] == "yes" and run1["in_sync"] == "yes"
    for key, want in ref["loss_state"].items():
        got = run0["loss_state"][key]
        if want.is_floating_point():
            assert got.numel() == 0 or float((got - want).abs().max()) <= STATE_ATOL, key
        else:
            assert torch.equal(got, want), key


@pytest.mark.parametrize("name", MEMORY_LOSSES)
def test_a_memory_under_two_ranks_equals_one_process(distributed_results, name):
    # each rank enqueues the gathered global batch: both hold the one-process memory
    rank0, rank1 = distributed_results("losses", 0), distributed_results("losses", 1)
    entry = rank0.get(f"memory_{name}")
    assert entry is not None, f"the worker did not run the memory of {name!r}"
    ref, run0, run1 = entry["reference"], entry["uneven"], rank1[f"memory_{name}"]["uneven"]
    assert_matches_reference(run0, ref)
    assert_ranks_identical(run0, run1)
    assert run0["in_sync"] == "yes" and run1["in_sync"] == "yes"
    for key, want in ref["loss_state"].items():
        got = run0["loss_state"][key]
        if want.is_floating_point():
            assert float((got - want).abs().max()) <= STATE_ATOL, key
        else:
            assert torch.equal(got, want), key
    # 4 steps of 24 rows in a memory of 48: full, written twice over, used from step 1
    assert int(ref["loss_state"]["memory_count"]) == 48
    assert int(ref["loss_state"]["steps_seen"]) == 4
    assert float(ref["loss_state"]["memory_embeddings"].abs().min()) > 0


def test_soprc_v_stays_identical_across_ranks_and_equal_to_one_process(distributed_results):
    rank0, rank1 = distributed_results("losses", 0), distributed_results("losses", 1)
    ref = rank0["soprc_long"]["reference"]
    run0, run1 = rank0["soprc_long"]["even"], rank1["soprc_long"]["even"]
    assert len(ref["losses"]) == 6
    assert torch.equal(run0["loss_state"]["v"], run1["loss_state"]["v"])
    assert torch.equal(run0["loss_state"]["v_updates"], ref["loss_state"]["v_updates"])
    assert int(ref["loss_state"]["v_updates"].sum()) == 6 * 6  # every class, every step
    v_error = float((run0["loss_state"]["v"] - ref["loss_state"]["v"]).abs().max())
    assert v_error <= STATE_ATOL
    # v moved away from its initial grid: the comparison is not of untouched buffers
    assert float((ref["loss_state"]["v"] - torch.arange(100) / 100).abs().max()) > 0.05
    assert_matches_reference(run0, ref)


def test_sum_reduction_gives_the_gradient_when_ranks_sum_it(distributed_results):
    rank0, rank1 = distributed_results("losses", 0), distributed_results("losses", 1)
    ref = rank0["soprc"]["reference"]  # the same batches; its first 2 steps
    assert_matches_reference(rank0["soprc_sum"]["sum"], ref, steps=2)
    assert_ranks_identical(rank0["soprc_sum"]["sum"], rank1["soprc_sum"]["sum"])


def test_bad_inputs_raise_the_same_error_on_every_rank(distributed_results):
    rank0, rank1 = distributed_results("errors", 0), distributed_results("errors", 1)
    assert "differ in dimension" in rank0["dimension"] and rank0["dimension"] == rank1["dimension"]
    # the rank with the bad input says what is wrong; the other names it
    assert "`labels` has 11 rows" in rank1["label_length"] and "(rank 1)" in rank1["label_length"]
    assert "rank(s) [1]" in rank0["label_length"]
    # NaN on one rank: the loss rejects the gathered batch on both
    assert "NaN" in rank0["nan"] and rank0["nan"] == rank1["nan"]


def test_divergence_is_detected_and_named_on_every_rank(distributed_results):
    for rank in (0, 1):
        message, names, ranks = distributed_results("errors", rank)["divergence"]
        assert names == ["loss.v", "model.0.bias"] and ranks == [1]
        assert "step 7" in message and "loss.v (ranks [1])" in message


def test_trainer_setup_problems_are_named(distributed_results):
    rank0, rank1 = distributed_results("errors", 0), distributed_results("errors", 1)
    for result in (rank0, rank1):
        assert "must divide the classes per batch" in result["odd_classes"]
    # BatchNorm statistics stay per rank on the CPU: said once, by rank 0
    assert len(rank0["batchnorm_warnings"]) == 1 and rank1["batchnorm_warnings"] == []
    assert "model.frozen_bn=true" in rank0["batchnorm_warnings"][0]
