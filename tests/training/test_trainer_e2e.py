"""End-to-end training on the bundled digits data with a tiny budget: determinism, bit-exact
resumption (weights, SOPRC's v buffer, optimizer, metrics), weights_only checkpoints, atomic
writes, Ctrl-C and NaN handling."""

from __future__ import annotations

import json

import pytest
import torch

from rankwise.training import (
    NonFiniteLossError,
    Trainer,
    TrainingInterrupted,
    atomic_save,
    load_checkpoint,
)

STEPS = 12


# the tiny run of tests/conftest.py with SOPRC (its per-class vector v is a loss buffer that must
# survive a resume), a cosine schedule, weight decay and 12 steps
CHANGES = {
    "model.embedding_dim": 16,
    "loss.name": "soprc",
    "optimizer.lr": 2e-3,
    "optimizer.weight_decay": 1e-4,
    "schedule": {"name": "cosine"},
    "budget.iterations": STEPS,
    "eval_every": 4,
    "eval_ks": [1, 10],
    "log_every": 2,
    "seed": 3,
}


@pytest.fixture(scope="module")
def make_config(tiny_config):
    return lambda run_dir, **extra: tiny_config(run_dir, **{**CHANGES, **extra})


def final_state(run_dir):
    last = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    best = load_checkpoint(run_dir / "checkpoints" / "best.pt")
    return last, best


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def records(run_dir, kind):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drop = ("samples_per_s",)
    return [{k: v for k, v in r.items() if k not in drop} for r in rows if r["kind"] == kind]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, make_config):
    run_dir = tmp_path_factory.mktemp("reference")
    result = Trainer.from_config(make_config(run_dir)).fit()
    return run_dir, result


def test_run_writes_the_run_directory(reference_run):
    run_dir, result = reference_run
    assert result.status == "completed" and result.steps == STEPS
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "report.json",
        "training_curves.png",
        "pr_curve.png",
        "checkpoints/last.pt",
        "checkpoints/best.pt",
    ):
        assert (run_dir / name).is_file(), name
    report = json.loads((run_dir / "report.json").read_text())
    assert report["steps"] == STEPS and report["test"]["map"] == result.test.map
    assert report["best_step"] in (4, 8, 12)
    assert [r["step"] for r in records(run_dir, "val")] == [4, 8, 12]
    assert [r["step"] for r in records(run_dir, "train")] == list(range(2, STEPS + 1, 2))
    # digits open-set: the test split (classes 5-9) is ranked leave-one-out
    assert result.test.n_queries == 896


def test_checkpoints_load_with_weights_only_and_no_tmp_files_remain(reference_run):
    run_dir, _ = reference_run
    for name in ("last.pt", "best.pt"):
        state = torch.load(run_dir / "checkpoints" / name, weights_only=True)
        assert "model" in state
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert last["step"] == STEPS
    assert "v" in "".join(last["loss"].keys())  # SOPRC's auxiliary vector is checkpointed
    leftovers = [p.name for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_same_seed_gives_identical_metrics_and_weights(reference_run, tmp_path, make_config):
    run_dir, result = reference_run
    again = Trainer.from_config(make_config(tmp_path / "again")).fit()
    assert again.test.to_dict() == result.test.to_dict()
    assert records(tmp_path / "again", "val") == records(run_dir, "val")
    assert_same_tensors(
        final_state(tmp_path / "again")[0]["model"], final_state(run_dir)[0]["model"]
    )


def test_another_seed_gives_other_weights(reference_run, tmp_path, make_config):
    run_dir, _ = reference_run
    Trainer.from_config(
        make_config(tmp_path / "other", seed=4, budget={"iterations": 2}, eval_every=2)
    ).fit()
    other = load_checkpoint(tmp_path / "other" / "checkpoints" / "last.pt")["model"]
    reference = final_state(run_dir)[0]["model"]
    assert any(not torch.equal(other[k], reference[k]) for k in reference)


@pytest.mark.parametrize("stop_at", [6, 8])
def test_interrupted_and_resumed_run_matches_uninterrupted_run(
    reference_run, tmp_path, stop_at, make_config
):
    run_dir, result = reference_run
    interrupted = tmp_path / "interrupted"

    def ctrl_c(trainer):
        if trainer.step == stop_at:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted) as info:
        Trainer.from_config(make_config(interrupted)).fit(callbacks=[ctrl_c])
    assert info.value.step == stop_at
    assert info.value.run_dir == interrupted and info.value.checkpoint_step == stop_at
    assert f"Trainer.from_run_dir({str(interrupted)!r})" in str(info.value)
    assert load_checkpoint(interrupted / "checkpoints" / "last.pt")["step"] == stop_at

    resumed = Trainer.from_run_dir(interrupted)
    assert resumed.step == stop_at
    resumed_result = resumed.fit()
    assert resumed_result.test.to_dict() == result.test.to_dict()
    assert resumed_result.best_step == result.best_step
    (last_a, best_a), (last_b, best_b) = final_state(run_dir), final_state(interrupted)
    assert_same_tensors(last_a["model"], last_b["model"])
    assert_same_tensors(last_a["loss"], last_b["loss"])
    assert_same_tensors(best_a["model"], best_b["model"])
    assert records(interrupted, "val") == records(run_dir, "val")
    assert records(interrupted, "train") == records(run_dir, "train")


