"""EmbeddingIndex (issue 39, item 2): exact top-k equal to a brute-force argsort of the metrics'
exact keys (ties by insertion order, and counted at the cut) for every similarity, block size and
add() split; save / load; the faiss backend; bounded memory on a 100,000-item gallery."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwise._extras import MissingDependencyError
from rankwise.search import EmbeddingIndex, exact_top_k
from rankwise.search import index as index_module
from rankwise.similarity import SIMILARITIES, ranking_keys, similarity_from_keys


def brute_force(queries, gallery, k, similarity):
    """Positions by a full stable argsort of the exact keys, and the ties left out at the cut."""
    keys = ranking_keys(queries, gallery, similarity).numpy()
    order = np.argsort(-keys, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(keys, order, axis=1)
    kth = top[:, -1:]
    ties = (keys == kth).sum(axis=1) - (top == kth).sum(axis=1)
    return order, top, ties


def check_against_brute_force(queries, gallery, k, similarity, **blocks):
    index = EmbeddingIndex(gallery.shape[1], similarity, dtype="float64")
    half = max(1, gallery.shape[0] // 2)
    index.add(gallery[:half])
    if half < gallery.shape[0]:
        index.add(gallery[half:])
    result = index.search(queries, k, **blocks)
    order, top, ties = brute_force(queries, gallery, k, similarity)
    np.testing.assert_array_equal(result.positions, order)
    np.testing.assert_array_equal(result.ids, order)
    np.testing.assert_array_equal(result.ties_at_cut, ties)
    np.testing.assert_array_equal(result.cut_tied, ties > 0)
    expected_scores = similarity_from_keys(torch.from_numpy(top), similarity).numpy()
    np.testing.assert_array_equal(result.scores, expected_scores)


@pytest.mark.parametrize("similarity", SIMILARITIES)
@pytest.mark.parametrize("k", [1, 5, 40])
def test_search_equals_brute_force_on_tie_heavy_data(similarity, k):
    rng = np.random.default_rng(k)
    gallery = rng.integers(-2, 3, (300, 3)).astype(np.float64)  # 125 distinct rows: many ties
    queries = rng.integers(-2, 3, (20, 3)).astype(np.float64)
    check_against_brute_force(queries, gallery, k, similarity, query_block=7, gallery_block=33)
    order, _, ties = brute_force(queries, gallery, k, similarity)
    assert ties.max() > 0  # the data does put ties at the cut


@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_search_equals_brute_force_on_near_ties_one_ulp_apart(similarity):
    # gallery rows a float32 ulp apart: the BLAS screening cannot tell them, the exact keys can
    rng = np.random.default_rng(1)
    base = rng.standard_normal(16).astype(np.float32)
    steps = np.arange(-40, 40, dtype=np.float32)[:, None]
    gallery = base[None] + steps * np.spacing(np.abs(base).astype(np.float32))[None]
    gallery = np.concatenate([gallery, rng.standard_normal((200, 16)).astype(np.float32)])
    queries = np.stack([base, base * 2, -base]).astype(np.float32)
    for k in (1, 10, 60):
        check_against_brute_force(queries, gallery, k, similarity, gallery_block=64)


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    similarity=st.sampled_from(SIMILARITIES),
    n_g=st.integers(1, 30),
    n_q=st.integers(1, 4),
    d=st.integers(1, 4),
)
def test_search_equals_brute_force_hypothesis(data, similarity, n_g, n_q, d):
    values = st.integers(-2, 2).map(float)
    gallery = np.array(
        data.draw(st.lists(st.lists(values, min_size=d, max_size=d), min_size=n_g, max_size=n_g))
    )
    queries = np.array(
        data.draw(st.lists(st.lists(values, min_size=d, max_size=d), min_size=n_q, max_size=n_q))
    )
    k = data.draw(st.integers(1, n_g))
    query_block = data.draw(st.integers(1, n_q))
    gallery_block = data.draw(st.integers(1, n_g))
    check_against_brute_force(
        queries, gallery, k, similarity, query_block=query_block, gallery_block=gallery_block
    )


def test_exact_top_k_checks_its_arguments():
    g = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="`k`=4 exceeds the 3 gallery items"):
        exact_top_k(torch.zeros(1, 2), g, k=4)
    with pytest.raises(ValueError, match="dimension 3 but the gallery has 2"):
        exact_top_k(torch.zeros(1, 3), g, k=1)
    with pytest.raises(ValueError, match="`similarity` must be one of"):
        exact_top_k(torch.zeros(1, 2), g, k=1, similarity="manhattan")
    with pytest.raises(ValueError, match="`queries`"):
        exact_top_k(torch.tensor([[float("nan"), 0.0]]), g, k=1)


def test_ids_paths_and_labels_follow_the_items():
    index = EmbeddingIndex(2, "dot")
    index.add(
        np.array([[1.0, 0.0], [3.0, 0.0]]),
        ids=[10, 11],
        paths=["a.png", "b.png"],
        labels=["x", "y"],
    )
    index.add(np.array([[2.0, 0.0]]), ids=[12], paths=["c.png"], labels=["z"])
    result = index.search(np.array([[1.0, 0.0]]), k=3)
    assert result.ids.tolist() == [[11, 12, 10]]
    assert result.paths == [["b.png", "c.png", "a.png"]]
    assert result.labels.tolist() == [["y", "z", "x"]]
    assert result.rows()[0][0] == {"rank": 1, "id": 11, "score": 3.0, "path": "b.png", "label": "y"}


def test_add_and_search_refuse_bad_input_naming_the_argument():
    index = EmbeddingIndex(2)
    with pytest.raises(ValueError, match="index is empty"):
        index.search(np.ones((1, 2)), k=1)
    index.add(np.ones((2, 2)), paths=["a", "b"])
    with pytest.raises(ValueError, match="holds paths; pass `paths` to every add"):
        index.add(np.ones((1, 2)))
    with pytest.raises(ValueError, match="`embeddings` have dimension 3"):
        index.add(np.ones((1, 3)), paths=["c"])
    with pytest.raises(ValueError, match="`paths` has 1 entries for 2 embeddings"):
        index.add(np.ones((2, 2)), paths=["c"])
    with pytest.raises(ValueError, match="`ids` must be a 1-D integer array"):
        index.add(np.ones((1, 2)), ids=[0.5], paths=["c"])
    with pytest.raises(ValueError, match="`k`=3 exceeds the 2 items"):
        index.search(np.ones((1, 2)), k=3)
    with pytest.raises(ValueError, match="`queries` have dimension 1"):
        index.search(np.ones((1, 1)), k=1)
    with pytest.raises(ValueError, match="`embeddings`.*NaN"):
        index.add(np.array([[np.nan, 0.0]]), paths=["c"])
    with pytest.raises(ValueError, match="`metadata` must be JSON-serialisable"):
        EmbeddingIndex(2, metadata={"when": object()})


def test_save_and_load_round_trip_with_metadata(tmp_path):
    rng = np.random.default_rng(0)
    index = EmbeddingIndex(4, "euclidean", metadata={"model_id": "abc", "step": 7})
    index.add(
        rng.standard_normal((30, 4)),
        ids=np.arange(100, 130),
        paths=[f"p{i}" for i in range(30)],
        labels=np.arange(30) % 3,
    )
    written = index.save(tmp_path / "gallery")
    assert written == tmp_path / "gallery.json" and (tmp_path / "gallery.npz").is_file()
    meta = json.loads(written.read_text())
    assert meta["similarity"] == "euclidean" and meta["dim"] == 4 and meta["metadata"]["step"] == 7
    for name in ("gallery", "gallery.json", "gallery.npz"):
        loaded = EmbeddingIndex.load(tmp_path / name)
        queries = rng.standard_normal((5, 4))
        a, b = index.search(queries, 6), loaded.search(queries, 6)
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.scores, b.scores)
        assert a.paths == b.paths and np.array_equal(a.labels, b.labels)
        assert loaded.metadata == {"model_id": "abc", "step": 7}


def test_load_refuses_a_replaced_or_foreign_file(tmp_path):
    index = EmbeddingIndex(2)
    index.add(np.eye(2))
    index.save(tmp_path / "a")
    other = EmbeddingIndex(2)
    other.add(np.ones((3, 2)))
    other.save(tmp_path / "b")
    (tmp_path / "a.npz").write_bytes((tmp_path / "b.npz").read_bytes())
    with pytest.raises(ValueError, match="SHA-256 differs"):
        EmbeddingIndex.load(tmp_path / "a")
    (tmp_path / "c.json").write_text('{"kind": "something else"}')
    with pytest.raises(ValueError, match="not an EmbeddingIndex file"):
        EmbeddingIndex.load(tmp_path / "c.json")
    with pytest.raises(FileNotFoundError, match="no EmbeddingIndex"):
        EmbeddingIndex.load(tmp_path / "missing")


def test_a_gallery_of_100000_items_is_searched_in_blocks(monkeypatch):
    # the score blocks never exceed query_block x gallery_block, and the result is still exact
    shapes = []
    scores = index_module._Screen.scores

    def recording(self, q, similarity):
        approx, band = scores(self, q, similarity)
        shapes.append(tuple(approx.shape))
        return approx, band

    monkeypatch.setattr(index_module._Screen, "scores", recording)
    rng = np.random.default_rng(0)
    gallery = rng.integers(-3, 4, (100_000, 4)).astype(np.float32)
    queries = rng.integers(-3, 4, (6, 4)).astype(np.float32)
    index = EmbeddingIndex(4, "cosine")
    index.add(gallery)
    result = index.search(queries, k=20, query_block=4, gallery_block=8192)
    assert max(shapes) <= (4, 8192) and len(shapes) == 2 * 13
    order, _, ties = brute_force(queries, gallery, 20, "cosine")
    np.testing.assert_array_equal(result.positions, order)
    np.testing.assert_array_equal(result.ties_at_cut, ties)


def test_faiss_backend_finds_the_exact_neighbours_and_flags_ties():
    pytest.importorskip("faiss")
    rng = np.random.default_rng(0)
    gallery = rng.standard_normal((500, 8)).astype(np.float32)
    queries = rng.standard_normal((10, 8)).astype(np.float32)
    for similarity in SIMILARITIES:
        exact, flat = EmbeddingIndex(8, similarity), EmbeddingIndex(8, similarity, backend="faiss")
        exact.add(gallery)
        flat.add(gallery)
        a, b = exact.search(queries, 5), flat.search(queries, 5)
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_allclose(a.scores, b.scores, rtol=1e-5, atol=1e-5)
        assert b.ties_at_cut is None and not b.cut_tied.any()
    duplicated = EmbeddingIndex(8, "dot", backend="faiss")
    duplicated.add(np.repeat(gallery[:1], 4, axis=0))
    result = duplicated.search(gallery[:1], 2)
    assert result.cut_tied.tolist() == [True] and result.ids.tolist() == [[0, 1]]


def test_faiss_backend_without_faiss_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # import faiss now fails
    with pytest.raises(
        MissingDependencyError, match=r"faiss-cpu is not installed.*rankwise\[faiss\]"
    ):
        EmbeddingIndex(4, backend="faiss")
