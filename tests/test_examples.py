"""The three ways in of docs/training.md, each an example under examples/, run on a short budget:
your own loop with a rankwise loss and RetrievalMetric, the Trainer with your own model and data,
the command line with a config, and (when lightning is installed) a LightningModule. Each must
show learning: the held-out mAP after training beats the untrained model's."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(
        f"rankwise_example_{name}", EXAMPLES / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_loop_learns(capsys):
    scores = load("own_loop").main(steps=20)
    assert scores["after"] > scores["before"] + 0.1
    assert "held-out mAP" in capsys.readouterr().out


def test_trainer_with_own_model_learns_and_writes_nothing_without_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    scores = load("trainer_own_model").main(steps=20)
    assert scores["after"] > scores["before"] + 0.1 and scores["test"] > 0.5
    assert list(tmp_path.iterdir()) == []


def test_trainer_example_with_a_run_dir(tmp_path):
    load("trainer_own_model").main(steps=8, run_dir=str(tmp_path / "run"))
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["status"] == "completed" and report["steps"] == 8
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()


def test_cli_example(tmp_path):
    out = tmp_path / "cli"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "STEPS": "6"}
    result = subprocess.run(
        ["bash", str(EXAMPLES / "cli.sh")], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "test mAP" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 6 and report["test"]["n_queries"] == 200  # 20 queries x 10 classes


def test_lightning_module_learns():
    pytest.importorskip("lightning", reason="the lightning extra is not installed")
    scores = load("lightning_module").main(steps=20)
    assert scores["after"] > scores["before"] + 0.1


# --- docs/training.md quotes what each example prints at its default 300 steps (issue 19, item 12)

DOC = EXAMPLES.parent / "docs" / "training.md"
NUMBER = re.compile(r"\d+(?:\.\d+)?")
# a stale quote was 0.0012 to 0.005 off what the examples print (issue 19); same-kernel CPUs print
# the same digits, so 0.001 is last-digit slack only
SAME_KERNELS_TOLERANCE = 0.001


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo (``AuthenticAMD``, ``GenuineIntel``), or ``""``."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    match = re.search(r"^vendor_id\s*:\s*(\S+)", text, flags=re.M)
    return match.group(1) if match else ""


def quote_tolerance() -> float:
    """How far the examples' output may be from the quotes on this machine.

    docs/training.md quotes an AMD machine with torch's AVX2 / AVX-512 kernels; pre-AVX2 kernels,
    MKL's conditional-reproducibility paths (``MKL_CBWR``) and an Intel CPU (MKL picks its code
    per vendor: an Intel Xeon with AVX-512 printed 0.9406 for the quoted 0.9437) sum in another
    order and move the trained numbers by up to the spread the docs state.
    """
    same_kernels = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if same_kernels and cpu_vendor() == "AuthenticAMD" and not os.environ.get("MKL_CBWR"):
        return SAME_KERNELS_TOLERANCE
    ways_in = " ".join(DOC.read_text().split("## Three ways in", 1)[1].split("\n## ", 1)[0].split())
    return float(re.search(r"by up to (0\.\d+)", ways_in).group(1))


def documented_output(script: str) -> str:
    """The output docs/training.md quotes for ``examples/<script>``, whitespace squeezed."""
    text = " ".join(DOC.read_text().split())
    pattern = rf"`(?:python|bash) examples/{re.escape(script)}`[^`]*?(?:prints|ends with) `([^`]+)`"
    match = re.search(pattern, text)
    assert match, f"docs/training.md quotes no output of examples/{script}"
    return match.group(1)


def assert_quotes(quoted: str, output: str) -> None:
    """``output`` has a line worded like ``quoted`` whose numbers are within the tolerance."""
    wording = NUMBER.sub("#", quoted)
    lines = [
        line.strip() for line in output.splitlines() if NUMBER.sub("#", line.strip()) == wording
    ]
    assert lines, (quoted, output)
    tolerance = quote_tolerance()
    pairs = list(zip(NUMBER.findall(quoted), NUMBER.findall(lines[0]), strict=True))
    # scores within the tolerance; counts (steps, best step) exactly where the kernels are the same
    # (elsewhere another best step is one of the ways the numbers move)
    scores = [(float(a), float(b)) for a, b in pairs if "." in a]
    counts = [(a, b) for a, b in pairs if "." not in a]
    assert all(abs(a - b) <= tolerance for a, b in scores), (quoted, lines[0])
    assert tolerance > SAME_KERNELS_TOLERANCE or all(a == b for a, b in counts), (quoted, lines[0])


def test_docs_quote_what_own_loop_prints(capsys):
    load("own_loop").main()
    assert_quotes(documented_output("own_loop.py"), capsys.readouterr().out)


def test_docs_quote_what_the_trainer_example_prints(capsys):
    scores = load("trainer_own_model").main()
    assert_quotes(documented_output("trainer_own_model.py"), capsys.readouterr().out)
    text = " ".join(DOC.read_text().split())
    quoted_test = float(re.search(r"\)` and a test mAP of (\d\.\d+)", text).group(1))
    assert abs(quoted_test - scores["test"]) <= quote_tolerance(), (quoted_test, scores["test"])


def test_docs_quote_what_the_cli_example_prints(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "cli")}
    result = subprocess.run(
        ["bash", str(EXAMPLES / "cli.sh")], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert_quotes(documented_output("cli.sh"), result.stdout)


def test_docs_quote_what_the_lightning_example_prints(capsys):
    pytest.importorskip("lightning", reason="the lightning extra is not installed")
    load("lightning_module").main()
    assert_quotes(documented_output("lightning_module.py"), capsys.readouterr().out)
