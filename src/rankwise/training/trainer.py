"""The training loop: a Trainer for your own model, loss and data.

The training loop of the image-retrieval experiments of Wen et al., *Exploring the
Algorithm-Dependent Generalization of AUPRC Optimization with List Stability* (NeurIPS 2022),
Sec. 5.1 and App. D.1: an embedding network trained end to end with a ranking loss (SOPRC's
Alg. 1 or a competitor) on P x K mini-batches with exactly ``m`` samples per class, model selection
by validation mAUPRC (tie-aware mAP), and a final test report of the selected model (open-set:
leave-one-out on the test data; closed-set: test queries against a gallery).

:class:`Trainer` takes objects — your ``nn.Module``, a loss, a dataset — and runs that loop;
:meth:`Trainer.from_config` builds them from a YAML config (:mod:`rankwise.training.build`). The
progress bar, the ``metrics.jsonl`` log, the best-checkpoint selection, the plots and the collapse
detector are callbacks (:mod:`rankwise.training.callbacks`), so :meth:`Trainer.fit` is the loop.

The loop is resumable bit for bit: a checkpoint holds the weights, the optimizer, the loss buffers
(SOPRC's auxiliary vector ``v`` of Eq. (10)), the learning-rate scheduler, the sampler position
(epoch and batch), every RNG stream, the step counter and the callbacks' state (the best-so-far,
the logged loss window). Random data transforms draw from a generator seeded by
``(seed, epoch, batch, slot)``, so batches do not depend on where a run was interrupted nor on
``num_workers``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from .._signals import handle_signals, signal_number_of
from .._threads import preserve_torch_threads
from .._validation import Interval, check_bool, check_scalar
from .build import (
    build_loss_from_config,
    build_model_from_config,
    build_optimizer,
    build_sampler_from_config,
    check_batch_classes,
    learning_rate_at,
    load_splits,
    preflight,
    resolve_device,
    seed_everything,
    total_steps,
)
from .callbacks import (
    BestCheckpoint,
    Callback,
    CollapseDetector,
    MetricsLogger,
    PlotCurves,
    ProgressBar,
    StepCallback,
    StepOutput,
)
from .checkpoint import (
    atomic_save,
    atomic_write_text,
    capture_rng_state,
    keep_previous,
    load_checkpoint,
    restore_rng_state,
)
from .config import Config, config_from_dict, read_config_file
from .errors import (
    ConfigError,
    CorruptCheckpointError,
    DiskFullError,
    NonFiniteLossError,
    TrainingInterrupted,
)
from .loader import BatchSampler, dataset_labels, default_sampler, training_loader, worker_init
from .lock import RunDirLock, lock_run_dir
from .rundir import (
    existing_results,
    readable_checkpoint_step,
    remove_stale_temporaries,
    resolve_run_dir,
)

if TYPE_CHECKING:
    from rich.console import Console

    from ..data import RetrievalSplits
    from ..metrics import PRCurve, RetrievalReport

__all__ = [
    "LRSchedule",
    "RunResult",
    "Trainer",
    "build_optimizer",
    "learning_rate_at",
    "load_splits",
    "preflight",
    "train",
]

# a learning rate per 0-based step, or a torch scheduler stepped after every optimizer step
LRSchedule = Callable[[int], float] | torch.optim.lr_scheduler.LRScheduler
CallbackLike = Callback | Callable[["Trainer"], None]
_C = TypeVar("_C", bound=Callback)


@dataclass
class RunResult:
    """Outcome of :meth:`Trainer.fit`.

    Attributes:
        run_dir: the run directory (``None`` for a trainer without one).
        status: ``"completed"`` (budget reached, test report made) or ``"stopped"``
            (``max_steps`` reached; resume to finish).
        steps: optimizer steps taken.
        seconds: wall-clock seconds spent in this run, summed over resumptions.
        best_step: step of the best validation score (``None`` before the first evaluation).
        best_val: the best validation ``RetrievalReport`` summary (a dict).
        test: the test report of the selected model (completed runs with test data only).
        pr_curve: the test mean precision-recall curve of the selected model (idem).
        config: the run's config as a dict (empty for a trainer built from objects).
    """

    run_dir: Path | None
    status: str
    steps: int
    seconds: float
    best_step: int | None
    best_val: dict[str, Any] | None
    test: RetrievalReport | None = None
    pr_curve: PRCurve | None = None
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
            "run_dir": None if self.run_dir is None else str(self.run_dir),
        }


@contextlib.contextmanager
def _determinism(enabled: bool) -> Iterator[None]:
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


_SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


@contextlib.contextmanager
def _graceful_stop(trainer: Trainer) -> Iterator[None]:
    """Ctrl-C or SIGTERM: finish the current step, then checkpoint and stop; a second: abort now.

    SIGTERM (what ``timeout``, SLURM, Kubernetes and docker send) is handled exactly like
    Ctrl-C, so a scheduler's stop leaves ``last.pt`` at the last complete step.
    """

    def on_signal(signum: int) -> bool:
        if trainer._stop_signal is not None:
            return False  # the second signal: raise at once (the last checkpoint is kept)
        trainer._stop_signal = signum
        trainer._stop_requested = True
        saving = " and saving a checkpoint" if trainer.run_dir is not None else ""
        name = _SIGNAL_NAMES.get(signum, signal.Signals(signum).name)
        # the hint names the signal that came: a scheduler sends SIGTERM, a person Ctrl-C
        again = "Ctrl-C again" if signum == signal.SIGINT else f"another {name}"
        trainer.console.print(
            f"[yellow]{name}: stopping after this step{saving} ({again} aborts at once).[/yellow]",
            soft_wrap=True,
        )
        return True

    with handle_signals(on_signal):
        yield


def _device_of(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is None:
        first = next(iter(model.parameters()), None)
        return first.device if first is not None else torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"`device`: unknown device {device!r} (use cpu, cuda or auto).") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`device` {device!r}: no CUDA device is available on this machine.")
    return dev


def _check_dataset(data: Any, name: str, required: bool = False) -> None:
    if data is None:
        if required:
            raise ValueError(f"`{name}` is required: a map-style dataset of (x, label) items.")
        return
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise ValueError(
            f"`{name}` must be a map-style dataset (with __len__ and __getitem__ returning "
            f"(x, label)), got {type(data).__name__}."
        )
    if len(data) == 0:
        raise ValueError(f"`{name}` is empty.")
    item = data[0]  # one item, so a wrong layout fails here and not in a worker process
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise ValueError(
            f"`{name}[0]` must be an (x, label) pair, got {type(item).__name__}; wrap the data "
            "in a Dataset whose __getitem__ returns (input, class id)."
        )


def _positive_int(value: Any, name: str, low: int = 1) -> int:
    return check_scalar(value, name, Interval("integer", low, None))


class Trainer:
    """Train an embedding model with a ranking loss; select it on validation, test it.

    The loop of :meth:`fit`: P x K batches from ``sampler``; per step ``model(x)`` ->
    ``loss_fn(embeddings, labels)`` -> ``optimizer.step()`` (:meth:`train_step`); every
    ``eval_every`` steps (and at the end) the validation data is ranked leave-one-out with the
    exact tie-aware metrics of :func:`rankwise.metrics.retrieval_metrics`, the best model by
    validation mAP is kept, and a checkpoint is written; at the end the selected model is tested.

    What the data must provide: ``train_data`` (and ``val_data`` / ``test_data`` /
    ``gallery_data``) are map-style datasets whose ``dataset[i]`` returns ``(x, label)`` with an
    integer class id; a batch of ``x`` goes through ``model`` as is. The default sampler reads
    the class ids without loading items, from a ``labels`` attribute ((N,) ints; every
    :mod:`rankwise.data` dataset has one) or from ``TensorDataset(inputs, labels)``; with your
    own ``sampler`` that attribute is not needed for training. A dataset with a ``transform``
    attribute that is ``None`` is read without per-item RNG seeding (nothing random happens).

    Args:
        model: the embedding network, ``(B, ...) -> (B, d)``; moved to ``device``.
        loss_fn: the loss, an ``nn.Module`` called as ``loss_fn(embeddings, labels)`` (every
            :mod:`rankwise.losses` loss); its buffers are checkpointed. Moved to ``device``.
        train_data: the training data.
        optimizer: default ``torch.optim.Adam(lr=1e-3)`` over the trainable parameters of
            ``model`` and ``loss_fn``.
        sampler: a batch sampler (an iterable of index lists with a length; ``set_epoch`` makes
            resumption exact). Default: :class:`~rankwise.sampling.MPerClassBatchSampler` with
            ``m=4`` samples per class and ``min(32, 4 x classes)`` samples, seeded by ``seed``.
        val_data: validation data, ranked leave-one-out; it selects the model (``None``: the
            final model is tested).
        test_data: test queries; ranked leave-one-out (open-set), or against ``gallery_data``
            (closed-set). ``None``: no test report.
        gallery_data: the gallery (database) of a closed-set test.
        run_dir: where checkpoints, ``metrics.jsonl``, ``report.json`` and plots go. ``None``
            writes no file at all: the history, the best model and the result stay in memory,
            and a run cannot be resumed. The trainer locks it against other processes
            (:mod:`rankwise.training.lock`) from its construction, before anything in it is
            read, to the end of :meth:`fit`; a second :meth:`fit` takes it back, refusing it
            when another process wrote a checkpoint there meanwhile.
        callbacks: :class:`~rankwise.training.callbacks.Callback` objects or plain functions
            ``fn(trainer)`` (called after every complete step). A callback of the type of a
            default one (``ProgressBar``, ``MetricsLogger``, ``BestCheckpoint``,
            ``CollapseDetector``, ``PlotCurves``) replaces that default.
        iterations: the budget in optimizer steps; or
        epochs: the budget in passes of the sampler (default 1 when neither is given).
        lr_schedule: a function ``step -> learning rate`` (0-based step; the rate is set on
            every parameter group before the step) or a torch ``LRScheduler`` (stepped after
            every optimizer step; its state is checkpointed). ``None`` keeps the optimizer's.
        eval_every: steps between evaluations and checkpoints (default: once per epoch).
        log_every: steps between training records in the history.
        eval_ks: cut-offs of recall@k / precision@k in the reports.
        eval_batch_size: batch size when embedding evaluation data.
        metric_fn: the evaluation, called as ``metric_fn(query, query_labels, gallery,
            gallery_labels, ks=eval_ks)`` (``gallery`` ``None`` for leave-one-out); default
            :func:`rankwise.metrics.retrieval_metrics` (cosine, tie-aware). Its report needs the
            attribute the selection monitors (``map``) and ``to_dict()``; e.g.
            ``functools.partial(retrieval_metrics, similarity="dot")``.
        curve_fn: the test curve, called like ``metric_fn`` without ``ks``; default
            :func:`rankwise.metrics.pr_curve`.
        device: ``"cpu"``, ``"cuda"``, ``"auto"`` or a ``torch.device``; default: where the
            model's parameters are.
        seed: seeds the default sampler, the per-item transform seeds and the data loaders.
            Seed your model's initialisation yourself (``torch.manual_seed`` before building it).
        num_workers: DataLoader worker processes (batches do not depend on it).
        deterministic: deterministic algorithms (warn-only) and cuDNN during training.
        progress: show a progress bar (``None``: only when stdout is a terminal).
        detect_collapse: stop when every score ties (:class:`CollapseDetector`).
        resume: continue from ``run_dir/checkpoints/last.pt``; build the same objects first.
        resume_from: with ``resume``, the checkpoint file to continue from instead of
            ``last.pt`` (e.g. ``checkpoints/previous.pt`` when ``last.pt`` is corrupt).
        overwrite: start afresh in a ``run_dir`` that already holds a run (its results are
            deleted when :meth:`fit` starts).
        console: a rich console for messages and the progress bar (default: stderr).
        name: the run's name on the progress bar and plots (default: the loss's).
        config: the :class:`Config` the objects were built from (set by :meth:`from_config`):
            written to ``run_dir/config.yaml`` and into checkpoints, and used in messages.

    Raises:
        ValueError: a bad argument, named (a :class:`ConfigError` for a ``run_dir`` that
            already holds a run, or a checkpoint that cannot be resumed; a
            :class:`~rankwise.training.lock.RunDirInUseError` for one another process is
            writing).
    """

    CHECKPOINT_FORMAT = 2

    def __init__(
        self,
        model: nn.Module,
        loss_fn: nn.Module,
        train_data: Dataset,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: BatchSampler | None = None,
        val_data: Dataset | None = None,
        test_data: Dataset | None = None,
        gallery_data: Dataset | None = None,
        run_dir: str | Path | None = None,
        callbacks: Sequence[CallbackLike] = (),
        iterations: int | None = None,
        epochs: int | None = None,
        lr_schedule: LRSchedule | None = None,
        eval_every: int | None = None,
        log_every: int = 10,
        eval_ks: Sequence[int] = (1, 10, 100),
        eval_batch_size: int = 256,
        metric_fn: Callable[..., RetrievalReport] | None = None,
        curve_fn: Callable[..., PRCurve] | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
        num_workers: int = 0,
        deterministic: bool = True,
        progress: bool | None = None,
        detect_collapse: bool = True,
        resume: bool = False,
        overwrite: bool = False,
        console: Console | None = None,
        name: str | None = None,
        config: Config | None = None,
        resume_from: str | Path | None = None,
    ) -> None:
        if isinstance(model, Config):
            raise TypeError(
                "Trainer(config) became Trainer.from_config(config); Trainer() takes the model, "
                "the loss and the training data."
            )
        self._check_modules(model, loss_fn)
        _check_dataset(train_data, "train_data", required=True)
        for data, data_name in ((val_data, "val_data"), (test_data, "test_data")):
            _check_dataset(data, data_name)
        _check_dataset(gallery_data, "gallery_data")
        if gallery_data is not None and test_data is None:
            raise ValueError("`gallery_data` is the gallery of a test: pass `test_data` too.")
        self.config = config
        self.model = model
        self.loss_fn = loss_fn
        self.train_data = train_data
        self.val_data = val_data
        self.test_data = test_data
        self.gallery_data = gallery_data
        self.seed = _positive_int(seed, "seed", 0)
        self.num_workers = _positive_int(num_workers, "num_workers", 0)
        self.eval_batch_size = _positive_int(eval_batch_size, "eval_batch_size")
        from ..metrics import pr_curve, retrieval_metrics
        from ..metrics._inputs import check_ks

        self.eval_ks = tuple(sorted(check_ks(eval_ks, "eval_ks")))
        self.deterministic = check_bool(deterministic, "deterministic")

        for fn, fn_name in ((metric_fn, "metric_fn"), (curve_fn, "curve_fn")):
            if fn is not None and not callable(fn):
                raise ValueError(f"`{fn_name}` must be a function, got {type(fn).__name__}.")
        self.metric_fn = metric_fn if metric_fn is not None else retrieval_metrics
        self.curve_fn = curve_fn if curve_fn is not None else pr_curve
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.checkpoint_dir = (
            self.run_dir / "checkpoints" if self.run_dir is not None else Path("checkpoints")
        )
        resume, overwrite = check_bool(resume, "resume"), check_bool(overwrite, "overwrite")
        self._check_run_options(resume, overwrite, resume_from)
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        self.console = console

        self.device = _device_of(model, device)
        if self.device.type == "cuda" and self.deterministic:
            # cuBLAS reads this once, at its first use: it must be set before any CUDA matmul
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.model.to(self.device)
        self.loss_fn.to(self.device)
        self.optimizer = optimizer if optimizer is not None else self._default_optimizer()
        self.sampler = sampler if sampler is not None else self._default_sampler()
        self.steps_per_epoch = len(self.sampler)
        if self.steps_per_epoch <= 0:
            raise ValueError("`sampler` yields no batch per epoch.")
        self.total_steps = self._budget(iterations, epochs)
        self.eval_every = (
            self.steps_per_epoch if eval_every is None else _positive_int(eval_every, "eval_every")
        )
        self.lr_schedule = lr_schedule
        self._lr_function = self._check_schedule(lr_schedule)
        self.name = name or self.loss_name

        # -- progress state (checkpointed) ---------------------------------------------------
        self.step = 0
        self.next_epoch = 0
        self.next_position = 0
        self.seconds = 0.0
        self.last_checkpoint_step: int | None = None
        self._stop_requested = False
        self._stop_signal: int | None = None
        self._in_step = False
        # whether checkpoints/last.pt is known good (written or loaded by this trainer): only
        # then is it kept as previous.pt when the next checkpoint replaces it
        self._last_is_good = False
        self._tick = time.perf_counter()
        self.callbacks = self._default_callbacks(
            _positive_int(log_every, "log_every"),
            None if progress is None else check_bool(progress, "progress"),
            check_bool(detect_collapse, "detect_collapse"),
        )
        for callback in callbacks:
            self._add_callback(self._as_callback(callback))
        self._active: list[Callback] = list(self.callbacks)
        # the name the caller gave the run directory, for messages (a config's output_dir)
        self._run_dir_key = "output_dir" if config is not None and not resume else "run_dir"
        self._run_lock: RunDirLock | None = None
        self._holds_run_dir = False
        self._left_checkpoint: tuple[int, int, int] | None = None
        self._completed = False
        self._open_run_dir(resume, overwrite, None if resume_from is None else Path(resume_from))

    # -- construction -----------------------------------------------------------------------

    @staticmethod
    def _check_modules(model: Any, loss_fn: Any) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"`model` must be a torch.nn.Module, got {type(model).__name__}.")
        if not isinstance(loss_fn, nn.Module):
            raise ValueError(
                f"`loss_fn` must be a torch.nn.Module called as loss_fn(embeddings, labels) "
                f"(every rankwise.losses loss is one), got {type(loss_fn).__name__}."
            )

    def _check_run_options(
        self, resume: bool, overwrite: bool, resume_from: str | Path | None = None
    ) -> None:
        if resume_from is not None and not resume:
            raise ValueError("`resume_from` names the checkpoint to resume: pass `resume` too.")
        if resume and self.run_dir is None:
            raise ValueError("`resume` needs the `run_dir` of the run to continue.")
        if resume and overwrite:
            raise ValueError(
                "pass `resume` or `overwrite`, not both: `resume` continues the run, "
                "`overwrite` deletes its results and starts afresh."
            )

    # -- the run directory's lock (one writer per folder, see rankwise.training.lock) ----------

    @classmethod
    def _lock_run_dir(
        cls,
        run_dir: Path,
        key: str,
        *,
        resume: bool = False,
        check: Callable[[], None] | None = None,
        group: Any = None,
    ) -> RunDirLock:
        """Take the lock of ``run_dir``, then run ``check`` (a refusal releases it again).

        Args:
            run_dir: the run directory.
            key: the argument or config key that named it, for the messages.
            resume: the caller continues the run there.
            check: what must hold once the folder is locked (e.g. no results in it).
            group: the process group of a data-parallel trainer (unused here).

        Returns:
            The hold of the lock.
        """
        lock = lock_run_dir(run_dir, key, then="resume it" if resume else None)
        if check is not None:
            try:
                check()
            except BaseException:
                lock.release()
                raise
        return lock

    def _take_run_dir(self, *, resume: bool, check: Callable[[], None] | None = None) -> None:
        assert self.run_dir is not None
        self._run_lock = self._lock_run_dir(
            self.run_dir,
            self._run_dir_key,
            resume=resume,
            check=check,
            group=getattr(self, "group", None),  # a DistributedTrainer's process group
        )
        self._holds_run_dir = True

    def _release_run_dir(self) -> None:
        if self._run_lock is not None:
            # what this trainer leaves behind; taken back, the folder must still hold it
            self._left_checkpoint = self._checkpoint_fingerprint()
            self._run_lock.release()
        self._run_lock, self._holds_run_dir = None, False

    def _checkpoint_fingerprint(self) -> tuple[int, int, int] | None:
        """Identity of ``checkpoints/last.pt`` (every save replaces the file: a new inode)."""
        try:
            info = (self.checkpoint_dir / "last.pt").stat()
        except FileNotFoundError:
            return None
        return info.st_ino, info.st_mtime_ns, info.st_size

    def _check_unchanged(self) -> None:
        """The run directory taken back by :meth:`fit` is as this trainer left it."""
        if self._checkpoint_fingerprint() != self._left_checkpoint:
            raise ConfigError(
                f"{self._run_dir_key}: {str(self.run_dir)!r} was written by another process "
                "since this trainer last trained in it (its checkpoints/last.pt changed); build "
                "a new trainer to continue from what it holds (`resume`)."
            )

    def _open_run_dir(self, resume: bool, overwrite: bool, resume_from: Path | None) -> None:
        """Lock the run directory, then apply the results rule or load the state to resume."""
        if self.run_dir is None:
            return
        self._take_run_dir(resume=resume)
        try:
            if resume:
                self._load_last(resume_from)
            elif not overwrite:
                _refuse_results(self.run_dir, self._run_dir_key)
        except BaseException:
            self._release_run_dir()
            raise
        self._left_checkpoint = self._checkpoint_fingerprint()

    @staticmethod
    def _check_schedule(schedule: LRSchedule | None) -> Callable[[int], float] | None:
        """The per-step learning-rate function of ``schedule`` (``None``: a scheduler, or none)."""
        if schedule is None or isinstance(schedule, torch.optim.lr_scheduler.LRScheduler):
            return None
        if not callable(schedule):
            raise ValueError(
                "`lr_schedule` must be a function step -> learning rate or a torch LRScheduler, "
                f"got {type(schedule).__name__}."
            )
        return schedule

    def _default_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        params += [p for p in self.loss_fn.parameters() if p.requires_grad]
        if not params:
            raise ValueError("`model` has no trainable parameter (requires_grad) to optimize.")
        return torch.optim.Adam(params, lr=1e-3)

    def _default_sampler(self) -> BatchSampler:
        return default_sampler(dataset_labels(self.train_data, "train_data"), self.seed)

    def _budget(self, iterations: int | None, epochs: int | None) -> int:
        if iterations is not None and epochs is not None:
            raise ValueError("pass `iterations` or `epochs`, not both.")
        if iterations is not None:
            return _positive_int(iterations, "iterations")
        return _positive_int(1 if epochs is None else epochs, "epochs") * self.steps_per_epoch

    def _default_callbacks(
        self, log_every: int, progress: bool | None, detect_collapse: bool
    ) -> list[Callback]:
        callbacks: list[Callback] = []
        if detect_collapse:  # first: a collapsed validation split is neither logged nor kept
            callbacks.append(CollapseDetector())
        callbacks += [
            MetricsLogger(log_every),
            BestCheckpoint(),
            ProgressBar(progress, log_every),
            PlotCurves(),
        ]
        return callbacks

    @staticmethod
    def _as_callback(callback: CallbackLike) -> Callback:
        if isinstance(callback, Callback):
            return callback
        if callable(callback):
            return StepCallback(callback)
        raise ValueError(
            f"`callbacks` must hold Callback objects or functions fn(trainer), got "
            f"{type(callback).__name__}."
        )

    def _add_callback(self, callback: Callback) -> None:
        for i, existing in enumerate(self.callbacks):
            if type(existing) is not StepCallback and isinstance(callback, type(existing)):
                self.callbacks[i] = callback  # a user's ProgressBar replaces the default one
                return
        self.callbacks.append(callback)

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        splits: RetrievalSplits | None = None,
        resume: bool = False,
        overwrite: bool = False,
        console: Console | None = None,
        callbacks: Sequence[CallbackLike] = (),
        resume_from: str | Path | None = None,
    ) -> Trainer:
        """Build the data, model, loss, sampler, optimizer and schedule of ``config``.

        All configuration errors that need the data (unknown loss parameter, more classes per
        batch than the training split has, missing dataset files, milestones past the budget)
        are raised as :class:`ConfigError` naming the key, before any training step.

        Args:
            config: the validated run configuration.
            splits: pre-loaded :class:`~rankwise.data.RetrievalSplits` (a sweep reuses one
                load for every run); by default :func:`rankwise.data.load_dataset` is called.
            resume: continue from ``<output_dir>/checkpoints/last.pt`` (see
                :meth:`from_run_dir`).
            overwrite: start afresh in an output directory that already holds a run.
            console: rich console for messages (default: stderr).
            callbacks: extra callbacks (see :class:`Trainer`).
            resume_from: with ``resume``, the checkpoint to continue from instead of
                ``last.pt``.

        Returns:
            The trainer, its ``run_dir`` the config's output directory.

        Raises:
            RunDirInUseError: another process is writing the output directory (checked before
                anything in it is read and before the data is loaded).
        """
        run_dir = config.resolved_output_dir()
        # the folder is locked before it is looked at, and refused before the data is loaded
        refuse = None if resume or overwrite else partial(_refuse_results, run_dir, "output_dir")
        key = "run_dir" if resume else "output_dir"
        with cls._lock_run_dir(run_dir, key, resume=resume, check=refuse):
            return cls._build_from_config(
                config,
                run_dir,
                splits=splits,
                resume=resume,
                overwrite=overwrite,
                console=console,
                callbacks=callbacks,
                resume_from=resume_from,
            )

    @classmethod
    def _build_from_config(
        cls,
        config: Config,
        run_dir: Path,
        *,
        splits: RetrievalSplits | None,
        resume: bool,
        overwrite: bool,
        console: Console | None,
        callbacks: Sequence[CallbackLike],
        resume_from: str | Path | None,
    ) -> Trainer:
        device = resolve_device(config.device)
        if device.type == "cuda" and config.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        # data, then every data-dependent check before anything is built
        splits = splits if splits is not None else load_splits(config)
        train_labels, n_classes = check_batch_classes(config, splits)
        # model, loss, sampler, optimizer (seeded: the same seed gives the same init)
        seed_everything(config.seed)
        model = build_model_from_config(config, splits.train.input_shape)
        loss_fn = build_loss_from_config(config, train_labels, n_classes)
        sampler = build_sampler_from_config(config, train_labels)
        steps = total_steps(config, len(sampler))
        params = [p for p in model.parameters() if p.requires_grad]
        params += [p for p in loss_fn.parameters() if p.requires_grad]
        name = f"{config.loss.name} on {config.dataset.name}"
        plots = PlotCurves(
            title=name,
            pr_title=f"test mean PR curve ({config.dataset.name})",
            label=config.loss.name,
        )
        return cls(
            model,
            loss_fn,
            splits.train,
            optimizer=build_optimizer(config.optimizer, params, getattr(model, "backbone", None)),
            sampler=sampler,
            val_data=splits.val,
            test_data=splits.test,
            gallery_data=splits.gallery,
            run_dir=run_dir,
            callbacks=[plots, *callbacks],
            iterations=steps,
            lr_schedule=partial(learning_rate_at, config, total_steps=steps),
            eval_every=config.eval_every,
            log_every=config.log_every,
            eval_ks=config.eval_ks,
            eval_batch_size=config.eval_batch_size,
            device=device,
            seed=config.seed,
            num_workers=config.num_workers,
            deterministic=config.deterministic,
            progress=config.progress,
            resume=resume,
            overwrite=overwrite,
            console=console,
            name=name,
            config=config,
            resume_from=resume_from,
        )

    @classmethod
    def from_run_dir(
        cls,
        run_dir: str | Path,
        *,
        num_workers: int | None = None,
        device: str | None = None,
        console: Console | None = None,
        checkpoint: str | Path | None = None,
    ) -> Trainer:
        """Trainer that resumes the config run in ``run_dir``.

        It reads the run's ``config.yaml`` and ``checkpoints/last.pt``.

        Args:
            run_dir: the run directory of a :meth:`from_config` run, or a folder holding
                exactly one (e.g. ``runs/digits`` for ``runs/digits/auc-seed0``; several are
                listed in the error).
            num_workers: may change freely (batches do not depend on it).
            device: may change too, but then results are no longer bit-identical to an
                uninterrupted run.
            console: rich console for messages.
            checkpoint: the checkpoint file to continue from instead of ``last.pt`` (e.g.
                ``checkpoints/previous.pt``, kept when ``last.pt`` is replaced).

        Returns:
            The trainer, at the step of the checkpoint.
        """
        run_dir = resolve_run_dir(run_dir)
        with cls._lock_run_dir(run_dir, "run_dir", resume=True):  # before config.yaml is read
            data = read_config_file(run_dir / "config.yaml")
            data["output_dir"] = str(run_dir)
            if num_workers is not None:
                data["num_workers"] = num_workers
            if device is not None:
                data["device"] = device
            if checkpoint is None and not (run_dir / "checkpoints" / "last.pt").is_file():
                raise CorruptCheckpointError(
                    run_dir / "checkpoints" / "last.pt", "it is missing"
                ).with_context(run_dir=run_dir, **_fallback(run_dir))
            return cls.from_config(
                config_from_dict(data), resume=True, console=console, resume_from=checkpoint
            )

    # -- names and messages -----------------------------------------------------------------

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes the run directory and prints (rank 0 of a data-parallel run)."""
        return True

    @property
    def world_size(self) -> int:
        """The number of data-parallel processes training the model (1 here)."""
        return 1

    @property
    def completed(self) -> bool:
        """Whether the last :meth:`fit` completed the run (its report is written or being written).

        From then on an interruption loses nothing: ``report.json`` says ``"completed"``.
        """
        return self._completed

    @property
    def loss_name(self) -> str:
        """The loss's name: its config name, or its class name."""
        if self.config is not None:
            return self.config.loss.name
        return type(self.loss_fn).__name__

    @property
    def last_good_checkpoint(self) -> Path | None:
        """``checkpoints/last.pt`` once a checkpoint was written in this run, else ``None``."""
        if self.run_dir is None or self.last_checkpoint_step is None:
            return None
        return self.checkpoint_dir / "last.pt"

    def kept_checkpoint_message(self) -> str:
        """What survives a failure now: ``"the last good checkpoint (...) is kept"`` or why not.

        Returns:
            A clause for error messages.
        """
        if self.run_dir is None:
            return "nothing was saved (the trainer has no run_dir)"
        if self.last_checkpoint_step is None:
            return "no checkpoint had been written yet"
        return (
            f"the last good checkpoint ({self.checkpoint_dir / 'last.pt'}, step "
            f"{self.last_checkpoint_step}) is kept"
        )

    def _callback(self, kind: type[_C]) -> _C | None:
        return next((c for c in self._active if isinstance(c, kind)), None)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The records of the run so far (train, val, test, error), as in ``metrics.jsonl``."""
        logger = self._callback(MetricsLogger)
        return logger.records if logger is not None else []

    @property
    def best_step(self) -> int | None:
        """Step of the best validation score so far."""
        best = self._callback(BestCheckpoint)
        return None if best is None else best.best_step

    @property
    def best_val(self) -> dict[str, Any] | None:
        """Validation report summary of the best step so far."""
        best = self._callback(BestCheckpoint)
        return None if best is None else best.best_val

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The complete state after ``self.step`` (what ``checkpoints/last.pt`` holds)."""
        scheduler = self.lr_schedule
        return {
            "format": self.CHECKPOINT_FORMAT,
            "config": None if self.config is None else self.config.to_dict(),
            "world_size": self.world_size,
            "step": self.step,
            "next_epoch": self.next_epoch,
            "next_position": self.next_position,
            "seconds": self.seconds,
            "model": self.model.state_dict(),
            "loss": self.loss_fn.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict()
            if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
            else None,
            "sampler": {"epoch": self.next_epoch, "position": self.next_position},
            "rng": capture_rng_state(),
            "callbacks": {
                c.state_key: c.state_dict() for c in self._active if c.state_key is not None
            },
        }

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/last.pt`` atomically with the complete state after ``self.step``.

        Returns:
            The checkpoint's path.

        Raises:
            DiskFullError: no space left for it; the earlier checkpoints are intact.
        """
        if self.run_dir is None:
            raise ValueError("the trainer has no `run_dir` to write a checkpoint to.")
        self._account_time()
        path = self.checkpoint_dir / "last.pt"
        state = self.state_dict()
        if self.is_main_process:
            with self._naming_what_is_kept():
                if self._last_is_good:
                    # an older good checkpoint survives whatever happens to the new one
                    keep_previous(path, self.checkpoint_dir / "previous.pt")
                atomic_save(state, path)
        self.last_checkpoint_step = self.step
        self._last_is_good = True
        return path

    @contextlib.contextmanager
    def _naming_what_is_kept(self) -> Iterator[None]:
        """A full disk inside the block: say which run it is and which checkpoint is kept."""
        try:
            yield
        except DiskFullError as exc:
            raise exc.with_context(
                run_dir=self.run_dir,
                kept=self.kept_checkpoint_message(),
                resumable=self.last_checkpoint_step is not None,
            ) from None

    def _read_checkpoint(self, path: Path | None) -> dict[str, Any]:
        """The checkpoint to resume; a corrupt one names an older one that loads, if any."""
        last = self.checkpoint_dir / "last.pt"
        target = last if path is None else path
        try:
            state = load_checkpoint(target, map_location=self.device)
        except CorruptCheckpointError as exc:
            fallback = _fallback(self.run_dir, exclude=target) if self.run_dir else {}
            raise exc.with_context(run_dir=self.run_dir, **fallback) from None
        except FileNotFoundError:
            raise ConfigError(f"run_dir: checkpoint {str(target)!r} does not exist.") from None
        self._last_is_good = target == last
        return state

    def _check_best(self) -> None:
        """A resumed run's ``best.pt`` must load: the final test evaluates it."""
        best = next((c for c in self.callbacks if isinstance(c, BestCheckpoint)), None)
        path = self.checkpoint_dir / "best.pt"
        if best is None or best.best_step is None or self.run_dir is None:
            return
        try:
            load_checkpoint(path, map_location="cpu")
        except FileNotFoundError:
            reason = "it is missing"
        except CorruptCheckpointError as exc:
            reason = exc.reason
        else:
            return
        retrain = (
            f"rankwise train --config {self.run_dir / 'config.yaml'} --output {self.run_dir} "
            "--overwrite"
            if self.config is not None
            else "the same Trainer with overwrite=True"
        )
        raise CorruptCheckpointError(
            path,
            reason,
            run_dir=self.run_dir,
            advice=(
                f"It held the model selected on validation (step {best.best_step}), which the "
                f"final test evaluates; no other copy exists. Train the run again: {retrain}."
            ),
        )

    def _load_last(self, path: Path | None = None) -> None:
        state = self._read_checkpoint(path)
        fmt = state.get("format")
        if fmt not in (1, self.CHECKPOINT_FORMAT):
            raise ConfigError(f"run_dir: unsupported checkpoint format {fmt!r}.")
        saved_world = int(state.get("world_size", 1))
        if saved_world != self.world_size:
            raise ConfigError(
                f"run_dir: the checkpoint was written by a run of {saved_world} data-parallel "
                f"process(es) and this run has {self.world_size}; each process's batches and "
                f"random streams depend on that number, so resume with {saved_world} process(es)"
                + (
                    f" (torchrun --nproc-per-node {saved_world} ...)."
                    if saved_world > 1
                    else " (plain `rankwise train --resume`, without torchrun)."
                )
            )
        self.model.load_state_dict(state["model"])
        self.loss_fn.load_state_dict(state["loss"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state.get("lr_scheduler") is not None:
            if not isinstance(self.lr_schedule, torch.optim.lr_scheduler.LRScheduler):
                raise ValueError(
                    "the checkpoint holds a learning-rate scheduler: pass the same `lr_schedule`."
                )
            self.lr_schedule.load_state_dict(state["lr_scheduler"])
        self.step = int(state["step"])
        self.next_epoch = int(state["next_epoch"])
        self.next_position = int(state["next_position"])
        self.seconds = float(state["seconds"])
        self.last_checkpoint_step = self.step
        self._restore_rng(state)
        states = state.get("callbacks", {}) if fmt != 1 else _format1_callback_states(state)
        for callback in self.callbacks:
            if callback.state_key is not None and callback.state_key in states:
                callback.load_state_dict(states[callback.state_key])
        self._check_best()

    def _restore_rng(self, state: dict[str, Any]) -> None:
        restore_rng_state(state["rng"])

    def _prepare_run_dir(self) -> None:
        if self.run_dir is None or not self.is_main_process:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.run_dir)  # of writes a killed run never finished
        if self.config is not None:
            import yaml

            atomic_write_text(
                yaml.safe_dump(self.config.to_dict(), sort_keys=False),
                self.run_dir / "config.yaml",
            )
        if self.step == 0:
            # a fresh run (possibly overwriting one): drop the previous run's checkpoints and
            # outputs, so a crash before the first checkpoint cannot leave them to a resume
            for stale in (
                "checkpoints/last.pt",
                "checkpoints/previous.pt",
                "checkpoints/best.pt",
                "report.json",
            ):
                (self.run_dir / stale).unlink(missing_ok=True)
            for stale in ("pr_curve.json", "pr_curve.png", "training_curves.png"):
                (self.run_dir / stale).unlink(missing_ok=True)

    # -- evaluation -------------------------------------------------------------------------

    def embed(self, dataset: Dataset) -> tuple[torch.Tensor, np.ndarray]:
        """Embeddings ``(N, d)`` (on the trainer's device) and ``(N,)`` int64 labels of a dataset.

        Streams the dataset in batches of ``eval_batch_size`` under ``torch.no_grad()`` in eval
        mode and restores the previous mode afterwards.

        Args:
            dataset: a map-style dataset of ``(x, label)`` items.

        Returns:
            ``(embeddings, labels)``.
        """
        loader = DataLoader(
            dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            worker_init_fn=worker_init,
            generator=torch.Generator().manual_seed(self.seed),
            pin_memory=self.device.type == "cuda",
        )
        was_training = self.model.training
        self.model.eval()
        chunks, labels = [], []
        try:
            with torch.no_grad():
                for x, y in loader:
                    chunks.append(self.model(x.to(self.device, non_blocking=True)))
                    labels.append(torch.as_tensor(y).reshape(-1))
        finally:
            self.model.train(was_training)
        return torch.cat(chunks), torch.cat(labels).numpy().astype(np.int64, copy=False)

    def _data(self, split: str) -> Dataset:
        data = {"val": self.val_data, "test": self.test_data}.get(split)
        if split not in ("val", "test"):
            raise ValueError(f"`split` must be 'val' or 'test', got {split!r}.")
        if data is None:
            raise ValueError(f"the trainer has no {split!r} data (pass `{split}_data`).")
        return data

    def _rank(
        self, split: str, with_curve: bool = False
    ) -> tuple[RetrievalReport, torch.Tensor, PRCurve | None]:
        query, query_labels = self.embed(self._data(split))
        gallery: tuple[torch.Tensor, np.ndarray] | tuple[None, None] = (None, None)
        if split == "test" and self.gallery_data is not None:
            gallery = self.embed(self.gallery_data)
        report = self.metric_fn(query, query_labels, *gallery, ks=self.eval_ks)
        curve = self.curve_fn(query, query_labels, *gallery) if with_curve else None
        return report, query, curve

    def evaluate(self, split: str = "val") -> RetrievalReport:
        """The exact retrieval report of the current model on the ``"val"`` or ``"test"`` data.

        Validation data is ranked leave-one-out; test data leave-one-out too, or against
        ``gallery_data`` when there is one.

        Args:
            split: ``"val"`` or ``"test"``.

        Returns:
            A :class:`~rankwise.metrics.RetrievalReport`.
        """
        with preserve_torch_threads():
            return self._rank(split)[0]

    def test(self) -> tuple[RetrievalReport, PRCurve]:
        """Test report and mean precision-recall curve of the current model (one embedding pass).

        Returns:
            ``(report, curve)``.
        """
        with preserve_torch_threads():
            report, _, curve = self._rank("test", with_curve=True)
        assert curve is not None
        return report, curve

    def _validate_and_checkpoint(self) -> None:
        if self.val_data is not None:
            with preserve_torch_threads():
                report, embeddings, _ = self._rank("val")
            with self._naming_what_is_kept():  # best.pt
                self._emit("on_validation_end", report, embeddings)
        if self.run_dir is not None:
            self.save_checkpoint()

    # -- training ---------------------------------------------------------------------------

    def _emit(self, hook: str, *args: Any) -> None:
        for callback in self._active:
            getattr(callback, hook)(self, *args)

    def _account_time(self) -> None:
        now = time.perf_counter()
        self.seconds += now - self._tick
        self._tick = now

    def learning_rate(self, step: int) -> float:
        """The learning rate of the 0-based ``step`` (of the first parameter group).

        Args:
            step: 0-based index of the optimizer step.

        Returns:
            The rate ``lr_schedule`` gives (or the optimizer's current one).
        """
        if self._lr_function is not None:
            return float(self._lr_function(step))
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the batch ``(x, y)`` at the learning rate of ``self.step``.

        Forward pass, the checks of a healthy model (finite embeddings; the callbacks'
        ``on_train_batch``, e.g. the collapse detector), the loss, its check, backward and the
        optimizer (and scheduler) step. A failed check raises before anything is applied.

        Args:
            x: a batch of inputs (moved to the trainer's device).
            y: its (B,) class ids.

        Returns:
            The batch's loss, detached.
        """
        if self._lr_function is not None:
            lr = self._lr_function(self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)  # build_optimizer's backbone group
        embeddings, labels = self._forward(x, y)
        if not bool(torch.isfinite(embeddings).all()):
            # a diverged model: stop like a non-finite loss (the loss would only reject its
            # input), keeping the last good checkpoint
            self._raise_non_finite(None)
        self._emit("on_train_batch", embeddings, labels)
        loss = self.loss_fn(embeddings, labels)
        if not torch.isfinite(loss):
            self._raise_non_finite(loss)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        if isinstance(self.lr_schedule, torch.optim.lr_scheduler.LRScheduler):
            self.lr_schedule.step()
        return loss.detach()

    def _forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings and labels the loss of a training batch sees (on the device).

        The data-parallel trainer (:mod:`rankwise.training.distributed`) overrides it to
        all-gather the batch of every rank.
        """
        embeddings = self.model(x.to(self.device, non_blocking=True))
        return embeddings, y.to(self.device, non_blocking=True)

    def _advance(self, meta: torch.Tensor) -> tuple[int, int]:
        epoch, position = int(meta[0, 0]), int(meta[0, 1])
        if position + 1 >= self.steps_per_epoch:
            self.next_epoch, self.next_position = epoch + 1, 0
        else:
            self.next_epoch, self.next_position = epoch, position + 1
        return epoch, position

    def _run_step(self, batches: Iterator[Any]) -> None:
        self._in_step = True
        x, y, meta = next(batches)
        lr = self.learning_rate(self.step)
        loss = self.train_step(x, y)
        self.step += 1
        epoch, position = self._advance(meta)
        output = StepOutput(self.step, epoch, position, float(loss), lr, int(y.shape[0]))
        self._emit("on_train_step_end", output)
        if self.step % self.eval_every == 0 or self.step == self.total_steps:
            self._validate_and_checkpoint()
        # the step, its records and its evaluation are complete: a safe stop point
        self._in_step = False
        self._emit("on_step_end")
        if self._stop_requested:
            raise KeyboardInterrupt

    def fit(
        self,
        *,
        max_steps: int | None = None,
        callbacks: Sequence[CallbackLike] = (),
        test: bool = True,
    ) -> RunResult:
        """Train to the budget (or to ``max_steps``), then test the selected model.

        Args:
            max_steps: stop after this many total steps (with a checkpoint when there is a
                ``run_dir``; ``status="stopped"``); resuming later continues exactly there.
            callbacks: extra callbacks for this call only (see :class:`Trainer`).
            test: test the selected model at the end (``False``: no test report; tuning on
                validation data never reads test data).

        Returns:
            The :class:`RunResult`.

        Raises:
            TrainingInterrupted: Ctrl-C or SIGTERM; ``last.pt`` holds the state after the last
                full step.
            NonFiniteLossError: the loss or the model became NaN/inf, or the model collapsed
                (:class:`~rankwise.training.errors.CollapsedEmbeddingsError`); the last good
                checkpoint is kept.
        """
        if max_steps is not None:
            max_steps = _positive_int(max_steps, "max_steps", 0)
        self._active = self.callbacks + [self._as_callback(c) for c in callbacks]
        if self.run_dir is not None and not self._holds_run_dir:
            # a second fit: the folder was released at the end of the first one
            self._take_run_dir(resume=True, check=self._check_unchanged)
        try:
            return self._fit(max_steps, test)
        finally:
            self._release_run_dir()

    def _fit(self, max_steps: int | None, test: bool) -> RunResult:
        self._completed = False
        self._prepare_run_dir()
        self._stop_requested = False
        self._stop_signal = None
        self._tick = time.perf_counter()
        self._emit("on_fit_start")
        with _determinism(self.deterministic), _graceful_stop(self):
            self.model.train()
            self.loss_fn.train()  # a stateful loss (SOPRC's v, XBM's memory) updates in training
            batches = iter(self._loader())
            try:
                while self.step < self.total_steps and (max_steps is None or self.step < max_steps):
                    self._run_step(batches)
            except KeyboardInterrupt as exc:
                signum = signal_number_of(exc, self._stop_signal or signal.SIGINT)
                raise self._interrupted(signum) from None
            except NonFiniteLossError as exc:
                self._emit("on_failure", exc)
                raise
            finally:
                self._account_time()
                del batches  # shuts DataLoader workers down
                self._emit("on_train_end")

        if self.step < self.total_steps:  # max_steps reached
            if self.run_dir is not None and self.last_checkpoint_step != self.step:
                self.save_checkpoint()
            result = self._result("stopped")
        else:
            with _determinism(self.deterministic):
                result = self._finish(test)
        self._emit("on_fit_end", result)
        return result

    def _loader(self) -> DataLoader:
        return training_loader(
            self.train_data,
            self.sampler,
            seed=self.seed,
            epoch=self.next_epoch,
            position=self.next_position,
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
        )

    def _interrupted(self, signal_number: int = signal.SIGINT) -> TrainingInterrupted:
        if self.run_dir is None:
            detail = "nothing was saved (the trainer has no run_dir)"
        elif not self._in_step:
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
        by = _SIGNAL_NAMES.get(signal_number, signal.Signals(signal_number).name)
        message = f"training interrupted ({by}) at step {self.step}/{self.total_steps}: {detail}"
        hint = (
            f"Trainer.from_run_dir({str(self.run_dir)!r})"
            if self.config is not None
            else "Trainer(<the same objects>, run_dir=..., resume=True)"
        )
        return TrainingInterrupted(
            message,
            self.step,
            self.run_dir,
            self.last_checkpoint_step,
            hint,
            signal_number=signal_number,
        )

    def _raise_non_finite(self, loss: torch.Tensor | None) -> None:
        what = (
            f"the loss is {float(loss.detach())}"
            if loss is not None
            else "the model's embeddings contain NaN/inf"
        )
        fix = "optimizer.lr" if self.config is not None else "the learning rate"
        message = (
            f"{what} at step {self.step + 1} (epoch {self.next_epoch}, loss {self.loss_name}); "
            f"training stopped without applying that step and {self.kept_checkpoint_message()}. "
            f"Lower {fix} or check the loss parameters."
        )
        record = {
            "kind": "error",
            "step": self.step + 1,
            "error": "non-finite loss" if loss is not None else "non-finite embeddings",
        }
        raise NonFiniteLossError(message, self.step + 1, self.last_good_checkpoint, record)

    def _result(
        self, status: str, test: RetrievalReport | None = None, curve: PRCurve | None = None
    ) -> RunResult:
        return RunResult(
            run_dir=self.run_dir,
            status=status,
            steps=self.step,
            seconds=self.seconds,
            best_step=self.best_step,
            best_val=self.best_val,
            test=test,
            pr_curve=curve,
            config={} if self.config is None else self.config.to_dict(),
        )

    def _selected_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights of the model selected on validation (``None``: the final model)."""
        best = self._callback(BestCheckpoint)
        return None if best is None else best.best_model_state(self)

    def _test_selected(self) -> tuple[RetrievalReport, PRCurve]:
        weights = self._selected_weights()
        final = None
        if weights is not None:
            final = {k: v.clone() for k, v in self.model.state_dict().items()}
            self.model.load_state_dict(weights)
        try:
            return self.test()
        finally:
            if final is not None:
                self.model.load_state_dict(final)

    def _finish(self, test: bool) -> RunResult:
        start = time.perf_counter()
        report, curve = None, None
        if test and self.test_data is not None:
            report, curve = self._test_selected()
            self._emit("on_test_end", report, curve)
        self.seconds += time.perf_counter() - start
        result = self._result("completed", report, curve)
        self._completed = True
        if self.run_dir is not None and self.is_main_process:
            atomic_write_text(
                json.dumps(result.to_dict(), indent=2) + "\n", self.run_dir / "report.json"
            )
            if curve is not None:
                data = {
                    "recall": [float(v) for v in curve.recall],
                    "precision": [float(v) for v in curve.precision],
                    "n_queries": int(curve.n_queries),
                }
                atomic_write_text(json.dumps(data) + "\n", self.run_dir / "pr_curve.json")
        return result


def _refuse_results(run_dir: Path, key: str) -> None:
    """The one rule of train, bench and tune: results are never overwritten silently."""
    found = existing_results(run_dir)
    if found:
        raise ConfigError(
            f"{key}: {str(run_dir)!r} already holds a run ({', '.join(found)}); continue it "
            "with `resume` or start afresh with `overwrite`, which deletes its results (or "
            f"choose another `{key}`)."
        )


def _fallback(run_dir: Path | None, exclude: Path | None = None) -> dict[str, Any]:
    """``{"fallback", "fallback_step"}`` of an older checkpoint of the run that loads, or ``{}``."""
    if run_dir is None:
        return {}
    candidate = run_dir / "checkpoints" / "previous.pt"
    if exclude is not None and candidate.resolve() == Path(exclude).resolve():
        return {}
    step = readable_checkpoint_step(candidate)
    return {} if step is None else {"fallback": candidate, "fallback_step": step}


def _format1_callback_states(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The callback states of a format-1 checkpoint (best-so-far and loss window at top level)."""
    return {
        "best_checkpoint": {
            "best_value": state.get("best_map"),
            "best_step": state.get("best_step"),
            "best_val": state.get("best_val"),
        },
        "metrics_logger": {"window_losses": state.get("window_losses", [])},
    }


def train(
    config: Config,
    *,
    splits: RetrievalSplits | None = None,
    overwrite: bool = False,
    max_steps: int | None = None,
    callbacks: Sequence[CallbackLike] = (),
    console: Console | None = None,
) -> RunResult:
    """Build a :class:`Trainer` from ``config`` and run :meth:`Trainer.fit`.

    Args:
        config: the validated run configuration.
        splits: pre-loaded dataset splits (default: loaded from ``config.dataset``).
        overwrite: start afresh in an output directory that already holds a run.
        max_steps: stop early (see :meth:`Trainer.fit`).
        callbacks: extra callbacks.
        console: rich console for messages.

    Returns:
        The :class:`RunResult`.
    """
    trainer = Trainer.from_config(config, splits=splits, overwrite=overwrite, console=console)
    return trainer.fit(max_steps=max_steps, callbacks=callbacks)
