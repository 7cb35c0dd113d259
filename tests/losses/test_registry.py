"""build_loss / LOSSES: every name builds a working loss, parameters are checked against the
constructor signature, and SOPRC gets its training labels and semi-variance regularizer."""

import importlib

import pytest
import torch

from rankwise.losses import registry
from rankwise.losses.baselines import BASELINES, CrossBatchMemoryBaseline
from rankwise.losses.blackbox_ap import BlackBoxAPLoss
from rankwise.losses.dir import DIRLoss
from rankwise.losses.registry import LOSSES, build_loss, loss_parameters

# The class each rankwise loss name must build (module, attribute).
RANKWISE_CLASSES = {
    "soprc": ("rankwise.losses.soprc", "SOPRCLoss"),
    "ap": ("rankwise.losses.soprc", "APLoss"),
    "auc": ("rankwise.losses.auc", "AUCLoss"),
    "wilcoxon": ("rankwise.losses.auc", "WilcoxonLoss"),
    "smooth_ap": ("rankwise.losses.smooth_ap", "SmoothAPLoss"),
    "roadmap": ("rankwise.losses.roadmap", "ROADMAPLoss"),
    "recall_at_k": ("rankwise.losses.recall_at_k", "RecallAtKLoss"),
    "dir": ("rankwise.losses.dir", "DIRLoss"),
    "blackbox_ap": ("rankwise.losses.blackbox_ap", "BlackBoxAPLoss"),
    "tie_aware_ap": ("rankwise.losses.tie_aware", "TieAwareAPLoss"),
    "tie_aware_ndcg": ("rankwise.losses.tie_aware", "TieAwareNDCGLoss"),
    "dpsh": ("rankwise.losses.pairwise_hashing", "DPSHLoss"),
    "pointwise_roc": ("rankwise.losses.pointwise_roc", "PointwiseROCLoss"),
}
# losses of binary codes take relaxed codes in [-1, 1] (a HashingHead's tanh output)
HASHING = {"tie_aware_ap", "tie_aware_ndcg", "dpsh"}


