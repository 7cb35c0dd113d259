"""docs/hashing.md says what the code does (issue 19, item 13): its loss-versus-mAP example prints
the numbers it states, its AP_T@k note agrees with its own tables, and its quick sweep command uses
options and a dataset that `rankwise hash train` has."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import typer

from rankwise.cli import build_app
from rankwise.data import DATASETS

DOC = Path(__file__).resolve().parents[2] / "docs" / "hashing.md"


def squeeze(text: str) -> str:
    return " ".join(text.split())


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_loss_example_prints_what_the_docs_say():
    """The loss of hard codes is 1 - mean AP_T over the anchors it keeps: not 1 - mAP_T when an
    anchor has no irrelevant item (the metrics keep it, with AP_T = 1)."""
    (block,) = [b for b in code_blocks("python") if "n_skipped_no_negative" in b]
    # "print(...)  # 0.1944: ..." states what that print shows
    stated = [
        line.split("#", 1)[1].split()[0].rstrip(":")
        for line in block.splitlines()
        if line.startswith("print(")
    ]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(DOC), "exec"), {})
    assert out.getvalue().split() == stated
    assert stated[0] != stated[2]  # the point of the example: loss != 1 - mAP_T


def table_rows(heading: str) -> list[list[str]]:
    section = DOC.read_text().split(heading, 1)[1].split("\n\n", 2)[1]
    return [line.strip("|").split("|")[1:] for line in section.splitlines()[2:]]


def test_ap_at_k_note_agrees_with_the_tables():
    text = squeeze(DOC.read_text())
    assert "not comparable with the paper's AP@5K" in text
    bound = re.search(r"AP_T@1000 ≤ 1000 / ([\d,]+) ≈ ([\d.]+)", text)
    n_relevant = int(bound.group(1).replace(",", ""))
    assert n_relevant == 7000 - 100  # Fashion-MNIST: 7,000 images per class, 100 are queries
    assert float(bound.group(2)) == round(1000 / n_relevant, 3)
    cells = [c for row in table_rows("Tie-aware NDCG_T, AP_T@1000 and P@1000:") for c in row]
    ap_at_1000 = [float(c.split("/")[1]) for c in cells]
    assert max(ap_at_1000) <= 1000 / n_relevant
    maps = [
        float(c.split("**")[1]) for row in table_rows("with the tie-breaking range") for c in row
    ]
    quoted = re.search(r"AP_T@1000 ([\d.]+)–([\d.]+) against AP_T ([\d.]+)–([\d.]+)", text)
    assert [float(v) for v in quoted.groups()] == [
        round(min(ap_at_1000), 3),
        round(max(ap_at_1000), 3),
        round(min(maps), 2),
        round(max(maps), 2),
    ]


def test_quick_sweep_command_uses_real_options():
    commands = [
        shlex.split(line)
        for block in code_blocks("bash")
        for line in block.splitlines()
        if line.startswith("rankwise hash train") and "--quick" in line
    ]
    assert commands, "docs/hashing.md shows no --quick sweep"
    click_command = typer.main.get_command(build_app()).commands["hash"].commands["train"]
    options = {name for param in click_command.params for name in param.opts}
    for words in commands:
        assert {"--quick", "--methods", "--dataset"} <= set(words)
        assert {w for w in words if w.startswith("--")} <= options
        assert words[words.index("--dataset") + 1] == "digits" and "digits" in DATASETS
