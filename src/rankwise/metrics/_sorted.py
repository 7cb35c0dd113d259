"""Sorted-row counting: tie-group counts of a score block from a device sort of each row.

The counts of :class:`rankwise.metrics._kernels.RelevantGroupCounts` (He et al., "Hashing as
Tie-Aware Learning to Rank", CVPR 2018, Prop. 1 / Eq. 6): once a row is sorted the items tied at
a relevant value ``v`` are one contiguous run, so the counts are binary searches
(``torch.searchsorted``) in the sorted row, a few vectorised torch ops per chunk on any device (the
GPU path; on the CPU the numba kernel of :mod:`rankwise.metrics._kernels` stays the default).

Rows are sorted in float32. When a block's values are not exact (an approximation with a proven
error bound ``e``, :mod:`rankwise.metrics._scores`, or rounded float64), only the items within
``2 e`` of a relevant value are compared by their exact keys, so the counts equal the numba path's
integer for integer (docs/metrics.md, "How the counts are computed").
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from ._kernels import RelevantGroupCounts, tie_group_bounds

__all__ = [
    "RelevantLists",
    "sorted_row_counts",
    "class_relevant_lists",
    "mask_relevant_lists",
]

STRATEGIES = ("auto", "segment", "sort", "table")
# "auto" takes "segment" for chunks where at least this fraction of the (query, item) pairs is
# relevant, else "sort" (see sorted_row_counts)
SEGMENT_MIN_RELEVANT_FRACTION = 0.05
# float32 rounding: |fl32(x) - x| <= 2^-24 |x| for normal results, <= 2^-150 for subnormal ones.
_HALF_ULP32 = 2.0**-24
_SUBNORMAL32 = 2.0**-149
# float32 overflows beyond this; larger float64 values are sorted as float64.
_FLOAT32_SAFE = 2.0**126
# relative slack on the window half-width (the float64 arithmetic of the window's own ends)
_WINDOW_SLACK = 1.0 + 2.0**-40
# Devices whose float32 rows are sorted as flat int64 keys (``_sort_rows``): torch's CPU radix sort
# is 1.5-2x faster than its row-wise float32 sort; CUDA is not measured (docs/benchmarks.md).
FLAT_KEY_SORT_DEVICES = frozenset({"cpu"})
FLAT_SORT_PART = 2**20  # scores sorted at once by the flat sort (``_sort_rows``)


@dataclass
class RelevantLists:
    """Relevant items of a chunk of queries as flat (row, column) lists, grouped by row.

    Attributes:
        rows: (S,) int64 row (query within the chunk) of each relevant item, non-decreasing.
        cols: (S,) int64 gallery column of each relevant item (the excluded item is never listed).
        n_rows: rows in the chunk.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    n_rows: int


def class_relevant_lists(
    query_class: torch.Tensor,
    class_ptr: torch.Tensor,
    members: torch.Tensor,
    self_index: torch.Tensor | None,
) -> RelevantLists:
    """Lists of queries whose relevant items are the gallery rows of their class (any device).

    Args: the tensors of :func:`rankwise.metrics._kernels.relevant_lists_from_classes`
    (``self_index`` may be None). Returns the lists, rows non-decreasing.
    """
    device = query_class.device
    n_rows = int(query_class.shape[0])
    present = query_class >= 0
    safe_class = torch.where(present, query_class, torch.zeros_like(query_class))
    start = class_ptr[safe_class]
    sizes = torch.where(present, class_ptr[safe_class + 1] - start, torch.zeros_like(start))
    rows = torch.repeat_interleave(torch.arange(n_rows, device=device), sizes)
    # index_select: cheaper on the CPU than tensor indexing for these long (S,) gathers
    offset = (start - (torch.cumsum(sizes, 0) - sizes)).index_select(0, rows)
    cols = members.index_select(0, offset + torch.arange(rows.shape[0], device=device))
    if self_index is not None:
        keep = torch.nonzero(cols != self_index.index_select(0, rows)).squeeze(1)
        rows, cols = rows.index_select(0, keep), cols.index_select(0, keep)
    return RelevantLists(rows, cols, n_rows)


