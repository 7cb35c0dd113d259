"""`rankwise train` as 2 data-parallel processes (gloo, CPU) on digits: stopped and resumed, it
ends exactly where an uninterrupted 2-process run ends; rank 0 alone prints and writes.

The fast test stops the run with --max-steps in the 2-rank worker session
(tests/distributed_worker.py, case "digits") and resumes it as two `python -m rankwise` processes
with the variables torchrun sets (conftest.launch_ranks); the slow one runs torchrun itself and
interrupts it with Ctrl-C (SIGINT) at an arbitrary step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rankwise.training import load_checkpoint


def records(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "samples_per_s"} for r in rows]


def assert_same_run(run_dir: Path, reference: Path) -> None:
    mine, theirs = (load_checkpoint(d / "checkpoints" / "last.pt") for d in (run_dir, reference))
    for part in ("model", "loss"):
        assert mine[part].keys() == theirs[part].keys()
        for key in mine[part]:
            assert torch.equal(mine[part][key], theirs[part][key]), (part, key)
    for index, slots in theirs["optimizer"]["state"].items():
        for key, value in slots.items():
            assert torch.equal(mine["optimizer"]["state"][index][key], value), (index, key)
    assert mine["step"] == theirs["step"] and mine["world_size"] == theirs["world_size"] == 2
    report, expected = (json.loads((d / "report.json").read_text()) for d in (run_dir, reference))
    assert report["test"] == expected["test"] and report["best_step"] == expected["best_step"]
    assert records(run_dir) == records(reference)


def test_stopped_and_resumed_two_process_run_matches_the_uninterrupted_one(
    distributed_results, launch_ranks
):
    out = Path(distributed_results.out_dir)
    reference = out / "digits-uninterrupted"  # DistributedTrainer.from_config(...).fit(), 2 ranks
    rank0, rank1 = distributed_results("digits", 0), distributed_results("digits", 1)
    assert rank0["status"] == "completed" and rank0["steps"] == 10
    # `rankwise train -c digits.yaml --max-steps 6` ran in both ranks of the worker session
    run_dir = out / "digits-cli"
    assert rank0["cli_exit"] == rank1["cli_exit"] == 0, rank0["cli_output"] + rank1["cli_output"]
    assert "stopped after step 6" in rank0["cli_output"]
    assert f"--resume {run_dir}" in rank0["cli_output"]
    assert "stopped after" not in rank1["cli_output"]  # rank 1 prints nothing
    # the command left the process group and stopped its threads: none runs at interpreter exit
    # (a gloo thread alive then aborted a rank under load, exit -6)
    for rank in (rank0, rank1):
        assert not rank["group_after_cli"]
        assert rank["threads_after_cli"] == []
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 6
    resumed = launch_ranks(["-m", "rankwise", "train", "--resume", str(run_dir)])
    assert "resuming" in resumed[0] and "MAP" in resumed[0]
    assert "resuming" not in resumed[1] and "MAP" not in resumed[1]
    assert_same_run(run_dir, reference)


def torchrun(args: list[str], **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    return subprocess.Popen(
        [*command, "2", "-m", "rankwise", "train", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


@pytest.mark.slow
def test_torchrun_interrupted_with_ctrl_c_and_resumed_matches_uninterrupted(
    distributed_results, tmp_path
):
    config = str(Path(distributed_results.out_dir) / "digits.yaml")
    longer = ["budget.iterations=40"]
    reference = tmp_path / "reference"
    done = torchrun(["-c", config, "--output", str(reference), *longer])
    assert done.wait(timeout=600) == 0, done.communicate()[0]

    run_dir = tmp_path / "interrupted"
    proc = torchrun(["-c", config, "--output", str(run_dir), *longer])
    deadline = time.monotonic() + 300
    while not (run_dir / "checkpoints" / "last.pt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)  # torchrun forwards it to both ranks
    output = proc.communicate(timeout=300)[0]
    stopped_at = load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"]
    assert 4 <= stopped_at < 40, output
    assert f"training interrupted at step {stopped_at}/40" in output
    resumed = torchrun(["--resume", str(run_dir)])
    assert resumed.wait(timeout=600) == 0, resumed.communicate()[0]
    assert_same_run(run_dir, reference)
