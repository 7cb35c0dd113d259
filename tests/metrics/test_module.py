"""RetrievalMetric: accumulation over batches, reset, errors, storage device."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score

from rankwise.metrics.module import RetrievalMetric
from rankwise.metrics.retrieval import retrieval_metrics


def _data(n: int = 90, dim: int = 8, classes: int = 7, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=gen)
    centers = torch.randn(classes, dim, generator=gen)
    return centers[labels] + torch.randn(n, dim, generator=gen), labels


def _assert_same_report(a, b):
    assert a.map == pytest.approx(b.map, abs=1e-12)
    assert a.map_at_r == pytest.approx(b.map_at_r, abs=1e-12)
    assert a.r_precision == pytest.approx(b.r_precision, abs=1e-12)
    assert a.recall_at == pytest.approx(b.recall_at, abs=1e-12)
    assert a.precision_at == pytest.approx(b.precision_at, abs=1e-12)
    assert (a.n_queries, a.n_gallery, a.n_queries_without_relevant) == (
        b.n_queries,
        b.n_gallery,
        b.n_queries_without_relevant,
    )
    torch.testing.assert_close(a.per_query_ap, b.per_query_ap, equal_nan=True)


def test_batches_equal_one_call_on_the_concatenation(device):
    x, labels = _data()
    x, labels = x.to(device), labels.to(device)
    metric = RetrievalMetric(ks=(1, 5, 20))
    bounds = [0, 17, 18, 50, 90]  # uneven batches, one of size 1
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        metric.update(x[lo:hi], labels[lo:hi])
    assert metric.n_samples == 90
    _assert_same_report(metric.compute(), retrieval_metrics(x, labels, ks=(1, 5, 20)))


def test_map_matches_sklearn_average_precision_per_query():
    # independent reference: leave-one-out AP of every query with scikit-learn (no ties here)
    x, labels = _data(n=60, seed=3)
    metric = RetrievalMetric(ks=(1,))
    metric(x[:25], labels[:25].numpy())  # forward is update, numpy labels accepted
    metric(x[25:].numpy(), labels[25:])
    report = metric.compute()
    xn = torch.nn.functional.normalize(x.double(), dim=1)
    scores = (xn @ xn.T).numpy()
    aps = []
    for i in range(60):
        others = np.arange(60) != i
        relevant = (labels[others] == labels[i]).numpy()
        if relevant.any():
            aps.append(average_precision_score(relevant, scores[i, others]))
    assert report.map == pytest.approx(float(np.mean(aps)), abs=1e-9)
    assert report.n_queries_without_relevant == 60 - len(aps)


def test_separate_gallery_mode():
    q, ql = _data(n=30, seed=1)
    g, gl = _data(n=50, seed=2)
    metric = RetrievalMetric(ks=(1, 10), gallery_mode="separate", similarity="dot")
    metric.update(q[:10], ql[:10])
    metric.update(q[10:], ql[10:])
    metric.update_gallery(g[:20], gl[:20])
    metric.update_gallery(g[20:], gl[20:])
    assert (metric.n_samples, metric.n_gallery_samples) == (30, 50)
    expected = retrieval_metrics(q, ql, g, gl, ks=(1, 10), similarity="dot")
    _assert_same_report(metric.compute(), expected)


def test_reset_and_empty_compute():
    metric = RetrievalMetric()
    with pytest.raises(ValueError, match="before any update"):
        metric.compute()
    x, labels = _data()
    metric.update(x, labels)
    first = metric.compute().map
    metric.reset()
    assert metric.n_samples == 0
    with pytest.raises(ValueError, match="before any update"):
        metric.compute()
    metric.update(x, labels)
    assert metric.compute().map == first


def test_stored_copies_are_detached_copies_on_store_device(device):
    x, labels = _data()
    x = x.to(device).requires_grad_(True)
    labels = labels.to(device)
    metric = RetrievalMetric(store_device="cpu")
    metric.update(x, labels)
    query, query_labels, gallery, _ = metric._gathered()
    assert query.device.type == "cpu" and query_labels.device.type == "cpu" and gallery is None
    assert not query.requires_grad
    before = metric.compute().map
    with torch.no_grad():
        x.mul_(-1.0)  # the caller reuses its buffer: the stored copy must not change
    assert metric.compute().map == before
    kept = RetrievalMetric(store_device=None)
    kept.update(x.detach(), labels)
    assert kept._gathered()[0].device == x.device


def test_gathered_still_works_as_the_deprecated_data_parallel_hook():
    # a subclass that "gathers" a second shard: compute() must see both shards (sync() replaces
    # this hook; an override now warns when the metric is built)
    x, labels = _data(n=80)

    class TwoShards(RetrievalMetric):
        def _gathered(self):
            local_q, local_l, _, _ = super()._gathered()
            return torch.cat([local_q, x[40:]]), torch.cat([local_l, labels[40:]]), None, None

    with pytest.warns(DeprecationWarning, match="overrides RetrievalMetric._gathered"):
        metric = TwoShards(ks=(1, 10))
    metric.update(x[:40], labels[:40])
    _assert_same_report(metric.compute(), retrieval_metrics(x, labels, ks=(1, 10)))


def test_batch_validation_errors():
    x, labels = _data()
    metric = RetrievalMetric()
    bad = x[:5].clone()
    bad[2, 0] = math.nan
    with pytest.raises(ValueError, match="NaN"):
        metric.update(bad, labels[:5])
    assert metric.n_samples == 0  # a rejected batch is not stored
    metric.update(x[:5], labels[:5])
    with pytest.raises(ValueError, match="dimension 3"):
        metric.update(x[5:10, :3], labels[5:10])
    with pytest.raises(ValueError, match="multi-hot"):
        metric.update(x[5:10], torch.ones(5, 4))
    with pytest.raises(ValueError, match="length 4"):
        metric.update(x[5:10], labels[5:9])
    with pytest.raises(ValueError, match="gallery_mode='separate'"):
        metric.update_gallery(x[5:10], labels[5:10])
    separate = RetrievalMetric(gallery_mode="separate")
    separate.update(x, labels)
    with pytest.raises(ValueError, match="update_gallery"):
        separate.compute()
    separate.update_gallery(x[:, :4], labels)
    with pytest.raises(ValueError, match="dimension"):
        separate.compute()
    with pytest.raises(ValueError, match="gallery_mode"):
        RetrievalMetric(gallery_mode="both")
    with pytest.raises(ValueError, match="`ks`"):
        RetrievalMetric(ks=(0, 5))
    with pytest.raises(ValueError, match="`similarity`"):
        RetrievalMetric(similarity="hamming")
    with pytest.raises(ValueError, match="`ties`"):
        RetrievalMetric(ties="random")


def test_multi_hot_batches():
    x, _ = _data(n=40)
    gen = torch.Generator().manual_seed(5)
    multi_hot = torch.rand(40, 6, generator=gen) < 0.3
    metric = RetrievalMetric(ks=(1, 5))
    metric.update(x[:15], multi_hot[:15])
    metric.update(x[15:], multi_hot[15:])
    _assert_same_report(metric.compute(), retrieval_metrics(x, multi_hot, ks=(1, 5)))
    with pytest.raises(ValueError, match="6 columns"):
        metric.update(x[:3], multi_hot[:3, :5])


def test_retrieval_metric_rejects_non_integer_ks_and_accepts_a_single_k():
    with pytest.raises(ValueError, match="ks"):
        RetrievalMetric(ks=(1.7,))
    assert RetrievalMetric(ks=10).ks == (10,)


def test_declared_states_and_sync_without_a_process_group():
    x, labels = _data(n=30)
    metric = RetrievalMetric(ks=(1,))
    assert list(metric.metric_state) == [
        "query_embeddings",
        "query_labels",
        "gallery_embeddings",
        "gallery_labels",
    ]
    metric.update(x[:10], labels[:10])
    metric.update(x[10:], labels[10:])
    assert [t.shape[0] for t in metric.metric_state["query_embeddings"]] == [10, 20]
    before = metric.compute()
    metric.sync()  # no process group: nothing to gather, nothing changes
    assert not metric.synced and metric.n_samples == 30
    assert metric.compute().per_query_ap.equal(before.per_query_ap)
    with pytest.raises(ValueError, match="must be 'cat'"):
        metric.add_state("scores", default=[], dist_reduce_fx="sum")
    with pytest.raises(ValueError, match="must be an empty list"):
        metric.add_state("scores", default=torch.zeros(3))
    with pytest.raises(ValueError, match="already declared"):
        metric.add_state("query_labels", default=[])


def test_sync_gathers_every_rank_and_compute_equals_the_union(sharded_results):
    from sharded_worker import assert_identical

    for rank, results in enumerate(sharded_results):
        out = results["module"]
        for case in ("self", "separate", "unsynced"):
            assert_identical(out[case]["sharded"], out[case]["single"], f"rank {rank} {case}")
        assert out["self_n_samples"] == 90
        assert out["sync_twice"].startswith("RuntimeError: the metric is already synced")
        assert out["update_synced"].startswith("RuntimeError: the metric holds every rank's rows")
        # rank 0 gave 4-dimensional embeddings, rank 1 3-dimensional: the same error everywhere
        assert out["mismatch"].startswith("ValueError: the query batches differ across ranks")
        assert "rank 0: dimension 4" in out["mismatch"] and "rank 1: dimension 3" in out["mismatch"]
    assert sharded_results[0]["module"]["mismatch"] == sharded_results[1]["module"]["mismatch"]
