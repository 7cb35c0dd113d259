"""build_model, and the ResNet-50 path (absent torchvision; local weights with a stand-in)."""

import importlib.abc
import sys
import types

import pytest
import torch
from torch import nn

from rankwise.models import (
    BACKBONES,
    EmbeddingModel,
    FrozenBatchNorm,
    build_model,
    resnet50_backbone,
)


@pytest.mark.parametrize(
    "backbone,shape",
    [("small_cnn", (1, 8, 8)), ("small_cnn", (1, 28, 28)), ("mlp", (1, 8, 8)), ("mlp", (20,))],
)
def test_build_model_shapes_and_unit_norm(backbone, shape):
    model = build_model(backbone, shape, 12)
    assert isinstance(model, EmbeddingModel)
    out = model(torch.rand(5, *shape))
    assert out.shape == (5, 12)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(5))


def test_build_model_passes_options():
    model = build_model("mlp", (1, 8, 8), 4, hidden=(7,), normalize=False)
    assert model.backbone.out_features == 7 and model.head.normalize is False
    assert build_model("small_cnn", (3, 32, 32), 4, width=2).backbone.out_features == 16


def test_build_model_errors():
    with pytest.raises(ValueError) as info:
        build_model("vgg16", (3, 32, 32), 8)
    assert all(name in str(info.value) for name in BACKBONES)
    with pytest.raises(ValueError, match="depth"):
        build_model("small_cnn", (1, 8, 8), 8, depth=3)
    with pytest.raises(ValueError, match="weights_path"):
        build_model("small_cnn", (1, 8, 8), 8, weights_path="w.pth")
    with pytest.raises(ValueError, match="embedding_dim"):
        build_model("mlp", (4,), 0)
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        build_model("small_cnn", (64,), 8)
    with pytest.raises(ValueError, match="3-channel"):
        build_model("resnet50", (1, 28, 28), 8)


class _RefuseTorchvision(importlib.abc.MetaPathFinder):
    """Import hook that makes every ``torchvision`` import fail, as if it were not installed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def hide_torchvision(monkeypatch):
    """Hide torchvision even where it is installed and already imported (restored afterwards).

    A cached ``sys.modules["torchvision.models"]`` would satisfy ``from torchvision.models import
    ...`` without looking at its parent, so every cached torchvision module is removed and a
    meta-path finder refuses to import them again.
    """
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_RefuseTorchvision(), *sys.meta_path])


def test_resnet50_without_torchvision_says_how_to_install(monkeypatch):
    hide_torchvision(monkeypatch)
    with pytest.raises(ImportError, match=r"pip install rankwise\[vision\]"):
        build_model("resnet50", (3, 32, 32), 8)


def test_hide_torchvision_hides_an_already_imported_package(monkeypatch):
    # a stand-in package, imported and cached as an installed torchvision would be
    tv = types.ModuleType("torchvision")
    tv.__path__ = []
    models = types.ModuleType("torchvision.models")
    models.resnet50 = lambda **kwargs: None
    tv.models = models
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    from torchvision.models import resnet50  # noqa: F401  (the cached module answers)

    hide_torchvision(monkeypatch)
    with pytest.raises(ImportError):
        from torchvision.models import resnet50  # noqa: F401,F811
    with pytest.raises(ImportError):
        import torchvision  # noqa: F401


class _TinyResNet(nn.Module):
    """Stand-in for torchvision's resnet50 with the same attribute names (conv1, bn1, fc)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        return self.fc(x.mean(dim=(2, 3)))


@pytest.fixture
def fake_torchvision(monkeypatch):
    calls = []

    def resnet50(weights=None):
        calls.append(weights)
        return _TinyResNet()

    tv = types.ModuleType("torchvision")
    models = types.ModuleType("torchvision.models")
    models.resnet50 = resnet50
    tv.models = models
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)
    return calls


def test_resnet50_loads_local_weights_and_freezes_bn(tmp_path, fake_torchvision):
    torch.manual_seed(0)
    source = _TinyResNet()
    with torch.no_grad():
        source.bn1.running_mean.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    path = tmp_path / "weights.pth"
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, path)

    net = resnet50_backbone(weights_path=path, frozen_bn=True)
    assert fake_torchvision == [None]  # never asks torchvision for (downloadable) weights
    assert isinstance(net.fc, nn.Identity) and net.out_features == 4
    assert isinstance(net.bn1, FrozenBatchNorm)
    torch.testing.assert_close(net.conv1.weight, source.conv1.weight)
    torch.testing.assert_close(net.bn1.running_mean, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    net.train()
    net(torch.rand(2, 3, 6, 6))
    torch.testing.assert_close(net.bn1.running_mean, torch.tensor([1.0, 2.0, 3.0, 4.0]))

    model = build_model("resnet50", (3, 6, 6), 5, weights_path=path)
    out = model(torch.rand(3, 3, 6, 6))
    assert out.shape == (3, 5)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(3))


def test_resnet50_weight_errors(tmp_path, fake_torchvision):
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        resnet50_backbone(weights_path=tmp_path / "missing.pth")
    wrong = tmp_path / "wrong.pth"
    torch.save({"layer9.weight": torch.zeros(2)}, wrong)
    with pytest.raises(ValueError, match="not a ResNet-50 state dict"):
        resnet50_backbone(weights_path=wrong)
    unfrozen = resnet50_backbone(frozen_bn=False)
    assert isinstance(unfrozen.bn1, nn.BatchNorm2d)
