"""Properties every loss of `LOSSES` must have, run over the registry (a loss registered later is
picked up automatically): bad scalar arguments rejected the same way (numpy scalars accepted, bool
never a number, NaN and inf never, the argument named), a finite scalar with gradients on a P x K
batch, `state_dict` round trip, `.double()`, device moves, the reference-set path, and eval mode
leaving the loss's state untouched."""

from __future__ import annotations

import importlib
import inspect
import math
import re

import numpy as np
import pytest
import torch

from rankwise.losses import LOSSES, build_loss
from rankwise.losses.baselines import BASELINES
from rankwise.losses.registry import loss_parameters

N_CLASSES = 6
DIM = 8
TRAIN_LABELS = np.repeat(np.arange(N_CLASSES), 10)


def make(name, **params):
    if name == "xbm":  # a one-call warm-up (default 75), so a few calls already fill the memory
        params.setdefault("start_iteration", 1)
    return build_loss(
        name, train_labels=TRAIN_LABELS, num_classes=N_CLASSES, embedding_dim=DIM, **params
    )


def pk_batch(dtype=torch.float32, device="cpu", seed=0, classes=(0, 1, 2), m=4):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.tensor(classes).repeat_interleave(m)
    centres = torch.randn(N_CLASSES, DIM, generator=generator)
    x = centres[labels] + 0.5 * torch.randn(len(labels), DIM, generator=generator)
    # inside (-1, 1): valid for every loss, the relaxed binary codes of the hashing losses included
    x = 0.95 * torch.tanh(x)
    return x.to(dtype=dtype, device=device).requires_grad_(True), labels.to(device)


def constructor_defaults(name):
    """{parameter: default} of what build_loss passes the parameters of loss `name` to."""
    if name in BASELINES:
        from rankwise.losses import baselines

        pml_losses = importlib.import_module("pytorch_metric_learning.losses")
        callables = [getattr(pml_losses, baselines._LOSS_CLASSES[name]).__init__]
        callables.append(pml_losses.BaseMetricLossFunction.__init__)
        extra = {"memory_size": 1024, "embedding_size": DIM} if name == "xbm" else {}
    else:
        from rankwise.losses import registry

        cls = registry._LOSS_CLASSES[name]
        callables = [cls.__init__] + ([cls.from_labels] if name == "soprc" else [])
        extra = {"semi_variance_weights": (1.0, 5.0)} if name == "soprc" else {}
    out = dict(extra)
    for fn in callables:
        for p in inspect.signature(fn).parameters.values():
            if p.default is not inspect.Parameter.empty and p.name in loss_parameters(name):
                out.setdefault(p.name, p.default)
    return out


def params_of_kind(kind):
    """(loss, parameter, default) for every parameter of the given kind, over all losses."""
    cases = []
    for name in LOSSES:
        for param, default in constructor_defaults(name).items():
            if param == "semi_variance_weights":
                continue  # a pair of weights, not a range: tested on its own below
            if kind == "scalar":
                ok = isinstance(default, (int, float)) and not isinstance(default, bool)
            elif kind == "flag":
                ok = isinstance(default, bool)
            elif kind == "choice":
                ok = isinstance(default, str) and param != "triplets_per_anchor"
            else:  # a (low, high) range
                ok = (
                    isinstance(default, (tuple, list))
                    and len(default) == 2
                    and all(isinstance(v, (int, float)) for v in default)
                )
            if ok:
                cases.append(pytest.param(name, param, default, id=f"{name}-{param}"))
    return cases


def raises_naming(param):
    return pytest.raises(ValueError, match=re.escape(param))


def call_and_read_stats(loss_fn, *args):
    """One call, then a read of ``last_stats``. A rankwise loss checks the values of the embeddings
    on the device and raises their error when ``last_stats`` is read (docs/losses.md, "Errors of
    the embeddings' values"); labels, shapes and a PML baseline's inputs raise at the call."""
    value = loss_fn(*args)
    dict(getattr(loss_fn, "last_stats", {}))
    return value


@pytest.mark.parametrize("name", LOSSES)
def test_a_pk_batch_gives_a_finite_scalar_with_gradients(name):
    loss_fn = make(name)
    x, y = pk_batch()
    value = loss_fn(x, y)
    assert value.ndim == 0 and torch.isfinite(value)
    value.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# scalars whose None is a documented choice (soprc: prior_scale=None is the theory's raw prior)
NONE_ALLOWED = {"soprc-prior_scale"}


@pytest.mark.parametrize(("name", "param", "default"), params_of_kind("scalar"))
def test_scalar_arguments_are_checked_the_same_way(name, param, default):
    numpy_value = np.float32(default) if isinstance(default, float) else np.int64(default)
    make(name, **{param: numpy_value})  # a numpy scalar is a number like any other
    bads = [float("nan"), float("inf"), True, "0.1"]
    if f"{name}-{param}" in NONE_ALLOWED:
        make(name, **{param: None})
    else:
        bads.append(None)
    for bad in bads:
        with raises_naming(param):
            make(name, **{param: bad})


