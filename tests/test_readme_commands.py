"""Every `rankwise ...` command of README.md's code blocks runs as written, in a quick form.

Each command is taken from README.md itself and run through the real CLI (typer's CliRunner) in a
fresh folder, with only a shorter budget (and the inputs it names) added: the README's own options
are kept, so a command whose options, defaults or config stop working fails here. A README
command without a quick form below fails `test_every_readme_command_has_a_quick_form`.

The seed-2 Adam row of `rankwise bench --dataset digits --ablation` collapsed at step 37 (issue 40:
the untrained CNN scores every pair above SOPRC's whole initial v grid, so the loss sat at 0.9993
with almost no gradient and Adam's coupled weight decay won); the ablation's quick form keeps all
15 runs and 40 steps, past that step.
"""

from __future__ import annotations

import json
import re
import shlex
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from rankwise.cli import app

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def readme_commands() -> list[str]:
    """The `rankwise ...` lines of README.md's ```bash blocks, without their trailing comments."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = re.split(r"\s+#\s", line.strip())[0].strip()
            if line.startswith("rankwise "):
                commands.append(line)
    return commands


# -- inputs the commands name -------------------------------------------------------------------
def embeddings_and_labels(folder: Path) -> None:
    """emb.npy (60 x 8, 3 separable classes) and labels.npy, as `rankwise evaluate` reads them."""
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(3), 20)
    centres = rng.normal(size=(3, 8)) * 3
    np.save(folder / "emb.npy", (centres[labels] + rng.normal(size=(60, 8))).astype(np.float32))
    np.save(folder / "labels.npy", labels)


# the README's train command in its quick form: 4 steps, stopped at step 2 by --max-steps when
# a later command (resume, embed) needs an interrupted or finished run to start from
TRAIN = "rankwise train --config configs/digits.yaml loss.name=auc optimizer.lr=0.003"
TINY = ["budget.iterations=4", "eval_every=2"]


def invoke(argv: list[str]):
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, f"rankwise {shlex.join(argv)} failed:\n{result.output}"
    return result


def interrupted_run(folder: Path) -> None:
    """runs/digits/auc-seed0 stopped at step 2 of 4, as Ctrl-C would leave it."""
    invoke([*shlex.split(TRAIN)[1:], *TINY, "--max-steps", "2"])


def digits_inputs(folder: Path) -> None:
    """An interrupted run to embed with, and new.npy: 10 raw digit images."""
    interrupted_run(folder)
    from sklearn.datasets import load_digits

    np.save(folder / "new.npy", load_digits().images[:10].astype(np.float32))


def search_inputs(folder: Path) -> None:
    """The run and new.npy of `embed`, and gallery.npy: 40 more raw digit images."""
    digits_inputs(folder)
    from sklearn.datasets import load_digits

    np.save(folder / "gallery.npy", load_digits().images[10:50].astype(np.float32))


def _searched(folder: Path, output: str) -> None:
    hits = json.loads((folder / "hits.json").read_text())
    text = json.dumps(hits)
    assert '"score"' in text and '"id"' in text and '"ties_at_cut"' in text, text[:300]


def _exported(folder: Path, output: str) -> None:
    assert (folder / "model.onnx").stat().st_size > 0
    meta = json.loads((folder / "model.onnx.json").read_text())
    assert meta, "the export writes its metadata next to the model"


def fake_fashion_mnist(folder: Path) -> None:
    """fmnist/: a 200-image, 10-class Fashion-MNIST in its IDX layout (the real one may be absent)."""
    root = folder / "fmnist"
    root.mkdir()
    rng = np.random.default_rng(0)
    for stem, n in (("train", 200), ("t10k", 100)):
        labels = np.arange(n, dtype=np.uint8) % 10
        images = (rng.random((n, 28, 28)) * 60 + labels[:, None, None] * 19).astype(np.uint8)
        header = struct.pack(">IIII", 2051, n, 28, 28)
        (root / f"{stem}-images-idx3-ubyte").write_bytes(header + images.tobytes())
        (root / f"{stem}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 2049, n) + labels.tobytes()
        )


@dataclass
class Quick:
    """How a README command runs quickly: what to prepare, what to append, what to check."""

    setup: Callable[[Path], None] | None = None
    extra: list[str] = field(default_factory=list)
    check: Callable[[Path, str], None] | None = None


def _report_written(folder: Path, output: str) -> None:
    report = json.loads((folder / "report.json").read_text())
    assert 0 <= report["map"] <= 1 and (folder / "pr.png").stat().st_size > 0


def _json_on_stdout(folder: Path, output: str) -> None:
    # `| jq .map`: the report is the whole of stdout, and has a map
    assert 0 <= json.loads(output)["map"] <= 1


def _trained(folder: Path, output: str) -> None:
    (run,) = (folder / "runs" / "digits").iterdir()
    assert json.loads((run / "report.json").read_text())["steps"] == 4


def _embedded(folder: Path, output: str) -> None:
    assert np.load(folder / "emb.npy").shape[0] == 10


def _bench_complete(runs: int) -> Callable[[Path, str], None]:
    def check(folder: Path, output: str) -> None:
        (bench_json,) = (folder / "runs").rglob("bench.json")
        rows = json.loads(bench_json.read_text())["rows"]
        assert sum(len(r["seeds"]) for r in rows) == runs

    return check


def _tuned(folder: Path, output: str) -> None:
    assert list((folder / "runs").rglob("tuned.yaml"))


QUICK: dict[str, Quick] = {
    "rankwise evaluate emb.npy labels.npy --ks 1,10,100 --json report.json --plot-pr pr.png": Quick(
        embeddings_and_labels, check=_report_written
    ),
    TRAIN: Quick(extra=TINY, check=_trained),
    "rankwise train --resume runs/digits": Quick(interrupted_run, check=_trained),
    "rankwise embed runs/digits new.npy --output emb.npy": Quick(digits_inputs, check=_embedded),
    "rankwise search runs/digits new.npy --gallery gallery.npy --k 10 --json hits.json": Quick(
        search_inputs, check=_searched
    ),
    "rankwise export runs/digits --format onnx -o model.onnx": Quick(
        interrupted_run, check=_exported
    ),
    "rankwise bench --dataset fashion-mnist --seeds 3": Quick(
        fake_fashion_mnist,
        ["--data-dir", "fmnist", "--quick", "--losses", "contrastive", *TINY],
        _bench_complete(3),
    ),
    # all 15 runs, 40 steps each: past step 37, where seed 2's Adam row collapsed (issue 40)
    "rankwise bench --dataset digits --ablation": Quick(
        extra=["budget.iterations=40", "eval_every=40"], check=_bench_complete(15)
    ),
    "rankwise tune --dataset digits --grid optimizer.lr=0.0003,0.001,0.003": Quick(
        extra=["--losses", "soprc,auc", *TINY], check=_tuned
    ),
    "rankwise experiment list": Quick(),
    "rankwise roc fit --dataset digits --alpha 0.05": Quick(
        extra=["--max-iter", "20", "--n-test", "300"]
    ),
    "rankwise evaluate emb.npy labels.npy --json - | jq .map": Quick(
        embeddings_and_labels, check=_json_on_stdout
    ),
}
SLOW = {"rankwise bench --dataset digits --ablation"}


def test_every_readme_command_has_a_quick_form():
    commands = readme_commands()
    assert len(commands) >= 10, commands  # the extraction found the command-line block
    assert sorted(set(commands)) == sorted(QUICK), (
        "README.md's commands and this file's quick forms differ; give each new command one"
    )


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in QUICK],
)
def test_readme_command_runs(command, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    quick = QUICK[command]
    if quick.setup is not None:
        quick.setup(tmp_path)
    argv = shlex.split(command.split(" | ")[0])[1:] + quick.extra
    result = invoke(argv)
    if quick.check is not None:
        quick.check(tmp_path, result.stdout)


def test_the_seed_2_adam_row_of_the_digits_ablation_trains_past_step_37(tmp_path, monkeypatch):
    """Row 5 (Adam) of the README's ablation, seed 2, to step 40: it collapsed at step 37."""
    monkeypatch.chdir(tmp_path)
    result = invoke(
        [
            "train",
            "--config",
            str(REPO / "configs" / "digits.yaml"),
            "--seed",
            "2",
            "--output",
            "run",
            "budget.iterations=40",
            "eval_every=40",
        ]
    )
    assert json.loads((tmp_path / "run" / "report.json").read_text())["steps"] == 40, result.output
