"""The three ways in of docs/training.md, each an example under examples/, run on a short budget:
your own loop with a rankwise loss and RetrievalMetric, the Trainer with your own model and data,
the command line with a config, and (when lightning is installed) a LightningModule. Each must
show learning: the held-out mAP after training beats the untrained model's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(
        f"rankwise_example_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_loop_learns(capsys):
    scores = load("own_loop").main(steps=20)
    assert scores["after"] > scores["before"] + 0.1
    assert "held-out mAP" in capsys.readouterr().out


def test_trainer_with_own_model_learns_and_writes_nothing_without_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scores = load("trainer_own_model").main(steps=20)
    assert scores["after"] > scores["before"] + 0.1 and scores["test"] > 0.5
    assert list(tmp_path.iterdir()) == []


def test_trainer_example_with_a_run_dir(tmp_path):
    load("trainer_own_model").main(steps=8, run_dir=str(tmp_path / "run"))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "completed" and report["steps"] == 8
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_cli_example(tmp_path):
    out = tmp_path / "cli"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "STEPS": "6"}
    result = subprocess.run(
        ["bash", str(EXAMPLES / "cli.sh")], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "test mAP" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 6 and report["test"]["n_queries"] == 200  # 20 queries x 10 classes


def test_lightning_module_learns():
    pytest.importorskip("lightning", reason="the lightning extra is not installed")
    scores = load("lightning_module").main(steps=20)
    assert scores["after"] > scores["before"] + 0.1
