"""The Evaluator alone: embed data once, rank it with metric_fn (leave-one-out or against a
gallery), draw curve_fn; the same report from one process and from either rank of a fake
two-process run, whose ranks embed a shard each."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from rankwise.metrics import pr_curve, retrieval_metrics
from rankwise.training import Evaluator


def clustered(n_classes=4, per_class=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    centers = 2 * torch.randn(n_classes, 5, generator=generator)
    return TensorDataset(centers[labels] + torch.randn(len(labels), 5, generator=generator), labels)


MODEL = torch.nn.Linear(5, 3)
CPU = torch.device("cpu")


def test_the_report_is_the_metric_of_the_embeddings():
    data = clustered()
    ranking = Evaluator(ks=(1, 5), batch_size=7).rank(MODEL, CPU, data, with_curve=True)
    with torch.no_grad():
        embeddings = MODEL(data.tensors[0])
    expected = retrieval_metrics(embeddings, data.tensors[1].numpy(), ks=(1, 5))
    assert ranking.report.to_dict() == expected.to_dict()
    torch.testing.assert_close(ranking.embeddings, embeddings)
    curve = pr_curve(embeddings, data.tensors[1].numpy())
    np.testing.assert_array_equal(ranking.curve.precision, curve.precision)


def test_queries_against_a_gallery():
    queries, gallery = clustered(seed=1), clustered(per_class=9, seed=1)
    report = Evaluator(ks=(1,)).rank(MODEL, CPU, queries, gallery).report
    assert report.n_queries == len(queries) and report.n_gallery == len(gallery)


def test_two_ranks_rank_the_whole_split_in_order(two_ranks):
    data = clustered(per_class=7)  # 28 items: 14 per rank
    alone = Evaluator(ks=(1, 5)).rank(MODEL, CPU, data)
    for rank in (0, 1):
        strategy = two_ranks(rank)
        ranked = Evaluator(ks=(1, 5), strategy=strategy).rank(MODEL, CPU, data)
        assert ranked.report.to_dict() == alone.report.to_dict()
        torch.testing.assert_close(ranked.embeddings, alone.embeddings, rtol=0, atol=0)
        assert strategy.calls == [("embed_split", 28)]


def test_a_custom_metric_and_curve_are_called_as_documented():
    calls = []

    def metric(query, labels, gallery, gallery_labels, *, ks):
        calls.append(("metric", query.shape, gallery, ks))
        return retrieval_metrics(query, labels, gallery, gallery_labels, ks=ks, similarity="dot")

    evaluator = Evaluator(metric, partial(pr_curve, similarity="dot"), ks=(10, 1))
    ranking = evaluator.rank(MODEL, CPU, clustered(), with_curve=True)
    assert calls == [("metric", (24, 3), None, (1, 10))]
    assert ranking.report.similarity == "dot" and ranking.curve is not None


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"metric_fn": "map"}, "`metric_fn` must be a function"),
        ({"curve_fn": 3}, "`curve_fn` must be a function"),
        ({"ks": (0,)}, "`ks`"),
        ({"batch_size": 0}, "`batch_size`"),
        ({"num_workers": -1}, "`num_workers`"),
    ],
)
def test_bad_arguments_are_named(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        Evaluator(**kwargs)


def test_the_model_is_left_in_its_mode():
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Dropout(0.5))
    model.train()
    first = Evaluator().embed(model, clustered(), CPU)[0]
    assert model.training
    torch.testing.assert_close(Evaluator().embed(model, clustered(), CPU)[0], first)  # eval mode
