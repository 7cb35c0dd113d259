"""Folder benchmarks on tiny fixtures written here in each dataset's official layout."""

from pathlib import Path

import numpy as np
import pytest
import scipy.io
from PIL import Image

from rankwise.data import (
    CorruptDatasetError,
    DatasetNotFoundError,
    ImageFolderDataset,
    load_dataset,
)


def _img(path, value=0, fmt=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (7, 5), (value % 256, 40, 90)).save(path, format=fmt)


def _check_loads(ds, size=6):
    assert isinstance(ds, ImageFolderDataset)
    x, y = ds[len(ds) - 1]
    assert x.shape == (3, size, size) and y == ds.labels[-1]


def _check_rows(splits):
    """Every sample names the list file and line (or .mat annotation) that lists its image."""
    for data in splits.splits().values():
        origin = data.origin
        assert origin is not None and origin.rows.shape == (len(data),)
        for path, row in zip(data.paths, origin.rows, strict=True):
            if origin.unit == "annotation":  # cars_annos.mat: the fixture's images are numbered
                assert Path(origin.file).name == "cars_annos.mat"
                assert Path(path).name == f"{row:06d}.jpg"
                continue
            line = Path(origin.file).read_text().splitlines()[row - 1]
            assert Path(path).stem in line, (path, origin.file, row, line)


# --------------------------------------------------------------------------- CUB-200-2011


