"""One writer per run folder (issue 19, item 1): a second `rankwise train` (or `--resume`, or a
sweep) into a folder another process is writing is refused with a message naming that process,
before it reads or writes anything there; a holder killed with SIGKILL leaves no obstacle."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.training import ConfigError, Trainer, config_from_dict, load_checkpoint
from rankwise.training.lock import RunDirInUseError

runner = CliRunner()


@pytest.fixture(scope="module")
def base(tiny_config):
    """The tiny run of tests/conftest.py, 4 steps."""
    return tiny_config.data(**{"budget.iterations": 4})


def one_line(text: str) -> str:
    return " ".join(text.split())


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the holder ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=60)


# rankwise.training.lock in a fresh process without the rankwise.training package's __init__
# (torch and the trainer, seconds of import per process): the same module and lock_run_dir
IMPORT_LOCK = (
    "import sys, types\n"
    "import rankwise\n"
    "package = types.ModuleType('rankwise.training')\n"
    "package.__path__ = [rankwise.__path__[0] + '/training']\n"
    "sys.modules['rankwise.training'] = package\n"
    "from rankwise.training.lock import lock_run_dir\n"
)

# another process that takes a folder's lock and keeps it until it is killed
HOLD = IMPORT_LOCK + (
    "import time\nhold = lock_run_dir(sys.argv[1])\nprint('locked', flush=True)\ntime.sleep(600)\n"
)


@pytest.fixture
def hold_folder():
    """``hold_folder(path)``: a process holding the lock of ``path`` (killed after the test)."""
    holders: list[subprocess.Popen] = []

    def hold(folder: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True
        )
        holders.append(proc)
        assert proc.stdout.readline().strip() == "locked", f"the holder failed ({proc.wait()})"
        return proc

    yield hold
    for proc in holders:
        kill(proc)


def test_a_second_train_into_a_folder_being_trained_is_refused_naming_the_holder(tmp_path, base):
    """Two real `rankwise train` processes racing for one folder; then the holder is killed."""
    run_dir = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**base, "budget": {"iterations": 2000}, "eval_every": 1}))
    holder = subprocess.Popen(
        [sys.executable, "-m", "rankwise", "train", "-c", str(config), "--output", str(run_dir)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        last = run_dir / "checkpoints" / "last.pt"
        wait_for(last.is_file, holder, "its first checkpoint")
        started = (run_dir / "config.yaml").read_text()

        # a fresh run with another seed into the same folder: refused, the holder named
        result = runner.invoke(
            app, ["train", "-c", str(config), "--output", str(run_dir), "--seed", "1"]
        )
        text = one_line(result.output)
        assert result.exit_code == 2, result.output
        assert f"pid {holder.pid}" in text and "in use" in text, text
        assert "--output" in text and "--resume" not in text, text  # the option the user gave

        # a simultaneous --resume (which would log every record twice): refused too
        result = runner.invoke(app, ["train", "--resume", str(run_dir), "--max-steps", "1"])
        text = one_line(result.output)
        assert result.exit_code == 2, result.output
        assert f"pid {holder.pid}" in text and "in use" in text, text
        assert (run_dir / "config.yaml").read_text() == started  # every file is the holder's
        assert yaml.safe_load(started)["seed"] == 0
    finally:
        kill(holder)  # SIGKILL: no handler runs, the lock file stays behind

    # the folder of a killed holder is not blocked: --resume takes it over and continues
    step = load_checkpoint(last)["step"]
    result = runner.invoke(app, ["train", "--resume", str(run_dir), "--max-steps", str(step + 1)])
    assert result.exit_code == 0, result.output
    assert load_checkpoint(last)["step"] == step + 1


def test_the_refusal_of_a_fresh_run_names_the_option_given_not_resume(tmp_path, monkeypatch, base):
    """Issue 19 item 9: a folder holding results is refused under --output, the option the user
    gave (`--resume:` was not passed). Issue 32: the run checks the folder once, before the data
    loads, and holds its lock from then on, so no other writer can put results there while the
    data loads (the race that a second check after loading used to catch)."""
    import fcntl

    from rankwise.training import assembly
    from rankwise.training.lock import LOCK_FILE

    run_dir = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(base))
    load = assembly.load_splits
    loads = []

    def load_while_another_writer_tries(*args, **kwargs):
        # another open file description of the lock file: flock refuses it while the run holds it
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        loads.append(True)
        return load(*args, **kwargs)

    monkeypatch.setattr(assembly, "load_splits", load_while_another_writer_tries)
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    result = runner.invoke(app, ["train", "-c", str(config), "--output", str(run_dir)])
    announced, *rest = result.output.strip().splitlines()
    assert announced.startswith("rankwise train: ")  # what runs, first (issue 40)
    text = one_line("\n".join(rest))
    assert result.exit_code == 2, result.output
    assert text.startswith("config error: --output:") and "--resume:" not in text, text
    assert "output_dir" not in text, text  # every name in it is an option of the command
    assert loads == []  # refused before the data loaded

    (run_dir / "metrics.jsonl").unlink()
    args = ["train", "-c", str(config), "--output", str(run_dir), "--max-steps", "1"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert loads == [True]  # the data loaded with the folder locked


def test_every_sweep_refuses_a_folder_in_use_before_writing_anything(tmp_path, hold_folder, base):
    from rankwise.hashing.workflow import HashSettings, run_hash_experiment
    from rankwise.training.bench import run_bench
    from rankwise.training.tune import tune

    out = tmp_path / "sweep"
    holder = hold_folder(out)
    message = rf"run folder .* is in use by pid {holder.pid} on host"
    with pytest.raises(RunDirInUseError, match=message) as info:
        run_bench(base, losses=["auc"], seeds=[0], output=out)
    assert info.value.holder["pid"] == holder.pid
    with pytest.raises(RunDirInUseError, match=message):
        tune(base, losses=["auc"], grid={"optimizer.lr": [1e-3]}, output=out)
    with pytest.raises(RunDirInUseError, match=message):
        run_hash_experiment(config_from_dict(base), HashSettings(bits=[8]), out)
    assert sorted(p.name for p in out.iterdir()) == [".rankwise.lock"]  # nothing written

    # the command line: exit 2 with the holder named, under the option the user gave
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(base))
    for args, option in (
        (
            ["bench", "-c", str(config), "--losses", "auc", "--seeds", "1", "-o", str(out)],
            "--output",
        ),
        (["bench", "--resume", str(out)], "--resume"),  # before its sweep.json is read
        (["tune", "--resume", str(out)], "--resume"),
        (["hash", "train", "-c", str(config), "--output", str(out)], "--output"),
    ):
        result = runner.invoke(app, args)
        text = one_line(result.output)
        assert result.exit_code == 2, (args, result.output)
        assert f"config error: {option}: run folder" in text and f"pid {holder.pid}" in text, text


def test_a_lock_left_by_a_killed_process_is_no_result_and_no_obstacle(tmp_path, hold_folder, base):
    from rankwise.training.rundir import existing_results, find_run_dirs

    run_dir = tmp_path / "runs" / "auc-seed0"
    kill(hold_folder(run_dir))  # SIGKILL: its lock file stays behind
    assert [p.name for p in run_dir.iterdir()] == [".rankwise.lock"]
    assert existing_results(run_dir) == [] and find_run_dirs(tmp_path / "runs") == []
    result = Trainer.from_config(config_from_dict({**base, "output_dir": str(run_dir)})).fit()
    assert result.status == "completed"
    # the run done, the folder is free again: another process takes it, and this one is refused
    holder = hold_folder(run_dir)
    with pytest.raises(RunDirInUseError, match=f"pid {holder.pid}"):
        Trainer.from_run_dir(run_dir)


def test_a_forked_child_does_not_keep_the_lock_of_a_killed_parent(tmp_path):
    """DataLoader workers are forked from the trainer: killed with it, they may outlive it for a
    few seconds, and must not keep its run folder locked meanwhile."""
    from rankwise.training.lock import lock_run_dir

    script = IMPORT_LOCK + (
        "import os, time\n"
        "hold = lock_run_dir(sys.argv[1])\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    os.write(1, b'child running\\n')\n"
        "    time.sleep(120)\n"
        "    os._exit(0)\n"
        "os.write(1, b'%d\\n' % child)\n"  # one write each: the two lines never interleave
        "time.sleep(600)\n"
    )
    run_dir = tmp_path / "run"
    parent = subprocess.Popen([sys.executable, "-c", script, str(run_dir)], stdout=subprocess.PIPE)
    # kill the parent only once the child runs: fork returns in the parent first, and until the
    # child is scheduled (its at-fork hook closes the lock file) it shares the parent's lock; on a
    # loaded machine the test could otherwise kill the parent inside that window
    lines = {parent.stdout.readline().strip() for _ in range(2)}
    assert b"child running" in lines, lines
    child = int((lines - {b"child running"}).pop())
    try:
        kill(parent)
        with lock_run_dir(run_dir):  # the child still runs, the folder is free
            pass
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_trainer_taking_its_folder_back_refuses_what_another_process_wrote(tmp_path, base):
    run_dir = tmp_path / "run"
    trainer = Trainer.from_config(config_from_dict({**base, "output_dir": str(run_dir)}))
    assert trainer.fit(max_steps=2).status == "stopped"  # the folder is released here
    Trainer.from_run_dir(run_dir).fit(max_steps=3)  # as another process would have
    with pytest.raises(ConfigError, match="was written by another process"):
        trainer.fit()
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 3
    assert Trainer.from_run_dir(run_dir).fit().status == "completed"
