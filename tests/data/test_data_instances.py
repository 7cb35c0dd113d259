"""Augmented-instance benchmarks: views, determinism, disjoint sources, options, pi sweep."""

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from rankwise.data import (
    DATASETS,
    INSTANCE_DEFAULTS,
    InstanceViews,
    ViewAugmentation,
    build_instance_splits,
    dataset_protocols,
    load_dataset,
    write_idx,
)
from rankwise.metrics import retrieval_metrics

SYSTEM_FASHION = Path("/usr/share/datasets/fashion-mnist")
needs_fashion = pytest.mark.skipif(
    not (SYSTEM_FASHION / "train-images-idx3-ubyte.gz").exists()
    and not (SYSTEM_FASHION / "train-images-idx3-ubyte").exists(),
    reason="Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)",
)
SMALL = {"train_classes": 40, "val_classes": 10, "test_classes": 20}


def _raw_map(dataset):
    flat = dataset.inputs.reshape(len(dataset), -1)
    return retrieval_metrics(flat, dataset.labels, ks=(1,)).map


def _write_mnist(folder, n_train=60, n_test=30, size=12, seed=0):
    # distinct random images: every pixel row identifies its source
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    train = rng.integers(0, 256, (n_train, size, size), dtype=np.uint8)
    test = rng.integers(0, 256, (n_test, size, size), dtype=np.uint8)
    write_idx(folder / "train-images-idx3-ubyte", train)
    write_idx(folder / "train-labels-idx1-ubyte", (np.arange(n_train) % 10).astype(np.uint8))
    write_idx(folder / "t10k-images-idx3-ubyte", test)
    write_idx(folder / "t10k-labels-idx1-ubyte", (np.arange(n_test) % 10).astype(np.uint8))
    return train, test


# --------------------------------------------------------------------------- registration


def test_instance_datasets_are_registered_open_set_only():
    for name in ("digits-instances", "fashion-mnist-instances", "mnist-instances"):
        assert name in DATASETS
        assert dataset_protocols(name) == ("open-set",)
    with pytest.raises(ValueError, match="open-set"):
        load_dataset("digits-instances", protocol="closed-set", **SMALL)


def test_digits_instances_defaults_and_labels():
    splits = load_dataset("digits-instances")
    d = INSTANCE_DEFAULTS["digits"]
    k, t, v, s = (
        d[key] for key in ("views_per_class", "train_classes", "val_classes", "test_classes")
    )
    assert splits.protocol == "open-set" and splits.name == "digits-instances"
    assert splits.describe() == {
        "train": {"samples": t * k, "classes": t},
        "val": {"samples": v * 4, "classes": v},
        "test": {"samples": s * 4, "classes": s},
    }
    assert isinstance(splits.train, InstanceViews) and splits.train.transform is not None
    # training labels are 0..T-1 (per-class loss state is indexed by label), other splits after
    assert splits.train.labels.tolist() == np.repeat(np.arange(t), k).tolist()
    assert splits.val.labels.min() == t and splits.test.labels.min() == t + v
    assert splits.input_shape == (1, 8, 8)
    assert any("pi = 0.001" in note for note in splits.notes)


# --------------------------------------------------------------------------- the views


def test_identity_augmentation_returns_the_source():
    aug = ViewAugmentation(rotation=0, scale=(1, 1), translation=0, noise=0)
    image = torch.rand(2, 6, 9)
    torch.testing.assert_close(aug(image), image, atol=1e-5, rtol=0)
    torch.testing.assert_close(aug.apply(image[None])[0], image, atol=1e-5, rtol=0)


def test_affine_geometry_against_rot90_and_shift():
    image = torch.zeros(1, 8, 8)
    image[0, 1, 2:6] = 1.0  # an asymmetric bar
    image[0, 2:5, 5] = 0.5
    aug = ViewAugmentation(rotation=90, scale=(1, 1), translation=0.25, noise=0)
    half = torch.full((1,), 0.5, dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)

    def render(u):
        theta = aug._affine(u.reshape(1, 4), 8, 8).to(torch.float32)
        grid = torch.nn.functional.affine_grid(theta, [1, 1, 8, 8], align_corners=False)
        return torch.nn.functional.grid_sample(image[None], grid, align_corners=False)[0]

    rotated = render(torch.cat([one, half, half, half]))  # theta = +90 degrees
    assert any(
        torch.allclose(rotated, torch.rot90(image, k, dims=(1, 2)), atol=1e-5) for k in (1, -1)
    )
    shifted = render(torch.cat([half, half, one, half]))  # +0.25 * 8 = 2 pixels along x
    expected = torch.zeros_like(image)
    expected[..., 2:] = image[..., :-2]
    torch.testing.assert_close(shifted, expected, atol=1e-5, rtol=0)


