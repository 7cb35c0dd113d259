"""Training loop of the image-retrieval experiments of Wen et al., *Exploring the
Algorithm-Dependent Generalization of AUPRC Optimization with List Stability* (NeurIPS 2022),
Sec. 5.1 and App. D.1: an embedding network trained end to end with a ranking loss (SOPRC's
Alg. 1 or a competitor) on P x K mini-batches with exactly ``m`` samples per class, model selection
by validation mAUPRC (tie-aware mAP), and a final test report of the selected model (open-set:
leave-one-out on the test split; closed-set: test queries against the gallery).

The loop is resumable bit for bit: a checkpoint holds the weights, the optimizer, the loss buffers
(SOPRC's auxiliary vector ``v`` of Eq. (10)), the sampler position (epoch and batch), every RNG
stream, the step counter and the best-so-far. Random data transforms draw from a generator seeded
by ``(seed, epoch, batch, slot)``, so batches do not depend on where a run was interrupted nor on
``num_workers``. The learning rate is a pure function of the step, so the schedule needs no state.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch.utils.data import DataLoader, Dataset

from .._threads import preserve_torch_threads
from .checkpoint import (
    atomic_save,
    atomic_write_text,
    capture_rng_state,
    load_checkpoint,
    restore_rng_state,
)
from .config import Config, ConfigError, OptimizerConfig, config_from_dict

__all__ = [
    "COLLAPSE_SPREAD",
    "CollapsedEmbeddingsError",
    "NonFiniteLossError",
    "RunResult",
    "Trainer",
    "TrainingInterrupted",
    "build_optimizer",
    "embedding_spread",
    "learning_rate_at",
    "load_splits",
    "preflight",
    "train",
]

CHECKPOINT_FORMAT = 1
# embedding_spread below which a run counts as collapsed: every cosine score then lies within
# 2 * spread**2 = 2e-6 of every other (a few float32 ulps near 1), i.e. every score ties
COLLAPSE_SPREAD = 1e-3
Callback = Callable[["Trainer"], None]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the run stopped without applying that step."""

    def __init__(self, message: str, step: int, last_good_checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.last_good_checkpoint = last_good_checkpoint


class CollapsedEmbeddingsError(NonFiniteLossError):
    """Every score ties: the embeddings of a training batch or of the validation split all point
    in the same direction, so nothing can be ranked any more; the run stopped.

    A subclass of :class:`NonFiniteLossError` so every handler of a diverged run (the CLI, ``tune``
    recording a failed trial) handles a collapsed one too. ``spread`` is the
    :func:`embedding_spread` that triggered it, ``where`` ``"training batch"`` or
    ``"validation split"``.
    """

    def __init__(
        self,
        message: str,
        step: int,
        last_good_checkpoint: Path | None,
        spread: float,
        where: str,
    ) -> None:
        super().__init__(message, step, last_good_checkpoint)
        self.spread = spread
        self.where = where


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (or a callback raising ``KeyboardInterrupt``) stopped the run after a checkpoint."""

    def __init__(self, message: str, step: int, run_dir: Path, checkpoint_step: int | None) -> None:
        super().__init__(message)
        self.message = message
        self.step = step
        self.run_dir = run_dir
        self.checkpoint_step = checkpoint_step

    def __str__(self) -> str:
        return self.message


@dataclass
class RunResult:
    """Outcome of :meth:`Trainer.fit`.

    Attributes:
        run_dir: the run directory.
        status: ``"completed"`` (budget reached, test report written) or ``"stopped"``
            (``max_steps`` reached; ``last.pt`` holds the state, resume to finish).
        steps: optimizer steps taken.
        seconds: wall-clock seconds spent in this run, summed over resumptions.
        best_step: step of the best validation mAP (``None`` before the first evaluation).
        best_val: the best validation ``RetrievalReport.to_dict()``.
        test: the test :class:`~rankwise.metrics.RetrievalReport` of the best model (completed only).
        pr_curve: the test :class:`~rankwise.metrics.PRCurve` of the best model (completed only).
    """

    run_dir: Path
    status: str
    steps: int
    seconds: float
    best_step: int | None
    best_val: dict[str, Any] | None
    test: Any = None
    pr_curve: Any = None
    config: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the content of ``report.json``)."""
        return {
            "status": self.status,
            "steps": self.steps,
            "seconds": self.seconds,
            "best_step": self.best_step,
            "best_val": self.best_val,
            "test": None if self.test is None else self.test.to_dict(),
            "run_dir": str(self.run_dir),
        }


# -- helpers --------------------------------------------------------------------------------------


def learning_rate_at(config: Config, step: int, total_steps: int) -> float:
    """Learning rate of the optimizer step with 0-based index ``step``.

    multistep: ``lr * gamma ** (number of milestones <= step)`` (as ``MultiStepLR`` stepped per
    iteration); cosine: ``min_lr + (lr - min_lr) * (1 + cos(pi * step / total_steps)) / 2``.
    """
    base = config.optimizer.lr
    schedule = config.schedule
    if schedule.name == "multistep":
        passed = sum(1 for milestone in schedule.milestones if milestone <= step)
        return base * schedule.gamma**passed
    if schedule.name == "cosine":
        progress = min(step, total_steps) / max(total_steps, 1)
        return schedule.min_lr + (base - schedule.min_lr) * 0.5 * (
            1.0 + math.cos(math.pi * progress)
        )
    return base


def embedding_spread(embeddings: torch.Tensor) -> float:
    """Largest distance of an L2-normalized row of ``embeddings`` (N, d) from the first one.

    Cosine scores are ranked by direction only, and for unit vectors 1 - u_i.u_j = |u_i - u_j|^2 / 2,
    so a spread ``r`` puts every pairwise score within 2 r^2 of every other. 0 means every row has
    the same direction (or every row is zero); ``inf`` for fewer than 2 rows (nothing to compare).
    O(N d), no score matrix.
    """
    if embeddings.shape[0] < 2:
        return math.inf
    unit = torch.nn.functional.normalize(embeddings.detach().float(), dim=1)
    return float((unit - unit[:1]).norm(dim=1).max())


def _mix_seed(*parts: int) -> int:
    """splitmix64 over the parts: decorrelated 63-bit seeds from small integers."""
    mask = (1 << 64) - 1
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state + (int(part) & mask) + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        state = z ^ (z >> 31)
    return state >> 1


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: 'cuda' requested but no CUDA device is available; use auto/cpu.")
    return torch.device(name)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))  # noqa: NPY002
    torch.manual_seed(seed)


