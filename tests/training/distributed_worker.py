"""One rank of the 2-process checks of tests/training/test_distributed*.py (not a test module).

Run as ``python distributed_worker.py CASE OUT_DIR`` with the torchrun environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set by ``conftest.run_ranks``. Each case writes
``OUT_DIR/<case>-rank<r>.pt`` (plain tensors and values, loaded with weights_only=True); the test
compares them with a single process.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

torch.set_num_threads(1)

from rankwise.losses import LOSSES, build_loss  # noqa: E402
from rankwise.training.distributed import (  # noqa: E402
    DistributedLoss,
    check_replicas_in_sync,
    init_distributed,
)
from rankwise.training.errors import ReplicaDivergenceError  # noqa: E402

DIM_IN, DIM = 6, 8
CLASSES, M = 6, 4  # global batch: 6 classes x 4 = 24 rows, 3 classes per rank


def global_batch(step: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The global P x K batch of a step (class-contiguous), the same on every rank."""
    generator = torch.Generator().manual_seed(100 + step)
    labels = torch.arange(CLASSES).repeat_interleave(M)
    centers = torch.randn(CLASSES, DIM_IN, generator=generator, dtype=dtype)
    x = centers[labels] + 0.7 * torch.randn(labels.numel(), DIM_IN, generator=generator, dtype=dtype)
    return x, labels


def local_rows(n: int, rank: int, world: int, uneven: bool) -> slice:
    """Rank ``rank``'s rows; ``uneven`` gives rank 0 one class more than the others."""
    if not uneven:
        return slice(n * rank // world, n * (rank + 1) // world)
    cuts = [0, 16, n] if world == 2 else [n * r // world for r in range(world + 1)]
    return slice(cuts[rank], cuts[rank + 1])


def make_loss(name: str) -> nn.Module:
    labels = torch.arange(CLASSES).repeat_interleave(10)
    return build_loss(name, train_labels=labels, num_classes=CLASSES, embedding_dim=DIM).double()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM_IN, 16), nn.Tanh(), nn.Linear(16, DIM)).double()


def train_steps(model, loss_fn, steps, *, rank, world, uneven=False, reduction="mean"):
    """SGD steps; returns per-step (loss, grads) and the final state. world=1: one process."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    records = []
    for step in range(steps):
        x, y = global_batch(step)
        rows = local_rows(x.shape[0], rank, world, uneven) if world > 1 else slice(None)
        loss = loss_fn(model(x[rows]), y[rows])
        optimizer.zero_grad()
        loss.backward()
        if reduction == "sum" and world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        grads = [p.grad.detach().clone() for p in model.parameters()]
        records.append((float(loss.detach()), grads))
        optimizer.step()
    return records


def reference(name: str, steps: int) -> dict:
    """One process, the concatenated batch, no torch.distributed involved."""
    model, loss_fn = make_model(), make_loss(name)
    records = train_steps(model, loss_fn, steps, rank=0, world=1)
    return {
        "losses": [r[0] for r in records],
        "grads": [r[1] for r in records],
        "loss_state": {k: v.clone() for k, v in loss_fn.state_dict().items()},
    }


def distributed(name: str, steps: int, rank: int, world: int, uneven: bool, reduction: str):
    from torch.nn.parallel import DistributedDataParallel

    model = make_model()
    loss_fn = DistributedLoss(make_loss(name), gradient_reduction=reduction)
    wrapped = model if reduction == "sum" else DistributedDataParallel(model)
    records = train_steps(
        wrapped, loss_fn, steps, rank=rank, world=world, uneven=uneven, reduction=reduction
    )
    in_sync = "yes"
    try:
        check_replicas_in_sync(model, loss_fn.loss, step=steps)
    except ReplicaDivergenceError as exc:
        in_sync = str(exc)
    return {
        "losses": [r[0] for r in records],
        "grads": [r[1] for r in records],
        "loss_state": {k: v.clone() for k, v in loss_fn.loss.state_dict().items()},
        "in_sync": in_sync,
    }


def case_losses(rank: int, world: int) -> dict:
    """Every loss: 1 step (3 for the stateful ones), even and uneven shards, mean and sum."""
    out = {}
    for name in LOSSES:
        steps = 3 if name in ("soprc", "xbm") else 1
        out[name] = {
            "reference": reference(name, steps) if rank == 0 else None,
            "even": distributed(name, steps, rank, world, False, "mean"),
            "uneven": distributed(name, steps, rank, world, True, "mean"),
        }
    out["soprc_sum"] = {"sum": distributed("soprc", 2, rank, world, True, "sum")}
    out["soprc_long"] = {
        "reference": reference("soprc", 6) if rank == 0 else None,
        "even": distributed("soprc", 6, rank, world, False, "mean"),
    }
    return out


def case_errors(rank: int, world: int) -> dict:
    """Inputs that differ across ranks raise the same error everywhere; divergence is named."""
    out = {}
    loss_fn = DistributedLoss(make_loss("ap"))
    x, y = global_batch(0)
    rows = local_rows(x.shape[0], rank, world, False)
    attempts = {
        "dimension": lambda: loss_fn(x[rows][:, : 4 + 2 * rank], y[rows]),
        "label_length": lambda: loss_fn(x[rows], y[rows][: None if rank == 0 else -1]),
        "nan": lambda: loss_fn(x[rows] * (float("nan") if rank == 1 else 1.0), y[rows]),
    }
    for key, attempt in attempts.items():
        try:
            attempt()
            out[key] = "no error"
        except ValueError as exc:
            out[key] = str(exc)
    model = make_model()
    soprc = make_loss("soprc")
    if rank == 1:
        with torch.no_grad():
            model[0].bias[2] += 1e-12
            soprc.v[1, 3] = 0.5
    try:
        check_replicas_in_sync(model, soprc, step=7)
        out["divergence"] = "no error"
    except ReplicaDivergenceError as exc:
        out["divergence"] = (str(exc), exc.names, exc.ranks)
    return out


CASES = {"losses": case_losses, "errors": case_errors}


def main() -> None:
    cases, out_dir = sys.argv[1].split(","), Path(sys.argv[2])
    context = init_distributed(backend="gloo", device="cpu")
    try:
        for case in cases:
            result = CASES[case](context.rank, context.world_size)
            torch.save(result, out_dir / f"{case}-rank{context.rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    np.seterr(all="ignore")
    del copy
    main()
