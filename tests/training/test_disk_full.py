"""A full disk while a checkpoint is written (issue 19, item 6).

One line naming the run folder and how much space the checkpoint needs against what is free, a
distinct exit code (not 1, which means the run diverged or collapsed), the earlier checkpoints
intact and no temporary file left. The disk fills up partway through ``torch.save`` (the
file's ``write`` raises ENOSPC, which torch wraps in its own RuntimeError), and
``shutil.disk_usage`` reports what a full disk has left.
"""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest
import torch
import yaml
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.commands.common import EXIT_DISK_FULL, EXIT_FAILED, cli_errors
from rankwise.training import Trainer, load_checkpoint
from rankwise.training.errors import DiskFullError

runner = CliRunner()
FREE = 1000  # bytes a full disk has left


class FillsUp:
    """A file that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, handle, room: int) -> None:
        self.handle, self.room = handle, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.handle.write(bytes(data[: self.room]))  # partway, as a real disk fills up
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(n)``: the disk fills up while the checkpoint after ``n`` more is written.

    A checkpoint is a ``torch.save`` of a state holding the optimizer (``last.pt``); ``best.pt``
    is written as long as the disk is not full, nothing once it is.
    """
    real_save = torch.save
    usage = namedtuple("usage", "total used free")

    def arm(checkpoints: int) -> None:
        left = [checkpoints]

        def save(obj, f, *args, **kwargs):
            if not hasattr(f, "fileno"):  # only files on the disk fill it
                return real_save(obj, f, *args, **kwargs)
            if left[0] >= 0 and isinstance(obj, dict) and "optimizer" in obj:
                left[0] -= 1
            if left[0] >= 0:
                return real_save(obj, f, *args, **kwargs)
            monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, FREE))
            return real_save(obj, FillsUp(f, 4096), *args, **kwargs)

        monkeypatch.setattr(torch, "save", save)

    return arm


def leftovers(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp"))


def test_a_full_disk_during_a_checkpoint_names_the_space_needed_and_keeps_the_others(
    tmp_path, full_disk, tiny_config
):
    run_dir = tmp_path / "run"
    trainer = Trainer.from_config(tiny_config(run_dir))
    trainer.fit(max_steps=4)  # last.pt at step 4, previous.pt at step 2, best.pt
    last = (run_dir / "checkpoints" / "last.pt").read_bytes()
    full_disk(0)
    trainer = Trainer.from_run_dir(run_dir)
    with pytest.raises(DiskFullError) as info:
        trainer.fit()  # the checkpoint of step 6 fills the disk
    exc = info.value
    message = str(exc)
    assert "\n" not in message
    assert "no space left on device" in message and str(run_dir) in message
    size = len(last)
    assert 0.9 * size <= exc.needed <= 1.1 * size  # the checkpoint being written
    assert exc.free == FREE
    assert f"{exc.needed - FREE} bytes" in message or "kB" in message or "MB" in message
    assert "step 4" in message  # what is intact
    # last.pt as it was (previous.pt became its copy first), no temporary file left
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == last
    assert load_checkpoint(run_dir / "checkpoints" / "previous.pt")["step"] == 4
    assert load_checkpoint(run_dir / "checkpoints" / "best.pt")["step"] in (2, 4, 6)
    assert leftovers(run_dir) == []


def test_the_command_line_says_it_in_one_line_with_its_own_exit_code(
    tmp_path, full_disk, monkeypatch, tiny_config
):
    config_path = tmp_path / "c.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config.data()))
    run_dir = tmp_path / "run"
    full_disk(1)  # the checkpoint of step 2 is written; the disk fills up after it
    result = runner.invoke(app, ["train", "-c", str(config_path), "--output", str(run_dir)])
    assert result.exit_code == EXIT_DISK_FULL != EXIT_FAILED, result.output
    text = " ".join(result.output.split())
    assert "Traceback" not in result.output and "inline_container" not in result.output
    assert "no space left on device" in text and str(run_dir) in text
    assert f"rankwise train --resume {run_dir}" in text
    assert leftovers(run_dir) == []
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 2
    monkeypatch.undo()  # space was freed: the command it printed finishes the run
    resumed = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert resumed.exit_code == 0, resumed.output


def test_any_other_write_to_a_full_disk_ends_a_command_the_same_way(capsys):
    import typer

    with pytest.raises(typer.Exit) as info, cli_errors("bench"):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/out/bench.json")
    assert info.value.exit_code == EXIT_DISK_FULL
    assert "no space left on device writing /data/out/bench.json" in capsys.readouterr().err
