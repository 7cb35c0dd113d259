"""Packed binary codes: every input form packs to the same bits, XOR + popcount distances equal the
±1 inner-product formula (TALR Eq. 1), and malformed codes are rejected with clear messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rankwise.hashing import (
    PackedCodes,
    as_packed_codes,
    hamming_distances,
    pack_codes,
    unpack_codes,
)


def random_codes(n, bits, seed=0):
    return np.random.default_rng(seed).choice(np.array([-1, 1], dtype=np.int8), size=(n, bits))


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(1, 200),
    n_q=st.integers(1, 9),
    n_db=st.integers(1, 13),
    seed=st.integers(0, 2**16),
)
def test_popcount_distances_equal_the_inner_product_formula(bits, n_q, n_db, seed):
    q = random_codes(n_q, bits, seed)
    db = random_codes(n_db, bits, seed + 1)
    expected = (bits - q.astype(np.int64) @ db.T.astype(np.int64)) // 2
    assert np.array_equal(hamming_distances(q, db), expected)
    # every packed form gives the same distances
    for dtype in ("uint8", "uint16", "uint32", "uint64"):
        dist = hamming_distances(pack_codes(q, dtype), pack_codes(db, dtype), bits=bits)
        assert np.array_equal(dist, expected)


@pytest.mark.parametrize("bits", [1, 7, 8, 12, 24, 33, 64, 65, 130])
def test_pack_unpack_round_trip_and_storage_size(bits):
    codes = random_codes(20, bits)
    for dtype, width in (("uint8", 8), ("uint64", 64)):
        packed = pack_codes(codes, dtype)
        assert packed.dtype == np.dtype(dtype)
        assert packed.shape == (20, -(-bits // width))
        assert torch.equal(unpack_codes(packed, bits=bits), torch.from_numpy(codes))
    if bits == 64:
        assert pack_codes(codes, "uint64").nbytes == 20 * 8  # 8 bytes per 64-bit code
        assert as_packed_codes(codes).nbytes_per_code == 8


def test_uint8_and_uint64_layouts_agree_with_numpy_packbits():
    codes = random_codes(5, 70)
    as_bits = codes > 0
    assert np.array_equal(
        pack_codes(codes, "uint8"), np.packbits(as_bits, axis=1, bitorder="little")
    )
    words = pack_codes(codes, "uint64")
    bit_5 = (words[:, 0] >> np.uint64(5)) & np.uint64(1)
    bit_66 = (words[:, 1] >> np.uint64(2)) & np.uint64(1)
    assert np.array_equal(bit_5.astype(bool), as_bits[:, 5])
    assert np.array_equal(bit_66.astype(bool), as_bits[:, 66])


@pytest.mark.parametrize(
    "convert",
    [
        lambda c: c,  # int8 {-1, +1}
        lambda c: c.astype(np.float32),
        lambda c: torch.from_numpy(c).to(torch.float64),
        lambda c: torch.from_numpy(c).to(torch.bfloat16),
        lambda c: c > 0,  # bool
        lambda c: (c > 0).astype(np.int64),  # {0, 1}
        lambda c: torch.from_numpy((c > 0).astype(np.float32)),
    ],
)
def test_every_code_form_packs_to_the_same_bits(convert):
    codes = random_codes(6, 21)
    expected = as_packed_codes(codes)
    got = as_packed_codes(convert(codes))
    assert got.bits == 21 and np.array_equal(got.words, expected.words)


def test_all_zero_and_all_one_codes_are_unambiguous():
    zeros = np.zeros((2, 4), dtype=np.int8)  # {0, 1} codes: every bit is -1
    ones = np.ones((2, 4), dtype=np.int8)
    assert torch.equal(unpack_codes(as_packed_codes(zeros)), -torch.ones(2, 4, dtype=torch.int8))
    assert torch.equal(unpack_codes(as_packed_codes(ones)), torch.ones(2, 4, dtype=torch.int8))


@pytest.mark.parametrize(
    "codes, match",
    [
        (np.array([[1, -1, 0]]), r"mixes -1 and 0"),
        (np.array([[0.3, -0.2]]), r"binary codes in \{-1, \+1\} or \{0, 1\}.*0.3.*encode"),
        (np.array([[2, 0]]), r"values such as 2"),
        (np.array([[np.nan, 1.0]]), "NaN"),
        (np.array([1, -1]), "must be 2-D"),
        (np.zeros((3, 0)), "0 columns"),
        (np.array([["a", "b"]]), "numeric"),
    ],
)
def test_non_binary_codes_are_rejected_with_the_argument_named(codes, match):
    with pytest.raises(ValueError, match=match):
        as_packed_codes(codes, "query_codes")
    with pytest.raises(ValueError, match="query_codes"):
        as_packed_codes(codes, "query_codes")


def test_packed_input_is_checked_against_bits():
    packed = pack_codes(random_codes(4, 12), "uint8")  # 2 bytes per code
    assert as_packed_codes(packed, bits=12).bits == 12
    assert as_packed_codes(packed).bits == 16  # default: every bit of the words
    with pytest.raises(ValueError, match="2 uint8 words per code, but 20-bit codes take 3"):
        as_packed_codes(packed, "codes", bits=20)
    with pytest.raises(ValueError, match="bits set beyond bit 9"):
        as_packed_codes(packed, "codes", bits=9)  # bits 9..11 are data, not padding
    with pytest.raises(ValueError, match="`bits` must be a positive integer"):
        as_packed_codes(packed, bits=True)
    with pytest.raises(ValueError, match="bits=5 was passed"):
        as_packed_codes(random_codes(2, 4), bits=5)


def test_bit_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="`queries` has 12-bit codes but `database` has 16"):
        hamming_distances(random_codes(2, 12), random_codes(3, 16))


def test_packed_codes_object_and_chunking():
    codes = random_codes(50, 33, seed=3)
    packed = as_packed_codes(codes)
    assert isinstance(packed, PackedCodes) and len(packed) == 50
    full = hamming_distances(packed)
    assert np.array_equal(full, hamming_distances(codes, codes, chunk_size=7))
    assert np.array_equal(np.diag(full), np.zeros(50))
    assert np.array_equal(packed.rows(slice(3, 5)).words, packed.words[3:5])
    with pytest.raises(ValueError, match="chunk_size"):
        hamming_distances(codes, chunk_size=0)


def test_distance_dtype_widens_past_255_bits():
    codes = random_codes(3, 300)
    dist = hamming_distances(codes, -codes)
    assert dist.dtype == np.uint16 and (np.diag(dist) == 300).all()


def test_distances_of_packed_codes_of_different_word_types():
    q, db = random_codes(4, 70, seed=5), random_codes(9, 70, seed=6)
    expected = hamming_distances(q, db)
    for q_words in ("uint8", "uint16", "uint32", "uint64"):
        for db_words in ("uint8", "uint16", "uint32", "uint64"):
            got = hamming_distances(
                as_packed_codes(q).to(q_words), as_packed_codes(db).to(db_words)
            )
            assert np.array_equal(got, expected)


@pytest.mark.parametrize(
    "convert",
    [lambda c: torch.from_numpy(c).to(torch.uint8), lambda c: c.astype(np.uint8)],
    ids=["torch.uint8", "numpy.uint8"],
)
def test_unsigned_zero_one_codes_are_ambiguous_and_refused(convert):
    """12 columns of 0/1 bytes: 12-bit unpacked codes or 96-bit packed codes? Not guessed."""
    zero_one = convert((random_codes(5, 12) > 0).astype(np.uint8))
    with pytest.raises(ValueError, match=r"`query_codes`.*only 0 and 1.*bool.*bits=") as info:
        as_packed_codes(zero_one, "query_codes")
    assert len(str(info.value).splitlines()) == 1
    with pytest.raises(ValueError, match="only 0 and 1"):
        hamming_distances(zero_one)
    # intent stated: bool codes are 12-bit codes, an explicit `bits` reads packed words
    assert as_packed_codes(np.asarray(zero_one, dtype=bool)).bits == 12
    assert as_packed_codes(zero_one, bits=96).bits == 96
    # packed words with any value above 1 are unambiguous
    assert as_packed_codes(pack_codes(random_codes(5, 16), "uint8")).bits == 16
