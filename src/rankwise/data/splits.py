"""Seeded, class-stratified index splits for the retrieval protocols.

Validation split: Wen et al., NeurIPS 2022 (SOPRC), Sec. 6 "Datasets" -- the official test split
is kept and the rest is split 9:1 into training and validation data; the validation data is
evaluated leave-one-out, so every class that contributes to it contributes at least two samples
(a lone sample would be a query without a positive). Closed-set split: He et al., CVPR 2018
(tie-aware hashing), Sec. 5.1, CIFAR-10 "setting 1" -- 100 queries per class, the rest is the
database, 500 training images per class sampled from the database. Open-set validation
(:func:`class_holdout_split`): whole training classes are held out instead of samples, as the
test classes are, so model selection measures transfer to unseen classes (the class-disjoint
validation of Musgrave et al., "A Metric Learning Reality Check", ECCV 2020).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "VAL_HOLDOUTS",
    "stratified_split",
    "class_holdout_split",
    "split_validation",
    "ClosedSetIndices",
    "closed_set_split",
]

VAL_HOLDOUTS: tuple[str, ...] = ("samples", "classes")


def stratified_split(
    labels: np.ndarray, fraction: float, seed: int, min_per_class: int = 2
) -> tuple[np.ndarray, np.ndarray]:
    """Split sample indices into (kept, held_out) with about ``fraction`` of every class held out.

    Each class ``c`` with ``n_c`` samples has the quota ``fraction * n_c``. The integer part is
    held out when it reaches ``min_per_class``; remaining units are handed out to the classes
    with the largest unmet quota (random tie-breaks), one unit to a class that already holds
    samples out and ``min_per_class`` units to one that does not, until the total reaches
    ``round(fraction * N)``. A class never gives away all of its samples, and a class that
    contributes to the held-out part contributes at least ``min_per_class`` samples. So with
    small classes (Stanford Online Products: 2-12 images) a random subset of classes gives two
    samples each rather than every class giving a lone, positive-less sample.

    Args:
        labels: ``(N,)`` integer class ids.
        fraction: share of samples to hold out, in ``[0, 1)``.
        seed: seed of the ``numpy.random.Generator`` (same seed -> same split).
        min_per_class: smallest number of held-out samples of a class that contributes.

    Returns:
        ``(kept, held_out)``: sorted ``np.int64`` index arrays partitioning ``range(N)``.
    """
    labels = np.asarray(labels)
    if not 0.0 <= float(fraction) < 1.0:
        raise ValueError(f"`val_fraction` must be in [0, 1), got {fraction}.")
    if min_per_class < 1:
        raise ValueError(f"`min_per_class` must be >= 1, got {min_per_class}.")
    n = labels.shape[0]
    all_idx = np.arange(n, dtype=np.int64)
    if fraction == 0.0 or n == 0:
        return all_idx, np.empty(0, dtype=np.int64)
    rng = np.random.default_rng(seed)
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    quota = fraction * counts
    take = np.floor(quota).astype(np.int64)
    take[take < min_per_class] = 0
    take = np.minimum(take, counts - 1)
    remaining = int(round(fraction * n)) - int(take.sum())
    # Largest unmet quota first; the random permutation breaks ties reproducibly.
    order = rng.permutation(classes.size)
    order = order[np.argsort(-(quota - take)[order], kind="stable")]
    for c in order:
        if remaining <= 0:
            break
        step = 1 if take[c] > 0 else min_per_class
        if take[c] + step <= counts[c] - 1:
            take[c] += step
            remaining -= step
    held_out = []
    for c in range(classes.size):
        if take[c] == 0:
            continue
        members = all_idx[inverse == c]
        held_out.append(rng.choice(members, size=int(take[c]), replace=False))
    held = np.sort(np.concatenate(held_out)) if held_out else np.empty(0, dtype=np.int64)
    mask = np.ones(n, dtype=bool)
    mask[held] = False
    return all_idx[mask], held.astype(np.int64)


def class_holdout_split(
    labels: np.ndarray, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hold out whole classes (open-set validation) instead of samples of every class.

    ``max(2, round(fraction * C))`` of the ``C`` classes are held out, drawn at random among the
    classes with at least two samples (a held-out class is queried leave-one-out, so a lone
    sample would be a query without a positive); at least two classes stay for training.

    Args:
        labels: ``(N,)`` integer class ids.
        fraction: share of the classes to hold out, in ``(0, 1)``.
        seed: seed of the ``numpy.random.Generator`` (same seed -> same split).

    Returns:
        ``(kept, held_out, relabelled)``: sorted ``np.int64`` index arrays partitioning
        ``range(N)``, and ``(N,)`` new labels: the kept classes become ``0 .. K - 1`` (in the order
        of their ids) and the held-out ones ``K .. C - 1``, so training labels stay contiguous
        (per-class loss state is indexed by label) and never collide with labels ``>= C``.

    Raises:
        ValueError: ``fraction`` outside ``(0, 1)``, or too few classes to keep two and hold two
            out.
    """
    labels = np.asarray(labels)
    if not 0.0 < float(fraction) < 1.0:
        raise ValueError(
            f"`val_fraction` must be in (0, 1) to hold out classes, got {fraction}; it is the "
            "share of the training classes held out for validation."
        )
    classes, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    n_held = max(2, int(round(fraction * classes.size)))
    eligible = np.flatnonzero(counts >= 2)
    if classes.size - n_held < 2 or eligible.size < n_held:
        raise ValueError(
            f"val_holdout='classes' needs {n_held} held-out classes with >= 2 samples each and "
            f"2 classes left to train on, but the training split has {classes.size} classes "
            f"({eligible.size} with >= 2 samples); use val_holdout='samples' or a dataset with "
            "more classes."
        )
    rng = np.random.default_rng(seed)
    held_classes = np.zeros(classes.size, dtype=bool)
    held_classes[rng.choice(eligible, size=n_held, replace=False)] = True
    order = np.concatenate([np.flatnonzero(~held_classes), np.flatnonzero(held_classes)])
    new_id = np.empty(classes.size, dtype=np.int64)
    new_id[order] = np.arange(classes.size, dtype=np.int64)
    held_mask = held_classes[inverse]
    all_idx = np.arange(labels.shape[0], dtype=np.int64)
    return all_idx[~held_mask], all_idx[held_mask], new_id[inverse]


