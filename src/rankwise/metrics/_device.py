"""The device-resident chunk loop of exact retrieval evaluation (the ``backend="torch"`` path).

One loop, the same code on every device. Each chunk of ``B`` query rows against the ``N`` gallery
items runs a fixed sequence of torch operations whatever the rows, the dimension, the relevant
items or the ties, with no host synchronisation (no ``.item()``, ``nonzero``, ``unique``,
boolean-mask indexing, numpy or numba):

1. the score block (one matmul: exact values, or the float64 approximation of
   :mod:`rankwise.metrics._scores` with its error bound), the excluded item set to -inf, and
   **one ascending sort of each row** (``torch.sort``, the only primitive that differs between
   devices, inside torch);
2. the relevance of the sorted items (the gallery labels gathered in sorted order) and its
   cumulative count ``E`` along the row;
3. the j-th relevant item of each query found by ``searchsorted`` in ``E`` (a (B, W) layout, W the
   most relevant items of a query in the chunk, known on the host), its value, and its
   **window** — the sorted positions whose value lies within twice the error bound of its own
   (the run of equal values when the values are exact) — by two ``searchsorted`` in the sorted
   row; ``E`` at the window's ends gives the relevant items above and inside it. These are the
   counts of He et al., "Hashing as Tie-Aware Learning to Rank" (CVPR 2018), Prop. 1:
   ``N_{d-1}, n_d, n^+_d`` and ``N^+_{d-1}``;
4. one scatter puts each tie group's counts at slot ``N^+_{d-1}`` of a (W, B) table, so a query's
   groups sit in decreasing score order from slot 0 (the relevant items of one group all write
   the same values to the same slot); :func:`rankwise.metrics.ranking.group_terms` evaluates
   every closed form there and a cumulative sum over the slots adds them up per query in that
   order — the order in which the numba backend adds them, so both give the same bits;
5. the per-query sums, the counts of each query's best group (recall@k) and, for approximate
   values, the number of near-tied pairs of each query go to one buffer on the device, read back
   once per call.

Near ties. With approximate values, a relevant item whose window holds other items cannot be
placed without exact keys, unless they are all copies of its own row (equal rows, equal keys: the
window is then its tie group). :func:`gallery_row_copies` counts every gallery row's copies once,
before the loop, and a window holds nothing but copies when its width is that count (less one if
the excluded item is a copy), so copies (a collapsed model, a few rows repeated) cost the main
loop only. The main loop counts the (relevant item, window item) pairs of the other windows per
query; after the read-back, the queries that have any go through three more loops, each its own
fixed sequence of kernels per chunk (sizes planned on the host from those counts):

* the **window loop** sorts their rows again (steps 1-3), stores every relevant slot's window
  counts in a per-batch slot store and enumerates one range of the rows' pairs into a pair
  buffer (cumulative sum of the window widths and ``searchsorted`` of the pair numbers: no
  compaction sync), and writes the rows' number of pairs for the host's overflow check;
* after each window chunk, the **pair loop** gives every chunk of that buffer its exact keys
  (:func:`rankwise.similarity.transposed_pair_keys`, a constant number of kernels whatever the
  dimension) and adds, per slot, the items whose key is strictly above or below the item's own
  (``index_add_`` of integers);
* the **group loop** reads the stored windows shrunk by those moves and runs steps 4-5.

A row chunk whose pair buffer was short reruns its batch (checked once, after the loops, with the
results). With the float64 approximation (bound about 1e-13) random float embeddings essentially
never need the pass, nor do exact copies; near copies a few ulps apart do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F

from ..similarity import transposed_pair_keys
from ._scores import LoopOperands
from .ranking import group_terms

__all__ = [
    "BYTES_PER_SCORE",
    "CHUNK_RECORD",
    "DeviceProblem",
    "memory_budget",
    "plan_chunks",
    "run_metrics",
    "run_pr_curve",
]

# Names of the profiler ranges around each chunk and around the read-back (torch.profiler, and
# rankwise._dispatch_count, which counts the operations of each chunk).
CHUNK_RECORD = "rankwise.retrieval.chunk"
WINDOW_RECORD = "rankwise.retrieval.near_tie_window"
PAIRS_RECORD = "rankwise.retrieval.near_tie_pairs"
GROUP_RECORD = "rankwise.retrieval.near_tie_groups"
READBACK_RECORD = "rankwise.retrieval.readback"

# Memory plan. Bytes per score of a chunk's block while it is processed: the float64 block (8),
# the sorted values and their int64 order (16), the sort's workspace (up to 16 more on CUDA), the
# sorted labels (4), the relevance (1), its two int32 cumulative counts (8), slack (11).
BYTES_PER_SCORE = 64
# Bytes per (query, relevant slot): the (B, W) item tensors and the (W, B) group table, plus per
# cut-off the float64 closed-form temporaries (those of P@k and of DCG@k).
BYTES_PER_SLOT = 256
BYTES_PER_SLOT_AND_CUTOFF = 96
# Bytes per near-tied pair, per embedding dimension: the two keys' gathered float64 rows, their
# products and partial sums; plus the pair's own indices.
BYTES_PER_PAIR_DIM = 80
BYTES_PER_PAIR = 256
# The near-tie pass sizes each row chunk's pair buffer from the main loop's counts with this
# margin, plus this many pairs.
PAIR_SLACK = 1.25
PAIR_PAD = 64
# Near-tie pass: bytes per stored relevant slot (its window, moves, own column and query: 4 + 4
# + 1 + 1 int64, with slack) and per pair of the buffer (slot, column and relevance, plus the
# window chunk's int64 temporaries of each pair it enumerates). Row chunks of that pass get half
# the budget, the slot store and the pair buffer a quarter each.
BYTES_PER_STORED_SLOT = 96
BYTES_PER_STORED_PAIR = 80
# The budget: on CUDA a fraction of the free memory, capped; elsewhere a fraction of the available
# RAM, capped (larger CPU chunks were not faster: the sort and the gathers run out of cache).
CUDA_MEMORY_FRACTION = 0.5
CUDA_MEMORY_CAP = 4 * 2**30
HOST_MEMORY_FRACTION = 0.25
HOST_MEMORY_CAP = 256 * 2**20


def _available_ram() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if hasattr(os, "sysconf"):
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError):
            return None
    return None


def memory_budget(device: torch.device) -> int:
    """Bytes one chunk may use on ``device`` (read once, on the host, before the loop)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(1, min(CUDA_MEMORY_CAP, int(free * CUDA_MEMORY_FRACTION)))
    available = _available_ram()
    if available is None:
        return HOST_MEMORY_CAP
    return max(1, min(HOST_MEMORY_CAP, int(available * HOST_MEMORY_FRACTION)))


