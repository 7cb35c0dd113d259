"""Backbones from outside rankwise: your own factory or a timm model, named in the config.

``model.backbone: "package.module:factory"`` imports ``package.module`` with :mod:`importlib`
and calls ``factory(**model.backbone_options)``, which returns ``(network, width)``: the feature
network, mapping a ``(B, *input_shape)`` batch to ``(B, width)`` features, and that width. The
config records the spec string, so reloading a run (``load_run``, ``rankwise embed``,
``rankwise export``, ``Trainer.from_run_dir``) imports the same factory again.

``model.backbone: "timm:NAME"`` builds ``timm.create_model(NAME, pretrained=False,
num_classes=0, **model.backbone_options)`` (the classifier removed, so the network returns its
pooled features, ``num_features`` wide; Wightman, *PyTorch Image Models*, 2019). Nothing is
downloaded: weights come from a local state dict, ``model.weights_path``, loaded with
``torch.load(weights_only=True)``.

Either way the network is checked before training: one forward of a batch of zeros of the data's
input shape must give ``(2, width)`` features. Then ``model.frozen_bn`` freezes its batch
normalisation as it does the built-in ResNet-50's, and :func:`rankwise.models.build_model` adds
the same projection head and L2 normalisation as after a built-in backbone.
"""

from __future__ import annotations

import importlib
import inspect
import numbers
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from .._extras import require
from .backbones import _load_state_dict_file, freeze_batchnorm

__all__ = [
    "TIMM_PREFIX",
    "BackboneError",
    "build_external_backbone",
    "check_backbone_spec",
    "import_factory",
    "is_external_backbone",
]

TIMM_PREFIX = "timm:"
_PROBE_BATCH = 2  # two rows: a network that squeezes the batch dimension shows it


class BackboneError(ValueError):
    """A backbone from a factory or timm that cannot be built or does not fit the data.

    Attributes:
        argument: the argument at fault, ``"backbone"``, ``"backbone_options"`` or
            ``"weights_path"`` (the ``model.`` config key of the same name).
    """

    def __init__(self, message: str, argument: str = "backbone") -> None:
        super().__init__(message)
        self.argument = argument


def is_external_backbone(backbone: Any) -> bool:
    """Whether ``backbone`` names a factory (``"package.module:factory"``) or ``"timm:NAME"``.

    >>> is_external_backbone("small_cnn"), is_external_backbone("timm:resnet18")
    (False, True)
    """
    return isinstance(backbone, str) and ":" in backbone


