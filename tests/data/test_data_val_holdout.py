"""Open-set validation (``val_holdout="classes"``) on every kind of dataset."""

import pickle

import numpy as np
import pytest
from PIL import Image

from rankwise.data import class_holdout_split, default_val_holdout, load_dataset, write_idx


def _check_open_set_val(splits, n_train_classes_before):
    """Held-out classes are absent from training; labels stay contiguous and never collide."""
    train, val = set(splits.train.labels.tolist()), set(splits.val.labels.tolist())
    assert train.isdisjoint(val)
    assert len(val) >= 2 and len(train) >= 2
    assert train | val == set(range(n_train_classes_before))
    assert train == set(range(len(train)))  # training labels are 0 .. K-1
    assert min(val) == len(train)
    test = set(splits.test.labels.tolist())
    assert test.isdisjoint(train | val)
    assert min(np.bincount(splits.val.labels)[sorted(val)]) >= 2  # every query has a positive
    assert any("val (open-set)" in note for note in splits.notes)


def test_class_holdout_split_counts_and_relabelling():
    labels = np.repeat(np.arange(20), 5)
    kept, held, relabelled = class_holdout_split(labels, 0.25, seed=3)
    assert np.intersect1d(kept, held).size == 0 and kept.size + held.size == 100
    assert np.unique(labels[held]).size == 5  # round(0.25 * 20)
    assert set(relabelled[kept].tolist()) == set(range(15))
    assert set(relabelled[held].tolist()) == set(range(15, 20))
    # a class keeps its samples together and its new id is the same for all of them
    for c in range(20):
        assert np.unique(relabelled[labels == c]).size == 1
    again = class_holdout_split(labels, 0.25, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((kept, held, relabelled), again, strict=True))
    other = class_holdout_split(labels, 0.25, seed=4)
    assert not np.array_equal(held, other[1])


def test_class_holdout_split_skips_singletons_and_checks_sizes():
    labels = np.array([0, 1, 1, 2, 3, 3, 4, 4])  # classes 0 and 2 have one sample each
    for seed in range(10):
        _, held, _ = class_holdout_split(labels, 0.4, seed)
        assert set(labels[held].tolist()) <= {1, 3, 4}
    with pytest.raises(ValueError, match="val_holdout='samples'"):
        class_holdout_split(np.array([0, 0, 1, 1, 2, 2]), 0.5, 0)  # would leave 1 class
    with pytest.raises(ValueError, match="val_fraction"):
        class_holdout_split(labels, 0.0, 0)


def test_defaults():
    assert default_val_holdout("digits") == "samples"
    assert default_val_holdout("SOP") == "samples"
    assert default_val_holdout("fashion_mnist_instances") == "classes"
    with pytest.raises(ValueError, match="val_holdout"):
        load_dataset("digits", val_holdout="queries")


def test_digits_open_set_validation():
    samples = load_dataset("digits")
    assert set(samples.val.labels.tolist()) == set(samples.train.labels.tolist())
    splits = load_dataset("digits", val_holdout="classes", val_fraction=0.4)
    _check_open_set_val(splits, 5)
    assert len(splits.train) + len(splits.val) == len(samples.train) + len(samples.val)
    assert np.array_equal(splits.test.labels, samples.test.labels)  # the test is untouched


def test_closed_set_array_dataset_refuses_class_holdout():
    with pytest.raises(ValueError, match="open-set"):
        load_dataset("digits", protocol="closed-set", val_holdout="classes")


