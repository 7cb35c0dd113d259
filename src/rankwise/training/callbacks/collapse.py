"""Collapse detection: stop when every score of a batch ties (:class:`CollapseDetector`), with advice."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..._validation import Interval, check_scalar
from ..errors import CollapsedEmbeddingsError
from .base import Callback, TrainerView

if TYPE_CHECKING:
    from ...metrics import RetrievalReport
    from ..config import Config

__all__ = [
    "COLLAPSE_SPREAD",
    "CollapseDetector",
    "config_collapse_advice",
    "embedding_spread",
    "optimizer_collapse_advice",
]

# embedding_spread below which a run counts as collapsed: every cosine score then lies within
# 2 * spread**2 = 2e-6 of every other (a few float32 ulps near 1), i.e. every score ties
COLLAPSE_SPREAD = 1e-3


def embedding_spread(embeddings: torch.Tensor) -> float:
    """Largest distance of an L2-normalized row of ``embeddings`` (N, d) from the first one.

    For unit vectors 1 - u_i.u_j = |u_i - u_j|^2 / 2, so a spread ``r`` puts every cosine score
    within 2 r^2 of every other; 0: one direction (or all zero); ``inf``: fewer than 2 rows. O(N d).

    Args:
        embeddings: (N, d) tensor.

    Returns:
        The spread, a Python float.
    """
    if embeddings.shape[0] < 2:
        return math.inf
    unit = torch.nn.functional.normalize(embeddings.detach().float(), dim=1)
    return float((unit - unit[:1]).norm(dim=1).max())


def config_collapse_advice(config: Config) -> str:
    """``"Likely cause: ... Fix: ..."`` of a collapse under ``config``, in config keys."""
    oc = config.optimizer
    causes, fixes = [], []
    if oc.weight_decay > 0 and oc.name != "adamw":
        how = (
            "Adam divides the decay term by the gradient's scale, so it moves every weight by a "
            "full lr-sized step towards 0"
            if oc.name == "adam"
            else "it shrinks the weights towards 0"
        )
        causes.append(
            f"weight decay coupled to the gradient (optimizer.name={oc.name}, weight_decay="
            f"{oc.weight_decay:g}) outweighing a tiny loss gradient: {how}"
        )
        fixes.append("optimizer.name=adamw (decoupled weight decay) or optimizer.weight_decay=0")
    causes.append(f"a learning rate too high for this loss (optimizer.lr={oc.lr:g})")
    fixes.append("a lower optimizer.lr")
    params = config.loss.params
    if config.loss.name == "soprc" and params.get("use_v", True) and not params.get("warm_start"):
        # issue 40: an untrained network scores every pair near 1, above the whole default v
        # grid, so every TPR sits at its floor and the loss at ~1 with almost no gradient
        causes.append(
            "SOPRC's v starting below the network's first scores (every TPR at its floor, the "
            "loss stuck near 1 with almost no gradient)"
        )
        fixes.append("loss.params.warm_start=true (v starts at the first batch's scores)")
    if config.loss.name == "soprc" and "prior_scale" in params and params["prior_scale"] is None:
        causes.append(
            "SOPRC's gradient shrinks with the class prior, and the raw priors of a many-class "
            "dataset (prior_scale=null, ~1e-4) leave almost none"
        )
        fixes.append("the default loss.params.prior_scale=0.1 (see docs/losses.md, SOPRC)")
    return f"Likely cause: {'; or '.join(causes)}. Fix: {'; '.join(fixes)}."


def optimizer_collapse_advice(optimizer: torch.optim.Optimizer) -> str:
    """``"Likely cause: ... Fix: ..."`` of a collapse, in terms of the trainer's ``optimizer``."""
    name = type(optimizer).__name__
    decay = max(float(g.get("weight_decay", 0.0) or 0.0) for g in optimizer.param_groups)
    lr = float(optimizer.param_groups[0].get("lr", math.nan))
    causes, fixes = [], []
    if decay > 0 and not isinstance(optimizer, torch.optim.AdamW):
        causes.append(
            f"weight decay coupled to the gradient ({name} with weight_decay={decay:g}) "
            "outweighing a tiny loss gradient"
        )
        fixes.append("torch.optim.AdamW (decoupled weight decay) or weight_decay=0")
    causes.append(f"a learning rate too high for this loss (lr={lr:g})")
    fixes.append("a lower learning rate")
    return f"Likely cause: {'; or '.join(causes)}. Fix: {'; '.join(fixes)}."


class CollapseDetector(Callback):
    """Stop a run whose scores all tie: a training batch's or the validation split's embeddings.

    Raises :class:`~rankwise.training.errors.CollapsedEmbeddingsError` with the likely cause and
    fix; the step is not applied (training batch) or not checkpointed (validation).

    Args:
        threshold: the :func:`embedding_spread` at or below which the run counts as collapsed.
        advice: the cause-and-fix sentence for the trainer (default: from its optimizer,
            :func:`optimizer_collapse_advice`; the factory gives a run built from a config
            :func:`config_collapse_advice`, in config keys).
    """

    def __init__(
        self,
        threshold: float = COLLAPSE_SPREAD,
        advice: Callable[[TrainerView], str] | None = None,
    ) -> None:
        self.threshold = check_scalar(threshold, "threshold", Interval("real", 0, None))
        self.advice = advice

    def _advice(self, trainer: TrainerView) -> str:
        if self.advice is not None:
            return self.advice(trainer)
        return optimizer_collapse_advice(trainer.optimizer)

    def check(self, trainer: TrainerView, embeddings: torch.Tensor, where: str, step: int) -> None:
        """Raise when every score of ``embeddings`` ties.

        Args:
            trainer: the trainer.
            embeddings: (N, d) embeddings.
            where: ``"training batch"`` or ``"validation split"``.
            step: their step (for the message).
        """
        spread = embedding_spread(embeddings)
        if spread > self.threshold:
            return
        message = (
            f"every score ties at step {step} (epoch {trainer.next_epoch}, loss "
            f"{trainer.loss_name}): the {embeddings.shape[0]} embeddings of the {where} all "
            f"point in the same direction (spread {spread:.2e} <= {self.threshold:g}), so the "
            f"model has collapsed and cannot rank; training stopped and "
            f"{trainer.store.kept_message()}. " + self._advice(trainer)
        )
        record = {
            "kind": "error",
            "step": step,
            "error": "collapsed embeddings",
            "where": where,
            "spread": spread,
        }
        raise CollapsedEmbeddingsError(
            message, step, trainer.store.last_good_checkpoint, spread, where, record
        )

    def on_train_batch(
        self, trainer: TrainerView, embeddings: torch.Tensor, labels: torch.Tensor
    ) -> None:
        """Check the training batch before its loss."""
        self.check(trainer, embeddings, "training batch", trainer.step + 1)

    def on_validation_end(
        self, trainer: TrainerView, report: RetrievalReport, embeddings: torch.Tensor
    ) -> None:
        """Check the validation split (the step is applied but not checkpointed)."""
        self.check(trainer, embeddings, "validation split", trainer.step)
