"""What a core-only install (`pip install rankwise`: torch, numpy, scipy, numba; no extra) can
import, checked in a fresh interpreter in which every extra's modules fail to import. Before issue
20, `import rankwise.models` needed scikit-learn (the similarity estimators lived there) and
`import rankwise.metrics` loaded the hashing package (and with it torch.nn modules of ours)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import rankwise
from rankwise._extras import EXTRAS

SRC = Path(rankwise.__file__).resolve().parents[1]
# import names of every extra, plus scikit-learn's own dependency threadpoolctl
BLOCKED = sorted({name for names in EXTRAS.values() for name in names} | {"threadpoolctl"})

_PRELUDE = """
import importlib.abc, json, sys

BLOCKED = set({blocked!r})


class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
"""


def run_python(code: str, *, core_only: bool) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    prelude = _PRELUDE.format(blocked=BLOCKED) if core_only else "import json, sys\n"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_core_only_install_imports_the_backbones_and_builds_a_model():
    out = run_python(
        """
        import torch
        import rankwise.models
        from rankwise.models import EmbeddingModel, build_model

        model = build_model("small_cnn", (1, 8, 8), 16)
        shape = tuple(model(torch.zeros(2, 1, 8, 8)).shape)
        print(json.dumps({"shape": shape, "ok": isinstance(model, EmbeddingModel),
                          "sklearn": "sklearn" in sys.modules}))
        """,
        core_only=True,
    )
    assert out == {"shape": [2, 16], "ok": True, "sklearn": False}


@pytest.mark.parametrize(
    "statement",
    [
        "from rankwise.models import BilinearSimilarity",
        "from rankwise.models import MMC",
        "import rankwise.similarity_learning",
        "from rankwise.similarity_learning import BilinearSimilarity",
    ],
)
def test_core_only_install_names_the_extra_of_the_similarity_estimators(statement):
    out = run_python(
        f"""
        try:
            {statement}
        except ImportError as error:
            print(json.dumps({{"error": type(error).__name__, "message": str(error)}}))
        else:
            print(json.dumps({{"error": None}}))
        """,
        core_only=True,
    )
    assert out["error"] is not None, f"{statement} worked without scikit-learn"
    assert "scikit-learn" in out["message"]
    assert "pip install 'rankwise[train]'" in out["message"]


def test_the_similarity_estimators_are_the_same_objects_under_both_paths():
    from rankwise import models, similarity_learning

    assert models.BilinearSimilarity is similarity_learning.BilinearSimilarity
    assert models.MMC is similarity_learning.MMC
    assert {"BilinearSimilarity", "MMC"} <= set(models.__all__)


def test_importing_the_metrics_loads_no_network_code():
    out = run_python(
        """
        import rankwise.metrics

        print(json.dumps(sorted(m for m in sys.modules if m.startswith("rankwise."))))
        """,
        core_only=False,
    )
    network = ("hashing", "losses", "models", "training", "similarity_learning", "sampling")
    loaded = [m for m in out if m.split(".")[1] in network]
    assert loaded == [], f"`import rankwise.metrics` loaded {loaded}"


def test_core_only_install_searches_exactly_and_names_the_faiss_extra():
    # issue 39: the exact EmbeddingIndex needs no extra; its faiss backend names the `faiss` extra
    out = run_python(
        """
        import numpy as np
        from rankwise._extras import MissingDependencyError
        from rankwise.search import EmbeddingIndex

        index = EmbeddingIndex(2, "dot")
        index.add(np.array([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]]))
        found = index.search(np.array([[1.0, 0.0]]), k=2).ids.tolist()
        try:
            EmbeddingIndex(2, backend="faiss")
        except MissingDependencyError as error:
            message, extra = str(error), error.extra
        print(json.dumps({"found": found, "message": message, "extra": extra}))
        """,
        core_only=True,
    )
    assert out["found"] == [[1, 0]]
    assert out["extra"] == "faiss" and "pip install 'rankwise[faiss]'" in out["message"]
