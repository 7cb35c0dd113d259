"""DistributedTrainer with 2 gloo ranks (tests/distributed_worker.py, case "trainer").

A float64 MLP trained with SOPRC (stateful) on 8 clustered classes, P x K = 4 x 4 global batches:
the 2-rank run against one process with the same objects, an interruption that reaches one rank
only, its resumption, rank 0 alone writing, and a resume with another world size.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from rankwise.training import ConfigError, Trainer, load_checkpoint

WEIGHT_ATOL = 1e-12  # measured: 5.7e-15 after 10 Adam steps (float64)


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_train_like_one_process_on_the_concatenated_batch(distributed_results):
    rank0, rank1 = distributed_results("trainer", 0), distributed_results("trainer", 1)
    run, single = rank0["uninterrupted"], rank0["single"]
    # every rank ends with the same weights, SOPRC v, report and selection
    assert same_tensors(run["model"], rank1["uninterrupted"]["model"])
    assert same_tensors(run["loss"], rank1["uninterrupted"]["loss"])
    assert run["test"] == rank1["uninterrupted"]["test"]
    # and with what one process computes on the same global batches (float64 rounding only)
    for key in single["model"]:
        assert float((run["model"][key] - single["model"][key]).abs().max()) <= WEIGHT_ATOL, key
    v_error = (run["loss"]["v"].double() - single["loss"]["v"].double()).abs().max()
    assert float(v_error) <= WEIGHT_ATOL
    assert torch.equal(run["loss"]["v_updates"], single["loss"]["v_updates"])
    assert run["best_step"] == single["best_step"]
    assert run["test"]["map"] == pytest.approx(single["test"]["map"], rel=1e-12, abs=0)
    assert run["test"]["n_queries"] == single["test"]["n_queries"] == 42
    kinds = [(r["kind"], r["step"]) for r in run["history"]]
    assert kinds == [(r["kind"], r["step"]) for r in single["history"]]
    for mine, theirs in zip(run["history"], single["history"], strict=True):
        if mine["kind"] == "train":
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-12)
    # the default MPerClassBatchSampler was sharded: rank 1 holds slots 8..15 of each batch
    assert rank0["sampler"] == ["DistributedMPerClassBatchSampler", 0]
    assert rank1["sampler"] == ["DistributedMPerClassBatchSampler", 8]


def test_only_rank_0_writes_the_run_directory(distributed_results):
    out = Path(distributed_results.out_dir)
    assert not distributed_results("trainer", 1)["rank1_dir_exists"]
    assert not (out / "uninterrupted-rank1").exists()
    run_dir = out / "uninterrupted"
    for name in ("metrics.jsonl", "report.json", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert (run_dir / name).is_file(), name
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert last["world_size"] == 2 and len(last["rng_per_rank"]) == 2
    # one record per evaluation and logged step, not one per rank
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [(r["kind"], r["step"]) for r in records] == [
        ("train", 2), ("val", 3), ("train", 4), ("train", 6), ("val", 6), ("train", 8),
        ("val", 9), ("train", 10), ("val", 10), ("test", 10),
    ]  # fmt: skip
    report = json.loads((run_dir / "report.json").read_text())
    assert (
        report["test"]["map"] == distributed_results("trainer", 0)["uninterrupted"]["test"]["map"]
    )


def test_a_stop_on_one_rank_stops_both_and_the_resumed_run_matches(distributed_results):
    for rank in (0, 1):
        result = distributed_results("trainer", rank)
        # a SIGTERM reached rank 1 during step 4: both ranks stopped after step 4 with a checkpoint
        assert result["stopped_at"] == (4, 4)
        assert result["resumed_from"] == 4
        resumed, uninterrupted = result["resumed"], result["uninterrupted"]
        assert same_tensors(resumed["model"], uninterrupted["model"])
        assert same_tensors(resumed["loss"], uninterrupted["loss"])
        assert resumed["test"] == uninterrupted["test"]
        assert resumed["best_step"] == uninterrupted["best_step"]
    rank0 = distributed_results("trainer", 0)
    assert rank0["resumed"]["history"] == rank0["uninterrupted"]["history"]


def _worker_module():
    path = Path(__file__).parents[1] / "distributed_worker.py"
    spec = importlib.util.spec_from_file_location("distributed_worker", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_resume_with_another_world_size_is_refused(distributed_results, tmp_path):
    worker = _worker_module()
    run_dir = Path(distributed_results.out_dir) / "interrupted"
    with pytest.raises(ConfigError) as info:
        worker.trainer_objects(Trainer, run_dir, resume=True)
    assert "2 data-parallel process(es) and this run has 1" in str(info.value)
    assert "torchrun --nproc-per-node 2" in str(info.value)  # how to resume it


def test_each_rank_ranks_its_share_of_the_queries_and_gets_the_single_process_report(
    distributed_results,
):
    # issue 32 item 4: the ranking of a data-parallel evaluation is sharded, the numbers identical
    single = distributed_results("sharded_evaluation", 0)["single"]
    assert single["rows"] == {"metric": [35, 42], "curve": [42]}  # validation, then test
    shares = []
    for rank in (0, 1):
        run = distributed_results("sharded_evaluation", rank)["distributed"]
        shares.append(run["rows"])
        assert run["test"] == single["test"]  # every field, exactly
        assert run["best_val"] == single["best_val"]
        # NDCG@k and MRR (issue 37) merged from the ranks' shares like every other field
        assert set(run["test"]["ndcg_at"]) == {"1", "5"} and 0 < run["test"]["mrr"] <= 1
        assert run["best_val"]["mrr"] == single["best_val"]["mrr"]
        assert run["scalars"] == single["scalars"]
        assert run["scalars"]["ndcg@5"] == run["test"]["ndcg_at"]["5"]
        assert torch.equal(run["curve"], single["curve"])
    # validation 35 queries, test 42: each rank ranked its half, together all of them once
    assert [share["metric"] for share in shares] == [[17, 21], [18, 21]]
    assert [share["curve"] for share in shares] == [[21], [21]]


def test_a_custom_metric_fn_and_curve_fn_evaluate_the_distributed_run(distributed_results):
    # issue 20: the data-parallel evaluation replaced metric_fn / curve_fn by the default metrics
    single = distributed_results("custom_metric", 0)["single"]
    for rank in (0, 1):
        run = distributed_results("custom_metric", rank)["distributed"]
        assert run["metric_calls"] == single["metric_calls"] == 2  # validation, then test
        assert run["curve_calls"] == single["curve_calls"] == 1
        assert run["test"]["map"] == pytest.approx(single["test"]["map"], rel=1e-12, abs=0)
        assert run["test"]["n_queries"] == single["test"]["n_queries"] == 42
        torch.testing.assert_close(run["curve"], single["curve"], rtol=1e-12, atol=0)