class _PositionedBatches:
    """Batch sampler yielding ``(index, item_seed, epoch, position)`` tuples forever.

    Starts at batch ``position`` of ``epoch`` of the underlying P x K sampler (whose batches are a
    function of its seed and ``set_epoch``) and continues with the following epochs. The epoch and
    position travel with the items, so the trainer knows exactly which batch it consumed even when
    DataLoader workers prefetch ahead.
    """

    def __init__(self, sampler: Any, seed: int, epoch: int, position: int) -> None:
        self.sampler = sampler
        self.seed = seed
        self.epoch = epoch
        self.position = position

    def __iter__(self) -> Iterator[list[tuple[int, int, int, int]]]:
        epoch, skip = self.epoch, self.position
        while True:
            self.sampler.set_epoch(epoch)
            produced = 0
            for position, batch in enumerate(self.sampler):
                produced += 1
                if position < skip:
                    continue
                yield [
                    (int(index), _mix_seed(self.seed, epoch, position, slot), epoch, position)
                    for slot, index in enumerate(batch)
                ]
            if produced == 0:
                raise RuntimeError("the batch sampler produced no batch in an epoch.")
            epoch, skip = epoch + 1, 0


class _SeededItems(Dataset):
    """Wraps a dataset so every item's random transform is seeded by its batch coordinates."""

    def __init__(self, dataset: Dataset, reseed: bool) -> None:
        self.dataset = dataset
        self.reseed = reseed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int, int, int]) -> tuple[Any, int, torch.Tensor]:
        index, item_seed, epoch, position = key
        meta = torch.tensor([epoch, position], dtype=torch.int64)
        if not self.reseed:
            x, label = self.dataset[index]
            return x, label, meta
        np_state, py_state = np.random.get_state(), random.getstate()  # noqa: NPY002
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(item_seed)
            np.random.seed(item_seed % (2**32))  # noqa: NPY002
            random.seed(item_seed)
            try:
                x, label = self.dataset[index]
            finally:
                np.random.set_state(np_state)  # noqa: NPY002
                random.setstate(py_state)
        return x, label, meta


def _worker_init(worker_id: int) -> None:
    # each worker gets a distinct, reproducible stream (the DataLoader generator fixes base seeds)
    worker_seed = torch.initial_seed() % (2**32)
    np.random.seed(worker_seed)  # noqa: NPY002
    random.seed(worker_seed)


