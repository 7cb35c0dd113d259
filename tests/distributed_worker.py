"""One rank of the 2-process checks of tests/*/test_distributed*.py (not a test module).

Run as ``python distributed_worker.py CASE OUT_DIR`` with the torchrun environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) set by ``conftest.run_ranks``. Each case writes
``OUT_DIR/<case>-rank<r>.pt`` (plain tensors and values, loaded with weights_only=True); the test
compares them with a single process.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rankwise.losses import LOSSES, MEMORY_LOSSES, build_loss
from rankwise.training.distributed import (
    DistributedLoss,
    check_replicas_in_sync,
    init_distributed,
)
from rankwise.training.errors import ReplicaDivergenceError

DIM_IN, DIM = 6, 8
CLASSES, M = 6, 4  # global batch: 6 classes x 4 = 24 rows, 3 classes per rank


def global_batch(step: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The global P x K batch of a step (class-contiguous), the same on every rank."""
    generator = torch.Generator().manual_seed(100 + step)
    labels = torch.arange(CLASSES).repeat_interleave(M)
    centers = torch.randn(CLASSES, DIM_IN, generator=generator, dtype=dtype)
    x = centers[labels] + 0.7 * torch.randn(
        labels.numel(), DIM_IN, generator=generator, dtype=dtype
    )
    return x, labels


