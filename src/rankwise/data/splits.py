"""Seeded, class-stratified index splits for the retrieval protocols.

Validation split: Wen et al., NeurIPS 2022 (SOPRC), Sec. 6 "Datasets" -- the official test split
is kept and the rest is split 9:1 into training and validation data; the validation data is
evaluated leave-one-out, so every class that contributes to it contributes at least two samples
(a lone sample would be a query without a positive). Closed-set split: He et al., CVPR 2018
(tie-aware hashing), Sec. 5.1, CIFAR-10 "setting 1" -- 100 queries per class, the rest is the
database, 500 training images per class sampled from the database.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["stratified_split", "ClosedSetIndices", "closed_set_split"]


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
        n_query, n_train: per-class counts, or ``None`` for all.
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