@contextlib.contextmanager
def _determinism(enabled: bool, device: torch.device) -> Iterator[None]:
    previous = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    previous_cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    if enabled:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous, warn_only=previous_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = previous_cudnn


@contextlib.contextmanager
def _graceful_sigint(trainer: Trainer) -> Iterator[None]:
    """First Ctrl-C: finish the current step, then checkpoint and stop. Second: abort at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if trainer._stop_requested:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        trainer._stop_requested = True
        trainer.console.print(
            "[yellow]Ctrl-C: stopping after this step and saving a checkpoint "
            "(press Ctrl-C again to abort without saving).[/yellow]",
            soft_wrap=True,
        )

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _report_value(report: Any, name: str) -> float:
    return float(getattr(report, name))


def _collapse_advice(config: Config) -> str:
    """Likely causes of a collapse under ``config`` and the settings that fix them."""
    oc = config.optimizer
    causes, fixes = [], []
    if oc.weight_decay > 0 and oc.name != "adamw":
        how = (
            "Adam divides the decay term by the gradient's scale, so it moves every weight by a "
            "full lr-sized step towards 0"
            if oc.name == "adam"
            else "it shrinks the weights towards 0"
        )
        causes.append(
            f"weight decay coupled to the gradient (optimizer.name={oc.name}, weight_decay="
            f"{oc.weight_decay:g}) outweighing a tiny loss gradient: {how}"
        )
        fixes.append("optimizer.name=adamw (decoupled weight decay) or optimizer.weight_decay=0")
    causes.append(f"a learning rate too high for this loss (optimizer.lr={oc.lr:g})")
    fixes.append("a lower optimizer.lr")
    if config.loss.name == "soprc" and config.loss.params.get("prior_scale") is None:
        causes.append(
            "SOPRC's gradient shrinks with the class prior, and the raw priors of a many-class "
            "dataset (~1e-4) leave almost none"
        )
        fixes.append("loss.params.prior_scale (see docs/losses.md, SOPRC)")
    return f"Likely cause: {'; or '.join(causes)}. Fix: {'; '.join(fixes)}."


def _summary(report: Any) -> dict[str, Any]:
    """``report.to_dict()`` without the per-query list (kept only in ``report.json``)."""
    out = report.to_dict()
    out.pop("per_query_ap", None)
    return out


# -- data-dependent configuration checks ---------------------------------------------------------


def load_splits(config: Config) -> Any:
    """:func:`rankwise.data.load_dataset` for ``config.dataset``; failures as :class:`ConfigError`."""
    from ..data import load_dataset

    ds = config.dataset
    try:
        return load_dataset(
            ds.name,
            protocol=ds.protocol,
            data_dir=ds.data_dir,
            val_fraction=ds.val_fraction,
            seed=ds.split_seed,
            image_size=ds.image_size,
            val_holdout=ds.val_holdout,
            **ds.options,
        )
    except FileNotFoundError as exc:
        raise ConfigError(f"dataset.data_dir: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"dataset: {exc}") from None


def _check_batch_classes(config: Config, splits: Any) -> tuple[np.ndarray, int]:
    train_labels = np.asarray(splits.train.labels, dtype=np.int64)
    n_classes = int(np.unique(train_labels).size)
    per_batch = config.sampler.classes_per_batch
    if per_batch > n_classes:
        raise ConfigError(
            f"sampler.batch_size: {config.sampler.batch_size} / sampler.m={config.sampler.m} "
            f"= {per_batch} classes per batch, but the training split of "
            f"{config.dataset.name!r} has only {n_classes} classes; use sampler.batch_size <= "
            f"{n_classes * config.sampler.m}."
        )
    return train_labels, n_classes


def _build_loss(config: Config, train_labels: np.ndarray, n_classes: int) -> torch.nn.Module:
    from ..losses import build_loss

    try:
        return build_loss(
            config.loss.name,
            train_labels=train_labels,
            num_classes=n_classes,
            embedding_dim=config.model.embedding_dim,
            **config.loss.params,
        )
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError(f"loss.params ({config.loss.name}): {exc}") from None


def _build_sampler(config: Config, train_labels: np.ndarray) -> Any:
    from ..sampling import MPerClassBatchSampler

    try:
        sampler = MPerClassBatchSampler(
            train_labels, config.sampler.m, config.sampler.batch_size, seed=config.seed
        )
    except ValueError as exc:
        raise ConfigError(f"sampler: {exc}") from None
    if len(sampler) <= 0:
        raise ConfigError("sampler: the training split yields no full batch per epoch.")
    return sampler


def build_optimizer(
    oc: OptimizerConfig, params: Sequence[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimizer named by ``oc`` over ``params``.

    ``sgd`` and ``adam`` add ``weight_decay * w`` to the gradient (coupled L2); ``adamw`` decays
    the weights by ``lr * weight_decay * w`` outside the adaptive step (decoupled), so a tiny loss
    gradient cannot be outweighed by the decay term (see docs/losses.md, SOPRC).
    """
    if oc.name == "sgd":
        return torch.optim.SGD(params, lr=oc.lr, momentum=oc.momentum, weight_decay=oc.weight_decay)
    if oc.name == "adamw":
        return torch.optim.AdamW(params, lr=oc.lr, weight_decay=oc.weight_decay)
    return torch.optim.Adam(params, lr=oc.lr, weight_decay=oc.weight_decay)