def split_validation(
    labels: np.ndarray, fraction: float, seed: int, holdout: str = "samples"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, str]:
    """Carve a validation split out of training labels, by samples or by classes.

    Args:
        labels: ``(N,)`` training class ids (``0 .. C - 1`` in every rankwise loader).
        fraction: share held out (of the samples, or of the classes); ``0`` -> no validation.
        seed: seed of the split.
        holdout: ``"samples"`` (:func:`stratified_split`: closed-set validation on the training
            classes) or ``"classes"`` (:func:`class_holdout_split`: open-set validation).

    Returns:
        ``(kept, held_out, labels, note)``: index arrays, the (possibly relabelled) ``(N,)``
        labels to use for both parts, and a human-readable description of the held-out part.
    """
    if holdout not in VAL_HOLDOUTS:
        raise ValueError(f"`val_holdout` must be one of {VAL_HOLDOUTS}, got {holdout!r}.")
    labels = np.asarray(labels)
    if holdout == "samples" or float(fraction) == 0.0:
        kept, held = stratified_split(labels, fraction, seed)
        note = (
            f"val: {held.size} of {labels.size} training samples held out (stratified, "
            f"{np.unique(labels[held]).size} classes, seed {seed}); evaluated leave-one-out"
        )
        return kept, held, labels, note
    kept, held, relabelled = class_holdout_split(labels, fraction, seed)
    n_classes = np.unique(labels).size
    note = (
        f"val (open-set): {np.unique(labels[held]).size} of {n_classes} training classes held "
        f"out with all their {held.size} samples (seed {seed}); the model never trains on them; "
        "evaluated leave-one-out"
    )
    return kept, held, relabelled, note


@dataclass(frozen=True)
class ClosedSetIndices:
    """Index arrays of a closed-set split.

    ``query`` indexes the query pool; ``query_rest`` are the other query-pool samples, which join
    the database: the database is ``concatenate([database_pool, query_pool[query_rest]])`` and
    ``train`` indexes that database (the hashing protocol trains on database images).
    """

    query: np.ndarray
    query_rest: np.ndarray
    train: np.ndarray


def _per_class_sample(
    labels: np.ndarray,
    candidates: np.ndarray,
    n_per_class: int | None,
    rng: np.random.Generator,
    what: str,
) -> np.ndarray:
    if n_per_class is None:
        return np.sort(candidates)
    if int(n_per_class) < 1:
        raise ValueError(f"`{what}` must be a positive integer or None (all), got {n_per_class}.")
    picked = []
    for c in np.unique(labels[candidates]):
        members = candidates[labels[candidates] == c]
        if members.size < n_per_class:
            raise ValueError(
                f"class {int(c)} has only {members.size} samples available but `{what}`="
                f"{n_per_class} were requested; lower `{what}`."
            )
        picked.append(rng.choice(members, size=int(n_per_class), replace=False))
    return np.sort(np.concatenate(picked)).astype(np.int64)


def closed_set_split(
    query_pool_labels: np.ndarray,
    database_pool_labels: np.ndarray,
    n_query: int | None,
    n_train: int | None,
    seed: int,
) -> ClosedSetIndices:
    """Sample a closed-set (hashing) split.

    ``n_query`` queries per class are drawn from the query pool (``None``: the whole pool); the
    query pool's other samples join the database pool to form the database; ``n_train`` training
    samples per class are drawn from the database (``None``: the whole database). Indices into the
    database refer to the concatenation ``[database pool, unused query-pool samples]``.

    Args:
        query_pool_labels: ``(Nq,)`` labels of the pool queries are drawn from (a test split).
        database_pool_labels: ``(Nd,)`` labels of the pool that is entirely database (a train
            split); may be empty.
        n_query: queries per class, or ``None`` for all.
        n_train: training samples per class, or ``None`` for all.
        seed: seed of the generator.

    Returns:
        :class:`ClosedSetIndices`.
    """
    rng = np.random.default_rng(seed)
    q_labels = np.asarray(query_pool_labels)
    query = _per_class_sample(q_labels, np.arange(q_labels.size), n_query, rng, "n_query")
    unused = np.setdiff1d(np.arange(q_labels.size), query)
    db_labels = np.concatenate([np.asarray(database_pool_labels), q_labels[unused]])
    database = np.arange(db_labels.size, dtype=np.int64)
    if db_labels.size == 0:
        raise ValueError("the database is empty: `n_query=None` used every sample as a query.")
    train = _per_class_sample(db_labels, database, n_train, rng, "n_train")
    return ClosedSetIndices(query=query, query_rest=unused.astype(np.int64), train=train)
