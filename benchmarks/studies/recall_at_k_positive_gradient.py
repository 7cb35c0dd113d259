"""Where the Recall@k surrogate's gradient sends each positive at K = 2 and K = 8 (issue 38).

The Recall@k surrogate (Patel, Tolias, Matas, CVPR 2022, Eq. 5-6; ``rankwise.losses.recall_at_k``)
ranks positive i of anchor q as 1 + Σ_{z≠i} σ((s_qz − s_qi)/τ2), positives z included. The terms
whose z = j is another positive tie the positives together: with g_i = ∂L/∂rank(i) ≥ 0 they add

    c_pp(q, i) = Σ_{j∈P_q, j≠i} σ'((s_qj − s_qi)/τ2)/τ2 · (g_j − g_i)

to ∂L/∂s_qi. c_pp sums to zero over an anchor's positives: it moves positives against each other.
Where c_pp(q, i) > 0, gradient descent *lowers* s_qi (pushes the positive down the ranking); it
happens when a positive j within a few τ2 of i has the larger g_j, typically a better-ranked
positive still on the slope of σ((k − rank)/τ1) for some k. With one positive per anchor (K = 2)
there are no such terms; with 7 (K = 8) there are many.

This script measures, on P x K batches of the Fashion-MNIST instance benchmark's training split
(the converged sampling-rate cells' data: 3,200 training sources, batches of 64), for a given
network (the pretrained start of the fine-tuning, ``--pretrained DIR``, and/or trained runs,
``--runs DIR ...``):

* the share of anchor-positive pairs (q, i) with c_pp(q, i) > 0 (pushed down by the
  positive-positive terms), and with a net ∂L/∂s_qi > 0 (pushed down by the whole gradient);
* the share of the gradient mass on positive scores carried by these terms:
  Σ|c_pp| / Σ(|c_pp| + |c_rest|), where c_rest is the negatives' part (``detach_positive_ranks``'s
  gradient, ≤ 0 for every positive: it only ever raises a positive);
* among the pushed-down pairs, the share whose nearest better-scored positive is within 0.05.

c_pp is measured as ∂L/∂s of the faithful loss minus that of ``detach_positive_ranks=True``, in
float64, on the scores of the network's embeddings (the loss's value is checked against the loss
called on the embeddings).

Usage::

    python benchmarks/studies/recall_at_k_positive_gradient.py --pretrained runs/rk/pretraining \
        --runs runs/rk/pretrained/fb_k8/recall_at_k/seed0 --batches 20
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from rankwise.data.instances import InstanceViews
from rankwise.losses import RecallAtKLoss
from rankwise.training import load_config
from rankwise.training.build import (
    build_model_from_config,
    build_sampler_from_config,
    check_batch_classes,
    load_splits,
)
from rankwise.training.inference import load_run

CONFIG = Path(__file__).parents[2] / "configs" / "fashion_mnist_instances.yaml"
DATA = [
    "dataset.options.train_classes=3200",
    "dataset.options.val_classes=250",
    "dataset.options.test_classes=500",
]
NEAR = 0.05  # the "within about 0.05" of issue 38: 5 τ2


def score_gradients(
    emb: torch.Tensor, labels: torch.Tensor, detach: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """∂L/∂s on the cosine scores of ``emb`` (float64), the scores and the positives' mask."""
    unit = torch.nn.functional.normalize(emb.double(), dim=1)
    scores = (unit @ unit.T).requires_grad_(True)
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool)
    pos, neg = same & ~eye, ~same
    rows = pos.any(dim=1) & neg.any(dim=1)
    loss_fn = RecallAtKLoss(detach_positive_ranks=detach)
    recall = loss_fn.recall_per_anchor(scores, pos, (pos, neg), rows)
    weight = rows.double()
    loss = 1 - (recall * weight).sum() / weight.sum()
    reference = RecallAtKLoss()(emb.double(), labels)  # the loss as training calls it
    if abs(loss.item() - reference.item()) > 1e-12:
        raise AssertionError(f"score-level loss {loss.item()} != loss {reference.item()}")
    (grad,) = torch.autograd.grad(loss, scores)
    return grad, scores.detach(), pos