def test_max_steps_stops_with_a_checkpoint_and_resume_finishes(
    reference_run, tmp_path, make_config
):
    run_dir, result = reference_run
    stopped = Trainer.from_config(make_config(tmp_path / "r")).fit(max_steps=5)
    assert stopped.status == "stopped" and stopped.steps == 5 and stopped.test is None
    finished = Trainer.from_run_dir(tmp_path / "r").fit()
    assert finished.test.to_dict() == result.test.to_dict()
    assert_same_tensors(final_state(run_dir)[0]["model"], final_state(tmp_path / "r")[0]["model"])


def test_existing_run_directory_is_not_overwritten(reference_run, make_config):
    run_dir, _ = reference_run
    from rankwise.training import ConfigError

    with pytest.raises(ConfigError, match="already holds a run"):
        Trainer.from_config(make_config(run_dir))


def test_nan_loss_stops_with_the_step_number_and_keeps_the_last_good_checkpoint(
    tmp_path, monkeypatch, make_config
):
    trainer = Trainer.from_config(make_config(tmp_path / "nan"))
    real_forward = trainer.loss_fn.forward
    calls = {"n": 0}

    def poisoned(embeddings, labels, *args, **kwargs):
        calls["n"] += 1
        loss = real_forward(embeddings, labels, *args, **kwargs)
        return loss * float("nan") if calls["n"] == 6 else loss

    monkeypatch.setattr(trainer.loss_fn, "forward", poisoned)
    with pytest.raises(NonFiniteLossError, match="at step 6") as info:
        trainer.fit()
    assert info.value.step == 6
    kept = load_checkpoint(tmp_path / "nan" / "checkpoints" / "last.pt")
    assert kept["step"] == 4  # the checkpoint of the last evaluation, untouched
    assert all(torch.isfinite(v).all() for v in kept["model"].values())


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_save({"w": torch.ones(3)}, path)
    with pytest.raises(Exception):  # noqa: B017 - pickling a lambda fails inside torch.save
        atomic_save({"w": torch.zeros(3), "bad": lambda: None}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_epoch_streams_at_most_one_copy_of_the_training_data(
    tmp_path, monkeypatch, num_workers, make_config
):
    """The loop fetches samples item by item through the sampler's batches: over one epoch no
    more items than one copy of the training split (plus the sampler's within-class padding of
    each class's last chunk), exactly batch_size per step."""
    from rankwise.training.build import load_splits

    config = make_config(
        tmp_path / "run",
        **{
            "budget.iterations": None,
            "budget.epochs": 1,
            "eval_every": 10_000,
            "num_workers": num_workers,
        },
    )
    splits = load_splits(config)
    train = splits.train
    counting = type("CountingDataset", (type(train),), {})
    fetched: list[int] = []
    original = type(train).__getitem__

    def getitem(self, index):
        fetched.append(int(index))
        return original(self, index)

    counting.__getitem__ = getitem
    monkeypatch.setattr(train, "__class__", counting)
    trainer = Trainer.from_config(config, splits=splits)
    fetched.clear()  # the constructor checks the first item; count the epoch's fetches only
    trainer.fit()
    n_classes = len(set(train.labels.tolist()))
    if num_workers == 0:  # worker processes count in their own copy of the list
        assert 0 < len(fetched) <= len(train) + n_classes * (config.sampler.m - 1)
        assert len(fetched) == trainer.steps_per_epoch * config.sampler.batch_size
    assert trainer.step == trainer.steps_per_epoch


def test_resume_between_two_train_log_records_logs_the_same_window_mean(
    reference_run, tmp_path, make_config
):
    """log_every=2 and a stop at step 5: the record of step 6 averages the losses of steps 5 and
    6 in an uninterrupted run, so the resumed run must carry step 5's loss in its checkpoint."""
    run_dir, _ = reference_run
    Trainer.from_config(make_config(tmp_path / "odd")).fit(max_steps=5)
    Trainer.from_run_dir(tmp_path / "odd").fit()
    assert records(tmp_path / "odd", "train") == records(run_dir, "train")


def test_resuming_a_completed_run_keeps_a_single_test_record(reference_run, tmp_path, make_config):
    Trainer.from_config(make_config(tmp_path / "done", **{"budget.iterations": 4})).fit()
    Trainer.from_run_dir(tmp_path / "done").fit()
    assert [r["step"] for r in records(tmp_path / "done", "test")] == [4]


def test_rng_state_restores_from_a_checkpoint_mapped_to_the_training_device(device):
    """``_load_last`` maps the checkpoint to the training device, RNG tensors included."""
    import numpy as np

    from rankwise.training.checkpoint import capture_rng_state, restore_rng_state

    np.random.seed(11)  # noqa: NPY002
    state = capture_rng_state()
    expected = np.random.random(4)  # noqa: NPY002

    def to_device(value):
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if isinstance(value, dict):
            return {k: to_device(v) for k, v in value.items()}
        return value

    restore_rng_state(to_device(state))
    assert np.array_equal(np.random.random(4), expected)  # noqa: NPY002


def test_overwrite_removes_the_previous_runs_checkpoints(tmp_path, make_config):
    """A crash of an --overwrite run before its first checkpoint must not leave the old run's
    last.pt next to the new config.yaml, where --resume would pick it up."""
    run_dir = tmp_path / "run"
    Trainer.from_config(make_config(run_dir, **{"budget.iterations": 4})).fit()

    def crash(trainer):
        raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer.from_config(make_config(run_dir, seed=5), overwrite=True).fit(callbacks=[crash])
    assert not (run_dir / "checkpoints" / "last.pt").exists()
    assert not (run_dir / "checkpoints" / "best.pt").exists()
    assert not (run_dir / "report.json").exists()