def plan_chunks(
    n_relevant: np.ndarray, n_gallery: int, n_cutoffs: int, chunk_size: int | None, budget: int
) -> list[tuple[int, int, int]]:
    """(first row, last row + 1, W) of every chunk, W the most relevant items of one of its rows.

    ``chunk_size`` rows per chunk when given; otherwise as many rows as fit ``budget`` bytes at
    :data:`BYTES_PER_SCORE` per score and the slot costs per relevant item of the widest query.
    """
    n_q = int(n_relevant.shape[0])
    if chunk_size is None:
        widest = int(n_relevant.max()) if n_q else 0
        per_row = n_gallery * BYTES_PER_SCORE + widest * (
            BYTES_PER_SLOT + n_cutoffs * BYTES_PER_SLOT_AND_CUTOFF
        )
        chunk_size = max(1, min(n_q, budget // max(per_row, 1)))
    out = []
    for lo in range(0, n_q, chunk_size):
        hi = min(n_q, lo + chunk_size)
        out.append((lo, hi, max(int(n_relevant[lo:hi].max()), 1)))
    return out


@dataclass
class DeviceProblem:
    """Everything the loop reads for a set of query rows, on the device, built before the loop.

    Attributes:
        operands: the score blocks (:class:`rankwise.metrics._scores.LoopOperands`).
        n_gallery: gallery items N (a query's excluded item, if any, included).
        gallery_labels: (N,) int32 class ids, or (C, N) float32 multi-hot transposed.
        query_labels: (n_q, 1) int32 class ids (-1: a class absent from the gallery), or (n_q, C)
            float32 multi-hot.
        self_column: (n_q, 1) int64 excluded gallery column (0 where none), or None.
        self_fill: (n_q, 1) -inf where a column is excluded, +inf where not (a no-op ``amin``).
        offset: (n_q, 1) int32, 1 where the excluded item is relevant (it sorts first).
        n_relevant_column: (n_q, 1) int32 relevant items of each query (the excluded one not).
        relevant_total: (n_q, 1) int64 relevant items of the sorted row, the excluded one included.
        cut: (C, 1, n_q) float64 cut-offs of :func:`rankwise.metrics.ranking.group_terms`.
        n_relevant: (n_q,) int64 on the host: relevant items of each query (excluded one not).
        columns: (n_q,) int64 columns of the per-call buffer these rows fill, or None (row i
            fills column i).
        need: (L, n_q) int64 for PR curves: the slot of each recall level (:func:`pr_terms`).
        gallery_rows: (N, 2) int64 for approximate values, else None: the copies of each gallery
            item's exact row in the gallery and the row's id (:func:`gallery_row_copies`).
        self_row: (n_q, 1) int64 row id of the excluded item (-1 where none), with
            ``gallery_rows`` and an excluded item; else None.
    """

    operands: LoopOperands
    n_gallery: int
    gallery_labels: torch.Tensor
    query_labels: torch.Tensor
    self_column: torch.Tensor | None
    self_fill: torch.Tensor | None
    offset: torch.Tensor
    n_relevant_column: torch.Tensor
    relevant_total: torch.Tensor
    cut: torch.Tensor
    n_relevant: np.ndarray
    columns: torch.Tensor | None = None
    need: torch.Tensor | None = None
    gallery_rows: torch.Tensor | None = None
    self_row: torch.Tensor | None = None

    @property
    def multi_hot(self) -> bool:
        """True for multi-hot labels."""
        return self.gallery_labels.ndim == 2

    def rows(self, index: np.ndarray) -> DeviceProblem:
        """The same problem for the query rows ``index`` (host int64), writing their columns."""
        idx = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(self.cut.device)
        return replace(
            self,
            operands=self.operands.rows(idx),
            query_labels=self.query_labels[idx],
            self_column=None if self.self_column is None else self.self_column[idx],
            self_fill=None if self.self_fill is None else self.self_fill[idx],
            offset=self.offset[idx],
            n_relevant_column=self.n_relevant_column[idx],
            relevant_total=self.relevant_total[idx],
            cut=self.cut[:, :, idx],
            n_relevant=self.n_relevant[index],
            columns=idx if self.columns is None else self.columns[idx],
            need=None if self.need is None else self.need[:, idx],
            self_row=None if self.self_row is None else self.self_row[idx],
        )


def gallery_row_copies(gallery: torch.Tensor) -> torch.Tensor:
    """(N, 2) int64: how often each gallery item's row occurs in ``gallery``, and the row's id.

    Rows are equal when their entries are (``-0.0`` and ``0.0`` alike: every key of them is then
    the same float64 number). Built once per call, before the loop (``torch.unique`` of the rows'
    bits), so identical items need no pair of exact keys: see :func:`_mixed_windows`.

    Args:
        gallery: (N, d) float64 rows the exact keys are computed from.
    """
    bits = (gallery + 0.0).contiguous().view(torch.int64)  # + 0.0: -0.0 becomes 0.0
    _, row, copies = torch.unique(bits, dim=0, return_inverse=True, return_counts=True)
    return torch.stack([copies[row], row], dim=1)


@dataclass
class _Consts:
    """Per-call constants of the loop, on the device."""

    ar1: torch.Tensor  # (1, W) int32 1, 2, ..., W
    slot_plus_one: torch.Tensor  # (W, 1) float64 1, 2, ..., W
    slot: torch.Tensor  # (W, 1) int64 0, 1, ..., W - 1
    default: torch.Tensor  # (4, 1, 1) float64 raw counts of an empty slot
    table: torch.Tensor  # (N + 1, 2) float64 harmonic numbers
    signs: torch.Tensor  # (4, 1, 1) int64: how the pair moves shift start, end, E(start), E(end)

    @staticmethod
    def build(widest: int, table: torch.Tensor) -> _Consts:
        device = table.device
        ar = torch.arange(widest, device=device)
        default = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64, device=device)
        return _Consts(
            (ar + 1).to(torch.int32)[None],
            (ar + 1).to(torch.float64)[:, None],
            ar[:, None],
            default[:, None, None],
            table,
            torch.tensor([1, -1, 1, -1], device=device)[:, None, None],
        )


def _relevance(prob: DeviceProblem, order: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """(B, N) bool relevance of the sorted items (2 ops; 3 for multi-hot labels)."""
    if prob.multi_hot:
        return ((prob.query_labels[lo:hi] @ prob.gallery_labels) > 0).gather(1, order)
    # index_select of the flat order: the same gather as gallery_labels[order], without advanced
    # indexing's per-element index arithmetic (a third of its time on the CPU)
    labels = prob.gallery_labels.index_select(0, order.view(-1)).view(order.shape)
    return labels == prob.query_labels[lo:hi]


@dataclass
class _Items:
    """The (B, W) relevant items of a chunk: sorted position and window, the sorted rows."""

    pos: torch.Tensor  # sorted position of the j-th relevant item (ascending order)
    raw: torch.Tensor  # (4, B, W) int64: window start, end, E at the start, E at the end
    order: torch.Tensor  # (B, N) gallery column of each sorted position
    relevant: torch.Tensor  # (B, N) bool relevance of each sorted position


def _items(prob: DeviceProblem, c: _Consts, lo: int, hi: int, width: int) -> _Items:
    """Steps 1-3 of the module docstring: sort, relevance, windows and their counts."""
    scores = prob.operands.block(lo, hi)
    if prob.self_column is not None:
        assert prob.self_fill is not None
        scores.scatter_reduce_(1, prob.self_column[lo:hi], prob.self_fill[lo:hi], "amin")
    values, order = torch.sort(scores, dim=1)
    del scores
    relevant = _relevance(prob, order, lo, hi)
    count = torch.cumsum(relevant, dim=1, dtype=torch.int32)  # relevant items at <= position
    before = F.pad(count, (1, 0))  # E: relevant items before each position, (B, N + 1)
    # the j-th relevant item (after the excluded one when it is relevant: it sorts first); past a
    # query's last one, its last one again (those slots write the same values twice). The
    # position of the m-th relevant item is the first with `count` >= m.
    wanted = torch.minimum(c.ar1[:, :width], prob.n_relevant_column[lo:hi]) + prob.offset[lo:hi]
    pos = torch.searchsorted(count, wanted)
    value = values.gather(1, pos)
    # searchsorted and gather write into the rows of raw: no stack of four (B, W) tensors
    raw = torch.empty((4, *pos.shape), dtype=torch.int64, device=pos.device)
    if prob.operands.exact:  # the window is the run of equal values (half window 0: no ops)
        torch.searchsorted(values, value, out=raw[0])
        torch.searchsorted(values, value, right=True, out=raw[1])
    else:
        half = prob.operands.half_window[lo:hi, None]
        torch.searchsorted(values, value - half, out=raw[0])
        torch.searchsorted(values, value + half, right=True, out=raw[1])
    # E at both ends in one gather (the two index rows read the same row of E; int32 like E)
    raw[2:].copy_(before.expand(2, *before.shape).gather(2, raw[:2]))
    return _Items(pos, raw, order, relevant)


def _mixed_windows(
    prob: DeviceProblem, own: torch.Tensor, window: torch.Tensor, lo: int
) -> torch.Tensor:
    """(B, W) bool: the window holds an item that is not a copy of its relevant item's row.

    Copies of the row have the item's exact key, so a window of nothing but copies is its tie
    group and needs no pair. Every copy lies in the window (equal keys: values within twice the
    bound) but the excluded item (sorted first); so the window holds only copies exactly when its
    width is the row's copies in the gallery, less one when the excluded item is a copy. 2
    kernels (4 with an excluded item), on (B, W) tensors: no pass over the (B, N) row.

    Args:
        prob: the problem, with ``gallery_rows``.
        own: (B, W) gallery column of each relevant slot's item.
        window: (B, W) window widths.
        lo: the first query row of the chunk.
    """
    assert prob.gallery_rows is not None
    copies, row = prob.gallery_rows[own].unbind(-1)
    if prob.self_row is not None:
        window = window + (row == prob.self_row[lo : lo + own.shape[0]])
    return window != copies


def _paired(
    prob: DeviceProblem, c: _Consts, own: torch.Tensor, window: torch.Tensor, lo: int
) -> torch.Tensor:
    """(B, W) bool: the slots whose windows need pairs of exact keys.

    The query's real slots (not the repeats of its last relevant item) whose window holds
    another item than copies of the item's own row (without ``gallery_rows``: any other item).
    """
    real = c.ar1[:, : window.shape[1]] <= prob.n_relevant_column[lo : lo + window.shape[0]]
    if prob.gallery_rows is None:
        return real & (window > 1)
    return real & _mixed_windows(prob, own, window, lo)


def _pair_counts(
    prob: DeviceProblem, c: _Consts, items: _Items, lo: int, out: torch.Tensor
) -> None:
    """The (B,) near-tied (relevant item, window item) pairs of each query, to out's last row.

    Windows of :func:`_paired` slots: the near-tie pass sizes its pair buffers from these counts.
    """
    window = items.raw[1] - items.raw[0]
    own = items.order.gather(1, items.pos)
    pairs = window * _paired(prob, c, own, window, lo)
    if prob.columns is None:  # summed straight into the buffer (no copy)
        torch.sum(pairs, 1, dtype=out.dtype, out=out[-1, lo : lo + pairs.shape[0]])
    else:
        _write(prob, out, out.shape[0] - 1, lo, pairs.sum(1)[None])


def _group_table(
    prob: DeviceProblem,
    c: _Consts,
    raw: torch.Tensor,
    lo: int,
    hi: int,
    valid: torch.Tensor | None = None,
):
    """Step 4: (g, n, r, g + n) (W, B) float64 of each group at slot N^+_{d-1}, and the table.

    The table has a spare slot W, where slots not ``valid`` are sent.
    """
    width = raw.shape[2]
    slot = prob.relevant_total[lo:hi] - raw[3]  # relevant items above the group
    if valid is not None:
        slot = torch.where(valid, slot, width)
    table = c.default.expand(4, width + 1, hi - lo).clone()
    table.scatter_(1, slot.T.expand(4, width, hi - lo), raw.transpose(1, 2).to(torch.float64))
    gn, g = prob.n_gallery - table[:2, :width]  # N - start = g + n, N - end = g (integers)
    n, r = table[1::2, :width] - table[0::2, :width]  # end - start, E(end) - E(start)
    return g, n, r, gn, table


def _write(prob: DeviceProblem, out: torch.Tensor, first: int, lo: int, values: torch.Tensor):
    """out[first : first + len(values), the columns of rows lo..] = values (one copy)."""
    rows = out[first : first + values.shape[0]]
    if prob.columns is None:
        rows[:, lo : lo + values.shape[1]].copy_(values)
    else:
        rows.index_copy_(1, prob.columns[lo : lo + values.shape[1]], values.to(out.dtype))


# What a loop does with a chunk's raw counts: evaluate its closed forms and write them to the
# per-call buffer. Arguments: problem, constants, buffer, lo, hi, raw (4, B, W), valid (B, W) or
# None (every slot may be written).
Finish = Callable[
    [DeviceProblem, _Consts, torch.Tensor, int, int, torch.Tensor, "torch.Tensor | None"], None
]


def _metric_finish(ties: str) -> Finish:
    """Step 4 and 5 of the metrics: closed forms, sums in slot order, the best group's counts.

    With the discount table in the constants' table (:func:`run_metrics`) the sums hold the DCG@k
    rows of :func:`~rankwise.metrics.ranking.group_terms` too (NDCG@k).
    """

    def finish(prob, c, out, lo, hi, raw, valid) -> None:
        width = raw.shape[2]
        g, n, r, gn, table = _group_table(prob, c, raw, lo, hi, valid)
        terms = group_terms(
            g, n, r, c.slot_plus_one[:width], prob.cut[:, :, lo:hi], ties, c.table, 2, gn
        )
        sums = terms.cumsum(1)[:, -1]  # in slot order: decreasing score
        _write(prob, out, 0, lo, sums)
        _write(prob, out, sums.shape[0], lo, table[:, 0])

    return finish


def _pr_finish(ties: str) -> Finish:
    """Step 4 and 5 of the PR curves: every query's interpolated precision at each level."""

    def finish(prob, c, out, lo, hi, raw, valid) -> None:
        width = raw.shape[2]
        g, n, r, _, _ = _group_table(prob, c, raw, lo, hi, valid)
        n_rel = prob.n_relevant_column[lo:hi].T
        assert prob.need is not None
        curve = pr_terms(g, n, r, c.slot[:width], n_rel, prob.need[:, lo:hi], ties)
        _write(prob, out, 0, lo, curve)

    return finish


def _main_chunk(
    prob: DeviceProblem, c: _Consts, out: torch.Tensor, lo: int, hi: int, width: int, finish
) -> None:
    """One chunk of the main loop: steps 1-5; with approximate values, the near-tied pairs too."""
    items = _items(prob, c, lo, hi, width)
    finish(prob, c, out, lo, hi, items.raw, None)
    if not prob.operands.exact:
        _pair_counts(prob, c, items, lo, out)


def pr_terms(
    g: torch.Tensor,
    n: torch.Tensor,
    r: torch.Tensor,
    slot: torch.Tensor,
    n_relevant: torch.Tensor,
    need: torch.Tensor,
    ties: str,
) -> torch.Tensor:
    """(L, B) interpolated precision of each query at each recall level, from its group table.

    The i-th relevant item (slot i - 1) of a group of n items holding r relevant ones, g above,
    sits at position g + j (optimistic), g + n - r + j (pessimistic) or, expected, g + j (n + 1) /
    (r + 1) (the mean of the j-th order statistic), j its rank in the group; its precision is
    i / position. The curve at a recall level is the largest precision at or after the item
    ``need`` (0-based) of that level (SOPRC paper, Fig. 2).

    Args:
        g: (W, B) float64 items above each group, at the group's first slot (empty: r = 0).
        n: (W, B) float64 group sizes.
        r: (W, B) float64 relevant items of each group.
        slot: (W, 1) int64 0, 1, ..., W - 1.
        n_relevant: (1, B) int64 relevant items of each query (slots past it are unused).
        need: (L, B) int64 slot whose suffix maximum is each level's precision.
        ties: the tie handling.
    """
    first = torch.where(r > 0, slot, 0).cummax(0).values  # the group of every slot
    gf, nf, rf = torch.stack([g, n, r]).gather(1, first.expand(3, *first.shape))
    j = (slot - first + 1).to(torch.float64)
    if ties == "expected":
        position = gf + j * (nf + 1) / (rf + 1)
    elif ties == "optimistic":
        position = gf + j
    else:
        position = gf + nf - rf + j
    precision = torch.where(slot < n_relevant, (slot + 1) / position, 0.0)
    best_after = precision.flip(0).cummax(0).values.flip(0)
    return torch.where(n_relevant > 0, best_after.gather(0, need), 0.0)


# ---------------------------------------------------------------------------------------------
# The near-tie pass: three loops over the queries the main loop flagged
# ---------------------------------------------------------------------------------------------


@dataclass
class _SlotStore:
    """The relevant slots of a batch of near-tied queries, and a pair buffer, on the device.

    Slot ``start[i] + j`` holds the j-th relevant item of the batch's i-th query (the excluded
    item not counted); slot S (the last) is a spare where padding and repeats are sent. Every
    size is known on the host before the loops: S from the relevant counts, the pair buffer from
    the main loop's pair counts.
    """

    start: torch.Tensor  # (rows of the batch, 1) int64 first slot of each query
    raw: torch.Tensor  # (4, S + 1) int64 window start, end, E at both (from the sorted rows)
    moves: torch.Tensor  # (4, S + 1) int64 pairs whose key moves the item out of its window
    own: torch.Tensor  # (S + 1,) int64 gallery column of the slot's relevant item
    query: torch.Tensor  # (S + 1,) int64 column of the exact-key operands of its query
    pair_slot: torch.Tensor  # (P,) int64 the slot of each near-tied pair (S: padding)
    pair_other: torch.Tensor  # (P,) int64 gallery column of the pair's window item
    pair_relevant: torch.Tensor  # (P,) bool whether that item is relevant
    first_row: int  # the batch's first query row (of the flagged ones)

    @property
    def spare(self) -> int:
        """The spare slot S."""
        return int(self.own.shape[0]) - 1


def _slot_ids(
    prob: DeviceProblem, c: _Consts, store: _SlotStore, lo: int, hi: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, W) store slot of every relevant slot of rows lo..hi, and (B, W) bool of the real ones.

    Slots past a query's last relevant item (repeats of it) get the spare slot. 3 kernels.
    """
    invalid = c.ar1[:, :width] > prob.n_relevant_column[lo:hi]
    first = store.start[lo - store.first_row : hi - store.first_row]
    ids = (first + c.slot[:width].T).masked_fill_(invalid, store.spare)
    return ids, ~invalid


def _window_chunk(
    prob: DeviceProblem,
    c: _Consts,
    store: _SlotStore,
    seen: torch.Tensor,
    chunk: tuple[int, int, int, int, int, int],
) -> None:
    """Window loop: sort rows lo..hi again, store their windows, enumerate pairs p0..p1.

    ``chunk`` is (lo, hi, W, p0, p1, k). The (relevant item, window item) pairs of the rows are
    numbered by the cumulative sum of their window widths; pair p's item is a ``searchsorted`` of
    p in that sum, its window member ``p - (sum before the item) + window start``: no compaction,
    no sync. Pairs p0..p1 - 1 go to the pair buffer's first p1 - p0 entries (those past the
    rows' last pair to the spare slot); the rows' number of pairs to ``seen[k]`` (the host
    checks it against the buffer after the loops).
    """
    lo, hi, width, p0, p1, k = chunk
    items = _items(prob, c, lo, hi, width)
    ids, _ = _slot_ids(prob, c, store, lo, hi, width)
    flat_ids = ids.view(-1)
    own = items.order.gather(1, items.pos)
    store.raw.index_copy_(1, flat_ids, items.raw.view(4, -1))
    store.own.index_copy_(0, flat_ids, own.view(-1))
    n_items = items.order.shape[1]
    n_slots = flat_ids.shape[0]
    start, end = items.raw[0], items.raw[1]
    window = end - start
    widths = (window * _paired(prob, c, own, window, lo)).view(-1)
    cum = torch.cumsum(widths, 0)
    seen[k : k + 1].copy_(cum[-1:])
    base = start.view(-1) - (cum - widths)  # position of pair p = p + base of its item
    pairs = torch.arange(p0, p1, device=cum.device)
    item = torch.searchsorted(cum, pairs, right=True)  # n_slots past the rows' last pair
    item_c = item.clamp_(max=n_slots - 1)
    member = (pairs + base.index_select(0, item_c)).clamp_(0, n_items - 1)
    flat = torch.div(item_c, width, rounding_mode="floor") * n_items + member
    m = p1 - p0
    slot = flat_ids.index_select(0, item_c).masked_fill_(pairs >= cum[-1], store.spare)
    store.pair_slot[:m].copy_(slot)
    store.pair_other[:m].copy_(items.order.view(-1).index_select(0, flat))
    store.pair_relevant[:m].copy_(items.relevant.view(-1).index_select(0, flat))


def _pair_chunk(
    store: _SlotStore, keys: tuple[int, torch.Tensor, torch.Tensor], a: int, b: int
) -> None:
    """Pair loop: exact keys of the buffer's pairs a..b - 1, and the moves they make.

    Each pair's two keys (the window item's and the relevant item's own) by
    :func:`rankwise.similarity.transposed_pair_keys` in a constant number of kernels; an item
    whose key is strictly below the relevant item's leaves the window's bottom (start + 1), one
    strictly above its top (end - 1), relevant ones move ``E`` alike. Integer ``index_add_``:
    the sums do not depend on the order of the additions.
    """
    code, q_t, g_t = keys
    slot = store.pair_slot[a:b]
    rows = store.query.index_select(0, slot)
    cols = torch.cat([store.pair_other[a:b], store.own.index_select(0, slot)])
    other, own = transposed_pair_keys(code, q_t, g_t, rows.repeat(2), cols).view(2, -1)
    above, below = other > own, other < own
    relevant = store.pair_relevant[a:b]
    moves = torch.stack([below, above, below & relevant, above & relevant])
    store.moves.index_add_(1, slot, moves.to(torch.int64))


def _group_chunk(
    prob: DeviceProblem,
    c: _Consts,
    store: _SlotStore,
    out: torch.Tensor,
    chunk: tuple[int, int, int],
    finish,
) -> None:
    """Group loop: the stored windows moved by their pairs, then the closed forms (no sort)."""
    lo, hi, width = chunk
    ids, valid = _slot_ids(prob, c, store, lo, hi, width)
    flat_ids = ids.view(-1)
    moved = store.moves.index_select(1, flat_ids) * c.signs[:, :, 0]
    raw = (store.raw.index_select(1, flat_ids) + moved).view(4, hi - lo, width)
    finish(prob, c, out, lo, hi, raw, valid)


@dataclass
class _NearTiePlan:
    """The near-tie pass planned on the host from the main loop's counts.

    Attributes:
        rows: (lo, hi, W) row chunks of the flagged queries (window and group loops).
        totals: pairs each row chunk's buffer holds (at least the rows' pairs; else rerun).
        batches: row chunks whose slots share one store (within the memory budget).
        pair_cap: most pairs one window chunk enumerates (the pair buffer's size).
        pairs_per_chunk: pairs one chunk of the pair loop gives keys.
    """

    rows: list[tuple[int, int, int]]
    totals: list[int]
    batches: list[list[int]]
    pair_cap: int
    pairs_per_chunk: int


def _plan_near_ties(
    sub: DeviceProblem, needed: np.ndarray, dim: int, chunk_size: int | None, budget: int
) -> _NearTiePlan:
    """Row chunks within half the budget, stores and pair buffers within a quarter each."""
    rows = plan_chunks(sub.n_relevant, sub.n_gallery, sub.cut.shape[0], chunk_size, budget // 2)
    totals = [int(np.ceil(needed[lo:hi].sum() * PAIR_SLACK)) + PAIR_PAD for lo, hi, _ in rows]
    per_pair = BYTES_PER_PAIR + BYTES_PER_PAIR_DIM * (dim + 1)
    slots = [int(sub.n_relevant[lo:hi].sum()) for lo, hi, _ in rows]
    batches: list[list[int]] = []
    used = 0
    for r, n in enumerate(slots):
        if not batches or used + n * BYTES_PER_STORED_SLOT > budget // 4:
            batches.append([])
            used = 0
        batches[-1].append(r)
        used += n * BYTES_PER_STORED_SLOT
    return _NearTiePlan(
        rows,
        totals,
        batches,
        max(1, budget // 4 // BYTES_PER_STORED_PAIR),
        max(1, budget // 4 // per_pair),
    )


def _new_store(
    sub: DeviceProblem, flagged: np.ndarray, plan: _NearTiePlan, batch: list[int]
) -> _SlotStore:
    """The store of one batch: sizes from the host counts, slots' queries sent in one copy."""
    first, last = plan.rows[batch[0]][0], plan.rows[batch[-1]][1]
    n_rel = sub.n_relevant[first:last]
    starts = np.concatenate([[0], np.cumsum(n_rel)])
    n_slots = int(starts[-1])
    device = sub.cut.device
    query = np.concatenate([np.repeat(flagged[first:last], n_rel), [0]])
    n_pairs = max(min(plan.totals[r], plan.pair_cap) for r in batch)

    def zeros(*shape: int, dtype=torch.int64) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    return _SlotStore(
        torch.from_numpy(starts[:-1, None].astype(np.int64)).to(device),
        zeros(4, n_slots + 1),
        zeros(4, n_slots + 1),
        zeros(n_slots + 1),
        torch.from_numpy(query.astype(np.int64)).to(device),
        zeros(n_pairs),
        zeros(n_pairs),
        zeros(n_pairs, dtype=torch.bool),
        first,
    )


@dataclass
class NearTieCounts:
    """Chunks of the three loops of the near-tie pass, and what it resolved."""

    window_chunks: int = 0
    pair_chunks: int = 0
    group_chunks: int = 0
    queries: int = 0
    pairs: int = 0


def _near_tie_batch(
    sub: DeviceProblem,
    c: _Consts,
    out: torch.Tensor,
    store: _SlotStore,
    plan: _NearTiePlan,
    batch: list[int],
    seen: torch.Tensor,
    keys: tuple[int, torch.Tensor, torch.Tensor],
    finish,
    counts: NearTieCounts,
) -> None:
    """The window loop (each chunk followed by the pair loop over its pairs), then the group loop.

    Every chunk of every loop is its own profiler range with a fixed sequence of kernels; the
    number of chunks is decided on the host from the plan.
    """
    for r in batch:
        lo, hi, width = plan.rows[r]
        for p0 in range(0, plan.totals[r], plan.pair_cap):
            p1 = min(plan.totals[r], p0 + plan.pair_cap)
            with torch.profiler.record_function(WINDOW_RECORD):
                _window_chunk(sub, c, store, seen, (lo, hi, width, p0, p1, r))
            counts.window_chunks += 1
            for a in range(0, p1 - p0, plan.pairs_per_chunk):
                with torch.profiler.record_function(PAIRS_RECORD):
                    _pair_chunk(store, keys, a, min(p1 - p0, a + plan.pairs_per_chunk))
                counts.pair_chunks += 1
    for r in batch:
        with torch.profiler.record_function(GROUP_RECORD):
            _group_chunk(sub, c, store, out, plan.rows[r], finish)
        counts.group_chunks += 1


def _near_ties(
    prob: DeviceProblem,
    c: _Consts,
    out: torch.Tensor,
    host: np.ndarray,
    flagged: np.ndarray,
    chunk_size: int | None,
    budget: int,
    pair_keys,
    finish,
) -> NearTieCounts:
    """Evaluate the ``flagged`` queries again with exact keys for their near-tied pairs.

    Their rows of ``host`` are replaced by what the pass writes to ``out``. The pass scores these
    rows in other blocks than the main loop did, and a matmul of another shape may round
    differently: its windows, hence its pairs, can differ slightly from the main loop's count.
    The window loop writes each row chunk's pairs to a device buffer read back with the results;
    a batch with a row chunk whose buffer was short runs again with that count (the same blocks,
    the same values), so the answer is never approximate.
    """
    assert prob.columns is None
    sub = prob.rows(flagged)
    keys = pair_keys()
    plan = _plan_near_ties(sub, host[-1, flagged], keys[1].shape[0] - 1, chunk_size, budget)
    seen = torch.zeros(len(plan.rows), dtype=torch.float64, device=out.device)
    counts = NearTieCounts(queries=int(flagged.size))
    todo, rounds = plan.batches, 0
    while todo:
        for batch in todo:
            store = _new_store(sub, flagged, plan, batch)
            _near_tie_batch(sub, c, out, store, plan, batch, seen, keys, finish, counts)
            del store
        with torch.profiler.record_function(READBACK_RECORD):
            cols = sub.columns
            assert cols is not None
            back = torch.cat([out.index_select(1, cols).view(-1), seen]).cpu().numpy()
        host[:, flagged] = back[: out.shape[0] * flagged.size].reshape(out.shape[0], -1)
        had = back[out.shape[0] * flagged.size :].astype(np.int64)
        rounds += 1
        short = {r for r, n in enumerate(had) if n > plan.totals[r]}
        for r in short:  # more margin at every further round, should a matmul not repeat itself
            plan.totals[r] = int(had[r] * (1 + (rounds - 1) * PAIR_SLACK))
        todo = [batch for batch in plan.batches if short.intersection(batch)]
    counts.pairs = int(had.sum())
    return counts


@dataclass
class LoopResult:
    """What one call read back (host) and how it ran.

    Attributes:
        values: (rows, n_q) float64 per-query buffer.
        chunks: chunks of the main loop.
        near_ties: chunks of the near-tie pass's three loops, the queries and pairs it resolved.
    """

    values: np.ndarray
    chunks: int
    near_ties: NearTieCounts = field(default_factory=NearTieCounts)

    @property
    def near_tie_queries(self) -> int:
        """Queries evaluated again with exact keys."""
        return self.near_ties.queries

    @property
    def near_tie_pairs(self) -> int:
        """(relevant item, window item) pairs given exact keys."""
        return self.near_ties.pairs


def _run(
    prob: DeviceProblem,
    table: torch.Tensor,
    n_out: int,
    chunk_size: int | None,
    budget: int,
    finish,
    pair_keys,
) -> LoopResult:
    """The main loop, the one read-back, and the near-tie pass over the queries that need it."""
    widest = max(int(prob.n_relevant.max()) if prob.n_relevant.size else 1, 1)
    consts = _Consts.build(widest, table)
    approximate = not prob.operands.exact
    n_rows = n_out + (1 if approximate else 0)
    out = torch.zeros(n_rows, prob.cut.shape[2], dtype=torch.float64, device=prob.cut.device)
    plan = plan_chunks(prob.n_relevant, prob.n_gallery, prob.cut.shape[0], chunk_size, budget)
    for lo, hi, width in plan:
        with torch.profiler.record_function(CHUNK_RECORD):
            _main_chunk(prob, consts, out, lo, hi, width, finish)
    with torch.profiler.record_function(READBACK_RECORD):
        host = out.cpu().numpy()
    flagged = np.flatnonzero(host[n_out] > 0) if approximate else np.zeros(0, dtype=np.int64)
    if not flagged.size:
        return LoopResult(host[:n_out], len(plan))
    near = _near_ties(prob, consts, out, host, flagged, chunk_size, budget, pair_keys, finish)
    return LoopResult(host[:n_out], len(plan), near)


def run_metrics(
    prob: DeviceProblem,
    ties: str,
    table: torch.Tensor,
    chunk_size: int | None,
    budget: int,
    pair_keys,
    discounts: torch.Tensor | None = None,
) -> LoopResult:
    """Per-query sums of every closed form and the counts of each query's best group, read once.

    Rows of the result: AP, MAP@R, R-precision, P@k per k (sums), with ``discounts`` the DCG@k
    sums per k, then the raw counts of the best group (window start and end, ``E`` at both).

    Args:
        prob: the problem (all the query rows).
        ties: the tie handling.
        table: (N + 1, 2) float64 harmonic table on the device.
        chunk_size: rows per chunk, or None to plan from ``budget``.
        budget: bytes a chunk may use.
        pair_keys: callable returning ``(code, query (d + 1, n_q), gallery (d + 1, N))``
            operands of the exact keys; called only when some query has near-tied pairs.
        discounts: (N + 1, 2) float64 cumulative discounts on the device, as ``table``
            (:func:`rankwise.metrics.ranking.discount_table_tensor`), or
            None for no DCG@k rows.
    """
    n_out = prob.cut.shape[0] + 1 + 4
    if discounts is not None:
        n_out += prob.cut.shape[0] - 2
        # one (N + 1, 4) table: group_terms reads both tables with one lookup (once per call)
        assert discounts.shape == table.shape
        table = torch.cat([table, discounts], 1)
    finish = _metric_finish(ties)
    return _run(prob, table, n_out, chunk_size, budget, finish, pair_keys)


def run_pr_curve(
    prob: DeviceProblem,
    ties: str,
    table: torch.Tensor,
    chunk_size: int | None,
    budget: int,
    pair_keys,
) -> LoopResult:
    """(L, n_q) interpolated precision of every query at every recall level, read back once.

    0 for a query without a relevant item; ``prob.need`` gives the levels. Arguments as
    :func:`run_metrics`.
    """
    assert prob.need is not None
    n_out = prob.need.shape[0]
    return _run(prob, table, n_out, chunk_size, budget, _pr_finish(ties), pair_keys)
