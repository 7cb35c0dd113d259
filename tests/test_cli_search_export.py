"""`rankwise search` and `rankwise export` (issue 39, items 2 and 5) on a tiny trained digits run
and a small image run: results equal a brute-force ranking of the run's own embeddings, saved
indexes are reused only with their model, bad input is one line and exit 2; every export format
reloads and reproduces the run's embeddings, its metadata states the preprocessing."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.similarity import ranking_keys
from rankwise.training import Trainer, load_run

runner = CliRunner()


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, tiny_config):
    run_dir = tmp_path_factory.mktemp("runs") / "digits"
    Trainer.from_config(tiny_config(run_dir, **{"budget.iterations": 3, "eval_every": 3})).fit()
    return run_dir


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    # an image-dataset run (cub200 at 16 x 16) written directly, as in tests/training/test_inference
    import yaml

    from rankwise.models import build_model
    from rankwise.training import atomic_save

    run_dir = tmp_path_factory.mktemp("image") / "run"
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
    atomic_save({"step": 1, "model": model.state_dict()}, run_dir / "checkpoints" / "best.pt")
    return run_dir


def write_images(folder, n, seed):
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pixels = rng.integers(0, 255, (12 + i, 20, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i:02d}.png")
    return sorted(folder.glob("*.png"))


def expected_ranking(run_dir, query_raw, gallery_raw, k):
    run = load_run(run_dir)
    keys = ranking_keys(run.embed(query_raw), run.embed(gallery_raw), "cosine").numpy()
    return np.argsort(-keys, axis=1, kind="stable")[:, :k]


def test_search_arrays_of_raw_digits_equals_brute_force(digits_run, tmp_path):
    images = load_digits().images
    np.save(tmp_path / "q.npy", images[:6])
    np.save(tmp_path / "g.npy", images[100:400])
    out = tmp_path / "out.json"
    args = [
        "search",
        str(digits_run),
        str(tmp_path / "q.npy"),
        "--gallery",
        str(tmp_path / "g.npy"),
    ]
    result = runner.invoke(app, [*args, "--k", "7", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    ids = np.array([[item["id"] for item in q["results"]] for q in report["queries"]])
    np.testing.assert_array_equal(ids, expected_ranking(digits_run, images[:6], images[100:400], 7))
    assert report["similarity"] == "cosine" and report["k"] == 7 and report["gallery_size"] == 300
    assert report["run"]["step"] == load_run(digits_run).step
    assert all(q["ties_at_cut"] == 0 for q in report["queries"])
    table = runner.invoke(app, [*args, "--k", "2"])  # no --json: a readable table
    assert table.exit_code == 0, table.output
    assert "2 nearest of 300 (cosine)" in table.output and str(ids[0, 0]) in table.output


def test_search_embeddings_and_a_saved_index(digits_run, tmp_path):
    images = load_digits().images
    run = load_run(digits_run)
    np.save(tmp_path / "qe.npy", run.embed(images[:4]).numpy())
    np.save(tmp_path / "g.npy", images[:200])
    first = runner.invoke(
        app,
        [
            "search",
            str(digits_run),
            str(tmp_path / "qe.npy"),
            "--gallery",
            str(tmp_path / "g.npy"),
            "--k",
            "3",
            "--save-index",
            str(tmp_path / "gallery"),
            "--json",
            str(tmp_path / "a.json"),
        ],
    )
    assert first.exit_code == 0, first.output
    assert (tmp_path / "gallery.json").is_file() and (tmp_path / "gallery.npz").is_file()
    again = runner.invoke(
        app,
        [
            "search",
            str(digits_run),
            str(tmp_path / "qe.npy"),
            "--gallery",
            str(tmp_path / "gallery.json"),
            "--k",
            "3",
            "--json",
            "-",
        ],
    )
    assert again.exit_code == 0, again.output
    refused = runner.invoke(
        app,
        [
            "search",
            str(digits_run),
            str(tmp_path / "qe.npy"),
            "--gallery",
            str(tmp_path / "g.npy"),
            "--save-index",
            str(tmp_path / "gallery"),
        ],
    )
    assert refused.exit_code == 2 and "gallery.npz exists; pass --overwrite" in refused.output
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads(again.stdout)
    assert [q["results"] for q in a["queries"]] == [q["results"] for q in b["queries"]]
    assert a["queries"][0]["results"][0]["id"] == 0  # digit 0 is its own nearest neighbour


def test_a_saved_index_of_another_model_is_refused(digits_run, tmp_path):
    from rankwise.search import EmbeddingIndex

    index = EmbeddingIndex(8, metadata={"model_id": "0123456789abcdef"})
    index.add(np.random.default_rng(0).standard_normal((5, 8)))
    index.save(tmp_path / "other")
    np.save(tmp_path / "q.npy", load_digits().images[:2])
    result = runner.invoke(
        app,
        [
            "search",
            str(digits_run),
            str(tmp_path / "q.npy"),
            "--gallery",
            str(tmp_path / "other.json"),
        ],
    )
    assert result.exit_code == 2
    assert "built with model 0123456789abcdef" in result.output and "--save-index" in result.output


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda p: np.save(p / "x.npy", np.zeros((3, 5))),
            "has shape (3, 5); this run takes inputs (N, 1, 8, 8) or embeddings (N, 8)",
        ),
        (lambda p: (p / "imgs").mkdir(), "holds images but the run was trained on digits arrays"),
        (lambda p: np.save(p / "x.npy", np.full((2, 8, 8), 99.0)), "digits pixels are 0-16"),
    ],
)
def test_search_bad_queries_are_one_line_and_exit_2(digits_run, tmp_path, make, message):
    make(tmp_path)
    np.save(tmp_path / "g.npy", load_digits().images[:20])
    target = tmp_path / ("imgs" if (tmp_path / "imgs").exists() else "x.npy")
    result = runner.invoke(
        app, ["search", str(digits_run), str(target), "--gallery", str(tmp_path / "g.npy")]
    )
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_search_image_folder_against_a_csv_table(image_run, tmp_path):
    gallery = write_images(tmp_path / "gallery", 6, seed=0)
    queries = write_images(tmp_path / "queries", 2, seed=1)
    table = tmp_path / "gallery.csv"
    table.write_text(
        "path,label\n" + "".join(f"gallery/{p.name},{i % 2}\n" for i, p in enumerate(gallery))
    )
    out = tmp_path / "out.json"
    result = runner.invoke(
        app,
        [
            "search",
            str(image_run),
            str(tmp_path / "queries"),
            "--gallery",
            str(table),
            "--k",
            "6",
            "--json",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert [q["path"] for q in report["queries"]] == [str(p) for p in queries]
    first = report["queries"][0]["results"]
    order = expected_ranking(image_run, queries, gallery, 6)[0]
    assert [r["id"] for r in first] == order.tolist()
    assert [r["path"] for r in first] == [str(gallery[j]) for j in order]
    assert [r["label"] for r in first] == [int(j) % 2 for j in order]


def test_search_csv_errors_name_the_row_and_column(image_run, tmp_path):
    write_images(tmp_path / "gallery", 2, seed=0)
    (tmp_path / "bad.csv").write_text("path\ngallery/img00.png\ngallery/missing.png\n")
    (tmp_path / "nocol.csv").write_text("file\nx.png\n")
    write_images(tmp_path / "broken", 2, seed=0)
    (tmp_path / "broken" / "img01.png").write_bytes(b"not a png")
    for table, message in (
        ("bad.csv", "bad.csv row 2, column 'path': no file"),
        ("nocol.csv", "has no 'path' column (its columns: file)"),
    ):
        result = runner.invoke(
            app,
            [
                "search",
                str(image_run),
                str(tmp_path / table),
                "--gallery",
                str(tmp_path / "gallery"),
            ],
        )
        assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    result = runner.invoke(
        app,
        [
            "search",
            str(image_run),
            str(tmp_path / "gallery"),
            "--gallery",
            str(tmp_path / "broken"),
        ],
    )
    # a broken image is a data error on one line, led by the argument, with its item number
    text = " ".join(result.output.split())
    broken = tmp_path / "broken"
    assert (
        result.exit_code == 2
        and f"data error: --gallery: image file '{broken / 'img01.png'}'" in text
    ), result.output
    assert f"(item 2 of {broken}) could not be decoded" in text, result.output
    # in a table it is named by the table's row
    (tmp_path / "broken.csv").write_text("path\nbroken/img00.png\nbroken/img01.png\n")
    result = runner.invoke(
        app,
        [
            "search",
            str(image_run),
            str(tmp_path / "broken.csv"),
            "--gallery",
            str(tmp_path / "gallery"),
        ],
    )
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "data error: QUERIES: image file" in text, result.output
    assert f"({tmp_path / 'broken.csv'} row 2) could not be decoded" in text, result.output


@pytest.mark.parametrize("fmt", ["torchscript", "pt2", "onnx"])
def test_export_reproduces_the_runs_embeddings(digits_run, tmp_path, fmt):
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    out = tmp_path / f"model.{fmt}"
    result = runner.invoke(app, ["export", str(digits_run), "--format", fmt, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "parity passed" in result.output
    meta = json.loads((tmp_path / f"model.{fmt}.json").read_text())
    assert meta["input"]["shape"] == ["batch", 1, 8, 8] and meta["input"]["dtype"] == "float32"
    assert meta["output"]["shape"] == ["batch", 8] and meta["output"]["l2_normalized"] is True
    assert meta["preprocessing"]["steps"] == [{"op": "divide", "by": 16.0}]
    assert meta["similarity"] == "cosine" and meta["embedding_dim"] == 8
    assert meta["parity"]["passed"] and meta["parity"]["max_abs_diff"] <= 1e-5
    # the file, loaded as a server would, with the stated preprocessing
    raw = load_digits().images[:9]
    x = (raw / 16.0).astype(np.float32)[:, None]
    if fmt == "onnx":
        import onnxruntime

        got = onnxruntime.InferenceSession(str(out)).run(None, {"input": x})[0]
    elif fmt == "torchscript":
        got = torch.jit.load(str(out))(torch.from_numpy(x)).detach().numpy()
    else:
        got = torch.export.load(str(out)).module()(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, load_run(digits_run).embed(raw).numpy(), atol=1e-5)
    again = runner.invoke(app, ["export", str(digits_run), "--format", fmt, "-o", str(out)])
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_export_image_run_states_the_image_preprocessing(image_run, tmp_path):
    out = tmp_path / "model.pt2"
    result = runner.invoke(app, ["export", str(image_run), "--format", "pt2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    steps = json.loads((tmp_path / "model.pt2.json").read_text())["preprocessing"]["steps"]
    assert {"op": "resize", "size": [16, 16], "interpolation": "bilinear"} in steps
    assert any(step["op"] == "normalize" for step in steps)


def test_export_onnx_without_the_extra_names_it(digits_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    result = runner.invoke(
        app, ["export", str(digits_run), "--format", "onnx", "-o", str(tmp_path / "m.onnx")]
    )
    assert result.exit_code == 3
    assert "rankwise[export]" in result.output and not (tmp_path / "m.onnx").exists()


def test_export_refuses_an_unknown_format(digits_run, tmp_path):
    result = runner.invoke(
        app, ["export", str(digits_run), "--format", "tflite", "-o", str(tmp_path / "m")]
    )
    assert (
        result.exit_code == 2 and "--format must be one of onnx, torchscript, pt2" in result.output
    )


def test_search_reports_ties_at_the_cut(digits_run, tmp_path):
    # four copies of one embedding: k = 2 keeps rows 0 and 1 and says 2 more tie
    emb = load_run(digits_run).embed(load_digits().images[:1]).numpy()
    np.save(tmp_path / "g.npy", np.repeat(emb, 4, axis=0))
    np.save(tmp_path / "q.npy", emb)
    args = [
        "search",
        str(digits_run),
        str(tmp_path / "q.npy"),
        "--gallery",
        str(tmp_path / "g.npy"),
    ]
    result = runner.invoke(app, [*args, "--k", "2", "--arrays", "embeddings", "--json", "-"])
    assert result.exit_code == 0, result.output
    query = json.loads(result.stdout)["queries"][0]
    assert [r["id"] for r in query["results"]] == [0, 1]
    assert query["ties_at_cut"] == 2 and query["cut_tied"] is True
    table = runner.invoke(app, [*args, "--k", "2"])
    assert "query 0: 2 more gallery item(s) score exactly the score at rank 2" in table.output


def test_search_with_the_faiss_backend(digits_run, tmp_path):
    pytest.importorskip("faiss")
    images = load_digits().images
    np.save(tmp_path / "q.npy", images[:3])
    np.save(tmp_path / "g.npy", images[:50])
    args = [
        "search",
        str(digits_run),
        str(tmp_path / "q.npy"),
        "--gallery",
        str(tmp_path / "g.npy"),
    ]
    result = runner.invoke(app, [*args, "--k", "4", "--backend", "faiss", "--json", "-"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["backend"] == "faiss"
    for i, query in enumerate(report["queries"]):
        assert query["ties_at_cut"] is None and query["results"][0]["id"] == i  # itself first
        scores = [r["score"] for r in query["results"]]
        assert scores == sorted(scores, reverse=True)
    bad = runner.invoke(app, [*args, "--backend", "annoy"])
    assert bad.exit_code == 2 and "--backend must be one of 'exact', 'faiss'" in bad.output
