"""Seeded augmentation of image files (issue 38, item 1): ``dataset.augment`` gives the training
split random resize / crop / flip views and the evaluation splits resize + centre crop; the views
of an item depend only on its seed (run seed, epoch, batch, slot), so runs repeat, ``num_workers``
changes nothing and a resumed run equals an uninterrupted one bit for bit; the PIL operations are
torchvision's, checked against crops computed by hand; bad settings are one error naming the key."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

from rankwise.data import load_dataset
from rankwise.data.augment import (
    ImageAugmentation,
    augment_transforms,
    center_offsets,
    check_augment,
    random_resized_window,
    resize_image,
    torchvision_pipeline,
)
from rankwise.data.base import IMAGENET_MEAN, IMAGENET_STD, open_image
from rankwise.training import ConfigError, config_from_dict
from rankwise.training.loader import mix_seed, training_loader

AUGMENT = {
    "resize": 10,
    "random_resized_crop": {"size": 8, "scale": [0.3, 1.0]},
    "hflip": 0.5,
    "center_crop": 8,
}


def normalized(pixels: np.ndarray) -> torch.Tensor:
    """``(H, W, 3)`` uint8 pixels as the transforms return them: CHW, [0, 1], ImageNet-normalized."""
    chw = pixels.astype(np.float32).transpose(2, 0, 1) / 255.0
    mean = np.asarray(IMAGENET_MEAN, np.float32).reshape(3, 1, 1)
    std = np.asarray(IMAGENET_STD, np.float32).reshape(3, 1, 1)
    return torch.from_numpy((chw - mean) / std)


def gradient_image(width=20, height=14):
    """An RGB image whose every pixel differs (so a crop's position shows in its values)."""
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 12 % 256, y * 17 % 256, (x * 7 + y * 3) % 256], axis=-1)
    return Image.fromarray(pixels.astype(np.uint8)), pixels.astype(np.uint8)


# ----------------------------------------------------------------------------- training vs evaluation


def test_training_views_are_random_and_evaluation_is_resize_and_centre_crop(image_classes):
    splits = load_dataset(
        "folder", data_dir=image_classes, image_size=8, val_fraction=0.2, augment=AUGMENT
    )
    views = [splits.train.seeded_item(0, seed)[0] for seed in range(6)]
    assert all(v.shape == (3, 8, 8) for v in views)
    assert len({v.numpy().tobytes() for v in views}) > 1  # training: random views
    for split in (splits.val, splits.test):
        first, again = split[0][0], split.seeded_item(0, 123)[0]
        assert torch.equal(first, again)  # evaluation: no randomness, whatever the seed
        # by hand: 12 x 12 -> 10 x 10 bilinear, then the centre 8 x 8 (offset round(2 / 2) = 1)
        pixels = np.asarray(open_image(split.paths[0], "test").resize((10, 10), Image.BILINEAR))
        assert torch.equal(first, normalized(pixels[1:9, 1:9]))


def test_without_augment_every_split_keeps_the_plain_resize(image_classes):
    splits = load_dataset("folder", data_dir=image_classes, image_size=8, val_fraction=0.2)
    assert torch.equal(splits.train.seeded_item(0, 1)[0], splits.train.seeded_item(0, 2)[0])


# ----------------------------------------------------------------------------- seeding


class Fixed:
    """A batch sampler giving the same items at every step (the views alone must change)."""

    def __init__(self, batches=3):
        self.batches = batches

    def __iter__(self):
        return iter([[0, 1, 2, 3]] * self.batches)

    def __len__(self):
        return self.batches


def batches(dataset, num_workers, n=4, seed=7, epoch=0, position=0):
    loader = training_loader(
        dataset,
        Fixed(),
        seed=seed,
        epoch=epoch,
        position=position,
        num_workers=num_workers,
        pin_memory=False,
    )
    out = []
    for x, _, meta in loader:
        out.append((x, meta))
        if len(out) == n:
            break
    return out


