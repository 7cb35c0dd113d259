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
placed without exact keys. The main loop only counts those (relevant item, window item) pairs per
query; after the read-back, the queries that have any are evaluated again by the same loop with
a **pair stage**: the pairs are enumerated into a buffer sized on the host from those counts
(cumulative sum of the window widths and ``searchsorted`` of the pair slots), their exact keys
computed by :func:`rankwise.similarity.transposed_pair_keys` in a constant number of kernels, and
each window shrunk by the items whose key is strictly above or below the item's own. With the
float64 approximation (bound about 1e-13) random float embeddings essentially never need it;
exact duplicates do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

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
PAIRS_RECORD = "rankwise.retrieval.near_tie_chunk"
READBACK_RECORD = "rankwise.retrieval.readback"

# Memory plan. Bytes per score of a chunk's block while it is processed: the float64 block (8),
# the sorted values and their int64 order (16), the sort's workspace (up to 16 more on CUDA), the
# sorted labels (4), the relevance (1), its two int32 cumulative counts (8), slack (11).
BYTES_PER_SCORE = 64
# Bytes per (query, relevant slot): the (B, W) item tensors and the (W, B) group table, plus per
# cut-off the float64 closed-form temporaries.
BYTES_PER_SLOT = 256
BYTES_PER_SLOT_AND_CUTOFF = 64
# Bytes per near-tied pair, per embedding dimension: the two keys' gathered float64 rows, their
# products and partial sums; plus the pair's own indices.
BYTES_PER_PAIR_DIM = 80
BYTES_PER_PAIR = 256
# The near-tie pass sizes its pair buffers from the main loop's counts with this margin.
PAIR_SLACK = 1.25
PAIR_PAD = 64
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
        pair_keys: (code, query (d + 1, n_q), gallery (d + 1, N)) operands of the exact keys,
            needed by the pair stage only.
        need: (L, n_q) int64 for PR curves: the slot of each recall level (:func:`pr_terms`).
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
    pair_keys: tuple[int, torch.Tensor, torch.Tensor] | None = None
    need: torch.Tensor | None = None

    @property
    def multi_hot(self) -> bool:
        """True for multi-hot labels."""
        return self.gallery_labels.ndim == 2

    def rows(self, index: np.ndarray) -> DeviceProblem:
        """The same problem for the query rows ``index`` (host int64), writing their columns."""
        idx = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)).to(self.cut.device)
        pair_keys = None
        if self.pair_keys is not None:
            code, q_t, g_t = self.pair_keys
            pair_keys = (code, q_t.index_select(1, idx), g_t)
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
            pair_keys=pair_keys,
            need=None if self.need is None else self.need[:, idx],
        )


@dataclass
class _Consts:
    """Per-call constants of the loop, on the device."""

    ar1: torch.Tensor  # (1, W) int32 1, 2, ..., W
    slot_plus_one: torch.Tensor  # (W, 1) float64 1, 2, ..., W
    slot: torch.Tensor  # (W, 1) int64 0, 1, ..., W - 1
    default: torch.Tensor  # (4, 1, 1) float64 raw counts of an empty slot
    table: torch.Tensor  # (N + 1, 2) float64 harmonic numbers
    signs: torch.Tensor  # (4, 1, 1) int64: how the pair stage moves start, end, E(start), E(end)
    pairs_per_pass: int = 1 << 62  # near-tied pairs given keys at once (see _pair_corrections)

    @staticmethod
    def build(widest: int, table: torch.Tensor, pairs_per_pass: int = 1 << 62) -> _Consts:
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
            pairs_per_pass,
        )


