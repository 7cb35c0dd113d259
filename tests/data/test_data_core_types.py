"""ArrayDataset, ImageFolderDataset (lazy loading, default transform, bad files), RetrievalSplits."""

import numpy as np
import pytest
import torch
from PIL import Image

from rankwise.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ArrayDataset,
    CorruptDatasetError,
    ImageFolderDataset,
    RetrievalSplits,
    default_image_transform,
)


def test_array_dataset_uint8_storage_converts_per_item():
    raw = torch.arange(2 * 1 * 3 * 3, dtype=torch.uint8).reshape(2, 1, 3, 3) * 10
    ds = ArrayDataset(raw, np.array([3, 7]), name="toy")
    assert ds.inputs.dtype == torch.uint8  # storage stays uint8
    assert ds.labels.dtype == np.int64
    assert ds.input_shape == (1, 3, 3)
    assert ds.num_classes == 2
    x, y = ds[1]
    assert x.dtype == torch.float32 and y == 7
    expected = np.arange(9, 18).reshape(1, 3, 3) * 10 / 255.0
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-6)
    xb, yb = ds.batch([1, 0])
    np.testing.assert_allclose(xb[0].numpy(), expected, rtol=1e-6)
    assert yb.tolist() == [7, 3]
    assert ds.inputs[1, 0, 0, 0] == 90  # the per-item conversion did not touch the storage


def test_array_dataset_rejects_bad_labels():
    with pytest.raises(ValueError, match="labels"):
        ArrayDataset(torch.zeros(3, 2), np.array([0, 1]))
    with pytest.raises(ValueError, match="integer"):
        ArrayDataset(torch.zeros(2, 2), np.array([0.5, 1.0]))


def test_array_dataset_works_with_dataloader():
    ds = ArrayDataset(torch.zeros(10, 1, 4, 4, dtype=torch.uint8), np.arange(10) % 2)
    x, y = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert x.shape == (4, 1, 4, 4) and x.dtype == torch.float32
    assert y.tolist() == [0, 1, 0, 1]


def test_default_transform_matches_imagenet_normalization_formula():
    color = (10, 128, 250)
    image = Image.new("RGB", (13, 7), color)
    out = default_image_transform(5)(image)
    assert out.shape == (3, 5, 5) and out.dtype == torch.float32
    for c in range(3):
        expected = (color[c] / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
        np.testing.assert_allclose(out[c].numpy(), expected, rtol=1e-5, atol=1e-6)


def _write_images(folder, n, size=(6, 4)):
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"im{i}.png"
        Image.new("L" if i % 2 else "RGB", size, 20 * i).save(p)  # grayscale files too
        paths.append(p.name)
    return paths


def test_image_folder_dataset_is_lazy(tmp_path, monkeypatch):
    paths = _write_images(tmp_path, 4)
    opened = []
    original_open = Image.open

    def counting_open(fp, *args, **kwargs):
        opened.append(str(fp))
        return original_open(fp, *args, **kwargs)

    monkeypatch.setattr(Image, "open", counting_open)
    ds = ImageFolderDataset(paths, [0, 0, 1, 1], root=tmp_path, image_size=8)
    assert opened == []  # nothing read at construction
    x, y = ds[3]
    assert len(opened) == 1 and opened[0].endswith("im3.png")
    assert x.shape == (3, 8, 8) and y == 1
    assert ds.input_shape == (3, 8, 8) and ds.num_classes == 2
    sub = ds.subset([0, 3])
    assert sub.labels.tolist() == [0, 1] and len(opened) == 1


def test_image_folder_missing_and_corrupt_files_name_the_file(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    ds = ImageFolderDataset(["absent.png", "broken.jpg"], [0, 1], root=tmp_path, image_size=4)
    with pytest.raises(FileNotFoundError, match="absent.png"):
        ds[0]
    with pytest.raises(CorruptDatasetError, match="broken.jpg"):
        ds[1]


def test_truncated_jpeg_names_the_file(tmp_path):
    path = tmp_path / "cut.jpg"
    Image.new("RGB", (64, 64), (1, 2, 3)).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    ds = ImageFolderDataset([str(path)], [0], image_size=4)
    with pytest.raises(CorruptDatasetError, match="cut.jpg"):
        ds[0]


def test_retrieval_splits_describe_counts():
    train = ArrayDataset(torch.zeros(6, 2), np.array([0, 0, 1, 1, 2, 2]))
    test = ArrayDataset(torch.zeros(4, 2), np.array([5, 5, 6, 7]))
    splits = RetrievalSplits(
        train=train, val=None, test=test, gallery=None, protocol="open-set", name="toy"
    )
    assert splits.describe() == {
        "train": {"samples": 6, "classes": 3},
        "test": {"samples": 4, "classes": 3},
    }
    assert splits.input_shape == (2,)
    assert "toy" in str(splits)
    with pytest.raises(ValueError, match="gallery"):
        RetrievalSplits(
            train=train, val=None, test=test, gallery=None, protocol="closed-set", name="toy"
        )
    with pytest.raises(ValueError, match="protocol"):
        RetrievalSplits(train=train, val=None, test=test, gallery=None, protocol="x", name="t")


def test_image_dataset_pickles_for_dataloader_workers(tmp_path):
    import pickle

    paths = _write_images(tmp_path, 2)
    ds = ImageFolderDataset(paths, [0, 1], root=tmp_path, image_size=4)
    clone = pickle.loads(pickle.dumps(ds))
    torch.testing.assert_close(clone[1][0], ds[1][0])