def test_views_depend_only_on_seed_epoch_batch_and_slot(image_classes):
    train = load_dataset("folder", data_dir=image_classes, image_size=8, augment=AUGMENT).train
    first = batches(train, num_workers=0)
    # the same items at every step: each step shows other views
    assert not torch.equal(first[0][0], first[1][0])
    # another run seed: other views
    assert not torch.equal(first[0][0], batches(train, num_workers=0, seed=8)[0][0])
    # the global RNGs play no part, nor the worker processes
    np.random.seed(123)  # noqa: NPY002
    torch.manual_seed(5)
    again = batches(train, num_workers=0)
    workers = batches(train, num_workers=2)
    for (x, _), (y, _), (z, _) in zip(first, again, workers, strict=True):
        assert torch.equal(x, y) and torch.equal(x, z)
    # started at batch 2 of epoch 0 (as a resumed run is), the views are those of batch 2
    resumed = batches(train, num_workers=0, position=2, n=2)
    assert torch.equal(resumed[0][0], first[2][0]) and torch.equal(resumed[1][0], first[3][0])
    # each item's view is its transform at the item's seed (seed, epoch, batch, slot)
    x, meta = first[3]
    epoch, position = (int(v) for v in meta[0])
    assert (epoch, position) == (1, 0)  # 3 batches an epoch
    item = train.seeded_item(2, mix_seed(7, epoch, position, 2))[0]
    assert torch.equal(x[2], item)


# ----------------------------------------------------------------------------- resume bit for bit

FOLDER_RUN = {
    "dataset": {"name": "folder", "image_size": 8, "val_fraction": 0.2, "augment": AUGMENT},
    "sampler": {"m": 2, "batch_size": 4},
    "budget.iterations": 6,
    "eval_every": 2,
    "eval_ks": [1, 5],
}


def test_an_augmented_run_resumed_after_ctrl_c_matches_an_uninterrupted_one(
    image_classes, tiny_config, tmp_path, ctrl_c_and_resume
):
    from rankwise.training import Trainer, load_run

    def config(run_dir):
        data = tiny_config.data(run_dir, **FOLDER_RUN)
        data["dataset"]["data_dir"] = str(image_classes)
        return config_from_dict(data)

    trainer = Trainer.from_config(config(tmp_path / "ref"))
    # the run trains on the random views and validates on resize + centre crop
    assert trainer.train_data.transform.train and not trainer.val_data.transform.train
    ctrl_c_and_resume(config, reference_trainer=trainer)
    # a trained run embeds new images with its evaluation transform (resize + centre crop)
    run = load_run(tmp_path / "ref")
    path = str(next(image_classes.rglob("*.png")))
    _, evaluation = augment_transforms(AUGMENT, 8)
    assert torch.equal(run.preprocess([path])[0], evaluation(open_image(path, "test")))


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("augment", "words"),
    [
        (
            {"random_crop": 8, "random_resized_crop": {"size": 8}, "center_crop": 8},
            ["random_resized_crop", "random_crop", "both"],
        ),
        ({"random_crop": 0, "center_crop": 8}, ["random_crop", "positive"]),
        ({"random_crop": 8, "center_crop": -3}, ["center_crop", "positive"]),
        ({"resize": [8, 0], "random_crop": 8, "center_crop": 8}, ["resize", "positive"]),
        (
            {"random_resized_crop": {"size": 8, "scale": [0.9, 0.2]}, "center_crop": 8},
            ["random_resized_crop.scale", "ordered"],
        ),
        (
            {"random_resized_crop": {"size": 8, "scale": [0.5, 1.5]}, "center_crop": 8},
            ["random_resized_crop.scale", "<= 1"],
        ),
        (
            {"random_resized_crop": {"size": 8, "ratio": [2.0, 0.5]}, "center_crop": 8},
            ["random_resized_crop.ratio", "ordered"],
        ),
        ({"random_crop": 8, "hflip": 1.5, "center_crop": 8}, ["hflip", "[0, 1]"]),
        ({"random_crop": 8, "hflip": -0.1, "center_crop": 8}, ["hflip", "[0, 1]"]),
        ({"resize": 6, "random_crop": 8, "center_crop": 6}, ["random_crop", "resize"]),
        ({"random_crop": 16, "center_crop": 16}, ["image_size", "16"]),
        ({"hflip": 0.5, "center_crop": 8}, ["training", "random_crop"]),
        ({"random_crop": 8, "resize": 10}, ["evaluation", "center_crop"]),
        ({"random_crop": 8, "center_crop": 8, "backend": "opencv"}, ["backend", "pil"]),
        ({"random_crop": 8, "center_crop": 8, "rotate": 5}, ["rotate"]),
    ],
)
def test_bad_augmentation_is_a_config_error_naming_the_key(tiny_config, augment, words):
    data = tiny_config.data(dataset={"name": "folder", "image_size": 8, "augment": augment})
    with pytest.raises(ConfigError) as error:
        config_from_dict(data)
    message = str(error.value)
    assert "dataset.augment" in message and all(w in message for w in words), message


