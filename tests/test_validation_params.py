"""The shared scalar-parameter checks of ``rankwise._validation`` (used by every loss)."""

import math

import numpy as np
import pytest
import torch

from rankwise._validation import (
    Interval,
    check_bool,
    check_choice,
    check_range_pair,
    check_scalar,
)

POSITIVE = Interval("real", 0, None, closed="neither")
UNIT = Interval("real", 0, 1)


@pytest.mark.parametrize(
    "value", [0.1, 1, np.float32(0.1), np.float64(2.0), np.int64(3), torch.tensor(0.5)]
)
def test_real_scalars_of_any_numeric_type_are_accepted(value):
    out = check_scalar(value, "tau1", POSITIVE)
    assert isinstance(out, float) and out > 0


@pytest.mark.parametrize(
    "value",
    [math.inf, -math.inf, math.nan, np.float32("nan"), True, "0.1", None, [0.1], torch.ones(2)],
)
def test_non_finite_bool_and_non_scalars_are_rejected_with_the_name(value):
    with pytest.raises(ValueError, match=r"`tau1` must be a finite number > 0, got"):
        check_scalar(value, "tau1", POSITIVE)


def test_bounds_and_closedness():
    assert check_scalar(0, "beta", UNIT) == 0.0
    assert check_scalar(1, "beta", UNIT) == 1.0
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        check_scalar(1.5, "beta", UNIT)
    half_open = Interval("real", 0, 1, closed="right")
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        check_scalar(0.0, "prior_scale", half_open)
    assert Interval("real", None, 1, closed="neither").describe() == "a finite number < 1"


def test_infinity_only_when_allowed():
    unbounded = Interval("real", 0, None, allow_inf=True)
    assert check_scalar(math.inf, "clip", unbounded) == math.inf
    with pytest.raises(ValueError):
        check_scalar(math.nan, "clip", unbounded)


def test_integers():
    count = Interval("integer", 1, None)
    assert check_scalar(np.int32(4), "num_v", count) == 4
    assert isinstance(check_scalar(np.int32(4), "num_v", count), int)
    for bad in (4.0, 0, True, "4"):
        with pytest.raises(ValueError, match=r"`num_v` must be an integer >= 1"):
            check_scalar(bad, "num_v", count)


def test_choice_bool_and_range_pair():
    assert check_choice("hard", "strategy", ("hard", "all")) == "hard"
    with pytest.raises(ValueError, match=r"`strategy` must be one of 'hard', 'all', got 'x'"):
        check_choice("x", "strategy", ("hard", "all"))
    assert check_bool(np.bool_(True), "unbiased") is True
    with pytest.raises(ValueError, match="`unbiased` must be True or False"):
        check_bool(1, "unbiased")
    assert check_range_pair((np.float32(-1), 1), "score_range") == (-1.0, 1.0)
    for bad in ((-math.inf, 1), (1, 1), (2, 1), (0,), None, "ab"):
        with pytest.raises(ValueError, match="`score_range` must be a pair"):
            check_range_pair(bad, "score_range")


def test_every_device_entry_point_refuses_the_same_inputs_naming_its_argument(monkeypatch):
    # one resolution (`_validation.resolve_device`) behind the config key, the Trainer argument,
    # the distributed setup and `evaluate --device`: the same refusals, each naming its argument
    from rankwise._validation import resolve_device
    from rankwise.commands.evaluate import _check_device
    from rankwise.training import ConfigError
    from rankwise.training.arguments import device_of
    from rankwise.training.build import resolve_device as config_device
    from rankwise.training.distributed import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    model = torch.nn.Linear(2, 2)
    entry_points = [
        (lambda d: resolve_device(d), ValueError, "`device`: "),
        (lambda d: device_of(model, d), ValueError, "`device`: "),
        (lambda d: config_device(d), ConfigError, "device: "),
        (lambda d: init_distributed(device=d).device, ConfigError, "device: "),
        (lambda d: _check_device(d), ValueError, "--device: "),
    ]
    for call, error, name in entry_points:
        assert call("auto") == torch.device("cpu")
        for device, fragment in [
            ("cuda", "no CUDA device"),
            ("cuda:1", "no CUDA device"),
            ("bogus", "unknown device 'bogus'"),
        ]:
            with pytest.raises(error) as info:
                call(device)
            assert str(info.value).startswith(name) and fragment in str(info.value), info.value
