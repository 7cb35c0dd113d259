"""Using a trained run (issue 14, item 18): `load_run` rebuilds the model selected on validation
with its preprocessing, and `rankwise embed` writes the embeddings the run's own evaluation saw."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.metrics import retrieval_metrics
from rankwise.training import ConfigError, Trainer, load_run
from rankwise.training.build import load_splits


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_config):
    run_dir = tmp_path_factory.mktemp("runs") / "digits" / "auc-seed0"
    # the tiny run of tests/conftest.py, 6 steps
    config = tiny_config(run_dir, **{"budget.iterations": 6, "eval_every": 3})
    result = Trainer.from_config(config).fit()
    return run_dir, result, config


def test_load_run_reproduces_the_runs_test_report_from_raw_pixels(trained):
    run_dir, result, config = trained
    run = load_run(run_dir.parent)  # a folder holding one run is accepted, as for --resume
    assert run.checkpoint.name == "best.pt" and run.step == result.best_step
    assert run.input_shape == (1, 8, 8) and not run.model.training
    # the test split's rows, taken from the raw 0-16 pixels a user has
    splits = load_splits(config)
    raw = load_digits().images
    scaled = torch.as_tensor(raw / 16.0, dtype=torch.float32)
    rows = [int(torch.nonzero((scaled == x[0]).flatten(1).all(1))[0]) for x in splits.test.inputs]
    emb = run.embed(raw[rows])
    report = retrieval_metrics(emb, splits.test.labels, ks=(1,))
    assert report.map == pytest.approx(result.test.map, abs=1e-6)


def test_load_run_checks_its_inputs(trained):
    run = load_run(trained[0])
    with pytest.raises(ValueError, match=r"shape \(N, 1, 8, 8\)"):
        run.embed(np.zeros((3, 28, 28)))
    with pytest.raises(ValueError, match="digits pixels are 0-16"):
        run.embed(np.full((2, 8, 8), 255.0))
    with pytest.raises(ConfigError, match="holds no run|not a run directory"):
        load_run(trained[0] / "checkpoints")


def test_embed_command_writes_the_embeddings(trained, tmp_path):
    run_dir = trained[0]
    np.save(tmp_path / "x.npy", load_digits().images[:50])
    out = tmp_path / "emb.npy"
    runner = CliRunner()
    args = ["embed", str(run_dir), str(tmp_path / "x.npy"), "--output", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    emb = np.load(out)
    expected = load_run(run_dir).embed(load_digits().images[:50]).numpy()
    assert emb.shape == (50, 8) and np.array_equal(emb, expected)
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_embed_a_folder_of_images_with_an_image_run(tmp_path):
    # an image-dataset run (cub200, 3 x 16 x 16 here): the folder is embedded in sorted path
    # order with the run's resize + ImageNet normalization, and the order is written beside it
    import yaml
    from PIL import Image

    from rankwise.data.base import default_image_transform
    from rankwise.models import build_model
    from rankwise.training import atomic_save

    run_dir = tmp_path / "run"
    config = {
        "dataset": {"name": "cub200", "image_size": 16},
        "model": {"backbone": "small_cnn", "embedding_dim": 4},
        "loss": {"name": "auc"},
        "budget": {"iterations": 1},
    }
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    torch.manual_seed(0)
    model = build_model("small_cnn", (3, 16, 16), 4)
    atomic_save({"step": 7, "model": model.state_dict()}, run_dir / "checkpoints" / "best.pt")
    images = tmp_path / "images" / "sub"
    images.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in ("b.png", "a.jpg"):
        Image.fromarray(rng.integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(images / name)
    out = tmp_path / "emb.npy"
    result = CliRunner().invoke(
        app, ["embed", str(run_dir), str(tmp_path / "images"), "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    listed = (tmp_path / "emb.paths.txt").read_text().split()
    assert [p.rsplit("/", 1)[1] for p in listed] == ["a.jpg", "b.png"]
    transform = default_image_transform(16)
    with Image.open(listed[0]) as image:
        first = transform(image)
    model.eval()
    with torch.no_grad():
        expected = model(first[None]).numpy()
    assert np.allclose(np.load(out)[:1], expected, atol=1e-6)
    assert load_run(run_dir).step == 7


def test_embed_a_class_per_folder_tree_writes_its_labels(tmp_path):
    """Issue 40: class folders below INPUT give <out>.labels.npy, in the rows' order, and say so."""
    import yaml
    from PIL import Image

    from rankwise.models import build_model
    from rankwise.training import atomic_save

    run_dir = tmp_path / "run"
    config = {
        "dataset": {"name": "cub200", "image_size": 16},
        "model": {"backbone": "small_cnn", "embedding_dim": 4},
        "loss": {"name": "auc"},
        "budget": {"iterations": 1},
    }
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    model = build_model("small_cnn", (3, 16, 16), 4)
    atomic_save({"step": 1, "model": model.state_dict()}, run_dir / "checkpoints" / "best.pt")
    rng = np.random.default_rng(0)
    for cls, names in (("zebra", ("1.png", "2.png")), ("ant", ("3.png",)), ("cat", ("0.png",))):
        (tmp_path / "tree" / cls).mkdir(parents=True)
        for name in names:
            image = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
            Image.fromarray(image).save(tmp_path / "tree" / cls / name)
    out = tmp_path / "emb.npy"
    result = CliRunner().invoke(
        app, ["embed", str(run_dir), str(tmp_path / "tree"), "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    listed = (tmp_path / "emb.paths.txt").read_text().split()
    labels = np.load(tmp_path / "emb.labels.npy")
    classes = {"ant": 0, "cat": 1, "zebra": 2}  # sorted folder names
    assert labels.tolist() == [classes[p.split("/")[-2]] for p in listed]
    assert labels.dtype == np.int64 and len(labels) == np.load(out).shape[0] == 4
    assert "emb.labels.npy" in result.output and "ant=0" in result.output
    # images straight in the folder: no classes, no labels file
    flat = tmp_path / "flat"
    flat.mkdir()
    Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(flat / "a.png")
    args = ["embed", str(run_dir), str(flat), "-o", str(tmp_path / "flat.npy")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0 and not (tmp_path / "flat.labels.npy").exists()
