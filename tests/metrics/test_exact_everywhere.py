"""Exact on every device (issue 36): cosine keys without torch.ldexp, integer embeddings in
float64, labels that fit int64, recall@k inside a large tie to a few ulp, no sympy on the way.

Every oracle is exact (fractions, brute force over the orderings of a tie); the device-dependent
defects are guarded by the CPU run of the code path the device runs.
"""

from __future__ import annotations

import itertools
import math
import random
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from rankwise.metrics import retrieval_metrics
from rankwise.metrics.ranking import hit_probability_at


def _backends(device: torch.device) -> tuple[str, ...]:
    return ("numba", "torch") if device.type == "cpu" else ("torch",)


def _brute_force_cosine_ap(x: list[list[int]], y: list[int]) -> list[Fraction]:
    """Leave-one-out tie-aware AP by brute force: the mean AP over every ordering of the gallery
    that sorts it by exact cosine (compared as the rational key D |D| / (|q|^2 |g|^2))."""
    aps = []
    for q, row in enumerate(x):
        others = [j for j in range(len(x)) if j != q]

        def key(j: int, row=row) -> Fraction:
            dot = sum(a * b for a, b in zip(row, x[j], strict=True))
            return Fraction(dot * abs(dot), sum(a * a for a in row) * sum(b * b for b in x[j]))

        total, count = Fraction(0), 0
        for order in itertools.permutations(others):
            keys = [key(j) for j in order]
            if any(a < b for a, b in itertools.pairwise(keys)):
                continue
            hits, ap = 0, Fraction(0)
            for position, j in enumerate(order, start=1):
                if y[j] == y[q]:
                    hits += 1
                    ap += Fraction(hits, position)
            total += ap / hits
            count += 1
        aps.append(total / count)
    return aps


REPRO_X = [[1, 2], [2, 4], [3, 6], [1, 0], [5, 10]]
REPRO_Y = [0, 0, 1, 1, 0]


def test_the_cuda_reproducer_is_exact_on_every_device_and_backend(device):
    """Guards the cosine ties of integer codes whose largest entry is 8-15, 256-511, ... (item 1):
    on CUDA the torch.ldexp row scaling split them, giving [.7083, .7083, .25, .6111, .5833]."""
    exact = _brute_force_cosine_ap(REPRO_X, REPRO_Y)
    assert exact == [Fraction(29, 36), Fraction(29, 36), Fraction(1, 4), Fraction(25, 48)] + [
        Fraction(29, 36)
    ]
    want = [float(v) for v in exact]
    x = torch.tensor(REPRO_X, device=device)
    # integer codes, and the same rows scaled to largest entries 80 and 2560 (float32) and by
    # 2^-20 (float64)
    cases = [
        (x, None),
        (x, 1),
        (x.float() * 8, None),
        (x.float() * 256, 2),
        (x.double() / 2**20, 1),
    ]
    for (xs, chunk), backend in itertools.product(cases, _backends(device)):
        report = retrieval_metrics(
            xs, torch.tensor(REPRO_Y), ks=(1,), chunk_size=chunk, backend=backend
        )
        # the closed form of AP rounds (1 ulp here); a split tie is off by 0.1 or more
        got = report.per_query_ap.tolist()
        assert got == pytest.approx(want, rel=4 * 2.0**-53, abs=0), (xs.dtype, backend, chunk)


@pytest.mark.parametrize("similarity", ["cosine", "dot", "euclidean"])
def test_no_evaluation_mode_calls_ldexp(monkeypatch, similarity):
    """Guards every scaling of the evaluation path (the cosine operands, the dot and euclidean
    approximations of metrics._scores) against torch.ldexp, inexact on CUDA: with it made to
    fail, every mode (exact matmul, float32 and float64 approximations) still evaluates."""

    def refuse(*args, **kwargs):
        raise AssertionError("torch.ldexp is inexact on CUDA: build powers of two from bits")

    monkeypatch.setattr(torch, "ldexp", refuse)
    monkeypatch.setattr(torch.Tensor, "ldexp", refuse, raising=False)
    rng = np.random.default_rng(36)
    labels = rng.integers(0, 5, 40)
    for x in (rng.integers(-3, 4, (40, 6)), rng.normal(size=(40, 6)) * 1e3 + 5):
        for backend in ("numba", "torch"):
            report = retrieval_metrics(x, labels, similarity=similarity, backend=backend)
            assert 0 < report.map <= 1