def test_per_item_path_matches_the_vectorised_path():
    # both draw 4 uniforms then the noise from the same stream: same seed -> same view
    aug = ViewAugmentation(rotation=40, scale=(0.7, 1.3), translation=0.2, noise=0.3)
    image = torch.rand(3, 11, 7)
    torch.manual_seed(123)
    item = aug(image)
    batch = aug.apply(image[None], torch.Generator().manual_seed(123))[0]
    torch.testing.assert_close(item, batch, atol=1e-5, rtol=0)
    assert item.min() >= 0 and item.max() <= 1


def test_views_differ_and_are_nontrivial():
    aug = ViewAugmentation()
    image = torch.rand(1, 28, 28)
    a, b = aug(image), aug(image)
    assert not torch.equal(a, b)
    assert (a - image).abs().mean() > 0.05


def test_training_views_are_fresh_and_reproducible_from_the_item_seed():
    splits = load_dataset("digits-instances", **SMALL)
    train = splits.train
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        first, label = train[5]
        torch.manual_seed(7)
        again, _ = train[5]
        second, _ = train[5]
    assert label == 1  # item 5 with 4 views per class is a view of source 1
    assert torch.equal(first, again)
    assert not torch.equal(first, second)


def test_trainer_item_seeds_give_fresh_reproducible_views():
    # the trainer seeds each item by (seed, epoch, batch, slot): same key -> same view,
    # another step -> another view
    from rankwise.training.loader import SeededItems, mix_seed

    splits = load_dataset("digits-instances", **SMALL)
    items = SeededItems(splits.train, reseed=splits.train.transform is not None)
    assert items.reseed

    def key(epoch, position, slot, index=3):
        return (index, mix_seed(0, epoch, position, slot), epoch, position)

    a, _, _ = items[key(0, 0, 0)]
    b, _, _ = items[key(0, 0, 0)]
    c, _, _ = items[key(0, 1, 0)]
    d, _, _ = items[key(1, 0, 0)]
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_trainer_batch_fetch_matches_item_fetch_and_keeps_global_rng():
    from rankwise.training.loader import SeededItems, mix_seed

    splits = load_dataset("digits-instances", **SMALL)
    items = SeededItems(splits.train, reseed=True)
    keys = [(i, mix_seed(0, 0, 2, i), 0, 2) for i in (0, 5, 9, 17)]
    torch.manual_seed(11)
    before = torch.rand(3)
    torch.manual_seed(11)
    batch = items.__getitems__(keys)
    after = torch.rand(3)
    assert torch.equal(before, after)  # the global stream is not consumed
    for (x, label, meta), key in zip(batch, keys, strict=True):
        x_item, label_item, meta_item = items[key]
        assert torch.equal(x, x_item) and label == label_item and torch.equal(meta, meta_item)
        assert meta.tolist() == [0, 2]


def test_batch_is_vectorised_and_labelled():
    splits = load_dataset("digits-instances", **SMALL)
    x, y = splits.train.batch([0, 1, 4, 159], torch.Generator().manual_seed(0))
    assert x.shape == (4, 1, 8, 8) and x.dtype == torch.float32
    assert y.tolist() == [0, 0, 1, 39]
    with pytest.raises(IndexError):
        splits.train[len(splits.train)]


def test_instance_views_pickle_for_dataloader_workers():
    splits = load_dataset("digits-instances", **SMALL)
    clone = pickle.loads(pickle.dumps(splits.train))
    torch.manual_seed(3)
    a, _ = splits.train[10]
    torch.manual_seed(3)
    b, _ = clone[10]
    assert torch.equal(a, b)


# --------------------------------------------------------------------------- fixed eval views


