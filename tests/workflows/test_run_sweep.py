"""The sweep engine alone (issue 32, item 3): ``run_sweep`` on a fake plan whose runs train
nothing. It owns the folder's lock, ``sweep.json``, the refusal of runs stored with another
config, resume (a completed run kept, an interrupted one continued from its checkpoint), the
summary rewritten atomically after every run, failed and skipped runs, and the interruption
message."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rankwise.training import ConfigError, NonFiniteLossError, TrainingInterrupted
from rankwise.training.lock import LOCK_FILE
from rankwise.training.rundir import RunPaths
from rankwise.workflows.sweep import (
    FinishedRun,
    SweepPlan,
    SweepRun,
    SweepSummary,
    json_text,
    run_sweep,
)
from rankwise.workflows.sweepdir import SweepPaths


class FakeSweep:
    """A plan of fake runs: each 'trains' by writing its config and report, or as told."""

    def __init__(self, output: Path, names: Sequence[str] = ("a", "b", "c"), **plan: Any) -> None:
        self.output = output
        self.names = list(names)
        self.lr: dict[str, float] = {}  # per run: the planned learning rate (default 0.001)
        self.behaviour: dict[str, Any] = {}  # per run: an exception to raise, or a callable
        self.calls: list[tuple[str, bool]] = []  # (run, resume) of every train call
        self.seen: list[list[str]] = []  # the summary file on disk when each train started
        self.reports: list[list[tuple[str, str]]] = []
        self.finished_calls = 0
        self.plan_options = plan

    @property
    def summary_path(self) -> Path:
        return self.output / "summary.json"

    # the shared tiny config of tests/conftest.py (set for every test by shared_config below)
    tiny_config: Any = None

    def config(self, name: str) -> Any:
        """The planned config of run ``name``: the tiny config at its learning rate."""
        return self.tiny_config(self.output / name, **{"optimizer.lr": self.lr.get(name, 0.001)})

    def train(self, name: str, resume: bool) -> str:
        self.calls.append((name, resume))
        on_disk = json.loads(self.summary_path.read_text()) if self.summary_path.is_file() else []
        self.seen.append(on_disk)
        what = self.behaviour.get(name)
        if isinstance(what, BaseException):
            raise what
        if callable(what):
            what()
        paths = RunPaths(self.output / name)
        paths.root.mkdir(parents=True, exist_ok=True)
        paths.config.write_text(json.dumps(self.config(name).to_dict()))
        paths.report.write_text(json.dumps({"status": "completed", "name": name}))
        return f"{name}:{'resumed' if resume else 'trained'}"

    def kept(self, name: str) -> str | None:
        report = RunPaths(self.output / name).report
        return f"{name}:kept" if report.is_file() else None

    def run(self, name: str, **options: Any) -> SweepRun[str]:
        return SweepRun(
            name,
            self.config(name),
            lambda resume: self.train(name, resume),
            lambda: self.kept(name),
            **options,
        )

    def plan(
        self, per_run: dict[str, dict[str, Any]] | None = None, **hooks: Any
    ) -> SweepPlan[str]:
        options = {"kept_in": "their results are in summary.json", **self.plan_options, **hooks}
        return SweepPlan(
            kind="fake",
            output=self.output,
            runs=[self.run(name, **(per_run or {}).get(name, {})) for name in self.names],
            report=lambda done: self.reports.append([(f.run.name, f.how) for f in done]),
            **options,
        )

    def summarise(self, done: Sequence[FinishedRun[str]], complete: bool) -> SweepSummary[Any]:
        value = {"complete": complete, "results": [f.result for f in done]}

        def finish() -> None:
            self.finished_calls += 1

        files = {self.summary_path: json_text([f.result for f in done])}
        return SweepSummary(value, files, finish if complete else None)


def recorded(output: Path, names: Sequence[str] = ("a", "b", "c")) -> FakeSweep:
    """A sweep recorded in sweep.json (as bench and tune: settings, its own result file)."""
    return FakeSweep(output, names, settings={"grid": [1, 2]}, files=("summary.json",))


@pytest.fixture(autouse=True)
def shared_config(tiny_config: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fake run's config starts from the shared tiny config."""
    monkeypatch.setattr(FakeSweep, "tiny_config", tiny_config)


@pytest.fixture
def fake(tmp_path: Path) -> FakeSweep:
    return recorded(tmp_path / "sweep")