# -- integer embeddings and labels (item 4) --------------------------------------------------------


def test_integer_embeddings_are_exact_up_to_2_to_the_53(device):
    """Guards the float64 conversion of integer codes (docs/metrics.md: exact to 2^53): in float32
    2^24 + 1 became 2^24, tying the relevant item with the irrelevant one (AP 0.75, exact 1)."""
    for big in (2**24, 2**40, 2**52):
        q = torch.tensor([[1]], device=device)
        g = torch.tensor([[big], [big + 1]], device=device)
        for backend in _backends(device):
            report = retrieval_metrics(
                q, [0], g, [1, 0], ks=(1,), similarity="dot", backend=backend
            )
            assert report.map == 1.0 and report.recall_at[1] == 1.0, (big, backend)
            worse = retrieval_metrics(q, [0], g, [0, 1], ks=(1,), similarity="dot", backend=backend)
            assert worse.map == 0.5 and worse.recall_at[1] == 0.0, (big, backend)


@pytest.mark.parametrize(
    "labels",
    [
        [1e20, 2e20, 1e20, 3e20],
        np.array([2.0**63, 0.0, 1.0, 2.0]),
        np.array([-(2.0**64), 0.0, 1.0, 2.0]),
        torch.tensor([1e20, 2e20, 1e20, 3e20], dtype=torch.float32),
        torch.tensor([1e30, 2e30, 1e30, 3e30], dtype=torch.bfloat16),
    ],
)
def test_float_labels_outside_int64_are_refused(labels):
    """Guards against float class ids that int64 cannot hold: the cast made 1e20 and 2e20 one
    class, so every item counted as relevant (AP 1.0, silently)."""
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"`query_labels` holds the .* outside the int64 range"):
        retrieval_metrics(x, labels)
    with pytest.raises(ValueError, match=r"`gallery_labels` holds .*np.unique\(gallery_labels"):
        retrieval_metrics(x, [0, 1, 0, 1], x, labels)


def test_labels_at_the_ends_of_int64_keep_their_classes():
    """The int64 range itself stays accepted: -2^63 as a float, and uint64 ids up to 2^64 - 1
    (read as int64 bit patterns: distinct ids stay distinct)."""
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    want = retrieval_metrics(x, [5, 7, 5, 7]).per_query_ap.tolist()
    for labels in (
        np.array([-(2.0**63), 0.0, -(2.0**63), 0.0]),
        np.array([2**63, 0, 2**63, 0], dtype=np.uint64),
        np.array([2**64 - 1, 2**63 - 1, 2**64 - 1, 2**63 - 1], dtype=np.uint64),
    ):
        assert retrieval_metrics(x, labels).per_query_ap.tolist() == want


# -- recall@k inside a tie (item 5) ----------------------------------------------------------------


def _ulps(got: float, numerator: int, denominator: int) -> float:
    """Distance of ``got`` from ``numerator / denominator`` in units of the last place of the
    correctly rounded value (integer arithmetic: no gcd of the large binomials)."""
    nearest = numerator / denominator  # Python's int division is correctly rounded
    p, q = float(got).as_integer_ratio()
    u, v = math.ulp(nearest).as_integer_ratio()
    return abs(p * denominator - q * numerator) * v / (q * denominator * u)


def _recall_in_tie(n: int, r: int, t: int) -> tuple[int, int]:
    """1 - C(n - r, t) / C(n, t) as (numerator, denominator), from the ratio's min(r, t) factors
    ``(n - max(r, t) - i) / (n - i)`` (the ratio is symmetric in r and t)."""
    m, s = min(r, t), max(r, t)
    total = math.prod(range(n - m + 1, n + 1))
    return total - math.prod(range(n - s - m + 1, n - s + 1)), total


