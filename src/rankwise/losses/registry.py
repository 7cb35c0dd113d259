"""Name-based construction of every loss the trainer can use.

The rankwise ranking losses (SOPRC with its semi-variance regularizer, Wen et al., NeurIPS 2022,
Alg. 1 and Eq. 9; the biased AP baseline, Eq. 5; the AUC loss of Gajić et al., Eq. 9; the Wilcoxon
loss, Eq. 11; Smooth-AP; ROADMAP, Ramzi et al., NeurIPS 2021; the Recall@k surrogate, Patel et al.,
CVPR 2022; DIR, Revaud et al., ICCV 2019; BlackBox-AP, Rolínek et al., CVPR 2020; the
pointwise ROC loss, Vogel et al., ICML 2018, problem (1)) and the pytorch-metric-learning baselines
of :mod:`rankwise.losses.baselines`. Parameters are checked
against the constructor signature, so a misspelt key fails with a ``ValueError`` naming the loss,
the key and the valid keys instead of being ignored.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

from torch import nn

from .._registry import Registry, keyword_parameters
from .._validation import Interval, check_scalar
from .auc import AUCLoss, WilcoxonLoss
from .baselines import BASELINES, baseline, baseline_parameters
from .blackbox_ap import BlackBoxAPLoss
from .dir import DIRLoss
from .memory import MEMORY_LOSSES, RankingMemory
from .pairwise_hashing import DPSHLoss
from .pointwise_roc import PointwiseROCLoss
from .recall_at_k import RecallAtKLoss
from .roadmap import ROADMAPLoss
from .smooth_ap import SmoothAPLoss
from .soprc import APLoss, SemiVarianceRegularizer, SOPRCLoss
from .tie_aware import TieAwareAPLoss, TieAwareNDCGLoss

__all__ = ["LOSSES", "build_loss", "loss_parameters"]

# loss name -> its class; the baselines' entry is the factory `baseline`
_LOSS_CLASSES: Registry[Callable[..., nn.Module]] = Registry(
    "loss",
    {
        "soprc": SOPRCLoss,
        "ap": APLoss,
        "auc": AUCLoss,
        "wilcoxon": WilcoxonLoss,
        "smooth_ap": SmoothAPLoss,
        "roadmap": ROADMAPLoss,
        "recall_at_k": RecallAtKLoss,
        "dir": DIRLoss,
        "blackbox_ap": BlackBoxAPLoss,
        "pointwise_roc": PointwiseROCLoss,
        # binary-code losses (relaxed codes of a HashingHead as embeddings): TALR's tie-aware AP /
        # NDCG (He et al., CVPR 2018, Eq. 11-12) and the DPSH pairwise-likelihood baseline
        "tie_aware_ap": TieAwareAPLoss,
        "tie_aware_ndcg": TieAwareNDCGLoss,
        "dpsh": DPSHLoss,
        **dict.fromkeys(BASELINES, baseline),
    },
)
LOSSES = _LOSS_CLASSES.names


class _LabelsConstructed(Protocol):
    """A loss class also built by ``from_labels(train_labels, **kw)`` (SOPRCLoss, PointwiseROCLoss)."""

    def __call__(self, *args: Any, **kwargs: Any) -> nn.Module: ...

    def from_labels(self, train_labels: Any, **kwargs: Any) -> nn.Module: ...


def _labels_constructed(name: str) -> _LabelsConstructed:
    """The registered class of loss ``name``, one with a ``from_labels`` constructor."""
    # the registry types its entries as plain factories (the baselines' entry is a function)
    return cast(_LabelsConstructed, _LOSS_CLASSES[name])


# Released SOPRC configs: weight 1 on positives below their mean, 5 on negatives above it.
DEFAULT_SEMI_VARIANCE_WEIGHTS = (1.0, 5.0)
# build_loss("soprc") keys that configure the SemiVarianceRegularizer it adds
_SEMI_VARIANCE_KEYS = ("semi_variance_weights", "semi_variance_normalization")
# Context arguments of build_loss, passed to a constructor that names them and is not given them.
_CONTEXT_NAMES = {
    "num_classes": "num_classes",
    "embedding_dim": "embedding_dim",
    "embedding_size": "embedding_dim",
    "bits": "embedding_dim",
}


def _soprc_parameters(cls: _LabelsConstructed) -> tuple[dict[str, inspect.Parameter], bool]:
    """Keys of ``SOPRCLoss.from_labels`` and, through its ``**kwargs``, of ``SOPRCLoss`` itself."""
    named, var_kw = keyword_parameters(cls.from_labels, skip=1)
    if var_kw:
        init_named, var_kw = keyword_parameters(cls)  # the class: its __init__ less self
        named = {**init_named, **named}
    named.pop("semi_variance", None)
    named.pop("prior", None)  # from_labels computes the class priors from the labels
    named.pop("positives", None)  # ... and the positives per class
    return named, var_kw


def loss_parameters(name: str) -> tuple[str, ...]:
    """Keyword parameters :func:`build_loss` accepts for loss ``name`` (sorted).

    For ``"soprc"`` these are the keys of ``SOPRCLoss.from_labels`` / ``SOPRCLoss`` plus
    ``semi_variance_weights``; for baselines,
    :func:`~rankwise.losses.baselines.baseline_parameters`.
    """
    _LOSS_CLASSES.canonical(name)
    if name in BASELINES:
        return baseline_parameters(name)
    if name == "soprc":
        named, _ = _soprc_parameters(_labels_constructed(name))
        return tuple(sorted({*named, *_SEMI_VARIANCE_KEYS}))
    named, _ = keyword_parameters(_LOSS_CLASSES[name].__init__)
    return tuple(sorted(named))


def _reject_unknown(name: str, params: dict[str, Any], valid: Sequence[str]) -> None:
    for key in params:
        if key not in valid:
            raise ValueError(
                f"loss {name!r} got an unknown parameter {key!r}; valid parameters: "
                f"{', '.join(sorted(valid))}."
            )


def _with_context(
    name: str,
    named: dict[str, inspect.Parameter],
    params: dict[str, Any],
    context: dict[str, Any],
    required_from: dict[str, inspect.Parameter] | None = None,
) -> dict[str, Any]:
    """Fill parameters named as context arguments; check those ``required_from`` (or ``named``)."""
    filled = dict(params)
    for param_name, context_name in _CONTEXT_NAMES.items():
        if param_name in named and param_name not in filled and context[context_name] is not None:
            filled[param_name] = context[context_name]
    missing = [
        p.name
        for p in (named if required_from is None else required_from).values()
        if p.default is inspect.Parameter.empty and p.name not in filled
    ]
    if missing:
        fixes = ", ".join(f"{_CONTEXT_NAMES.get(m, m)}=..." for m in missing)
        raise ValueError(f"loss {name!r} needs {', '.join(map(repr, missing))}; pass {fixes}.")
    return filled


def build_loss(
    name: str,
    *,
    train_labels: Any = None,
    num_classes: int | None = None,
    embedding_dim: int | None = None,
    memory: Mapping[str, Any] | None = None,
    **params: Any,
) -> nn.Module:
    """Build the loss called ``name`` with keyword ``params``.

    Args:
        name: one of :data:`LOSSES`.
        train_labels: (N,) integer class ids of the whole training set; required by ``"soprc"``,
            which sets its per-class state and class priors from them
            (``SOPRCLoss.from_labels(train_labels, **params)``).
        num_classes: passed to a constructor that has a ``num_classes`` parameter.
        embedding_dim: passed as ``embedding_dim`` / ``embedding_size`` to a constructor that has
            one (e.g. ``"xbm"``'s ``embedding_size``), and to the memory.
        memory: ``{"size": ..., "start_step": ...}`` wraps the loss in a cross-batch
            :class:`~rankwise.losses.memory.RankingMemory` (one of :data:`MEMORY_LOSSES`;
            needs ``embedding_dim``); None (default): no memory.
        **params: constructor keywords of the loss (see :func:`loss_parameters`). For ``"soprc"``,
            ``semi_variance_weights=(lambda_pos, lambda_neg)`` (default ``(1.0, 5.0)``) builds
            ``SemiVarianceRegularizer(lambda_pos, lambda_neg)`` into the loss; ``None`` disables it;
            ``semi_variance_normalization`` (``"pairs"``, Eq. 9, default, or ``"tail"``, the
            released code) is its ``normalization``.

    Returns:
        The loss ``nn.Module``, called as ``loss(embeddings, labels, ref_embeddings=None,
        ref_labels=None)``.

    Raises:
        ValueError: unknown name, unknown parameter (naming the key and listing the valid ones),
            missing required context (e.g. ``train_labels`` for ``"soprc"``).

    Example:
        >>> import torch
        >>> from rankwise.losses import build_loss
        >>> build_loss("ap", tau1=0.05)
        APLoss(tau1=0.05, tau2=0.001, similarity='cosine')
        >>> type(build_loss("soprc", train_labels=torch.tensor([0, 0, 1, 1]))).__name__
        'SOPRCLoss'
    """
    _LOSS_CLASSES.canonical(name)
    if memory is not None:
        settings = _check_memory(name, memory, embedding_dim)
        inner = build_loss(
            name,
            train_labels=train_labels,
            num_classes=num_classes,
            embedding_dim=embedding_dim,
            **params,
        )
        return RankingMemory(inner, **settings)
    context = {"num_classes": num_classes, "embedding_dim": embedding_dim}
    if name in BASELINES:
        valid = baseline_parameters(name)
        _reject_unknown(name, params, valid)
        kw = dict(params)
        if "embedding_size" in valid and "embedding_size" not in kw and embedding_dim is not None:
            kw["embedding_size"] = embedding_dim
        if name == "xbm" and "embedding_size" not in kw:
            raise ValueError("loss 'xbm' needs the embedding dimension; pass embedding_dim=...")
        return baseline(name, **kw)

    if name == "soprc":
        return _build_soprc(_labels_constructed(name), train_labels, params, context)
    cls = _LOSS_CLASSES[name]
    named, var_kw = keyword_parameters(cls.__init__)
    if not var_kw:
        _reject_unknown(name, params, tuple(named))
    if name == "pointwise_roc" and train_labels is not None:
        # from_labels checks the labels can form both pairs
        return _labels_constructed(name).from_labels(train_labels, **params)
    return cls(**_with_context(name, named, params, context))


_MEMORY_KEYS = ("size", "start_step")


def _check_memory(name: str, memory: Any, embedding_dim: int | None) -> dict[str, Any]:
    """The keyword arguments of :class:`RankingMemory` (but the loss) from ``memory``, checked."""
    if name not in MEMORY_LOSSES:
        raise ValueError(
            f"loss {name!r} takes no memory: a cross-batch memory serves the ranking losses "
            f"{', '.join(MEMORY_LOSSES)} ('xbm' is the contrastive loss with its own)."
        )
    if not isinstance(memory, Mapping):
        raise ValueError(f"`memory` must be a mapping {{size, start_step}}, got {memory!r}.")
    for key in memory:
        if key not in _MEMORY_KEYS:
            raise ValueError(
                f"`memory` got an unknown key {key!r}; valid keys: {', '.join(_MEMORY_KEYS)}."
            )
    if "size" not in memory:
        raise ValueError("`memory` needs `size`, the items it holds (at least the batch size).")
    if embedding_dim is None:
        raise ValueError(f"loss {name!r} with a memory needs embedding_dim=... (its width).")
    return {**memory, "embedding_dim": embedding_dim}


def _check_weight_pair(weights: Any) -> tuple[float, float]:
    """``semi_variance_weights``: a pair of finite numbers >= 0 (numpy scalars accepted)."""
    message = (
        "loss 'soprc': `semi_variance_weights` must be a pair (lambda_pos, lambda_neg) of finite "
        f"numbers >= 0, or None, got {weights!r}."
    )
    if isinstance(weights, (str, bytes)):
        raise ValueError(message)
    try:
        pair = [
            check_scalar(w, "semi_variance_weights", Interval("real", 0, None)) for w in weights
        ]
    except (TypeError, ValueError):
        raise ValueError(message) from None
    if len(pair) != 2:
        raise ValueError(message)
    return float(pair[0]), float(pair[1])


def _build_soprc(
    cls: _LabelsConstructed, train_labels: Any, params: dict[str, Any], context: dict[str, Any]
) -> nn.Module:
    if train_labels is None:
        raise ValueError(
            "loss 'soprc' needs the training labels to size its per-class state and class "
            "priors; pass build_loss('soprc', train_labels=<(N,) class ids of the training set>)."
        )
    params = dict(params)
    weights = params.pop("semi_variance_weights", DEFAULT_SEMI_VARIANCE_WEIGHTS)
    normalization = params.pop("semi_variance_normalization", "pairs")
    named, var_kw = _soprc_parameters(cls)
    if "semi_variance" in params:
        raise ValueError(
            "loss 'soprc': pass `semi_variance_weights=(lambda_pos, lambda_neg)` or None instead "
            "of `semi_variance`."
        )
    if not var_kw:
        _reject_unknown("soprc", params, (*named, *_SEMI_VARIANCE_KEYS))
    regularizer = None
    if weights is not None:
        lambda_pos, lambda_neg = _check_weight_pair(weights)
        regularizer = SemiVarianceRegularizer(lambda_pos, lambda_neg, normalization=normalization)
    # from_labels derives the rest of SOPRCLoss's required arguments from the labels.
    from_labels_named, _ = keyword_parameters(cls.from_labels, skip=1)
    from_labels_named.pop("semi_variance", None)
    kw = _with_context("soprc", named, params, context, required_from=from_labels_named)
    return cls.from_labels(train_labels, semi_variance=regularizer, **kw)
