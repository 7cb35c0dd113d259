"""Config validation of rankwise.training: every error names its dotted key and is raised before
any training step; overrides are typed; the learning-rate schedule matches torch's schedulers."""

from __future__ import annotations

import pytest
import torch
import yaml

from rankwise.training import ConfigError, Trainer, config_from_dict, learning_rate_at, load_config
from rankwise.training.config import apply_overrides, parse_overrides

# the tiny run of tests/conftest.py with SOPRC on 16 dimensions, 4 steps (a dict)
CHANGES = {
    "model.embedding_dim": 16,
    "loss.name": "soprc",
    "budget.iterations": 4,
    "eval_ks": [1, 10, 100],
}


@pytest.fixture
def base(tiny_config):
    return lambda **extra: tiny_config.data(**{**CHANGES, **extra})


def test_unknown_top_level_key_is_named(base):
    with pytest.raises(ConfigError, match=r"learning_rate: unknown key"):
        config_from_dict({**base(), "learning_rate": 0.1})


def test_unknown_nested_key_is_named_with_its_path(base):
    with pytest.raises(ConfigError, match=r"optimizer\.momentun: unknown key"):
        config_from_dict(base(**{"optimizer.momentun": 0.9}))


def test_unknown_loss_is_named(base):
    with pytest.raises(ConfigError, match=r"loss\.name: unknown loss 'sopcr'"):
        config_from_dict(base(**{"loss.name": "sopcr"}))


def test_unknown_dataset_is_named(base):
    with pytest.raises(ConfigError, match=r"dataset\.name: unknown dataset 'digitz'"):
        config_from_dict(base(**{"dataset.name": "digitz"}))


def test_dataset_alias_is_normalized(base):
    assert config_from_dict(base(**{"dataset.name": "fashion_mnist"})).dataset.name == (
        "fashion-mnist"
    )


@pytest.mark.parametrize(("size", "suggested"), [(30, "20"), (32, "20"), (18, "16 or 20")])
def test_batch_size_errors_suggest_a_size_that_then_works(tmp_path, size, suggested, base):
    # digits (open-set) trains on 5 classes: the suggestion must respect m AND the class count
    # (the old message suggested 28 for 30, which holds 7 classes and then failed again)
    config = config_from_dict(base(**{"sampler.batch_size": size, "output_dir": str(tmp_path)}))
    with pytest.raises(ConfigError) as info:
        Trainer.from_config(config)
    message = str(info.value)
    assert message.startswith(f"sampler.batch_size: {size} ")
    assert message.endswith(f"use sampler.batch_size={suggested}.")
    for value in suggested.split(" or "):
        fixed = base(**{"sampler.batch_size": int(value), "output_dir": str(tmp_path / value)})
        Trainer.from_config(config_from_dict(fixed))  # no error


def test_a_batch_of_a_single_class_is_refused_without_data(base):
    with pytest.raises(ConfigError, match=r"sampler\.batch_size: 6 holds fewer than 2 classes"):
        config_from_dict(base(**{"sampler.batch_size": 6}))


def test_budget_needs_exactly_one_of_epochs_or_iterations(base):
    with pytest.raises(ConfigError, match="budget"):
        config_from_dict(base(**{"budget.iterations": None}))
    # overriding one on a config that sets the other: the message says how to clear it
    with pytest.raises(ConfigError) as info:
        config_from_dict(base(**{"budget.epochs": 2}))
    assert "to train 2 epochs add budget.iterations=null" in str(info.value)


def test_switching_the_loss_on_the_command_line_drops_the_old_loss_params(tmp_path, base):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base(**{"loss.params": {"beta": 0.5, "tau1": 0.2}})))
    notes: list[str] = []
    config = load_config(path, ["loss.name=auc", "loss.params.delta_s=0.1"], notes)
    assert config.loss.name == "auc" and config.loss.params == {"delta_s": 0.1}
    assert notes and "beta=0.5" in notes[0] and "soprc" in notes[0]
    # the same loss keeps its params
    kept = load_config(path, ["loss.name=soprc"])
    assert kept.loss.params == {"beta": 0.5, "tau1": 0.2}


def test_unknown_loss_param_raises_before_training(tmp_path, base):
    config = config_from_dict(base(**{"loss.params.betta": 0.1, "output_dir": str(tmp_path / "r")}))
    with pytest.raises(ConfigError, match=r"loss\.params.*'betta'"):
        Trainer.from_config(config)
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_more_classes_per_batch_than_the_training_split_has(tmp_path, base):
    # digits (open-set) trains on 5 classes: 32 / 4 = 8 classes per batch cannot be drawn
    config = config_from_dict(base(**{"sampler.batch_size": 32, "output_dir": str(tmp_path)}))
    with pytest.raises(ConfigError, match=r"sampler\.batch_size: 32 / sampler\.m=4 = 8 classes"):
        Trainer.from_config(config)


def test_milestones_past_the_budget(tmp_path, base):
    config = config_from_dict(
        base(
            **{
                "optimizer.name": "sgd",
                "schedule": {"name": "multistep", "milestones": [2, 9]},
                "output_dir": str(tmp_path),
            }
        )
    )
    with pytest.raises(ConfigError, match=r"schedule\.milestones"):
        Trainer.from_config(config)


def test_overrides_are_typed_by_yaml(tmp_path, base):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base()))
    config = load_config(
        path,
        [
            "loss.params.beta=0.1",
            "model.frozen_bn=false",
            "optimizer.name=SGD",
            "loss.params.semi_variance_weights=[1, 5]",
            "budget.iterations=7",
        ],
    )
    assert config.loss.params == {"beta": 0.1, "semi_variance_weights": [1, 5]}
    assert config.model.frozen_bn is False
    assert config.optimizer.name == "sgd"
    assert config.budget.iterations == 7