def batch_counts(emb: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Counts over the (anchor, positive) pairs of one batch."""
    full, scores, pos = score_gradients(emb, labels, detach=False)
    rest, _, _ = score_gradients(emb, labels, detach=True)
    c_pp, c_rest, c_full = (full - rest)[pos], rest[pos], full[pos]
    # the nearest positive of the same anchor scored above s_qi, per pair
    pos_scores = torch.where(pos, scores, torch.tensor(float("nan"), dtype=scores.dtype))
    gaps = pos_scores[:, None, :] - scores[:, :, None]  # [q, i, j] = s_qj − s_qi
    gaps = torch.where(gaps > 0, gaps, torch.tensor(float("inf"), dtype=scores.dtype))
    nearest = torch.nan_to_num(gaps, nan=float("inf")).min(dim=2).values[pos]
    down = c_pp > 0
    return {
        "pairs": float(pos.sum()),
        "pp_down": float(down.sum()),
        "net_down": float((c_full > 0).sum()),
        "rest_down": float((c_rest > 0).sum()),
        "pp_mass": float(c_pp.abs().sum()),
        "rest_mass": float(c_rest.abs().sum()),
        "down_near": float((down & (nearest <= NEAR)).sum()),
    }


def measure(
    model: torch.nn.Module, k: int, batches: int, args: argparse.Namespace
) -> dict[str, float]:
    """Totals of :func:`batch_counts` over ``batches`` training batches of 64 = (64 / k) x k."""
    overrides = [*DATA, f"dataset.options.views_per_class={k}", f"sampler.m={k}"]
    config = load_config(CONFIG, [*overrides, "sampler.batch_size=64", f"seed={args.seed}"])
    splits = load_splits(config)
    labels, _ = check_batch_classes(config, splits)
    sampler = build_sampler_from_config(config, labels)
    train = splits.train
    if not isinstance(train, InstanceViews):  # pragma: no cover - the config's dataset
        raise TypeError(f"expected the instance views of the training split, got {type(train)}")
    generator = torch.Generator().manual_seed(args.seed)
    totals: dict[str, float] = {}
    model.train()  # as in training (frozen batch norm: its statistics stay)
    for _, idx in zip(range(batches), iter(sampler), strict=False):
        x, y = train.batch(idx, generator)
        with torch.no_grad():
            emb = model(x)
        for key, value in batch_counts(emb, y).items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


def row(name: str, k: int, t: dict[str, float]) -> str:
    """One markdown row of the totals ``t`` of network ``name`` at K = ``k``."""
    pairs = t["pairs"]
    mass = t["pp_mass"] / (t["pp_mass"] + t["rest_mass"])
    near = t["down_near"] / t["pp_down"] if t["pp_down"] else float("nan")
    return (
        f"| {name} | K = {k} | {int(pairs)} | {100 * t['pp_down'] / pairs:.1f} % | "
        f"{100 * t['net_down'] / pairs:.1f} % | {100 * mass:.1f} % | "
        f"{100 * near:.0f} % | {int(t['rest_down'])} |"
    )


def main(argv: list[str] | None = None) -> None:
    """Print the table for the networks named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pretrained", help="a `rankwise pretrain` output directory")
    parser.add_argument("--runs", nargs="*", default=[], help="trained run directories")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    models: list[tuple[str, Any]] = []
    if args.pretrained:
        config = load_config(CONFIG, [*DATA, f"model.pretrained={args.pretrained}"])
        shape = load_splits(config).train.input_shape
        models.append(("pretrained start", build_model_from_config(config, shape)))
    for run in args.runs:
        loaded = load_run(run)
        models.append((f"{run} (step {loaded.step})", loaded.model))
    print(
        "| network | batch | (anchor, positive) pairs | pushed down by the pos-pos terms | "
        "pushed down, net | pos-pos share of the gradient mass on positives | "
        f"pushed down with a better positive within {NEAR} | pushed down by the negatives |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, model in models:
        for k in (2, 8):
            print(row(name, k, measure(model, k, args.batches, args)), flush=True)


if __name__ == "__main__":
    main()