def test_augment_is_refused_for_arrays_and_beside_an_own_transform(image_classes):
    with pytest.raises(ValueError, match="in-memory arrays"):
        load_dataset("digits", augment={"random_crop": 8, "center_crop": 8}, image_size=8)
    with pytest.raises(ValueError, match="both set the image transforms"):
        load_dataset(
            "folder",
            data_dir=image_classes,
            image_size=8,
            augment={"random_crop": 8, "center_crop": 8},
            transform=lambda image: image,
        )


def test_the_recipes_carry_the_papers_augmentation():
    from pathlib import Path

    import yaml

    configs = Path(__file__).resolve().parents[2] / "configs"
    for name in ("sop.yaml", "inat2018.yaml", "vehicleid.yaml"):
        text = (configs / name).read_text()
        augment = config_from_dict(yaml.safe_load(text)).dataset.augment
        assert augment is not None, name
        # Wen et al., Sec. 5.1: shorter side 256, random 224 x 224 crop, flip with probability 0.5
        assert (augment.resize, augment.random_crop, augment.hflip) == (256, 224, 0.5), name
        assert augment.center_crop == 224 and augment.random_resized_crop is None, name
        assert "Sec. 5.1" in text, name


# ----------------------------------------------------------------------------- the operations by hand


def test_random_crop_and_flip_are_the_hand_computed_window():
    image, pixels = gradient_image(20, 14)
    augment = ImageAugmentation({"random_crop": 9, "hflip": 0.5}, train=True)
    flipped = 0
    for seed in range(8):
        rng = np.random.default_rng(seed)  # the draws in torchvision's order: top, left, flip
        top, left = int(rng.integers(0, 14 - 9 + 1)), int(rng.integers(0, 20 - 9 + 1))
        window = pixels[top : top + 9, left : left + 9]
        if rng.random() < 0.5:
            window, flipped = window[:, ::-1], flipped + 1
        assert torch.equal(augment(image, seed=seed), normalized(np.ascontiguousarray(window)))
    assert 0 < flipped < 8


def test_resize_takes_the_shorter_side_as_torchvision_does():
    image, _ = gradient_image(20, 14)
    assert resize_image(image, 7).size == (10, 7)  # long side int(7 * 20 / 14) = 10
    assert resize_image(image.transpose(Image.TRANSPOSE), 7).size == (7, 10)
    assert resize_image(image, (5, 9)).size == (9, 5)  # [h, w]: that size
    assert resize_image(image, 14) is image  # already the size: untouched
    expected = np.asarray(image.resize((10, 7), Image.BILINEAR))
    assert np.array_equal(np.asarray(resize_image(image, 7)), expected)


def test_random_resized_crop_is_torchvisions_algorithm_by_hand():
    image, pixels = gradient_image(20, 14)
    scale, ratio = (0.2, 0.9), (0.75, 4 / 3)
    augment = ImageAugmentation({"random_resized_crop": {"size": 6, "scale": scale}}, train=True)
    for seed in range(5):
        rng = np.random.default_rng(seed)
        for _ in range(10):
            area = 14 * 20 * rng.uniform(*scale)
            aspect = np.exp(rng.uniform(np.log(ratio[0]), np.log(ratio[1])))
            w, h = int(round(np.sqrt(area * aspect))), int(round(np.sqrt(area / aspect)))
            if 0 < w <= 20 and 0 < h <= 14:
                top, left = int(rng.integers(0, 14 - h + 1)), int(rng.integers(0, 20 - w + 1))
                break
        window = Image.fromarray(np.ascontiguousarray(pixels[top : top + h, left : left + w]))
        expected = np.asarray(window.resize((6, 6), Image.BILINEAR))
        assert torch.equal(augment(image, seed=seed), normalized(expected))
    # no attempt fits (ratios 4-5 need w > 20): the centre crop at ratio 4, h = 5, top (14 - 5) // 2
    rng = np.random.default_rng(0)
    assert random_resized_window(14, 20, (1.0, 1.0), (4.0, 5.0), rng) == (4, 0, 5, 20)
    # an aspect ratio inside the range: the whole image
    assert random_resized_window(14, 20, (2.0, 2.0), (0.5, 2.0), rng) == (0, 0, 14, 20)