def test_every_run_trains_and_the_summary_is_rewritten_atomically_after_each(fake, monkeypatch):
    replaced: list[str] = []
    real_replace = os.replace

    def recording_replace(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        replaced.append(Path(dst).name)
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", recording_replace)
    locked = []
    fake.behaviour["b"] = lambda: locked.append((fake.output / LOCK_FILE).is_file())
    value = run_sweep(fake.plan(), fake.summarise)

    assert value == {"complete": True, "results": ["a:trained", "b:trained", "c:trained"]}
    # each run started with the summary of the runs before it on disk
    assert fake.seen == [[], ["a:trained"], ["a:trained", "b:trained"]]
    # one atomic replacement per run and one for the complete summary; sweep.json once
    assert replaced.count("summary.json") == 4 and replaced.count("sweep.json") == 1
    assert fake.finished_calls == 1
    assert fake.reports[-1] == [("a", "trained"), ("b", "trained"), ("c", "trained")]
    assert locked == [True] and not (fake.output / LOCK_FILE).exists()  # held, then released
    record = json.loads(SweepPaths(fake.output).record.read_text())
    assert record == {
        "kind": "fake",
        "settings": {"grid": [1, 2]},
        "runs": [str(fake.output / name) for name in "abc"],
    }


def test_a_folder_with_results_is_refused_unless_resumed_or_overwritten(fake):
    run_sweep(fake.plan(), fake.summarise)
    before = fake.summary_path.read_text()
    with pytest.raises(ConfigError, match="already holds results.*`resume`.*`overwrite`"):
        run_sweep(fake.plan(), fake.summarise)
    assert fake.summary_path.read_text() == before and len(fake.calls) == 3
    with pytest.raises(ConfigError, match="pass one"):
        run_sweep(fake.plan(), fake.summarise, resume=True, overwrite=True)
    fake.names = ["a"]  # overwrite: the previous sweep's runs are deleted first
    value = run_sweep(fake.plan(), fake.summarise, overwrite=True)
    assert value["results"] == ["a:trained"]
    assert not (fake.output / "b").exists() and not (fake.output / "c").exists()


def test_a_resumed_sweep_keeps_finished_runs_and_continues_the_interrupted_one(fake):
    fake.behaviour["b"] = lambda: (_checkpoint(fake, "b"), _raise(interrupted_at(3)))
    with pytest.raises(TrainingInterrupted) as info:
        run_sweep(fake.plan(), fake.summarise)
    said = str(info.value)
    assert said.startswith(
        "fake interrupted (Ctrl-C) in run b at step 3/10: checkpoint saved at step 3; 1 of 3 "
        "runs finished (their results are in summary.json)"
    ), said
    assert info.value.checkpoint_step == 3 and info.value.step == 3
    assert f"the same call with resume=True (output={str(fake.output)!r})" in said
    assert json.loads(fake.summary_path.read_text()) == ["a:trained"]  # the finished run kept

    del fake.behaviour["b"]
    fake.calls.clear()
    value = run_sweep(fake.plan(), fake.summarise, resume=True)
    assert value["results"] == ["a:kept", "b:resumed", "c:trained"]
    assert fake.calls == [("b", True), ("c", False)]  # a is not trained again
    assert fake.reports[-1] == [("a", "kept"), ("b", "resumed"), ("c", "trained")]


def test_runs_stored_with_another_config_are_refused_before_anything_is_written(fake):
    run_sweep(fake.plan(), fake.summarise)
    record = SweepPaths(fake.output).record.read_text()
    summary = fake.summary_path.read_text()
    fake.lr.update(a=0.01, c=0.5)
    fake.calls.clear()
    with pytest.raises(ConfigError) as info:
        run_sweep(fake.plan(), fake.summarise, resume=True)
    message = str(info.value)
    # every changed run named, the first one's keys, and the fix; today's wording
    assert message.startswith(
        f"output: 2 runs in {str(fake.output.parent)!r} (sweep/a, sweep/c) were made with "
        "another config than this sweep plans for them (optimizer.lr: 0.001 stored, 0.01 "
        "planned); start the sweep afresh with `overwrite`"
    ), message
    assert fake.calls == []
    assert SweepPaths(fake.output).record.read_text() == record
    assert fake.summary_path.read_text() == summary


def test_resuming_needs_the_same_settings(fake):
    run_sweep(fake.plan(), fake.summarise)
    fake.plan_options["settings"] = {"grid": [1, 3]}
    with pytest.raises(ConfigError, match="started with other settings"):
        run_sweep(fake.plan(), fake.summarise, resume=True)
    with pytest.raises(ConfigError, match="holds no fake sweep to resume"):
        run_sweep(recorded(fake.output.parent / "empty").plan(), fake.summarise, resume=True)


def test_a_failed_run_is_recorded_and_skips_the_rest_of_its_group(tmp_path):
    fake = FakeSweep(tmp_path / "s", ["a", "b", "c", "d"])
    fake.behaviour["a"] = NonFiniteLossError("loss is nan", 2, None)
    seconds: list[float] = []

    def failed(error: NonFiniteLossError, took: float) -> str:
        seconds.append(took)
        return f"failed at step {error.step}"

    options = {
        name: {"failed": failed, "group": group} for name, group in zip("abcd", "xxyy", strict=True)
    }
    value = run_sweep(fake.plan(options), fake.summarise)
    # b shares a's group: not run; c and d go on
    assert value["results"] == ["failed at step 2", "c:trained", "d:trained"]
    assert [name for name, _ in fake.calls] == ["a", "c", "d"]
    assert len(seconds) == 1 and seconds[0] >= 0


def test_a_failure_without_a_handler_ends_the_sweep_with_the_finished_runs_kept(tmp_path):
    fake = FakeSweep(tmp_path / "s")
    fake.behaviour["b"] = NonFiniteLossError("loss is nan", 2, None)
    with pytest.raises(NonFiniteLossError):
        run_sweep(fake.plan(), fake.summarise)
    assert json.loads(fake.summary_path.read_text()) == ["a:trained"]
    assert [name for name, _ in fake.calls] == ["a", "b"]


def test_an_interruption_between_runs_or_before_the_first_names_no_run(tmp_path):
    fake = FakeSweep(tmp_path / "s", ["a"])

    def stop() -> None:
        raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted) as info:
        run_sweep(fake.plan(start=stop), fake.summarise, resume_hint="the hint")
    said = str(info.value)
    assert said.startswith("fake interrupted (Ctrl-C); the run had not finished"), said
    assert info.value.checkpoint_step is None and fake.calls == []

    fake = FakeSweep(tmp_path / "t", ["a", "b"])
    fake.behaviour["b"] = interrupted_at(1, signal.SIGTERM)
    with pytest.raises(TrainingInterrupted) as info:
        run_sweep(fake.plan(), fake.summarise, resume_hint="the hint")
    assert info.value.signal_number == signal.SIGTERM
    assert str(info.value).startswith("fake interrupted (SIGTERM) in run b at step 1/10")
    assert f"the hint (output={str(fake.output)!r})" in str(info.value)


