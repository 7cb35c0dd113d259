"""`rankwise roc fit` end to end: saved arrays and the bundled digits, the report against the
library's metrics, the threshold's FPR, the outputs (PNG, JSON, model) and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from rankwise.cli import app
from rankwise.metrics import tpr_at_fpr

runner = CliRunner()


@pytest.fixture
def saved(tmp_path):
    """Gaussian classes whose informative directions are not the dominant ones."""
    rng = np.random.default_rng(0)

    def draw(n):
        labels = rng.integers(0, 6, n)
        centers = np.zeros((6, 10))
        centers[np.arange(6), np.arange(6)] = 1.0
        X = centers[labels] + 0.45 * rng.normal(size=(n, 10))
        X[:, 6:] *= 3  # loud, uninformative features
        return X, labels

    X, y = draw(300)
    X_test, y_test = draw(300)
    for name, value in (("X", X), ("y", y), ("Xt", X_test), ("yt", y_test)):
        np.save(tmp_path / f"{name}.npy", value)
    return tmp_path


def _run(*args):
    return runner.invoke(app, ["roc", "fit", *map(str, args)])


def _array_args(tmp):
    return [
        "--features", tmp / "X.npy", "--labels", tmp / "y.npy",
        "--test-features", tmp / "Xt.npy", "--test-labels", tmp / "yt.npy",
    ]  # fmt: skip


def test_saved_arrays_report_plot_and_model(saved):
    out = saved / "out"
    result = _run(*_array_args(saved), "--alpha", "0.05", "--max-iter", "200", "--output", out)
    assert result.exit_code == 0, result.output
    assert "TPR@FPR=0.05" in result.output and "cosine (input features)" in result.output
    report = json.loads((out / "report.json").read_text())
    assert report["alpha"] == 0.05 and report["n_test_pairs"] == 300 * 299 // 2
    # the report's numbers are those of rankwise.metrics on the saved model
    model = np.load(out / "bilinear.npz")
    X_test = np.load(saved / "Xt.npy")
    y_test = np.load(saved / "yt.npy")
    Z = X_test / np.linalg.norm(X_test, axis=1, keepdims=True)
    i, j = np.triu_indices(300, 1)
    scores = 0.5 * (1 + ((Z[i] @ model["A"]) * Z[j]).sum(1))
    same = y_test[i] == y_test[j]
    assert report["learned"]["tpr_at_fpr"]["0.05"] == pytest.approx(tpr_at_fpr(scores, same, 0.05))
    cosine = tpr_at_fpr((Z[i] * Z[j]).sum(1), same, 0.05)
    assert report["cosine"]["tpr_at_fpr"]["0.05"] == pytest.approx(cosine)
    assert report["learned"]["tpr_at_fpr"]["0.05"] > cosine + 0.05  # it learned
    assert report["threshold"]["train_fpr"] <= 0.05
    assert report["threshold"]["test_fpr"] == pytest.approx(
        np.mean(scores[~same] >= model["threshold"])
    )
    assert abs(report["threshold"]["test_fpr"] - 0.05) < 0.03
    with Image.open(out / "roc.png") as image:
        assert image.format == "PNG"
    again = _run(*_array_args(saved), "--output", out)
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_closed_form_on_digits_with_a_feasible_alpha(tmp_path):
    result = _run(
        "--dataset", "digits", "--method", "closed-form", "--alpha", "0.3", "--n-test", "300",
        "--output", tmp_path,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["method"] == "bilinear, closed-form"
    assert report["train_negative_risk"] <= 0.3 + 1e-9
    assert report["threshold"]["train_fpr"] is None  # the mean risk is not an FPR


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset", "digits", "--alpha", "1.5"], "--alpha must be a finite number in (0, 1)"),
        (["--dataset", "digits", "--method", "closed-form"], "infeasible"),
        (["--dataset", "nope"], "--dataset must be one of"),
        (["--dataset", "digits", "--fpr", "0,2"], "--fpr must be"),
        (["--dataset", "digits", "--method", "x"], "--method must be one of"),
        (["--dataset", "digits", "--pca", "1.5"], "--pca must be"),
        (["--features", "missing.npy"], "pass --dataset NAME, or all of"),
        (["--dataset", "fashion-mnist", "--data-dir", "."], "apt-get install dataset-fashion"),
    ],
)
def test_bad_input_is_one_line_with_exit_code_2(args, message, tmp_path):
    result = _run(*args, "--output", tmp_path / "o")
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.output.strip().startswith("error:")
    assert len(result.output.strip().splitlines()) <= 3  # one message (wrapped at most)