def test_fixed_views_are_deterministic_and_seeded():
    a = load_dataset("digits-instances", seed=4, **SMALL)
    b = load_dataset("digits-instances", seed=4, **SMALL)
    c = load_dataset("digits-instances", seed=5, **SMALL)
    for split in ("val", "test"):
        torch.testing.assert_close(
            getattr(a, split).inputs, getattr(b, split).inputs, rtol=0, atol=0
        )
        assert not torch.equal(getattr(a, split).inputs, getattr(c, split).inputs)
    np.testing.assert_array_equal(a.train.source_ids, b.train.source_ids)
    assert not np.array_equal(a.train.source_ids, c.train.source_ids)
    assert a.test.inputs.dtype == torch.float32 and a.test.inputs.shape == (80, 1, 8, 8)


def test_sources_are_disjoint_in_one_pool():
    splits = load_dataset("digits-instances", train_classes=900, val_classes=300, test_classes=597)
    train, val, test = (set(s.source_ids.tolist()) for s in (splits.train, splits.val, splits.test))
    assert len(train) == 900 and len(val) == 300 and len(test) == 597
    assert train.isdisjoint(val) and train.isdisjoint(test) and val.isdisjoint(test)
    assert train | val | test == set(range(1797))  # the whole pool, nothing twice


def test_sources_are_disjoint_with_an_official_test_split(tmp_path):
    train_images, test_images = _write_mnist(tmp_path / "mnist")
    # noise-only views: random-pixel fixtures have no spatial structure to survive a warp
    splits = load_dataset(
        "mnist-instances",
        data_dir=tmp_path,
        train_classes=40,
        val_classes=15,
        test_classes=25,
        rotation=0,
        scale=[1, 1],
        translation=0,
        noise=0.05,
    )
    assert splits.input_shape == (1, 12, 12)
    tr, va = splits.train.source_ids, splits.val.source_ids
    assert set(tr.tolist()).isdisjoint(va.tolist()) and max(tr.max(), va.max()) < 60
    # the stored sources are the pool images, in class order
    np.testing.assert_array_equal(splits.train.sources[:, 0].numpy(), train_images[tr])
    assert splits.test.source_ids.max() < 30 and len(set(splits.test.source_ids.tolist())) == 25
    # every fixed test view is closest (L2) to its own test source among all test images
    views = splits.test.inputs.reshape(100, -1)
    pool = torch.from_numpy(test_images.reshape(30, -1)).float() / 255
    nearest = torch.cdist(views, pool).argmin(dim=1).numpy()
    own = np.repeat(splits.test.source_ids, 4)
    assert (nearest == own).all()


def test_eval_split_size_sweep_keeps_the_prefix():
    small = load_dataset("digits-instances", **SMALL)
    big = load_dataset("digits-instances", **{**SMALL, "train_classes": 400})
    # sweeping the class count keeps the validation and test data identical
    assert torch.equal(small.test.inputs, big.test.inputs)
    assert torch.equal(small.val.inputs, big.val.inputs)
    more = load_dataset("digits-instances", **{**SMALL, "test_classes": 30})
    assert torch.equal(more.test.inputs[:80], small.test.inputs)


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "options, key",
    [
        ({"train_classes": 1}, "train_classes"),
        ({"train_classes": True}, "train_classes"),
        ({"train_classes": 2.5}, "train_classes"),
        ({"views_per_class": 1}, "views_per_class"),
        ({"val_classes": 1}, "val_classes"),
        ({"test_classes": 0}, "test_classes"),
        ({"eval_views_per_class": 1}, "eval_views_per_class"),
        ({"rotation": -5}, "rotation"),
        ({"rotation": float("nan")}, "rotation"),
        ({"scale": [1.2, 0.8]}, "scale"),
        ({"scale": [0, 1]}, "scale"),
        ({"scale": 1.0}, "scale"),
        ({"translation": 1.0}, "translation"),
        ({"noise": -0.1}, "noise"),
        ({"padding": "wrap"}, "padding"),
        ({"train_classes": 1700}, "train_classes"),
        ({"rotations": 10}, "rotations"),
        ({"n_query": 10}, "n_query"),
    ],
)
def test_bad_options_name_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        load_dataset("digits-instances", **options)