def test_malformed_override_and_value_into_a_scalar(base):
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["optimizer.lr"])
    with pytest.raises(ConfigError, match=r"eval_every\.x: eval_every is a value"):
        apply_overrides(base(), {"eval_every.x": 1})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("name", ["multistep", "cosine", "none"])
def test_learning_rate_schedule_matches_torch_schedulers(name, base):
    total = 40
    schedule = {"name": name}
    if name == "multistep":
        schedule.update(milestones=[10, 25], gamma=0.1)
    if name == "cosine":
        schedule.update(min_lr=1e-4)
    config = config_from_dict(
        base(**{"optimizer": {"name": "sgd", "lr": 0.01}, "schedule": schedule})
    )
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.01)
    if name == "multistep":
        ref = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10, 25], gamma=0.1)
    elif name == "cosine":
        ref = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total, eta_min=1e-4)
    else:
        ref = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    for step in range(total):
        assert learning_rate_at(config, step, total) == pytest.approx(
            opt.param_groups[0]["lr"], rel=1e-9, abs=1e-12
        )
        opt.step()
        ref.step()


def test_ablation_plan_reproduces_table_2_rows(tmp_path, base):
    from rankwise.training.bench import plan_bench
    from rankwise.training.build import load_splits, preflight

    data = base(
        **{
            "bench.ablation.sgd": {"name": "sgd", "lr": 0.05},
            "bench.ablation.adam": {"name": "adam", "lr": 0.002},
        }
    )
    runs = plan_bench(data, seeds=[0], ablation=True, output=tmp_path)
    got = [
        (
            r.config.loss.params.get("unbiased"),
            r.config.loss.params.get("use_v"),
            "semi_variance_weights" not in r.config.loss.params,
            r.config.optimizer.name,
            r.config.optimizer.lr,
        )
        for r in runs
    ]
    # Table 2: (unbiased estimator, with v, with L_var, optimizer)
    assert got == [
        (False, False, False, "sgd", 0.05),
        (True, False, False, "sgd", 0.05),
        (True, True, False, "sgd", 0.05),
        (True, True, True, "sgd", 0.05),
        (True, True, True, "adam", 0.002),
    ]
    assert all(r.config.loss.name == "soprc" for r in runs)
    splits = load_splits(runs[0].config)
    for run in runs:  # every variant is accepted by build_loss on the real training labels
        assert preflight(run.config, splits) == 4


def test_bench_plan_keeps_base_params_only_for_the_base_loss(tmp_path, base):
    from rankwise.training.bench import plan_bench

    data = base(
        **{"loss.params.tau1": 0.2, "bench.overrides": {"triplet": {"loss.params.margin": 0.3}}}
    )
    runs = plan_bench(data, losses=["triplet", "soprc"], seeds=[0, 1], output=tmp_path)
    params = {(r.label, r.seed): r.config.loss.params for r in runs}
    assert params[("triplet", 1)] == {"margin": 0.3}
    assert params[("soprc", 0)] == {"tau1": 0.2}
    assert {r.config.output_dir for r in runs} == {
        str(tmp_path / lab / f"seed{s}") for lab in ("triplet", "soprc") for s in (0, 1)
    }


def test_bench_plan_applies_run_overrides_to_every_loss_after_the_switch(tmp_path, base):
    from rankwise.training.bench import plan_bench

    runs = plan_bench(
        base(),
        losses=["blackbox_ap"],
        seeds=[0],
        output=tmp_path,
        run_overrides={"loss.params.lambda_val": 50.0},
    )
    assert runs[0].config.loss.params == {"lambda_val": 50.0}
    with pytest.raises(ConfigError, match="`losses`"):
        plan_bench(
            base(), losses=["soprc"], seeds=[0], output=tmp_path, run_overrides={"loss.name": "auc"}
        )


# -- issue 19, item 8: config files that are not a mapping of sections; cut-offs past int64 -------

BAD_CONFIG_FILES = {
    "a YAML list": (b"- dataset: {name: digits}\n- loss: {name: auc}\n", "its top level is a list"),
    "a number": (b"42\n", "its top level is a number"),
    "a binary file": (bytes(range(256)) * 4, "not a UTF-8 text file"),
    "invalid YAML": (b"dataset: {name: digits\nloss: [\n", "not valid YAML"),
}


@pytest.mark.parametrize("content", sorted(BAD_CONFIG_FILES))
def test_a_config_file_that_is_not_a_mapping_of_sections_is_named_in_one_line(tmp_path, content):
    data, why = BAD_CONFIG_FILES[content]
    path = tmp_path / "config.yaml"
    path.write_bytes(data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert str(path) in message and why in message and "\n" not in message
    if content != "invalid YAML":
        assert "a YAML mapping of sections" in message


def test_eval_ks_past_int64_is_a_config_error_before_training():
    with pytest.raises(ConfigError, match=r"eval_ks.*2\*\*63 - 1"):
        config_from_dict({"dataset": {"name": "digits"}, "eval_ks": [1, 10**30]})
    with pytest.raises(ValueError, match=r"`eval_ks` must hold integers from 1 to 2\*\*63 - 1"):
        Trainer(
            torch.nn.Linear(2, 2),
            torch.nn.MSELoss(),
            torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4)),
            eval_ks=(10**30,),
        )