@pytest.mark.parametrize(("name", "param", "default"), params_of_kind("flag"))
def test_flags_are_booleans(name, param, default):
    make(name, **{param: np.bool_(default)})
    for bad in (1, 0.0, "yes"):
        with raises_naming(param):
            make(name, **{param: bad})


@pytest.mark.parametrize(("name", "param", "default"), params_of_kind("choice"))
def test_string_options_name_their_choices(name, param, default):
    make(name, **{param: default})
    with raises_naming(param):
        make(name, **{param: "no-such-option"})


@pytest.mark.parametrize(("name", "param", "default"), params_of_kind("range"))
def test_ranges_are_finite_increasing_pairs(name, param, default):
    low, high = default
    make(name, **{param: (np.float32(low), np.float32(high))})
    for bad in ((-math.inf, high), (low, math.nan), (high, low), (low,), "ab"):
        with raises_naming(param):
            make(name, **{param: bad})


@pytest.mark.parametrize("bad", [(1.0, math.nan), (1.0, -1.0), (1.0,), "15", (True, 5.0)])
def test_soprc_semi_variance_weights(bad):
    make("soprc", semi_variance_weights=(np.float32(1.0), np.int64(5)))
    make("soprc", semi_variance_weights=None)
    with raises_naming("semi_variance_weights"):
        make("soprc", semi_variance_weights=bad)


def trained_copy(name, steps=3, dtype=torch.float32, device="cpu"):
    """A loss after a few training-mode calls, so its state (if any) is not the initial one."""
    loss_fn = make(name).to(device=device)
    if dtype == torch.float64:
        loss_fn = loss_fn.double()
    loss_fn.train()
    for seed in range(steps):
        x, y = pk_batch(
            dtype, device, seed=seed, classes=tuple((seed + i) % N_CLASSES for i in range(3))
        )
        loss_fn(x, y)
    return loss_fn


def same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", LOSSES)
def test_state_dict_round_trip(name):
    source = trained_copy(name)
    target = make(name)
    target.load_state_dict(source.state_dict())
    assert same_state(source, target)
    x, y = pk_batch(seed=7)
    source.eval(), target.eval()
    assert torch.equal(source(x, y), target(x, y))


@pytest.mark.parametrize("name", LOSSES)
def test_double_precision(name):
    loss_fn = make(name).double()
    for key, value in loss_fn.state_dict().items():
        if value.is_floating_point():
            assert value.dtype == torch.float64, key
    x, y = pk_batch(torch.float64)
    value = loss_fn(x, y)
    assert value.dtype == torch.float64 and torch.isfinite(value)
    value.backward()
    assert x.grad.dtype == torch.float64


@pytest.mark.parametrize("name", LOSSES)
def test_device_moves(name, device):
    loss_fn = trained_copy(name).to(device)
    for key, value in loss_fn.state_dict().items():
        assert value.device.type == device.type, key
    x, y = pk_batch(device=device, seed=5)
    value = loss_fn(x, y)
    assert value.device.type == device.type and torch.isfinite(value)
    back = loss_fn.to("cpu")
    assert all(v.device.type == "cpu" for v in back.state_dict().values())


@pytest.mark.parametrize("name", LOSSES)
def test_reference_set_path(name):
    loss_fn = make(name)
    x, y = pk_batch(seed=1, classes=(0, 1, 2))
    ref, ref_y = pk_batch(seed=2, classes=(1, 2, 3))
    try:
        value = loss_fn(x, y, ref, ref_y)
    except ValueError as exc:
        # a loss that cannot rank against an external set says so, naming the argument
        assert "ref_embeddings" in str(exc)
        return
    assert value.ndim == 0 and torch.isfinite(value)
    value.backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(ref.grad).all()
    assert x.grad.abs().sum() > 0
    with raises_naming("ref_labels"):
        loss_fn(x, y, ref, None)


@pytest.mark.parametrize("name", LOSSES)
def test_eval_mode_freezes_the_state(name):
    loss_fn = trained_copy(name)
    before = {k: v.clone() for k, v in loss_fn.state_dict().items()}
    loss_fn.eval()
    for seed in range(3):
        x, y = pk_batch(seed=10 + seed, classes=(3, 4, 5))
        loss_fn(x, y)
    after = loss_fn.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


@pytest.mark.parametrize("name", LOSSES)
def test_bad_inputs_are_named(name):
    loss_fn = make(name)
    x, y = pk_batch()
    with raises_naming("embeddings"):
        call_and_read_stats(loss_fn, torch.full_like(x, math.nan), y)
    with raises_naming("labels"):
        loss_fn(x, y[:-1])


def state_snapshot(loss_fn):
    return {k: v.clone() for k, v in loss_fn.state_dict().items()}


