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
    assert 0 < report["threshold"]["train_fpr"] <= 0.3  # the FPR of the threshold itself


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
    assert message in _error_line(result)


def _error_line(result):
    """The one ``error:`` line of a failed run, after nothing but progress lines on stderr."""
    assert result.stdout == "", result.stdout
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error:"), result.stderr
    assert all(line.startswith("roc fit: ") for line in lines[:-1]), result.stderr
    return lines[-1]


def _unit(X):
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def _pair_scores(out, Z):
    """S_A over every pair i < j of the (preprocessed, unit) rows Z, from the saved model."""
    model = np.load(out / "bilinear.npz")
    i, j = np.triu_indices(Z.shape[0], 1)
    return 0.5 * (1 + ((Z[i] @ model["A"]) * Z[j]).sum(1)), i, j, float(model["threshold"])


def test_the_saved_split_reproduces_the_reported_numbers(tmp_path):
    """Issue 19: the split was not saved, so nothing could be recomputed from the run folder."""
    from rankwise.data import read_digits_images

    out = tmp_path / "run"
    result = _run(
        "--dataset", "digits", "--n-train", "300", "--n-test", "250", "--center", "--max-iter",
        "60", "--seed", "3", "--output", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    split = np.load(out / "split.npz")
    assert int(split["seed"]) == 3 and report["split"] == "split.npz"
    assert split["train"].size == 300 and split["test"].size == 250
    assert not set(split["train"].tolist()) & set(split["test"].tolist())
    images, labels = read_digits_images(with_labels=True)
    X = images.reshape(images.shape[0], -1).astype(np.float64)
    model = np.load(out / "bilinear.npz")
    project = lambda rows: _unit((X[rows] - model["mean"]) @ model["components"].T)  # noqa: E731
    scores, i, j, threshold = _pair_scores(out, project(split["test"]))
    y_test = labels[split["test"]]
    same = y_test[i] == y_test[j]
    assert report["learned"]["tpr_at_fpr"]["0.05"] == tpr_at_fpr(scores, same, 0.05)
    assert report["threshold"]["test_fpr"] == np.mean(scores[~same] >= threshold)
    assert report["threshold"]["test_tpr"] == np.mean(scores[same] >= threshold)
    scores, i, j, _ = _pair_scores(out, project(split["train"]))
    y = labels[split["train"]]
    assert report["threshold"]["train_fpr"] == np.mean(scores[y[i] != y[j]] >= threshold)


def test_closed_form_reports_the_training_fpr_of_its_threshold(saved):
    """Issue 19: `--method closed-form` printed "FPR nan on training pairs"."""
    out = saved / "closed"
    result = _run(*_array_args(saved), "--method", "closed-form", "--alpha", "0.49", "-o", out)
    assert result.exit_code == 0, result.output
    assert "nan" not in result.stdout
    report = json.loads((out / "report.json").read_text())
    X, y = np.load(saved / "X.npy"), np.load(saved / "y.npy")
    scores, i, j, threshold = _pair_scores(out, _unit(X))
    train_fpr = np.mean(scores[y[i] != y[j]] >= threshold)
    assert report["threshold"]["train_fpr"] == pytest.approx(train_fpr, abs=1e-12)
    assert 0 < train_fpr <= 0.49
    assert f"FPR {train_fpr:.4f} on training pairs" in result.stdout


def test_tuple_negatives_bound_the_fpr_over_every_training_pair(tmp_path):
    """Issue 19 item 3 through the CLI: `--negatives tuples` on classes 300/30/30."""
    rng = np.random.default_rng(0)
    centers = np.array([[0.5, 0.87, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    y = np.repeat(np.arange(3), (300, 30, 30))
    X = centers[y] + 0.35 * rng.normal(size=(360, 3))
    for name, value in (("X", X), ("y", y), ("Xt", X[::3]), ("yt", y[::3])):
        np.save(tmp_path / f"{name}.npy", value)
    out = tmp_path / "out"
    result = _run(
        *_array_args(tmp_path), "--negatives", "tuples", "--n-negative-samples", "2000",
        "--max-iter", "150", "--alpha", "0.05", "-o", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    scores, i, j, threshold = _pair_scores(out, _unit(X))
    true_fpr = np.mean(scores[y[i] != y[j]] >= threshold)
    assert true_fpr <= 0.05 + 0.016  # 4 σ_T/√B, see tests/models/test_bilinear.py
    assert abs(report["threshold"]["train_fpr"] - true_fpr) <= 0.016


@pytest.mark.parametrize(
    "content, flag, message",
    [
        (np.array(["a", "b"] * 150), "--labels", "--labels: y.npy must hold a numeric array"),
        (np.array(["a", "b"] * 150), "--test-labels", "--test-labels: yt.npy must hold a numeric"),
        (np.arange(300) + 0.5, "--labels", "--labels must hold integer class ids"),
        (np.arange(300) + 0.5, "--test-labels", "--test-labels must hold integer class ids"),
        (np.zeros((300, 1), int), "--labels", "--labels must be 1-D (one class id per row of"),
        (np.zeros(299, int), "--labels", "--labels has 299 entries but --features has 300 rows"),
        (np.zeros(299, int), "--test-labels", "--test-labels has 299 entries but --test-features"),
    ],
)
def test_label_errors_name_the_labels_option(saved, content, flag, message):
    """Issue 19: string labels were reported as "--features labels", others as `labels`."""
    target = saved / ("y.npy" if flag == "--labels" else "yt.npy")
    np.save(target, content)
    result = _run(*_array_args(saved), "--output", saved / "o")
    assert result.exit_code == 2, result.output
    assert message in _error_line(result)


def test_string_features_are_refused(saved):
    np.save(saved / "X.npy", np.load(saved / "X.npy").astype(str))
    result = _run(*_array_args(saved), "--output", saved / "o")
    assert result.exit_code == 2
    assert "--features: X.npy must hold a numeric array" in _error_line(result)


def test_progress_stages_go_to_stderr(saved):
    """Issue 19 item 12: the command said nothing until the table (70 s on digits)."""
    result = _run(*_array_args(saved), "--max-iter", "40", "--output", saved / "o")
    assert result.exit_code == 0, result.output
    progress = result.stderr
    for stage in ("loading", "fitting", "iteration 40/40", "evaluating", "writing"):
        assert stage in progress, progress
    assert "TPR@FPR" not in progress and "TPR@FPR" in result.stdout  # the table: stdout
