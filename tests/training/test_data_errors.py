"""Data errors of image datasets (issue 40, items 2-3), on a tiny SOP-layout tree written here.

Before the first step every listed image file is opened (``dataset.preflight``): a missing or
broken one is one ``config error`` line naming the file and its list row, exit 2, nothing
written; the check is cached by the file list's fingerprint, and ``--no-preflight`` skips it. A
file that breaks during the run stops it with one ``data error`` line, a checkpoint at the step it
reached, and ``--resume`` (once the file is fixed) finishes with the uninterrupted run's result.
"""

from __future__ import annotations

import importlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from rich.console import Console
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.data import load_dataset
from rankwise.training import Trainer, build, load_config
from rankwise.training.callbacks import PlotCurves

runner = CliRunner()

HEADER = "image_id class_id super_class_id path"
TRAIN_CLASSES, TEST_CLASSES, PER_CLASS = (1, 2, 3, 4, 5, 6), (7, 8, 9), 5
CONFIG = {
    "dataset": {"name": "sop", "image_size": 8, "val_fraction": 0.25},
    "model": {"backbone": "small_cnn", "embedding_dim": 8},
    "loss": {"name": "soprc", "params": {}},
    "sampler": {"m": 2, "batch_size": 4},
    "optimizer": {"name": "adam", "lr": 1e-3},
    "budget": {"iterations": 6},
    "eval_every": 2,
    "eval_ks": [1],
    "eval_batch_size": 16,
    "log_every": 2,
    "threads": 1,
    "progress": False,
}


def write_sop(base: Path) -> Path:
    """A Stanford Online Products tree of tiny PNGs: 6 training and 3 test classes of 5 images."""
    root = base / "Stanford_Online_Products"
    rows: dict[str, list[str]] = {"train": [], "test": []}
    image_id = 1
    for split, classes in (("train", TRAIN_CLASSES), ("test", TEST_CLASSES)):
        for c in classes:
            for k in range(PER_CLASS):
                rel = f"bicycle_final/{c}_{k}.png"
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                rng = np.random.default_rng(image_id)
                pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
                pixels[..., 0] = 20 * c  # the class shows in the red channel: learnable
                Image.fromarray(pixels).save(root / rel)
                rows[split].append(f"{image_id} {c} 1 {rel}")
                image_id += 1
    (root / "Ebay_train.txt").write_text("\n".join([HEADER, *rows["train"]]) + "\n")
    (root / "Ebay_test.txt").write_text("\n".join([HEADER, *rows["test"]]) + "\n")
    return root


def line_of(list_file: Path, path: str) -> int:
    """The 1-based line of ``list_file`` naming the image ``path``."""
    rel = Path(path).relative_to(list_file.parent).as_posix()
    lines = list_file.read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.endswith(f" {rel}"))


@pytest.fixture(autouse=True, scope="module")
def _no_figures():
    """The figures take most of a tiny run's time and decide nothing here."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PlotCurves, "on_fit_end", lambda self, trainer, result: None)
        yield


@pytest.fixture(scope="module")
def sop(tmp_path_factory):
    """The data tree, its splits and a config file (one per module: runs compare on it)."""
    base = tmp_path_factory.mktemp("data")
    root = write_sop(base)
    config = base / "sop.yaml"
    config.write_text(
        yaml.safe_dump({**CONFIG, "dataset": {**CONFIG["dataset"], "data_dir": str(base)}})
    )
    splits = load_dataset("sop", data_dir=base, val_fraction=0.25, image_size=8)
    return {"base": base, "root": root, "config": config, "splits": splits}


@pytest.fixture(scope="module")
def reference(sop, tmp_path_factory):
    """An uninterrupted run on the intact data: what every resumed run must reproduce."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = runner.invoke(app, ["train", "-c", str(sop["config"]), "--output", str(out)])
    assert result.exit_code == 0, result.output
    return out


def train(sop, out: Path, *extra: str):
    return runner.invoke(app, ["train", "-c", str(sop["config"]), "--output", str(out), *extra])


def one_line(output: str, head: str) -> str:
    """The single line of ``output`` starting with ``head`` (the message is one line)."""
    lines = [line for line in output.splitlines() if line.startswith(head)]
    assert len(lines) == 1, output
    assert "Traceback" not in output, output
    return lines[0]


