"""scikit-learn digits (open / closed set) and CIFAR-10 python batches (closed-set setting 1)."""

import pickle

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from rankwise.data import CorruptDatasetError, DatasetNotFoundError, load_dataset


def test_digits_open_set_classes_and_counts():
    reference = load_digits()
    splits = load_dataset("digits", val_fraction=0.1, seed=0)
    assert splits.protocol == "open-set" and splits.name == "digits"
    train_classes = set(splits.train.labels.tolist()) | set(splits.val.labels.tolist())
    assert train_classes == {0, 1, 2, 3, 4}
    assert set(splits.test.labels.tolist()) == {5, 6, 7, 8, 9}
    assert len(splits.train) + len(splits.val) == int((reference.target < 5).sum())
    assert len(splits.test) == int((reference.target >= 5).sum())
    assert splits.input_shape == (1, 8, 8)
    # Test images are the reference images of classes 5-9, scaled to [0, 1], in order.
    expected = reference.images[reference.target >= 5] / 16.0
    np.testing.assert_allclose(splits.test.inputs[:, 0].numpy(), expected, rtol=1e-6)
    # Validation: about 10% of every training class, disjoint from train.
    val_counts = np.bincount(splits.val.labels, minlength=5)
    train_counts = np.bincount(reference.target[reference.target < 5], minlength=5)
    assert np.all(np.abs(val_counts - 0.1 * train_counts) < 1.0)


def test_digits_val_split_is_deterministic():
    a = load_dataset("digits", seed=4)
    b = load_dataset("digits", seed=4)
    c = load_dataset("digits", seed=5)
    assert torch.equal(a.val.inputs, b.val.inputs)
    assert not torch.equal(a.val.inputs, c.val.inputs)


def test_digits_closed_set_counts():
    splits = load_dataset("digits", protocol="closed-set", n_query=10, n_train=50, val_fraction=0.2)
    assert np.bincount(splits.test.labels).tolist() == [10] * 10
    assert len(splits.gallery) == 1797 - 100
    assert (
        np.bincount(np.concatenate([splits.train.labels, splits.val.labels])).tolist() == [50] * 10
    )
    assert np.bincount(splits.val.labels).tolist() == [10] * 10
    assert set(splits.describe()) == {"train", "val", "test", "gallery"}


def _write_cifar(folder, per_class_train=4, per_class_test=10):
    """Fake CIFAR-10 batches; every image is unique (its global index is written in pixel 0-2)."""
    folder.mkdir(parents=True)
    counter = 0

    def batch(n_per_class):
        nonlocal counter
        labels = np.repeat(np.arange(10), n_per_class)
        data = np.zeros((labels.size, 3072), dtype=np.uint8)
        for row in range(labels.size):
            data[row, :3] = [counter // 65536, (counter // 256) % 256, counter % 256]
            counter += 1
        return {b"batch_label": b"x", b"labels": labels.tolist(), b"data": data}

    for i in range(1, 6):
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(batch(per_class_train), f)
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(batch(per_class_test), f)


def _ids(ds):
    raw = ds.inputs[:, 0, 0, :3].to(torch.int64)
    return set((raw[:, 0] * 65536 + raw[:, 1] * 256 + raw[:, 2]).tolist())


def test_cifar10_closed_set_setting_one(tmp_path):
    _write_cifar(tmp_path / "cifar-10-batches-py")
    splits = load_dataset(
        "cifar10", protocol="closed-set", data_dir=tmp_path, n_query=3, n_train=6, val_fraction=0.0
    )
    assert splits.protocol == "closed-set"
    assert np.bincount(splits.test.labels).tolist() == [3] * 10
    assert np.bincount(splits.train.labels).tolist() == [6] * 10
    assert len(splits.gallery) == 5 * 40 + 100 - 30
    queries, database, train = _ids(splits.test), _ids(splits.gallery), _ids(splits.train)
    assert queries.isdisjoint(database)
    assert queries | database == set(range(300))  # every image is a query or in the database
    assert train <= database  # training images come from the database
    assert splits.train.inputs.dtype == torch.uint8 and splits.input_shape == (3, 32, 32)
    # Queries come from the test batch (ids 200..299).
    assert min(queries) >= 200


def test_cifar10_pickle_with_code_is_refused(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder)
    with open(folder / "data_batch_3", "wb") as f:
        pickle.dump({b"data": np.zeros((1, 3072), np.uint8), b"labels": [0], b"x": print}, f)
    with pytest.raises(CorruptDatasetError, match="data_batch_3"):
        load_dataset("cifar10", protocol="closed-set", data_dir=tmp_path)


def test_cifar10_truncated_batch_names_the_file(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _write_cifar(folder)
    raw = (folder / "test_batch").read_bytes()
    (folder / "test_batch").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CorruptDatasetError, match="test_batch"):
        load_dataset("cifar10", protocol="closed-set", data_dir=tmp_path)


def test_cifar10_missing_shows_layout(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="cifar-10-batches-py"):
        load_dataset("cifar10", protocol="closed-set", data_dir=tmp_path)
