"""``build_model``: construct an :class:`EmbeddingModel` from a backbone name.

Backbones: ``resnet50`` (the ImageNet-pretrained, frozen-BN ResNet-50 of Wen et al., NeurIPS 2022,
Sec. 6, and Gajić et al., Sec. 4.2), and ``small_cnn`` / ``mlp`` for small inputs (digits, MNIST
family, CIFAR-10 at 32x32); or your own network, ``"package.module:factory"``, or a timm model,
``"timm:NAME"`` (:mod:`rankwise.models.external`). The head projects to ``embedding_dim`` and
L2-normalizes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from .._registry import Registry
from .backbones import MLPBackbone, SmallCNN, resnet50_backbone
from .embedding import EmbeddingHead, EmbeddingModel
from .external import build_external_backbone, is_external_backbone

__all__ = ["BACKBONES", "build_model", "build_backbone"]

# backbone name -> the options it takes
_BACKBONE_KWARGS: Registry[tuple[str, ...]] = Registry(
    "backbone",
    {"small_cnn": ("width",), "mlp": ("hidden", "dropout"), "resnet50": ()},
    normalize=lambda name: str(name).strip().lower().replace("-", "_"),
    hint="; or your own network as 'package.module:factory', or a timm model as 'timm:NAME'",
)
BACKBONES: tuple[str, ...] = _BACKBONE_KWARGS.names
_HEAD_KWARGS = ("normalize",)


def build_backbone(
    backbone: str,
    input_shape: tuple[int, ...],
    *,
    weights_path: str | os.PathLike | None = None,
    frozen_bn: bool = True,
    backbone_options: Mapping[str, Any] | None = None,
    **kw: Any,
) -> nn.Module:
    """Backbone module for ``input_shape`` (one item, e.g. ``(1, 28, 28)``); has ``out_features``.

    ``backbone``: a name of :data:`BACKBONES`, ``"package.module:factory"`` or ``"timm:NAME"``
    (:func:`rankwise.models.external.build_external_backbone`). ``backbone_options`` and ``kw``
    (merged): ``width`` (small_cnn), ``hidden`` and ``dropout`` (mlp), the factory's keywords.
    """
    clash = sorted(set(kw) & set(backbone_options or {}))
    if clash:
        raise ValueError(f"backbone option(s) {clash} given twice (keywords and backbone_options).")
    kw = {**kw, **(backbone_options or {})}
    shape = tuple(int(s) for s in input_shape)
    if not shape or any(s < 1 for s in shape):
        raise ValueError(
            f"`input_shape` must be a non-empty tuple of positive ints, got {input_shape}."
        )
    if is_external_backbone(backbone):
        return build_external_backbone(
            backbone, shape, options=kw, weights_path=weights_path, frozen_bn=frozen_bn
        )
    key = _BACKBONE_KWARGS.canonical(backbone)
    unknown = sorted(set(kw) - set(_BACKBONE_KWARGS[key]))
    if unknown:
        raise ValueError(
            f"backbone {key!r} does not take option(s) {unknown}; it accepts "
            f"{list(_BACKBONE_KWARGS[key]) or 'no extra options'}."
        )
    if weights_path is not None and key != "resnet50":
        raise ValueError(
            f"`weights_path` is only used by the resnet50, factory ('package.module:factory') "
            f"and timm backbones, not {key!r}; drop it."
        )
    if key == "mlp":
        return MLPBackbone(math.prod(shape), **kw)
    if len(shape) != 3:
        raise ValueError(
            f"backbone {key!r} needs image input_shape (C, H, W), got {shape}; use 'mlp' for "
            "vectors."
        )
    channels, height, width = shape
    if key == "small_cnn":
        if height != width:
            raise ValueError(f"small_cnn needs square inputs, got input_shape {shape}.")
        return SmallCNN(in_channels=channels, input_size=height, **kw)
    if channels != 3:
        raise ValueError(
            f"resnet50 needs 3-channel images, got input_shape {shape}; use 'small_cnn' for "
            "grayscale data."
        )
    return resnet50_backbone(weights_path=weights_path, frozen_bn=frozen_bn)


def backbone_width(net: nn.Module) -> int:
    """``net.out_features``: the feature width every backbone of :func:`build_backbone` sets."""
    width = net.out_features  # a plain attribute, which nn.Module's typing cannot see
    if not isinstance(width, int):
        raise TypeError(f"backbone {type(net).__name__} has no integer `out_features`.")
    return width


def build_model(
    backbone: str,
    input_shape: tuple[int, ...],
    embedding_dim: int,
    *,
    weights_path: str | os.PathLike | None = None,
    frozen_bn: bool = True,
    backbone_options: Mapping[str, Any] | None = None,
    **kw: Any,
) -> EmbeddingModel:
    """Backbone + :class:`EmbeddingHead` (``embedding_dim`` outputs, L2-normalized).

    Args:
        backbone: one of :data:`BACKBONES`, ``"package.module:factory"`` (a callable
            returning ``(network, width)``) or ``"timm:NAME"``.
        input_shape: shape of one input item, e.g. ``(1, 8, 8)`` or ``(3, 224, 224)``.
        embedding_dim: ``d``.
        weights_path: local backbone weights (resnet50, a factory's or a timm network); never
            downloaded.
        frozen_bn: freeze the backbone's BatchNorm layers (small_cnn and mlp have none).
        backbone_options: the backbone's options as one mapping (a factory's keywords; any
            key, ``normalize`` included, goes to the backbone).
        **kw: backbone options (``width``; ``hidden``, ``dropout``) and ``normalize`` (head).

    Returns:
        :class:`EmbeddingModel` mapping ``(B, *input_shape)`` to ``(B, embedding_dim)``.
    """
    if int(embedding_dim) < 1:
        raise ValueError(f"`embedding_dim` must be a positive integer, got {embedding_dim}.")
    head_kw = {k: kw.pop(k) for k in _HEAD_KWARGS if k in kw}
    net = build_backbone(
        backbone,
        input_shape,
        weights_path=weights_path,
        frozen_bn=frozen_bn,
        backbone_options=backbone_options,
        **kw,
    )
    head = EmbeddingHead(backbone_width(net), int(embedding_dim), **head_kw)
    return EmbeddingModel(net, head)