def same_result(run: Path, reference: Path) -> None:
    """Same steps, selected step, test report and final weights as the reference run."""
    got, want = (json.loads((d / "report.json").read_text()) for d in (run, reference))
    assert got["status"] == want["status"] == "completed"
    for key in ("steps", "best_step", "best_val", "test"):
        assert got[key] == want[key], key
    weights = [
        torch.load(d / "checkpoints" / "last.pt", weights_only=True)["model"]
        for d in (run, reference)
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


class Broken:
    """Break files of the tree (missing, or bytes that are no image) and restore them."""

    def __init__(self) -> None:
        self.saved: dict[Path, bytes] = {}

    def remove(self, path: str | Path) -> None:
        path = Path(path)
        self.saved[path] = path.read_bytes()
        path.unlink()

    def corrupt(self, path: str | Path) -> None:
        path = Path(path)
        self.saved.setdefault(path, path.read_bytes())
        path.write_bytes(b"\x89PNG\r\n\x1a\n this is no longer an image")

    def restore(self) -> None:
        for path, data in self.saved.items():
            path.write_bytes(data)
        self.saved.clear()


@pytest.fixture
def broken():
    files = Broken()
    yield files
    files.restore()  # the module's tree stays intact for the next test


@pytest.fixture
def decodes(monkeypatch):
    """How many files the pre-flight check opened."""
    preflight_module = importlib.import_module("rankwise.data.preflight")
    opened: list[str] = []
    check = preflight_module._image_problem

    def counting(path: str) -> str | None:
        opened.append(path)
        return check(path)

    monkeypatch.setattr(preflight_module, "_image_problem", counting)
    return opened


# ---------------------------------------------------------------- item 2: the pre-flight check


def test_missing_and_corrupt_images_are_one_config_error_before_anything_is_written(
    sop, broken, tmp_path
):
    val_file, train_file = sop["splits"].val.paths[0], sop["splits"].train.paths[0]
    broken.remove(val_file)  # listed in Ebay_train.txt, held out for validation
    broken.corrupt(train_file)
    out = tmp_path / "runs" / "run"
    result = train(sop, out)
    assert result.exit_code == 2, result.output
    line = one_line(result.output, "config error:")
    list_file = sop["root"] / "Ebay_train.txt"
    assert line.startswith("config error: dataset 'sop': ")
    missing = f"{val_file!r} ({list_file}, line {line_of(list_file, val_file)}): missing"
    corrupt = f"{train_file!r} ({list_file}, line {line_of(list_file, train_file)}): not an image"
    assert missing in line and corrupt in line
    assert not (tmp_path / "runs").exists()  # no run folder, no file


def test_the_check_is_cached_by_the_file_list_and_repeated_when_a_file_changes(
    sop, broken, decodes, tmp_path
):
    n_files = len(TRAIN_CLASSES + TEST_CLASSES) * PER_CLASS
    out = tmp_path / "run"
    first = train(sop, out, "--max-steps", "2")
    assert first.exit_code == 0, first.output
    assert len(decodes) == n_files and (out / "preflight.json").is_file()
    resumed = runner.invoke(app, ["train", "--resume", str(out), "--max-steps", "4"])
    assert resumed.exit_code == 0, resumed.output
    assert len(decodes) == n_files  # the same files: not opened again
    # a resumed run keeps its saved setting: the flag is refused like other config changes
    flagged = runner.invoke(app, ["train", "--resume", str(out), "--no-preflight"])
    assert flagged.exit_code == 2 and "drop --no-preflight" in flagged.output, flagged.output
    broken.corrupt(sop["splits"].test.paths[0])  # a changed file changes the fingerprint
    refused = runner.invoke(app, ["train", "--resume", str(out)])
    assert refused.exit_code == 2, refused.output
    assert "Ebay_test.txt, line 2): not an image" in one_line(refused.output, "config error:")
    assert len(decodes) == 2 * n_files


@pytest.mark.parametrize("skip", [["--no-preflight"], ["dataset.preflight=false"]])
def test_the_check_can_be_skipped(sop, decodes, tmp_path, skip):
    result = train(sop, tmp_path / "run", "--max-steps", "2", *skip)
    assert result.exit_code == 0, result.output
    assert decodes == [] and not (tmp_path / "run" / "preflight.json").exists()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["dataset"]["preflight"] is False


def test_a_large_file_list_says_what_it_checks(sop, monkeypatch):
    monkeypatch.setattr(build, "PROGRESS_FROM", 10)  # the tree's 45 files count as large
    out = io.StringIO()
    opened = build.check_data_files(
        load_config(sop["config"]), sop["splits"], None, Console(file=out)
    )
    assert opened == 45
    assert out.getvalue() == "checking the 45 image files of sop (dataset.preflight)\n"


# -------------------------------------------------------- item 3: a file that breaks mid-run


@pytest.mark.parametrize(
    ("split", "list_name", "stopped"), [("val", "Ebay_train.txt", 2), ("test", "Ebay_test.txt", 6)]
)
def test_a_file_missing_at_evaluation_stops_with_a_checkpoint_and_resumes_exactly(
    sop, broken, reference, tmp_path, split, list_name, stopped
):
    data = getattr(sop["splits"], split)
    broken.remove(data.paths[1])
    out = tmp_path / "run"
    result = train(sop, out, "--no-preflight")  # as if the file went missing after the check
    assert result.exit_code == 2, result.output
    line = one_line(result.output, "data error:")
    list_file = sop["root"] / list_name
    where = f"({list_file}, line {line_of(list_file, data.paths[1])}; sample 1 of dataset 'sop/{split}')"
    assert f"{data.paths[1]!r} {where} does not exist" in line
    assert (
        f"stopped at step {stopped}/6 reading the {'validation' if split == 'val' else 'test'} data"
        in line
    )
    assert (
        f"checkpoint at step {stopped}; once the file is fixed, resume with: rankwise train --resume {out}"
        in line
    )
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=False)
    assert state["step"] == stopped and state["validation_pending"] == (split == "val")
    assert not (out / "report.json").exists()
    broken.restore()
    resumed = runner.invoke(app, ["train", "--resume", str(out)])
    assert resumed.exit_code == 0, resumed.output
    same_result(out, reference)