def _tie_cases() -> list[tuple[int, int, int, int]]:
    """(g, n, r, k): large ties (n up to 136,000, as iNat), few and many relevant items, cut-offs
    at the top of the tie, inside it and at its last position that can miss."""
    rng = random.Random(5)
    cases = []
    for n in (2, 3, 7, 50, 599, 2999, 20_000, 136_000):
        for r in sorted({1, 2, 11, 59, 1999, n // 2, n - 1} & set(range(1, n))):
            for t in sorted(
                {1, 2, 10, 100, 1000, n - r, rng.randint(1, n - r)} & set(range(1, n - r + 1))
            ):
                if min(r, t) <= 2000:  # keeps the fractions fast
                    cases.append((rng.randint(0, 5), n, r, t))
    return cases


def test_recall_at_k_inside_a_tie_is_within_a_few_ulp_of_the_exact_fraction():
    """Guards R@k of a query whose best relevant group straddles k: 1 - C(n - r, t) / C(n, t),
    t = k - g, to a few ulp (1 - exp(gammaln ...) was off by up to 7e5 ulp at n = 3,000)."""
    cases = _tie_cases()
    g, n, r, t = (np.array(column, dtype=np.int64) for column in zip(*cases, strict=True))
    got = hit_probability_at(g, n, r, g + t, "expected")
    worst = max(
        _ulps(value, *_recall_in_tie(nn, rr, tt))
        for value, (_, nn, rr, tt) in zip(got, cases, strict=True)
    )
    assert worst <= 4, worst
    # outside the partial range: certain hits and misses, and the two bounds
    assert hit_probability_at(g, n, r, g, "expected").tolist() == [0.0] * len(cases)
    assert hit_probability_at(g, n, r, g + n - r + 1, "expected").tolist() == [1.0] * len(cases)
    assert hit_probability_at(g, n, r, g + t, "optimistic").tolist() == [1.0] * len(cases)
    assert hit_probability_at(g, n, r, g + t, "pessimistic").tolist() == [0.0] * len(cases)


def test_recall_at_k_of_one_large_tie_is_the_exact_fraction():
    """The issue's case: 3,000 identical rows, 50 classes, leave-one-out: R@k is the probability
    that the top k of 2,999 tied items hold one of the 59 relevant ones (exact 59/2999 at k = 1)."""
    x = torch.ones(3000, 2, dtype=torch.float64)
    report = retrieval_metrics(x, torch.arange(3000) % 50, ks=(1, 2, 100))
    for k in (1, 2, 100):
        assert _ulps(report.recall_at[k], *_recall_in_tie(2999, 59, k)) <= 4, k
    assert report.recall_at[1] == 59 / 2999
    small = (torch.ones(120, 2), torch.arange(120) % 6)  # every backend computes R@k alike
    reports = [retrieval_metrics(*small, ks=(1, 5), backend=b) for b in ("numba", "torch")]
    assert reports[0].per_query["recall@5"].tolist() == reports[1].per_query["recall@5"].tolist()
    assert _ulps(reports[0].recall_at[5], *_recall_in_tie(119, 19, 5)) <= 4


# -- no sympy on the evaluation path (item 6) ------------------------------------------------------

FIRST_EVALUATION = """
import sys
import torch
from rankwise.metrics import pr_curve, retrieval_metrics

x, y = torch.randn(40, 8), torch.arange(40) % 4
for backend in ("numba", "torch"):
    for similarity in ("cosine", "euclidean"):
        retrieval_metrics(x, y, similarity=similarity, backend=backend)
pr_curve(x, y)
print(sorted({"sympy", "torch.fx.experimental.symbolic_shapes"} & set(sys.modules)))
"""


def test_a_first_evaluation_imports_no_sympy():
    """Guards the cold start of every fresh process (``rankwise evaluate``): torch.broadcast_shapes
    imported torch.fx.experimental.symbolic_shapes and sympy on its first call (0.5 s)."""
    out = subprocess.run(
        [sys.executable, "-c", FIRST_EVALUATION], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_plain_broadcast_shape_follows_numpy():
    from rankwise.metrics.ranking import _broadcast_shape

    for shapes in [((3,), (3,), (3,)), ((2, 1), (1, 5), (5,)), ((), (4, 1)), ((0,), (1,), ())]:
        assert _broadcast_shape(*shapes) == np.broadcast_shapes(*shapes)
    assert _broadcast_shape(torch.Size([2, 1]), torch.Size([3])) == (2, 3)
    with pytest.raises(ValueError, match="cannot be broadcast"):
        _broadcast_shape((2,), (3,))
