"""The hashing workflow on the library's Trainer and the ``rankwise hash`` command line: a sweep of
methods and code lengths on digits (quick), its results, the re-evaluation from checkpoints, the
tie-range figure, and configuration errors named by key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from rankwise.cli import build_app
from rankwise.hashing.workflow import (
    DEFAULT_HASH_CONFIG,
    HashingTrainer,
    MethodResult,
    load_hash_config,
    method_config,
    plot_tie_ranges,
    results_table,
)

REPO = Path(__file__).resolve().parents[2]
QUICK = [
    "--dataset",
    "digits",
    "--bits",
    "8,12",
    "--methods",
    "untrained,talr,dpsh,smooth_ap",
    "--quick",
    "sampler.m=5",
    "sampler.batch_size=50",
    "eval_batch_size=500",
    "threads=1",
]


def test_shipped_config_is_the_built_in_default():
    shipped = yaml.safe_load((REPO / "configs" / "hash_fashion_mnist.yaml").read_text())
    assert shipped == DEFAULT_HASH_CONFIG
    config, settings = load_hash_config()
    assert config.dataset.protocol == "closed-set" and settings.bits == [12, 24, 32, 48]


def test_method_configs_differ_only_in_loss_and_code_length():
    config, settings = load_hash_config(None, ["hash.loss_params.dpsh.eta=0.5"])
    talr = method_config(config, settings, "talr", 24, Path("out"))
    mid = method_config(config, settings, "talr_midpoint", 24, Path("out"))
    dpsh = method_config(config, settings, "dpsh", 12, Path("out"))
    triplet = method_config(config, settings, "triplet", 12, Path("out"))
    assert talr.loss.name == "tie_aware_ap" and talr.model.embedding_dim == 24
    assert mid.loss.params == {"form": "midpoint"}
    assert dpsh.loss.name == "dpsh" and dpsh.loss.params == {"eta": 0.5}
    assert triplet.loss.name == "triplet_semihard" and triplet.loss.params == {"margin": 0.2}
    assert talr.resolved_output_dir() == Path("out/talr/24bits")
    for cfg in (mid, dpsh, triplet):
        assert cfg.optimizer == talr.optimizer and cfg.sampler == talr.sampler


def test_hash_config_errors_name_the_key(tmp_path):
    from rankwise.training import ConfigError

    with pytest.raises(ConfigError, match="hash.objective"):
        load_hash_config(None, ["hash.objective=map"])
    with pytest.raises(ConfigError, match="hash.methods"):
        load_hash_config(None, ["hash.methods=[talr,lsh]"])
    with pytest.raises(ConfigError, match="hash.bogus"):
        load_hash_config(None, ["hash.bogus=1"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_hash_config(tmp_path / "missing.yaml")


def test_hashing_trainer_selects_and_tests_by_hamming_ranking():
    from rankwise.data import load_dataset
    from rankwise.hashing import build_hashing_model
    from rankwise.losses import TieAwareAPLoss
    from rankwise.metrics import HammingRetrievalReport

    splits = load_dataset("digits", protocol="closed-set", n_query=10, n_train=40, seed=0)
    torch.manual_seed(0)
    model = build_hashing_model("mlp", splits.input_shape, 16)
    trainer = HashingTrainer(
        model,
        TieAwareAPLoss(16),
        splits.train,
        val_data=splits.val,
        test_data=splits.test,
        gallery_data=splits.gallery,
        iterations=30,
        eval_every=15,
        progress=False,
    )
    result = trainer.fit()
    assert isinstance(result.test, HammingRetrievalReport) and result.test.bits == 16
    assert result.test.n_gallery == len(splits.gallery)
    low, high = result.test.map_range
    assert low <= result.test.map <= high
    assert result.best_val is not None and "ndcg" in result.best_val


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    runner = CliRunner()
    result = runner.invoke(build_app(), ["hash", "train", *QUICK, "--output", str(out)])
    return out, result


def test_cli_train_runs_every_method_and_code_length(sweep):
    out, result = sweep
    assert result.exit_code == 0, result.output
    assert "tie-aware mAP" in result.output and "| talr |" in result.output
    results = json.loads((out / "results.json").read_text())
    assert {(r["method"], r["bits"]) for r in results} == {
        (m, b) for m in ("untrained", "talr", "dpsh", "smooth_ap") for b in (8, 12)
    }
    for r in results:
        assert r["map_range"][0] <= r["map"] <= r["map_range"][1]
    for name in ("results_table.md", "results_tie_ranges.png", "hash_config.yaml"):
        assert (out / name).is_file()
    assert (out / "talr" / "8bits" / "checkpoints" / "best.pt").is_file()


def test_cli_train_again_reuses_completed_runs(sweep):
    out, _ = sweep
    before = (out / "talr" / "8bits" / "hash_result.json").stat().st_mtime_ns
    result = CliRunner().invoke(build_app(), ["hash", "train", *QUICK, "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "talr" / "8bits" / "hash_result.json").stat().st_mtime_ns == before


def test_cli_evaluate_reproduces_the_training_results(sweep):
    out, _ = sweep
    result = CliRunner().invoke(build_app(), ["hash", "evaluate", str(out)])
    assert result.exit_code == 0, result.output
    trained = {(r["method"], r["bits"]): r for r in json.loads((out / "results.json").read_text())}
    evaluated = json.loads((out / "evaluation.json").read_text())
    for r in evaluated:
        # the same selected checkpoint, the same codes: the same tie-aware mAP
        assert r["map"] == pytest.approx(trained[(r["method"], r["bits"])]["map"], abs=1e-12)
    assert (out / "evaluation_tie_ranges.png").is_file()


def test_cli_errors(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(build_app(), ["hash", "train", "--objective", "map", "-o", str(tmp_path)])
    assert bad.exit_code == 2 and "--objective" in bad.output
    missing = runner.invoke(build_app(), ["hash", "evaluate", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "not a sweep directory" in missing.output
    bits = runner.invoke(build_app(), ["hash", "train", "--bits", "a,b", "-o", str(tmp_path)])
    assert bits.exit_code == 2


def test_table_and_tie_range_plot(tmp_path):
    results = [
        MethodResult("talr", 12, 0.5, (0.4, 0.6), 0.8),
        MethodResult("dpsh", 12, 0.45, (0.3, 0.55), 0.7),
        MethodResult("talr", 24, 0.6, (0.55, 0.65), 0.85),
    ]
    table = results_table(results)
    assert "| talr | 0.5000 | 0.6000 |" in table and "| dpsh | 0.4500 | — |" in table
    path = plot_tie_ranges(results, tmp_path / "ranges.png", "test")
    assert path.stat().st_size > 1000
    assert np.isfinite([r.map for r in results]).all()


def test_untrained_codes_are_calibrated_not_collapsed():
    """An untrained centred head keeps batch-norm's initial statistics (mean 0, var 1) unless
    they are set from the data: ReLU features are all positive, so every image then gets the
    same code. calibrate_batch_norm sets the exact data statistics and restores the model."""
    from rankwise.data import load_dataset
    from rankwise.hashing import build_hashing_model
    from rankwise.hashing.workflow import calibrate_batch_norm, encode_dataset

    splits = load_dataset("digits", protocol="closed-set", n_query=10, n_train=40, seed=0)
    torch.manual_seed(0)
    model = build_hashing_model("small_cnn", splits.input_shape, 16, center=True, width=8)
    model.eval()
    raw, _ = encode_dataset(model, splits.train, 128)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    calibrate_batch_norm(model, splits.train, batch_size=37)
    assert not model.training and [m.momentum for m in norms] == momenta
    codes, _ = encode_dataset(model, splits.train, 128)
    assert len(torch.unique(raw, dim=0)) <= 2  # the collapse this guards against
    assert len(torch.unique(codes, dim=0)) > len(codes) // 2
    # every bit is balanced to within sampling error: the head's inputs are centred
    assert codes.float().mean(0).abs().max() < 0.5


@pytest.mark.parametrize("command, prefix", [("evaluate", "evaluation"), ("train", "results")])
def test_cli_help_names_the_files_it_writes(tmp_path, command, prefix):
    from rankwise.hashing.workflow import write_report

    results = [MethodResult("talr", 12, 0.5, (0.4, 0.6), 0.8)]
    written = [p.name for p in write_report(results, tmp_path, prefix=prefix)]
    help_text = (
        CliRunner().invoke(build_app(), ["hash", command, "--help"], env={"COLUMNS": "200"}).output
    )
    for name in written:
        assert name in help_text, (name, help_text)
    # no other name for them (`hash evaluate --help` said table.md and tie_ranges.png)
    assert "table.md" not in help_text.replace(f"{prefix}_table.md", "")
    assert "tie_ranges.png" not in help_text.replace(f"{prefix}_tie_ranges.png", "")


def test_untrained_runs_get_a_run_directory(sweep):
    """docs/hashing.md: each run is a run directory <output>/<method>/<bits>bits, untrained too."""
    out, _ = sweep
    results = {(r["method"], r["bits"]): r for r in json.loads((out / "results.json").read_text())}
    for bits in (8, 12):
        run_dir = out / "untrained" / f"{bits}bits"
        assert results[("untrained", bits)]["run_dir"] == str(run_dir)
        assert (
            yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["embedding_dim"] == bits
        )
        report = json.loads((run_dir / "report.json").read_text())
        assert report["status"] == "completed" and report["steps"] == 0
        assert report["test"]["map"] == pytest.approx(results[("untrained", bits)]["map"], abs=0)
