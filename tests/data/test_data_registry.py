"""load_dataset: names, aliases, protocols and option validation."""

import pytest

from rankwise.data import DATASETS, dataset_protocols, load_dataset


def test_datasets_tuple_lists_the_benchmarks():
    assert DATASETS[0] == "digits"
    for name in (
        "mnist",
        "fashion-mnist",
        "cifar10",
        "cub200",
        "cars196",
        "sop",
        "inshop",
        "inaturalist",
        "vehicleid",
    ):
        assert name in DATASETS


def test_unknown_name_lists_names():
    with pytest.raises(ValueError) as info:
        load_dataset("imagenet")
    for name in DATASETS:
        assert name in str(info.value)


def test_default_is_digits_open_set():
    splits = load_dataset()
    assert splits.name == "digits" and splits.protocol == "open-set"


def test_bad_protocol_and_options():
    with pytest.raises(ValueError, match="protocol"):
        load_dataset("digits", protocol="semi-open")
    with pytest.raises(ValueError, match="n_querys"):
        load_dataset("digits", n_querys=3)
    with pytest.raises(ValueError, match="test_size"):
        load_dataset("digits", test_size="small")
    with pytest.raises(ValueError, match="val_fraction"):
        load_dataset("digits", val_fraction=1.5)


def test_protocols_per_dataset():
    assert dataset_protocols("inshop") == ("closed-set",)
    assert dataset_protocols("SOP") == ("open-set",)
    assert set(dataset_protocols("cifar-10")) == {"open-set", "closed-set"}
    with pytest.raises(ValueError, match="open-set"):
        load_dataset("cub200", protocol="closed-set")
