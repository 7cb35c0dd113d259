"""IDX reading (MNIST / Fashion-MNIST): headers written by hand here, gzip, corrupt files, lookup."""

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from rankwise.data import (
    CorruptDatasetError,
    DatasetNotFoundError,
    load_dataset,
    read_idx,
    write_idx,
)

SYSTEM_FASHION = Path("/usr/share/datasets/fashion-mnist")


def _idx_bytes(array, magic):
    # Independent of rankwise.data.write_idx: big-endian magic then one uint32 per dim.
    header = struct.pack(">i", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def _write_mnist(folder, n_train=40, n_test=20, size=5, gz=False, seed=0):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "train-images-idx3-ubyte": (rng.integers(0, 256, (n_train, size, size)), 2051),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10, 2049),
        "t10k-images-idx3-ubyte": (rng.integers(0, 256, (n_test, size, size)), 2051),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10, 2049),
    }
    for stem, (arr, magic) in data.items():
        raw = _idx_bytes(arr, magic)
        if gz:
            with gzip.open(folder / (stem + ".gz"), "wb") as f:
                f.write(raw)
        else:
            (folder / stem).write_bytes(raw)
    return {k: v[0] for k, v in data.items()}


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_roundtrip(tmp_path, gz):
    arrays = _write_mnist(tmp_path, gz=gz)
    suffix = ".gz" if gz else ""
    images = read_idx(tmp_path / f"train-images-idx3-ubyte{suffix}", 2051)
    labels = read_idx(tmp_path / f"train-labels-idx1-ubyte{suffix}", 2049)
    assert images.dtype == np.uint8 and images.shape == (40, 5, 5)
    np.testing.assert_array_equal(images, arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(labels, arrays["train-labels-idx1-ubyte"])
    # write_idx produces the same bytes as the hand-written header.
    write_idx(tmp_path / "copy", images)
    assert (tmp_path / "copy").read_bytes() == _idx_bytes(images, 2051)


def test_truncated_idx_names_the_file(tmp_path):
    _write_mnist(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CorruptDatasetError, match="train-images-idx3-ubyte.*truncated"):
        read_idx(path, 2051)
    with pytest.raises(CorruptDatasetError, match="train-images-idx3-ubyte"):
        load_dataset("mnist", data_dir=tmp_path)


def test_truncated_gzip_names_the_file(tmp_path):
    _write_mnist(tmp_path, gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:30])
    with pytest.raises(CorruptDatasetError, match="t10k-images-idx3-ubyte.gz"):
        load_dataset("mnist", data_dir=tmp_path)


def test_wrong_magic_names_the_file(tmp_path):
    _write_mnist(tmp_path)
    # A label file where the image file should be: magic 2049 instead of 2051.
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(_idx_bytes(np.zeros(20), 2049))
    with pytest.raises(CorruptDatasetError, match=r"t10k-images-idx3-ubyte.*magic number 2049"):
        load_dataset("fashion-mnist", data_dir=tmp_path)


def test_label_count_mismatch_is_reported(tmp_path):
    _write_mnist(tmp_path)
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(_idx_bytes(np.zeros(39), 2049))
    with pytest.raises(CorruptDatasetError, match="40 images but .* 39 labels"):
        load_dataset("mnist", data_dir=tmp_path)


def test_missing_fashion_mnist_says_how_to_get_it(tmp_path):
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("fashion-mnist", data_dir=tmp_path / "nowhere")
    message = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in message
    assert "`data_dir`" in message and "--data-dir" not in message  # the Python argument
    assert "train-images-idx3-ubyte" in message
    assert isinstance(info.value, FileNotFoundError)


def test_open_set_split_and_uint8_storage(tmp_path):
    arrays = _write_mnist(tmp_path, gz=True)
    splits = load_dataset("mnist", data_dir=tmp_path, val_fraction=0.0)
    train_y, test_y = arrays["train-labels-idx1-ubyte"], arrays["t10k-labels-idx1-ubyte"]
    assert splits.protocol == "open-set" and splits.gallery is None and splits.val is None
    assert sorted(set(splits.train.labels.tolist())) == [0, 1, 2, 3, 4]
    assert sorted(set(splits.test.labels.tolist())) == [5, 6, 7, 8, 9]
    assert len(splits.train) == int((train_y < 5).sum())  # classes 0-4 of the train split
    assert len(splits.test) == int((test_y >= 5).sum())  # classes 5-9 of the test split
    assert splits.train.inputs.dtype == torch.uint8 and splits.input_shape == (1, 5, 5)
    x, y = splits.test[0]
    first_test = arrays["t10k-images-idx3-ubyte"][test_y >= 5][0]
    np.testing.assert_allclose(x[0].numpy(), first_test / 255.0, rtol=1e-6)
    assert y == test_y[test_y >= 5][0]


def test_rankwise_data_env_with_subfolder(tmp_path, monkeypatch):
    _write_mnist(tmp_path / "fashion-mnist")
    monkeypatch.setenv("RANKWISE_DATA", str(tmp_path))
    splits = load_dataset("fashion-mnist", val_fraction=0.0)
    assert len(splits.train) == 20 and len(splits.test) == 10


def test_closed_set_counts(tmp_path):
    _write_mnist(tmp_path, n_train=100, n_test=50)
    splits = load_dataset(
        "mnist", data_dir=tmp_path, protocol="closed-set", n_query=2, n_train=6, val_fraction=0.0
    )
    assert np.bincount(splits.test.labels).tolist() == [2] * 10
    assert len(splits.gallery) == 100 + 50 - 20
    assert np.bincount(splits.train.labels).tolist() == [6] * 10
    assert splits.gallery.inputs.dtype == torch.uint8


@pytest.mark.skipif(
    not SYSTEM_FASHION.is_dir(), reason="Debian package dataset-fashion-mnist not installed"
)
def test_system_fashion_mnist_loads(monkeypatch):
    monkeypatch.delenv("RANKWISE_DATA", raising=False)
    splits = load_dataset("fashion-mnist", seed=0)
    # Official sizes: 6000 train / 1000 test images per class; classes 0-4 train, 5-9 test.
    assert len(splits.train) + len(splits.val) == 30000
    assert len(splits.val) == 3000
    assert np.bincount(splits.val.labels).tolist() == [600] * 5
    assert len(splits.test) == 5000 and set(splits.test.labels.tolist()) == {5, 6, 7, 8, 9}
    assert splits.train.inputs.dtype == torch.uint8
    assert splits.input_shape == (1, 28, 28)
    assert os.path.basename(str(SYSTEM_FASHION)) == "fashion-mnist"
