"""Shared pytest fixtures: CUDA-marked tests are skipped when no GPU is present; tests that read
Fashion-MNIST skip without it (`fashion_mnist`); 2-process
torch.distributed (gloo, CPU) runs of tests/distributed_worker.py; the tiny training config of
the training tests (`tiny_config`); an in-process fake of a two-rank strategy (`two_ranks`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def fashion_mnist():
    """Skip the test where Fashion-MNIST is not installed (a fresh machine may lack it)."""
    from rankwise.data import read_mnist_family

    try:
        read_mnist_family("fashion-mnist", None)
    except (OSError, ValueError):
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")


@pytest.fixture(params=["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def device(request):
    """Run a test on the CPU, and on CUDA too when a GPU is present."""
    return torch.device(request.param)


WORKER = Path(__file__).with_name("distributed_worker.py")
DISTRIBUTED_CASES = (
    "losses",
    "errors",
    "trainer",
    "metrics",
    "custom_metric",
    "sharded_evaluation",
    "sub_batch",
    "digits",  # last: `rankwise train` leaves the process group itself
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for a worker, one intra-op thread each (2 shared cores)."""
    return {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMBA_NUM_THREADS": "1",
    }


def wait_ranks(
    args: list[str], world_size: int = 2, timeout: float = 600, extra_env=None
) -> list[tuple[int, str]]:
    """Run ``python *args`` as ``world_size`` ranks; each rank's exit code and output.

    A rank still running after ``timeout`` seconds (waiting in a collective another rank never
    joined) is killed: the test fails with a timeout. ``extra_env(rank)`` adds variables.
    """
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, *args],
            env={
                **rank_environment(rank, world_size, port),
                **(extra_env(rank) if extra_env is not None else {}),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:  # a rank hung (a collective another rank never joined)
                proc.kill()
                proc.wait()
    return [(proc.returncode, output) for proc, output in zip(procs, outputs, strict=True)]


def run_ranks(args: list[str], world_size: int = 2, timeout: float = 600) -> list[str]:
    """Run ``python *args`` as ``world_size`` ranks; fail with every rank's output if one fails.

    Returns:
        Each rank's combined stdout and stderr.
    """
    finished = wait_ranks(args, world_size, timeout)
    codes = [code for code, _ in finished]
    outputs = [output for _, output in finished]
    if any(codes):
        details = "\n".join(
            f"--- rank {r} (exit {c}) ---\n{o[-4000:]}"
            for r, (c, o) in enumerate(zip(codes, outputs, strict=True))
        )
        pytest.fail(f"a distributed worker failed:\n{details}")
    return outputs


@pytest.fixture(scope="session")
def launch_ranks():
    """:func:`run_ranks`: ``launch_ranks(args, world_size=2)`` runs ``python *args`` as ranks."""
    return run_ranks


@pytest.fixture(scope="session")
def launch_ranks_unchecked():
    """:func:`wait_ranks`: every rank's ``(exit code, output)``, failing or not."""
    return wait_ranks


@pytest.fixture(scope="session")
def distributed_results(tmp_path_factory):
    """Every case of distributed_worker.py, run once per session by 2 gloo ranks.

    Returns:
        A function ``(case, rank) -> the rank's saved result``; its ``out_dir`` holds the
        run directories the trainer case wrote.
    """
    import torch

    out = tmp_path_factory.mktemp("distributed")
    run_ranks([str(WORKER), ",".join(DISTRIBUTED_CASES), str(out)])

    def load(case: str, rank: int):
        return torch.load(out / f"{case}-rank{rank}.pt", weights_only=True)

    load.out_dir = out
    return load


# -- the tiny training run ------------------------------------------------------------------------

# digits, a small CNN, 8 steps of 5 classes x 4 (a few seconds): the config the training tests
# start from, each changing what it is about
TINY_CONFIG = {
    "dataset": {"name": "digits"},
    "model": {"backbone": "small_cnn", "embedding_dim": 8},
    "loss": {"name": "auc", "params": {}},
    "sampler": {"m": 4, "batch_size": 20},
    "optimizer": {"name": "adam", "lr": 1e-3},
    "budget": {"iterations": 8},
    "eval_every": 2,
    "eval_ks": [1],
    "seed": 0,
    "progress": False,
    "threads": 1,
}


class TinyConfig:
    """``tiny_config(output_dir, **overrides)`` -> a Config; ``tiny_config.data(**overrides)`` -> its dict.

    Overrides are dotted keys (``**{"budget.iterations": 4}``) or whole sections / top-level
    keys (``seed=1``, ``budget={"iterations": 2}``), as ``apply_overrides`` applies them.
    """

    def data(self, output_dir=None, **overrides):
        from rankwise.training.config import apply_overrides

        data = apply_overrides(TINY_CONFIG, overrides)
        if output_dir is not None:
            data["output_dir"] = str(output_dir)
        return data

    def __call__(self, output_dir=None, **overrides):
        from rankwise.training import config_from_dict

        return config_from_dict(self.data(output_dir, **overrides))


@pytest.fixture(scope="session")
def tiny_config():
    """:class:`TinyConfig`: the shared tiny training config, with a test's changes."""
    return TinyConfig()


# -- a fake of two processes ------------------------------------------------------------------------


def fake_two_ranks(rank=0, *, other_stop=False, other_code=0, main_value=None):
    """Rank ``rank`` of a two-process run, in this process (no process group, no other process).

    The other rank's part of every collective is given: ``other_stop`` (its stop request),
    ``other_code`` (its outcome of a write), ``main_value`` (what rank 0 reads, for rank 1).
    ``embed_split`` embeds both ranks' shards here and puts them together in rank order, as the
    all-gather would. ``calls`` records the collectives.
    """
    from pathlib import Path

    from torch.utils.data import Subset

    from rankwise.training.lock import RunDirLock
    from rankwise.training.strategy import SingleProcess

    class FakeTwoRanks(SingleProcess):
        world_size = 2

        def __init__(self):
            self.rank = rank
            self.calls = []

        def any_rank(self, flag):
            self.calls.append(("any_rank", flag))
            return bool(flag) or other_stop

        def worst_code(self, code):
            self.calls.append(("worst_code", code))
            return max(code, other_code)

        def from_main_process(self, read):
            self.calls.append(("from_main_process",))
            return read() if self.rank == 0 else main_value

        def lock(self, take, run_dir):
            self.calls.append(("lock",))
            return take() if self.rank == 0 else RunDirLock(Path(run_dir), held=False)

        def embed_split(self, data, embed):
            self.calls.append(("embed_split", len(data)))
            n = len(data)
            shards = [embed(Subset(data, range(n * r // 2, n * (r + 1) // 2))) for r in range(2)]
            return (
                torch.cat([e for e, _ in shards]),
                np.concatenate([labels for _, labels in shards]),
            )

    return FakeTwoRanks()


@pytest.fixture(scope="session")
def two_ranks():
    """:func:`fake_two_ranks`: ``two_ranks(rank, other_stop=..., ...)`` -> a fake strategy."""
    return fake_two_ranks


# -- your own data: a folder of small generated images --------------------------------------------


def write_image_classes(root, n_classes=6, per_class=6, size=12, seed=0, names=None):
    """``root/c<i>/<j>.png``: ``n_classes`` classes of small RGB PNGs, each class its own colour.

    ``names`` (optional) replaces the folder names ``c<i>`` (and sets the number of classes).

    Returns ``root``. Images of one class share a mean colour (plus noise), so a few training steps
    separate them.
    """
    from pathlib import Path

    import numpy as np
    from PIL import Image

    root = Path(root)
    rng = np.random.default_rng(seed)
    names = [f"c{c}" for c in range(n_classes)] if names is None else list(names)
    for name in names:
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        colour = rng.integers(0, 200, 3)
        for j in range(per_class):
            noise = rng.integers(0, 50, (size, size, 3))
            pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{j}.png")
    return root


@pytest.fixture
def ctrl_c_and_resume(tmp_path):
    """``check(config)``: a run interrupted by Ctrl-C at step 3 and resumed from the command line
    equals the uninterrupted one (report and weights); ``config(run_dir)`` builds the 6-step run.

    Returns the uninterrupted run's :class:`RunResult`; the runs are in ``tmp_path / "ref"`` and
    ``tmp_path / "cut"``.
    """
    import json

    from typer.testing import CliRunner

    from rankwise.cli import app
    from rankwise.training import Trainer, TrainingInterrupted, load_checkpoint

    def check(config, reference_trainer=None):
        trainer = reference_trainer or Trainer.from_config(config(tmp_path / "ref"))
        reference = trainer.fit()

        def ctrl_c(trainer):
            if trainer.step == 3:
                raise KeyboardInterrupt

        with pytest.raises(TrainingInterrupted):
            Trainer.from_config(config(tmp_path / "cut")).fit(callbacks=[ctrl_c])
        assert load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")["step"] == 3
        # resumed as a user would, from the command line
        result = CliRunner().invoke(app, ["train", "--resume", str(tmp_path / "cut")])
        assert result.exit_code == 0, result.output
        report = json.loads((tmp_path / "cut" / "report.json").read_text())
        assert report["status"] == "completed" and report["steps"] == 6
        assert report["test"] == reference.test.to_dict()
        a = load_checkpoint(tmp_path / "ref" / "checkpoints" / "last.pt")["model"]
        b = load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")["model"]
        assert all(torch.equal(a[k], b[k]) for k in a)
        return reference

    return check


@pytest.fixture
def image_classes(tmp_path):
    """A folder of generated class sub-folders (:func:`write_image_classes`) under ``tmp_path``."""
    return write_image_classes(tmp_path / "images")


@pytest.fixture(scope="session")
def write_images():
    """:func:`write_image_classes`, for tests that choose the folder, names or sizes."""
    return write_image_classes
