"""rankwise.similarity: one vocabulary for losses and metrics, the differentiable score matrix,
the exact evaluation keys, and the module's place low in the layering."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rankwise import similarity as sim
from rankwise.losses import AUCLoss, SmoothAPLoss, SOPRCLoss
from rankwise.losses import similarity_matrix as losses_similarity_matrix


def test_one_set_of_names_and_the_alias():
    assert sim.SIMILARITIES == ("cosine", "dot", "euclidean")
    assert [sim.check_similarity(n) for n in (*sim.SIMILARITIES, "neg_euclidean")] == [
        "cosine",
        "dot",
        "euclidean",
        "euclidean",
    ]
    for bad in ("l2", "Cosine", None, 3):
        with pytest.raises(ValueError, match="`similarity` must be one of"):
            sim.check_similarity(bad)
    with pytest.raises(ValueError, match="`metric` must be one of"):
        sim.check_similarity("l2", name="metric")


def test_losses_take_both_spellings_and_keep_the_canonical_one():
    for loss_cls in (SOPRCLoss, SmoothAPLoss, AUCLoss):
        kwargs = {"num_classes": 4} if loss_cls is SOPRCLoss else {}
        for name in ("euclidean", "neg_euclidean"):
            assert loss_cls(similarity=name, **kwargs).similarity == "euclidean"
        with pytest.raises(ValueError, match="`similarity`"):
            loss_cls(similarity="l1", **kwargs)
    assert losses_similarity_matrix is sim.similarity_matrix


def test_differentiable_matrix_is_the_losses_formula():
    torch.manual_seed(0)
    q = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    r = torch.randn(7, 4, dtype=torch.float64)
    cos = F.normalize(q, dim=1) @ F.normalize(r, dim=1).T
    sq = (q * q).sum(1, keepdim=True) + (r * r).sum(1) - 2 * q @ r.T
    for name, want in (
        ("cosine", cos),
        ("dot", q @ r.T),
        ("euclidean", -sq.clamp_min(1e-12).sqrt()),
        ("neg_euclidean", -sq.clamp_min(1e-12).sqrt()),
    ):
        got = sim.similarity_matrix(q, r, name)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda x: sim.similarity_matrix(x, r, "euclidean"), (q,))


def test_ranking_keys_and_values():
    x = torch.tensor([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]])
    keys = sim.ranking_keys(x, similarity="cosine")
    assert keys.dtype == torch.float64
    assert keys[0, 1].item() == (4.0 * 4.0) / (25.0 * 1.0)  # cos |cos| with cos = 4/5
    assert keys[2].tolist() == [0.0, 0.0, 0.0]  # a zero vector: cosine 0, as F.normalize
    values = sim.exact_similarity(x, similarity="cosine")
    assert values[0, 1].item() == 0.8 and values[0, 0].item() == 1.0
    assert sim.exact_similarity(x, x[:2], "euclidean")[0].tolist() == [-0.0, -np.sqrt(18.0)]
    assert sim.exact_similarity(x, None, "dot")[0].tolist() == [25.0, 4.0, 0.0]
    with pytest.raises(ValueError, match="`gallery` has dimension 3"):
        sim.ranking_keys(x, torch.ones(2, 3))


def test_similarity_module_stays_a_lower_layer():
    # imported alone, it pulls in neither the metrics, the losses, training, the CLI nor the
    # config / terminal libraries
    probe = (
        "import sys, rankwise.similarity\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith("
        "('rankwise.', 'pydantic', 'yaml', 'typer', 'rich')))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = out.stdout.split()
    assert loaded and all(
        m in ("rankwise.similarity", "rankwise._validation", "rankwise._threads") for m in loaded
    ), loaded


def test_soprc_pair_scores_use_the_canonical_euclidean_name():
    # RankingLoss stores "euclidean" for both spellings; SOPRC's per-pair scores must follow it
    from rankwise.losses.soprc import _PairScores

    torch.manual_seed(1)
    a, b = torch.randn(6, 3), torch.randn(6, 3)
    loss = SOPRCLoss(num_classes=3, similarity="neg_euclidean")
    scores = _PairScores(a, b, loss.similarity)(torch.arange(6), torch.arange(6))
    torch.testing.assert_close(scores, -(a - b).norm(dim=1))