def test_val_holdout_samples_is_refused_for_instances():
    with pytest.raises(ValueError, match="val_holdout"):
        load_dataset("digits-instances", val_holdout="samples", **SMALL)
    assert load_dataset("digits-instances", val_holdout="classes", **SMALL).val is not None
    assert load_dataset("digits-instances", **{**SMALL, "val_classes": 0}).val is None


def test_config_errors_name_the_dataset_option():
    from rankwise.training import ConfigError, config_from_dict
    from rankwise.training.build import load_splits

    config = config_from_dict(
        {
            "dataset": {"name": "digits-instances", "options": {"views_per_class": 1}},
            "loss": {"name": "ap"},
            "budget": {"iterations": 1},
        }
    )
    with pytest.raises(ConfigError, match="views_per_class"):
        load_splits(config)


def test_build_instance_splits_from_any_arrays():
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, (50, 3, 10, 10), dtype=np.uint8)
    splits = build_instance_splits(
        "toy", pool, train_classes=20, val_classes=5, test_classes=10, padding="border"
    )
    assert splits.input_shape == (3, 10, 10) and splits.name == "toy"
    x, y = splits.train[0]
    assert x.shape == (3, 10, 10) and y == 0
    with pytest.raises(ValueError, match="test_pool"):
        build_instance_splits("toy", pool, pool[:, 0], **SMALL)


# --------------------------------------------------------------------------- the pi sweep


def test_pi_sweep_few_class_end():
    splits = load_dataset("digits-instances", train_classes=10, views_per_class=64)
    assert splits.train.num_classes == 10 and len(splits.train) == 640
    assert np.bincount(splits.train.labels).tolist() == [64] * 10


@needs_fashion
def test_pi_sweep_sop_like_end_on_fashion_mnist():
    # pi = 1e-4 (Stanford Online Products) needs 10,000 training sources
    splits = load_dataset(
        "fashion-mnist-instances", train_classes=10000, test_classes=100, val_classes=50
    )
    assert splits.train.num_classes == 10000 and len(splits.train) == 40000
    assert splits.train.sources.dtype == torch.uint8  # views are drawn per item, not stored
    assert any("pi = 0.0001" in note for note in splits.notes)
    with pytest.raises(ValueError, match="train_classes"):
        load_dataset("fashion-mnist-instances", train_classes=60000)


# --------------------------------------------------------------------------- raw pixels fail


def test_raw_pixels_retrieve_poorly_on_the_default_views():
    splits = load_dataset("digits-instances")
    raw = _raw_map(splits.test)
    clean = load_dataset("digits-instances", rotation=0, scale=[1, 1], translation=0, noise=0)
    assert _raw_map(clean.test) > 0.99  # without augmentation raw pixels find every view
    assert raw < 0.25


@needs_fashion
def test_raw_pixels_retrieve_poorly_on_default_fashion_mnist_instances():
    splits = load_dataset("fashion-mnist-instances", train_classes=100, val_classes=0)
    assert len(splits.test) == 4000
    assert _raw_map(splits.test) < 0.1


def test_missing_fashion_mnist_names_the_package(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist-instances", data_dir=tmp_path)


# --------------------------------------------------------------------------- with the trainer


def test_training_on_instances_resumes_bit_for_bit(tmp_path):
    # fresh views every step come from the trainer's per-item seeds, so an interrupted and
    # resumed run sees exactly the views of an uninterrupted one
    from rankwise.training import Trainer, config_from_dict

    def config(out):
        return config_from_dict(
            {
                "dataset": {"name": "digits-instances", "options": SMALL},
                "model": {"backbone": "small_cnn", "embedding_dim": 8},
                "loss": {"name": "contrastive"},
                "sampler": {"m": 4, "batch_size": 16},
                "budget": {"iterations": 4},
                "eval_every": 2,
                "threads": 1,
                "progress": False,
                "output_dir": str(out),
            }
        )

    whole = Trainer.from_config(config(tmp_path / "whole"))
    whole.fit()
    part = Trainer.from_config(config(tmp_path / "part"))
    assert part.fit(max_steps=2).status == "stopped"
    resumed = Trainer.from_run_dir(tmp_path / "part")
    result = resumed.fit()
    assert result.status == "completed" and result.steps == 4
    for key, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[key]), key
