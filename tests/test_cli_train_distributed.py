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
    # the command that continues it is the torchrun one: a plain `rankwise train --resume`
    # would be refused (the checkpoint holds the random streams of 2 processes)
    resume = f"torchrun --nproc-per-node 2 -m rankwise train --resume {run_dir}"
    assert resume in " ".join(rank0["cli_output"].split())
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


def test_every_rank_is_refused_when_the_run_folder_is_in_use(launch_ranks_unchecked, tmp_path):
    """Issue 19 item 1: rank 0 takes the run folder's lock for the run; when another process
    holds it, every rank is refused (none waits forever in a collective for rank 0)."""
    from rankwise.training.lock import lock_run_dir

    config = tmp_path / "digits.yaml"
    config.write_text(DIGITS)
    run_dir = tmp_path / "busy"
    with lock_run_dir(run_dir):  # this process: to the ranks, another writer of the folder
        ranks = launch_ranks_unchecked(
            ["-m", "rankwise", "train", "-c", str(config), "--output", str(run_dir)]
        )
    assert [code for code, _ in ranks] == [2, 2], ranks
    # rank 0 alone says it (issue 30: every rank printed the same line)
    assert f"is in use by pid {os.getpid()}" in " ".join(ranks[0][1].split()), ranks
    assert "in use" not in ranks[1][1], ranks
    assert not run_dir.exists()  # nothing was written


def test_a_message_every_rank_would_print_is_printed_once_and_recorded_for_torchrun(
    launch_ranks_unchecked, tmp_path
):
    """Issue 30 item 4: a config error (every rank raises it) is printed by rank 0 alone; each
    rank writes it to its torchrun error file, which torchrun's failure summary shows."""
    config = tmp_path / "digits.yaml"
    config.write_text(DIGITS)
    ranks = launch_ranks_unchecked(
        ["-m", "rankwise", "train", "-c", str(config), "sampler.batch_size=oops"],
        extra_env=lambda rank: {"TORCHELASTIC_ERROR_FILE": str(tmp_path / f"error{rank}.json")},
    )
    assert [code for code, _ in ranks] == [2, 2], ranks
    assert ranks[0][1].count("config error: invalid config:") == 1, ranks
    assert "config error" not in ranks[1][1], ranks
    for rank in (0, 1):
        recorded = json.loads((tmp_path / f"error{rank}.json").read_text())["message"]
        assert recorded["message"].startswith("config error: invalid config:")
        assert "sampler.batch_size" in recorded["message"]
        assert int(recorded["extraInfo"]["timestamp"]) > 0


def test_a_failed_torchrun_job_shows_the_message_once_and_in_its_summary(tmp_path):
    """What docs/distributed.md shows: torchrun's own summary names the failed rank and, as its
    `traceback :` line, rankwise's one-line message; above it the message is printed once."""
    config = tmp_path / "digits.yaml"
    config.write_text(DIGITS)
    proc = torchrun(["-c", str(config), "--output", str(tmp_path / "x"), "sampler.m=oops"])
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 1, output  # torchrun's own code for a failed job
    above, summary = output.split("Root Cause (first observed failure):")
    said = [" ".join(line.split()) for line in above.splitlines()]
    # printed by rank 0 alone (once; not at all if torchrun stopped rank 0 first when rank 1
    # failed before it: the summary says it then)
    assert said.count("config error: invalid config:") in (0, 1), output
    assert "config error: invalid config:" in said or "rank : 1" in " ".join(summary.split())
    # the root cause's `traceback :` line is the message
    root = [" ".join(line.split()) for line in summary.splitlines()]
    assert "traceback : config error: invalid config:" in root, output
    assert any(line.startswith("sampler.m: Input should be a valid integer") for line in root)
    assert "new message format" not in output  # the error file is written as torch's @record does


DIGITS = """\
dataset: {name: digits}
model: {backbone: small_cnn, embedding_dim: 8}
loss: {name: auc, params: {}}
sampler: {m: 4, batch_size: 16}
budget: {iterations: 4}
eval_every: 2
progress: false
threads: 1
"""


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
    said = " ".join(output.split())
    assert said.count(f"training interrupted (Ctrl-C) at step {stopped_at}/40") == 1, output
    assert f"torchrun --nproc-per-node 2 -m rankwise train --resume {run_dir}" in said
    resumed = torchrun(["--resume", str(run_dir)])
    assert resumed.wait(timeout=600) == 0, resumed.communicate()[0]
    assert_same_run(run_dir, reference)