def local_rows(n: int, rank: int, world: int, uneven: bool) -> slice:
    """Rank ``rank``'s rows; ``uneven`` gives rank 0 one class more than the others."""
    if not uneven:
        return slice(n * rank // world, n * (rank + 1) // world)
    cuts = [0, 16, n] if world == 2 else [n * r // world for r in range(world + 1)]
    return slice(cuts[rank], cuts[rank + 1])


def make_loss(name: str) -> nn.Module:
    labels = torch.arange(CLASSES).repeat_interleave(10)
    # XBM: a one-step warm-up (default 75), so its 3 steps cover the batch loss and the memory
    params: dict = {"start_iteration": 1} if name == "xbm" else {}
    if name.startswith("memory_"):  # a ranking loss with a memory of 2 global batches
        name, params = name.removeprefix("memory_"), {"memory": {"size": 48, "start_step": 1}}
    return build_loss(
        name, train_labels=labels, num_classes=CLASSES, embedding_dim=DIM, **params
    ).double()


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
    for name in MEMORY_LOSSES:  # 4 steps: the plain loss, then the memory filling and full
        memory_name = f"memory_{name}"
        out[memory_name] = {
            "reference": reference(memory_name, 4) if rank == 0 else None,
            "uneven": distributed(memory_name, 4, rank, world, True, "mean"),
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
        # the values of the embeddings are refused when last_stats is read (no sync in the step)
        "nan": lambda: (
            loss_fn(x[rows] * (float("nan") if rank == 1 else 1.0), y[rows]),
            dict(loss_fn.last_stats),
        ),
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
    out.update(trainer_setup_errors(rank))
    return out


def trainer_setup_errors(rank: int) -> dict:
    """Classes per batch not divisible by the world size; BatchNorm on the CPU."""
    import warnings

    from rankwise.sampling import MPerClassBatchSampler
    from rankwise.training.distributed import DistributedTrainer

    out = {}
    train = clustered(8, 12, seed=1)
    loss_fn = build_loss("ap").double()
    odd = MPerClassBatchSampler(train.tensors[1], m=4, batch_size=12, seed=0)  # 3 classes
    try:
        DistributedTrainer(make_model(), loss_fn, train, sampler=odd, progress=False)
        out["odd_classes"] = "no error"
    except ValueError as exc:
        out["odd_classes"] = str(exc)
    with_bn = nn.Sequential(nn.Linear(DIM_IN, 16), nn.BatchNorm1d(16), nn.Linear(16, DIM)).double()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DistributedTrainer(with_bn, loss_fn, train, progress=False)
    out["batchnorm_warnings"] = [str(w.message) for w in caught if "BatchNorm" in str(w.message)]
    return out


# -- the trainer -------------------------------------------------------------------------------


def clustered(n_classes: int, per_class: int, seed: int):
    """A TensorDataset of float64 points around class centers (what the trainer ranks)."""
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    centers = 1.5 * torch.randn(n_classes, DIM_IN, generator=generator, dtype=torch.float64)
    noise = torch.randn(labels.numel(), DIM_IN, generator=generator, dtype=torch.float64)
    return TensorDataset(centers[labels] + noise, labels)


def trainer_objects(trainer_class, run_dir, **extra):
    """The objects of a small run: 8 classes, SOPRC (stateful), Adam, P x K = 4 x 4."""
    from rankwise.sampling import MPerClassBatchSampler

    train = clustered(8, 12, seed=1)
    model = make_model()
    loss_fn = build_loss("soprc", train_labels=train.tensors[1], num_classes=8).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    sampler = MPerClassBatchSampler(train.tensors[1], m=4, batch_size=16, seed=5)
    return trainer_class(
        model,
        loss_fn,
        train,
        optimizer=optimizer,
        sampler=sampler,
        val_data=clustered(5, 7, seed=2),
        test_data=clustered(6, 7, seed=3),
        run_dir=run_dir,
        iterations=10,
        eval_every=3,
        log_every=2,
        eval_ks=(1, 5),
        seed=7,
        progress=False,
        **extra,
    )


def summary(trainer, result) -> dict:
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "loss": {k: v.clone() for k, v in trainer.loss_fn.state_dict().items()},
        "test": result.test.to_dict(),
        "best_step": result.best_step,
        "history": [{k: v for k, v in r.items() if k != "samples_per_s"} for r in trainer.history],
    }


class StopOnOneRank:
    """A SIGTERM (what a scheduler sends) that reaches rank 1 only, during step 4.

    The trainer handles it like Ctrl-C, and the ranks must agree to stop after the same step.
    """

    def __new__(cls, rank: int):
        import os
        import signal

        from rankwise.training import Callback

        class _Stop(Callback):
            def on_train_step_end(self, trainer, output):
                if rank == 1 and output.step == 4:
                    os.kill(os.getpid(), signal.SIGTERM)

        return _Stop()


def case_trainer(rank: int, world: int, out_dir: Path) -> dict:
    from rankwise.training import Trainer, TrainingInterrupted
    from rankwise.training.distributed import DistributedTrainer

    out: dict = {}
    # rank 1 gets a run directory of its own: it must never be written
    own_dir = out_dir / ("uninterrupted" if rank == 0 else "uninterrupted-rank1")
    trainer = trainer_objects(DistributedTrainer, own_dir)
    out["uninterrupted"] = summary(trainer, trainer.fit())
    out["sampler"] = [type(trainer.sampler).__name__, trainer.sampler.slot_offset]
    out["rank1_dir_exists"] = (out_dir / "uninterrupted-rank1").exists()

    shared = out_dir / "interrupted"
    try:
        trainer_objects(DistributedTrainer, shared, callbacks=[StopOnOneRank(rank)]).fit()
        out["stopped_at"] = None
    except TrainingInterrupted as exc:
        out["stopped_at"] = (exc.step, exc.checkpoint_step)
    resumed = trainer_objects(DistributedTrainer, shared, resume=True)
    out["resumed_from"] = resumed.step
    out["resumed"] = summary(resumed, resumed.fit())

    if rank == 0:  # one process, the same objects, no process group involved
        single = trainer_objects(Trainer, None)
        out["single"] = summary(single, single.fit())
    return out


def case_sub_batch(rank: int, world: int, out_dir: Path) -> dict:
    """Issue 38 item 3: 2 ranks embedding their batches in sub-batches (DDP ``no_sync`` for every
    chunk but the last) take the steps of 2 ranks embedding them in one pass."""
    from rankwise.training.distributed import DistributedTrainer

    out: dict = {}
    for name, sub_batch_size in (("one_pass", None), ("sub_batch", 3)):
        trainer = trainer_objects(DistributedTrainer, None, sub_batch_size=sub_batch_size)
        trainer.fit(max_steps=2, test=False)  # before the first validation (step 3)
        out[name] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        out[name + "_loss"] = {k: v.clone() for k, v in trainer.loss_fn.state_dict().items()}
    return out


class CountingEvaluation:
    """A custom ``metric_fn`` / ``curve_fn`` (dot-product ranking) that counts its calls."""

    def __init__(self) -> None:
        self.metric_calls = 0
        self.curve_calls = 0

    def metric_fn(self, *args, **kwargs):
        from rankwise.metrics import retrieval_metrics

        self.metric_calls += 1
        return retrieval_metrics(*args, similarity="dot", **kwargs)

    def curve_fn(self, *args, **kwargs):
        from rankwise.metrics import pr_curve

        self.curve_calls += 1
        return pr_curve(*args, similarity="dot", **kwargs)


def evaluated_run(trainer_class, metric_fn, curve_fn):
    """The fitted result of 3 steps evaluated by ``metric_fn`` / ``curve_fn`` (validation, test)."""
    from rankwise.sampling import MPerClassBatchSampler

    train = clustered(8, 12, seed=1)
    trainer = trainer_class(
        make_model(),
        build_loss("ap").double(),
        train,
        sampler=MPerClassBatchSampler(train.tensors[1], m=4, batch_size=16, seed=5),
        val_data=clustered(5, 7, seed=2),
        test_data=clustered(6, 7, seed=3),
        iterations=3,
        eval_every=3,
        eval_ks=(1, 5),
        seed=7,
        progress=False,
        metric_fn=metric_fn,
        curve_fn=curve_fn,
    )
    return trainer.fit()


def custom_metric_run(trainer_class) -> dict:
    """3 steps with a custom metric_fn / curve_fn: what evaluated the run, and its test report."""
    counting = CountingEvaluation()
    result = evaluated_run(trainer_class, counting.metric_fn, counting.curve_fn)
    return {
        "metric_calls": counting.metric_calls,
        "curve_calls": counting.curve_calls,
        "test": result.test.to_dict(),
        "curve": torch.from_numpy(result.pr_curve.precision),
    }


def case_custom_metric(rank: int, world: int, out_dir: Path) -> dict:
    """A DistributedTrainer given its own metric_fn / curve_fn must evaluate with them."""
    from rankwise.training import Trainer
    from rankwise.training.distributed import DistributedTrainer

    out = {"distributed": custom_metric_run(DistributedTrainer)}
    if rank == 0:
        out["single"] = custom_metric_run(Trainer)
    return out


def sharded_metric_run(trainer_class) -> dict:
    """3 steps whose metric_fn / curve_fn take query blocks: the rows each call ranked, the report."""
    from rankwise.metrics import pr_curve, query_blocks, retrieval_metrics

    rows: dict[str, list[int]] = {"metric": [], "curve": []}

    @query_blocks
    def metric_fn(query, *args, **kwargs):
        rows["metric"].append(int(query.shape[0]))
        return retrieval_metrics(query, *args, similarity="dot", **kwargs)

    @query_blocks
    def curve_fn(query, *args, **kwargs):
        rows["curve"].append(int(query.shape[0]))
        return pr_curve(query, *args, similarity="dot", **kwargs)

    result = evaluated_run(trainer_class, metric_fn, curve_fn)
    return {
        "rows": rows,
        "best_val": result.best_val,
        "test": result.test.to_dict(),
        "scalars": result.test.scalars(),  # the names a monitor selects by
        "curve": torch.from_numpy(result.pr_curve.precision),
    }


def case_sharded_evaluation(rank: int, world: int, out_dir: Path) -> dict:
    """Issue 32 item 4: a DistributedTrainer ranks only its share of the queries, same numbers."""
    from rankwise.training import Trainer
    from rankwise.training.distributed import DistributedTrainer

    out = {"distributed": sharded_metric_run(DistributedTrainer)}
    if rank == 0:
        out["single"] = sharded_metric_run(Trainer)
    return out


# -- sharded metrics -----------------------------------------------------------------------------


def metric_data(seed: int):
    """Integer embeddings (exact dot-product scores, many ties) and labels, 37 rows."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (37, 4), generator=generator).to(torch.float64)
    y = torch.randint(0, 5, (37,), generator=generator)
    return x, y


def case_metrics(rank: int, world: int) -> dict:
    from rankwise.metrics import pr_curve, retrieval_metrics
    from rankwise.metrics.distributed import distributed_pr_curve, distributed_retrieval_metrics

    x, y = metric_data(0)
    gallery, gallery_labels = metric_data(1)
    lonely = torch.cat([100 + torch.arange(18), y[18:]])  # rank 0's queries: no relevant item
    hot = (
        torch.nn.functional.one_hot(y, 5).bool()
        | torch.nn.functional.one_hot((y + 1) % 5, 5).bool()
    )
    q_rows = slice(0, 18) if rank == 0 else slice(18, 37)
    g_rows = slice(0, 30) if rank == 0 else slice(30, 37)
    settings = {
        "leave_one_out_dot": (dict(similarity="dot", ks=(1, 3, 50)), y, None, None),
        "leave_one_out_cosine": (dict(ks=(1, 5)), y, None, None),
        "leave_one_out_euclidean": (dict(similarity="euclidean", ks=(1, 5)), y, None, None),
        "pessimistic": (dict(similarity="dot", ties="pessimistic"), y, None, None),
        "no_relevant_on_rank0": (dict(similarity="dot"), lonely, None, None),
        "multi_hot": (dict(similarity="dot"), hot, None, None),
        "gallery_sharded": (dict(similarity="dot"), y, gallery, gallery_labels),
    }
    out = {}
    for key, (kwargs, labels, g, gl) in settings.items():
        # integer vectors for every similarity: the metrics rank by exact float64 keys, so even
        # the cosine / euclidean ties of integer vectors are the same in any shard
        local_g = None if g is None else g[g_rows]
        local_gl = None if gl is None else gl[g_rows]
        report = distributed_retrieval_metrics(
            x[q_rows], labels[q_rows], local_g, local_gl, **kwargs
        )
        curve_kwargs = {k: v for k, v in kwargs.items() if k != "ks"}
        curve = distributed_pr_curve(x[q_rows], labels[q_rows], local_g, local_gl, **curve_kwargs)
        entry = {"report": report.to_dict(), "curve": torch.from_numpy(curve.precision)}
        entry["curve_n"] = (curve.n_queries, curve.n_queries_without_relevant)
        if rank == 0:
            single = retrieval_metrics(x, labels, g, gl, **kwargs)
            single_curve = pr_curve(x, labels, g, gl, **curve_kwargs)
            entry["single"] = single.to_dict()
            entry["single_curve"] = torch.from_numpy(single_curve.precision)
            entry["single_curve_n"] = (
                single_curve.n_queries,
                single_curve.n_queries_without_relevant,
            )
        out[key] = entry
    # the whole gallery on every rank (not gathered)
    report = distributed_retrieval_metrics(
        x[q_rows], y[q_rows], gallery, gallery_labels, gallery_sharded=False, similarity="dot"
    )
    out["gallery_everywhere"] = {"report": report.to_dict()}
    out["errors"] = metric_errors(rank, x[q_rows], y[q_rows])
    return out


def metric_errors(rank: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Bad input on one rank: the same error, naming the argument and the rank, on every rank."""
    from rankwise.metrics.distributed import distributed_retrieval_metrics

    nan = x.clone()
    nan[0, 0] = float("nan")
    out_of_range = torch.full((x.shape[0],), 99 if rank == 1 else -1)
    attempts = {
        "nan_on_rank1": lambda: distributed_retrieval_metrics(nan if rank == 1 else x, y),
        "label_length_on_rank0": lambda: distributed_retrieval_metrics(
            x, y[:-1] if rank == 0 else y
        ),
        "similarity_everywhere": lambda: distributed_retrieval_metrics(x, y, similarity="l2"),
        "exclude_self_on_rank1": lambda: distributed_retrieval_metrics(
            x, y, x, y, exclude_self=out_of_range
        ),
        "dtype_differs": lambda: distributed_retrieval_metrics(x.float() if rank == 1 else x, y),
    }
    out = {}
    for key, attempt in attempts.items():
        try:
            attempt()
            out[key] = "no error"
        except ValueError as exc:
            out[key] = str(exc)
    return out


# -- rankwise train on digits ---------------------------------------------------------------------

DIGITS_CONFIG = """\
dataset: {name: digits}
model: {backbone: small_cnn, embedding_dim: 16}
loss: {name: soprc, params: {}}
sampler: {m: 4, batch_size: 16}
optimizer: {name: adam, lr: 0.002, weight_decay: 0.0001}
schedule: {name: cosine}
budget: {iterations: 10}
eval_every: 4
eval_ks: [1, 10]
log_every: 2
seed: 3
progress: false
threads: 1
"""


def lingering_threads() -> list[str]:
    """Threads besides the main one that would still run at interpreter exit.

    Python's non-daemon threads, and the native threads of a process group (gloo's worker and
    transport loops, the TCPStore server): alive while the interpreter shuts down, they can touch
    Python objects it is freeing and abort the process ("terminate called without an active
    exception", exit -6).
    """
    names = [
        t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
    ]
    tasks = Path("/proc/self/task")  # Linux: the name of every native thread
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if "gloo" in name or "tcpstore" in name:
            names.append(name)
    return sorted(names)


def case_digits(rank: int, world: int, out_dir: Path) -> dict:
    """The uninterrupted 2-process run of what `rankwise train -c digits.yaml` does."""
    from rankwise.training import load_config
    from rankwise.training.distributed import DistributedTrainer

    config_path = out_dir / "digits.yaml"
    if rank == 0:
        config_path.write_text(DIGITS_CONFIG)
    dist.barrier()
    run_dir = out_dir / "digits-uninterrupted"
    config = load_config(config_path, [f"output_dir={run_dir}"])
    result = DistributedTrainer.from_config(config).fit()
    # then `rankwise train --max-steps 6` in this process (the command leaves the process group
    # when it ends, so this case runs last); tests/test_cli_train_distributed.py resumes it
    from typer.testing import CliRunner

    from rankwise.cli import build_app

    stopped_dir = out_dir / "digits-cli"
    args = ["train", "-c", str(config_path), "--output", str(stopped_dir), "--max-steps", "6"]
    cli = CliRunner().invoke(build_app(), args)
    return {
        "status": result.status,
        "steps": result.steps,
        "map": result.test.map,
        "cli_exit": cli.exit_code,
        "cli_output": cli.output,
        # what the command left behind it (nothing: it joined the group and must leave it)
        "group_after_cli": dist.is_initialized(),
        "threads_after_cli": lingering_threads(),
    }


CASES = {
    "losses": case_losses,
    "errors": case_errors,
    "trainer": case_trainer,
    "metrics": case_metrics,
    "digits": case_digits,
    "custom_metric": case_custom_metric,
    "sharded_evaluation": case_sharded_evaluation,
    "sub_batch": case_sub_batch,
}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def report() -> None:
    """Launch both ranks, then print the largest differences from the one-process runs."""
    import os
    import subprocess
    import tempfile

    out = Path(tempfile.mkdtemp())
    port = 29000 + os.getpid() % 1000
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", OMP_NUM_THREADS="1")
        procs.append(
            subprocess.Popen([sys.executable, __file__, "losses,trainer", str(out)], env=env)
        )
    if any(proc.wait() for proc in procs):
        raise SystemExit("a rank failed")
    losses = torch.load(out / "losses-rank0.pt", weights_only=True)
    print(
        f"{'loss':18s} {'layout':7s} {'steps':>5s} {'loss rel':>9s} {'grad rel':>9s} {'state abs':>9s}"
    )
    for name, entry in losses.items():
        ref = entry.get("reference")
        for layout in ("even", "uneven"):
            if ref is None or layout not in entry:
                continue
            run = entry[layout]
            loss_error = max(
                abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"], strict=True)
            )
            grad_error = max(
                _relative(a, b)
                for mine, theirs in zip(run["grads"], ref["grads"], strict=True)
                for a, b in zip(mine, theirs, strict=True)
            )
            state = [
                float((run["loss_state"][k].double() - v.double()).abs().max())
                for k, v in ref["loss_state"].items()
                if v.numel()
            ]
            steps = len(ref["losses"])
            print(
                f"{name:18s} {layout:7s} {steps:5d} {loss_error:9.1e} {grad_error:9.1e} "
                f"{max(state, default=0.0):9.1e}"
            )
    trainer = torch.load(out / "trainer-rank0.pt", weights_only=True)
    run, single = trainer["uninterrupted"], trainer["single"]
    weights = max(float((run["model"][k] - single["model"][k]).abs().max()) for k in run["model"])
    print(f"trainer, 10 Adam steps, float64: largest weight difference {weights:.1e}")
    print(f"test mAP: 2 ranks {run['test']['map']!r}, one process {single['test']['map']!r}")


def main() -> None:
    cases, out_dir = sys.argv[1].split(","), Path(sys.argv[2])
    context = init_distributed(backend="gloo", device="cpu")
    try:
        for case in cases:
            started = time.perf_counter()
            run = CASES[case]
            if case in ("trainer", "digits", "custom_metric", "sharded_evaluation", "sub_batch"):
                result = run(context.rank, context.world_size, out_dir)
            else:
                result = run(context.rank, context.world_size)
            torch.save(result, out_dir / f"{case}-rank{context.rank}.pt")
            if dist.is_initialized():  # `rankwise train` (case digits) leaves the group itself
                dist.barrier()
            print(f"case {case}: {time.perf_counter() - started:.1f} s", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1:] == ["--report"]:
        report()
    else:
        main()
