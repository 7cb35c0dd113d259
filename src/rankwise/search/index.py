"""Exact top-k search over float embeddings under cosine, dot or euclidean similarity.

k-nearest-neighbour retrieval of a gallery by the similarities of :mod:`rankwise.similarity`
(``"cosine"``, ``"dot"``, ``"euclidean"``: score ``-||q - g||``). The exact backend scores every
(query, gallery) pair by the metrics' own float64 ranking keys (:class:`ExactOperands`: one
sequence of IEEE operations per pair, so a pair's score never depends on the block it is computed
in, the block sizes or the machine's BLAS) and keeps a running top-k per query over gallery
blocks: memory ``O(query_block x (gallery_block + k))`` whatever the gallery's size.

Computing every exact key (``d`` sequential float64 operations per pair) would be slow, so a
block is first scored by one float64 matrix product (BLAS, any summation order) whose error
against the exact key is at most ``E / 2`` per pair (a bound from the row norms, see
``_screening``). Let ``t`` be a row's k-th largest BLAS score: the k items scoring ``>= t`` have
exact keys ``>= t - E / 2``, so the exact k-th key is ``>= t - E / 2`` too, and every item in the
exact top k, or tied with its k-th key, has a BLAS score ``>= t - E``. Only those candidates get
exact keys; the result is the exact one, at the speed of a matrix product.

Ties are broken by insertion order (the item added first ranks first), never by an arbitrary
sort, and reported: a cut that falls inside a group of equal scores is a choice the scores do not
make (the tie groups of McSherry & Najork, ECIR 2008), so each query's result counts the gallery
items left out that score exactly its k-th score (``ties_at_cut``).

``backend="faiss"`` searches a flat (exhaustive) faiss index instead (Johnson, Douze & Jégou,
"Billion-scale similarity search with GPUs", IEEE TBD 2019: ``IndexFlatIP`` / ``IndexFlatL2``):
float32 arithmetic, the same neighbours up to rounding; ties at the cut are detected from a
(k + 1)-th result but not counted. faiss comes from the ``faiss`` extra.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._disk import atomic_write
from .._extras import require
from .._threads import keeps_torch_threads
from .._validation import Interval, check_choice, check_embeddings, check_scalar
from ..similarity import ExactOperands, check_similarity, similarity_from_keys

__all__ = ["BACKENDS", "EmbeddingIndex", "SearchResult", "exact_top_k"]

BACKENDS = ("exact", "faiss")
_FORMAT = 1
_KIND = "rankwise.EmbeddingIndex"
_DTYPES = {"float32": np.float32, "float64": np.float64}


@dataclass(frozen=True)
class SearchResult:
    """The ``k`` best gallery items of each query, best first.

    Attributes:
        scores: ``(n_q, k)`` float64 similarities (cosine, inner product, or ``-||q - g||``),
            non-increasing along each row.
        ids: ``(n_q, k)`` int64 ids of the items (those given to :meth:`EmbeddingIndex.add`).
        positions: ``(n_q, k)`` int64 insertion positions of the items (0 = the first added).
        ties_at_cut: ``(n_q,)`` int64, the gallery items not returned whose score equals the
            k-th score (0: the top-k is the same under any tie-breaking); ``None`` for the faiss
            backend, which does not count them.
        cut_tied: ``(n_q,)`` bool, whether an item left out ties with the k-th result.
        paths: per query, the ``k`` items' paths, if the index holds paths.
        labels: ``(n_q, k)`` labels of the items, if the index holds labels.
        similarity: the similarity the scores are.
    """

    scores: np.ndarray
    ids: np.ndarray
    positions: np.ndarray
    ties_at_cut: np.ndarray | None
    cut_tied: np.ndarray
    paths: list[list[str]] | None
    labels: np.ndarray | None
    similarity: str

    def rows(self) -> list[list[dict[str, Any]]]:
        """Per query, one dict per result: ``rank`` (from 1), ``id``, ``score``, ``path``, ``label``.

        ``path`` and ``label`` are present when the index holds them.
        """
        out = []
        for i in range(self.ids.shape[0]):
            row = []
            for j in range(self.ids.shape[1]):
                item: dict[str, Any] = {
                    "rank": j + 1,
                    "id": int(self.ids[i, j]),
                    "score": float(self.scores[i, j]),
                }
                if self.paths is not None:
                    item["path"] = self.paths[i][j]
                if self.labels is not None:
                    item["label"] = self.labels[i, j].item()
                row.append(item)
            out.append(row)
        return out


def _select_top(
    keys: torch.Tensor, positions: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest keys of each row, the earliest columns first among equal keys, sorted.

    ``keys`` / ``positions`` are ``(b, m)`` with columns in increasing-position order among equal
    keys (as :func:`exact_top_k` builds them), ``k <= m``. ``torch.topk`` gives the k-th largest
    value exactly (its choice among ties is left unused); the columns above it are taken, then the
    first columns equal to it, and a stable sort orders the ``k`` chosen ones.
    """
    b = keys.shape[0]
    threshold = torch.topk(keys, k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    above = keys > threshold
    equal = keys == threshold
    need = k - above.sum(dim=1, keepdim=True)
    chosen = above | (equal & (equal.cumsum(dim=1) <= need))
    columns = chosen.nonzero()[:, 1].view(b, k)  # row-major: each row's columns in order
    top_keys, top_pos = keys.gather(1, columns), positions.gather(1, columns)
    order = torch.sort(top_keys, dim=1, descending=True, stable=True).indices
    return top_keys.gather(1, order), top_pos.gather(1, order)


@keeps_torch_threads
def exact_top_k(
    queries: Any,
    gallery: Any,
    k: int,
    similarity: str = "cosine",
    *,
    query_block: int = 256,
    gallery_block: int = 16384,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact top-``k`` ranking keys of every query over ``gallery``, in bounded memory.

    Args:
        queries: ``(n_q, d)`` embeddings.
        gallery: ``(n_g, d)`` embeddings, ``k <= n_g``, on the queries' device.
        k: results per query.
        similarity: ``"cosine"``, ``"dot"`` or ``"euclidean"``.
        query_block: queries scored at once.
        gallery_block: gallery items scored at once (the score block is
            ``query_block x gallery_block`` float64).

    Returns:
        ``(keys, positions, ties)``: ``(n_q, k)`` float64 keys of :func:`rankwise.similarity.
        ranking_keys` (largest first; among equal keys the smaller gallery row first), their
        ``(n_q, k)`` int64 gallery rows, and ``(n_q,)`` int64 counts of the gallery rows *not*
        returned whose key equals the k-th key.

    Example:
        >>> import torch
        >>> from rankwise.search import exact_top_k
        >>> gallery = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [-1.0, 0.0]])
        >>> keys, rows, ties = exact_top_k(torch.tensor([[3.0, 0.0]]), gallery, k=1)
        >>> keys.tolist(), rows.tolist(), ties.tolist()  # rows 0 and 2 both have cosine 1
        ([[1.0]], [[0]], [1])
    """
    similarity = check_similarity(similarity)
    k = check_scalar(k, "k", Interval("integer", 1, None))
    q_all = check_embeddings(queries, "queries")
    g_all = check_embeddings(gallery, "gallery", device=q_all.device)
    if g_all.shape[1] != q_all.shape[1]:
        raise ValueError(
            f"`queries` have dimension {q_all.shape[1]} but the gallery has {g_all.shape[1]}; "
            "embed both with the same model."
        )
    if k > g_all.shape[0]:
        raise ValueError(
            f"`k`={k} exceeds the {g_all.shape[0]} gallery items; pass k <= {g_all.shape[0]}."
        )
    return _exact_top_k(q_all, g_all, k, similarity, query_block, gallery_block)


def _exact_top_k(
    q_all: torch.Tensor,
    g_all: torch.Tensor,
    k: int,
    similarity: str,
    query_block: int,
    gallery_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`exact_top_k` of checked operands (``1 <= k <= n_g``, equal dimensions).

    Gallery blocks in the outer loop (each converted for the screening once), query blocks
    inside; the running top-k of every query is merged with one block's candidates at a time.
    """
    query_block = check_scalar(query_block, "query_block", Interval("integer", 1, None))
    gallery_block = check_scalar(gallery_block, "gallery_block", Interval("integer", 1, None))
    if similarity != "cosine" and torch.float64 in (q_all.dtype, g_all.dtype):
        ExactOperands.build(q_all, g_all, similarity)  # refuses keys that would overflow float64
    n_q, n_g, device = q_all.shape[0], g_all.shape[0], q_all.device
    top = _RunningTop(n_q, device)
    for start in range(0, n_g, gallery_block):
        g = g_all[start : start + gallery_block]
        screen = _Screen.of(g, similarity) if g.shape[0] > k else None
        merged = _RunningTop(n_q, device)
        for lo in range(0, n_q, query_block):
            q = q_all[lo : lo + query_block]
            keys, pos = _block_candidates(q, g, screen, start, k, similarity)
            merged.put(lo, *top.merge(lo, keys, pos, min(k, start + g.shape[0])))
        top = merged
    ties = top.ties - (top.keys == top.keys[:, -1:]).sum(dim=1)
    return top.keys, top.positions, ties


