"""The hash sweep follows bench's rules (issue 20): a run trained with another config is refused,
not silently kept or resumed; unchanged runs are reused; ``overwrite`` retrains; every result file
is written atomically; the sweep leaves matplotlib's global backend alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib
import pytest
import yaml

from rankwise.hashing.workflow import load_hash_config, run_hash_experiment
from rankwise.training import ConfigError

TINY = [
    "dataset.name=digits",
    "dataset.options={}",
    "hash.bits=[8]",
    "hash.methods=[untrained,talr]",
    "budget.iterations=4",
    "budget.epochs=null",
    "eval_every=2",
    "sampler.m=5",
    "sampler.batch_size=50",
    "eval_batch_size=500",
    "threads=1",
    "device=cpu",
]


def sweep(output: Path, *extra: str, overwrite: bool = False) -> list:
    config, settings = load_hash_config(None, [*TINY, *extra])
    return run_hash_experiment(config, settings, output, overwrite=overwrite)


def stored_lr(run_dir: Path) -> float:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["optimizer"]["lr"]


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hash-sweep")
    sweep(out)
    return out


def test_a_changed_learning_rate_is_refused_naming_the_run_and_the_fix(done):
    before = (done / "talr" / "8bits" / "hash_result.json").read_text()
    with pytest.raises(ConfigError) as caught:
        sweep(done, "optimizer.lr=0.01")
    message = str(caught.value)
    # every changed run named, and why (it named the untrained baseline alone, issue 30)
    assert f"2 runs in {str(done)!r} (untrained/8bits, talr/8bits)" in message
    assert "(optimizer.lr: 0.001 stored, 0.01 planned)" in message
    assert "`overwrite`" in message and "another output" in message
    # nothing was kept, resumed or rewritten
    assert (done / "talr" / "8bits" / "hash_result.json").read_text() == before
    assert stored_lr(done / "talr" / "8bits") == 0.001


def test_the_command_refuses_it_with_exit_code_2_naming_its_flags(done):
    from typer.testing import CliRunner

    from rankwise.cli import build_app

    args = ["hash", "train", *TINY, "optimizer.lr=0.01", "--output", str(done)]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 2, result.output
    assert "--overwrite" in result.output and "--output" in result.output
    assert stored_lr(done / "talr" / "8bits") == 0.001


def test_a_rerun_of_the_command_says_it_continues_the_sweep(done):
    from typer.testing import CliRunner

    from rankwise.cli import build_app

    result = CliRunner().invoke(build_app(), ["hash", "train", *TINY, "--output", str(done)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert f"note: {done} holds a sweep: runs completed with this config are kept" in said
    assert said.count("kept from an earlier run") == 2  # untrained and talr


def test_an_unchanged_sweep_reuses_its_runs(done):
    path = done / "talr" / "8bits" / "hash_result.json"
    before = path.stat().st_mtime_ns
    results = sweep(done, "device=cpu")  # the device may change, as in bench
    assert path.stat().st_mtime_ns == before
    assert {r.method for r in results} == {"untrained", "talr"}


def test_an_interrupted_run_with_another_config_is_not_resumed(tmp_path):
    sweep(tmp_path)
    run_dir = tmp_path / "talr" / "8bits"
    (run_dir / "hash_result.json").unlink()  # as if killed after its last checkpoint
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    with pytest.raises(ConfigError, match="overwrite"):
        sweep(tmp_path, "optimizer.lr=0.01")
    assert stored_lr(run_dir) == 0.001


def test_overwrite_retrains_with_the_new_config(tmp_path):
    sweep(tmp_path)
    sweep(tmp_path, "optimizer.lr=0.01", overwrite=True)
    assert stored_lr(tmp_path / "talr" / "8bits") == 0.01
    assert stored_lr(tmp_path / "untrained" / "8bits") == 0.01


def test_every_result_file_is_written_atomically(tmp_path, monkeypatch):
    replaced: list[str] = []
    real_replace = os.replace

    def recording_replace(src, dst, *args, **kwargs):
        replaced.append(Path(dst).name)
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", recording_replace)
    sweep(tmp_path)
    # one atomic rename per result file: hash_result.json of both runs, the sweep's results
    assert replaced.count("hash_result.json") == 2
    assert "results.json" in replaced and "hash_config.yaml" in replaced
    assert json.loads((tmp_path / "talr" / "8bits" / "hash_result.json").read_text())["bits"] == 8


def test_the_report_leaves_matplotlibs_backend_alone(done):
    from rankwise.hashing.workflow import MethodResult, write_report

    results = [MethodResult.from_dict(r) for r in json.loads((done / "results.json").read_text())]
    matplotlib.use("svg")
    try:
        write_report(results, done, prefix="again")
        assert matplotlib.get_backend().lower() == "svg"
    finally:
        matplotlib.use("agg")
    assert (done / "again_tie_ranges.png").stat().st_size > 1000
