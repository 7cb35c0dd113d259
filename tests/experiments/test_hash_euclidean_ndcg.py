"""``hash-euclidean-ndcg`` (TALR, Sec. 5.3): every method is scored by tie-aware NDCG against
Euclidean-threshold affinities, and training the linear hash functions learns something even in
the quick run (binary-relevance mAP above random projections for every trained method)."""

from __future__ import annotations

import json

import pytest

from rankwise.experiments import get_experiment
from rankwise.experiments.hash_euclidean_ndcg import METHODS


@pytest.fixture(scope="module")
def quick(tmp_path_factory, fashion_mnist):
    run = get_experiment("hash-euclidean-ndcg")
    return run(quick=True, seed=0, output=tmp_path_factory.mktemp("hen") / "r.json")


def test_every_method_is_scored_with_its_tie_range(quick):
    rows = json.loads(quick.json_path.read_text())["rows"]
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        low, high = r["ndcg_range"]
        assert 0 < low <= r["ndcg"] <= high <= 1
        assert r["queries_without_neighbour"] == 0


def test_trained_hash_functions_beat_random_projections(quick):
    by = {r["method"]: r for r in quick.data["rows"]}
    for method in ("dpsh", "talr_ap", "talr_ndcg", "talr_ndcg_midpoint"):
        assert by[method]["map"] > by["lsh"]["map"] + 0.02, method
    assert by["talr_ndcg"]["ndcg"] > by["lsh"]["ndcg"]


def test_bad_options_name_the_argument():
    run = get_experiment("hash-euclidean-ndcg")
    with pytest.raises(ValueError, match="dims"):
        run(quick=True, bits=(64,), dims=32)
    with pytest.raises(ValueError, match="dataset"):
        run(quick=True, dataset="cifar")
