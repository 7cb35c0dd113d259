"""A factory backbone through the config path (issue 38, item 5): ``model.backbone:
"package.module:factory"`` trained a few steps, saved, and rebuilt from the run folder by
``load_run``, ``rankwise embed``, ``rankwise export`` and ``Trainer.from_run_dir`` with the same
embeddings; a factory that no longer imports is named by the reload's error."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.training import ConfigError, Trainer, load_config, load_run
from rankwise.workflows.export import export_run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODULE = "own_backbone"  # examples/own_backbone.py, the example of docs/training.md


@pytest.fixture(scope="module")
def nets_dir():
    """examples/ on sys.path, as docs/training.md's PYTHONPATH=examples puts it."""
    sys.path.insert(0, str(EXAMPLES))
    yield str(EXAMPLES)
    sys.path.remove(str(EXAMPLES))
    sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, nets_dir):
    run_dir = tmp_path_factory.mktemp("runs") / "factory"
    # the shipped example config, 4 steps of a 3-channel network
    overrides = [
        f"output_dir={run_dir}",
        "model.backbone_options.channels=3",
        "budget.iterations=4",
        "eval_every=2",
        "progress=false",
    ]
    trainer = Trainer.from_config(load_config(EXAMPLES / "own_backbone.yaml", overrides))
    trainer.fit()
    return run_dir, trainer


def test_the_run_records_the_factory_and_its_options(trained):
    run_dir, trainer = trained
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]
    assert saved["backbone"] == f"{MODULE}:conv_net" and saved["backbone_options"] == {
        "channels": 3
    }
    assert trainer.model.backbone.out_features == 12  # the option reached the factory


def test_load_run_rebuilds_the_trained_network(trained):
    run_dir, trainer = trained
    x = load_digits().images[:40]
    run = load_run(run_dir, checkpoint="last")
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.model(run.preprocess(x))
    assert torch.equal(run.embed(x), expected)


def test_embed_and_export_rebuild_it_from_the_run_folder(trained, tmp_path):
    run_dir = trained[0]
    np.save(tmp_path / "x.npy", load_digits().images[:30])
    out = tmp_path / "emb.npy"
    result = CliRunner().invoke(
        app, ["embed", str(run_dir), str(tmp_path / "x.npy"), "--output", str(out)]
    )
    assert result.exit_code == 0, result.output
    expected = load_run(run_dir).embed(load_digits().images[:30]).numpy()
    assert np.array_equal(np.load(out), expected)
    exported = export_run(run_dir, "torchscript", tmp_path / "model.ts")
    assert exported.passed, exported.max_abs_diff


def test_from_run_dir_continues_with_the_factory(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained[0], copy)
    trainer = Trainer.from_run_dir(copy, max_steps=6)
    assert trainer.step == 4 and trainer.model.backbone.out_features == 12
    trainer.fit()
    assert trainer.step == 6


def test_a_factory_that_no_longer_imports_is_named(trained, nets_dir, monkeypatch):
    run_dir = trained[0]
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != nets_dir])
    monkeypatch.delitem(sys.modules, MODULE)
    with pytest.raises(
        ConfigError,
        match=rf"needs backbone '{MODULE}:conv_net' \(model.backbone in "
        rf"its config.yaml, options \{{'channels': 3\}}\).*module '{MODULE}' "
        "does not import.*PYTHONPATH",
    ):
        load_run(run_dir)
    result = CliRunner().invoke(app, ["embed", str(run_dir), "x.npy", "--output", "e.npy"])
    assert result.exit_code == 2 and f"{MODULE}:conv_net" in result.output


def test_config_errors_name_the_key(tiny_config, nets_dir, tmp_path):
    with pytest.raises(ConfigError, match="model.backbone.*package.module:factory"):
        tiny_config(tmp_path / "a", **{"model.backbone": "nets:make:v2"})
    bad_options = tiny_config(
        tmp_path / "b",
        **{"model.backbone": f"{MODULE}:conv_net", "model.backbone_options": {"k": 1}},
    )
    with pytest.raises(ConfigError, match=r"^model.backbone_options: .*does not take the options"):
        Trainer.from_config(bad_options)
    bad_module = tiny_config(tmp_path / "c", **{"model.backbone": "rw_no_such_nets:make"})
    with pytest.raises(ConfigError, match=r"^model.backbone: .*'rw_no_such_nets' does not import"):
        Trainer.from_config(bad_module)


def test_rankwise_train_without_timm_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` raises ImportError
    args = ["train", "--config", str(EXAMPLES / "own_backbone.yaml"), "--output", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "model.backbone=timm:resnet18", "budget.iterations=1"])
    assert result.exit_code == 3, result.output
    assert "pip install 'rankwise[timm]'" in " ".join(result.output.split())


def test_docs_show_the_example_factory():
    # docs/training.md quotes examples/own_backbone.py's factory (its docstring left out)
    import ast

    source = (EXAMPLES / "own_backbone.py").read_text()
    func = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    func.body = func.body[1:]  # without the docstring
    docs = (EXAMPLES.parent / "docs" / "training.md").read_text()
    block = docs.split("```python\nfrom torch import nn\n\n\ndef conv_net", 1)[1].split("```")[0]
    quoted = ast.parse("def conv_net" + block).body[0]
    assert ast.dump(quoted) == ast.dump(func)
    config = yaml.safe_load((EXAMPLES / "own_backbone.yaml").read_text())["model"]
    assert f'backbone: "{config["backbone"]}"' in docs


def test_pretrain_refuses_backbone_options_it_would_drop(tmp_path):
    args = ["pretrain", "--config", str(EXAMPLES / "own_backbone.yaml"), "--output", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "model.backbone_options: rankwise pretrain builds" in " ".join(result.output.split())
