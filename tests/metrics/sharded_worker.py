"""Cases of the sharded evaluation run by 2 gloo ranks (torch.multiprocessing.spawn).

Imported by name in the spawned processes (tests/metrics/conftest.py puts this folder on
``sys.path``). Every case returns, per rank, what the rank computed sharded and the same call made
in one process on the whole data (``single``), or the error each rank raised; the tests compare
them field by field. Integer embeddings of a few values make most scores tie (the hard case for
exactness), and some query shares hold no query with a relevant item.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rankwise.metrics import (
    RetrievalMetric,
    pr_curve,
    query_blocks,
    retrieval_metrics,
    sharded_curve,
    sharded_metric,
    sharded_verification,
    verification_metrics,
)
from rankwise.workflows.hashing import hamming_curve_fn, hamming_metric_fn


def tied(n: int, seed: int, classes: int = 5, dim: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Embeddings in {-1, 0, 1}^dim (most scores tie) and class ids."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (n, dim), generator=generator).to(torch.float32)
    return x, torch.randint(0, classes, (n,), generator=generator)


def both(fn: Any, *args: Any, sharded: Any = sharded_metric, **kwargs: Any) -> dict[str, Any]:
    """The sharded call and the one-process call (``fn`` on everything)."""
    return {"sharded": sharded(fn, *args, **kwargs), "single": fn(*args, **kwargs)}


def case_reports(rank: int, world: int) -> dict[str, Any]:
    x, y = tied(203, 0)
    q, ql = tied(61, 1)
    g, gl = tied(90, 2)
    ql[:31] = 9  # rank 0's share (rows 0..29) has no query with a relevant gallery item
    hot = (torch.rand(120, 6, generator=torch.Generator().manual_seed(3)) < 0.3).to(torch.int64)
    out = {}
    for similarity in ("dot", "cosine", "euclidean"):
        for ties in ("expected", "pessimistic"):
            out[f"loo/{similarity}/{ties}"] = both(
                retrieval_metrics, x, y, ks=(1, 5, 202, 500), similarity=similarity, ties=ties
            )
    out["gallery"] = both(retrieval_metrics, q, ql, g, gl, ks=(1, 10, 95))
    out["multi_hot"] = both(retrieval_metrics, x[:120], hot, ks=(1, 3))
    out["numpy_labels"] = both(retrieval_metrics, x, y.numpy(), ks=(1, 4))
    out["partial"] = both(
        functools.partial(retrieval_metrics, similarity="euclidean"), x, y, ks=(2,)
    )
    index = np.where(np.arange(61) % 3 == 0, np.arange(61), -1)  # a few queries are gallery rows
    out["index_array"] = both(retrieval_metrics, q, ql, x[:61], y[:61], exclude_self=index)
    out["one_query"] = both(retrieval_metrics, q[:1], torch.tensor([0]), g, gl, ks=(1,))
    # NDCG@k / MRR (issue 37): cut-offs inside tie groups, on the device loop as well
    for backend in ("numba", "torch"):
        out[f"ndcg_mrr/{backend}"] = both(
            retrieval_metrics, x, y, ks=(1, 2, 3, 7, 60), similarity="dot", backend=backend
        )
    return out


def case_curves(rank: int, world: int) -> dict[str, Any]:
    x, y = tied(203, 0)
    q, ql = tied(61, 1)
    g, gl = tied(90, 2)
    ql[:31] = 9
    return {
        "loo": both(pr_curve, x, y, num_points=21, sharded=sharded_curve),
        "loo_pessimistic": both(pr_curve, x, y, ties="pessimistic", sharded=sharded_curve),
        "gallery": both(pr_curve, q, ql, g, gl, sharded=sharded_curve),
        "kept_rows": both(pr_curve, x, y, keep_per_query=True, sharded=sharded_curve),
    }


def case_hamming(rank: int, world: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(4)
    codes = torch.randn(150, 6, generator=generator)  # 6 bits: at most 7 distinct distances
    labels = torch.randint(0, 4, (150,), generator=generator).numpy()
    return {
        "loo": both(hamming_metric_fn, codes, labels, ks=(1, 10, 149, 500)),
        "gallery": both(hamming_metric_fn, codes[:40], labels[:40], codes[40:], labels[40:]),
        "curve": both(hamming_curve_fn, codes, labels, sharded=sharded_curve),
    }


def old_signature(query, query_labels, gallery=None, gallery_labels=None, *, ks=(1,)):
    """A custom metric_fn written to the old signature (no block call)."""
    return retrieval_metrics(query, query_labels, gallery, gallery_labels, ks=ks, ties="optimistic")


@query_blocks
def fails_on_rank1(query, query_labels, gallery=None, gallery_labels=None, **kwargs):
    """A marked metric_fn that fails on rank 1's block only."""
    if dist.get_rank() == 1:
        raise ValueError("rank 1 could not rank its block")
    return retrieval_metrics(query, query_labels, gallery, gallery_labels, **kwargs)


