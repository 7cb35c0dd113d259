"""``rankwise roc fit`` is callable from Python (issue 20): :func:`rankwise.workflows.roc.fit_roc`
writes the same run folder and the same report as the command, and keeps bench's overwrite rule."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.workflows.roc import fit_roc

OPTIONS = {"n_train": 200, "n_test": 150, "max_iter": 30, "seed": 1, "center": True}


def test_fit_roc_from_python_matches_the_command(tmp_path):
    run = fit_roc("digits", output=tmp_path / "py", **OPTIONS)
    assert sorted(p.name for p in run.paths.values()) == [
        "bilinear.npz",
        "report.json",
        "roc.png",
        "split.npz",
    ]
    assert all(path.is_file() for path in run.paths.values())
    assert run.estimator.A_.shape == (64, 64) and run.split[1].size == 150
    result = CliRunner().invoke(
        app,
        ["roc", "fit", "--dataset", "digits", "--n-train", "200", "--n-test", "150",
         "--max-iter", "30", "--seed", "1", "--center", "--output", str(tmp_path / "cli")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    from_cli = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert json.loads(run.paths["report"].read_text()) == from_cli
    model = np.load(tmp_path / "cli" / "bilinear.npz")
    np.testing.assert_array_equal(model["A"], np.load(run.paths["model"])["A"])


def test_fit_roc_refuses_results_without_overwrite(tmp_path):
    fit_roc("digits", output=tmp_path, **OPTIONS)
    with pytest.raises(ValueError, match="`overwrite`"):
        fit_roc("digits", output=tmp_path, **OPTIONS)
    again = fit_roc("digits", output=tmp_path, overwrite=True, **{**OPTIONS, "max_iter": 10})
    assert json.loads(again.paths["report"].read_text())["options"]["max_iter"] == 10


def test_fit_roc_names_its_arguments_in_errors(tmp_path):
    with pytest.raises(ValueError, match="`method` must be one of"):
        fit_roc("digits", method="x", output=tmp_path)
    with pytest.raises(ValueError, match="`dataset` must be one of"):
        fit_roc("nope", output=tmp_path)
    X, y = np.eye(4), np.array([0, 0, 1, 1])
    with pytest.raises(ValueError, match="`y` has 3 entries but `X` has 4 rows"):
        fit_roc((X, y[:3], X, y), output=tmp_path)
    with pytest.raises(ValueError, match="`y_test` must hold integer class ids"):
        fit_roc((X, y, X, y + 0.5), output=tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written before the checks
