"""Feature extractors (backbones) for embedding models, and frozen batch normalization.

The image-retrieval experiments of Wen et al., NeurIPS 2022 (SOPRC, Sec. 6 / App. D) and
Gajić et al. (AUC loss, Sec. 4.2) fine-tune an ImageNet-pretrained ResNet-50 with its batch
normalization layers frozen (running statistics fixed, BN in eval mode during training), since
P x K batches of a few classes give poor batch statistics. Frozen BN computes
y = (x - running_mean) / sqrt(running_var + eps) * weight + bias with fixed statistics (the
inference form of Ioffe & Szegedy 2015, Eq. in Alg. 1). ``SmallCNN`` and ``MLPBackbone`` are small
backbones for the bundled digits / MNIST-family experiments and for tests.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "FrozenBatchNorm",
    "freeze_batchnorm",
    "SmallCNN",
    "MLPBackbone",
    "resnet50_backbone",
    "VISION_EXTRA_HINT",
]

VISION_EXTRA_HINT = "pip install rankwise[vision]"


class FrozenBatchNorm(nn.Module):
    """Batch normalization with fixed statistics; ``train()`` does not change its behaviour.

    Works on ``(B, C)``, ``(B, C, L)``, ``(B, C, H, W)`` and ``(B, C, D, H, W)`` inputs (channel
    dimension 1), so it replaces ``BatchNorm1d/2d/3d``. ``running_mean`` and ``running_var`` are
    buffers; ``weight``/``bias`` are buffers too unless ``trainable_affine`` is set, then they
    are parameters.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance, as in the BN layer it replaces.
        trainable_affine: keep ``weight`` and ``bias`` learnable.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    running_mean: torch.Tensor
    running_var: torch.Tensor

    def __init__(
        self, num_features: int, eps: float = 1e-5, trainable_affine: bool = False
    ) -> None:
        super().__init__()
        self.num_features = int(num_features)
        self.eps = float(eps)
        self.trainable_affine = bool(trainable_affine)
        weight, bias = torch.ones(num_features), torch.zeros(num_features)
        if trainable_affine:
            self.weight = nn.Parameter(weight)
            self.bias = nn.Parameter(bias)
        else:
            self.register_buffer("weight", weight)
            self.register_buffer("bias", bias)
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    @classmethod
    def from_batchnorm(
        cls, bn: nn.modules.batchnorm._BatchNorm, trainable_affine: bool = False
    ) -> FrozenBatchNorm:
        """Copy statistics and affine parameters of ``bn`` (identity affine when it has none)."""
        frozen = cls(bn.num_features, eps=bn.eps, trainable_affine=trainable_affine)
        ref = bn.running_mean if bn.running_mean is not None else bn.weight
        if ref is not None:
            frozen = frozen.to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            if bn.affine:
                frozen.weight.copy_(bn.weight.detach())
                frozen.bias.copy_(bn.bias.detach())
            if (
                bn.track_running_stats
                and bn.running_mean is not None
                and bn.running_var is not None
            ):
                frozen.running_mean.copy_(bn.running_mean)
                frozen.running_var.copy_(bn.running_var)
        return frozen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``(B, C, ...)`` with the frozen statistics and affine parameters."""
        if x.ndim < 2 or x.shape[1] != self.num_features:
            raise ValueError(
                f"FrozenBatchNorm expects input (B, {self.num_features}, ...), got {tuple(x.shape)}."
            )
        scale = self.weight * torch.rsqrt(self.running_var + self.eps)
        shift = self.bias - self.running_mean * scale
        shape = (1, -1) + (1,) * (x.ndim - 2)
        return x * scale.reshape(shape) + shift.reshape(shape)

    def extra_repr(self) -> str:
        """Feature count, epsilon and whether the affine parameters train."""
        return f"{self.num_features}, eps={self.eps}, trainable_affine={self.trainable_affine}"


def freeze_batchnorm(module: nn.Module, trainable_affine: bool = False) -> nn.Module:
    """Replace every ``BatchNorm1d/2d/3d`` in ``module`` by a :class:`FrozenBatchNorm` in place.

    The frozen layers keep their running statistics whatever ``train()`` / ``eval()`` follows.
    Returns ``module`` (or the replacement when ``module`` itself is a BN layer).
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return FrozenBatchNorm.from_batchnorm(module, trainable_affine)
    for name, child in module.named_children():
        replaced = freeze_batchnorm(child, trainable_affine)
        if replaced is not child:
            setattr(module, name, replaced)
    return module