def _total_steps(config: Config, steps_per_epoch: int) -> int:
    budget = config.budget
    total = budget.iterations if budget.iterations is not None else budget.epochs * steps_per_epoch
    milestones = config.schedule.milestones
    if config.schedule.name == "multistep" and milestones[-1] >= total:
        raise ConfigError(
            f"schedule.milestones: {milestones} reach past the budget of {total} steps; the "
            "last decay would never happen."
        )
    return total


def preflight(config: Config, splits: Any) -> int:
    """Every check :class:`Trainer` makes before training, without building the model.

    Returns the number of training steps of the run. Raises :class:`ConfigError`.
    """
    import warnings

    train_labels, n_classes = _check_batch_classes(config, splits)
    _build_loss(config, train_labels, n_classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Trainer warns about undersized classes itself
        sampler = _build_sampler(config, train_labels)
    return _total_steps(config, len(sampler))


# -- trainer --------------------------------------------------------------------------------------


class Trainer:
    """Builds everything a run needs from a :class:`Config` and trains it.

    All configuration errors that need the data (unknown loss parameter, more classes per batch
    than the training split has, missing dataset files, milestones past the budget) are raised as
    :class:`ConfigError` by the constructor, before any training step.

    Args:
        config: the validated run configuration.
        splits: optional pre-loaded :class:`~rankwise.data.RetrievalSplits` (a benchmark reuses
            one load for every run); by default :func:`rankwise.data.load_dataset` is called.
        resume: resume from ``<run_dir>/checkpoints/last.pt`` (use :meth:`from_run_dir`).
        overwrite: allow starting a fresh run in a directory that already holds one.
        console: rich console for messages; by default one on stderr.
    """

    def __init__(
        self,
        config: Config,
        *,
        splits: Any = None,
        resume: bool = False,
        overwrite: bool = False,
        console: Any = None,
    ) -> None:
        from rich.console import Console

        from ..models import build_model

        self.config = config
        self.console = console if console is not None else Console(stderr=True)
        self.run_dir = config.resolved_output_dir()
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.device = _resolve_device(config.device)
        if self.device.type == "cuda" and config.deterministic:
            # cuBLAS reads this once, at its first use: it must be set before any CUDA matmul
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if config.threads is not None:
            torch.set_num_threads(config.threads)

        if not resume and not overwrite and (self.checkpoint_dir / "last.pt").exists():
            raise ConfigError(
                f"output_dir: {str(self.run_dir)!r} already holds a run; resume it with "
                f"`rankwise train --resume {self.run_dir}` or choose another --output."
            )

        # -- data, then every data-dependent check before anything is trained ----------------
        self.splits = splits if splits is not None else load_splits(config)
        train_labels, n_classes = _check_batch_classes(config, self.splits)

        # -- model, loss, sampler, optimizer (seeded: the same seed gives the same init) ------
        _seed_everything(config.seed)
        mc = config.model
        try:
            self.model = build_model(
                mc.backbone,
                tuple(self.splits.train.input_shape),
                mc.embedding_dim,
                weights_path=mc.weights_path,
                frozen_bn=mc.frozen_bn,
            ).to(self.device)
        except FileNotFoundError as exc:
            raise ConfigError(f"model.weights_path: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None
        self.loss_fn = _build_loss(config, train_labels, n_classes).to(self.device)
        self.sampler = _build_sampler(config, train_labels)
        self.steps_per_epoch = len(self.sampler)
        self.total_steps = _total_steps(config, self.steps_per_epoch)
        params = [p for p in self.model.parameters() if p.requires_grad]
        params += [p for p in self.loss_fn.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(config.optimizer, params)

        # -- progress state -------------------------------------------------------------------
        self.step = 0
        self.next_epoch = 0
        self.next_position = 0
        self.seconds = 0.0
        self.best_map: float | None = None
        self.best_step: int | None = None
        self.best_val: dict[str, Any] | None = None
        self.last_checkpoint_step: int | None = None
        self.history: list[dict[str, Any]] = []
        self._stop_requested = False
        self._in_step = False
        self._last_val_embeddings: torch.Tensor | None = None
        # losses of the steps since the last train log record: checkpointed, so a run resumed
        # between two records logs the same window mean as an uninterrupted run
        self._window_losses: list[float] = []
        if resume:
            self._load_last()

    # -- construction from a run directory ---------------------------------------------------

    @classmethod
    def from_run_dir(
        cls,
        run_dir: str | Path,
        *,
        num_workers: int | None = None,
        device: str | None = None,
        console: Any = None,
    ) -> Trainer:
        """Trainer that resumes the run in ``run_dir`` (its ``config.yaml`` and ``last.pt``).

        ``num_workers`` may change freely (batches do not depend on it); ``device`` may change
        too, but then results are no longer bit-identical to an uninterrupted run.
        """
        run_dir = Path(run_dir)
        config_path = run_dir / "config.yaml"
        if not config_path.is_file() or not (run_dir / "checkpoints" / "last.pt").is_file():
            raise ConfigError(
                f"--resume: {str(run_dir)!r} is not a run directory (it needs config.yaml and "
                "checkpoints/last.pt)."
            )
        data = yaml.safe_load(config_path.read_text())
        data["output_dir"] = str(run_dir)
        if num_workers is not None:
            data["num_workers"] = num_workers
        if device is not None:
            data["device"] = device
        return cls(config_from_dict(data), resume=True, console=console)

    # -- checkpoints ------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "config": self.config.to_dict(),
            "step": self.step,
            "next_epoch": self.next_epoch,
            "next_position": self.next_position,
            "seconds": self.seconds,
            "best_map": self.best_map,
            "best_step": self.best_step,
            "best_val": self.best_val,
            "model": self.model.state_dict(),
            "loss": self.loss_fn.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sampler": {"epoch": self.next_epoch, "position": self.next_position},
            "rng": capture_rng_state(),
            "window_losses": list(self._window_losses),
        }

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/last.pt`` atomically with the complete state after ``self.step``."""
        path = self.checkpoint_dir / "last.pt"
        atomic_save(self._state(), path)
        self.last_checkpoint_step = self.step
        return path

    def _load_last(self) -> None:
        state = load_checkpoint(self.checkpoint_dir / "last.pt", map_location=self.device)
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ConfigError(f"--resume: unsupported checkpoint format {state.get('format')!r}.")
        self.model.load_state_dict(state["model"])
        self.loss_fn.load_state_dict(state["loss"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.next_epoch = int(state["next_epoch"])
        self.next_position = int(state["next_position"])
        self.seconds = float(state["seconds"])
        self.best_map = state["best_map"]
        self.best_step = state["best_step"]
        self.best_val = state["best_val"]
        self.last_checkpoint_step = self.step
        restore_rng_state(state["rng"])
        self._window_losses = [float(v) for v in state.get("window_losses", [])]
        # records written after the checkpoint (a crash between checkpoints) are replayed anyway;
        # the test record is rewritten by the final test, which a resumed run always runs again
        self.history = [
            r
            for r in self._read_metrics()
            if int(r.get("step", 0)) <= self.step and r.get("kind") != "test"
        ]
        self._rewrite_metrics()

    # -- metrics log ------------------------------------------------------------------------

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def _read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.is_file():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]

    def _rewrite_metrics(self) -> None:
        atomic_write_text("".join(json.dumps(r) + "\n" for r in self.history), self.metrics_path)

    def _log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    # -- evaluation -------------------------------------------------------------------------

    def embed(self, dataset: Dataset) -> tuple[torch.Tensor, np.ndarray]:
        """Embeddings ``(N, d)`` (on the model's device) and ``(N,)`` int64 labels of a split.

        Streams the split in batches of ``eval_batch_size`` under ``torch.no_grad()`` in eval mode
        and restores the previous mode afterwards.
        """
        loader = DataLoader(
            dataset,
            batch_size=self.config.eval_batch_size,
            shuffle=False,
            num_workers=self.config.num_workers,
            worker_init_fn=_worker_init,
            generator=torch.Generator().manual_seed(self.config.seed),
            pin_memory=self.device.type == "cuda",
        )
        was_training = self.model.training
        self.model.eval()
        chunks = []
        try:
            with torch.no_grad():
                for x, _ in loader:
                    chunks.append(self.model(x.to(self.device, non_blocking=True)))
        finally:
            self.model.train(was_training)
        return torch.cat(chunks), np.asarray(dataset.labels, dtype=np.int64)

    def evaluate(self, split: str = "val") -> Any:
        """:class:`~rankwise.metrics.RetrievalReport` of the current model on ``val`` or ``test``."""
        with preserve_torch_threads():
            return self._evaluate(split)

    def _evaluate(self, split: str) -> Any:
        from ..metrics import retrieval_metrics

        query_set = self.splits.val if split == "val" else self.splits.test
        if query_set is None:
            raise ValueError(f"the dataset has no {split!r} split.")
        query, query_labels = self.embed(query_set)
        if split == "val":
            self._last_val_embeddings = query  # for the collapse check of _validate_and_checkpoint
        if split == "test" and self.splits.protocol == "closed-set":
            gallery, gallery_labels = self.embed(self.splits.gallery)
            return retrieval_metrics(
                query, query_labels, gallery, gallery_labels, ks=self.config.eval_ks
            )
        return retrieval_metrics(query, query_labels, ks=self.config.eval_ks)

    def test_pr_curve(self) -> Any:
        """Mean precision-recall curve of the current model on the test split."""
        with preserve_torch_threads():
            return self._test_pr_curve()

    def _test_pr_curve(self) -> Any:
        from ..metrics import pr_curve

        query, query_labels = self.embed(self.splits.test)
        if self.splits.protocol == "closed-set":
            gallery, gallery_labels = self.embed(self.splits.gallery)
            return pr_curve(query, query_labels, gallery, gallery_labels)
        return pr_curve(query, query_labels)

    def _validate_and_checkpoint(self) -> None:
        if self.splits.val is not None:
            report = self.evaluate("val")
            # the step is applied but not checkpointed: the last good checkpoint stays
            self._stop_if_collapsed(self._last_val_embeddings, "validation split", self.step)
            self._last_val_embeddings = None
            metrics = _summary(report)
            self._log({"kind": "val", "step": self.step, **metrics})
            value = _report_value(report, "map")
            if self.best_map is None or value > self.best_map:
                self.best_map, self.best_step, self.best_val = value, self.step, metrics
                atomic_save(
                    {
                        "format": CHECKPOINT_FORMAT,
                        "step": self.step,
                        "val": metrics,
                        "config": self.config.to_dict(),
                        "model": self.model.state_dict(),
                        "loss": self.loss_fn.state_dict(),
                    },
                    self.checkpoint_dir / "best.pt",
                )
        self.save_checkpoint()

    # -- training ---------------------------------------------------------------------------

    def _make_loader(self) -> DataLoader:
        train = self.splits.train
        reseed = getattr(train, "transform", True) is not None
        return DataLoader(
            _SeededItems(train, reseed),
            batch_sampler=_PositionedBatches(
                self.sampler, self.config.seed, self.next_epoch, self.next_position
            ),
            num_workers=self.config.num_workers,
            worker_init_fn=_worker_init,
            generator=torch.Generator().manual_seed(
                _mix_seed(self.config.seed, self.next_epoch, self.next_position)
            ),
            pin_memory=self.device.type == "cuda",
        )

    def _show_progress(self) -> bool:
        if self.config.progress is not None:
            return self.config.progress
        return bool(self.console.is_terminal) and sys.stdout.isatty()

    def _write_run_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            yaml.safe_dump(self.config.to_dict(), sort_keys=False), self.run_dir / "config.yaml"
        )
        if self.step == 0:
            # a fresh run (possibly --overwrite): drop the previous run's checkpoints and report,
            # so a crash before the first checkpoint cannot leave them to a later --resume
            for stale in (
                self.checkpoint_dir / "last.pt",
                self.checkpoint_dir / "best.pt",
                self.run_dir / "report.json",
            ):
                stale.unlink(missing_ok=True)
            self.history = []
            self._rewrite_metrics()

    def fit(self, *, max_steps: int | None = None, callbacks: Sequence[Callback] = ()) -> RunResult:
        """Train to the budget (or to ``max_steps``), then test the best model.

        Args:
            max_steps: stop after this many total steps with a checkpoint (``status="stopped"``);
                resuming later continues exactly where it stopped.
            callbacks: called as ``callback(trainer)`` after every step (and its evaluation);
                raising ``KeyboardInterrupt`` from one behaves like Ctrl-C.

        Raises:
            TrainingInterrupted: Ctrl-C; ``last.pt`` holds the state after the last full step.
            NonFiniteLossError: the loss became NaN/inf; the last good checkpoint is kept.
        """
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        cfg = self.config
        self._write_run_files()
        self._stop_requested = False
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("loss {task.fields[loss]:.4f}  {task.fields[rate]:.0f} samples/s"),
            console=self.console,
            disable=not self._show_progress(),
            transient=False,
        )
        window_start = time.perf_counter()
        window_steps = 0
        tick = time.perf_counter()
        with _determinism(cfg.deterministic, self.device), _graceful_sigint(self), progress:
            task = progress.add_task(
                f"{cfg.loss.name} on {cfg.dataset.name}",
                total=self.total_steps,
                completed=self.step,
                loss=float("nan"),
                rate=0.0,
            )
            self.model.train()
            batches = iter(self._make_loader())
            try:
                while self.step < self.total_steps:
                    if max_steps is not None and self.step >= max_steps:
                        break
                    self._in_step = True
                    x, y, meta = next(batches)
                    lr = learning_rate_at(cfg, self.step, self.total_steps)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    embeddings = self.model(x.to(self.device, non_blocking=True))
                    if not bool(torch.isfinite(embeddings).all()):
                        # a diverged model: stop like a non-finite loss (the loss would only
                        # reject its input), keeping the last good checkpoint
                        self._raise_non_finite(None)
                    self._stop_if_collapsed(embeddings, "training batch", self.step + 1)
                    loss = self.loss_fn(embeddings, y.to(self.device, non_blocking=True))
                    if not torch.isfinite(loss):
                        self._raise_non_finite(loss)
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    self.optimizer.step()
                    self.step += 1
                    epoch, position = int(meta[0, 0]), int(meta[0, 1])
                    if position + 1 >= self.steps_per_epoch:
                        self.next_epoch, self.next_position = epoch + 1, 0
                    else:
                        self.next_epoch, self.next_position = epoch, position + 1
                    now = time.perf_counter()
                    self.seconds += now - tick
                    tick = now

                    window_steps += 1
                    self._window_losses.append(float(loss.detach()))
                    if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                        elapsed = max(now - window_start, 1e-9)
                        rate = window_steps * cfg.sampler.batch_size / elapsed
                        stats = {
                            k: v
                            for k, v in getattr(self.loss_fn, "last_stats", {}).items()
                            if isinstance(v, (int, float))
                        }
                        self._log(
                            {
                                "kind": "train",
                                "step": self.step,
                                "epoch": epoch,
                                "loss": float(np.mean(self._window_losses)),
                                "lr": lr,
                                "samples_per_s": rate,
                                "loss_stats": stats,
                            }
                        )
                        progress.update(task, loss=float(np.mean(self._window_losses)), rate=rate)
                        window_start, window_steps, self._window_losses = now, 0, []
                    progress.update(task, completed=self.step)
                    if self.step % cfg.eval_every == 0 or self.step == self.total_steps:
                        self._validate_and_checkpoint()
                    # the step, its log record and its evaluation are complete: a safe stop point
                    self._in_step = False
                    for callback in callbacks:
                        callback(self)
                    if self._stop_requested:
                        raise KeyboardInterrupt
                    now = time.perf_counter()
                    self.seconds += now - tick
                    tick = now
            except KeyboardInterrupt:
                raise self._interrupted() from None
            finally:
                self.seconds += time.perf_counter() - tick
                tick = time.perf_counter()
                del batches  # shuts DataLoader workers down

        if self.step < self.total_steps:  # max_steps reached
            if self.last_checkpoint_step != self.step:
                self.save_checkpoint()
            return self._result("stopped")
        with _determinism(cfg.deterministic, self.device):
            return self._finish()

    def _interrupted(self) -> TrainingInterrupted:
        if not self._in_step:
            if self.last_checkpoint_step != self.step:
                self.save_checkpoint()
            detail = f"checkpoint saved at step {self.step}"
        elif self.last_checkpoint_step is not None:
            detail = (
                f"step {self.step + 1} was cut short, so the checkpoint of step "
                f"{self.last_checkpoint_step} is kept"
            )
        else:
            detail = "no checkpoint had been written yet; start the run again"
        message = (
            f"training interrupted at step {self.step}/{self.total_steps}: {detail}. "
            f"Resume with: rankwise train --resume {self.run_dir}"
        )
        return TrainingInterrupted(message, self.step, self.run_dir, self.last_checkpoint_step)

    def _raise_non_finite(self, loss: torch.Tensor | None) -> None:
        last = self.checkpoint_dir / "last.pt" if self.last_checkpoint_step is not None else None
        kept = (
            f"the last good checkpoint ({last}, step {self.last_checkpoint_step}) is kept"
            if last is not None
            else "no checkpoint had been written yet"
        )
        what = (
            f"the loss is {float(loss.detach())}"
            if loss is not None
            else "the model's embeddings contain NaN/inf"
        )
        message = (
            f"{what} at step {self.step + 1} "
            f"(epoch {self.next_epoch}, loss {self.config.loss.name}); training stopped without "
            f"applying that step and {kept}. Lower optimizer.lr or check the loss parameters."
        )
        self._log(
            {
                "kind": "error",
                "step": self.step + 1,
                "error": "non-finite loss" if loss is not None else "non-finite embeddings",
            }
        )
        raise NonFiniteLossError(message, self.step + 1, last)

    def _stop_if_collapsed(self, embeddings: torch.Tensor, where: str, step: int) -> None:
        """Raise :class:`CollapsedEmbeddingsError` when every score of ``embeddings`` ties."""
        spread = embedding_spread(embeddings)
        if spread > COLLAPSE_SPREAD:
            return
        last = self.checkpoint_dir / "last.pt" if self.last_checkpoint_step is not None else None
        kept = (
            f"the last good checkpoint ({last}, step {self.last_checkpoint_step}) is kept"
            if last is not None
            else "no checkpoint had been written yet"
        )
        message = (
            f"every score ties at step {step} (epoch {self.next_epoch}, loss "
            f"{self.config.loss.name}): the {embeddings.shape[0]} embeddings of the {where} all "
            f"point in the same direction (spread {spread:.2e} <= {COLLAPSE_SPREAD:g}), so the "
            f"model has collapsed and cannot rank; training stopped and {kept}. "
            + _collapse_advice(self.config)
        )
        self._log(
            {
                "kind": "error",
                "step": step,
                "error": "collapsed embeddings",
                "where": where,
                "spread": spread,
            }
        )
        raise CollapsedEmbeddingsError(message, step, last, spread, where)

    def _result(self, status: str, test: Any = None, curve: Any = None) -> RunResult:
        return RunResult(
            run_dir=self.run_dir,
            status=status,
            steps=self.step,
            seconds=self.seconds,
            best_step=self.best_step,
            best_val=self.best_val,
            test=test,
            pr_curve=curve,
            config=self.config.to_dict(),
        )

    def _finish(self) -> RunResult:
        from ..plots import plot_pr_curves
        from .curves import plot_training_curves

        start = time.perf_counter()
        best_path = self.checkpoint_dir / "best.pt"
        final_weights = None
        if best_path.is_file():
            final_weights = {k: v.clone() for k, v in self.model.state_dict().items()}
            self.model.load_state_dict(load_checkpoint(best_path, self.device)["model"])
        try:
            test = self.evaluate("test")
            curve = self.test_pr_curve()
        finally:
            if final_weights is not None:
                self.model.load_state_dict(final_weights)
        self.seconds += time.perf_counter() - start
        result = self._result("completed", test, curve)
        self._log({"kind": "test", "step": self.step, **_summary(test)})
        atomic_write_text(
            json.dumps(result.to_dict(), indent=2) + "\n", self.run_dir / "report.json"
        )
        atomic_write_text(
            json.dumps(
                {
                    "recall": [float(v) for v in curve.recall],
                    "precision": [float(v) for v in curve.precision],
                    "n_queries": int(curve.n_queries),
                }
            )
            + "\n",
            self.run_dir / "pr_curve.json",
        )
        plot_training_curves(
            self.history,
            self.run_dir / "training_curves.png",
            title=f"{self.config.loss.name} on {self.config.dataset.name}",
        )
        plot_pr_curves(
            {self.config.loss.name: curve},
            self.run_dir / "pr_curve.png",
            title=f"test mean PR curve ({self.config.dataset.name})",
            labels={self.config.loss.name: float(test.map)},
        )
        return result


def train(
    config: Config,
    *,
    splits: Any = None,
    overwrite: bool = False,
    max_steps: int | None = None,
    callbacks: Sequence[Callback] = (),
    console: Any = None,
) -> RunResult:
    """Build a :class:`Trainer` from ``config`` and run :meth:`Trainer.fit`."""
    trainer = Trainer(config, splits=splits, overwrite=overwrite, console=console)
    return trainer.fit(max_steps=max_steps, callbacks=callbacks)