def test_mnist_family_open_set_validation(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "mnist"
    folder.mkdir()
    write_idx(folder / "train-images-idx3-ubyte", rng.integers(0, 256, (100, 4, 4), np.uint8))
    write_idx(folder / "train-labels-idx1-ubyte", (np.arange(100) % 10).astype(np.uint8))
    write_idx(folder / "t10k-images-idx3-ubyte", rng.integers(0, 256, (50, 4, 4), np.uint8))
    write_idx(folder / "t10k-labels-idx1-ubyte", (np.arange(50) % 10).astype(np.uint8))
    splits = load_dataset("mnist", data_dir=tmp_path, val_holdout="classes", val_fraction=0.4)
    _check_open_set_val(splits, 5)
    assert len(splits.train) == 30 and len(splits.val) == 20  # 3 and 2 classes of 10


def test_cifar10_open_set_validation(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, n in [(f"data_batch_{i}", 20) for i in range(1, 6)] + [("test_batch", 20)]:
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": (np.arange(n) % 10).tolist(),
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    splits = load_dataset("cifar10", data_dir=tmp_path, val_holdout="classes")
    _check_open_set_val(splits, 5)  # 10 % of 5 classes rounds to the minimum of 2


def _img(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (7, 5), (value % 256, 40, 90)).save(path, format="JPEG")


def test_image_folder_open_set_validation(tmp_path):
    root = tmp_path / "CUB_200_2011"
    images, labels, image_id = [], [], 1
    for c in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 150, 200):  # 10 training classes, 2 test classes
        for k in range(3):
            rel = f"{c:03d}.Bird_{c}/Bird_{c}_{k}.jpg"
            _img(root / "images" / rel, image_id)
            images.append(f"{image_id} {rel}")
            labels.append(f"{image_id} {c}")
            image_id += 1
    (root / "images.txt").write_text("\n".join(images) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    splits = load_dataset(
        "cub200", data_dir=tmp_path, val_holdout="classes", val_fraction=0.3, image_size=6
    )
    _check_open_set_val(splits, 10)
    assert len(splits.val) == 9  # 3 whole classes
    x, _ = splits.val[0]
    assert x.shape == (3, 6, 6)


def test_inshop_query_gallery_allows_class_holdout(tmp_path):
    # In-Shop is query-vs-gallery, but its test items are disjoint from its training items
    root = tmp_path / "InShop"
    entries = []
    for item in range(6):
        for view in range(2):
            entries.append((f"img/MEN/Tees/id_{item:08d}/{view:02d}_1_front.jpg", item, "train"))
    entries += [
        ("img/MEN/Tees/id_00000077/01_1_front.jpg", 77, "query"),
        ("img/MEN/Tees/id_00000077/02_2_side.jpg", 77, "gallery"),
    ]
    for i, (rel, _, _) in enumerate(entries):
        _img(root / rel, i)
    lines = [str(len(entries)), "image_name item_id evaluation_status"]
    lines += [f"{p} id_{item:08d} {status}" for p, item, status in entries]
    (root / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")
    splits = load_dataset("inshop", data_dir=tmp_path, val_holdout="classes", image_size=6)
    assert splits.protocol == "closed-set"
    train, val = set(splits.train.labels.tolist()), set(splits.val.labels.tolist())
    assert train == {0, 1, 2, 3} and val == {4, 5}
    assert splits.test.labels.tolist() == [6] and splits.gallery.labels.tolist() == [6]


def test_config_key_reaches_the_loader():
    from rankwise.training import ConfigError, config_from_dict
    from rankwise.training.build import load_splits

    base = {"loss": {"name": "ap"}, "budget": {"iterations": 1}}
    config = config_from_dict(
        {"dataset": {"name": "digits", "val_holdout": "classes", "val_fraction": 0.4}, **base}
    )
    splits = load_splits(config)
    assert set(splits.val.labels.tolist()).isdisjoint(splits.train.labels.tolist())
    default = config_from_dict({"dataset": {"name": "digits"}, **base})
    assert default.dataset.val_holdout is None
    with pytest.raises(ConfigError, match="dataset.val_holdout"):
        config_from_dict({"dataset": {"name": "digits", "val_holdout": "both"}, **base})
    bad = config_from_dict(
        {"dataset": {"name": "digits-instances", "val_holdout": "samples"}, **base}
    )
    with pytest.raises(ConfigError, match="val_holdout"):
        load_splits(bad)
