"""Every registered experiment runs with ``quick=True``, writes its JSON and PNG, and gives the same
JSON for the same seed.

How long a quick run takes is reported by ``--durations`` and measured in docs/experiments.md, never
asserted here (timings on a shared machine make such a test flaky).
"""

from __future__ import annotations

import json

import pytest
from PIL import Image

from rankwise.experiments import REGISTRY, get_experiment

# experiments whose quick run reads Fashion-MNIST, which a fresh machine may lack
NEEDS_FASHION_MNIST = {"mmc-subsampling", "hash-euclidean-ndcg"}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_quick_run_writes_json_png_and_is_deterministic(name, tmp_path, request):
    if name in NEEDS_FASHION_MNIST:
        request.getfixturevalue("fashion_mnist")  # skips where it is not installed
    run = get_experiment(name)
    first = run(quick=True, seed=7, output=tmp_path / "a")

    payload = json.loads(first.json_path.read_text())
    assert payload["experiment"] == name
    assert payload["verdict"] == first.verdict and "\n" not in first.verdict
    assert first.verdict.startswith(f"{name}")
    assert isinstance(payload["consistent_with_paper"], bool)
    with Image.open(first.figure_path) as image:
        assert image.format == "PNG" and image.size[0] > 300 and image.size[1] > 200

    second = run(quick=True, seed=7, output=tmp_path / "b.json")
    assert second.json_path.read_text() == first.json_path.read_text()
    assert second.figure_path.read_bytes() == first.figure_path.read_bytes()
