"""Nothing the user set is silently ignored: a closed-set option in the open-set protocol is an
error, and a ``$RANKWISE_DATA`` that does not exist is reported instead of quietly falling back
to the system copy of the data (issue 14, item 15)."""

from __future__ import annotations

import pytest

from rankwise.data import DatasetNotFoundError, load_dataset
from rankwise.training import ConfigError, config_from_dict
from rankwise.training.build import load_splits


@pytest.mark.parametrize("option", [{"n_query": 5}, {"n_train": 10}])
def test_closed_set_options_are_refused_in_open_set(option):
    with pytest.raises(ValueError, match=r"in protocol 'open-set'.*closed-set"):
        load_dataset("digits", protocol="open-set", **option)
    # the same option is accepted where it means something
    splits = load_dataset("digits", protocol="closed-set", val_fraction=0.0, **option)
    assert splits.protocol == "closed-set"


def test_dataset_options_in_a_config_are_refused_in_open_set():
    config = config_from_dict(
        {
            "dataset": {"name": "digits", "options": {"n_query": 5}},
            "loss": {"name": "auc"},
            "budget": {"iterations": 1},
        }
    )
    with pytest.raises(ConfigError, match=r"dataset: .*\['n_query'\] in protocol 'open-set'"):
        load_splits(config)


def test_a_rankwise_data_that_does_not_exist_is_reported(tmp_path, monkeypatch):
    missing = tmp_path / "nonexistent"
    monkeypatch.setenv("RANKWISE_DATA", str(missing))
    # fashion-mnist has a system copy (/usr/share/datasets): it must not be used behind the
    # user's back when $RANKWISE_DATA points elsewhere
    with pytest.raises(DatasetNotFoundError, match=r"\$RANKWISE_DATA=.*nonexistent is not a dir"):
        load_dataset("fashion-mnist")
    # an explicit data_dir does not consult the environment
    with pytest.raises(DatasetNotFoundError, match="not found"):
        load_dataset("mnist", data_dir=tmp_path)
