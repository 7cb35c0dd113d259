"""`mmc-subsampling` (Vogel et al., Sec. 5.3, Fig. 4): scoring, the metric-learn subprocess protocol
(with a stand-in module, and with the real metric-learn where its environment exists), the quick
study on Fashion-MNIST, bad options."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from rankwise.experiments import mmc_subsampling as mmc
from rankwise.similarity_learning.mmc import mmc_objective, positive_scatter

# an interpreter with metric-learn 0.7.0 and scikit-learn <= 1.7 (a separate environment)
ML_PYTHON = Path(os.environ.get(mmc.METRIC_LEARN_ENV, "/nonexistent"))


def _blobs(n=120, d=5, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    return rng.normal(size=(4, d))[y] + 0.7 * rng.normal(size=(n, d)), y


def test_score_rescales_to_the_training_constraint():
    X, y = _blobs()
    X_test, y_test = _blobs(seed=1)
    A = np.diag([3.0, 1.0, 0.5, 2.0, 1.0])
    out = mmc._score(A, X, y, (X_test, y_test))
    scale = float((positive_scatter(X, y) * A).sum())
    assert out["train_constraint_before_rescaling"] == pytest.approx(scale)
    objective, constraint = mmc_objective(X_test, y_test, A / scale)
    assert out["test_objective"] == pytest.approx(objective)
    assert out["test_constraint"] == pytest.approx(constraint)
    # d_A is homogeneous of degree 1/2 in A: the scale-free ratio does not depend on the scale
    again = mmc._score(7.0 * A, X, y, (X_test, y_test))
    assert again["test_scale_free"] == pytest.approx(out["test_scale_free"])


def test_find_metric_learn_explains_why_it_is_skipped(tmp_path, monkeypatch):
    monkeypatch.delenv(mmc.METRIC_LEARN_ENV, raising=False)
    with pytest.raises(ValueError, match="`metric_learn_python`"):
        mmc.find_metric_learn(str(tmp_path / "no-python"))
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: no metric_learn' >&2\nexit 1\n")
    fake.chmod(0o755)
    python, reason = mmc.find_metric_learn(str(fake))
    assert python is None and "cannot import metric_learn" in reason
    monkeypatch.setenv(mmc.METRIC_LEARN_ENV, str(fake))
    assert mmc.find_metric_learn(None)[0] is None


def _stand_in(tmp_path: Path) -> dict[str, str]:
    """A ``metric_learn`` module with metric-learn's interface: records what it was given."""
    package = tmp_path / "site"
    package.mkdir()
    (package / "metric_learn.py").write_text(
        textwrap.dedent(
            """
            import numpy as np
            __version__ = "0.0-stand-in"

            class MMC_Supervised:
                def __init__(self, n_constraints=None, max_iter=100, random_state=None):
                    self.n_constraints, self.max_iter = n_constraints, max_iter
                    self.converged_ = True

                def fit(self, X, y):
                    self.d = X.shape[1]
                    return self

                def get_mahalanobis_matrix(self):
                    return np.eye(self.d) * (self.n_constraints or 1) * self.max_iter
            """
        )
    )
    return {**os.environ, "PYTHONPATH": str(package)}


@pytest.mark.parametrize(("n_constraints", "expected"), [(0, 20 * 4**2), (37, 37)])
def test_runner_protocol_with_a_stand_in(tmp_path, n_constraints, expected):
    X, y = _blobs()
    source, target = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(source, X=X, y=y, n_constraints=n_constraints, seed=0, max_iter=3)
    done = subprocess.run(
        [sys.executable, str(mmc._RUNNER), str(source), str(target)],
        env=_stand_in(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    with np.load(target) as out:
        assert int(out["n_constraints"]) == expected
        np.testing.assert_array_equal(out["A"], np.eye(5) * max(n_constraints, 1) * 3)
        assert bool(out["converged"]) and float(out["seconds"]) >= 0
        assert str(out["version"]) == "0.0-stand-in"


def test_runner_usage_error():
    done = subprocess.run(
        [sys.executable, str(mmc._RUNNER)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2 and "usage" in done.stderr


@pytest.mark.skipif(not ML_PYTHON.exists(), reason="no metric-learn environment on this machine")
def test_real_metric_learn_on_blobs():
    python, reason = mmc.find_metric_learn(str(ML_PYTHON))
    assert python is not None, reason
    X, y = _blobs(n=80)
    out = mmc._run_metric_learn(python, X, y, 0, seed=0, max_iter=20)
    A = out["A"]
    assert A.shape == (5, 5) and out["n_constraints"] == 20 * 4**2
    np.testing.assert_allclose(A, A.T, atol=1e-10)
    assert np.linalg.eigvalsh(A).min() > -1e-8  # a Mahalanobis matrix


def _fashion_mnist_installed() -> bool:
    from rankwise.data import read_mnist_family

    try:
        read_mnist_family("fashion-mnist", None)
    except (OSError, ValueError):
        return False
    return True


@pytest.fixture(scope="module")
def quick():
    if not _fashion_mnist_installed():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    return mmc.run(quick=True, seed=0, metric_learn=False)


def test_quick_study(quick):
    data = quick.data
    assert data["pca"]["explained_variance"] >= 0.9 and data["pca"]["n_components"] < 784
    assert data["metric_learn_ran"] is False and "disabled" in data["metric_learn"]
    methods = {(row["n"], row["method"]) for row in data["table"]}
    assert methods == {
        (200, "tuples B=0.05n"),
        (200, "tuples B=0.15n"),
        (200, "complete"),
        (400, "tuples B=0.05n"),
        (400, "tuples B=0.15n"),
    }
    for run in data["runs"]:
        assert run["seconds"] is None  # quick mode records no timings (reproducible output)
        # the solution meets the constraint on the training data (rescaling changes it by rounding)
        assert run["train_constraint_before_rescaling"] == pytest.approx(1.0, abs=1e-6)
        assert run["test_objective"] > 0 and run["test_constraint"] > 0
        if run["method"].startswith("tuples"):
            tuples = int(np.ceil(run["budget_fraction"] * run["n"]))
            assert run["n_negative_pairs_used"] == tuples * 10 * 9 // 2  # K = 10 classes
    complete = [c for c in data["comparisons"] if "loss_vs_complete" in c]
    assert [c["n"] for c in complete] == [200]
    assert abs(complete[0]["loss_vs_complete"]) < 0.05  # B = 0.15 n close to all n⁻ pairs
    assert quick.verdict.startswith("mmc-subsampling: B = 0.15 n tuples")
    assert "metric-learn skipped" in quick.verdict


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sizes": "10"}, "`sizes`"),
        ({"budgets": "0.1,-1"}, "`budgets`"),
        ({"sampling": "triples"}, "`sampling`"),
        ({"dataset": "cifar10"}, "`dataset`"),
        ({"variance": 1.0}, "`variance`"),
        ({"ml_runs": "default,best"}, "`ml_runs` must be one of 'default', 'matched'"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        mmc.run(quick=True, metric_learn=False, **options)