def caught(call: Any) -> str:
    try:
        call()
    except Exception as exc:  # the test reads the type and message
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def case_contract(rank: int, world: int) -> dict[str, Any]:
    x, y = tied(80, 5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        old = [sharded_metric(old_signature, x, y, ks=(1, 3)) for _ in range(2)]
    return {
        "old": {"sharded": old[0], "again": old[1], "single": old_signature(x, y, ks=(1, 3))},
        "old_warnings": [str(w.message) for w in seen],
        "error": caught(lambda: sharded_metric(fails_on_rank1, x, y, ks=(1,))),
        "no_relevant": caught(lambda: sharded_metric(retrieval_metrics, x, y, x, y + 100, ks=(1,))),
    }


def case_module(rank: int, world: int) -> dict[str, Any]:
    x, y = tied(90, 6)
    q, ql = tied(50, 7)
    out: dict[str, Any] = {}
    metric = RetrievalMetric(ks=(1, 10))
    rows = [slice(0, 20), slice(20, 37)] if rank == 0 else [slice(37, 60), slice(60, 90)]
    for r in rows:
        metric.update(x[r], y[r])
    local_before = metric.compute()
    metric.sync()
    out["self"] = {"sharded": metric.compute(), "single": retrieval_metrics(x, y, ks=(1, 10))}
    out["self_n_samples"] = metric.n_samples
    out["sync_twice"] = caught(metric.sync)
    out["update_synced"] = caught(lambda: metric.update(x[:2], y[:2]))
    metric.unsync()
    out["unsynced"] = {"sharded": metric.compute(), "single": local_before}

    separate = RetrievalMetric(ks=(1, 5), gallery_mode="separate", similarity="dot")
    separate.update(q[:25] if rank == 0 else q[25:], ql[:25] if rank == 0 else ql[25:])
    if rank == 1:  # rank 0 holds no gallery batch
        separate.update_gallery(x, y)
    separate.sync()
    out["separate"] = {
        "sharded": separate.compute(),
        "single": retrieval_metrics(q, ql, x, y, ks=(1, 5), similarity="dot"),
    }
    mismatch = RetrievalMetric()
    mismatch.update(x[:10, : 4 - rank], y[:10])
    out["mismatch"] = caught(mismatch.sync)
    return out


def case_verification(rank: int, world: int) -> dict[str, Any]:
    """sharded_verification against the one-process verification_metrics (pair counts merged)."""
    x, y = tied(101, 0)
    q, ql = tied(61, 1)
    g, gl = tied(90, 2)
    ql[:31] = 9  # rank 0's share has no positive pair: its negatives still count
    hot = (torch.rand(80, 6, generator=torch.Generator().manual_seed(3)) < 0.3).to(torch.int64)
    generator = torch.Generator().manual_seed(9)
    floats = torch.randn(80, 8, generator=generator)  # the approximate (screened) score path
    floats[7] = floats[3]
    float_labels = torch.randint(0, 6, (80,), generator=generator)
    fpr = (1e-3, 0.01, 0.1)

    def pair(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {
            "sharded": sharded_verification(*args, fpr=fpr, **kwargs),
            "single": verification_metrics(*args, fpr=fpr, **kwargs),
        }

    out = {"loo/cosine": pair(x, y), "loo/euclidean": pair(x, y, similarity="euclidean")}
    out["gallery"] = pair(q, ql, g, gl)
    out["multi_hot"] = pair(x[:80], hot)
    out["float"] = pair(floats, float_labels, chunk_size=11)
    index = np.where(np.arange(61) % 3 == 0, np.arange(61), -1)
    out["index_array"] = pair(q, ql, x[:61], y[:61], exclude_self=index)
    out["one_query"] = pair(q[:1], torch.tensor([0]), g, gl)
    return out


CASES = {
    "reports": case_reports,
    "curves": case_curves,
    "hamming": case_hamming,
    "contract": case_contract,
    "module": case_module,
    "verification": case_verification,
}


def main(rank: int, world: int, out_dir: str) -> None:
    """One rank: every case, pickled to ``out_dir/rank{rank}.pkl``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
    )
    try:
        results = {name: case(rank, world) for name, case in CASES.items()}
    finally:
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


def assert_identical(a: Any, b: Any, where: str = "report") -> None:
    """``a`` and ``b`` equal field by field, bit for bit (NaN equal to NaN, dtypes equal)."""
    if hasattr(a, "__dataclass_fields__"):
        assert type(a) is type(b), where
        for name in a.__dataclass_fields__:
            assert_identical(getattr(a, name), getattr(b, name), f"{where}.{name}")
    elif isinstance(a, (torch.Tensor, np.ndarray)):
        a_np, b_np = np.asarray(a), np.asarray(b)
        assert a_np.dtype == b_np.dtype and a_np.shape == b_np.shape, where
        assert np.array_equal(a_np, b_np, equal_nan=True), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_identical(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, float) and np.isnan(a):
        assert isinstance(b, float) and np.isnan(b), where
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b and type(a) is type(b), (where, a, b)
