"""The RunStore alone: the one writer of a run folder (lock, results rule, last.pt / best.pt,
resumption, config.yaml, report.json), without a Trainer, in one process and as either rank of a
fake two-process run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import yaml

from rankwise.training import RunResult, RunStore
from rankwise.training.errors import ConfigError, CorruptCheckpointError, DiskFullError
from rankwise.training.lock import RunDirInUseError


def state(step, value=0.0):
    return {"format": RunStore.FORMAT, "world_size": 1, "step": step, "w": torch.tensor([value])}


def test_without_a_folder_nothing_is_written_and_the_selected_model_stays_in_memory(tmp_path):
    store = RunStore(None).open()
    assert store.root is None and not store.holds
    weights = {"w": torch.ones(2)}
    store.save_best(3, {"map": 0.5}, weights, {})
    weights["w"] += 1  # the kept copy is a copy
    assert torch.equal(store.selected_weights("cpu")["w"], torch.ones(2))
    assert store.kept_message() == "nothing was saved (the trainer has no run_dir)"
    with pytest.raises(ValueError, match="no `run_dir`"):
        store.save_last(state(1))
    with pytest.raises(ValueError, match="`resume` needs the `run_dir`"):
        RunStore(None).open(resume=True)


def test_a_folder_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"output_dir: .* already holds a run \(report.json\)"):
        RunStore(run, key="output_dir").open()
    store = RunStore(run, key="output_dir").open(overwrite=True)
    assert store.holds
    store.release()
    assert not store.holds
    with pytest.raises(ValueError, match="not both"):
        RunStore(run).open(resume=True, overwrite=True)


def test_the_lock_is_held_from_open_to_release(tmp_path):
    run = tmp_path / "run"
    store = RunStore(run).open()
    probe = (
        "import sys; from rankwise.training import RunStore\n"
        "try:\n    RunStore(sys.argv[1]).open()\nexcept Exception as e:\n"
        "    print(type(e).__name__)\n"
    )
    held = subprocess.run([sys.executable, "-c", probe, str(run)], capture_output=True, text=True)
    assert held.stdout.strip() == RunDirInUseError.__name__, held.stderr
    store.release()
    assert not (run / ".rankwise.lock").exists()  # given back (the file goes with the lock)


def test_checkpoints_keep_the_previous_good_one_and_resume(tmp_path):
    run = tmp_path / "run"
    store = RunStore(run).open()
    store.prepare(0)
    store.save_last(state(2, 2.0))
    assert not (run / "checkpoints" / "previous.pt").exists()  # nothing good to keep yet
    store.save_last(state(4, 4.0))
    assert torch.load(run / "checkpoints" / "previous.pt")["step"] == 2
    assert store.last_step == 4 and store.last_good_checkpoint == run / "checkpoints" / "last.pt"
    assert "step 4) is kept" in store.kept_message()
    store.release()

    again = RunStore(run).open(resume=True)
    assert again.read_resume_state("cpu")["w"].item() == 4.0 and again.last_step == 4
    again.release()
    older = RunStore(run).open(resume=True, resume_from=run / "checkpoints" / "previous.pt")
    assert older.read_resume_state("cpu")["step"] == 2


def test_a_corrupt_checkpoint_names_the_older_one_that_loads(tmp_path):
    run = tmp_path / "run"
    store = RunStore(run).open()
    store.save_last(state(2))
    store.save_last(state(4))
    store.release()
    (run / "checkpoints" / "last.pt").write_bytes(b"junk")
    with pytest.raises(CorruptCheckpointError) as info:
        RunStore(run).open(resume=True).read_resume_state("cpu")
    assert info.value.fallback == run / "checkpoints" / "previous.pt"
    assert info.value.fallback_step == 2


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path, two_ranks):
    run = tmp_path / "run"
    store = RunStore(run, strategy=two_ranks(0)).open()
    store.save_last({**state(3), "world_size": 2})
    store.release()
    with pytest.raises(ConfigError, match=r"2 data-parallel process\(es\) and this run has 1"):
        RunStore(run).open(resume=True).read_resume_state("cpu")
    torch.save({**state(3), "format": 7}, run / "checkpoints" / "last.pt")
    with pytest.raises(ConfigError, match="unsupported checkpoint format 7"):
        RunStore(run).open(resume=True).read_resume_state("cpu")


def test_a_format_1_checkpoint_gives_its_callback_states_in_the_new_layout(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    old = {**state(5), "format": 1, "best_map": 0.7, "best_step": 4, "best_val": {"map": 0.7}}
    torch.save(old, run / "checkpoints" / "last.pt")
    loaded = RunStore(run).open(resume=True).read_resume_state("cpu")
    assert loaded["callbacks"]["best_checkpoint"] == {
        "best_value": 0.7,
        "best_step": 4,
        "best_val": {"map": 0.7},
    }
    assert loaded["callbacks"]["metrics_logger"] == {"window_losses": []}


def test_the_best_model_is_written_once_by_the_main_process(tmp_path, two_ranks):
    run = tmp_path / "run"
    other = RunStore(run, strategy=two_ranks(1, main_value={"w": torch.zeros(1)})).open()
    other.prepare(0)
    other.save_best(2, {"map": 0.3}, {"w": torch.ones(1)}, {})
    other.save_last(state(2))
    assert not run.exists()  # rank 1 never writes the folder (nor takes its lock)
    assert torch.equal(other.selected_weights("cpu")["w"], torch.zeros(1))  # rank 0's, handed over

    main = RunStore(run, strategy=two_ranks(0), record={"seed": 3}).open()
    main.prepare(0)
    main.save_best(2, {"map": 0.3}, {"w": torch.ones(1)}, {"v": torch.zeros(2)})
    best = torch.load(run / "checkpoints" / "best.pt")
    assert best["step"] == 2 and best["val"] == {"map": 0.3} and best["config"] == {"seed": 3}
    assert torch.equal(main.selected_weights("cpu")["w"], torch.ones(1))
    assert yaml.safe_load((run / "config.yaml").read_text()) == {"seed": 3}


def test_rank_0_running_out_of_space_stops_every_rank(tmp_path, two_ranks):
    store = RunStore(tmp_path / "run", strategy=two_ranks(1, other_code=2)).open()
    with pytest.raises(DiskFullError, match="rank 0 found no space left"):
        store.save_last(state(2))
    failed = RunStore(tmp_path / "run", strategy=two_ranks(1, other_code=1)).open()
    with pytest.raises(RuntimeError, match="rank 0 could not write the checkpoint"):
        failed.save_last(state(2))


def test_a_resumed_run_needs_its_best_checkpoint(tmp_path):
    run = tmp_path / "run"
    store = RunStore(run, record={"seed": 0}).open()
    store.check_best(None)  # nothing selected yet: nothing to check
    with pytest.raises(
        CorruptCheckpointError, match=r"best\.pt is missing.*Train the run again"
    ) as info:
        store.check_best(4)
    assert "--" not in str(info.value)  # the command line adds its own words
    assert "`overwrite`" in str(info.value) and "config.yaml" in str(info.value)


def test_a_fresh_run_deletes_the_earlier_runs_outputs_and_a_resumed_one_keeps_them(tmp_path):
    run = tmp_path / "run"
    store = RunStore(run, stale=[run / "extra.pt"]).open(overwrite=True)
    (run / "checkpoints").mkdir(parents=True)
    for name in ("checkpoints/last.pt", "report.json", "extra.pt", "notes.txt", ".x.pt.1.tmp"):
        (run / name).write_text("old")
    store.prepare(3)
    assert (run / "report.json").exists() and not (run / ".x.pt.1.tmp").exists()
    store.prepare(0)
    assert sorted(p.name for p in run.iterdir()) == [".rankwise.lock", "checkpoints", "notes.txt"]
    assert not (run / "config.yaml").exists()  # no record: a run built from objects


def test_reopening_refuses_a_folder_another_process_wrote_meanwhile(tmp_path):
    run = tmp_path / "run"
    store = RunStore(run).open()
    store.save_last(state(2))
    store.release()
    store.reopen()  # unchanged: taken back
    store.release()
    intruder = RunStore(run).open(resume=True)
    intruder.save_last(state(6))
    intruder.release()
    with pytest.raises(ConfigError, match="written by another process"):
        store.reopen()


def test_the_result_is_written_by_the_main_process_only(tmp_path, two_ranks):
    result = RunResult(tmp_path / "a", "completed", 8, 1.5, 8, {"map": 0.5})
    RunStore(tmp_path / "b", strategy=two_ranks(1)).open().save_result(result)
    assert not (tmp_path / "b" / "report.json").exists()
    main = RunStore(tmp_path / "a").open()
    main.save_result(result)
    assert json.loads((tmp_path / "a" / "report.json").read_text())["steps"] == 8
