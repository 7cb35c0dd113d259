"""The Trainer for people who bring their own model and data: an nn.Module, a loss and map-style
datasets, no config. run_dir=None writes no file; with a run directory the object-built run resumes
bit for bit (torch LR scheduler, callback state included); what the data must provide, the
defaults, closed-set test galleries and every bad argument named."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from rankwise.losses import APLoss, SmoothAPLoss
from rankwise.sampling import MPerClassBatchSampler
from rankwise.training import (
    Callback,
    ConfigError,
    MetricsLogger,
    ProgressBar,
    Trainer,
    TrainingInterrupted,
    config_from_dict,
    load_checkpoint,
)


def digits_splits():
    """Train on digits 0-4 (first 600 images), validate and test on held-out images."""
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    train = (y < 5) & (torch.arange(len(y)) < 700)
    val = (y < 5) & (torch.arange(len(y)) >= 700)
    test = y >= 5
    return (
        TensorDataset(x[train], y[train]),
        TensorDataset(x[val], y[val]),
        TensorDataset(x[test], y[test]),
    )


TRAIN, VAL, TEST = digits_splits()


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))


def make_trainer(run_dir=None, **kw):
    model = make_model()
    options = dict(
        val_data=VAL,
        test_data=TEST,
        run_dir=run_dir,
        iterations=8,
        eval_every=4,
        log_every=2,
        eval_ks=(1, 10),
        progress=False,
    )
    options.update(kw)
    return Trainer(model, APLoss(), TRAIN, **options)


def test_run_dir_none_writes_no_file_and_keeps_everything_in_memory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = make_trainer()
    result = trainer.fit()
    assert list(tmp_path.iterdir()) == []
    assert result.status == "completed" and result.steps == 8 and result.run_dir is None
    assert result.best_step in (4, 8) and result.best_val["map"] > 0
    assert result.test.n_queries == len(TEST) and result.pr_curve is not None
    kinds = [r["kind"] for r in trainer.history]
    assert kinds.count("train") == 4 and kinds.count("val") == 2 and kinds[-1] == "test"
    # the default optimizer is Adam over the model's parameters
    assert isinstance(trainer.optimizer, torch.optim.Adam)


def test_the_test_uses_the_selected_model_not_the_last_one():
    trainer = make_trainer(iterations=8, eval_every=4)
    result = trainer.fit()
    final_report = trainer.evaluate("test")
    if result.best_step == 8:
        assert final_report.map == result.test.map
    else:  # the model of step 4 was tested, the trainer keeps the final weights
        assert final_report.to_dict() != result.test.to_dict()


def test_an_object_built_run_resumes_bit_for_bit(tmp_path):
    def build(run_dir, **kw):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 3, gamma=0.5)
        return Trainer(
            model,
            APLoss(),
            TRAIN,
            optimizer=optimizer,
            lr_schedule=schedule,
            val_data=VAL,
            test_data=TEST,
            run_dir=run_dir,
            iterations=8,
            eval_every=2,
            log_every=3,
            eval_ks=(1, 10),
            progress=False,
            **kw,
        )

    reference = build(tmp_path / "a").fit()

    def stop_at_5(trainer):
        if trainer.step == 5:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted) as info:
        build(tmp_path / "b").fit(callbacks=[stop_at_5])
    assert info.value.checkpoint_step == 5 and "resume=True" in str(info.value)
    resumed = build(tmp_path / "b", resume=True)
    assert resumed.step == 5
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    result = resumed.fit()
    assert result.test.to_dict() == reference.test.to_dict()
    last_a = load_checkpoint(tmp_path / "a" / "checkpoints" / "last.pt")
    last_b = load_checkpoint(tmp_path / "b" / "checkpoints" / "last.pt")
    for key, value in last_a["model"].items():
        assert torch.equal(value, last_b["model"][key]), key
    assert last_a["lr_scheduler"] == last_b["lr_scheduler"]

    def rows(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [
            {k: v for k, v in json.loads(line).items() if k != "samples_per_s"} for line in lines
        ]

    assert rows(tmp_path / "a") == rows(tmp_path / "b")
    assert (tmp_path / "b" / "report.json").is_file() and not (
        tmp_path / "b" / "config.yaml"
    ).exists()


def test_a_function_schedule_sets_every_step_learning_rate():
    seen = []

    class Spy(Callback):
        def on_train_step_end(self, trainer, output):
            seen.append((output.step, output.lr, trainer.optimizer.param_groups[0]["lr"]))

    make_trainer(lr_schedule=lambda step: 0.01 / (1 + step), callbacks=[Spy()], iterations=3).fit()
    assert seen == [
        (s + 1, pytest.approx(0.01 / (1 + s)), pytest.approx(0.01 / (1 + s))) for s in range(3)
    ]


class StepCounter(Callback):
    """A user callback with state: checkpointed and restored with the run."""

    state_key = "step_counter"

    def __init__(self):
        self.count = 0

    def on_train_step_end(self, trainer, output):
        self.count += 1

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_user_callbacks_are_checkpointed_and_replace_defaults_of_their_type(tmp_path):
    counter = StepCounter()
    bar = ProgressBar(enabled=False)
    trainer = make_trainer(tmp_path / "r", callbacks=[counter, bar])
    assert (
        bar in trainer.callbacks and sum(isinstance(c, ProgressBar) for c in trainer.callbacks) == 1
    )
    trainer.fit(max_steps=4)
    again = StepCounter()
    resumed = make_trainer(tmp_path / "r", callbacks=[again], resume=True)
    assert again.count == 4
    resumed.fit()
    assert again.count == 8


def test_default_sampler_needs_labels_or_a_sampler():
    class NoLabels(Dataset):
        def __len__(self):
            return len(TRAIN)

        def __getitem__(self, i):
            return TRAIN[i]

    with pytest.raises(ValueError, match="`train_data` .* has no `labels` attribute"):
        Trainer(make_model(), APLoss(), NoLabels(), progress=False)
    labels = TRAIN.tensors[1].numpy()
    sampler = MPerClassBatchSampler(labels, m=4, batch_size=12, seed=0)
    trainer = Trainer(
        make_model(), APLoss(), NoLabels(), sampler=sampler, iterations=2, progress=False
    )
    assert trainer.fit().status == "completed"


def test_default_sampler_and_budget():
    trainer = Trainer(make_model(), APLoss(), TRAIN, progress=False)
    # 5 classes: 4 samples x 5 classes per batch; one epoch by default, evaluated once
    assert trainer.sampler.batch_size == 20 and trainer.sampler.m == 4
    assert trainer.total_steps == trainer.steps_per_epoch == trainer.eval_every
    two = Trainer(make_model(), APLoss(), TRAIN, epochs=2, progress=False)
    assert two.total_steps == 2 * two.steps_per_epoch


def test_closed_set_test_ranks_queries_against_the_gallery():
    queries = TensorDataset(TEST.tensors[0][:50], TEST.tensors[1][:50])
    gallery = TensorDataset(TEST.tensors[0][50:], TEST.tensors[1][50:])
    trainer = make_trainer(test_data=queries, gallery_data=gallery, iterations=2)
    result = trainer.fit()
    assert result.test.n_queries == 50 and result.test.n_gallery == len(TEST) - 50


def test_fit_without_test_and_without_validation():
    trainer = make_trainer(val_data=None, iterations=4)
    result = trainer.fit(test=False)
    assert result.test is None and result.best_step is None
    with pytest.raises(ValueError, match="no 'val' data"):
        trainer.evaluate("val")


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"iterations": 2, "epochs": 1}, "not both"),
        ({"iterations": 0}, "`iterations` must be an integer >= 1"),
        ({"eval_every": 2.5}, "`eval_every`"),
        ({"log_every": True}, "`log_every`"),
        ({"seed": -1}, "`seed`"),
        ({"eval_ks": (0,)}, "`eval_ks`"),
        ({"deterministic": 1}, "`deterministic` must be True or False"),
        ({"gallery_data": TEST, "test_data": None}, "`gallery_data`"),
        ({"resume": True}, "`resume` needs the `run_dir`"),
        ({"lr_schedule": 0.1}, "`lr_schedule`"),
        ({"device": "tpu"}, "`device`"),
        ({"val_data": [1, 2, 3]}, r"`val_data\[0\]` must be an \(x, label\) pair"),
    ],
)
def test_bad_arguments_are_named(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        make_trainer(**kwargs)


def test_bad_model_loss_and_config_are_named(tmp_path):
    with pytest.raises(ValueError, match="`loss_fn` must be a torch.nn.Module"):
        Trainer(make_model(), lambda e, y: e.sum(), TRAIN)
    with pytest.raises(ValueError, match="`model` must be a torch.nn.Module"):
        Trainer("resnet", APLoss(), TRAIN)
    config = config_from_dict(
        {"dataset": {"name": "digits"}, "loss": {"name": "ap"}, "budget": {"iterations": 1}}
    )
    with pytest.raises(TypeError, match="Trainer.from_config"):
        Trainer(config, APLoss(), TRAIN)


def test_an_existing_run_is_not_overwritten_silently(tmp_path):
    make_trainer(tmp_path / "r", iterations=2).fit()
    with pytest.raises(ConfigError, match="run_dir: .* already holds a run"):
        make_trainer(tmp_path / "r", iterations=2)
    make_trainer(tmp_path / "r", iterations=2, overwrite=True).fit()


def test_history_is_the_metrics_log(tmp_path):
    trainer = make_trainer(tmp_path / "r", callbacks=[MetricsLogger(log_every=4)])
    trainer.fit()
    logged = [
        json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()
    ]
    assert logged == json.loads(json.dumps(trainer.history))
    assert [r["step"] for r in logged if r["kind"] == "train"] == [4, 8]


def test_any_rankwise_loss_and_a_float64_model(tmp_path):
    model = make_model().double()
    x, y = TRAIN.tensors
    data = TensorDataset(x.double(), y)
    trainer = Trainer(model, SmoothAPLoss(), data, iterations=2, progress=False)
    assert trainer.fit().status == "completed"
    assert np.isfinite(trainer.history[-1]["loss"])


def test_a_custom_metric_and_curve():
    from functools import partial

    from rankwise.metrics import pr_curve, retrieval_metrics

    calls = []

    def curve(*args, **kwargs):
        calls.append(len(args))
        return pr_curve(*args, similarity="dot", **kwargs)

    trainer = make_trainer(
        iterations=2, metric_fn=partial(retrieval_metrics, similarity="dot"), curve_fn=curve
    )
    result = trainer.fit()
    assert result.test.similarity == "dot" and result.best_val["similarity"] == "dot"
    assert calls == [4]  # query, labels and the (absent) gallery
    with pytest.raises(ValueError, match="`metric_fn` must be a function"):
        make_trainer(metric_fn="map")


def test_ctrl_c_without_a_run_dir_stops_after_the_step_and_says_nothing_was_saved():
    def stop(trainer):
        if trainer.step == 3:
            raise KeyboardInterrupt

    trainer = make_trainer()
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit(callbacks=[stop])
    assert info.value.step == 3 and info.value.checkpoint_step is None
    assert "nothing was saved" in str(info.value) and "Resume" not in str(info.value)
    assert trainer.step == 3
    with pytest.raises(ValueError, match="`progress` must be True or False"):
        make_trainer(progress="yes")


def test_sigterm_stops_after_the_step_with_a_checkpoint_like_ctrl_c(tmp_path):
    """What a scheduler (or torchrun, forwarding it) sends: handled like Ctrl-C, then restored."""
    import os
    import signal

    def sigterm(trainer):
        if trainer.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    trainer = make_trainer(tmp_path / "run")
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit(callbacks=[sigterm])
    assert info.value.step == 3 and info.value.checkpoint_step == 3
    assert "checkpoint saved at step 3" in str(info.value)
    assert signal.getsignal(signal.SIGTERM) is before


# -- the Trainer's shape (issue 32): owned parts, grouped settings ----------------------------------


def test_the_trainer_holds_its_parts_instead_of_inheriting_them():
    from rankwise.training import Evaluator, RunStore, StopControl

    assert Trainer.__bases__ == (object,)  # no mixin chain
    trainer = make_trainer()
    assert isinstance(trainer.store, RunStore) and trainer.store.root is None
    assert isinstance(trainer.evaluator, Evaluator) and trainer.evaluator.ks == (1, 10)
    assert isinstance(trainer.stop_control, StopControl)
    assert trainer.evaluator.strategy is trainer.strategy is trainer.store.strategy


def test_the_constructor_takes_at_most_15_parameters():
    import inspect

    parameters = inspect.signature(Trainer).parameters
    assert len(parameters) <= 15, list(parameters)


def test_settings_groups_run_as_their_keywords(tmp_path):
    from rankwise.training import Logging, Runtime, Schedule

    flat = make_trainer(tmp_path / "flat", seed=3).fit()
    model = make_model()
    grouped = Trainer(
        model,
        APLoss(),
        TRAIN,
        val_data=VAL,
        test_data=TEST,
        run_dir=tmp_path / "grouped",
        schedule=Schedule(iterations=8, eval_every=4),
        runtime=Runtime(seed=3),
        logging=Logging(log_every=2, progress=False),
        eval_ks=(1, 10),
    ).fit()
    assert grouped.test.to_dict() == flat.test.to_dict() and grouped.best_step == flat.best_step


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"schedule": "fast"}, TypeError, "`schedule` must be a Schedule"),
        ({"iterations": 3, "schedule": None, "logging": None, "epochz": 2}, TypeError, "'epochz'"),
    ],
)
def test_bad_groups_and_unknown_keywords_are_named(kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        Trainer(make_model(), APLoss(), TRAIN, **kwargs)


def test_a_group_and_its_own_keywords_are_not_both_accepted():
    from rankwise.training import Schedule

    with pytest.raises(
        TypeError, match=r"pass `schedule` or its fields \(eval_every, iterations\)"
    ):
        Trainer(make_model(), APLoss(), TRAIN, schedule=Schedule(), iterations=3, eval_every=1)


def test_a_given_run_store_is_used_as_it_was_opened(tmp_path):
    from rankwise.training import RunStore

    store = RunStore(tmp_path / "r", key="output").open()
    trainer = make_trainer(store, iterations=2)
    assert trainer.store is store and trainer.run_dir == tmp_path / "r"
    trainer.fit()
    assert (tmp_path / "r" / "report.json").is_file() and not store.holds
    with pytest.raises(ValueError, match="`resume`: the given RunStore was opened with its own"):
        make_trainer(RunStore(tmp_path / "s").open(), resume=True)