def _dotted(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def check_backbone_spec(spec: str) -> tuple[str, str]:
    """``(module, attribute)`` of ``"package.module:factory"`` (``("timm", NAME)`` for timm).

    Only the spelling is checked; nothing is imported.

    Raises:
        BackboneError: not ``"package.module:factory"`` (dotted Python names on both sides of
            one colon) nor ``"timm:NAME"``.

    >>> check_backbone_spec("mypackage.nets:make_backbone")
    ('mypackage.nets', 'make_backbone')
    >>> check_backbone_spec("timm:resnet18")
    ('timm', 'resnet18')
    """
    module, sep, attribute = spec.strip().partition(":")
    if module == "timm" and sep:
        if not attribute.strip():
            raise BackboneError(
                f"backbone {spec!r} names no timm model; write 'timm:NAME', e.g. 'timm:resnet18'."
            )
        return module, attribute.strip()
    if not (sep and _dotted(module) and _dotted(attribute)):
        raise BackboneError(
            f"backbone {spec!r} is neither a built-in backbone nor 'package.module:factory' "
            "(dotted Python names on both sides of one colon) nor 'timm:NAME'; e.g. "
            "'mypackage.nets:make_backbone'."
        )
    return module, attribute


def import_factory(spec: str) -> Callable[..., Any]:
    """The callable that ``"package.module:factory"`` names, imported with :mod:`importlib`.

    Raises:
        BackboneError: the module does not import (with the start of ``sys.path``), it has no
            such attribute, or the attribute is not callable.
    """
    module_name, attribute = check_backbone_spec(spec)
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or an error inside the user's module
        where = [p or "." for p in sys.path[:3]]
        raise BackboneError(
            f"backbone {spec!r}: module {module_name!r} does not import "
            f"({type(exc).__name__}: {exc}); make it importable (install its package, or put "
            f"the folder holding it on PYTHONPATH; sys.path starts with {where})."
        ) from exc
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise BackboneError(
                f"backbone {spec!r}: module {module_name!r} has no attribute {attribute!r}; "
                "name the function that returns (network, width) after the colon."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise BackboneError(
            f"backbone {spec!r}: {attribute!r} is a {type(obj).__name__}, not a callable; "
            "name a function that returns (network, width)."
        )
    return obj


def _call_factory(spec: str, factory: Callable[..., Any], options: Mapping[str, Any]) -> Any:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: call it and see
        signature = None
    if signature is not None:
        try:
            signature.bind(**options)
        except TypeError as exc:
            raise BackboneError(
                f"backbone {spec!r} does not take the options {dict(options)} ({exc}); its "
                f"signature is {spec.partition(':')[2]}{signature}: set model.backbone_options "
                "to match it.",
                argument="backbone_options",
            ) from None
    try:
        return factory(**options)
    except Exception as exc:
        raise BackboneError(
            f"backbone {spec!r}: the factory raised {type(exc).__name__}: {exc}"
        ) from exc


def _network_and_width(spec: str, result: Any) -> tuple[nn.Module, int]:
    """``result`` checked to be ``(nn.Module, positive int)``."""
    if not (isinstance(result, tuple | list) and len(result) == 2):
        got = (
            f"a {type(result).__name__} of length {len(result)}"
            if isinstance(result, tuple | list)
            else f"a {type(result).__name__}"
        )
        raise BackboneError(
            f"backbone {spec!r}: the factory must return (network, width), an nn.Module and "
            f"its output width as an int, got {got}; e.g. `return net, 512`."
        )
    net, width = result
    if not isinstance(net, nn.Module):
        raise BackboneError(
            f"backbone {spec!r}: the factory's first return value must be an nn.Module, got a "
            f"{type(net).__name__}."
        )
    if isinstance(width, bool) or not isinstance(width, numbers.Integral) or int(width) < 1:
        raise BackboneError(
            f"backbone {spec!r}: the factory's second return value must be the network's "
            f"output width as a positive int, got {width!r}."
        )
    return net, int(width)


def _timm_network(name: str, options: Mapping[str, Any]) -> tuple[nn.Module, int]:
    spec = TIMM_PREFIX + name
    fixed = sorted({"pretrained", "num_classes"} & set(options))
    if fixed:
        raise BackboneError(
            f"backbone {spec!r}: model.backbone_options may not set {fixed}; rankwise builds "
            "timm models with pretrained=False and num_classes=0 (features, no classifier) and "
            "loads weights from model.weights_path.",
            argument="backbone_options",
        )
    (timm,) = require(("timm",), "timm", f"backbone {spec!r}")
    try:
        net = timm.create_model(name, pretrained=False, num_classes=0, **options)
    except Exception as exc:  # an unknown name (RuntimeError), a wrong option (TypeError)
        raise BackboneError(
            f"backbone {spec!r}: timm.create_model({name!r}, pretrained=False, num_classes=0, "
            f"**{dict(options)}) failed ({type(exc).__name__}: {exc}); timm.list_models() "
            "lists the names."
        ) from exc
    width = getattr(net, "num_features", None)
    if isinstance(width, bool) or not isinstance(width, numbers.Integral):
        raise BackboneError(
            f"backbone {spec!r}: the timm model has no integer `num_features` (got {width!r}); "
            "wrap it in your own factory ('package.module:factory') that returns its width."
        )
    return net, int(width)


def _classifier_prefixes(net: nn.Module) -> tuple[str, ...]:
    """The state-dict prefixes of a timm model's classifier (removed by ``num_classes=0``)."""
    cfg = getattr(net, "pretrained_cfg", None) or getattr(net, "default_cfg", None) or {}
    names = cfg.get("classifier") if isinstance(cfg, Mapping) else None
    names = (names,) if isinstance(names, str) else tuple(names or ())
    return tuple(f"{name}." for name in names)


def _load_weights(
    spec: str, net: nn.Module, weights_path: str | os.PathLike, skip: tuple[str, ...]
) -> None:
    state = _load_state_dict_file(weights_path, what=f"state dict of backbone {spec!r}")
    state = {k: v for k, v in state.items() if not k.startswith(skip)} if skip else state
    try:
        result = net.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # same keys, other shapes
        raise BackboneError(
            f"`weights_path` {os.fspath(weights_path)!r} does not fit backbone {spec!r}: {exc}",
            argument="weights_path",
        ) from None
    if result.missing_keys or result.unexpected_keys:
        raise BackboneError(
            f"`weights_path` {os.fspath(weights_path)!r} is not a state dict of backbone "
            f"{spec!r}: missing keys {list(result.missing_keys)[:5]}, unexpected keys "
            f"{list(result.unexpected_keys)[:5]}.",
            argument="weights_path",
        )


def _probe(spec: str, net: nn.Module, width: int, input_shape: tuple[int, ...]) -> None:
    """One forward of zeros in eval mode: the features must be ``(batch, width)``."""
    ref = next(
        (t for t in [*net.parameters(), *net.buffers()] if t.is_floating_point()),
        None,
    )
    device, dtype = (ref.device, ref.dtype) if ref is not None else ("cpu", torch.float32)
    x = torch.zeros((_PROBE_BATCH, *input_shape), device=device, dtype=dtype)
    modes = {module: module.training for module in net.modules()}
    net.eval()  # no batch statistics, no dropout: the probe changes no state
    try:
        with torch.no_grad():
            out = net(x)
    except Exception as exc:
        raise BackboneError(
            f"backbone {spec!r}: a forward of a {tuple(x.shape)} batch (the data's input shape "
            f"{input_shape}) failed ({type(exc).__name__}: {exc}); the network must take the "
            "data's items."
        ) from exc
    finally:
        for module, mode in modes.items():
            module.training = mode
    expected = (_PROBE_BATCH, width)
    if not isinstance(out, torch.Tensor):
        raise BackboneError(
            f"backbone {spec!r}: the network returns a {type(out).__name__}, not a tensor; it "
            f"must return (B, {width}) features."
        )
    if tuple(out.shape) != expected:
        hint = (
            "pool and flatten it (e.g. nn.AdaptiveAvgPool2d(1) then nn.Flatten())"
            if out.dim() > 2
            else f"return the width the network gives ({out.shape[-1]})"
            if out.dim() == 2 and out.shape[0] == _PROBE_BATCH
            else "keep the batch dimension first"
        )
        raise BackboneError(
            f"backbone {spec!r}: the network maps a {tuple(x.shape)} batch to "
            f"{tuple(out.shape)}, not to {expected} (the declared width {width}); {hint}."
        )


def build_external_backbone(
    spec: str,
    input_shape: tuple[int, ...],
    *,
    options: Mapping[str, Any] | None = None,
    weights_path: str | os.PathLike | None = None,
    frozen_bn: bool = True,
) -> nn.Module:
    """The feature network that ``spec`` names, checked on ``input_shape``; has ``out_features``.

    Args:
        spec: ``"package.module:factory"`` or ``"timm:NAME"``.
        input_shape: the shape of one input item, e.g. ``(3, 224, 224)``.
        options: keyword arguments of the factory (of ``timm.create_model`` for timm).
        weights_path: a local state dict of the network, loaded with ``weights_only=True``
            (for timm, the classifier's entries are ignored); every other key must match.
        frozen_bn: replace the network's BatchNorm layers by
            :class:`~rankwise.models.FrozenBatchNorm`, after loading the weights.

    Returns:
        The network; ``out_features`` is set to its width.

    Raises:
        BackboneError: see :func:`import_factory`; the factory's options, return value or
            features do not fit; the weights do not fit.
        rankwise._extras.MissingDependencyError: ``"timm:NAME"`` and timm does not import (the ``timm``
            extra).

    Example:
        >>> import sys, types
        >>> from torch import nn
        >>> mod = types.ModuleType("my_nets")
        >>> mod.make = lambda hidden=16: (nn.Sequential(nn.Flatten(), nn.Linear(64, hidden)), hidden)
        >>> sys.modules["my_nets"] = mod
        >>> build_external_backbone("my_nets:make", (1, 8, 8), options={"hidden": 8}).out_features
        8
        >>> del sys.modules["my_nets"]
    """
    options = dict(options or {})
    module_name, attribute = check_backbone_spec(spec)
    skip: tuple[str, ...] = ()
    if module_name == "timm" and spec.strip().startswith(TIMM_PREFIX):
        net, width = _timm_network(attribute, options)
        skip = _classifier_prefixes(net)
    else:
        factory = import_factory(spec)
        net, width = _network_and_width(spec, _call_factory(spec, factory, options))
    if weights_path is not None:
        _load_weights(spec, net, weights_path, skip)
    if frozen_bn:
        net = freeze_batchnorm(net)
    _probe(spec, net, width, tuple(input_shape))
    net.out_features = width  # type: ignore[assignment]  # read by backbone_width (head)
    return net
