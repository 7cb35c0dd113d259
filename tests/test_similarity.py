"""rankwise.similarity: one vocabulary for losses and metrics, the differentiable score matrix,
the exact evaluation keys, and the module's place low in the layering."""

from __future__ import annotations

import ast
import math
import random
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

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


# -- exact powers of two on every device (issue 36, item 1) ----------------------------------------
# torch.ldexp multiplies by pow(2, e), which CUDA computes inexactly in float64 (ldexp(1, -4) =
# 0.06249999999999999 there), so cosine lost its ties on a GPU. The powers are now built from
# their IEEE bits by pure torch code, the same on every device: these tests run that code on the
# CPU (and on CUDA when present) against exact values from math.ldexp and fractions.

EXPONENTS = range(-1074, 1024)  # every power of two float64 represents


def test_power_of_two_is_exact_for_every_exponent_of_float64(device):
    """Guards the bit-built 2^e: every representable exponent exactly, 0 below, inf above."""
    e = torch.arange(-1200, 1200, device=device)
    got = sim.power_of_two(e).cpu().tolist()
    want = [math.ldexp(1.0, k) if k <= 1023 else math.inf for k in range(-1200, 1200)]
    assert got == want
    assert [Fraction(v) for v in got[1200 - 1074 : 1200 + 1024]] == [
        Fraction(2) ** k for k in EXPONENTS
    ]


def _edge_values() -> list[float]:
    """Two signs x (2^E, the largest significand, a random one) for every exponent E of float64."""
    rng = random.Random(36)
    values = []
    for exponent in EXPONENTS:
        for significand in (0.5, 1 - 2.0**-53, rng.uniform(0.5, 1)):
            value = math.ldexp(significand, exponent + 1)
            values += [value, -value]
    return values


def test_times_power_of_two_is_correctly_rounded_like_ldexp(device):
    """Guards x * 2^e for every float64 exponent of x and shifts across the whole range: equal to
    C's ldexp (correctly rounded, subnormal results included), not merely close."""
    values = _edge_values()
    x = torch.tensor(values, dtype=torch.float64, device=device)
    for shift in (*range(-2200, 2201, 97), -1075, -1074, -1023, -1022, -969, -53, 53, 1023, 1024):
        got = sim.times_power_of_two(x, torch.tensor(shift, device=device)).cpu().tolist()
        want = []
        for v in values:
            try:
                want.append(math.ldexp(v, shift))
            except OverflowError:
                want.append(math.copysign(math.inf, v))
        assert got == want, shift


def test_cosine_row_scaling_is_exact_for_every_exponent_of_float64(device):
    """Guards the cosine operands' row scaling (the code CUDA runs, here on the CPU too): for a
    row maximum of every float64 exponent, each entry times 2^-e exactly (fractions), largest
    |entry| in [0.5, 1). Before the bit-built powers the subnormal maxima gave inf and NaN."""
    rng = random.Random(7)
    rows = []
    for exponent in EXPONENTS:
        top = math.ldexp(rng.uniform(0.5, 1), exponent + 1)
        rows.append([top, -top, top / 3, math.ldexp(1.0, exponent), 0.0])
    x = torch.tensor(rows, dtype=torch.float64, device=device)
    scaled = sim._power_of_two_row_scale(x).cpu().tolist()
    for row, out in zip(rows, scaled, strict=True):
        shift = -math.frexp(max(abs(v) for v in row))[1]
        assert out == [math.ldexp(v, shift) for v in row]
        assert [Fraction(v) for v in out] == [Fraction(v) * Fraction(2) ** shift for v in row]
        assert 0.5 <= max(abs(v) for v in out) < 1


def test_the_evaluation_path_never_calls_ldexp():
    """Guards against torch.ldexp coming back on the evaluation path (inexact on CUDA): no
    attribute named ``ldexp`` in rankwise.similarity or any module of rankwise.metrics."""
    root = Path(sim.__file__).parent
    uses = [
        f"{path.relative_to(root)}:{node.lineno}"
        for path in [root / "similarity.py", *sorted((root / "metrics").glob("*.py"))]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "ldexp"
    ]
    assert uses == []


def test_lowest_bit_exponent_is_exact_for_every_exponent_of_float64(device):
    """Guards the device scan of the grids (what CUDA runs; it scaled the significands by
    torch.ldexp too): per value of every float64 exponent, the exponent of its lowest set bit,
    from the exact integer ratio; and the minimum over a tensor, as the numba kernel's."""
    from rankwise._similarity_kernels import lowest_bit_exponent

    values = _edge_values()
    want = []
    for value in values:
        numerator, denominator = value.as_integer_ratio()
        want.append((numerator & -numerator).bit_length() - denominator.bit_length())
    x = torch.tensor([*values, 0.0], dtype=torch.float64, device=device)
    assert sim._entry_lowest_bit_exponents(x).cpu().tolist() == [*want, 1 << 30]
    for part in (x[:7], x[1000:3000], x[-5:], x[-1:]):
        expected = int(lowest_bit_exponent(part.cpu().numpy()))
        assert int(sim._lowest_bit_exponent_torch(part)) == expected
