"""Hashing heads: a linear layer whose outputs become bits, relaxed by tanh for training.

He, Cakir, Bargal & Sclaroff (CVPR 2018), Sec. 4.1, Eq. (8)-(10): bit ``i`` of the code is
``sgn(f_i(x))`` with ``f`` the network's activations, and training replaces ``sgn`` by the smooth
``tanh``. Following the authors' released code (``2 sigmoid(γ f) - 1``), the relaxation here is
``tanh(γ f / 2)`` with steepness ``γ`` (``γ = 1`` in every released experiment); larger ``γ`` makes
the relaxed codes closer to binary. ``sgn(0)`` is taken as ``+1`` so that encoding is deterministic.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .._packing import pack_codes
from .._validation import Interval, check_bool, check_choice, check_scalar
from ..models import build_backbone
from ..models.build import backbone_width

__all__ = ["DebiasedBatchNorm1d", "HashingHead", "HashingModel", "build_hashing_model", "binarize"]


def binarize(values: torch.Tensor) -> torch.Tensor:
    """``{-1, +1}`` int8 codes of real values: ``+1`` where ``values >= 0`` (so 0 maps to +1)."""
    return torch.where(values >= 0, 1, -1).to(torch.int8)


class DebiasedBatchNorm1d(nn.BatchNorm1d):
    """``BatchNorm1d`` without affine parameters whose running statistics are debiased in eval mode.

    torch's running mean starts at 0 and its running variance at 1, then moves by ``momentum`` per
    batch, so after ``t`` batches they still weigh the initial values by ``(1 - momentum)^t``
    (0.81 after 2 batches). A hashing head evaluated early in training (the first validation of a
    short run) then barely centres its activations, and every input falls on the same side of
    every bit: all codes tie although the batches themselves are centred. As Adam does for its
    moments (Kingma & Ba, ICLR 2015, Sec. 3), eval mode divides that weight out:
    ``mean = m_t / (1 - k)``, ``var = (v_t - k) / (1 - k)`` with ``k = (1 - momentum)^t``. The
    buffers and ``state_dict`` keys are ``BatchNorm1d``'s (checkpoints load either way); after a
    few hundred batches ``k`` is below 1e-9 and the statistics are torch's.

    Shapes:
        ``(B, C) -> (B, C)``.

    Example:
        >>> norm = DebiasedBatchNorm1d(2)
        >>> _ = norm(torch.tensor([[1.0, 10.0], [3.0, 14.0]]))  # one training batch
        >>> _ = norm.eval()
        >>> out = norm(torch.tensor([[2.0, 12.0]]))  # centred on that batch's mean, not 0.1 x it
        >>> bool(out.abs().max() < 1e-5)
        True
    """

    initial_weight: torch.Tensor

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum, affine=False)
        # the weight the initial values (mean 0, variance 1) still have in the running statistics:
        # 1 at the start, (1 - momentum) less per batch, 0 after a cumulative pass (momentum None,
        # as calibrate_batch_norm makes one). A buffer, so checkpoints carry it.
        self.register_buffer("initial_weight", torch.ones((), dtype=torch.float64))

    def reset_running_stats(self) -> None:
        """Reset as torch does, and let the initial values weigh everything again."""
        super().reset_running_stats()
        if hasattr(self, "initial_weight"):  # BatchNorm's __init__ resets before it exists
            self.initial_weight.fill_(1.0)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # a checkpoint of a plain BatchNorm1d (runs before this class) has no initial_weight: its
        # statistics were exponential averages over num_batches_tracked batches
        key = prefix + "initial_weight"
        if key not in state_dict and prefix + "num_batches_tracked" in state_dict:
            batches = float(state_dict[prefix + "num_batches_tracked"])
            keep = (1.0 - float(self.momentum or 1.0)) ** batches
            state_dict[key] = torch.tensor(keep, dtype=torch.float64)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def debiased_running_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running mean and variance with the initial values' weight divided out."""
        assert self.running_mean is not None and self.running_var is not None
        # tensor arithmetic, no host read of the weight: eval stays free of device syncs
        start = self.initial_weight.to(self.running_mean.dtype)
        weight = 1.0 - start
        seen = weight > 0
        weight = torch.where(seen, weight, torch.ones_like(weight))
        start = torch.where(seen, start, torch.zeros_like(start))
        mean = self.running_mean / weight
        var = ((self.running_var - start) / weight).clamp_min(0.0)
        return mean, var

    def normalize_with_running_stats(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise by the debiased running statistics, whatever the mode (updates nothing)."""
        mean, var = self.debiased_running_stats()
        return F.batch_norm(x, mean, var, training=False, eps=self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Batch statistics (and a running update) when training; debiased running ones in eval."""
        if not self.training:
            return self.normalize_with_running_stats(x)
        out = super().forward(x)
        if self.track_running_stats:
            # torch just moved the running statistics by momentum (or to the cumulative average)
            if self.momentum is None:
                self.initial_weight.zero_()
            else:
                self.initial_weight.mul_(1.0 - self.momentum)
        return out


class HashingHead(nn.Module):
    """Linear map to ``bits`` activations, relaxed to ``tanh(γ f / 2)`` while training.

    Args:
        in_features: size of the input features.
        bits: code length ``b``.
        gamma: steepness ``γ > 0`` of the relaxation (a buffer: it travels with ``state_dict``
            and can be annealed with :meth:`set_gamma`).
        bias: learn a bias in the linear map.
        hard_eval: in eval mode, ``forward`` returns the binary codes (as ``±1`` floats) instead
            of the relaxation, so any evaluation of the model's outputs ranks by Hamming distance.
        relaxation: ``"tanh"`` (``tanh(γ f / 2)``, TALR) or ``"identity"`` (the activations
            ``f`` themselves, for losses with their own quantization term such as DPSH, whose
            outputs ``u`` are linear, Li et al. IJCAI 2016, Eq. 5).
        center: batch-normalize the activations (``BatchNorm1d`` without affine parameters,
            running statistics in eval mode): each bit is centred and of unit scale, so a fresh
            network's codes differ (a linear map of ReLU features has one sign for every input)
            and ``tanh(γ f / 2)`` starts in its sensitive range. ``False``: the paper's plain
            linear layer (fine on pretrained features).

    Shapes:
        ``forward``: ``(B, in_features) -> (B, bits)``, values in ``(-1, 1)`` when training.
        ``encode``: ``(B, in_features) -> (B, bits)`` int8 in ``{-1, +1}``.
    """

    gamma: torch.Tensor

    def __init__(
        self,
        in_features: int,
        bits: int,
        gamma: float = 1.0,
        bias: bool = True,
        hard_eval: bool = True,
        relaxation: str = "tanh",
        center: bool = True,
    ) -> None:
        super().__init__()
        self.in_features = check_scalar(in_features, "in_features", Interval("integer", 1, None))
        self.bits = check_scalar(bits, "bits", Interval("integer", 1, None))
        gamma = check_scalar(gamma, "gamma", Interval("real", 0, None, closed="neither"))
        self.hard_eval = check_bool(hard_eval, "hard_eval")
        self.relaxation = check_choice(relaxation, "relaxation", ("tanh", "identity"))
        self.linear = nn.Linear(self.in_features, self.bits, bias=check_bool(bias, "bias"))
        self.center = check_bool(center, "center")
        self.norm = DebiasedBatchNorm1d(self.bits) if self.center else None
        self.register_buffer("gamma", torch.tensor(float(gamma), dtype=torch.float64))

    def set_gamma(self, gamma: float) -> None:
        """Change the steepness ``γ`` (e.g. doubled every few epochs, as the released code can)."""
        value = check_scalar(gamma, "gamma", Interval("real", 0, None, closed="neither"))
        self.gamma.fill_(value)

    def activations(self, features: torch.Tensor) -> torch.Tensor:
        """The real-valued activations ``f`` (B, bits) whose signs are the bits."""
        if features.ndim != 2 or features.shape[1] != self.in_features:
            raise ValueError(
                f"HashingHead expects features (B, {self.in_features}), got "
                f"{tuple(features.shape)}."
            )
        f = self.linear(features)
        return f if self.norm is None else self.norm(f)

    def _frozen_activations(self, features: torch.Tensor) -> torch.Tensor:
        """Activations with the running statistics, whatever the mode (encoding never updates them)."""
        if self.norm is None or not self.training:
            return self.activations(features)
        return self.norm.normalize_with_running_stats(self.linear(features))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Relaxed codes ``tanh(γ f / 2)`` (training), or ``±1`` codes in eval mode if hard_eval."""
        f = self.activations(features)
        if not self.training and self.hard_eval:
            return binarize(f).to(f.dtype)
        if self.relaxation == "identity":
            return f
        return torch.tanh(self.gamma.to(f.dtype) * f / 2)

    @torch.no_grad()
    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Binary codes ``sgn(f)`` as int8 ``{-1, +1}`` (``f = 0`` gives ``+1``)."""
        return binarize(self._frozen_activations(features))

    def pack(self, features: torch.Tensor, dtype: str = "uint8") -> np.ndarray:
        """Packed codes (see :func:`rankwise.hashing.pack_codes`): 8 bytes per 64-bit code."""
        return pack_codes(self.encode(features), dtype=dtype)

    def extra_repr(self) -> str:
        """The settings shown by ``repr``."""
        return (
            f"in_features={self.in_features}, bits={self.bits}, gamma={float(self.gamma):g}, "
            f"hard_eval={self.hard_eval}, relaxation={self.relaxation!r}, center={self.center}"
        )


class HashingModel(nn.Module):
    """A backbone followed by a :class:`HashingHead`.

    Args:
        backbone: module mapping a batch to ``(B, F)`` features (or what ``flatten(1)`` makes so).
        head: the hashing head.

    Attributes:
        bits: the code length; ``embedding_dim`` is the same number (the Trainer's name for it).
    """

    def __init__(self, backbone: nn.Module, head: HashingHead) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.bits = head.bits
        self.embedding_dim = head.bits

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Backbone features ``(B, F)``."""
        out = self.backbone(x)
        return out.flatten(1) if out.ndim != 2 else out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Relaxed codes while training, ``±1`` codes in eval mode (see :class:`HashingHead`)."""
        return self.head(self.features(x))

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """int8 ``{-1, +1}`` codes of a batch (the model's mode is left unchanged)."""
        return self.head.encode(self.features(x))

    def pack(self, x: torch.Tensor, dtype: str = "uint8") -> np.ndarray:
        """Packed codes of a batch."""
        return pack_codes(self.encode(x), dtype=dtype)


def build_hashing_model(
    backbone: str,
    input_shape: tuple[int, ...],
    bits: int,
    *,
    gamma: float = 1.0,
    relaxation: str = "tanh",
    center: bool = True,
    weights_path: str | os.PathLike | None = None,
    frozen_bn: bool = True,
    **kw: Any,
) -> HashingModel:
    """A :class:`HashingModel` on one of :data:`rankwise.models.BACKBONES`.

    Args:
        backbone: ``"small_cnn"``, ``"mlp"``, ``"resnet50"`` or ``"linear"`` (no hidden layer:
            the linear hash functions ``f_i(x) = w_iᵀx`` of the paper's LabelMe experiment).
        input_shape: shape of one input item.
        bits: code length.
        gamma: relaxation steepness (see :class:`HashingHead`).
        relaxation: ``"tanh"`` or ``"identity"`` (see :class:`HashingHead`).
        center: batch-normalize the activations (see :class:`HashingHead`).
        weights_path: local ResNet-50 weights (resnet50 only).
        frozen_bn: freeze the backbone's BatchNorm layers (resnet50).
        **kw: backbone options (``width``; ``hidden``, ``dropout``).
    """
    if backbone == "linear":
        if kw or weights_path is not None:
            raise ValueError("the 'linear' backbone takes no options.")
        head = HashingHead(
            int(np.prod(input_shape)), bits, gamma, relaxation=relaxation, center=center
        )
        return HashingModel(nn.Flatten(), head)
    net = build_backbone(
        backbone, input_shape, weights_path=weights_path, frozen_bn=frozen_bn, **kw
    )
    head = HashingHead(backbone_width(net), bits, gamma, relaxation=relaxation, center=center)
    return HashingModel(net, head)
