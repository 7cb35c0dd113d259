"""Backbones from outside rankwise (issue 38, item 5): ``"package.module:factory"`` and
``"timm:NAME"`` in ``build_model``, each failure a one-line error naming the key and the fix.

The factories live in a module written to a temporary folder put on ``sys.path``, as a user's
own package would be. timm from PyPI needs torchvision, which does not import beside the CPU torch
wheel here: the timm path is tested with a stand-in ``timm`` module in ``sys.modules`` that has
timm's ``create_model`` signature and ``num_features`` / ``pretrained_cfg`` attributes.
"""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch
from torch import nn

from rankwise._extras import MissingDependencyError
from rankwise.models import BackboneError, FrozenBatchNorm, build_model
from rankwise.models.external import check_backbone_spec

NETS = """
from torch import nn


def conv(channels=4, in_channels=1):
    net = nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1),
        nn.BatchNorm2d(channels),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
    )
    return net, 4 * channels


def wrong_width():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), 12


def unpooled():
    return nn.Conv2d(1, 3, 3, padding=1), 3


def only_net():
    return nn.Flatten()


def not_a_module():
    return "net", 3


def bool_width():
    return nn.Flatten(), True


def raises():
    raise RuntimeError("no GPU for this net")


def wrong_input():
    return nn.Linear(10, 4), 4


NOT_CALLABLE = 3
"""


@pytest.fixture
def nets(tmp_path, monkeypatch):
    """The name of an importable module of factories (unique per test)."""
    name = f"rw_nets_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(NETS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_factory_backbone_gets_rankwise_head_and_its_options(nets):
    torch.manual_seed(0)
    model = build_model(f"{nets}:conv", (1, 8, 8), 5, backbone_options={"channels": 3})
    assert model.backbone.out_features == 12 and model.head.linear.in_features == 12
    out = model(torch.rand(6, 1, 8, 8))
    assert out.shape == (6, 5)
    assert torch.allclose(out.norm(dim=1), torch.ones(6))  # the head L2-normalises
    # frozen_bn (the default) freezes the factory's batch norm as it does ResNet-50's
    assert isinstance(model.backbone[1], FrozenBatchNorm)
    kept = build_model(f"{nets}:conv", (1, 8, 8), 5, frozen_bn=False)
    assert isinstance(kept.backbone[1], nn.BatchNorm2d)
    # the probe forward changes nothing: the BN statistics are the initial ones, modes kept
    assert kept.training and kept.backbone[1].training
    assert torch.equal(kept.backbone[1].running_mean, torch.zeros(4))
    assert int(kept.backbone[1].num_batches_tracked) == 0


def test_the_seeded_init_is_the_same_each_time(nets):
    torch.manual_seed(3)
    a = build_model(f"{nets}:conv", (1, 8, 8), 5)
    torch.manual_seed(3)
    b = build_model(f"{nets}:conv", (1, 8, 8), 5)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


@pytest.mark.parametrize(
    ("attribute", "options", "argument", "match"),
    [
        (
            "wrong_width",
            {},
            "backbone",
            r"maps a \(2, 1, 8, 8\) batch to \(2, 10\), not to "
            r"\(2, 12\).*return the width the network gives \(10\)",
        ),
        ("unpooled", {}, "backbone", r"to \(2, 3, 8, 8\).*pool and flatten"),
        ("only_net", {}, "backbone", r"must return \(network, width\).*got a Flatten"),
        ("not_a_module", {}, "backbone", "first return value must be an nn.Module, got a str"),
        ("bool_width", {}, "backbone", "positive int, got True"),
        ("raises", {}, "backbone", "the factory raised RuntimeError: no GPU for this net"),
        ("wrong_input", {}, "backbone", r"forward of a \(2, 1, 8, 8\) batch .* failed"),
        ("NOT_CALLABLE", {}, "backbone", "'NOT_CALLABLE' is a int, not a callable"),
        ("missing", {}, "backbone", "has no attribute 'missing'"),
        (
            "conv",
            {"depth": 3},
            "backbone_options",
            r"does not take the options \{'depth': 3\}.*conv\(channels=4, in_channels=1\)",
        ),
    ],
)
def test_a_factory_that_does_not_fit_is_one_clear_error(nets, attribute, options, argument, match):
    with pytest.raises(BackboneError, match=match) as info:
        build_model(f"{nets}:{attribute}", (1, 8, 8), 4, backbone_options=options)
    assert info.value.argument == argument
    assert "\n" not in str(info.value)


def test_a_module_that_does_not_import_names_it_and_sys_path():
    with pytest.raises(
        BackboneError,
        match=r"module 'no_such_pkg.nets' does not import "
        r"\(ModuleNotFoundError.*PYTHONPATH; sys.path starts with",
    ):
        build_model("no_such_pkg.nets:make", (1, 8, 8), 4)


