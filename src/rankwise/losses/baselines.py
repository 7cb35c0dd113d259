"""Pairwise metric-learning baselines from pytorch-metric-learning, behind the rankwise call.

The baselines are built from pytorch-metric-learning (PML, Musgrave et al., "A Metric Learning
Reality Check", ECCV 2020), wrapped in the rankwise call contract ``loss(embeddings, labels,
ref_embeddings=None, ref_labels=None)``. Nothing is re-implemented: the contrastive loss (Hadsell
et al., CVPR 2006, in its cosine form with the margins of the XBM paper), the triplet loss with
batch-hard mining (Hermans et al., 2017) or semi-hard mining (Schroff et al., CVPR 2015), the
multi-similarity loss and miner (Wang et al., CVPR 2019), FastAP (Cakir et al., CVPR 2019) and the
cross-batch memory (XBM, Wang et al., CVPR 2020) around the contrastive loss all come from PML.
Inputs and parameters are checked like every rankwise loss's, and anchor counts go to
``last_stats``. PML is the ``baselines`` extra, imported on the first baseline built.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .._extras import require
from .._registry import Registry, keyword_parameters
from .._validation import Interval, check_bool, check_choice, check_scalar
from .base import anchor_statistics, raise_if_nothing_to_rank, score_dtype, validate_pair_inputs

__all__ = [
    "BASELINES",
    "PMLBaseline",
    "CrossBatchMemoryBaseline",
    "baseline",
    "baseline_parameters",
]

# Constructor keywords every PML loss accepts through its base classes.
_PML_COMMON_KEYS = (
    "distance",
    "reducer",
    "embedding_regularizer",
    "embedding_reg_weight",
    "collect_stats",
)
# Cosine contrastive margins of the XBM paper (Wang et al. 2020, Sec. 4.1): positives are pulled
# to similarity 1, negatives are pushed below 0.5.
_CONTRASTIVE_DEFAULTS = {"pos_margin": 1.0, "neg_margin": 0.5}
# baseline -> PML loss class name, and the miner class name of the mined baselines
_LOSS_CLASSES: Registry[str] = Registry(
    "baseline",
    {
        "contrastive": "ContrastiveLoss",
        "triplet": "TripletMarginLoss",
        "triplet_semihard": "TripletMarginLoss",
        "multi_similarity": "MultiSimilarityLoss",
        "fastap": "FastAPLoss",
        "xbm": "ContrastiveLoss",
    },
)
BASELINES = _LOSS_CLASSES.names
# rankwise's own keys of "xbm" (the rest are the PML ContrastiveLoss's)
_XBM_KEYS = ("embedding_size", "memory_size", "start_iteration", "batch_loss")
_MINER_CLASSES = {
    "triplet": "BatchHardMiner",
    "triplet_semihard": "TripletMarginMiner",
    "multi_similarity": "MultiSimilarityMiner",
}
_NO_REFERENCE_SET = {
    "fastap": "PML's FastAPLoss ranks each batch against itself only",
    "xbm": "the cross-batch memory is the reference set",
}
# Scalar parameters of the PML losses and miners, checked like every rankwise loss's: numpy
# scalars accepted, bool never a number, NaN and inf never.
_REAL = Interval("real")
_NON_NEGATIVE = Interval("real", 0, None)
_POSITIVE = Interval("real", 0, None, closed="neither")
_SCALARS: dict[str, Interval] = {
    "pos_margin": _REAL,
    "neg_margin": _REAL,
    "margin": _NON_NEGATIVE,
    "alpha": _POSITIVE,
    "beta": _POSITIVE,
    "base": _REAL,
    "num_bins": Interval("integer", 1, None),
    "embedding_reg_weight": _NON_NEGATIVE,
    "embedding_size": Interval("integer", 1, None),
    "memory_size": Interval("integer", 1, None),
    "start_iteration": Interval("integer", 0, None),
    "epsilon": _NON_NEGATIVE,
}
_FLAGS = ("swap", "smooth_loss", "batch_loss")
_TRIPLET_TYPES = ("all", "hard", "semihard", "easy")


def _pml(submodule: str) -> ModuleType:
    """A pytorch-metric-learning submodule (``losses``, ``miners``, ``distances``)."""
    require(("pytorch_metric_learning",), "baselines", "the pytorch-metric-learning baselines")
    return importlib.import_module(f"pytorch_metric_learning.{submodule}")


def baseline_parameters(name: str) -> tuple[str, ...]:
    """Keyword arguments :func:`baseline` accepts for baseline ``name``.

    Args:
        name: one of :data:`BASELINES`.

    Returns:
        The sorted parameter names (the PML loss's, its base classes', ``miner_kwargs`` for the
        mined baselines, ``embedding_size`` / ``memory_size`` / ``start_iteration`` /
        ``batch_loss`` for ``"xbm"``).
    """
    pml_class = _LOSS_CLASSES[name]  # the name is checked before the extra is imported
    keys = set(keyword_parameters(getattr(_pml("losses"), pml_class))[0])
    keys.update(_PML_COMMON_KEYS)
    if name in _MINER_CLASSES:
        keys.add("miner_kwargs")
    if name == "xbm":
        keys.update(_XBM_KEYS)
    return tuple(sorted(keys))


def _check_values(params: dict[str, Any], owner: str) -> dict[str, Any]:
    """``params`` with every known scalar checked (and converted to a Python int / float)."""
    checked = dict(params)
    for key, value in params.items():
        if key in _SCALARS:
            checked[key] = check_scalar(value, key, _SCALARS[key])
        elif key in _FLAGS:
            checked[key] = check_bool(value, key)
        elif key == "collect_stats" and value is not None:
            checked[key] = check_bool(value, key)
        elif key == "type_of_triplets":
            checked[key] = check_choice(value, key, _TRIPLET_TYPES)
        elif key == "triplets_per_anchor" and value != "all":
            checked[key] = check_scalar(value, key, Interval("integer", 1, None))
    return checked


def _check_miner_kwargs(name: str, miner_kwargs: Any) -> dict[str, Any]:
    if miner_kwargs is None:
        return {}
    if not isinstance(miner_kwargs, dict):
        raise ValueError(f"`miner_kwargs` must be a dict, got {type(miner_kwargs).__name__}.")
    if name not in _MINER_CLASSES:
        raise ValueError(f"baseline {name!r} has no miner; drop `miner_kwargs`.")
    miner_class = getattr(_pml("miners"), _MINER_CLASSES[name])
    valid = set(keyword_parameters(miner_class)[0]) | {"distance", "collect_stats"}
    for key in miner_kwargs:
        if key not in valid:
            raise ValueError(
                f"baseline {name!r} got an unknown miner parameter {key!r} in `miner_kwargs`; "
                f"valid miner parameters: {', '.join(sorted(valid))}."
            )
    return _check_values(miner_kwargs, name)


class PMLBaseline(nn.Module):
    """A PML loss (and optional miner) behind the rankwise loss call contract.

    Args:
        name: baseline name (one of :data:`BASELINES`), used in messages and ``repr``.
        loss: the PML loss module, called as ``loss(emb, labels, indices_tuple, ref_emb,
            ref_labels)``.
        miner: optional PML miner whose output is passed to ``loss`` as ``indices_tuple``.
        reference_set_error: when set, passing ``ref_embeddings`` raises ``ValueError`` with this
            reason (the PML loss cannot rank against an external set).

    ``last_stats`` after each call: the counts of :func:`rankwise.losses.base.anchor_statistics`
    and, with a miner, ``n_mined_triplets`` or ``n_mined_positive_pairs`` /
    ``n_mined_negative_pairs``.
    """

    def __init__(
        self,
        name: str,
        loss: nn.Module,
        miner: nn.Module | None = None,
        reference_set_error: str | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.loss = loss
        self.miner = miner
        self.reference_set_error = reference_set_error
        self.last_stats: dict[str, float] = {}

    def _validate(
        self, embeddings, labels, ref_embeddings, ref_labels
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if ref_embeddings is not None and self.reference_set_error is not None:
            raise ValueError(
                f"baseline {self.name!r} does not accept `ref_embeddings`/`ref_labels`: "
                f"{self.reference_set_error}. Call it with the batch only."
            )
        return validate_pair_inputs(embeddings, labels, ref_embeddings, ref_labels)

    def _count_anchors(
        self, labels: torch.Tensor, ref_labels: torch.Tensor, self_index: torch.Tensor | None
    ) -> int:
        """Record the anchor / pair counts; ``self_index[i]`` is anchor i's own column or -1."""
        same = labels[:, None] == ref_labels[None, :]
        pos = same.clone()
        neg = ~same
        if self_index is not None:
            rows = torch.arange(labels.shape[0], device=labels.device)
            own = self_index >= 0
            pos[rows[own], self_index[own]] = False
        valid, self.last_stats = anchor_statistics(pos, neg)
        return int(self.last_stats["n_anchors_used"])

    def _raise_if_nothing_to_rank(self, n_valid: int, labels: torch.Tensor) -> None:
        raise_if_nothing_to_rank(f"baseline {self.name!r}", n_valid, labels)

    def _record_mining(self, indices_tuple: tuple[torch.Tensor, ...]) -> None:
        if len(indices_tuple) == 3:
            self.last_stats["n_mined_triplets"] = int(indices_tuple[0].numel())
        else:
            self.last_stats["n_mined_positive_pairs"] = int(indices_tuple[0].numel())
            self.last_stats["n_mined_negative_pairs"] = int(indices_tuple[2].numel())

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Loss of one batch; arguments as :meth:`rankwise.losses.RankingLoss.forward`.

        ``ref_embeddings`` is PML's ``ref_emb``: when given, the anchors are compared with it only,
        never with each other.
        """
        emb, lab, ref, ref_lab = self._validate(embeddings, labels, ref_embeddings, ref_labels)
        # half precision is computed in float32, like the rankwise losses (rankwise.losses.base)
        emb = emb.to(score_dtype(emb.dtype))
        ref = None if ref is None else ref.to(emb.dtype)
        if ref is None or ref_lab is None:  # _validate gives both or neither
            self_index = torch.arange(lab.shape[0], device=lab.device)
            n_valid = self._count_anchors(lab, lab, self_index)
        else:
            n_valid = self._count_anchors(lab, ref_lab, None)
        self._raise_if_nothing_to_rank(n_valid, lab)
        indices_tuple = None
        if self.miner is not None:
            with torch.autocast(emb.device.type, enabled=False):
                indices_tuple = self.miner(emb, lab, ref, ref_lab)
            self._record_mining(indices_tuple)
        with torch.autocast(emb.device.type, enabled=False):
            return self.loss(emb, lab, indices_tuple, ref, ref_lab)

    def extra_repr(self) -> str:
        """The constructor arguments, shown by ``repr``."""
        return f"name={self.name!r}"


class CrossBatchMemoryBaseline(PMLBaseline):
    """PML ``CrossBatchMemory`` (XBM) around a loss, with its whole state in the module state.

    PML keeps the memory (``loss.embedding_memory`` (memory_size, embedding_size),
    ``loss.label_memory`` (memory_size,)) in buffers but its queue position and "memory full" flag
    in plain attributes, which ``state_dict()`` would lose; they are mirrored in the int64 buffers
    ``memory_queue_index`` and ``memory_filled`` and restored into PML before every call. The
    memory is the reference set (``ref_embeddings`` raise ``ValueError``).

    ``last_stats`` adds ``n_memory_items``; anchors are counted against the memory as it is after
    the enqueue (own slot excluded), before PML writes anything, so a call that raises leaves the
    memory as it was. Eval mode ranks against a frozen memory. The batch is enqueued in the
    memory's dtype or wider (half precision in float32).

    Warm-up and the batch term (Wang et al., CVPR 2020, Sec. 4, as the released code does): for the
    first ``start_iteration`` training calls the loss is the inner contrastive loss on the batch
    alone and nothing is enqueued; after them it is the memory loss, plus the batch loss when
    ``batch_loss``. The defaults (75, True) are that form; (0, False) is PML's, which collapses a
    network trained from scratch (docs/losses.md).
    """

    # PML's CrossBatchMemory: its queue_idx, has_been_filled, memory_size, ... are plain
    # attributes of an untyped package, which nn.Module's __getattr__ would type as Tensor | Module
    loss: Any
    memory_queue_index: torch.Tensor
    memory_filled: torch.Tensor
    iterations_seen: torch.Tensor

    def __init__(
        self, name: str, memory: nn.Module, start_iteration: int = 75, batch_loss: bool = True
    ) -> None:
        super().__init__(name, memory, None, _NO_REFERENCE_SET["xbm"])
        self.start_iteration = int(start_iteration)
        self.batch_loss = bool(batch_loss)
        self.register_buffer("memory_queue_index", torch.zeros((), dtype=torch.int64))
        self.register_buffer("memory_filled", torch.zeros((), dtype=torch.int64))
        # training calls seen, for the warm-up (a buffer: checkpoints resume it)
        self.register_buffer("iterations_seen", torch.zeros((), dtype=torch.int64))

    def reset_memory(self) -> None:
        """Empty the memory (zeros, queue at 0), keeping its device and dtype."""
        self.loss.embedding_memory.zero_()
        self.loss.label_memory.zero_()
        self.loss.queue_idx = 0
        self.loss.has_been_filled = False
        self.memory_queue_index.zero_()
        self.memory_filled.zero_()

    def forward(
        self,
        embeddings: torch.Tensor,
        labels: torch.Tensor,
        ref_embeddings: torch.Tensor | None = None,
        ref_labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Enqueue the batch and compute the loss of its anchors against the memory (see the class).

        ``embeddings`` (B, embedding_size) with B <= memory_size, ``labels`` (B,) class ids.
        """
        emb, lab, _, _ = self._validate(embeddings, labels, ref_embeddings, ref_labels)
        xbm = self.loss
        if emb.shape[1] != xbm.embedding_size:
            raise ValueError(
                f"`embeddings` has dimension {emb.shape[1]} but the XBM memory was built with "
                f"embedding_size={xbm.embedding_size}; pass embedding_size={emb.shape[1]}."
            )
        if emb.shape[0] > xbm.memory_size:
            raise ValueError(
                f"`embeddings` has {emb.shape[0]} rows, more than the XBM memory_size="
                f"{xbm.memory_size}; use memory_size >= batch size."
            )
        emb = emb.to(torch.promote_types(score_dtype(emb.dtype), xbm.embedding_memory.dtype))
        xbm.queue_idx = int(self.memory_queue_index)
        xbm.has_been_filled = bool(self.memory_filled)
        warming_up = int(self.iterations_seen) < self.start_iteration
        if not self.training:  # eval calls neither enqueue nor count toward the warm-up
            return self._batch_forward(emb, lab) if warming_up else self._frozen_forward(emb, lab)
        if warming_up:
            value = self._batch_forward(emb, lab)
        elif self.batch_loss:  # batch first: it validates before the memory is written
            value = self._batch_forward(emb, lab) + self._memory_forward(emb, lab)
        else:
            value = self._memory_forward(emb, lab)
        self.iterations_seen += 1
        return value

    def _batch_forward(self, emb: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        """The inner contrastive loss of the batch against itself (the memory untouched)."""
        n_valid = self._count_anchors(lab, lab, torch.arange(lab.shape[0], device=lab.device))
        self.last_stats["n_memory_items"] = 0  # the memory is not used: same keys as after
        self._raise_if_nothing_to_rank(n_valid, lab)
        with torch.autocast(emb.device.type, enabled=False):
            return self.loss.loss(emb, lab)

    def _memory_forward(self, emb: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        """Enqueue the batch, then its anchors' loss against the memory (PML)."""
        xbm = self.loss
        # Validate first, then mutate: count the anchors against the memory as PML's enqueue will
        # leave it (slots queue_idx, queue_idx + 1, ... mod memory_size; anchor i -> slot i).
        batch_size = lab.shape[0]
        slots = (xbm.queue_idx + torch.arange(batch_size, device=lab.device)) % xbm.memory_size
        filled = xbm.has_been_filled or xbm.queue_idx + batch_size >= xbm.memory_size
        n_memory = xbm.memory_size if filled else xbm.queue_idx + batch_size
        memory_labels = xbm.label_memory.to(lab.device, copy=True)
        memory_labels[slots] = lab
        n_valid = self._count_anchors(lab, memory_labels[:n_memory], slots)
        self.last_stats["n_memory_items"] = int(n_memory)
        self._raise_if_nothing_to_rank(n_valid, lab)
        with torch.autocast(emb.device.type, enabled=False):
            value = xbm(emb, lab)
        self.memory_queue_index.fill_(int(xbm.queue_idx))
        self.memory_filled.fill_(int(xbm.has_been_filled))
        return value

    def _frozen_forward(self, emb: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
        """Eval mode: the batch is ranked against the memory and never enqueued."""
        xbm = self.loss
        n_memory = xbm.memory_size if xbm.has_been_filled else xbm.queue_idx
        # the counts first: an empty or one-class memory is an error before PML is called
        n_valid = self._count_anchors(lab, xbm.label_memory[:n_memory].to(lab.device), None)
        self.last_stats["n_memory_items"] = int(n_memory)
        self._raise_if_nothing_to_rank(n_valid, lab)
        nothing = torch.zeros(emb.shape[0], dtype=torch.bool, device=emb.device)
        try:
            with torch.autocast(emb.device.type, enabled=False):
                return xbm(emb, lab, enqueue_mask=nothing)
        finally:
            # PML's bookkeeping counts an empty enqueue as a wrap-around ("memory full"): undo
            xbm.queue_idx = int(self.memory_queue_index)
            xbm.has_been_filled = bool(self.memory_filled)


def baseline(name: str, **kw: Any) -> nn.Module:
    """Build a pytorch-metric-learning baseline with the rankwise call contract.

    Args:
        name: one of :data:`BASELINES`:

            - ``"contrastive"``: ``ContrastiveLoss(pos_margin=1.0, neg_margin=0.5,
              distance=CosineSimilarity())`` (cosine form, XBM paper margins).
            - ``"triplet"``: ``TripletMarginLoss()`` (PML defaults: margin 0.05 on the L2 distance
              of normalized embeddings) on ``BatchHardMiner()`` triplets.
            - ``"triplet_semihard"``: ``TripletMarginLoss()`` on
              ``TripletMarginMiner(margin=<loss margin>, type_of_triplets="semihard")``.
            - ``"multi_similarity"``: ``MultiSimilarityLoss()`` (alpha 2, beta 50, base 0.5) on
              ``MultiSimilarityMiner()`` (epsilon 0.1), the paper's settings.
            - ``"fastap"``: ``FastAPLoss()`` (10 bins). No reference set.
            - ``"xbm"``: ``CrossBatchMemory(<contrastive as above>, embedding_size,
              memory_size=1024)``. No reference set; ``embedding_size`` is required;
              ``start_iteration`` (warm-up calls on the batch alone, default 75) and
              ``batch_loss`` (add the batch's own loss, default True): the released XBM
              code's form; 0 and False give PML's (:class:`CrossBatchMemoryBaseline`).
        **kw: keyword arguments of the PML loss constructor (they override the defaults above);
            ``miner_kwargs`` (dict) for the miner of the mined baselines; ``embedding_size``,
            ``memory_size``, ``start_iteration`` and ``batch_loss`` for ``"xbm"``.
            :func:`baseline_parameters` lists them.

    Returns:
        A :class:`PMLBaseline` (``.loss``, ``.miner`` are the PML objects) or, for ``"xbm"``, a
        :class:`CrossBatchMemoryBaseline`.

    Example:
        >>> import torch
        >>> from rankwise.losses import baseline
        >>> loss_fn = baseline("contrastive")  # needs pytorch-metric-learning (the baselines extra)
        >>> emb = torch.tensor([[1.0, 0.0], [0.9, 0.4], [0.0, 1.0], [0.6, 0.8]])
        >>> round(loss_fn(emb, torch.tensor([0, 0, 1, 1])).item(), 4)
        0.3797
    """
    valid = baseline_parameters(name)
    for key in kw:
        if key not in valid:
            raise ValueError(
                f"baseline {name!r} got an unknown parameter {key!r}; valid parameters: "
                f"{', '.join(valid)}."
            )
    kw = _check_values(dict(kw), name)
    miner_kwargs = _check_miner_kwargs(name, kw.pop("miner_kwargs", None))
    loss_kwargs: dict[str, Any] = {}
    if name in ("contrastive", "xbm"):
        loss_kwargs = {**_CONTRASTIVE_DEFAULTS, "distance": _pml("distances").CosineSimilarity()}
    if name == "xbm":
        return _cross_batch_memory(name, loss_kwargs, kw)
    loss_kwargs.update(kw)
    loss = getattr(_pml("losses"), _LOSS_CLASSES[name])(**loss_kwargs)
    miner = None
    if name == "triplet_semihard":
        # Semi-hard is defined relative to the loss margin, so the miner uses the same margin.
        miner_kwargs.setdefault("margin", loss.margin)
        miner_kwargs.setdefault("type_of_triplets", "semihard")
    if name in _MINER_CLASSES:
        miner = getattr(_pml("miners"), _MINER_CLASSES[name])(**miner_kwargs)
    return PMLBaseline(name, loss, miner, _NO_REFERENCE_SET.get(name))


def _cross_batch_memory(
    name: str, loss_kwargs: dict[str, Any], kw: dict[str, Any]
) -> CrossBatchMemoryBaseline:
    """XBM: a cosine contrastive loss inside PML's ``CrossBatchMemory``."""
    embedding_size = kw.pop("embedding_size", None)
    if embedding_size is None:
        raise ValueError(
            "baseline 'xbm' needs `embedding_size`, a positive int (the embedding dimension)."
        )
    memory_size = kw.pop("memory_size", 1024)
    warm_up = {key: kw.pop(key) for key in ("start_iteration", "batch_loss") if key in kw}
    pml_losses = _pml("losses")
    loss = pml_losses.ContrastiveLoss(**{**loss_kwargs, **kw})
    memory = pml_losses.CrossBatchMemory(loss, embedding_size, memory_size=memory_size)
    return CrossBatchMemoryBaseline(name, memory, **warm_up)
