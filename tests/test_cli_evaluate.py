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


def test_fpr_adds_the_verification_metrics_to_the_table_and_the_json(saved):
    from rankwise.metrics import verification_metrics

    tmp, emb, labels = saved
    out_json = tmp / "verification.json"
    result = _run(
        tmp / "emb.npy", tmp / "labels.npy", "--ks", "1", "--fpr", "1e-3,0.01", "--json", out_json
    )
    assert result.exit_code == 0, result.output
    expected = verification_metrics(emb, labels, fpr=(1e-3, 0.01))
    for row in ("ROC AUC", "TPR@FPR=0.001", "TPR@FPR=0.01"):
        assert row in result.output
    assert f"{expected.n_positive_pairs} positive, {expected.n_negative_pairs} negative" in (
        result.output
    )
    view = json.loads(out_json.read_text())["verification"]
    assert view["roc_auc"] == expected.roc_auc
    assert view["tpr_at_fpr"] == {"0.001": expected.tpr_at(1e-3), "0.01": expected.tpr_at(0.01)}
    assert view["operating_points"]["0.01"]["fnmr"] == 1 - expected.tpr_at(0.01)
    assert view["n_positive_pairs"] + view["n_negative_pairs"] == 150 * 149
    assert view["n_excluded_pairs"] == 150 and view["pairs"].startswith("leave-one-out")
    plain = _run(tmp / "emb.npy", tmp / "labels.npy", "--ks", "1")
    assert "ROC AUC" not in plain.output  # the default table is unchanged


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
        (lambda t: [t / "emb.npy", t / "short.npy"], "must hold one label per row of EMBEDDINGS"),
        (lambda t: [t / "multi.npz", t / "labels.npy"], "choose one with multi.npz:KEY"),
        (lambda t: [t / "multi.npz:nope", t / "labels.npy"], "no array 'nope'"),
        (lambda t: [t / "list.pt", t / "labels.npy"], "must hold a tensor"),
        (lambda t: [t / "garbage.npy", t / "labels.npy"], "garbage.npy is not a numeric .npy"),
        (lambda t: [t / "garbage.pt", t / "labels.npy"], "could not read garbage.pt"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--ks", "1,x"], "--ks"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--ks", "99999999999999999999999"], "--ks"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--similarity", "l1"], "--similarity must"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--gallery", t / "emb.npy"], "both --gallery"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--plot-pr", t / "pr.jpg"], ".png"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--fpr", "1e-3,x"], "'x' is not a number"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--fpr", "0"], "0 is outside (0, 1)"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--fpr", "1.5"], "1.5 is outside (0, 1)"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--fpr", "nan"], "nan is outside (0, 1)"),
        (lambda t: [t / "emb.npy", t / "labels.npy", "--fpr", "1e-3,"], "an empty value"),
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


# -- issue 40 item 7: labels from text, the command's own argument names, swapped arguments ------
def _table(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("name", "text", "spec"),
    [
        ("one.txt", lambda ls: "".join(f"{x}\n" for x in ls), "one.txt"),
        ("header.txt", lambda ls: "label\n" + "".join(f"{x}\n" for x in ls) + "\n", "header.txt"),
        (
            "plain.csv",
            lambda ls: "".join(f"{x},img{i}.png\n" for i, x in enumerate(ls)),
            "plain.csv",
        ),
        (
            "table.csv",
            lambda ls: "path,label\n" + "".join(f"img{i}.png,{x}\n" for i, x in enumerate(ls)),
            "table.csv",
        ),
        (
            "named.csv",
            lambda ls: "id,cls\n" + "".join(f"{i},{x}\n" for i, x in enumerate(ls)),
            "named.csv:cls",
        ),
        (
            "t.tsv",
            lambda ls: "label\tpath\n" + "".join(f"{x}\tp{i}\n" for i, x in enumerate(ls)),
            "t.tsv",
        ),
        # class names: numbered in sorted order, the same classes as the ids
        ("names.txt", lambda ls: "".join(f"class_{x:02d}\n" for x in ls), "names.txt"),
    ],
)
def test_labels_from_text_files_give_the_npy_report(saved, name, text, spec):
    tmp, emb, labels = saved
    _table(tmp / name, text(labels))
    via_text = _run(tmp / "emb.npy", str(tmp / spec), "--json", tmp / "text.json")
    assert via_text.exit_code == 0, via_text.output
    expected = retrieval_metrics(emb, labels)
    got = json.loads((tmp / "text.json").read_text())
    assert got["map"] == pytest.approx(expected.map, abs=1e-12) and got["n_queries"] == 150


@pytest.mark.parametrize(
    ("text", "spec", "message"),
    [
        ("path,label\na,1\n", "bad.csv:cls", "LABELS: bad.csv has no column 'cls'"),
        ("1\n\n2\n", "bad.txt", "bad.txt row 2 has no label"),
        ("1\n0.5\nx\n", "bad.txt", "bad.txt row 2 holds '0.5'"),
    ],
)
def test_bad_text_labels_name_the_file_and_row(saved, text, spec, message):
    tmp, _, _ = saved
    _table(tmp / spec.split(":")[0], text)
    result = _run(tmp / "emb.npy", str(tmp / spec))
    assert result.exit_code == 2 and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


def _one_line_error(result):
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") and len(result.output.strip().splitlines()) == 1
    return " ".join(result.output.split())  # rich's soft wrap off: one line; spaces normalised


def test_swapped_arguments_are_recognised_and_the_hint_says_swap(saved):
    tmp, _, _ = saved
    text = _one_line_error(_run(tmp / "labels.npy", tmp / "emb.npy"))
    assert "swapped" in text and f"{tmp / 'emb.npy'} {tmp / 'labels.npy'}" in text
    assert "reshape" not in text  # the library's hint would point the wrong way
    gallery = [tmp / "emb.npy", tmp / "labels.npy", "--gallery", tmp / "labels.npy"]
    text = _one_line_error(_run(*gallery, "--gallery-labels", tmp / "emb.npy"))
    assert "--gallery (" in text and "--gallery-labels (" in text and "swapped" in text


def test_errors_name_the_commands_arguments_not_python_parameters(saved):
    tmp, _, labels = saved
    np.save(tmp / "short.npy", labels[:10])
    cases = [
        ([tmp / "labels.npy", tmp / "labels.npy"], "EMBEDDINGS ("),  # labels given twice
        ([tmp / "emb.npy", tmp / "emb.npy"], "LABELS ("),  # embeddings given twice
        ([tmp / "emb.npy", tmp / "short.npy"], "LABELS ("),
        (
            [tmp / "emb.npy", tmp / "labels.npy", "--gallery", tmp / "emb.npy"]
            + ["--gallery-labels", tmp / "short.npy"],
            "--gallery-labels (",
        ),
    ]
    for args, named in cases:
        text = _one_line_error(_run(*args))
        assert named in text, text
        for parameter in ("`query`", "`query_labels`", "`gallery`", "`gallery_labels`"):
            assert parameter not in text, text
    # labels given twice: integers one per row are labels, not 1-D scores to reshape
    text = _one_line_error(_run(tmp / "labels.npy", tmp / "labels.npy"))
    assert "like labels" in text and "reshape" not in text
