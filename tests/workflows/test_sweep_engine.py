"""The sweep engine's stored-config check (rankwise.workflows.sweep.check_stored_config)."""

from __future__ import annotations

import pytest
import yaml

from rankwise.training import ConfigError
from rankwise.workflows.sweep import check_stored_config


def _store(run_dir, data):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(data))


def test_a_run_stored_before_a_new_config_key_with_its_default_is_the_same_config(
    tmp_path, tiny_config
):
    # a config.yaml written before optimizer.backbone_lr_mult / model.pretrained existed: the keys'
    # defaults give the run it trained, so --resume of that sweep must not be refused
    config = tiny_config()  # the shared tiny config of tests/conftest.py
    stored = config.to_dict()
    del stored["optimizer"]["backbone_lr_mult"], stored["model"]["pretrained"]
    _store(tmp_path / "run", stored)
    check_stored_config(config, tmp_path / "run")


def test_a_run_with_another_value_or_an_unreadable_config_is_refused(tmp_path, tiny_config):
    config = tiny_config()  # the shared tiny config of tests/conftest.py
    changed = config.to_dict()
    changed["optimizer"]["lr"] = 0.5
    _store(tmp_path / "changed", changed)
    # (the message says why: the keys that differ, issue 30)
    with pytest.raises(ConfigError, match=r"made with another config .*optimizer\.lr: 0\.5 stored"):
        check_stored_config(config, tmp_path / "changed")
    _store(tmp_path / "unknown", {**config.to_dict(), "no_such_key": 1})
    with pytest.raises(ConfigError, match="made with another config .*not a valid config today"):
        check_stored_config(config, tmp_path / "unknown")
