"""``rankwise show`` (issue 39, item 3): the worst test queries of a run and their top-k, checked
against report.json's per-query AP and a brute-force stable ranking that leaves the query out;
digits arrays, image folders, a table's query / gallery split, and bad options."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.similarity import exact_similarity, ranking_keys
from rankwise.training import Trainer, config_from_dict, load_run
from rankwise.training.build import load_splits
from rankwise.workflows.gallery import _embed, build_gallery, gallery_html

runner = CliRunner()


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory, tiny_config):
    run_dir = tmp_path_factory.mktemp("digits") / "run"
    Trainer.from_config(tiny_config(run_dir, **{"budget.iterations": 4})).fit()
    return run_dir


def brute_force_top(q, g, k, self_row=None):
    """Top-k rows of ``g`` for ``q`` by exact cosine, equal scores by row, ``self_row`` left out."""
    keys = ranking_keys(q[None], g, "cosine")[0].numpy()
    order = np.argsort(-keys, kind="stable")
    order = order[order != self_row] if self_row is not None else order
    scores = exact_similarity(q[None], g, "cosine")[0].double().numpy()
    return order[:k], scores[order[:k]]


def test_worst_queries_match_the_report_and_a_brute_force_ranking(digits_run):
    run = load_run(digits_run)
    gallery = build_gallery(run, k=5, worst=6)
    report = json.loads((digits_run / "report.json").read_text())["test"]
    ap = np.array([np.nan if v is None else v for v in report["per_query_ap"]])
    # the rows are the six lowest APs of the report, in order (ties by row)
    expected = np.flatnonzero(~np.isnan(ap))
    expected = expected[np.argsort(ap[expected], kind="stable")][:6]
    assert [row.query for row in gallery.rows] == expected.tolist()
    assert np.allclose([row.ap for row in gallery.rows], ap[expected], rtol=0, atol=1e-12)
    assert gallery.mean_ap == pytest.approx(report["map"], abs=1e-12)
    emb = _embed(run, gallery.queries, 256)
    labels = np.asarray(gallery.queries.labels)
    for row in gallery.rows:
        ids, scores = brute_force_top(emb[row.query], emb, 5, self_row=row.query)
        assert row.ids.tolist() == ids.tolist() and row.query not in row.ids
        assert np.allclose(row.scores, scores, rtol=0, atol=1e-12)
        assert row.correct.tolist() == (labels[ids] == labels[row.query]).tolist()


def test_show_writes_the_picture_and_the_page(digits_run, tmp_path):
    png, page = tmp_path / "worst.png", tmp_path / "page.html"
    result = runner.invoke(
        app,
        ["show", str(digits_run), "--worst", "3", "--k", "4", "-o", str(png), "--html", str(page)],
    )
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert (
        text.count("<tr>") == 3 and text.count('class="right"') + text.count('class="wrong"') == 12
    )
    lines = [line for line in result.output.splitlines() if line.startswith("query")]
    assert len(lines) == 3 and all(len(line.split("top 4: ")[1]) == 4 for line in lines)


def test_show_queries_draws_the_chosen_rows(digits_run, tmp_path):
    result = runner.invoke(
        app,
        [
            "show",
            str(digits_run),
            "--queries",
            "7,2",
            "--k",
            "2",
            "--html",
            str(tmp_path / "p.html"),
        ],
    )
    assert result.exit_code == 0, result.output
    assert [line.split()[1] for line in result.output.splitlines() if line.startswith("query")] == [
        "7",
        "2",
    ]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--queries", "1,x"], "--queries must be comma-separated"),
        (["--queries", "100000"], "--queries: query 100000 is not a row"),
        (["--k", "100000"], "--k must be 1 .."),
        ([], "-o FILE.png and / or --html"),
    ],
)
def test_bad_show_options_are_one_line_errors(digits_run, tmp_path, args, says):
    out = [] if args == [] else ["-o", str(tmp_path / "x.png")]
    result = runner.invoke(app, ["show", str(digits_run), *args, *out])
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not (tmp_path / "x.png").exists()


def test_a_table_run_shows_queries_against_its_gallery(image_classes, tiny_config, tmp_path):
    table = image_classes.parent / "table.csv"
    with open(table, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["label", "path", "split", "is_query", "is_gallery"])
        for c in range(6):
            for j in range(6):
                split = "train" if c < 4 else "validation"
                writer.writerow([f"c{c}", f"images/c{c}/{j}.png", split, int(j < 2), int(j >= 2)])
    data = tiny_config.data(
        tmp_path / "run",
        dataset={"name": "csv", "data_dir": str(table), "image_size": 8, "val_fraction": 0.2},
        sampler={"m": 2, "batch_size": 4},
        budget={"iterations": 2},
    )
    Trainer.from_config(config_from_dict(data)).fit()
    run = load_run(tmp_path / "run")
    gallery = build_gallery(run, k=3, worst=4)
    splits = load_splits(run.config)
    assert len(gallery.rows) == 4 and gallery.gallery.paths == splits.gallery.paths
    q_emb, g_emb = _embed(run, splits.test, 64), _embed(run, splits.gallery, 64)
    for row in gallery.rows:
        ids, _ = brute_force_top(q_emb[row.query], g_emb, 3)
        assert row.ids.tolist() == ids.tolist()
    page = gallery_html(gallery)
    assert page.count("data:image/png;base64,") == 4 * 4


def test_the_picture_of_an_array_item_is_its_pixels(digits_run):
    from rankwise.workflows.gallery import _picture

    gallery = build_gallery(load_run(digits_run), k=1, worst=1)
    item = gallery.queries.inputs[0]
    assert torch.equal(torch.from_numpy(_picture(gallery.queries, 0)), item[0].double())


def test_the_picture_of_a_feature_vector_is_a_min_max_scaled_strip():
    from rankwise.data import ArrayDataset
    from rankwise.workflows.gallery import _picture

    data = ArrayDataset(np.array([[-2.0, 0.0, 6.0]], dtype=np.float32), np.array([0]))
    assert _picture(data, 0).tolist() == [[0.0, 0.25, 1.0]]
