"""docs/your_data.md's walk from a folder of images to a served model (issue 39, item 6): every
command of its "The whole path" section is run, in order, on generated photos, with the page's own
config (a smaller training budget appended to the train command, so the test takes seconds)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from rankwise.cli import app

PAGE = Path(__file__).resolve().parents[1] / "docs" / "your_data.md"
SECTION = ("## The whole path on a folder of photos", "## Your data in the config")
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)
QUICK = ["budget.iterations=6", "eval_every=3"]
CLASSES = ["bag", "chair", "cup", "kettle", "lamp", "mug", "shoe", "vase"]


def walkthrough() -> tuple[str, list[str]]:
    """The section's config (its yaml block) and its commands (the lines of its bash blocks)."""
    text = PAGE.read_text()
    section = text[text.index(SECTION[0]) : text.index(SECTION[1])]
    blocks = BLOCK.findall(section)
    (config,) = [body for kind, body in blocks if kind == "yaml"]
    commands = [
        line.strip()
        for kind, body in blocks
        if kind == "bash"
        for line in body.splitlines()
        if line.strip()
    ]
    return config, commands


def test_the_page_walks_train_evaluate_search_show_export_in_order():
    _, commands = walkthrough()
    steps = [c.split()[1] if c.startswith("rankwise") else c.split()[0] for c in commands]
    assert steps == ["train", "embed", "python", "evaluate", "search", "show", "export"]


def test_every_command_of_the_page_runs_on_generated_photos(tmp_path, monkeypatch, write_images):
    write_images(tmp_path / "photos", per_class=8, size=16, names=CLASSES)
    config, commands = walkthrough()
    (tmp_path / "photos.yaml").write_text(config)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    for command in commands:
        words = shlex.split(command)
        if words[0] == "python":
            done = subprocess.run([sys.executable, *words[1:]], capture_output=True, text=True)
            assert done.returncode == 0, (command, done.stderr)
            continue
        assert words[0] == "rankwise", command
        args = words[1:] + (QUICK if words[1] == "train" else [])
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (command, result.output)
    report = json.loads((tmp_path / "runs/photos/report.json").read_text())
    assert report["status"] == "completed" and report["test"]["n_queries"] == 16
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["queries"]) == 8
    assert all(len(q["results"]) == 5 for q in results["queries"])
    assert (tmp_path / "worst.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "worst.html").read_text().count("<tr>") == 8
    meta = json.loads((tmp_path / "photos.pt2.json").read_text())
    assert meta["parity"]["passed"] is True