def test_centre_crop_rounds_and_pads_as_torchvision_does():
    image, pixels = gradient_image(9, 6)
    assert center_offsets(6, 9, 4) == (1, 2)  # round(2 / 2) = 1, round(5 / 2) = 2 (to even)
    augment = ImageAugmentation({"center_crop": 4}, train=False)
    assert torch.equal(augment(image), normalized(np.ascontiguousarray(pixels[1:5, 2:6])))
    # larger than the image: zero padding, (size - extent) // 2 before
    assert center_offsets(6, 9, 8) == (-1, 0)
    padded = ImageAugmentation({"center_crop": 8}, train=False)(image)
    expected = np.zeros((8, 8, 3), np.uint8)
    expected[1:7] = pixels[:, 0:8]
    assert torch.equal(padded, normalized(expected))


# ----------------------------------------------------------------------------- the torchvision path


@pytest.fixture
def fake_torchvision(monkeypatch):
    """A stand-in ``torchvision.transforms`` recording the pipeline (torchvision does not import
    beside this torch here); its random steps draw from the global torch generator, as
    torchvision's do."""

    class Step:
        def __init__(self, *args):
            self.args = args

        def __repr__(self):
            return f"{type(self).__name__}{self.args}"

        def __call__(self, image):
            return image

    class RandomHorizontalFlip(Step):
        def __call__(self, image):
            return image.transpose(Image.FLIP_LEFT_RIGHT) if torch.rand(1) < self.args[0] else image

    class Compose(Step):
        def __call__(self, image):
            for step in self.args[0]:
                image = step(image)
            return image

    transforms = types.ModuleType("torchvision.transforms")
    for name in ("Resize", "RandomCrop", "RandomResizedCrop", "CenterCrop"):
        setattr(transforms, name, type(name, (Step,), {}))
    transforms.RandomHorizontalFlip = RandomHorizontalFlip
    transforms.Compose = Compose
    package = types.ModuleType("torchvision")
    package.transforms = transforms
    monkeypatch.setitem(sys.modules, "torchvision", package)
    monkeypatch.setitem(sys.modules, "torchvision.transforms", transforms)
    return transforms


def test_the_torchvision_backend_builds_the_same_pipeline_and_is_seeded(fake_torchvision):
    spec = check_augment(
        {
            "resize": 10,
            "random_resized_crop": {"size": 8, "scale": [0.3, 1.0]},
            "hflip": 0.5,
            "center_crop": 8,
            "backend": "torchvision",
        }
    )
    train = torchvision_pipeline(spec, train=True)
    assert repr(train.args[0]) == (
        "[Resize(10,), RandomResizedCrop(8, (0.3, 1.0), (0.75, 1.3333333333333333)), "
        "RandomHorizontalFlip(0.5,)]"
    )
    assert repr(torchvision_pipeline(spec, train=False).args[0]) == "[Resize(10,), CenterCrop(8,)]"
    crop = check_augment({"random_crop": 8, "backend": "torchvision"})
    assert repr(torchvision_pipeline(crop, train=True).args[0]) == "[RandomCrop(8,)]"
    # seeded by the item's seed through the torch generator, which it leaves as it was
    augment = ImageAugmentation({"hflip": 0.5, "backend": "torchvision"}, train=True)
    image, _ = gradient_image(6, 6)
    state = torch.get_rng_state()
    views = {augment(image, seed=s).numpy().tobytes() for s in range(8)}
    assert len(views) == 2 and torch.equal(torch.get_rng_state(), state)
    assert torch.equal(augment(image, seed=3), augment(image, seed=3))


def test_pil_is_the_default_backend_even_where_torchvision_imports(fake_torchvision):
    augment = ImageAugmentation({"random_crop": 4, "hflip": 0.5}, train=True)
    assert augment.spec["backend"] == "pil" and augment._torchvision is None


def test_the_torchvision_backend_without_torchvision_says_what_to_do(monkeypatch):
    from rankwise._extras import MissingDependencyError

    monkeypatch.setitem(sys.modules, "torchvision", None)  # import fails
    with pytest.raises(MissingDependencyError, match="backend: pil") as error:
        ImageAugmentation({"random_crop": 4, "backend": "torchvision"}, train=True)
    assert error.value.extra == "vision"