def pk_batch(p=4, k=4, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(p).repeat_interleave(k)
    return torch.randn(p * k, dim, generator=g), labels


def test_losses_lists_rankwise_losses_and_every_baseline():
    assert set(LOSSES) == set(RANKWISE_CLASSES) | set(BASELINES)
    assert len(LOSSES) == len(set(LOSSES))


@pytest.mark.parametrize("name", LOSSES)
def test_every_name_builds_a_working_loss(name):
    if name in RANKWISE_CLASSES:
        module_name, attr = RANKWISE_CLASSES[name]
        cls = getattr(importlib.import_module(module_name), attr)
        if cls is None:
            pytest.skip(f"{module_name}.{attr} is still a placeholder in this checkout")
    emb, labels = pk_batch()
    if name in HASHING:
        emb = torch.tanh(emb)
    train_labels = torch.arange(4).repeat_interleave(10)
    loss = build_loss(name, train_labels=train_labels, num_classes=4, embedding_dim=8)
    if name in RANKWISE_CLASSES:
        assert type(loss) is cls
    emb.requires_grad_(True)
    value = loss(emb, labels)
    assert value.ndim == 0 and torch.isfinite(value)
    value.backward()
    assert emb.grad is not None and torch.isfinite(emb.grad).all()


def test_parameters_reach_the_constructor():
    loss = build_loss("dir", num_bins=7, score_range=(0.0, 1.0))
    assert isinstance(loss, DIRLoss) and loss.num_bins == 7 and loss.score_range == (0.0, 1.0)
    loss = build_loss("blackbox_ap", lambda_val=2.0, margin=0.0)
    assert isinstance(loss, BlackBoxAPLoss) and loss.lambda_val == 2.0 and loss.margin == 0.0
    xbm = build_loss("xbm", embedding_dim=16, memory_size=64)
    assert isinstance(xbm, CrossBatchMemoryBaseline)
    assert xbm.loss.embedding_size == 16 and xbm.loss.memory_size == 64
    assert build_loss("triplet", margin=0.2).loss.margin == 0.2


def test_unknown_names_and_parameters_name_the_key():
    with pytest.raises(ValueError, match="unknown loss 'soprcc'.*soprc, ap"):
        build_loss("soprcc")
    with pytest.raises(ValueError, match="'dir'.*'num_binz'.*num_bins"):
        build_loss("dir", num_binz=10)
    with pytest.raises(ValueError, match="'blackbox_ap'.*'lambda'.*lambda_val"):
        build_loss("blackbox_ap", **{"lambda": 4.0})
    with pytest.raises(ValueError, match="'fastap'.*'bins'.*num_bins"):
        build_loss("fastap", bins=10)
    with pytest.raises(ValueError, match="xbm.*embedding_dim"):
        build_loss("xbm")
    assert loss_parameters("dir") == ("num_bins", "score_range", "similarity")


def test_soprc_needs_train_labels():
    with pytest.raises(ValueError, match="train_labels"):
        build_loss("soprc")


class FakeSemiVariance:
    def __init__(self, lambda_pos, lambda_neg, normalization="pairs"):
        self.lambda_pos, self.lambda_neg = lambda_pos, lambda_neg
        self.normalization = normalization


class FakeSOPRC:
    """Records how the registry calls from_labels; its signature mimics SOPRCLoss's."""

    def __init__(self, num_classes, beta=0.1, semi_variance=None, similarity="cosine"):
        self.num_classes, self.beta, self.semi_variance = num_classes, beta, semi_variance

    @classmethod
    def from_labels(cls, train_labels, num_classes=None, prior_scale=None, **kwargs):
        obj = cls(num_classes if num_classes is not None else int(max(train_labels)) + 1, **kwargs)
        obj.train_labels, obj.prior_scale = train_labels, prior_scale
        return obj


def test_soprc_builds_from_labels_with_semi_variance(monkeypatch):
    monkeypatch.setitem(registry._LOSS_CLASSES._entries, "soprc", FakeSOPRC)
    monkeypatch.setattr(registry, "SemiVarianceRegularizer", FakeSemiVariance)
    train_labels = [0, 0, 1, 1, 2]
    loss = build_loss("soprc", train_labels=train_labels, beta=0.5, prior_scale=0.1)
    assert loss.train_labels is train_labels and loss.beta == 0.5 and loss.prior_scale == 0.1
    assert loss.num_classes == 3
    assert (loss.semi_variance.lambda_pos, loss.semi_variance.lambda_neg) == (1.0, 5.0)
    loss = build_loss(
        "soprc", train_labels=train_labels, num_classes=7, semi_variance_weights=(2, 3)
    )
    assert loss.num_classes == 7
    assert (loss.semi_variance.lambda_pos, loss.semi_variance.lambda_neg) == (2.0, 3.0)
    assert loss.semi_variance.normalization == "pairs"
    loss = build_loss("soprc", train_labels=train_labels, semi_variance_normalization="tail")
    assert loss.semi_variance.normalization == "tail"
    assert (
        build_loss("soprc", train_labels=train_labels, semi_variance_weights=None).semi_variance
        is None
    )
    with pytest.raises(ValueError, match="semi_variance_weights"):
        build_loss("soprc", train_labels=train_labels, semi_variance_weights=(1.0,))
    with pytest.raises(ValueError, match="semi_variance_weights"):
        build_loss("soprc", train_labels=train_labels, semi_variance=FakeSemiVariance(1, 1))
    assert set(loss_parameters("soprc")) == {
        "num_classes",
        "prior_scale",
        "beta",
        "similarity",
        "semi_variance_weights",
        "semi_variance_normalization",
    }


def test_soprc_unknown_key_is_named(monkeypatch):
    monkeypatch.setitem(registry._LOSS_CLASSES._entries, "soprc", FakeSOPRC)
    monkeypatch.setattr(registry, "SemiVarianceRegularizer", FakeSemiVariance)
    with pytest.raises(ValueError, match="'soprc'.*'betta'.*beta"):
        build_loss("soprc", train_labels=[0, 1], betta=0.1)


class NeedsClasses:
    def __init__(self, num_classes, embedding_dim, tau=1.0):
        self.num_classes, self.embedding_dim, self.tau = num_classes, embedding_dim, tau


def test_context_arguments_fill_required_constructor_parameters(monkeypatch):
    monkeypatch.setitem(registry._LOSS_CLASSES._entries, "ap", NeedsClasses)
    loss = build_loss("ap", num_classes=5, embedding_dim=32, tau=2.0)
    assert (loss.num_classes, loss.embedding_dim, loss.tau) == (5, 32, 2.0)
    with pytest.raises(ValueError, match="'ap' needs 'num_classes'.*num_classes="):
        build_loss("ap", embedding_dim=32)