def test_a_training_image_broken_mid_run_stops_at_that_step_and_resumes_exactly(
    sop, broken, reference, tmp_path, monkeypatch
):
    run_step = Trainer._run_step

    def breaking(self, batches):
        if self.step == 3 and not broken.saved:  # after the pre-flight check passed
            for path in sop["splits"].train.paths:
                broken.corrupt(path)
        return run_step(self, batches)

    monkeypatch.setattr(Trainer, "_run_step", breaking)
    out = tmp_path / "run"
    result = train(sop, out)
    assert result.exit_code == 2, result.output
    line = one_line(result.output, "data error:")
    assert "could not be decoded" in line and "Ebay_train.txt, line" in line
    assert "stopped at step 3/6 reading the training data with a checkpoint at step 3" in line
    assert torch.load(out / "checkpoints" / "last.pt", weights_only=False)["step"] == 3
    monkeypatch.setattr(Trainer, "_run_step", run_step)
    broken.restore()
    resumed = runner.invoke(app, ["train", "--resume", str(out)])
    assert resumed.exit_code == 0, resumed.output
    same_result(out, reference)


# ------------------------------------------------------------------------- embed on bad files


def test_embed_names_a_corrupt_or_missing_image_in_one_line(reference, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(folder / "a.png")
    (folder / "b.png").write_bytes(b"not an image")
    result = runner.invoke(
        app, ["embed", str(reference), str(folder), "-o", str(tmp_path / "e.npy")]
    )
    assert result.exit_code == 2, result.output
    line = one_line(result.output, "data error:")
    assert f"{str(folder / 'b.png')!r} (an image of INPUT) could not be decoded" in line
    assert not (tmp_path / "e.npy").exists()


def test_a_data_error_in_a_loader_worker_keeps_its_type_and_one_line_message(sop, broken):
    from rankwise.data import DataError, UnreadableImageError
    from rankwise.sampling import MPerClassBatchSampler
    from rankwise.training.loader import training_loader

    train = sop["splits"].train
    for path in train.paths:
        broken.corrupt(path)
    sampler = MPerClassBatchSampler(train.labels, 2, 4, seed=0)
    batches = training_loader(
        train, sampler, seed=0, epoch=0, position=0, num_workers=1, pin_memory=False
    )
    with pytest.raises(UnreadableImageError) as caught:  # re-raised from the worker
        next(iter(batches))
    assert "Original Traceback" in str(caught.value)
    line = DataError.one_line(caught.value)
    assert line.startswith("image file '") and "Traceback" not in line
    assert "Ebay_train.txt, line" in line and line.endswith(
        "the file is truncated or not an image."
    )


def test_a_sweep_checks_the_files_once_for_all_its_runs(sop, broken, decodes, tmp_path):
    from rankwise.training import ConfigError
    from rankwise.workflows.bench import BenchRun, prepare_splits

    config = load_config(sop["config"])
    runs = [BenchRun("soprc", seed, config) for seed in (0, 1)]
    cache = tmp_path / "preflight.json"
    prepare_splits(runs, lambda run: f"run {run.seed}", cache)
    assert len(decodes) == 45 and cache.is_file()  # one check for both runs
    prepare_splits(runs, lambda run: f"run {run.seed}", cache)
    assert len(decodes) == 45  # cached
    broken.remove(sop["splits"].test.paths[0])
    with pytest.raises(ConfigError, match=r"Ebay_test.txt, line 2\): missing"):
        prepare_splits(runs, lambda run: f"run {run.seed}", cache)