def mask_relevant_lists(relevant: torch.Tensor, self_index: torch.Tensor | None) -> RelevantLists:
    """Lists of a (B, N) bool relevance mask (any device), the excluded column removed."""
    rows, cols = torch.nonzero(relevant, as_tuple=True)
    if self_index is not None:
        keep = cols != self_index[rows]
        rows, cols = rows[keep], cols[keep]
    return RelevantLists(rows, cols, int(relevant.shape[0]))


def _float32_for_sorting(
    values: torch.Tensor, bound: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 values to sort, and the per-row bound of their error (None when exact).

    The bound is on the distance to a strictly increasing map of the exact keys.
    """
    if values.dtype == torch.float32:
        return values, bound
    if not values.is_floating_point():
        values = values.to(torch.float64)
    rounded = values.to(torch.float32)
    if values.dtype != torch.float64:  # fp16 / bf16: widening is exact
        return rounded, bound
    if values.shape[1] == 0:
        return rounded, bound
    low, high = torch.aminmax(rounded, dim=1)
    largest = torch.maximum(low.abs(), high.abs()).to(torch.float64)
    if bool((largest >= _FLOAT32_SAFE).any()):
        return values, bound  # float32 would overflow: sort the float64 values themselves
    # |x| <= |fl32(x)| (1 + 2^-23), so the largest float32 magnitude bounds the rounding too
    rounding = largest * (_HALF_ULP32 * (1.0 + 2.0**-22)) + _SUBNORMAL32
    return rounded, rounding if bound is None else bound + rounding


def _sort_rows(values: torch.Tensor, descending: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(values, dim=1, descending=descending)``: (B, N) sorted values and columns.

    Ties may come in any order. On ``FLAT_KEY_SORT_DEVICES`` a float32 block is sorted as flat
    int64 keys ``row * 2^32 + k(value)`` (``k`` order- and equality-preserving), in parts of about
    ``FLAT_SORT_PART`` scores: the radix sort ran 2x slower per item once out of cache.
    """
    n_rows, n_items = values.shape
    flat_key = (
        values.dtype == torch.float32
        and values.device.type in FLAT_KEY_SORT_DEVICES
        and n_rows > 0
        and n_items > 0
    )
    if not flat_key:
        return torch.sort(values, dim=1, descending=descending)
    values = values.contiguous()
    sorted_values = torch.empty_like(values)
    columns = torch.empty(values.shape, dtype=torch.int64, device=values.device)
    part = max(1, FLAT_SORT_PART // n_items)
    starts = range(0, n_rows, part)

    def sort_part(start: int) -> None:
        stop = min(n_rows, start + part)
        _flat_key_sort(
            values[start:stop], descending, sorted_values[start:stop], columns[start:stop]
        )

    # torch's radix sort runs on one thread: the parts (disjoint rows, disjoint outputs) are
    # spread over torch's intra-op threads instead
    workers = min(torch.get_num_threads(), len(starts))
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(sort_part, starts))
    else:
        for start in starts:
            sort_part(start)
    return sorted_values, columns


def _flat_key_sort(
    values: torch.Tensor, descending: bool, sorted_values: torch.Tensor, columns: torch.Tensor
) -> None:
    """``_sort_rows`` of a contiguous float32 block (< 2^31 rows) into the given outputs."""
    n_rows, n_items = values.shape
    bits = values.view(torch.int32)
    sign = bits >> 31  # -1 for negative values (and -0.0), else 0
    # |value|'s bits order magnitudes; negating those of negative values orders every float
    key = (bits & 0x7FFFFFFF).bitwise_xor_(sign).sub_(sign)
    if descending:
        key.neg_()  # keys lie in [-(2^31 - 1), 2^31 - 1]: negation cannot overflow
    row_offset = torch.arange(n_rows, dtype=torch.int64, device=values.device)
    composite = key.to(torch.int64)
    del key, sign
    composite += ((row_offset << 32) + 2**31)[:, None]  # non-negative, rows in the high bits
    flat_order = torch.sort(composite.view(-1)).indices
    del composite
    torch.index_select(values.view(-1), 0, flat_order, out=sorted_values.view(-1))
    torch.sub(flat_order.view(n_rows, n_items), (row_offset * n_items)[:, None], out=columns)


def _outward(x: torch.Tensor, dtype: torch.dtype, direction: float) -> torch.Tensor:
    """float64 ``x`` rounded to ``dtype`` away from the window's centre (down for -inf)."""
    y = x.to(dtype)
    if dtype == torch.float64:
        return y
    past = (y.to(torch.float64) < x) if direction > 0 else (y.to(torch.float64) > x)
    toward = torch.full_like(y, direction)
    return torch.where(past, torch.nextafter(y, toward), y)


def _padded(values: torch.Tensor, lists: RelevantLists) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, M) per-row values (M = most items of a row), +inf padded, and each item's flat index."""
    n_rows = lists.n_rows
    per_row = torch.bincount(lists.rows, minlength=n_rows)
    width = int(per_row.max()) if lists.rows.numel() else 0
    first = torch.cumsum(per_row, 0) - per_row
    slot = lists.rows * max(width, 1) + (
        torch.arange(lists.rows.shape[0], device=values.device) - first[lists.rows]
    )
    padded = torch.full(
        (n_rows, max(width, 1)), float("inf"), dtype=values.dtype, device=values.device
    )
    padded.view(-1)[slot] = values
    return padded, slot