def _make_cub(base, classes=(1, 2, 100, 101, 200), per_class=3):
    root = base / "CUB_200_2011"
    images, labels = [], []
    image_id = 1
    for c in classes:
        for k in range(per_class):
            rel = f"{c:03d}.Bird_{c}/Bird_{c}_{k}.jpg"
            _img(root / "images" / rel, image_id, "JPEG")
            images.append(f"{image_id} {rel}")
            labels.append(f"{image_id} {c}")
            image_id += 1
    (root / "images.txt").write_text("\n".join(images) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    return root


def test_cub200_metric_learning_split(tmp_path):
    _make_cub(tmp_path)
    splits = load_dataset("cub200", data_dir=tmp_path, val_fraction=0.0, image_size=6)
    # Classes 1, 2, 100 train (-> 0, 1, 2); 101, 200 test (-> 3, 4).
    assert splits.describe() == {
        "train": {"samples": 9, "classes": 3},
        "test": {"samples": 6, "classes": 2},
    }
    assert splits.train.labels.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert splits.test.labels.tolist() == [3, 3, 3, 4, 4, 4]
    assert splits.test.paths[0].endswith("101.Bird_101/Bird_101_0.jpg")
    _check_loads(splits.test)
    _check_rows(splits)
    # Pointing directly at the CUB_200_2011 folder works too.
    direct = load_dataset("cub", data_dir=tmp_path / "CUB_200_2011", val_fraction=0.0)
    assert len(direct.train) == 9


def test_cub200_validation_split(tmp_path):
    _make_cub(tmp_path, classes=(1, 2, 3, 150), per_class=10)
    splits = load_dataset("cub200", data_dir=tmp_path, val_fraction=0.2, seed=1, image_size=6)
    assert np.bincount(splits.val.labels).tolist() == [2, 2, 2]
    assert len(splits.train) == 24
    assert set(splits.train.paths).isdisjoint(splits.val.paths)
    _check_loads(splits.val)
    _check_rows(splits)


def test_cub200_mismatched_label_file(tmp_path):
    root = _make_cub(tmp_path)
    lines = (root / "image_class_labels.txt").read_text().splitlines()
    (root / "image_class_labels.txt").write_text("\n".join(lines[:-1]) + "\n")
    with pytest.raises(CorruptDatasetError, match="image_class_labels.txt"):
        load_dataset("cub200", data_dir=tmp_path)


# --------------------------------------------------------------------------- Cars196


def test_cars196_split_from_mat(tmp_path):
    root = tmp_path / "cars196"
    classes = [1, 98, 98, 99, 196, 196, 196]
    records = np.zeros(
        len(classes),
        dtype=[("relative_im_path", "O"), ("bbox_x1", "O"), ("class", "O"), ("test", "O")],
    )
    for i, c in enumerate(classes):
        rel = f"car_ims/{i + 1:06d}.jpg"
        _img(root / rel, i, "JPEG")
        records[i] = (rel, np.uint8(1), np.uint8(c), np.uint8(i % 2))
    scipy.io.savemat(root / "cars_annos.mat", {"annotations": records})
    splits = load_dataset("cars196", data_dir=tmp_path, val_fraction=0.0, image_size=6)
    assert splits.train.labels.tolist() == [0, 1, 1]  # classes 1, 98 (the 'test' flag is ignored)
    assert splits.test.labels.tolist() == [2, 3, 3, 3]  # classes 99, 196
    assert splits.train.paths[0].endswith("car_ims/000001.jpg")
    _check_loads(splits.test)
    _check_rows(splits)


# --------------------------------------------------------------------------- SOP


def _make_sop(base):
    root = base / "Stanford_Online_Products"
    header = "image_id class_id super_class_id path"
    rows = {"train": [], "test": []}
    image_id = 1
    for split, classes in (("train", [1, 2, 3]), ("test", [4, 5])):
        for c in classes:
            for k in range(2 + c % 3):
                rel = f"bicycle_final/{c}_{k}.JPG"
                _img(root / rel, image_id, "JPEG")
                rows[split].append(f"{image_id} {c} 1 {rel}")
                image_id += 1
    (root / "Ebay_train.txt").write_text("\n".join([header] + rows["train"]) + "\n")
    (root / "Ebay_test.txt").write_text("\n".join([header] + rows["test"]) + "\n")
    return root


def test_sop_split_files(tmp_path):
    _make_sop(tmp_path)
    splits = load_dataset("sop", data_dir=tmp_path, val_fraction=0.0, image_size=6)
    # class c has 2 + c % 3 images: train 3 + 4 + 2, test 3 + 4.
    assert np.bincount(splits.train.labels).tolist() == [3, 4, 2]
    assert splits.test.labels.tolist() == [3] * 3 + [4] * 4
    _check_loads(splits.train)
    _check_rows(splits)
    # the validation split is carved from Ebay_train.txt and keeps its rows
    held = load_dataset("sop", data_dir=tmp_path, val_fraction=0.3, image_size=6)
    _check_rows(held)
    assert held.val.origin.file.endswith("Ebay_train.txt")


def test_sop_bad_header_names_file(tmp_path):
    root = _make_sop(tmp_path)
    text = (root / "Ebay_test.txt").read_text().splitlines()
    (root / "Ebay_test.txt").write_text("\n".join(["id class path"] + text[1:]))
    with pytest.raises(CorruptDatasetError, match="Ebay_test.txt"):
        load_dataset("sop", data_dir=tmp_path)


# --------------------------------------------------------------------------- In-Shop


@pytest.mark.parametrize("nested", [False, True])
def test_inshop_query_gallery(tmp_path, nested):
    root = tmp_path / "InShop"
    entries = [
        ("img/WOMEN/Dresses/id_00000002/01_1_front.jpg", "id_00000002", "train"),
        ("img/WOMEN/Dresses/id_00000002/02_1_front.jpg", "id_00000002", "train"),
        ("img/MEN/Denim/id_00000010/01_1_front.jpg", "id_00000010", "train"),
        ("img/MEN/Denim/id_00000010/02_1_front.jpg", "id_00000010", "train"),
        ("img/MEN/Tees/id_00000077/01_1_front.jpg", "id_00000077", "query"),
        ("img/MEN/Tees/id_00000077/02_2_side.jpg", "id_00000077", "gallery"),
        ("img/MEN/Tees/id_00000077/03_7_add.jpg", "id_00000077", "gallery"),
        ("img/WOMEN/Tees/id_00000050/01_1_front.jpg", "id_00000050", "gallery"),
        ("img/WOMEN/Tees/id_00000050/02_1_front.jpg", "id_00000050", "query"),
    ]
    image_base = root / "Img" if nested else root
    list_dir = root / "Eval" if nested else root
    for i, (rel, _, _) in enumerate(entries):
        _img(image_base / rel, i, "JPEG")
    lines = [str(len(entries)), "image_name item_id evaluation_status"]
    lines += [f"{p} {item} {status}" for p, item, status in entries]
    list_dir.mkdir(parents=True, exist_ok=True)
    (list_dir / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")

    splits = load_dataset("inshop", data_dir=tmp_path, val_fraction=0.0, image_size=6)
    assert splits.protocol == "closed-set"
    assert splits.describe() == {
        "train": {"samples": 4, "classes": 2},
        "test": {"samples": 2, "classes": 2},
        "gallery": {"samples": 3, "classes": 2},
    }
    # Same item id -> same label across query and gallery; labels after the training classes.
    assert splits.test.labels.tolist() == [3, 2]  # id_77 -> 3, id_50 -> 2 (sorted after train)
    assert splits.gallery.labels.tolist() == [3, 3, 2]
    _check_loads(splits.gallery)
    _check_rows(splits)
    with pytest.raises(ValueError, match="closed-set"):
        load_dataset("inshop", data_dir=tmp_path, protocol="open-set")


# --------------------------------------------------------------------------- iNaturalist


def test_inaturalist_brown_split(tmp_path):
    root = tmp_path / "inaturalist"
    train = [f"train_val2018/Plantae/{cid}/{k}.jpg" for cid in (7172, 7173) for k in range(3)]
    test = [f"train_val2018/Aves/{cid}/{k}.jpg" for cid in (2000, 7172) for k in range(2)]
    for i, rel in enumerate(train + test):
        _img(root / rel, i, "JPEG")
    (root / "Inat_dataset_splits").mkdir()
    # a blank line is skipped, and the rows after it keep their line numbers
    listed = "\n".join([*train[:2], "", *train[2:]])
    (root / "Inat_dataset_splits/Inaturalist_train_set1.txt").write_text(listed + "\n")
    (root / "Inat_dataset_splits/Inaturalist_test_set1.txt").write_text("\n".join(test) + "\n")
    splits = load_dataset("inaturalist", data_dir=tmp_path, val_fraction=0.0, image_size=6)
    assert splits.train.labels.tolist() == [0, 0, 0, 1, 1, 1]
    # Aves/7172 is a different class from Plantae/7172 (supercategory is part of the class).
    assert splits.test.labels.tolist() == [2, 2, 3, 3]
    _check_loads(splits.test)
    _check_rows(splits)
    assert splits.train.origin.where(2).endswith("Inaturalist_train_set1.txt, line 4")


# --------------------------------------------------------------------------- VehicleID


def _make_vehicleid(base):
    root = base / "VehicleID_V1.0"
    lists = {
        "train_list.txt": [("0000001", 5), ("0000002", 5), ("0000003", 9), ("0000004", 9)],
        "test_list_800.txt": [("0000010", 100), ("0000011", 100)],
        "test_list_1600.txt": [
            ("0000010", 100),
            ("0000011", 100),
            ("0000012", 33),
            ("0000013", 33),
        ],
        "test_list_2400.txt": [
            ("0000010", 100),
            ("0000011", 100),
            ("0000012", 33),
            ("0000013", 33),
            ("0000014", 7),
            ("0000015", 7),
        ],
    }
    (root / "train_test_split").mkdir(parents=True)
    for fname, rows in lists.items():
        (root / "train_test_split" / fname).write_text(
            "\n".join(f"{i} {v}" for i, v in rows) + "\n"
        )
        for image_id, v in rows:
            _img(root / "image" / f"{image_id}.jpg", v, "JPEG")
    return root


@pytest.mark.parametrize(
    "test_size,n_test,n_ids", [("small", 2, 1), ("medium", 4, 2), ("large", 6, 3), (2400, 6, 3)]
)
def test_vehicleid_test_sizes(tmp_path, test_size, n_test, n_ids):
    _make_vehicleid(tmp_path)
    splits = load_dataset(
        "vehicleid", data_dir=tmp_path, val_fraction=0.0, image_size=6, test_size=test_size
    )
    assert splits.train.labels.tolist() == [0, 0, 1, 1]
    assert splits.describe()["test"] == {"samples": n_test, "classes": n_ids}
    assert splits.test.paths[0].endswith("image/0000010.jpg")
    _check_loads(splits.test)
    _check_rows(splits)


def test_vehicleid_bad_test_size(tmp_path):
    _make_vehicleid(tmp_path)
    with pytest.raises(ValueError, match="test_size"):
        load_dataset("vehicleid", data_dir=tmp_path, test_size="huge")


# --------------------------------------------------------------------------- missing data


@pytest.mark.parametrize(
    "name,fragment",
    [
        ("cub200", "image_class_labels.txt"),
        ("cars196", "cars_annos.mat"),
        ("sop", "Ebay_train.txt"),
        ("inshop", "list_eval_partition.txt"),
        ("inaturalist", "Inaturalist_train_set1.txt"),
        ("vehicleid", "train_list.txt"),
    ],
)
def test_missing_dataset_shows_layout(tmp_path, name, fragment):
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset(name, data_dir=tmp_path)
    assert fragment in str(info.value) and "`data_dir`" in str(info.value)  # the argument
    assert str(tmp_path) in str(info.value)
