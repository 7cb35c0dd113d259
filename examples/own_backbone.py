"""Your own backbone in a config: ``model.backbone: "own_backbone:conv_net"``.

rankwise imports this module by name and calls ``conv_net(**model.backbone_options)``; the
factory returns the feature network and its output width, and rankwise adds its projection head
and L2 normalisation, as after a built-in backbone. The config records the name, so
``rankwise embed`` / ``load_run`` / ``rankwise export`` rebuild the network from the run folder:
the module must import there too (here: ``PYTHONPATH=examples``). Run from the repository root::

    PYTHONPATH=examples rankwise train --config examples/own_backbone.yaml --output runs/own
    PYTHONPATH=examples rankwise embed runs/own x.npy --output emb.npy
"""

from __future__ import annotations

from torch import nn


def conv_net(channels: int = 16, in_channels: int = 1) -> tuple[nn.Module, int]:
    """A small CNN for 8 x 8 digits: ``(B, in_channels, 8, 8)`` -> ``(B, 4 * channels)``.

    Args:
        channels: feature maps of the convolutions (``model.backbone_options.channels``).
        in_channels: channels of the input images.

    Returns:
        The network and its output width, the contract of ``model.backbone``.
    """
    net = nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),  # pooled and flattened: the features are (B, width)
        nn.Flatten(),
    )
    return net, 4 * channels