class _RunningTop:
    """Every query's best keys so far (largest first, ties by gallery row) and its tie count.

    ``ties[i]`` counts the gallery rows seen so far whose key equals query ``i``'s last kept key,
    kept or not. It stays exact without keeping the dropped rows: when the k-th key rises, every
    earlier row with the new k-th key scored above the old one and so is still kept; a row of a
    block left out by the screening has a key below that block's k-th, so below the new k-th.
    """

    def __init__(self, n_q: int, device: torch.device) -> None:
        self.keys = torch.empty(n_q, 0, dtype=torch.float64, device=device)
        self.positions = torch.empty(n_q, 0, dtype=torch.int64, device=device)
        self.ties = torch.zeros(n_q, dtype=torch.int64, device=device)

    def merge(
        self, lo: int, block_keys: torch.Tensor, block_pos: torch.Tensor, keep: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``lo:lo + b`` merged with a block's candidates: ``keep`` keys, positions, ties."""
        hi = lo + block_keys.shape[0]
        old_keys, old_pos, old_ties = self.keys[lo:hi], self.positions[lo:hi], self.ties[lo:hi]
        # the kept rows first: they precede the block's, so among equal keys the column order is
        # the row order, as _select_top needs
        keys, pos = _select_top(
            torch.cat([old_keys, block_keys], dim=1), torch.cat([old_pos, block_pos], dim=1), keep
        )
        kth = keys[:, -1:]
        if old_keys.shape[1]:
            before = torch.where(
                kth[:, 0] == old_keys[:, -1], old_ties, (old_keys == kth).sum(dim=1)
            )
        else:
            before = torch.zeros_like(old_ties)
        return keys, pos, before + (block_keys == kth).sum(dim=1)

    def put(self, lo: int, keys: torch.Tensor, positions: torch.Tensor, ties: torch.Tensor) -> None:
        """Store the merged rows ``lo:lo + b`` (all rows keep the same number of keys)."""
        if self.keys.shape[1] != keys.shape[1]:
            n_q = self.keys.shape[0]
            self.keys = self.keys.new_empty(n_q, keys.shape[1])
            self.positions = self.positions.new_empty(n_q, keys.shape[1])
        hi = lo + keys.shape[0]
        self.keys[lo:hi], self.positions[lo:hi], self.ties[lo:hi] = keys, positions, ties


# Screening margin, in units of float64 rounding per dimension: the exact key and the BLAS score of
# a pair each lie within about (d + 2) u |q| |g| (dot), (d + 2) u (|q| + |g|)^2 (euclidean) or
# (10 d + 15) u (cosine key) of the real value, whatever the order of the BLAS sums (Higham,
# "Accuracy and Stability of Numerical Algorithms", 2nd ed., Sec. 3.1); 64 (d + 8) u covers each
# with room to spare.
_MARGIN = 64.0
_UNIT = 2.0**-53
_TINY = 2.0**-1070  # a generous bound on the subnormal error of one product


@dataclass(frozen=True)
class _Screen:
    """One side of the screening product, float64: unit rows (cosine) or rows and norms.

    Cosine is screened on cosines: with ``e1`` the error of an approximate cosine and ``e2`` that
    of an exact key ``cos |cos|``, the band is ``2 e1 + sqrt(2 e2)`` (``sign(y) sqrt|y|``, the
    inverse of ``c |c|``, rises by at most ``sqrt(2 h)`` over an interval of length ``h``);
    euclidean on ``q . g - ||g||^2 / 2``, whose order in a row is that of ``-||q - g||^2``.
    """

    rows: torch.Tensor
    norms: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor, similarity: str) -> _Screen:
        """The screening operands of checked rows ``x``."""
        x64 = x.to(torch.float64)
        if similarity == "cosine" and x.dtype == torch.float64:
            # float64 rows could overflow their squared norms: powers of two change no cosine
            x64 = torch.ldexp(x64, -torch.frexp(x64.abs().amax(dim=1, keepdim=True))[1])
        norms = torch.linalg.vector_norm(x64, dim=1)
        if similarity == "cosine":
            safe = torch.where(norms > 0, norms, torch.ones_like(norms))
            return cls(x64 / safe[:, None], norms)
        return cls(x64, norms)

    def scores(self, q: _Screen, similarity: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(approx, band)``, ``(b, n)`` and ``(b,)``, of queries ``q`` against this gallery side.

        Every item of a row's exact top k, or tied with its exact k-th key, has ``approx >= t -
        band``, ``t`` the row's k-th largest ``approx`` (module docstring).
        """
        rel = _MARGIN * (q.rows.shape[1] + 8) * _UNIT
        if similarity == "cosine":
            band = torch.full_like(q.norms, 2.0 * rel + (2.0 * rel) ** 0.5)
            return q.rows @ self.rows.T, band
        g_max = float(self.norms.max())
        tiny = q.rows.shape[1] * _TINY
        if similarity == "dot":
            return q.rows @ self.rows.T, rel * q.norms * g_max + tiny
        half = -0.5 * self.norms * self.norms
        return torch.addmm(half[None], q.rows, self.rows.T), rel * (q.norms + g_max) ** 2 + tiny


def _block_candidates(
    q: torch.Tensor,
    g: torch.Tensor,
    screen: _Screen | None,
    offset: int,
    k: int,
    similarity: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact keys of block items, among them all that can be in its top ``k`` or tie with its k-th.

    A BLAS float64 matrix product scores the block; an item whose score is below the k-th best
    score minus the band cannot reach the top ``k`` nor tie with the k-th key (module
    docstring), so only the ``w`` best-scored items of each row get exact keys, ``w`` grown until
    the band lies inside them (every item when ``screen`` is None: a block of at most ``k``).
    Returns ``(keys, positions)``, ``(b, w)``, each row in position order.
    """
    b, n = q.shape[0], g.shape[0]
    if screen is None:
        cols = torch.arange(n, device=q.device).expand(b, n)
    else:
        approx, band = screen.scores(_Screen.of(q, similarity), similarity)
        width = min(n, k + 8)
        while True:
            values, cols = torch.topk(approx, width, dim=1)
            if width == n or bool((values[:, -1] < values[:, k - 1] - band).all()):
                break
            width = min(n, 4 * width)
        cols = cols.sort(dim=1).values
    width = cols.shape[1]
    used, inverse = torch.unique(cols, return_inverse=True)
    ops = ExactOperands.build(q, g[used], similarity)
    rows = torch.arange(b, device=q.device).repeat_interleave(width)
    keys = ops.pair_keys(rows, inverse.reshape(-1)).view(b, width)
    return keys, cols + offset


class EmbeddingIndex:
    """Exact k-nearest-neighbour search of float embeddings, with ids, paths, labels and metadata.

    Results are ordered as in the module docstring; ids are those given to :meth:`add` (default:
    the insertion positions ``0, 1, ...``). :meth:`save` / :meth:`load` keep the embeddings in a
    ``.npz`` file and the rest (similarity, dimension, paths, the run's metadata) in a ``.json``
    file beside it; nothing pickled is ever read.

    Args:
        dim: embedding dimension ``d``.
        similarity: ``"cosine"`` (default), ``"dot"`` or ``"euclidean"`` (alias
            ``"neg_euclidean"``).
        backend: ``"exact"`` (default) or ``"faiss"`` (needs the ``faiss`` extra).
        dtype: ``"float32"`` (default) or ``"float64"``: how the embeddings are stored.
        metadata: JSON-serialisable facts saved with the index (e.g. the run, the model).

    Example:
        >>> import numpy as np
        >>> from rankwise.search import EmbeddingIndex
        >>> index = EmbeddingIndex(dim=2, similarity="cosine")
        >>> index.add(np.array([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]]), paths=["a", "b", "c"])
        >>> result = index.search(np.array([[1.0, 0.1]]), k=2)
        >>> result.positions.tolist(), result.paths  # rows 0 and 2 tie: insertion order
        ([[0, 2]], [['a', 'c']])
        >>> result.ties_at_cut.tolist()  # nothing left out ties with the 2nd result
        [0]
    """

    def __init__(
        self,
        dim: int,
        similarity: str = "cosine",
        *,
        backend: str = "exact",
        dtype: str = "float32",
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self.dim = check_scalar(dim, "dim", Interval("integer", 1, None))
        self.similarity = check_similarity(similarity)
        self.backend = check_choice(backend, "backend", BACKENDS)
        self.dtype = check_choice(dtype, "dtype", tuple(_DTYPES))
        if self.backend == "faiss":
            require(("faiss",), "faiss", "EmbeddingIndex(backend='faiss')")
        self.metadata: dict[str, Any] = dict(metadata or {})
        try:
            json.dumps(self.metadata)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"`metadata` must be JSON-serialisable: {exc}") from None
        self._chunks: list[np.ndarray] = []
        self._id_chunks: list[np.ndarray] = []
        self._label_chunks: list[np.ndarray] = []
        self._paths: list[str] = []
        self._has_paths: bool | None = None
        self._has_labels: bool | None = None
        self._size = 0
        self._faiss: Any = None

    def __len__(self) -> int:
        return self._size

    @property
    def ntotal(self) -> int:
        """Number of stored embeddings."""
        return self._size

    @property
    def nbytes(self) -> int:
        """Bytes taken by the stored embeddings."""
        return int(sum(c.nbytes for c in self._chunks))

    def add(
        self,
        embeddings: Any,
        ids: Any = None,
        paths: Sequence[str | os.PathLike] | None = None,
        labels: Any = None,
    ) -> None:
        """Append embeddings, with optional ids, paths and labels (one per row).

        Paths and labels are all-or-nothing: once the index holds them, every later ``add`` must
        give them too (and the other way round), so no item is ever without one.

        Args:
            embeddings: ``(n, dim)`` finite floats.
            ids: ``(n,)`` integer ids returned by searches (default: the insertion positions).
            paths: ``n`` paths (or any strings naming the items).
            labels: ``(n,)`` integer or string labels.
        """
        x = check_embeddings(embeddings, "embeddings")
        n = x.shape[0]
        if x.shape[1] != self.dim:
            raise ValueError(
                f"`embeddings` have dimension {x.shape[1]} but the index holds dimension "
                f"{self.dim}."
            )
        id_array = self._check_ids(ids, n)
        path_list = self._check_optional(paths, n, "paths")
        label_array = self._check_labels(labels, n)
        self._chunks.append(x.detach().cpu().numpy().astype(_DTYPES[self.dtype], copy=True))
        self._id_chunks.append(id_array)
        if path_list is not None:
            self._paths.extend(path_list)
        if label_array is not None:
            self._label_chunks.append(label_array)
        self._has_paths = path_list is not None
        self._has_labels = label_array is not None
        self._size += n
        self._faiss = None

    def _check_ids(self, ids: Any, n: int) -> np.ndarray:
        if ids is None:
            return np.arange(self._size, self._size + n, dtype=np.int64)
        id_array = np.asarray(ids)
        if id_array.shape != (n,) or id_array.dtype.kind not in "iu":
            raise ValueError(f"`ids` must be a 1-D integer array of length {n} (one per row).")
        return id_array.astype(np.int64)

    def _check_optional(self, paths: Any, n: int, name: str) -> list[str] | None:
        self._check_consistent(paths is not None, self._has_paths, name)
        if paths is None:
            return None
        if isinstance(paths, (str, os.PathLike)):
            raise ValueError(f"`{name}` must be a sequence of {n} paths, not one path.")
        listed = [os.fspath(p) for p in paths]
        if len(listed) != n:
            raise ValueError(f"`{name}` has {len(listed)} entries for {n} embeddings.")
        return listed

    def _check_labels(self, labels: Any, n: int) -> np.ndarray | None:
        self._check_consistent(labels is not None, self._has_labels, "labels")
        if labels is None:
            return None
        array = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
        if array.shape != (n,) or array.dtype.kind not in "iuU":
            raise ValueError(
                f"`labels` must be a 1-D array of {n} integers or strings (one per row), got "
                f"shape {array.shape} and dtype {array.dtype}."
            )
        if self._label_chunks and (array.dtype.kind == "U") != (
            self._label_chunks[0].dtype.kind == "U"
        ):
            raise ValueError("`labels` must be all integers or all strings across add() calls.")
        return array.astype(np.int64) if array.dtype.kind in "iu" else array

    def _check_consistent(self, given: bool, held: bool | None, name: str) -> None:
        if held is not None and given != held:
            state = "holds" if held else "holds no"
            raise ValueError(f"the index {state} {name}; pass `{name}` to every add() or to none.")

    def _database(self) -> np.ndarray:
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
            self._id_chunks = [np.concatenate(self._id_chunks)]
            if self._label_chunks:
                self._label_chunks = [np.concatenate(self._label_chunks)]
        if not self._chunks:
            return np.zeros((0, self.dim), dtype=_DTYPES[self.dtype])
        return self._chunks[0]

    def embeddings(self) -> np.ndarray:
        """The stored ``(ntotal, dim)`` embeddings, in insertion order."""
        return self._database()

    @property
    def ids(self) -> np.ndarray:
        """The ``(ntotal,)`` int64 ids, in insertion order."""
        self._database()
        return self._id_chunks[0] if self._id_chunks else np.zeros(0, dtype=np.int64)

    @property
    def paths(self) -> list[str] | None:
        """The items' paths in insertion order (None: the index holds no paths)."""
        return list(self._paths) if self._has_paths else None

    @property
    def labels(self) -> np.ndarray | None:
        """The items' labels in insertion order (None: the index holds no labels)."""
        self._database()
        return self._label_chunks[0] if self._has_labels and self._label_chunks else None

    def search(
        self,
        queries: Any,
        k: int,
        *,
        query_block: int = 256,
        gallery_block: int = 16384,
        device: str | torch.device | None = None,
    ) -> SearchResult:
        """The ``k`` most similar stored items of every query.

        Args:
            queries: ``(n_q, dim)`` finite floats.
            k: results per query, ``1 <= k <= ntotal``.
            query_block: queries scored at once.
            gallery_block: stored items scored at once (exact backend): memory is
                ``O(query_block x (gallery_block + k))`` whatever ``ntotal``.
            device: where the exact backend scores (default: the CPU; e.g. ``"cuda"``).

        Returns:
            A :class:`SearchResult`: by decreasing score, ties by insertion order.
        """
        k = check_scalar(k, "k", Interval("integer", 1, None))
        if self._size == 0:
            raise ValueError("the index is empty (0 items); add embeddings with add() first.")
        if k > self._size:
            raise ValueError(
                f"`k`={k} exceeds the {self._size} items in the index; pass k <= {self._size}."
            )
        dev = torch.device(device) if device is not None else torch.device("cpu")
        q = check_embeddings(queries, "queries", device=dev)
        if q.shape[1] != self.dim:
            raise ValueError(
                f"`queries` have dimension {q.shape[1]} but the index holds dimension {self.dim}; "
                "embed both with the same model."
            )
        if self.backend == "faiss":
            scores, positions, tied = self._search_faiss(q, k, query_block)
            return self._result(scores, positions, None, tied)
        gallery = torch.from_numpy(self._database()).to(dev)  # checked finite by add()
        keys, rows, ties = _exact_top_k(q, gallery, k, self.similarity, query_block, gallery_block)
        scores = similarity_from_keys(keys.cpu(), self.similarity).numpy()
        ties_np = ties.cpu().numpy()
        return self._result(scores, rows.cpu().numpy(), ties_np, ties_np > 0)

    def _result(
        self,
        scores: np.ndarray,
        positions: np.ndarray,
        ties: np.ndarray | None,
        tied: np.ndarray,
    ) -> SearchResult:
        labels = self.labels
        return SearchResult(
            scores=scores,
            ids=self.ids[positions],
            positions=positions,
            ties_at_cut=ties,
            cut_tied=tied,
            paths=[[self._paths[j] for j in row] for row in positions.tolist()]
            if self._has_paths
            else None,
            labels=labels[positions] if labels is not None else None,
            similarity=self.similarity,
        )

    def _faiss_index(self) -> Any:
        if self._faiss is None:
            (faiss,) = require(("faiss",), "faiss", "EmbeddingIndex(backend='faiss')")
            data = np.ascontiguousarray(self._database(), dtype=np.float32)
            if self.similarity == "euclidean":
                index = faiss.IndexFlatL2(self.dim)
            else:
                index = faiss.IndexFlatIP(self.dim)
                if self.similarity == "cosine":
                    data = _unit_rows(data)
            index.add(data)
            self._faiss = index
        return self._faiss

    def _search_faiss(
        self, q: torch.Tensor, k: int, query_block: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Faiss flat search of ``k + 1`` results (when there are more items than ``k``).

        The extra result says whether the cut falls inside a tie; the returned items are put
        in (score, insertion position) order, as the exact backend orders them.
        """
        query_block = check_scalar(query_block, "query_block", Interval("integer", 1, None))
        index = self._faiss_index()
        fetch = min(k + 1, self._size)
        x = np.ascontiguousarray(q.detach().cpu().numpy(), dtype=np.float32)
        if self.similarity == "cosine":
            x = _unit_rows(x)
        scores = np.empty((x.shape[0], fetch), dtype=np.float64)
        rows = np.empty((x.shape[0], fetch), dtype=np.int64)
        for lo in range(0, x.shape[0], query_block):
            found, where = index.search(x[lo : lo + query_block], fetch)
            scores[lo : lo + query_block] = found
            rows[lo : lo + query_block] = where
        if self.similarity == "euclidean":  # IndexFlatL2 returns squared distances
            scores = -np.sqrt(np.maximum(scores, 0.0))
        order = np.lexsort((rows, -scores), axis=1)
        scores = np.take_along_axis(scores, order, axis=1)
        rows = np.take_along_axis(rows, order, axis=1)
        tied = scores[:, k] == scores[:, k - 1] if fetch > k else np.zeros(len(x), dtype=bool)
        return scores[:, :k], rows[:, :k], tied

    # -- files ------------------------------------------------------------------------------------

    @staticmethod
    def files(path: str | os.PathLike) -> tuple[Path, Path]:
        """The two files of a saved index, ``(PATH.npz, PATH.json)``, from either or their stem."""
        path = Path(path)
        if path.suffix in (".npz", ".json"):
            path = path.with_suffix("")
        return path.with_name(path.name + ".npz"), path.with_name(path.name + ".json")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the index to ``PATH.npz`` (arrays) and ``PATH.json`` (the rest), atomically.

        The ``.json`` file is written last and records the ``.npz`` file's SHA-256, so a pair
        whose other half was replaced or cut short is refused by :meth:`load`.

        Args:
            path: ``PATH``, ``PATH.npz`` or ``PATH.json``.

        Returns:
            The ``.json`` file (the one :meth:`load` reads first).
        """
        arrays_path, meta_path = self.files(path)
        arrays: dict[str, Any] = {"embeddings": self._database(), "ids": self.ids}
        labels = self.labels
        if labels is not None:
            arrays["labels"] = labels
        atomic_write(arrays_path, lambda handle: np.savez(handle, **arrays))
        meta = {
            "kind": _KIND,
            "format": _FORMAT,
            "similarity": self.similarity,
            "dim": self.dim,
            "dtype": self.dtype,
            "ntotal": self._size,
            "arrays": arrays_path.name,
            "arrays_sha256": _sha256(arrays_path),
            "has_labels": bool(self._has_labels),
            "paths": self.paths,
            "metadata": self.metadata,
        }
        text = json.dumps(meta, indent=1) + "\n"
        atomic_write(meta_path, lambda handle: handle.write(text.encode()))
        return meta_path

    @staticmethod
    def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
        """The ``.json`` part of a saved index (similarity, dim, ntotal, paths, metadata, ...)."""
        _, meta_path = EmbeddingIndex.files(path)
        if not meta_path.is_file():
            raise FileNotFoundError(f"no EmbeddingIndex at {str(meta_path)!r} (its .json file).")
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{str(meta_path)!r} is not an EmbeddingIndex file: {exc}") from None
        if not isinstance(meta, dict) or meta.get("kind") != _KIND:
            raise ValueError(
                f"{str(meta_path)!r} is not an EmbeddingIndex file (written by "
                "EmbeddingIndex.save)."
            )
        if meta.get("format") != _FORMAT:
            raise ValueError(f"{str(meta_path)!r}: unsupported index format {meta.get('format')}.")
        return meta

    @classmethod
    def load(cls, path: str | os.PathLike, *, backend: str = "exact") -> EmbeddingIndex:
        """Read an index written by :meth:`save` (``PATH``, ``PATH.npz`` or ``PATH.json``).

        Args:
            path: the saved index.
            backend: the backend to search it with (``"exact"`` or ``"faiss"``).

        Raises:
            FileNotFoundError: a file of the pair is missing.
            ValueError: not an index, or its ``.npz`` is not the one its ``.json`` describes.
        """
        meta = cls.read_metadata(path)
        arrays_path = cls.files(path)[1].with_name(meta["arrays"])
        if not arrays_path.is_file():
            raise FileNotFoundError(f"the index's arrays {str(arrays_path)!r} are missing.")
        if _sha256(arrays_path) != meta["arrays_sha256"]:
            raise ValueError(
                f"{str(arrays_path)!r} is not the file its index metadata describes (its SHA-256 "
                "differs): it was replaced or cut short; save the index again."
            )
        with np.load(arrays_path, allow_pickle=False) as data:
            embeddings, ids = data["embeddings"], data["ids"]
            labels = data["labels"] if meta["has_labels"] else None
        index = cls(
            int(meta["dim"]),
            meta["similarity"],
            backend=backend,
            dtype=meta["dtype"],
            metadata=meta["metadata"],
        )
        if int(meta["ntotal"]):
            index.add(embeddings, ids=ids, paths=meta["paths"], labels=labels)
        return index

    def __repr__(self) -> str:
        return (
            f"EmbeddingIndex(dim={self.dim}, similarity={self.similarity!r}, "
            f"backend={self.backend!r}, ntotal={self._size})"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows divided by their norms (zero rows stay zero: cosine 0, as ``F.normalize``)."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.where(norms > 0, norms, 1.0), dtype=np.float32)
