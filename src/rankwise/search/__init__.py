"""rankwise.search: exact k-nearest-neighbour search of float embeddings, saved with their run.

:class:`EmbeddingIndex` ranks a gallery by the similarities of :mod:`rankwise.similarity`
(cosine, dot, euclidean) with the metrics' exact float64 keys, in bounded memory, breaking ties by
insertion order and counting the ties at the cut (McSherry & Najork, ECIR 2008); an optional faiss
flat index (Johnson, Douze & Jégou, 2019) is the ``faiss`` extra. Binary codes have their own
index, :class:`rankwise.hashing.HammingIndex`.
"""

from .index import BACKENDS, EmbeddingIndex, SearchResult, exact_top_k

__all__ = ["BACKENDS", "EmbeddingIndex", "SearchResult", "exact_top_k"]