def assert_same_state(loss_fn, snapshot):
    state = loss_fn.state_dict()
    assert state.keys() == snapshot.keys()
    for key, value in state.items():
        before = snapshot[key]
        assert value.dtype == before.dtype and value.shape == before.shape, key
        # bitwise: NaN payloads and signed zeros included
        as_bytes = value.contiguous().flatten().view(torch.uint8)
        assert torch.equal(as_bytes, before.contiguous().flatten().view(torch.uint8)), key


def raising_calls():
    """Calls every loss must refuse with a ValueError, by what is wrong with them."""
    x, y = pk_batch(seed=3)
    unseen = torch.tensor([1000, 1001, 1002])  # one sample each, in no memory: nothing to rank
    return {
        "nan-embeddings": (torch.full_like(x, math.nan), y),
        "labels-too-short": (x, y[:-1]),
        "nothing-to-rank": (x[:3], unseen),
        "one-class": (x[:4], torch.zeros(4, dtype=torch.long)),
    }


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("trained", [False, True], ids=["fresh", "trained"])
def test_a_raising_call_changes_no_state(name, trained):
    """Validate first, then mutate: after a call that raises every buffer is bitwise what it was
    (SOPRC's v and v_updates, the XBM memory and queue position, any later moving average)."""
    loss_fn = trained_copy(name) if trained else make(name)
    loss_fn.train()
    for case, (x, y) in raising_calls().items():
        if case == "one-class" and trained and name == "xbm":
            continue  # the memory holds other classes: a one-class batch is valid for XBM
        snapshot = state_snapshot(loss_fn)
        with pytest.raises(ValueError):
            call_and_read_stats(loss_fn, x, y)
        assert_same_state(loss_fn, snapshot)
    # and the loss still works
    x, y = pk_batch(seed=4)
    assert torch.isfinite(loss_fn(x, y))


def similarity_kwargs(name):
    return {"similarity": "dot"} if "similarity" in loss_parameters(name) else {}


# the hashing losses of TALR: inputs are tanh outputs, |score| <= bits
BOUNDED_CODES = {"tie_aware_ap", "tie_aware_ndcg"}


@pytest.mark.parametrize("name", LOSSES)
def test_float16_dot_scores_beyond_the_float16_range(name):
    """Half-precision rows whose squared norms exceed 65504: a float16 dot product overflows, so
    every loss scores and computes in float32 and returns float32. The value equals the float64
    loss of the same (float16) inputs, and, with a loss scale that fits the gradient into float16
    (what torch.amp.GradScaler finds), so does the gradient."""
    if name in BOUNDED_CODES:
        pytest.skip(
            f"{name} takes relaxed codes in [-1, 1] (refuses anything else): its scores are "
            "bounded by the bit count and cannot leave the float16 range; half precision is "
            "covered by the autocast test"
        )
    generator = torch.Generator().manual_seed(0)
    labels = torch.arange(3).repeat_interleave(4)
    centres = torch.randn(N_CLASSES, DIM, generator=generator)
    x = (centres[labels] + 0.5 * torch.randn(12, DIM, generator=generator)) * 300
    x = x.half()
    assert float((x.double() ** 2).sum(1).min()) > 65504
    outputs = {}
    for dtype in (torch.float16, torch.float64):
        loss_fn = make(name, **similarity_kwargs(name))
        loss_fn = loss_fn.double() if dtype == torch.float64 else loss_fn
        xd = x.detach().to(dtype, copy=True).requires_grad_(True)
        value = loss_fn(xd, labels)
        outputs[dtype] = (value, xd)
    value, xh = outputs[torch.float16]
    reference, xd = outputs[torch.float64]
    assert value.dtype == torch.float32 and torch.isfinite(value)
    assert float(value.detach()) == pytest.approx(float(reference.detach()), rel=1e-5, abs=1e-6)
    reference.backward()
    scale = 1.0 / max(float(xd.grad.abs().max()), 1e-30)
    (value * scale).backward()
    assert xh.grad.dtype == torch.float16 and bool(torch.isfinite(xh.grad).all())
    torch.testing.assert_close(xh.grad.double(), xd.grad * scale, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("name", [n for n in LOSSES if "similarity" in loss_parameters(n)])
def test_non_finite_dot_scores_name_the_embeddings(name):
    """float32 overflows too, at squared norms past 3.4e38: a clear error, not a NaN loss."""
    x, y = pk_batch()
    with raises_naming("embeddings"):
        call_and_read_stats(make(name, similarity="dot"), x.detach() * 1e20, y)


@pytest.mark.parametrize("name", LOSSES)
def test_autocast_does_not_lower_the_score_precision(name):
    """Under torch.autocast the score product would run in bfloat16 (CPU) or float16 (CUDA): the
    losses switch it off and give the value of the float32 inputs."""
    x, y = pk_batch()
    expected = make(name)(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = make(name)(x, y)
    assert got.dtype == torch.float32
    assert float(got.detach()) == pytest.approx(float(expected.detach()), rel=1e-6, abs=1e-7)