def _window_counts(
    order: torch.Tensor,
    lists: RelevantLists,
    lo: torch.Tensor,
    hi: torch.Tensor,
    exact_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Items of each window [lo, hi) above / tied with its relevant item (itself tied) by key."""
    device = lo.device
    width = hi - lo
    seg = torch.repeat_interleave(torch.arange(width.shape[0], device=device), width)
    first = torch.cumsum(width, 0) - width
    position = lo[seg] + torch.arange(seg.shape[0], device=device) - first[seg]
    rows = lists.rows[seg]
    cols = order[rows, position]
    n = width.shape[0]
    keys = exact_keys(torch.cat([lists.rows, rows]), torch.cat([lists.cols, cols]))
    own, others = keys[:n], keys[n:]
    above = torch.zeros(n, dtype=torch.int64, device=device)
    equal = torch.zeros(n, dtype=torch.int64, device=device)
    above.index_add_(0, seg, (others > own[seg]).to(torch.int64))
    equal.index_add_(0, seg, (others == own[seg]).to(torch.int64))
    return above, equal


def _relevant_item_counts(
    values: torch.Tensor,
    bound: torch.Tensor | None,
    lists: RelevantLists,
    self_index: torch.Tensor | None,
    exact_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    strategy: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(rows, higher, tied) of the relevant items (S,), and whether ordered by (row, higher)."""
    sort_values, bound = _float32_for_sorting(values, bound)
    if sort_values is values:
        sort_values = values.clone()
    n_items = sort_values.shape[1]
    if self_index is not None:
        # the excluded item goes below every finite value: never above, tied with or near a
        # relevant item (relevant values are finite)
        rows = torch.nonzero(self_index >= 0).squeeze(1)
        sort_values[rows, self_index[rows]] = float("-inf")
    if bound is not None and exact_keys is None:
        raise ValueError("`exact_keys` is required with `bound` (approximate scores).")
    if strategy == "segment":
        return _segment_counts(sort_values, bound, lists, exact_keys)
    own = sort_values[lists.rows, lists.cols]
    if strategy == "table":
        if bound is None:
            return (lists.rows, *_exact_table_counts(sort_values, own, lists), False)
        assert exact_keys is not None  # given with every bound (checked above)
        counts = _approximate_table_counts(sort_values, own, bound, lists, exact_keys)
        return (lists.rows, *counts, False)
    if bound is None:
        ascending = _sort_rows(sort_values)[0]
        padded, slot = _padded(own, lists)
        below_or_equal = torch.searchsorted(ascending, padded, right=True).view(-1)[slot]
        below = torch.searchsorted(ascending, padded).view(-1)[slot]
        return lists.rows, n_items - below_or_equal, below_or_equal - below, False
    assert exact_keys is not None  # given with every bound (checked above)
    ascending, order = _sort_rows(sort_values)
    half_width = (2.0 * _WINDOW_SLACK) * bound.to(own.device, torch.float64)[lists.rows]
    centre = own.to(torch.float64)
    low = _outward(centre - half_width, sort_values.dtype, float("-inf"))
    high = _outward(centre + half_width, sort_values.dtype, float("inf"))
    padded_low, slot = _padded(low, lists)
    padded_high, _ = _padded(high, lists)
    lo = torch.searchsorted(ascending, padded_low).view(-1)[slot]
    hi = torch.searchsorted(ascending, padded_high, right=True).view(-1)[slot]
    greater = n_items - hi
    size = torch.ones_like(greater)
    wide = torch.nonzero(hi - lo > 1).squeeze(1)
    if wide.numel():
        sub = RelevantLists(lists.rows[wide], lists.cols[wide], lists.n_rows)
        above, equal = _window_counts(order, sub, lo[wide], hi[wide], exact_keys)
        greater[wide] += above
        size[wide] = equal
    return lists.rows, greater, size, False


def _segment_counts(
    sort_values: torch.Tensor,
    bound: torch.Tensor | None,
    lists: RelevantLists,
    exact_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """Counts from one descending sort of each row, by linear passes over the sorted rows.

    In a descending row the items above the relevant item at position ``p`` are the positions
    before its tie group: with exact values the groups are the runs of equal values and each
    relevant item reads its group's first position and size. With approximate values (``bound``)
    a relevant item whose neighbours both lie outside its window (twice the bound, rounded
    outward) is alone in it -- the order of every other item is certain -- so ``p`` items are
    above it and it is tied with itself only; the others take the exact-key windows.
    """
    n_rows, n_items = sort_values.shape
    device = sort_values.device
    descending, order = _sort_rows(sort_values, descending=True)
    # flat (row-major) indices and index_select: much cheaper on the CPU than 2-d indexing
    relevant = torch.zeros(n_rows * n_items, dtype=torch.bool, device=device)
    relevant[lists.rows * n_items + lists.cols] = True
    relevant = relevant.view(n_rows, n_items).gather(1, order).view(-1)
    # increasing: rows non-decreasing, positions increasing within a row
    flat = torch.nonzero(relevant).squeeze(1)
    rows = torch.div(flat, n_items, rounding_mode="floor")
    position = flat - rows * n_items
    if bound is None:
        greater, size = _run_counts(descending, rows, position)
        return rows, greater, size, True
    assert exact_keys is not None  # the caller checked it comes with the bound
    flat_descending = descending.view(-1)
    value = flat_descending.index_select(0, flat).to(torch.float64)
    half_width = (2.0 * _WINDOW_SLACK) * bound.to(device, torch.float64).index_select(0, rows)
    low = _outward(value - half_width, descending.dtype, float("-inf"))
    high = _outward(value + half_width, descending.dtype, float("inf"))
    first, last = position == 0, position == n_items - 1
    # the neighbours' flat indices stay inside the block; the row's ends are masked by first/last
    previous = flat_descending.index_select(0, (flat - 1).clamp_min(0))
    following = flat_descending.index_select(0, (flat + 1).clamp_max(flat_descending.numel() - 1))
    alone = (first | (previous > high)) & (last | (following < low))
    greater, size = position.clone(), torch.ones_like(position)
    close = torch.nonzero(~alone).squeeze(1)
    if close.numel():
        close_flat = flat.index_select(0, close)
        sub = RelevantLists(
            rows.index_select(0, close), order.view(-1).index_select(0, close_flat), n_rows
        )
        # the negated descending row is ascending: the window [low, high] is [-high, -low] there
        negated = -descending
        padded_high, slot = _padded(-high[close], sub)
        padded_low, _ = _padded(-low[close], sub)
        lo = torch.searchsorted(negated, padded_high).view(-1)[slot]
        hi = torch.searchsorted(negated, padded_low, right=True).view(-1)[slot]
        above, equal = _window_counts(order, sub, lo, hi, exact_keys)
        greater[close] = lo + above
        size[close] = equal
    return rows, greater, size, False


def _run_counts(
    descending: torch.Tensor, rows: torch.Tensor, position: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """First position and length of the run of equal values holding each (row, position)."""
    n_rows, n_items = descending.shape
    starts = torch.ones(n_rows, n_items, dtype=torch.bool, device=descending.device)
    starts[:, 1:] = descending[:, 1:] != descending[:, :-1]
    flat_starts = starts.view(-1)
    run = torch.cumsum(flat_starts, 0) - 1  # run index of every flat position
    first = torch.nonzero(flat_starts).squeeze(1)
    end = torch.cat([first[1:], first.new_full((1,), n_rows * n_items)])
    base = rows * n_items
    own_run = run[base + position]
    return first[own_run] - base, end[own_run] - first[own_run]


def sorted_row_counts(
    values: torch.Tensor,
    lists: RelevantLists,
    self_index: torch.Tensor | None = None,
    *,
    bound: torch.Tensor | None = None,
    exact_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    strategy: str = "auto",
) -> RelevantGroupCounts:
    """Tie-group counts of a score block by vectorised torch ops (any device).

    Args:
        values: (B, N) floating tensor, higher = ranked first. With ``bound=None`` the values rank
            and tie within each row exactly like the keys; float64 values are then also their own
            exact keys.
        lists: the relevant items of each row (:func:`class_relevant_lists`,
            :func:`mask_relevant_lists`); the excluded item must not be listed.
        self_index: (B,) int64, a column removed from each row entirely, -1 for none.
        bound: None, or (B,) float64 tensor: ``|values[i, j] - phi_i(key_ij)| <= bound[i]`` for a
            strictly increasing ``phi_i``; the counts returned are then those of the exact keys.
        exact_keys: with ``bound``: ``exact_keys(rows, cols)`` returns the (m,) float64 exact keys
            of the pairs (row ``rows[m]`` of this block, column ``cols[m]``), as tensors on the
            block's device. It is asked only for items within twice the bound of a relevant item.
        strategy: ``"sort"`` sorts every row (O(N log N)), then two binary searches per relevant
            item; ``"segment"`` reads the counts off the sorted rows by linear passes
            (:func:`_segment_counts`); ``"table"`` locates every item among its row's M sorted
            relevant values (O(N log M), yet slower than the sort on the CPU, where
            ``torch.searchsorted`` costs about as much per item as the whole sort). ``"auto"``
            takes ``"segment"`` when at least ``SEGMENT_MIN_RELEVANT_FRACTION`` (5 %) of the
            block's (row, item) pairs are relevant (the binary searches then cost more than the
            linear passes), else ``"sort"``. All return the same counts.

    Returns:
        The counts, groups ordered by decreasing score within each row, exactly as
        :func:`rankwise.metrics._kernels.relevant_group_counts_from_lists` returns them.
    """
    values = values.detach()
    if bound is None and values.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        # exact float64 values: sorted in float32 with the rounding as the bound, the values
        # themselves serving as exact keys of the few items the rounding leaves open
        exact_keys = _gathered_keys(values.to(torch.float64))
    if strategy not in STRATEGIES:
        raise ValueError(f"`strategy` must be one of {STRATEGIES}, got {strategy!r}.")
    if strategy == "auto":
        pairs = values.shape[0] * values.shape[1]
        dense = lists.rows.numel() >= SEGMENT_MIN_RELEVANT_FRACTION * pairs
        strategy = "segment" if dense else "sort"
    rows, greater, size, ordered = _relevant_item_counts(
        values, bound, lists, self_index, exact_keys, strategy
    )
    n_items = values.shape[1] + 1
    # tied relevant items share their count of higher items, distinct ones never do: the groups
    # are the runs of equal (row, greater), in increasing order of greater (decreasing score)
    composite = rows * n_items + greater
    if not ordered:
        composite, size = _sorted_by_composite(composite, size, rows, strategy == "segment")
    distinct, n_relevant = torch.unique_consecutive(composite, return_counts=True)
    group_row = torch.div(distinct, n_items, rounding_mode="floor")
    first = torch.cumsum(n_relevant, 0) - n_relevant
    group_size = size[first]
    n_groups = torch.bincount(group_row, minlength=lists.n_rows)
    return RelevantGroupCounts(
        _to_numpy(n_groups),
        _to_numpy(distinct - group_row * n_items),
        _to_numpy(group_size),
        _to_numpy(n_relevant),
    )


def _sorted_by_composite(
    composite: torch.Tensor, size: torch.Tensor, rows: torch.Tensor, rows_grouped: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``composite`` sorted increasingly and ``size`` permuted alike.

    With ``rows_grouped`` (the items of a row contiguous, rows non-decreasing, as "segment" lists
    them in sorted-value order) only the rows out of order are sorted: their exact order differs
    from the values' only where the exact-key windows reordered near-ties, usually nowhere.
    """
    if not rows_grouped:
        composite, order = torch.sort(composite)
        return composite, size[order]
    out_of_order = composite[1:] < composite[:-1]
    if not bool(out_of_order.any()):
        return composite, size
    bad_rows = torch.unique(rows[1:][out_of_order])
    where = torch.nonzero(torch.isin(rows, bad_rows)).squeeze(1)
    part, order = torch.sort(composite[where])
    composite, size = composite.clone(), size.clone()
    composite[where] = part
    size[where] = size[where][order]
    return composite, size


def _gathered_keys(block: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``exact_keys`` callback reading the keys from a float64 block that holds them."""
    return lambda rows, cols: block[rows, cols]


def _to_numpy(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.cpu().numpy(), dtype=np.int64)


# the same counts from a table of the sorted relevant values (O(N log M) per row instead of
# O(N log N)): every item is located among its row's M relevant values by binary searches


def _relevant_table(own: torch.Tensor, lists: RelevantLists) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, M) ascending relevant values of each row (+inf padded), each listed item's flat index."""
    padded, slot = _padded(own, lists)
    table, order = torch.sort(padded, dim=1)
    width = table.shape[1]
    position = torch.empty_like(order)
    position.scatter_(1, order, torch.arange(width, device=own.device).expand_as(order))
    rows_base = torch.div(slot, width, rounding_mode="floor") * width
    return table, rows_base + position.view(-1)[slot]


def _row_histogram(bins: torch.Tensor, n_bins: int, keep: torch.Tensor | None) -> torch.Tensor:
    """(B, n_bins) int64 counts of the (B, N) bin indices (only where ``keep``)."""
    n_rows = bins.shape[0]
    flat = (bins + torch.arange(n_rows, device=bins.device)[:, None] * n_bins).view(-1)
    if keep is not None:
        flat = flat[keep.view(-1)]
    return torch.bincount(flat, minlength=n_rows * n_bins).view(n_rows, n_bins)


def _suffix_sums(hist: torch.Tensor) -> torch.Tensor:
    """(B, K + 1): entry k is ``hist[:, k:].sum(1)`` (the last column is 0)."""
    suffix = torch.flip(torch.cumsum(torch.flip(hist, [1]), 1), [1])
    return torch.cat([suffix, torch.zeros_like(suffix[:, :1])], dim=1)


def _exact_table_counts(
    sort_values: torch.Tensor, own: torch.Tensor, lists: RelevantLists
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts when the values rank and tie exactly like the keys.

    With ``below(s)`` the number of relevant values strictly below item ``s``: ``s`` is above
    relevant value ``v`` iff ``below(s) >= #(relevant values <= v)``, and tied with it iff it
    equals the table entry at ``below(s)``, i.e. the first of ``v``'s run.
    """
    table, where = _relevant_table(own, lists)
    n_rows, width = table.shape
    below = torch.searchsorted(table, sort_values)
    tied = torch.gather(table, 1, below.clamp_max(width - 1)) == sort_values
    hist = _row_histogram(below, width + 1, None)
    tied_hist = _row_histogram(below, width + 1, tied)
    first, last = (x.reshape(-1)[where] for x in tie_group_bounds(table))
    rows = lists.rows
    return _suffix_sums(hist)[rows, last + 1], tied_hist[rows, first]


def _outward_table(table: torch.Tensor, half_width: torch.Tensor, up: bool) -> torch.Tensor:
    """``table +- half_width`` (per row) rounded outward to the table's dtype, still ascending."""
    shifted = table.to(torch.float64) + (half_width if up else -half_width)[:, None]
    return _outward(shifted, table.dtype, float("inf") if up else float("-inf"))


def _approximate_table_counts(
    sort_values: torch.Tensor,
    own: torch.Tensor,
    bound: torch.Tensor,
    lists: RelevantLists,
    exact_keys: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the exact keys from values within ``bound`` of them (per row).

    Relevant value ``u_j`` (table position j) and item ``s``: ``s > u_j + 2e`` (item certainly
    above) for the ``a(s)`` smallest j, ``s < u_j - 2e`` (certainly below) from ``b(s)`` on. Items
    with ``a(s) = b(s)`` are certain for every relevant item and are only counted in a
    histogram of ``a``; the others ("close" items: every relevant item, and the rare items within
    ``2e`` of one) are compared with the relevant items by value -- by exact key in every row that
    holds a close pair, where the values' order is not certain.
    """
    table, where = _relevant_table(own, lists)
    n_rows, width = table.shape
    half_width = (2.0 * _WINDOW_SLACK) * bound.to(own.device, torch.float64)
    above_count = torch.searchsorted(_outward_table(table, half_width, True), sort_values)
    below_from = torch.searchsorted(
        _outward_table(table, half_width, False), sort_values, right=True
    )
    close = below_from > above_count
    hist = _row_histogram(above_count, width + 1, ~close)
    close_rows, close_cols = torch.nonzero(close, as_tuple=True)
    # a row needs exact keys when a close item is irrelevant or a relevant one is close to another
    n_close = torch.bincount(close_rows, minlength=n_rows)
    n_relevant = torch.bincount(lists.rows, minlength=n_rows)
    crowded = (below_from - above_count).amax(dim=1) > 1
    touched = (n_close > n_relevant) | crowded
    value = sort_values[close_rows, close_cols].to(torch.float64)
    need = touched[close_rows]
    if bool(need.any()):
        value[need] = exact_keys(close_rows[need], close_cols[need])
    own_value = own.to(torch.float64)
    relevant_need = touched[lists.rows]
    if bool(relevant_need.any()):
        own_value[relevant_need] = exact_keys(lists.rows[relevant_need], lists.cols[relevant_need])
    # close items' values, per row ascending (-inf padded in front: never above nor tied)
    ordered = RelevantLists(close_rows, close_cols, n_rows)
    padded, _ = _padded(-value, ordered)
    close_table = -torch.flip(torch.sort(padded, dim=1).values, [1])
    query = _padded(own_value, lists)
    at_or_below = torch.searchsorted(close_table, query[0], right=True).view(-1)[query[1]]
    strictly_below = torch.searchsorted(close_table, query[0]).view(-1)[query[1]]
    position = where - torch.div(where, width, rounding_mode="floor") * width
    certain_above = _suffix_sums(hist)[lists.rows, position + 1]
    n_close_table = close_table.shape[1]
    return certain_above + n_close_table - at_or_below, at_or_below - strictly_below
