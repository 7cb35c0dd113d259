"""README.md and docs/ say what the code does (issue 19, item 12): the `make demo` command and its
loss count are the Makefile's, README's demo table is what that command prints (the reference rows
exactly, the trained rows within the CPU-to-CPU range README states), the long commands README
shows carry their duration, and README's `make test` time names the machine and the command."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from rankwise.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

# "`make demo` runs `COMMAND`" in prose; the command may wrap over lines
DEMO_SENTENCE = re.compile(r"`make demo` runs `(?P<command>[^`]+)`(?P<rest>[^.]*)")
DURATION = re.compile(r"\b\d+(?:[.,]\d+)?\s*(?:s|min|h)\b")


def squeeze(text: str) -> str:
    return " ".join(text.split())


def makefile_demo_args() -> list[str]:
    """The arguments of `rankwise` in the Makefile's `demo` recipe."""
    recipe = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    command = squeeze(recipe.split("\n", 1)[1].replace("\\\n", " "))
    words = shlex.split(command)
    assert words[0] == "$(BIN)/rankwise", command
    return words[1:]


def option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def readme_demo_table() -> list[list[float]]:
    """README's demo table, one list of (mAUPRC, R@1, R@10, MAP@R) per row, in its order."""
    section = README.read_text().split("| Loss | mAUPRC | R@1 | R@10 | MAP@R |", 1)[1]
    lines = section.split("\n\n", 1)[0].strip().splitlines()[1:]  # past the |---| line
    return [[float(cell) for cell in line.strip("|").split("|")[1:]] for line in lines]


def machine_range() -> float:
    """The largest CPU-to-CPU difference README states for the demo's trained rows, in points."""
    match = re.search(
        r"trained rows[^.]*?by up to (\d+(?:\.\d+)?) points", squeeze(README.read_text())
    )
    assert match, "README does not say how much the demo's trained rows vary between machines"
    return float(match.group(1))


def test_every_make_demo_description_is_the_makefiles_command():
    expected = "rankwise " + " ".join(a for a in makefile_demo_args())
    found = {}
    for path in [README, *DOCS]:
        for match in DEMO_SENTENCE.finditer(path.read_text()):
            found.setdefault(path.name, []).append(squeeze(match.group("command")))
    assert {"README.md", "training.md"} <= found.keys(), found
    for name, commands in found.items():
        assert commands == [expected] * len(commands), (name, commands, expected)


def test_the_loss_count_quoted_for_make_demo_is_the_makefiles():
    n_losses = len(option(makefile_demo_args(), "--losses").split(","))
    quoted = []
    for path in [README, *DOCS, ROOT / "Makefile"]:
        for line_or_sentence in re.split(r"\.\s|\n\n", path.read_text()):
            if "make demo" in line_or_sentence:
                quoted += [int(n) for n in re.findall(r"\b(\d+) losses", line_or_sentence)]
    assert quoted and set(quoted) == {n_losses}, quoted


def run_demo(tmp_path, *extra: str) -> dict:
    """The Makefile's demo command into a scratch folder (plus ``extra`` overrides)."""
    args = makefile_demo_args()
    args[args.index("--output") + 1] = str(tmp_path / "demo")
    threads = torch.get_num_threads()
    try:
        result = CliRunner().invoke(app, [*args, *extra])
    finally:  # the demo's config trains on one thread; later tests keep theirs
        torch.set_num_threads(threads)
    assert result.exit_code == 0, result.output
    return json.loads((tmp_path / "demo" / "bench.json").read_text())


def table_row(row: dict) -> list[float]:
    keys = ("map", "recall_at_1", "recall_at_10", "map_at_r")
    return [round(100 * row[f"{key}_mean"], 2) for key in keys]


def test_readme_demo_reference_rows_are_what_the_demo_computes(tmp_path):
    # the reference rows involve no training: one loss trained for one step computes them exactly
    bench = run_demo(tmp_path, "--losses", "contrastive", "budget.iterations=1", "eval_every=1")
    documented = readme_demo_table()
    n_losses = len(option(makefile_demo_args(), "--losses").split(","))
    assert len(documented) == n_losses + len(bench["reference_rows"])
    assert documented[n_losses:] == [table_row(row) for row in bench["reference_rows"]]


def test_readme_says_which_demo_rows_depend_on_the_machine():
    text = squeeze(README.read_text())
    assert 0 < machine_range() < 5
    assert re.search(r"reference rows[^.]*(?:same|identical) (?:in|on) every", text), (
        "README does not say that the reference rows are machine-independent"
    )


@pytest.mark.slow
def test_make_demo_prints_readme_table_within_the_stated_range(tmp_path):
    bench = run_demo(tmp_path)
    documented = readme_demo_table()
    trained = [table_row(row) for row in bench["rows"]]
    references = [table_row(row) for row in bench["reference_rows"]]
    assert documented[len(trained) :] == references
    pairs = zip(documented[: len(trained)], trained, strict=True)
    spread = max(abs(a - b) for doc, got in pairs for a, b in zip(doc, got, strict=True))
    assert spread <= machine_range(), (documented, trained)


def readme_commands() -> list[tuple[str, str]]:
    """Every `rankwise bench` / `rankwise tune` line of README's shell blocks, with its comment."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        for line in block.splitlines():
            command, _, comment = line.partition("#")
            if re.match(r"rankwise (bench|tune)\b", command.strip()):
                lines.append((command.strip(), comment))
    return lines


def test_long_readme_commands_carry_their_duration():
    long_commands = [(c, note) for c, note in readme_commands() if "--quick" not in c]
    assert len(long_commands) >= 3, long_commands  # bench fashion-mnist, --ablation, tune
    missing = [c for c, note in long_commands if not DURATION.search(note)]
    assert missing == []


def test_readme_make_test_time_names_the_machine_and_the_command():
    paragraphs = [squeeze(p) for p in README.read_text().split("\n\n")]
    claims = [p for p in paragraphs if re.search(r"`make test` runs every test not marked slow", p)]
    assert len(claims) == 1, "README should say once how long `make test` takes"
    claim = claims[0]
    # no count of tests: it goes stale at the next commit that adds one (issue 30); only the size
    # of the suite when the time was measured
    measured = claim.split("when the suite counted")[0]
    assert not re.search(r"\d[\d,]* (?:tests|passed)", measured), claim
    assert "`time make test`" in claim, claim
    assert re.search(r"\b\d+-core\b", claim) and "AMD EPYC" in claim, claim
    assert re.search(r"\bload", claim), claim  # and that a loaded machine takes longer