class SmallCNN(nn.Module):
    """A four-convolution CNN for small images (8x8 digits, 28x28 MNIST, 32x32 CIFAR).

    conv3x3(C->w) - ReLU - conv3x3(w->w) - ReLU - maxpool2 - conv3x3(w->2w) - ReLU - maxpool2 -
    conv3x3(2w->2w) - ReLU - adaptive average pool to 2x2 - flatten. No batch normalization,
    so P x K batches of few classes do not bias it.

    Args:
        in_channels: input channels ``C``.
        input_size: input height = width (>= 4).
        width: channels of the first block ``w``.

    Shapes: ``(B, C, input_size, input_size)`` -> ``(B, 8 * width)``; ``out_features = 8 * width``.
    """

    def __init__(self, in_channels: int = 1, input_size: int = 28, width: int = 32) -> None:
        super().__init__()
        if int(in_channels) < 1 or int(width) < 1:
            raise ValueError(
                f"`in_channels` and `width` must be positive, got {in_channels} and {width}."
            )
        if int(input_size) < 4:
            raise ValueError(f"`input_size` must be >= 4 (two 2x poolings), got {input_size}.")
        self.in_channels = int(in_channels)
        self.input_size = int(input_size)
        w = int(width)
        self.features = nn.Sequential(
            nn.Conv2d(self.in_channels, w, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(w, w, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(w, 2 * w, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(2),
        )
        self.out_features = 8 * w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(B, C, H, W)`` to features ``(B, out_features)``."""
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"SmallCNN expects input (B, {self.in_channels}, H, W), got {tuple(x.shape)}."
            )
        return self.features(x).flatten(1)


class MLPBackbone(nn.Module):
    """Flatten, then ``Linear - ReLU (- Dropout)`` per hidden width.

    Args:
        in_features: size of the flattened input.
        hidden: hidden widths; ``()`` makes the backbone the identity on the flattened input.
        dropout: dropout probability after every hidden layer.

    Shapes: ``(B, *)`` with ``prod(*) = in_features`` -> ``(B, out_features)``,
    ``out_features = hidden[-1]`` (``in_features`` when ``hidden`` is empty).
    """

    def __init__(
        self, in_features: int, hidden: Sequence[int] = (256,), dropout: float = 0.0
    ) -> None:
        super().__init__()
        if int(in_features) < 1:
            raise ValueError(f"`in_features` must be positive, got {in_features}.")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {dropout}.")
        hidden = tuple(int(h) for h in hidden)
        if any(h < 1 for h in hidden):
            raise ValueError(f"`hidden` widths must be positive, got {hidden}.")
        self.in_features = int(in_features)
        layers: list[nn.Module] = []
        prev = self.in_features
        for h in hidden:
            layers += [nn.Linear(prev, h), nn.ReLU(inplace=True)]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            prev = h
        self.layers = nn.Sequential(*layers)
        self.out_features = prev

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Flatten ``(B, ...)`` to ``(B, in_features)`` and map it to ``(B, out_features)``."""
        flat = x.reshape(x.shape[0], -1)
        if flat.shape[1] != self.in_features:
            raise ValueError(
                f"MLPBackbone expects {self.in_features} features per sample, got input "
                f"{tuple(x.shape)} ({flat.shape[1]} after flattening)."
            )
        return self.layers(flat)


def _load_state_dict_file(
    weights_path: str | os.PathLike,
    what: str = "ResNet-50 state dict (e.g. torchvision's resnet50-*.pth)",
) -> dict[str, torch.Tensor]:
    path = os.fspath(weights_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"`weights_path` {path!r} does not exist; rankwise never downloads weights, pass a "
            f"local {what}."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"`weights_path` {path!r} could not be loaded as a tensor state dict ({exc})."
        ) from exc
    for key in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict):
        raise ValueError(f"`weights_path` {path!r} does not hold a state dict.")
    return {(k[len("module.") :] if k.startswith("module.") else k): v for k, v in state.items()}


def resnet50_backbone(
    weights_path: str | os.PathLike | None = None, frozen_bn: bool = True
) -> nn.Module:
    """ResNet-50 of torchvision without its classifier: ``(B, 3, H, W)`` -> ``(B, 2048)``.

    Args:
        weights_path: local state dict (``torch.load(weights_only=True)``), e.g. ImageNet
            weights; the ``fc.*`` classifier entries are ignored. ``None``: random init.
            Nothing is downloaded.
        frozen_bn: replace BN layers by :class:`FrozenBatchNorm` (after loading the weights, so
            the pretrained statistics are the frozen ones).

    Raises:
        ImportError: torchvision is not importable (install the ``vision`` extra).
        ValueError: the file is not a ResNet-50 state dict (lists missing / unexpected keys).
    """
    try:
        from torchvision.models import resnet50
    except Exception as exc:  # ImportError, or torchvision built against another torch
        raise ImportError(
            f"the resnet50 backbone needs torchvision, which could not be imported ({exc}); "
            f"install it with `{VISION_EXTRA_HINT}` or use backbone 'small_cnn' / 'mlp'."
        ) from exc
    model = resnet50(weights=None)
    out_features = int(model.fc.in_features)
    model.fc = nn.Identity()
    if weights_path is not None:
        state = _load_state_dict_file(weights_path)
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}
        result = model.load_state_dict(state, strict=False)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(
                f"`weights_path` {os.fspath(weights_path)!r} is not a ResNet-50 state dict: "
                f"missing keys {list(result.missing_keys)[:5]}, unexpected keys "
                f"{list(result.unexpected_keys)[:5]}."
            )
    if frozen_bn:
        freeze_batchnorm(model)
    model.out_features = out_features
    return model
