"""The experiment framework: registry, decorator, option parsing, output rules."""

from __future__ import annotations

import inspect
import json
import math
import os
import typing

import numpy as np
import pytest

from rankwise.experiments import (
    REGISTRY,
    ExperimentResult,
    experiment,
    get_experiment,
    list_experiments,
    run_experiment,
)
from rankwise.experiments.base import option_help, parse_sequence, resolve_output

SUPPORTED = (bool, int, float, str)


def _supported(annotation) -> bool:
    args = typing.get_args(annotation)
    if type(None) in args:
        (annotation,) = [a for a in args if a is not type(None)]
    if typing.get_origin(annotation) is tuple:
        return typing.get_args(annotation)[0] in SUPPORTED
    return annotation in SUPPORTED


@pytest.mark.parametrize("name", list(REGISTRY))
def test_registered_experiments_are_well_formed(name):
    run = get_experiment(name)
    spec = run.spec
    assert spec.name == name and spec.summary and spec.reference
    assert run.__module__ == REGISTRY[name]
    hints = typing.get_type_hints(spec.compute)
    helps = option_help(spec.compute)
    for param in spec.parameters():
        assert _supported(hints[param.name]), (name, param.name, hints[param.name])
        assert helps.get(param.name), f"{name}: option {param.name} has no Args: help line"
    # the public signature is the command's: output/overwrite first, then the options
    names = list(inspect.signature(run).parameters)
    assert names[:2] == ["output", "overwrite"] and {"quick", "seed"} <= set(names)


def test_list_and_unknown_name():
    assert [spec.name for spec in list_experiments()] == list(REGISTRY)
    with pytest.raises(ValueError, match="unknown experiment 'nope'; available: "):
        get_experiment("nope")


def _toy(name="toy"):
    @experiment(name, summary="A toy.", reference="nobody")
    def run(*, quick: bool = False, seed: int = 0, values: tuple[float, ...] = (1.0, 2.0)):
        """Toy.

        Args:
            quick: Quick.
            seed: Seed.
            values: Values, comma-separated
                over two lines.
        """
        data = {
            "seed": np.int64(seed),
            "mean": np.float32(np.mean(values)),
            "bad": float("nan"),
            "array": np.arange(3),
            "nested": {"t": (np.float64(math.inf), 1)},
        }
        return ExperimentResult(name, data, f"{name}: ok", True, figure=None)

    return run


def test_decorator_adds_output_and_writes_json(tmp_path):
    run = _toy()
    result = run(quick=True, seed=3)
    assert result.json_path is None  # output=None writes nothing
    payload = result.to_dict()
    assert payload == {
        "experiment": "toy",
        "seed": 3,
        "mean": 1.5,
        "bad": None,
        "array": [0, 1, 2],
        "nested": {"t": [None, 1]},
        "verdict": "toy: ok",
        "consistent_with_paper": True,
    }
    result = run(output=tmp_path / "out", seed=3)
    assert result.json_path == tmp_path / "out" / "toy.json"
    assert json.loads(result.json_path.read_text())["seed"] == 3
    with pytest.raises(FileExistsError, match="pass `overwrite`"):
        run(output=tmp_path / "out", seed=4)
    run(output=tmp_path / "out", seed=4, overwrite=True)
    assert json.loads(result.json_path.read_text())["seed"] == 4
    assert not list((tmp_path / "out").glob(".toy*"))  # no temporary files left behind
    umask = os.umask(0)
    os.umask(umask)
    assert result.json_path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_option_help_reads_google_args():
    helps = option_help(_toy().spec.compute)
    assert helps == {
        "quick": "Quick.",
        "seed": "Seed.",
        "values": "Values, comma-separated over two lines.",
    }


def test_decorator_rejects_bad_signatures():
    with pytest.raises(ValueError, match="lower-case"):
        experiment("Bad_Name", summary="", reference="")
    with pytest.raises(TypeError, match="must accept `seed`"):
        experiment("a", summary="", reference="")(lambda *, quick=False: None)
    with pytest.raises(TypeError, match="keyword-only"):
        experiment("a", summary="", reference="")(lambda quick=False, seed=0: None)
    with pytest.raises(TypeError, match="needs a default"):
        experiment("a", summary="", reference="")(lambda *, quick, seed=0: None)
    with pytest.raises(TypeError, match="added by the framework"):
        experiment("a", summary="", reference="")(lambda *, quick=False, seed=0, output=None: None)


def test_resolve_output(tmp_path):
    assert resolve_output("x", tmp_path / "a.json") == (tmp_path / "a.json", tmp_path / "a.png")
    assert resolve_output("x", tmp_path / "dir") == (
        tmp_path / "dir/x.json",
        tmp_path / "dir/x.png",
    )
    with pytest.raises(ValueError, match="directory or a .json file"):
        resolve_output("x", tmp_path / "a.png")
    (tmp_path / "a.png").write_text("")
    with pytest.raises(FileExistsError, match="a.png exists"):
        resolve_output("x", tmp_path / "a.json")
    assert resolve_output("x", tmp_path / "a.json", overwrite=True)[1] == tmp_path / "a.png"


def test_parse_sequence():
    assert parse_sequence("0.1, 0.2", "rates") == (0.1, 0.2)
    assert parse_sequence((1, 2), "sizes", int) == (1, 2)
    assert parse_sequence([0.5], "rates") == (0.5,)
    for bad in ("", "0.1,x", ()):
        with pytest.raises(ValueError, match="`rates` must be comma-separated numbers"):
            parse_sequence(bad, "rates")


def test_existing_output_fails_before_the_work(tmp_path):
    calls = []

    @experiment("counted", summary="", reference="")
    def run(*, quick: bool = False, seed: int = 0):
        calls.append(seed)
        return ExperimentResult("counted", {}, "counted: ok", True)

    target = tmp_path / "r.json"
    target.write_text("{}")
    with pytest.raises(FileExistsError):
        run(output=target, quick=True)
    assert target.read_text() == "{}" and not calls


def test_run_experiment_by_name(tmp_path):
    result = run_experiment("auc-slope", quick=True, delta_s=(0.2,), output=tmp_path)
    assert result.json_path == tmp_path / "auc-slope.json" and result.figure_path.is_file()
    with pytest.raises(ValueError, match="unknown experiment"):
        run_experiment("auc_slope")
