"""`rankwise evaluate` end to end on temporary .npy / .npz / .pt files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.metrics.retrieval import retrieval_metrics

runner = CliRunner()


@pytest.fixture
def saved(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 12, 150)
    centers = rng.normal(size=(12, 8))
    emb = (centers[labels] + rng.normal(size=(150, 8))).astype(np.float32)
    np.save(tmp_path / "emb.npy", emb)
    np.save(tmp_path / "labels.npy", labels)
    np.savez(tmp_path / "single.npz", emb)
    np.savez(tmp_path / "multi.npz", queries=emb, other=emb[:, :3])
    torch.save(torch.from_numpy(emb), tmp_path / "emb.pt")
    torch.save({"embeddings": torch.from_numpy(emb)}, tmp_path / "dict.pt")
    return tmp_path, emb, labels


def _run(*args: str):
    return runner.invoke(app, ["evaluate", *map(str, args)])


def test_npy_table_json_and_png(saved):
    tmp, emb, labels = saved
    out_json, out_png = tmp / "out" / "report.json", tmp / "pr.png"
    result = _run(
        tmp / "emb.npy",
        tmp / "labels.npy",
        "--ks",
        "1,5",
        "--json",
        out_json,
        "--plot-pr",
        out_png,
    )
    assert result.exit_code == 0, result.output
    rows = ("mAP", "recall@1", "recall@5", "precision@5", "MAP@R", "R-precision", "NDCG@5", "MRR")
    for row in rows:
        assert row in result.output
    assert "excluded queries (no relevant item in the gallery): 0" in result.output
    expected = retrieval_metrics(emb, labels, ks=(1, 5))
    report = json.loads(out_json.read_text())
    assert report["map"] == pytest.approx(expected.map, abs=1e-12)
    assert report["recall_at"]["5"] == pytest.approx(expected.recall_at[5], abs=1e-12)
    assert report["map_at_r"] == pytest.approx(expected.map_at_r, abs=1e-12)
    assert report["ndcg_at"]["5"] == pytest.approx(expected.ndcg_at[5], abs=1e-12)
    assert report["mrr"] == pytest.approx(expected.mrr, abs=1e-12)
    assert report["n_queries"] == 150 and len(report["per_query_ap"]) == 150
    assert f"{expected.map:.4f}" in result.output
    with Image.open(out_png) as image:
        assert image.format == "PNG" and image.size[0] > 300


@pytest.mark.parametrize(
    "spec", ["single.npz", "multi.npz:queries", "emb.pt", "dict.pt:embeddings"]
)
def test_other_formats_give_the_same_report(saved, spec):
    tmp, emb, labels = saved
    out_json = tmp / f"{spec.replace(':', '_')}.json"
    result = _run(tmp / spec, tmp / "labels.npy", "--ks", "1", "--json", out_json)
    assert result.exit_code == 0, result.output
    assert json.loads(out_json.read_text())["map"] == pytest.approx(
        retrieval_metrics(emb, labels, ks=(1,)).map, abs=1e-12
    )


def test_separate_gallery_and_similarity(saved):
    tmp, emb, labels = saved
    np.save(tmp / "q.npy", emb[:40])
    np.save(tmp / "ql.npy", labels[:40])
    out_json = tmp / "g.json"
    result = _run(
        tmp / "q.npy",
        tmp / "ql.npy",
        "--gallery",
        tmp / "emb.npy",
        "--gallery-labels",
        tmp / "labels.npy",
        "--similarity",
        "dot",
        "--ties",
        "pessimistic",
        "--json",
        out_json,
        "--device",
        "cpu",
    )
    assert result.exit_code == 0, result.output
    expected = retrieval_metrics(
        emb[:40], labels[:40], emb, labels, similarity="dot", ties="pessimistic"
    )
    got = json.loads(out_json.read_text())
    assert got["map"] == pytest.approx(expected.map, abs=1e-12)
    assert got["ties"] == "pessimistic" and got["n_gallery"] == 150


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda t: [t / "missing.npy", t / "labels.npy"], "file not found"),
        (lambda t: [t / "emb.csv", t / "labels.npy"], "unsupported file type"),
        (lambda t: [t / "cube.npy", t / "labels.npy"], "must be 2-D"),
        (lambda t: [t / "emb.npy", t / "short.npy"], "one label per embedding"),
        (lambda t: [t / "multi.npz", t / "labels.npy"], "choose one with multi.npz:KEY"),
        (lambda t: [t / "multi.npz:nope", t / "labels.npy"], "no array 'nope'"),
        (lambda t: [t / "list.pt", t / "labels.npy"], "must hold a tensor"),
        (lambda t: [t / "garbage.npy", t / "labels.npy"], "garbage.npy is not a numeric .npy"),
        (lambda t: [t / "garbage.pt", t / "labels.npy"], "could not read garbage.pt"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--ks", "1,x"], "--ks"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--ks", "99999999999999999999999"], "--ks"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--similarity", "l1"], "`similarity`"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--gallery", t / "emb.npy"], "both --gallery"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--plot-pr", t / "pr.jpg"], ".png"),
    ],
)
def test_bad_input_exits_2_with_one_line_message(saved, make_args, message):
    tmp, emb, labels = saved
    (tmp / "emb.csv").write_text("1,2\n")
    np.save(tmp / "cube.npy", np.zeros((3, 2, 2)))
    np.save(tmp / "short.npy", labels[:10])
    torch.save([1, 2, 3], tmp / "list.pt")
    (tmp / "garbage.npy").write_bytes(b"not an array at all")
    (tmp / "garbage.pt").write_bytes(b"not a torch file")
    result = _run(*make_args(tmp))
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert result.output.strip().startswith("error:")
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--json", "--plot-pr"])
@pytest.mark.parametrize("where", ["under_a_file", "is_a_directory"])
def test_unwritable_output_path_exits_2_with_one_line_message(saved, flag, where):
    tmp, _, _ = saved
    (tmp / "a_file").write_text("not a directory\n")
    (tmp / "a_dir.png").mkdir()
    name = "out.json" if flag == "--json" else "out.png"
    target = tmp / "a_file" / name if where == "under_a_file" else tmp / "a_dir.png"
    if flag == "--json" and where == "is_a_directory":
        target = tmp / "a_dir.png"  # a directory, whatever its suffix
    result = _run(tmp / "emb.npy", tmp / "labels.npy", flag, target)
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith("error:") and flag in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_write_failure_after_the_evaluation_exits_2_with_one_line_message(saved, monkeypatch):
    tmp, _, _ = saved

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("pathlib.Path.write_text", refuse)
    result = _run(tmp / "emb.npy", tmp / "labels.npy", "--json", tmp / "report.json")
    assert result.exit_code == 2, result.output
    # the report was printed before the write failed; the failure is one line at the end
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error:") and "--json" in last and "Permission denied" in last
    assert "Traceback" not in result.output and result.output.count("error:") == 1
