"""HashingHead (tanh relaxation, deterministic sign, packing) and HammingIndex (exact k-NN and radius
search ordered by distance then insertion, .npz round trip) against brute force."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwise.hashing import (
    HammingIndex,
    HashingHead,
    HashingModel,
    build_hashing_model,
    hamming_distances,
    pack_codes,
    unpack_codes,
)


def random_codes(n, bits, seed=0):
    return np.random.default_rng(seed).choice(np.array([-1, 1], dtype=np.int8), size=(n, bits))


# -- HashingHead ------------------------------------------------------------------------------------


def test_head_relaxes_while_training_and_binarizes_in_eval():
    torch.manual_seed(0)
    head = HashingHead(5, 12, gamma=2.0, center=False)
    x = torch.randn(7, 5)
    f = head.activations(x)
    relaxed = head(x)
    assert torch.allclose(relaxed, torch.tanh(2.0 * f / 2))
    assert relaxed.abs().max() < 1
    head.eval()
    hard = head(x)
    assert set(hard.unique().tolist()) <= {-1.0, 1.0} and hard.dtype == x.dtype
    assert torch.equal(hard.to(torch.int8), head.encode(x))
    assert torch.equal(head.encode(x), torch.where(f >= 0, 1, -1).to(torch.int8))


def test_centered_head_balances_bits_and_encodes_with_running_statistics():
    torch.manual_seed(0)
    head = HashingHead(6, 16)  # center=True: BatchNorm1d without affine parameters
    x = torch.rand(64, 6) + 3.0  # positive features: a plain linear map gives one code for all
    plain = HashingHead(6, 16, center=False)
    assert len({tuple(c.tolist()) for c in plain.encode(x)}) < 8
    relaxed = head(x)
    assert relaxed.mean(0).abs().max() < 0.2  # every bit centred over the batch
    before = head.norm.running_mean.clone()
    head.encode(x)  # encoding never updates the running statistics
    assert torch.equal(head.norm.running_mean, before)
    for _ in range(50):
        head(x)
    head.eval()
    codes = head.encode(x)
    assert torch.equal(codes, head(x).to(torch.int8))
    assert len({tuple(c.tolist()) for c in codes}) > 32


def test_zero_activation_maps_to_plus_one():
    head = HashingHead(3, 4, center=False)
    with torch.no_grad():
        head.linear.weight.zero_()
        head.linear.bias.copy_(torch.tensor([0.0, -1.0, 1.0, -0.0]))
    codes = head.encode(torch.randn(2, 3))
    assert codes.tolist() == [[1, -1, 1, 1], [1, -1, 1, 1]]


def test_gamma_is_a_buffer_and_can_be_annealed():
    head = HashingHead(3, 4, gamma=1.0, center=False)
    head.set_gamma(8.0)
    state = head.state_dict()
    assert float(state["gamma"]) == 8.0
    other = HashingHead(3, 4, center=False)
    other.load_state_dict(state)
    assert float(other.gamma) == 8.0
    x = torch.randn(2, 3)
    assert torch.allclose(other(x), torch.tanh(4.0 * other.activations(x)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"in_features": 0, "bits": 4}, "in_features"),
        ({"in_features": 3, "bits": 0}, "bits"),
        ({"in_features": 3, "bits": 4, "gamma": 0.0}, "gamma"),
        ({"in_features": 3, "bits": 4, "gamma": float("nan")}, "gamma"),
        ({"in_features": 3, "bits": True}, "bits"),
    ],
)
def test_head_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        HashingHead(**kwargs)


def test_head_pack_and_model_wrappers():
    torch.manual_seed(0)
    model = build_hashing_model("mlp", (1, 4, 4), 64)
    assert isinstance(model, HashingModel) and model.bits == 64
    x = torch.randn(3, 1, 4, 4)
    packed = model.pack(x, dtype="uint64")
    assert packed.shape == (3, 1) and packed.dtype == np.uint64
    assert np.array_equal(packed, pack_codes(model.encode(x), "uint64"))
    linear = build_hashing_model("linear", (6,), 8)
    assert linear(torch.randn(2, 6)).shape == (2, 8)
    with pytest.raises(ValueError, match="HashingHead expects features"):
        HashingHead(5, 8)(torch.randn(2, 4))


# -- HammingIndex -----------------------------------------------------------------------------------


def brute_force_knn(queries, database, k):
    dist = hamming_distances(queries, database).astype(np.int64)
    order = np.argsort(dist, axis=1, kind="stable")[:, :k]  # ties by insertion order
    return np.take_along_axis(dist, order, 1), order


@settings(max_examples=40, deadline=None)
@given(
    bits=st.integers(1, 80),
    n=st.integers(1, 60),
    k_frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_knn_search_equals_stable_brute_force(bits, n, k_frac, seed):
    database = random_codes(n, bits, seed)
    queries = random_codes(5, bits, seed + 1)
    k = max(1, round(k_frac * n))
    index = HammingIndex(bits)
    index.add(database[: n // 2])
    index.add(pack_codes(database[n // 2 :], "uint8"))  # packed input, added in two parts
    dist, ids = index.search(queries, k)
    ref_dist, ref_ids = brute_force_knn(queries, database, k)
    assert np.array_equal(dist, ref_dist) and np.array_equal(ids, ref_ids)


def test_radius_search_equals_brute_force():
    database = random_codes(300, 16, seed=1)
    queries = random_codes(7, 16, seed=2)
    index = HammingIndex(16)
    index.add(database)
    full = hamming_distances(queries, database)
    for radius in (0, 3, 6, 16, 40):
        lims, dist, ids = index.radius_search(queries, radius)
        assert lims.shape == (8,)
        for i in range(7):
            expected = np.flatnonzero(full[i] <= radius)
            expected = expected[np.argsort(full[i, expected], kind="stable")]
            assert np.array_equal(ids[lims[i] : lims[i + 1]], expected)
            assert np.array_equal(dist[lims[i] : lims[i + 1]], full[i, expected])


def test_custom_ids_save_and_load(tmp_path):
    database = random_codes(40, 24, seed=4)
    queries = random_codes(3, 24, seed=5)
    index = HammingIndex(24)
    index.add(database, ids=np.arange(1000, 1040))
    assert index.nbytes == 40 * 4  # 24-bit codes in one 32-bit word each
    path = index.save(tmp_path / "codes")
    assert path.name == "codes.npz"
    loaded = HammingIndex.load(path)
    assert loaded.ntotal == 40 and loaded.bits == 24
    d1, i1 = index.search(queries, 5)
    d2, i2 = loaded.search(queries, 5)
    assert np.array_equal(d1, d2) and np.array_equal(i1, i2) and i1.min() >= 1000
    with np.load(path, allow_pickle=False) as data:
        assert data["codes"].dtype == np.uint8 and data["codes"].shape == (40, 3)


def test_index_errors_name_the_problem(tmp_path):
    index = HammingIndex(16)
    index.add(random_codes(10, 16))
    with pytest.raises(ValueError, match="`k`=11 exceeds the 10 codes"):
        index.search(random_codes(1, 16), 11)
    with pytest.raises(ValueError, match="`k` must be an integer >= 1"):
        index.search(random_codes(1, 16), 0)
    with pytest.raises(ValueError, match="`queries` has 12-bit codes but the index holds 16"):
        index.search(random_codes(1, 12), 1)
    with pytest.raises(ValueError, match="`ids` must be a 1-D integer array of length 2"):
        index.add(random_codes(2, 16), ids=[1.5, 2.5])
    with pytest.raises(ValueError, match="`radius` must be an integer >= 0"):
        index.radius_search(random_codes(1, 16), -1)
    with pytest.raises(FileNotFoundError, match="no Hamming index"):
        HammingIndex.load(tmp_path / "missing.npz")
    bad = tmp_path / "bad.npz"
    np.savez(bad, something=np.zeros(3))
    with pytest.raises(ValueError, match="not a HammingIndex file"):
        HammingIndex.load(bad)
    empty = HammingIndex(8)
    assert empty.radius_search(random_codes(2, 8), 3)[0].tolist() == [0, 0, 0]


WORD_TYPES = ("uint8", "uint16", "uint32", "uint64")


@pytest.mark.parametrize("bits", [12, 70])
@pytest.mark.parametrize("query_words", WORD_TYPES)
@pytest.mark.parametrize("index_words", WORD_TYPES)
def test_packed_codes_of_any_word_type_search_like_the_matching_type(
    bits, index_words, query_words
):
    """The kernels read words of the index's type: a PackedCodes of another word type (added or
    searched) is repacked, so every pair gives the matched-type (and brute-force) results."""
    from rankwise.hashing import as_packed_codes

    database = random_codes(60, bits, seed=7)
    queries = random_codes(6, bits, seed=8)
    packed_db = as_packed_codes(database)
    index = HammingIndex(bits)
    index.add(packed_db.rows(slice(0, 25)).to(index_words))
    index.add(database[25:])  # a second chunk in the narrowest type
    q = as_packed_codes(queries).to(query_words)
    full = hamming_distances(queries, database)
    lims, dist, ids = index.radius_search(q, bits // 2)
    for i in range(len(queries)):
        expected = np.flatnonzero(full[i] <= bits // 2)
        expected = expected[np.argsort(full[i, expected], kind="stable")]
        assert np.array_equal(ids[lims[i] : lims[i + 1]], expected)
        assert np.array_equal(dist[lims[i] : lims[i + 1]], full[i, expected])
    dist, ids = index.search(q, 10)
    ref_dist, ref_ids = brute_force_knn(queries, database, 10)
    assert np.array_equal(dist, ref_dist) and np.array_equal(ids, ref_ids)
    matched_dist, matched_ids = index.search(queries, 10)
    assert np.array_equal(dist, matched_dist) and np.array_equal(ids, matched_ids)
    assert index.codes().bits == bits
    assert torch.equal(unpack_codes(index.codes()), torch.from_numpy(database))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_codes_are_added_and_searched_like_float32(dtype):
    database = torch.from_numpy(random_codes(30, 20, seed=9))
    queries = torch.from_numpy(random_codes(4, 20, seed=10))
    half, full = HammingIndex(20), HammingIndex(20)
    half.add(database.to(dtype))
    full.add(database.to(torch.float32))
    got = half.search(queries.to(dtype), 7)
    expected = full.search(queries.to(torch.float32), 7)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))
    lims, _, ids = half.radius_search(queries.to(dtype), 8)
    lims_f, _, ids_f = full.radius_search(queries, 8)
    assert np.array_equal(lims, lims_f) and np.array_equal(ids, ids_f)


def test_searching_an_empty_index_says_it_is_empty():
    empty = HammingIndex(8)
    with pytest.raises(ValueError, match=r"the index is empty.*HammingIndex.add") as info:
        empty.search(random_codes(2, 8), 1)
    assert "k <= 0" not in str(info.value)


def test_unsigned_zero_one_codes_are_not_silently_read_as_packed_bytes():
    """(n, 12) torch.uint8 {0, 1} codes could be 12-bit unpacked codes or 96-bit packed bytes."""
    zero_one = torch.from_numpy(random_codes(10, 12) > 0).to(torch.uint8)
    index = HammingIndex(12)
    with pytest.raises(ValueError, match=r"`codes`.*\{0, 1\}.*bool"):
        index.add(zero_one)
    index.add(zero_one.bool())  # stated intent: one bit per column
    assert index.ntotal == 10