def _relevance(prob: DeviceProblem, order: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """(B, N) bool relevance of the sorted items (2 ops; 3 for multi-hot labels)."""
    if prob.multi_hot:
        return ((prob.query_labels[lo:hi] @ prob.gallery_labels) > 0).gather(1, order)
    return prob.gallery_labels[order] == prob.query_labels[lo:hi]


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
    last = prob.n_relevant_column[lo:hi] + prob.offset[lo:hi]
    wanted = torch.minimum(c.ar1[:, :width] + prob.offset[lo:hi], last)
    pos = torch.searchsorted(count, wanted)
    value = values.gather(1, pos)
    half = prob.operands.half_window[lo:hi, None]
    start = torch.searchsorted(values, value - half)
    end = torch.searchsorted(values, value + half, right=True)
    raw = torch.stack([start, end, before.gather(1, start), before.gather(1, end)])
    return _Items(pos, raw, order, relevant)


def _pair_corrections(
    prob: DeviceProblem, c: _Consts, items: _Items, lo: int, width: int, n_pairs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(4, B, W) int64 to add to the raw counts, the (B,) pairs each query had, the real slots.

    The additions shrink each window to the item's exact tie group; more than ``n_pairs`` pairs in
    all means the buffer was short (the caller runs the chunk again). Slots past a query's last
    relevant item (a repeat of it) get no additions: they are not real (``valid`` False).

    Every (relevant item, item of its window) pair gets a slot of an ``n_pairs`` buffer (sized on
    the host from the counts of the main loop): the window widths' cumulative sum and a
    ``searchsorted`` of the slots give each slot its item and position, no compaction sync.
    Items whose exact key is strictly above the relevant item's own leave the window's top,
    those strictly below its bottom; relevant ones move ``E`` alike. The slots are taken in
    passes of at most ``c.pairs_per_pass`` (the counts add up), so that the memory of the keys
    stays within the budget however many pairs a chunk has; one pass unless it is pathological
    (say, a zero query row under cosine: every item tied with every relevant one).
    """
    n_slots = items.pos.numel()
    device = items.pos.device
    start, end = items.raw[0], items.raw[1]
    window = end - start
    n_relevant = prob.n_relevant_column[lo : lo + items.pos.shape[0]]
    valid = c.ar1[:, :width] <= n_relevant
    widths = (window * (valid & (window > 1))).view(-1)
    cum = torch.cumsum(widths, 0)
    base = start.view(-1) - (cum - widths)  # position of a pair = its slot + base of its item
    counts = torch.zeros(4, n_slots + 1, dtype=torch.int64, device=device)
    for first in range(0, n_pairs, c.pairs_per_pass):
        slots = torch.arange(first, min(first + c.pairs_per_pass, n_pairs), device=device)
        _count_pairs(prob, items, lo, width, slots, cum, base, counts)
    moved = counts[:, :n_slots].view(4, *items.pos.shape) * c.signs
    return moved, widths.view(items.pos.shape).sum(1), valid


def _count_pairs(
    prob: DeviceProblem,
    items: _Items,
    lo: int,
    width: int,
    slots: torch.Tensor,
    cum: torch.Tensor,
    base: torch.Tensor,
    counts: torch.Tensor,
) -> None:
    """Add the moves of the pairs ``slots`` to ``counts`` (4, n_slots + 1)."""
    n_items = items.order.shape[1]
    n_slots = items.pos.numel()
    item = torch.searchsorted(cum, slots, right=True)  # n_slots past the last pair: spare
    item_c = item.clamp(max=n_slots - 1)
    member = (slots + base.index_select(0, item_c)).clamp(0, n_items - 1)
    row = torch.div(item_c, width, rounding_mode="floor")
    row_start = row * n_items
    # each pair's two keys: the window item's and the relevant item's own
    flat = torch.cat([row_start + member, row_start + items.pos.view(-1).index_select(0, item_c)])
    assert prob.pair_keys is not None
    code, q_t, g_t = prob.pair_keys
    keys = transposed_pair_keys(code, q_t[:, lo:], g_t, row.repeat(2), items.order.view(-1)[flat])
    other, own = keys.view(2, -1)
    above, below = other > own, other < own
    relevant = items.relevant.view(-1)[flat[: slots.shape[0]]]
    moves = torch.stack([below, above, below & relevant, above & relevant]).to(torch.int64)
    counts.index_add_(1, item, moves)


def _pair_counts(items: _Items) -> torch.Tensor:
    """(B,) near-tied (relevant item, window item) pairs of each query.

    Windows wider than the item itself. Slots past a query's last relevant item repeat it and are
    counted too (an overestimate: the near-tie pass enumerates only the real ones).
    """
    window = items.raw[1] - items.raw[0]
    return (window * (window > 1)).sum(1)


def _raw_counts(
    prob: DeviceProblem, c: _Consts, items: _Items, lo: int, width: int, n_pairs: int
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The raw counts (after the pair stage when ``n_pairs``), the pairs of each query, the slots.

    The pairs are None for exact values, which need none. The slots (a (B, W) bool, or None when
    every slot may be written: repeats write what the item they repeat writes) are those whose
    counts go to the group table.
    """
    if n_pairs:
        moved, pairs, valid = _pair_corrections(prob, c, items, lo, width, n_pairs)
        return items.raw + moved, pairs, valid
    return items.raw, None if prob.operands.exact else _pair_counts(items), None


def _group_table(
    prob: DeviceProblem,
    c: _Consts,
    raw: torch.Tensor,
    lo: int,
    hi: int,
    valid: torch.Tensor | None = None,
):
    """Step 4: (g, n, r) (W, B) float64 of each group at slot N^+_{d-1}, and the raw table.

    The table has a spare slot W, where slots not ``valid`` are sent.
    """
    width = raw.shape[2]
    slot = prob.relevant_total[lo:hi] - raw[3]  # relevant items above the group
    if valid is not None:
        slot = torch.where(valid, slot, width)
    table = c.default.expand(4, width + 1, hi - lo).clone()
    table.scatter_(1, slot.T.expand(4, width, hi - lo), raw.transpose(1, 2).to(torch.float64))
    start, end, e_start, e_end = table[:, :width]
    return prob.n_gallery - end, end - start, e_end - e_start, table


def _write(prob: DeviceProblem, out: torch.Tensor, first: int, lo: int, values: torch.Tensor):
    """out[first : first + len(values), the columns of rows lo..] = values (one copy)."""
    rows = out[first : first + values.shape[0]]
    if prob.columns is None:
        rows[:, lo : lo + values.shape[1]].copy_(values)
    else:
        rows.index_copy_(1, prob.columns[lo : lo + values.shape[1]], values.to(out.dtype))


def _metric_chunk(
    prob: DeviceProblem,
    c: _Consts,
    out: torch.Tensor,
    lo: int,
    hi: int,
    width: int,
    ties: str,
    n_pairs: int,
) -> None:
    """One chunk of :func:`run_metrics` (``n_pairs > 0``: with the pair stage)."""
    items = _items(prob, c, lo, hi, width)
    raw, pairs, valid = _raw_counts(prob, c, items, lo, width, n_pairs)
    g, n, r, table = _group_table(prob, c, raw, lo, hi, valid)
    terms = group_terms(g, n, r, c.slot_plus_one[:width], prob.cut[:, :, lo:hi], ties, c.table)
    sums = terms.cumsum(1)[:, -1]  # in slot order: decreasing score
    _write(prob, out, 0, lo, sums)
    _write(prob, out, sums.shape[0], lo, table[:, 0])
    if pairs is not None:
        _write(prob, out, sums.shape[0] + 4, lo, pairs[None])


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


def _pr_chunk(
    prob: DeviceProblem,
    c: _Consts,
    out: torch.Tensor,
    lo: int,
    hi: int,
    width: int,
    ties: str,
    n_pairs: int,
) -> None:
    """One chunk of :func:`run_pr_curve`."""
    items = _items(prob, c, lo, hi, width)
    raw, pairs, valid = _raw_counts(prob, c, items, lo, width, n_pairs)
    g, n, r, _ = _group_table(prob, c, raw, lo, hi, valid)
    n_rel = prob.n_relevant_column[lo:hi].T
    assert prob.need is not None
    curve = pr_terms(g, n, r, c.slot[:width], n_rel, prob.need[:, lo:hi], ties)
    _write(prob, out, 0, lo, curve)
    if pairs is not None:
        _write(prob, out, curve.shape[0], lo, pairs[None])


def _pair_plan(
    pairs: np.ndarray,
    n_relevant: np.ndarray,
    n_gallery: int,
    dim: int,
    budget: int,
    max_rows: int | None,
) -> list[tuple[int, int, int, int]]:
    """(lo, hi, W, n_pairs) chunks of the near-tie pass: rows and pairs within ``budget``.

    A chunk takes rows while their score blocks and pair buffers fit ``budget`` (at least one
    row, however many pairs it has: its pairs then take several passes) and, when given, at most
    ``max_rows`` rows.
    """
    per_pair = BYTES_PER_PAIR + BYTES_PER_PAIR_DIM * (dim + 1)
    cost = n_gallery * BYTES_PER_SCORE + pairs.astype(np.int64) * per_pair
    out = []
    lo = 0
    while lo < pairs.shape[0]:
        hi, used = lo + 1, int(cost[lo])
        while hi < pairs.shape[0] and used + int(cost[hi]) <= budget:
            if max_rows is not None and hi - lo >= max_rows:
                break
            used += int(cost[hi])
            hi += 1
        width = max(int(n_relevant[lo:hi].max()), 1)
        out.append((lo, hi, width, int(pairs[lo:hi].sum())))
        lo = hi
    return out


@dataclass
class LoopResult:
    """What one call read back (host) and how it ran.

    Attributes:
        values: (rows, n_q) float64 per-query buffer.
        chunks: chunks of the main loop.
        near_tie_chunks: chunks of the near-tie pass.
        near_tie_queries: queries evaluated again with exact keys.
        near_tie_pairs: (relevant item, window item) pairs given exact keys.
    """

    values: np.ndarray
    chunks: int
    near_tie_chunks: int = 0
    near_tie_queries: int = 0
    near_tie_pairs: int = 0


def _run(
    prob: DeviceProblem,
    table: torch.Tensor,
    n_out: int,
    chunk_size: int | None,
    budget: int,
    run_chunk,
    pair_keys,
) -> LoopResult:
    """The loop, the one read-back, and the near-tie pass over the queries that need it."""
    widest = max(int(prob.n_relevant.max()) if prob.n_relevant.size else 1, 1)
    consts = _Consts.build(widest, table)
    approximate = not prob.operands.exact
    n_rows = n_out + (1 if approximate else 0)
    out = torch.zeros(n_rows, prob.cut.shape[2], dtype=torch.float64, device=prob.cut.device)
    plan = plan_chunks(prob.n_relevant, prob.n_gallery, prob.cut.shape[0], chunk_size, budget)
    for lo, hi, width in plan:
        with torch.profiler.record_function(CHUNK_RECORD):
            run_chunk(prob, consts, out, lo, hi, width, 0)
    n_main = len(plan)
    with torch.profiler.record_function(READBACK_RECORD):
        host = out.cpu().numpy()
    flagged = np.flatnonzero(host[n_out] > 0) if approximate else np.zeros(0, dtype=np.int64)
    if not flagged.size:
        return LoopResult(host[:n_out], n_main)
    sub = prob.rows(flagged)
    code, q_t, g_t = pair_keys()
    per_pair = BYTES_PER_PAIR + BYTES_PER_PAIR_DIM * q_t.shape[0]
    consts = replace(consts, pairs_per_pass=max(2, budget // 2 // per_pair))
    sub = replace(sub, pair_keys=(code, q_t.index_select(1, sub.columns), g_t))
    # The pass scores these rows in other blocks than the main loop did, and a matmul of another
    # shape may round differently: its windows, hence its pairs, can differ slightly. Each chunk
    # writes the pairs it needed; a chunk whose buffer was short is run again with their count
    # (checked after each read-back; the counts of a chunk are the same when it runs again).
    needed = host[n_out, flagged]
    pair_plan = _pair_plan(
        needed * PAIR_SLACK + PAIR_PAD,
        sub.n_relevant,
        prob.n_gallery,
        q_t.shape[0] - 1,
        budget,
        chunk_size,
    )
    assert sub.columns is not None
    chunks = rounds = 0
    while pair_plan:
        for lo, hi, width, n_pairs in pair_plan:
            with torch.profiler.record_function(PAIRS_RECORD):
                run_chunk(sub, consts, out, lo, hi, width, n_pairs)
        chunks += len(pair_plan)
        with torch.profiler.record_function(READBACK_RECORD):
            host[:, flagged] = out.index_select(1, sub.columns).cpu().numpy()
        needed = host[n_out, flagged]  # the pairs each query had: rerun the short chunks
        # what the chunk reported: enough when it runs again (the same blocks, the same values);
        # more margin at every further round, should a device's matmul not repeat itself
        rounds += 1
        pair_plan = [
            (lo, hi, width, int(needed[lo:hi].sum() * (1 + (rounds - 1) * PAIR_SLACK)))
            for lo, hi, width, n_pairs in pair_plan
            if needed[lo:hi].sum() > n_pairs
        ]
    return LoopResult(host[:n_out], n_main, chunks, int(flagged.size), int(needed.sum()))


def run_metrics(
    prob: DeviceProblem,
    ties: str,
    table: torch.Tensor,
    chunk_size: int | None,
    budget: int,
    pair_keys,
) -> LoopResult:
    """Per-query sums of every closed form and the counts of each query's best group, read once.

    Rows of the result: AP, MAP@R, R-precision, P@k per k (sums), then the raw counts of the best
    group (window start and end, ``E`` at both).

    Args:
        prob: the problem (all the query rows).
        ties: the tie handling.
        table: (N + 1, 2) float64 harmonic table on the device.
        chunk_size: rows per chunk, or None to plan from ``budget``.
        budget: bytes a chunk may use.
        pair_keys: callable returning ``(code, query (d + 1, n_q), gallery (d + 1, N))``
            operands of the exact keys; called only when some query has near-tied pairs.
    """

    def chunk(p, c, out, lo, hi, width, n_pairs):
        _metric_chunk(p, c, out, lo, hi, width, ties, n_pairs)

    return _run(prob, table, prob.cut.shape[0] + 1 + 4, chunk_size, budget, chunk, pair_keys)


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

    def chunk(p, c, out, lo, hi, width, n_pairs):
        _pr_chunk(p, c, out, lo, hi, width, ties, n_pairs)

    return _run(prob, table, prob.need.shape[0], chunk_size, budget, chunk, pair_keys)