@pytest.mark.parametrize("spec", ["a:b:c", ":make", "pkg.nets:", "my-pkg:make", "timm:"])
def test_a_misspelled_spec_is_refused_before_any_import(spec):
    with pytest.raises(BackboneError, match="package.module:factory|timm:NAME"):
        check_backbone_spec(spec)


def test_an_unknown_name_mentions_the_factory_form():
    with pytest.raises(ValueError, match="unknown backbone 'resnet18'.*package.module:factory"):
        build_model("resnet18", (3, 32, 32), 4)


def test_factory_weights_load_from_a_local_file(nets, tmp_path):
    torch.manual_seed(1)
    source = build_model(f"{nets}:conv", (1, 8, 8), 4, frozen_bn=False).backbone
    path = tmp_path / "w.pt"
    torch.save(source.state_dict(), path)
    torch.manual_seed(2)
    loaded = build_model(f"{nets}:conv", (1, 8, 8), 4, weights_path=path, frozen_bn=False)
    assert all(
        torch.equal(loaded.backbone.state_dict()[k], v) for k, v in source.state_dict().items()
    )
    torch.save({"other.weight": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(BackboneError, match=r"not a state dict of backbone .*missing keys") as info:
        build_model(f"{nets}:conv", (1, 8, 8), 4, weights_path=tmp_path / "bad.pt")
    assert info.value.argument == "weights_path"


# -- timm --------------------------------------------------------------------------------------


class _FakeTimmNet(nn.Module):
    """What ``timm.create_model(name, num_classes=0)`` returns: pooled features, no classifier."""

    pretrained_cfg = {"classifier": "fc"}

    def __init__(self, width: int, in_chans: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_chans, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Identity()
        self.num_features = width

    def forward(self, x):
        return self.fc(self.pool(self.bn(self.conv(x))).flatten(1))


@pytest.fixture
def fake_timm(monkeypatch):
    """A stand-in ``timm`` module; ``calls`` records the ``create_model`` calls."""
    module = types.ModuleType("timm")
    module.calls = []

    def create_model(name, pretrained=False, num_classes=1000, in_chans=3, **kw):
        module.calls.append(
            {
                "name": name,
                "pretrained": pretrained,
                "num_classes": num_classes,
                "in_chans": in_chans,
                **kw,
            }
        )
        if name != "resnet18":
            raise RuntimeError(f"Unknown model ({name})")
        if kw:
            raise TypeError(f"__init__() got an unexpected keyword argument {next(iter(kw))!r}")
        return _FakeTimmNet(16, in_chans)

    module.create_model = create_model
    monkeypatch.setitem(sys.modules, "timm", module)
    return module


def test_a_timm_model_by_name_without_download(fake_timm):
    model = build_model("timm:resnet18", (3, 16, 16), 8)
    assert fake_timm.calls == [
        {"name": "resnet18", "pretrained": False, "num_classes": 0, "in_chans": 3}
    ]
    assert model.backbone.out_features == 16 and model(torch.rand(2, 3, 16, 16)).shape == (2, 8)
    assert isinstance(model.backbone.bn, FrozenBatchNorm)
    gray = build_model("timm:resnet18", (1, 16, 16), 8, backbone_options={"in_chans": 1})
    assert gray(torch.rand(2, 1, 16, 16)).shape == (2, 8)


def test_timm_weights_come_from_a_local_file_without_the_classifier(fake_timm, tmp_path):
    torch.manual_seed(0)
    source = _FakeTimmNet(16, 3)
    state = {
        **source.state_dict(),
        "fc.weight": torch.zeros(1000, 16),
        "fc.bias": torch.zeros(1000),
    }
    torch.save({"state_dict": state}, tmp_path / "resnet18.pth")
    model = build_model(
        "timm:resnet18", (3, 16, 16), 8, weights_path=tmp_path / "resnet18.pth", frozen_bn=False
    )
    assert torch.equal(model.backbone.conv.weight, source.conv.weight)
    with pytest.raises(FileNotFoundError, match="never downloads weights"):
        build_model("timm:resnet18", (3, 16, 16), 8, weights_path=tmp_path / "none.pth")


@pytest.mark.parametrize(
    ("name", "options", "argument", "match"),
    [
        ("resnet99", {}, "backbone", r"timm.create_model\('resnet99'.*Unknown model.*list_models"),
        ("resnet18", {"depth": 3}, "backbone", "unexpected keyword argument 'depth'"),
        ("resnet18", {"pretrained": True}, "backbone_options", r"may not set \['pretrained'\]"),
    ],
)
def test_a_timm_model_that_cannot_be_built_says_why(fake_timm, name, options, argument, match):
    with pytest.raises(BackboneError, match=match) as info:
        build_model(f"timm:{name}", (3, 16, 16), 8, backbone_options=options)
    assert info.value.argument == argument


def test_without_timm_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` raises ImportError
    with pytest.raises(
        MissingDependencyError, match=r"timm.*pip install 'rankwise\[timm\]'"
    ) as info:
        build_model("timm:resnet18", (3, 16, 16), 8)
    assert info.value.extra == "timm"
