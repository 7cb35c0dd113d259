"""The score distributions of the SOPRC simulation study (Wen et al., NeurIPS 2022, App. B.2, Fig. 3).

Binormal (s⁻ ~ N(0, 1), s⁺ ~ N(1, 1)), bibeta (s⁻ ~ B(2, 5), s⁺ ~ B(5, 2)) and offset uniform
(s⁻ ~ U(0, 1), s⁺ ~ U(0.5, 1.5)), each with the quantile function p of the positive scores and its
second derivative p'' (Prop. 3's interpolation bound), and the finite score population S of the
simulation: N points of which round(π N) are positive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._validation import check_choice

__all__ = ["DISTRIBUTIONS", "ScoreModel", "draw_population", "score_model"]


@dataclass(frozen=True)
class ScoreModel:
    """One score distribution of App. B.2.

    Attributes:
        name: ``"binormal"``, ``"bibeta"`` or ``"offset-uniform"``.
        label: how the paper writes it.
        negative: (rng, n) -> n negative scores.
        positive: (rng, n) -> n positive scores.
        positive_quantile: u -> p(u), the quantile function of the positive scores.
        positive_quantile_d2: u -> p''(u).
        score_range: bounds of all scores (clip of φ's extrapolated ends), None when unbounded.
    """

    name: str
    label: str
    negative: Callable[[np.random.Generator, int], np.ndarray]
    positive: Callable[[np.random.Generator, int], np.ndarray]
    positive_quantile: Callable[[np.ndarray], np.ndarray]
    positive_quantile_d2: Callable[[np.ndarray], np.ndarray]
    score_range: tuple[float, float] | None

    def phi(self, scores: np.ndarray, num_points: int) -> np.ndarray:
        """SOPRC's interpolation φ of Alg. 2 onto ``num_points`` positions, clipped to the range."""
        import torch

        from ..losses.soprc import score_interpolation

        return score_interpolation(torch.from_numpy(scores), num_points, self.score_range).numpy()


def _normal_quantile(u: np.ndarray) -> np.ndarray:
    from scipy.special import ndtri

    return 1.0 + ndtri(u)


def _normal_quantile_d2(u: np.ndarray) -> np.ndarray:
    # p = 1 + Φ⁻¹(u): p' = 1/φ(z), p'' = z/φ(z)² with z = Φ⁻¹(u)
    from scipy.special import ndtri

    z = ndtri(u)
    density = np.exp(-0.5 * z**2) / np.sqrt(2 * np.pi)
    return z / density**2


def _beta_quantile(u: np.ndarray) -> np.ndarray:
    from scipy.special import betaincinv

    return betaincinv(5.0, 2.0, u)


def _beta_quantile_d2(u: np.ndarray) -> np.ndarray:
    # p = F⁻¹(u): p'' = −f'(p)/f(p)³ = −((a−1)/x − (b−1)/(1−x)) / f(x)², x = p(u), f = B(5, 2)
    x = _beta_quantile(u)
    density = 30.0 * x**4 * (1.0 - x)
    return -(4.0 / x - 1.0 / (1.0 - x)) / density**2


DISTRIBUTIONS: dict[str, ScoreModel] = {
    "binormal": ScoreModel(
        "binormal",
        "binormal: s⁻ ~ N(0, 1), s⁺ ~ N(1, 1)",
        lambda rng, n: rng.normal(0.0, 1.0, n),
        lambda rng, n: rng.normal(1.0, 1.0, n),
        _normal_quantile,
        _normal_quantile_d2,
        None,
    ),
    "bibeta": ScoreModel(
        "bibeta",
        "bibeta: s⁻ ~ B(2, 5), s⁺ ~ B(5, 2)",
        lambda rng, n: rng.beta(2.0, 5.0, n),
        lambda rng, n: rng.beta(5.0, 2.0, n),
        _beta_quantile,
        _beta_quantile_d2,
        (0.0, 1.0),
    ),
    "offset-uniform": ScoreModel(
        "offset-uniform",
        "offset uniform: s⁻ ~ U(0, 1), s⁺ ~ U(0.5, 1.5)",
        lambda rng, n: rng.uniform(0.0, 1.0, n),
        lambda rng, n: rng.uniform(0.5, 1.5, n),
        lambda u: 0.5 + np.asarray(u, dtype=np.float64),
        lambda u: np.zeros_like(np.asarray(u, dtype=np.float64)),
        (0.0, 1.5),
    ),
}


def score_model(name: str) -> ScoreModel:
    """The :class:`ScoreModel` called ``name`` (``ValueError`` naming the choices otherwise)."""
    return DISTRIBUTIONS[check_choice(name, "distribution", tuple(DISTRIBUTIONS))]


def draw_population(
    model: ScoreModel, n_points: int, prior: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The simulated data set S: round(prior · n_points) positive and the rest negative scores.

    Returns:
        (positives, negatives), each sorted ascending, float64.
    """
    n_pos = int(round(prior * n_points))
    positives = np.sort(model.positive(rng, n_pos))
    negatives = np.sort(model.negative(rng, n_points - n_pos))
    return positives, negatives
