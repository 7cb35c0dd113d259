"""Fit metric-learn's ``MMC_Supervised`` on arrays from an ``.npz`` file and save its matrix.

Run as a script by :mod:`rankwise.experiments.mmc_subsampling`, possibly with another Python
interpreter (metric-learn 0.7.0 needs scikit-learn ≤ 1.7, so it usually lives in a separate virtual
environment). It imports only numpy, time and metric_learn, never rankwise::

    python _metric_learn_runner.py INPUT.npz OUTPUT.npz

INPUT holds ``X`` (n, d), ``y`` (n,), ``n_constraints`` (≤ 0: metric-learn's default), ``seed``,
``max_iter``; OUTPUT gets ``A`` (d, d), ``seconds`` (wall time of ``fit`` alone), ``converged``,
``n_constraints`` and the metric-learn version.
"""

from __future__ import annotations

import sys
import time
import warnings


def main(argv: list[str]) -> int:
    """Fit and save; returns the process exit code."""
    import numpy as np

    if len(argv) != 2:
        print("usage: _metric_learn_runner.py INPUT.npz OUTPUT.npz", file=sys.stderr)
        return 2
    import metric_learn

    with np.load(argv[0]) as data:
        X, y = data["X"], data["y"]
        n_constraints = int(data["n_constraints"])
        seed, max_iter = int(data["seed"]), int(data["max_iter"])
    model = metric_learn.MMC_Supervised(
        n_constraints=n_constraints if n_constraints > 0 else None,
        max_iter=max_iter,
        random_state=seed,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scikit-learn's deprecation notices about metric-learn
        start = time.perf_counter()
        model.fit(X, y)
        seconds = time.perf_counter() - start
    used = n_constraints if n_constraints > 0 else 20 * len(np.unique(y)) ** 2
    np.savez(
        argv[1],
        A=model.get_mahalanobis_matrix(),
        seconds=seconds,
        converged=bool(getattr(model, "converged_", False)),
        n_constraints=used,
        version=metric_learn.__version__,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
