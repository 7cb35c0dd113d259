"""What a run killed with SIGKILL leaves behind does not stop its resumption (issue 19, item 7).

kill -9 (or a power cut, a full disk) can interrupt the append of a record to ``metrics.jsonl``
(a last line cut short) and an atomic write (its ``.NAME.XXXX.tmp`` file stays). The torn last
record is dropped with one note (it is of a step after the checkpoint, which the resumed run
replays), the temporary files are removed; a broken line that is not the last is corruption and
stops the resumption with a message naming the file and the line.
"""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.training import ConfigError, Trainer

runner = CliRunner()

TORN = '{"kind": "train", "step": 7, "epoch": 0, "lo'  # the append of step 7, cut short


@pytest.fixture
def config(tiny_config):
    """The tiny run of tests/conftest.py, logging every step."""
    return lambda run_dir: tiny_config(run_dir, log_every=1)


def records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "samples_per_s"} for line in lines]


@pytest.fixture
def killed_at_step_7(tmp_path, config):
    """A run with last.pt at step 6, killed while appending step 7's record and writing files."""
    run_dir = tmp_path / "run"
    Trainer.from_config(config(run_dir)).fit(max_steps=6)
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write(TORN)
    for leftover in (
        "checkpoints/.last.pt.k2x9_q1.tmp",
        "checkpoints/.best.pt.ab12cd34.tmp",
        "checkpoints/.previous.pt.4242.tmp",
        ".metrics.jsonl.zz81mm0p.tmp",
    ):
        (run_dir / leftover).write_bytes(b"PK\x03\x04 partial")
    return run_dir


def leftovers(run_dir):
    return sorted(p.name for p in run_dir.rglob("*.tmp"))


def test_a_torn_last_record_is_dropped_once_and_the_run_ends_as_an_uninterrupted_one(
    tmp_path, config, killed_at_step_7
):
    reference = tmp_path / "reference"
    Trainer.from_config(config(reference)).fit()
    run_dir = killed_at_step_7
    messages = io.StringIO()
    trainer = Trainer.from_run_dir(run_dir, console=Console(file=messages, width=300))
    result = trainer.fit()
    assert result.status == "completed"
    note = messages.getvalue()
    assert note.count("dropped a torn last record") == 1 and "metrics.jsonl" in note, note
    assert records(run_dir) == records(reference)  # every line JSON, step 7 logged once
    assert leftovers(run_dir) == []


def test_the_command_line_resumes_a_killed_run(killed_at_step_7):
    run_dir = killed_at_step_7
    result = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert "JSONDecodeError" not in result.output and "Traceback" not in result.output
    assert "dropped a torn last record" in " ".join(result.output.split())
    assert leftovers(run_dir) == []


def test_a_broken_line_before_the_last_is_corruption_named_with_its_line(killed_at_step_7):
    run_dir = killed_at_step_7
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = "garbage\n"
    path.write_text("".join(lines))
    with pytest.raises(ConfigError, match=r"metrics\.jsonl line 3 is not a JSON record") as info:
        Trainer.from_run_dir(run_dir).fit()
    assert "\n" not in str(info.value)
    result = runner.invoke(app, ["train", "--resume", str(run_dir)])
    assert result.exit_code == 2, result.output
    assert "metrics.jsonl line 3" in " ".join(result.output.split())


def test_the_temporary_files_of_unfinished_writes_go_when_the_run_is_resumed(killed_at_step_7):
    run_dir = killed_at_step_7
    path = run_dir / "metrics.jsonl"
    path.write_text(path.read_text().removesuffix(TORN))  # only the temporary files are left
    assert len(leftovers(run_dir)) == 4
    Trainer.from_run_dir(run_dir).fit(max_steps=7)
    assert leftovers(run_dir) == []
