"""Your own data (issue 39, item 1): ``folder``, ``csv`` and ``arrays`` datasets from the config and
the command line; their splits, the table's query / gallery flags and categories, bad input as one
line naming the row and column (exit 2, nothing written), and a folder run resumed after Ctrl-C."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.data import CorruptDatasetError, DatasetNotFoundError, load_dataset
from rankwise.data.preflight import check_image_files
from rankwise.data.registry import input_spec

runner = CliRunner()


def write_table(
    path, rows, columns=("label", "path", "split", "is_query", "is_gallery", "category")
):
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        writer.writerows(rows)
    return path


def table_of(images, flags=True, category=True):
    """Classes c0-c3 train, c4-c5 validation; first two images of a class queries, the rest gallery."""
    rows = []
    for c in range(6):
        for j in range(6):
            row = [f"c{c}", f"images/c{c}/{j}.png", "train" if c < 4 else "validation"]
            if flags:
                row += [int(j < 2), int(j >= 2)]
            if category:
                row += ["shoes" if c % 2 else "bags"]
            rows.append(row)
    columns = ["label", "path", "split"]
    columns += ["is_query", "is_gallery"] if flags else []
    columns += ["category"] if category else []
    return write_table(images.parent / "table.csv", rows, columns)


def paths_of(dataset):
    return {p.split("images/")[1] for p in dataset.paths}


def test_folder_open_set_splits_whole_classes_reproducibly(image_classes):
    splits = load_dataset("folder", data_dir=image_classes, image_size=16, val_fraction=0.2)
    assert splits.protocol == "open-set" and splits.gallery is None
    train_classes = {p.split("/")[0] for p in paths_of(splits.train) | paths_of(splits.val)}
    test_classes = {p.split("/")[0] for p in paths_of(splits.test)}
    assert not train_classes & test_classes and len(train_classes | test_classes) == 6
    # training labels contiguous from 0, test labels after them
    assert set(splits.train.labels.tolist()) == set(range(len(train_classes)))
    assert min(splits.test.labels) >= len(train_classes)
    # every image used exactly once
    everything = paths_of(splits.train) | paths_of(splits.val) | paths_of(splits.test)
    assert len(everything) == 36 == len(splits.train) + len(splits.val) + len(splits.test)
    again = load_dataset("folder", data_dir=image_classes, image_size=16, val_fraction=0.2)
    assert again.test.paths == splits.test.paths
    x, y = splits.test[0]
    assert x.shape == (3, 16, 16) and isinstance(y, int)


def test_folder_test_fraction_and_seed_choose_the_test_classes(image_classes):
    def test_classes(**kw):
        s = load_dataset("folder", data_dir=image_classes, image_size=8, **kw)
        return {p.split("/")[0] for p in paths_of(s.test)}

    assert len(test_classes()) == 2
    assert len(test_classes(test_fraction=0.5)) == 3
    draws = {frozenset(test_classes(seed=seed)) for seed in range(6)}
    assert len(draws) > 1


def test_folder_closed_set_splits_every_class(image_classes):
    splits = load_dataset(
        "folder", data_dir=image_classes, image_size=8, protocol="closed-set", val_fraction=0.2
    )
    assert splits.protocol == "closed-set"
    assert set(np.unique(splits.test.labels)) == set(range(6))
    assert set(np.unique(splits.gallery.labels)) == set(range(6))
    assert not paths_of(splits.test) & paths_of(splits.gallery)
    assert paths_of(splits.train) <= paths_of(splits.gallery)


def test_folder_val_holdout_classes_holds_out_whole_classes(image_classes):
    splits = load_dataset(
        "folder", data_dir=image_classes, image_size=8, val_holdout="classes", val_fraction=0.3
    )
    assert not set(splits.val.labels.tolist()) & set(splits.train.labels.tolist())


def test_table_with_flags_is_query_against_gallery_with_categories(image_classes):
    splits = load_dataset("csv", data_dir=table_of(image_classes), image_size=8, val_fraction=0.2)
    assert splits.protocol == "closed-set"
    assert paths_of(splits.test) == {f"c{c}/{j}.png" for c in (4, 5) for j in (0, 1)}
    assert paths_of(splits.gallery) == {f"c{c}/{j}.png" for c in (4, 5) for j in range(2, 6)}
    assert {p.split("/")[0] for p in paths_of(splits.train)} == {"c0", "c1", "c2", "c3"}
    assert splits.test.categories.tolist() == ["bags", "bags", "shoes", "shoes"]
    assert splits.gallery.categories.tolist() == ["bags"] * 4 + ["shoes"] * 4


def test_table_without_flags_is_leave_one_out(image_classes):
    table = table_of(image_classes, flags=False, category=False)
    splits = load_dataset("csv", data_dir=table, image_size=8, val_fraction=0.2)
    assert splits.protocol == "open-set" and splits.gallery is None
    assert len(splits.test) == 12 and not hasattr(splits.test, "categories")


def test_table_rows_flagged_both_everywhere_are_leave_one_out(image_classes):
    rows = [
        [f"c{c}", f"images/c{c}/{j}.png", "train" if c < 4 else "validation", 1, 1]
        for c in range(6)
        for j in range(6)
    ]
    table = write_table(image_classes.parent / "t.csv", rows, columns=CSV_FLAGS)
    splits = load_dataset("csv", data_dir=table, image_size=8, val_fraction=0.2)
    assert splits.protocol == "open-set" and len(splits.test) == 12


CSV_FLAGS = ("label", "path", "split", "is_query", "is_gallery")


def test_arrays_without_split_are_split_by_class_and_with_split_as_given(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.random((60, 5)).astype(np.float32)
    y = np.repeat(np.arange(6), 10)
    np.savez(tmp_path / "a.npz", x=x, y=y)
    splits = load_dataset("arrays", data_dir=tmp_path / "a.npz", val_fraction=0.1)
    assert splits.input_shape == (5,)
    train_rows = {tuple(r) for r in splits.train.inputs.numpy().tolist()}
    test_rows = {tuple(r) for r in splits.test.inputs.numpy().tolist()}
    assert not train_rows & test_rows and len(splits.test) == 20
    split = np.where(y < 4, "train", "validation")
    np.savez(tmp_path / "b.npz", x=x, y=y, split=split)
    splits = load_dataset("arrays", data_dir=tmp_path / "b.npz", val_fraction=0.1)
    assert torch.equal(splits.test.inputs, torch.from_numpy(x[40:]))
    assert input_spec("arrays", 224, tmp_path / "b.npz") == ((5,), "float")


def _break(kind, images):
    """Make the bad input ``kind``; returns (dataset name, data_dir, what the message must say)."""
    if kind == "missing file":
        table = table_of(images)
        text = table.read_text().replace("images/c5/3.png", "images/c5/nope.png")
        table.write_text(text)
        return "csv", table, ["table.csv row 35, column 'path'", "nope.png", "missing"]
    if kind == "unreadable image":
        (images / "c2" / "4.png").write_bytes(b"not a png")
        return "folder", images, ["dataset 'folder'", "c2/4.png", "not an image"]
    if kind == "unreadable image in table":
        (images / "c1" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
        return (
            "csv",
            table_of(images),
            ["table.csv row 8, column 'path'", "c1/0.png", "not an image"],
        )
    if kind == "empty class":
        (images / "c9").mkdir()
        return "folder", images, ["class folder", "c9", "holds no image"]
    if kind == "duplicate path":
        table = table_of(images)
        table.write_text(table.read_text().replace("images/c0/1.png", "images/c0/0.png"))
        return "csv", table, ["row 3", "column 'path'", "already on row 2"]
    if kind == "missing column":
        table = table_of(images)
        table.write_text(table.read_text().replace("label,", "klass,", 1))
        return "csv", table, ["no column 'label'"]
    if kind == "unknown column":
        table = table_of(images)
        table.write_text(table.read_text().replace("category", "categroy", 1))
        return "csv", table, ["unknown column 'categroy'"]
    if kind == "bad split":
        table = table_of(images)
        lines = table.read_text().splitlines()
        lines[5] = lines[5].replace(",train,", ",test,")
        table.write_text("\n".join(lines) + "\n")
        return "csv", table, ["row 6", "column 'split'", "'test'"]
    if kind == "bad flag":
        table = table_of(images)
        lines = table.read_text().splitlines()
        lines[30] = lines[30].replace(",validation,0,", ",validation,maybe,")
        table.write_text("\n".join(lines) + "\n")
        return "csv", table, ["row 31", "column 'is_query'", "'maybe'"]
    if kind == "empty label":
        table = table_of(images)
        lines = table.read_text().splitlines()
        lines[3] = lines[3].replace("c0,", ",", 1)
        table.write_text("\n".join(lines) + "\n")
        return "csv", table, ["row 4", "column 'label'", "empty"]
    if kind == "extra cell":
        table = table_of(images)
        lines = table.read_text().splitlines()
        lines[4] += ",surplus"
        table.write_text("\n".join(lines) + "\n")
        return "csv", table, ["row 5", "7 cells for 6 columns"]
    if kind == "missing cell":
        table = table_of(images)
        lines = table.read_text().splitlines()
        lines[6] = lines[6].rsplit(",", 1)[0]
        table.write_text("\n".join(lines) + "\n")
        return "csv", table, ["row 7", "fewer cells"]
    if kind == "no table":
        return "csv", images.parent / "absent.csv", ["absent.csv", "is not a file"]
    if kind == "arrays without y":
        np.savez(images.parent / "a.npz", x=np.zeros((4, 3), np.float32))
        return "arrays", images.parent / "a.npz", ["no array 'y'"]
    if kind == "arrays with NaN":
        x = np.zeros((8, 3), np.float32)
        x[5, 1] = np.nan
        np.savez(images.parent / "a.npz", x=x, y=np.arange(8))
        return "arrays", images.parent / "a.npz", ["row 5", "NaN"]
    raise AssertionError(kind)


BAD = [
    "missing file",
    "unreadable image",
    "unreadable image in table",
    "empty class",
    "duplicate path",
    "missing column",
    "unknown column",
    "bad split",
    "bad flag",
    "empty label",
    "extra cell",
    "missing cell",
    "no table",
    "arrays without y",
    "arrays with NaN",
]


# bad files are found by the pre-flight check every run makes before its first step
FILE_PROBLEMS = ("missing file", "unreadable image", "unreadable image in table")


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_is_named_by_row_and_column(image_classes, kind):
    name, data_dir, says = _break(kind, image_classes)
    with pytest.raises((CorruptDatasetError, DatasetNotFoundError)) as info:
        splits = load_dataset(name, data_dir=data_dir, image_size=8)
        assert kind in FILE_PROBLEMS, "loaded without an error"
        check_image_files(splits)
    message = str(info.value)
    assert "\n" not in message
    for part in says:
        assert part in message, (part, message)


@pytest.mark.parametrize(
    "kind", ["unreadable image", "missing file", "duplicate path", "missing column"]
)
def test_bad_input_from_the_command_line_is_exit_2_and_writes_nothing(
    image_classes, tiny_config, tmp_path, kind
):
    name, data_dir, says = _break(kind, image_classes)
    config = tmp_path / "c.json"
    data = tiny_config.data(
        dataset={"name": name, "image_size": 8}, sampler={"m": 2, "batch_size": 4}
    )
    config.write_text(json.dumps(data))
    out = tmp_path / "run"
    result = runner.invoke(
        app, ["train", "-c", str(config), "--data-dir", str(data_dir), "-o", str(out)]
    )
    assert result.exit_code == 2, result.output
    assert all(part in " ".join(result.output.split()) for part in says), result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_own_dataset_without_data_dir_says_to_set_it(tiny_config, tmp_path):
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config.data(dataset={"name": "folder"})))
    result = runner.invoke(app, ["train", "-c", str(config), "-o", str(tmp_path / "run")])
    assert result.exit_code == 2 and "dataset.data_dir" in result.output
    assert not (tmp_path / "run").exists()


FOLDER_RUN = {
    "dataset": {"name": "folder", "image_size": 8, "val_fraction": 0.2},
    "sampler": {"m": 2, "batch_size": 4},
    "budget.iterations": 6,
    "eval_every": 2,
    "eval_ks": [1, 5],
}


def test_a_folder_run_resumed_after_ctrl_c_matches_an_uninterrupted_one(
    image_classes, tiny_config, ctrl_c_and_resume
):
    from rankwise.training import config_from_dict

    def config(run_dir):
        data = tiny_config.data(run_dir, **FOLDER_RUN)
        data["dataset"]["data_dir"] = str(image_classes)
        return config_from_dict(data)

    ctrl_c_and_resume(config)


def test_an_arrays_run_embeds_its_float_inputs(tiny_config, tmp_path):
    from rankwise.training import Trainer, config_from_dict, load_run

    rng = np.random.default_rng(1)
    y = np.repeat(np.arange(8), 8)
    x = (rng.normal(size=(64, 6)) * 3 + y[:, None]).astype(np.float32)  # values outside [0, 1]
    np.savez(tmp_path / "a.npz", x=x, y=y)
    data = tiny_config.data(
        tmp_path / "run",
        dataset={"name": "arrays", "data_dir": str(tmp_path / "a.npz"), "val_fraction": 0.2},
        model={"backbone": "mlp", "embedding_dim": 4},
        sampler={"m": 2, "batch_size": 4},
        budget={"iterations": 2},
    )
    Trainer.from_config(config_from_dict(data)).fit()
    run = load_run(tmp_path / "run")
    assert run.input_shape == (6,) and run.input_kind == "float"
    assert run.embed(x[:5]).shape == (5, 4)


def test_a_table_with_categories_reports_the_test_map_per_category(
    image_classes, tiny_config, tmp_path
):
    from rankwise.training import Trainer, config_from_dict

    data = tiny_config.data(
        tmp_path / "run",
        dataset={"name": "csv", "data_dir": str(table_of(image_classes)), "image_size": 8},
        sampler={"m": 2, "batch_size": 4},
        budget={"iterations": 2},
    )
    Trainer.from_config(config_from_dict(data)).fit()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    ap = np.array(report["test"]["per_query_ap"], dtype=float)
    # queries: c4/0, c4/1 (bags), c5/0, c5/1 (shoes)
    assert report["test_per_category"] == {
        "bags": {"map": float(ap[:2].mean()), "n_queries": 2, "n_queries_without_relevant": 0},
        "shoes": {"map": float(ap[2:].mean()), "n_queries": 2, "n_queries_without_relevant": 0},
    }
    # runs without categories keep report.json as it was
    plain = tiny_config(tmp_path / "plain", **{"budget.iterations": 2})
    Trainer.from_config(plain).fit()
    assert "test_per_category" not in json.loads((tmp_path / "plain" / "report.json").read_text())


def test_bench_and_embed_take_a_folder_dataset(image_classes, tmp_path):
    config = tmp_path / "folder.yaml"
    config.write_text(
        "dataset: {name: folder, image_size: 8, val_fraction: 0.2}\n"
        "model: {backbone: small_cnn, embedding_dim: 8}\n"
        "loss: {name: auc}\n"
        "sampler: {m: 2, batch_size: 4}\n"
        "budget: {iterations: 2}\n"
        "eval_every: 2\neval_ks: [1]\nthreads: 1\nprogress: false\n"
        "bench: {losses: [auc, ap], overrides: {}}\n"
    )
    args = ["bench", "-c", str(config), "-d", "folder", "--data-dir", str(image_classes)]
    result = runner.invoke(app, [*args, "--seeds", "1", "-o", str(tmp_path / "bench")])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert "folder (open-set)" in result.output and summary
    (run_dir,) = [p.parent for p in (tmp_path / "bench").rglob("report.json")][:1]
    out = tmp_path / "emb.npy"
    result = runner.invoke(app, ["embed", str(run_dir), str(image_classes / "c0"), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert np.load(out).shape == (6, 8)


def test_a_spreadsheets_byte_order_mark_and_hidden_folders_are_not_data(image_classes):
    table = table_of(image_classes)
    table.write_bytes(b"\xef\xbb\xbf" + table.read_bytes())
    assert len(load_dataset("csv", data_dir=table, image_size=8).test) == 4
    (image_classes / ".ipynb_checkpoints").mkdir()
    (image_classes / "c0" / ".thumbs").mkdir()
    (image_classes / "c0" / ".thumbs" / "0.png").write_bytes(b"junk")
    splits = load_dataset("folder", data_dir=image_classes, image_size=8)
    assert len(splits.train) + len(splits.val) + len(splits.test) == 36
