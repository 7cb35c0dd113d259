"""Stratified validation split and closed-set (hashing) split, checked by counting."""

import numpy as np
import pytest

from rankwise.data import closed_set_split, stratified_split


def _class_counts(labels):
    classes, counts = np.unique(labels, return_counts=True)
    return dict(zip(classes.tolist(), counts.tolist(), strict=True))


def test_stratified_split_large_classes_proportional():
    labels = np.repeat(np.arange(5), [100, 200, 50, 80, 170])
    kept, held = stratified_split(labels, 0.1, seed=3)
    assert np.array_equal(np.sort(np.concatenate([kept, held])), np.arange(labels.size))
    assert held.size == round(0.1 * labels.size)
    counts = _class_counts(labels[held])
    for c, n in zip(range(5), [100, 200, 50, 80, 170], strict=True):
        assert abs(counts[c] - 0.1 * n) < 1.0  # each class within one sample of its share


def test_stratified_split_small_classes_give_two_or_none():
    rng = np.random.default_rng(0)
    sizes = rng.integers(2, 13, size=300)  # SOP-like: 2-12 images per class
    labels = np.repeat(np.arange(300), sizes)
    kept, held = stratified_split(labels, 0.1, seed=0)
    held_counts = _class_counts(labels[held])
    kept_counts = _class_counts(labels[kept])
    assert all(n >= 2 for n in held_counts.values())  # every val query has a positive
    assert set(kept_counts) == set(range(300))  # no class leaves the training set
    assert abs(held.size - 0.1 * labels.size) <= 2


def test_stratified_split_is_deterministic_and_seeded():
    labels = np.repeat(np.arange(10), 30)
    a = stratified_split(labels, 0.2, seed=1)
    b = stratified_split(labels, 0.2, seed=1)
    c = stratified_split(labels, 0.2, seed=2)
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[0], b[0])
    assert not np.array_equal(a[1], c[1])


def test_stratified_split_zero_fraction_and_bad_fraction():
    labels = np.arange(6) % 2
    kept, held = stratified_split(labels, 0.0, seed=0)
    assert held.size == 0 and kept.tolist() == list(range(6))
    with pytest.raises(ValueError, match="val_fraction"):
        stratified_split(labels, 1.0, seed=0)


def test_closed_set_split_counts_and_disjointness():
    test_labels = np.repeat(np.arange(4), 10)
    train_labels = np.repeat(np.arange(4), 20)
    idx = closed_set_split(test_labels, train_labels, n_query=3, n_train=5, seed=0)
    assert _class_counts(test_labels[idx.query]) == {0: 3, 1: 3, 2: 3, 3: 3}
    assert np.intersect1d(idx.query, idx.query_rest).size == 0
    assert np.union1d(idx.query, idx.query_rest).tolist() == list(range(40))
    database_labels = np.concatenate([train_labels, test_labels[idx.query_rest]])
    assert database_labels.size == 80 + 28
    assert _class_counts(database_labels[idx.train]) == {0: 5, 1: 5, 2: 5, 3: 5}
    assert np.unique(idx.train).size == idx.train.size
    with pytest.raises(ValueError, match="n_query"):
        closed_set_split(test_labels, train_labels, n_query=11, n_train=5, seed=0)


def test_closed_set_split_setting_two_uses_everything():
    test_labels = np.repeat(np.arange(3), 4)
    train_labels = np.repeat(np.arange(3), 6)
    idx = closed_set_split(test_labels, train_labels, n_query=None, n_train=None, seed=0)
    assert idx.query.tolist() == list(range(12)) and idx.query_rest.size == 0
    assert idx.train.tolist() == list(range(18))
