"""The command line as documented and as a script uses it (issue 14, items 11, 13, 15): `--json -`
writes the report to stdout, `--version` and shell completion exist, `--help` reads as click
writes it, and bad input files are named with the row, never with advice to unpickle."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import rankwise
from rankwise.cli import app

runner = CliRunner()


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(5), 6)
    emb = (rng.normal(size=(5, 4))[labels] + 0.3 * rng.normal(size=(30, 4))).astype(np.float32)
    np.save(tmp_path / "emb.npy", emb)
    np.save(tmp_path / "labels.npy", labels)
    return tmp_path


def test_json_dash_writes_the_report_to_stdout_and_no_file(files, monkeypatch):
    monkeypatch.chdir(files)
    result = runner.invoke(app, ["evaluate", "emb.npy", "labels.npy", "--json", "-"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stdout is the JSON alone: the table went to stderr
    assert 0.0 < report["map"] <= 1.0 and report["n_queries"] == 30
    assert "mAP" in result.stderr
    assert not (files / "-").exists()


def test_version_and_shell_completion():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"rankwise {rankwise.__version__}"
    result = runner.invoke(app, ["--help"])
    assert "--install-completion" in result.stdout and "--show-completion" in result.stdout


@pytest.mark.parametrize("command", ["evaluate", "train", "bench", "tune"])
def test_help_shows_no_bool_type_for_flags_and_upper_case_arguments(command):
    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.stdout
    assert "{" not in result.stdout.split("Usage:")[1].splitlines()[0]
    if command == "evaluate":
        assert "Usage: rankwise evaluate [OPTIONS] EMBEDDINGS LABELS" in result.stdout


def test_a_junk_npy_is_reported_without_advice_to_unpickle(files):
    (files / "junk.npy").write_bytes(b"not an array at all")
    result = runner.invoke(app, ["evaluate", str(files / "junk.npy"), str(files / "labels.npy")])
    assert result.exit_code == 2
    assert "junk.npy is not a numeric .npy array" in result.output
    assert "allow_pickle" not in result.output and "unsafe" not in result.output


def test_nan_embeddings_are_named_by_file_and_row(files):
    emb = np.load(files / "emb.npy")
    emb[7, 2] = np.nan
    emb[11, 0] = np.inf
    np.save(files / "bad.npy", emb)
    result = runner.invoke(app, ["evaluate", str(files / "bad.npy"), str(files / "labels.npy")])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "bad.npy has NaN or inf values in 2 row(s) (row 7, 11" in text
    assert "`query`" not in text


def test_train_has_seed_and_data_dir_as_the_readme_says(tmp_path, tiny_config):
    import yaml

    # the shared tiny run, 2 steps, its progress left to the default (plain lines without a tty)
    config = tiny_config.data(**{"budget.iterations": 2})
    del config["progress"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    args = ["train", "-c", str(path), "-o", str(out), "--seed", "3", "--data-dir", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["seed"] == 3 and saved["dataset"]["data_dir"] == str(tmp_path)
    text = " ".join(result.output.split())
    assert "Test results of the model selected on validation mAP (step 2 of 2)" in text
    # without a terminal, progress is plain log lines, one per print
    assert any(line.startswith("auc on digits: step 2/2") for line in result.output.splitlines())


@pytest.mark.parametrize(
    ("command", "named"),
    [
        (["train", "--data-dir"], "--data-dir"),
        (["bench", "--losses", "auc", "--seeds", "1", "--data-dir"], "--data-dir"),
        (["hash", "train", "dataset.data_dir="], "dataset.data_dir=DIR"),
    ],
    ids=["train", "bench", "hash"],
)
def test_a_missing_dataset_names_the_commands_own_option(tmp_path, tiny_config, command, named):
    """The library's message names the argument `data_dir`; each command words it as its own
    option (hash train has no --data-dir: a KEY=VALUE override)."""
    import yaml

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config.data(**{"dataset.name": "fashion-mnist"})))
    nowhere = str(tmp_path / "nowhere")
    head = command[:2] if command[0] == "hash" else command[:1]
    rest = command[len(head) :]
    if rest[-1].endswith("="):
        rest = [*rest[:-1], rest[-1] + nowhere]
    else:
        rest = [*rest, nowhere]
    args = [*head, "-c", str(path), "-o", str(tmp_path / "out"), *rest]
    result = runner.invoke(app, args)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"Point rankwise at the folder with {named} or the $RANKWISE_DATA" in text, text
    assert "`data_dir`" not in text


@pytest.mark.parametrize(
    "command",
    [["train", "-c"], ["hash", "train", "--config"], ["bench", "--config"], ["tune", "--config"]],
    ids=["train", "hash", "bench", "tune"],
)
@pytest.mark.parametrize("content", ["list", "binary"])
def test_every_command_names_a_config_file_that_is_not_a_mapping(tmp_path, command, content):
    # issue 19, item 8: a bare ValueError (a YAML list) or UnicodeDecodeError (a binary file)
    path = tmp_path / "config.yaml"
    if content == "list":
        path.write_text("- dataset: {name: digits}\n- loss: {name: auc}\n")
    else:
        path.write_bytes(bytes(range(256)) * 4)
    result = runner.invoke(app, [*command, str(path), "--output", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert text.startswith("config error:") and str(path) in text
    assert "a YAML mapping of sections" in text and "Traceback" not in result.output