def test_a_sweep_without_settings_continues_when_run_again_and_overwrite_retrains(tmp_path):
    fake = FakeSweep(tmp_path / "s", ["a", "b"])  # as the hash sweep: no sweep.json
    fake.behaviour["b"] = interrupted_at(2)
    with pytest.raises(TrainingInterrupted, match=r"Resume with the same call again"):
        run_sweep(fake.plan(), fake.summarise)
    del fake.behaviour["b"]
    assert run_sweep(fake.plan(), fake.summarise)["results"] == ["a:kept", "b:trained"]
    assert not SweepPaths(fake.output).record.exists()
    # a changed config is refused the same way, and overwrite trains every run anew
    fake.lr["b"] = 0.1
    with pytest.raises(ConfigError, match=r"the run in '.*/b' was made with another config"):
        run_sweep(fake.plan(), fake.summarise)
    value = run_sweep(fake.plan(), fake.summarise, overwrite=True)
    assert value["results"] == ["a:trained", "b:trained"]


def test_records_are_written_after_the_checks_and_prepare_comes_first(tmp_path):
    fake = FakeSweep(tmp_path / "s", ["a"])
    order: list[str] = []
    record = fake.output / "record.yaml"

    def prepare() -> None:
        order.append("prepare")
        assert not record.exists()

    def start() -> None:
        order.append("start")
        assert record.read_text() == "kind: fake\n"

    fake.behaviour["a"] = lambda: order.append("a")
    plan = fake.plan(prepare=prepare, start=start, records={record: "kind: fake\n"})
    run_sweep(plan, fake.summarise)
    assert order == ["prepare", "start", "a"]


def _checkpoint(fake: FakeSweep, name: str) -> None:
    """What an interrupted run leaves: its config and a checkpoint, no report."""
    paths = RunPaths(fake.output / name)
    paths.checkpoints.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(json.dumps(fake.config(name).to_dict()))
    paths.last.write_bytes(b"checkpoint")


def _raise(error: BaseException) -> None:
    raise error


def interrupted_at(step: int, number: int = signal.SIGINT) -> TrainingInterrupted:
    """The interruption a Trainer raises at ``step`` of 10, its checkpoint saved."""
    return TrainingInterrupted(
        "training interrupted",
        step,
        None,
        step,
        signal_number=number,
        detail=f"at step {step}/10: checkpoint saved at step {step}",
    )
