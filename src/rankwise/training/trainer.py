"""The training loop: a Trainer for your own model, loss and data.

The loop of Wen et al. (NeurIPS 2022), Sec. 5.1 and App. D.1: ranking loss on P x K batches, model
selection by validation tie-aware mAP, test report of the selected model. Resumable bit for bit: a
checkpoint holds every state (e.g. SOPRC's ``v`` of Eq. (10), sampler position, RNG streams);
batches depend neither on interruptions nor on ``num_workers`` (:mod:`rankwise.training.loader`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import Dataset

from .._signals import signal_number_of
from .._validation import check_bool
from ..metrics import pr_curve, retrieval_metrics
from ..metrics._inputs import check_ks
from .arguments import (
    LRSchedule,
    check_dataset,
    check_modules,
    check_run_options,
    check_schedule,
    determinism,
    device_of,
    positive_int,
)
from .build import build_optimizer, learning_rate_at, load_splits, preflight
from .callbacks import Callback, StepOutput
from .callbacks.host import CallbackLike
from .config import Config
from .errors import NonFiniteLossError
from .evaluation import Evaluation
from .failures import Failures, graceful_stop
from .loader import BatchSampler, dataset_labels, default_sampler, training_loader
from .lock import RunDirLock
from .state import RunPaths, RunResult
from .strategy import SingleProcess

if TYPE_CHECKING:
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


class Trainer(Evaluation, Failures):
    """Train an embedding model with a ranking loss; select it on validation, test it.

    The loop of :meth:`fit`: P x K batches from ``sampler``; per step ``model(x)`` ->
    ``loss_fn(embeddings, labels)`` -> ``optimizer.step()`` (:meth:`train_step`); every
    ``eval_every`` steps (and at the end) the validation data is ranked leave-one-out with the
    exact tie-aware metrics of :func:`rankwise.metrics.retrieval_metrics`, the best model by
    validation mAP is kept, and a checkpoint is written; at the end the selected model is tested.

    Every dataset is map-style, ``dataset[i] -> (x, label)`` with an integer class id (what the
    default sampler reads: :func:`~rankwise.training.loader.dataset_labels`, docs/training.md).

    Args:
        model: the embedding network, ``(B, ...) -> (B, d)``; moved to ``device``.
        loss_fn: the loss, an ``nn.Module`` called as ``loss_fn(embeddings, labels)`` (every
            :mod:`rankwise.losses` loss); its buffers are checkpointed. Moved to ``device``.
        train_data: the training data.
        optimizer: default ``torch.optim.Adam(lr=1e-3)`` over the trainable parameters of
            ``model`` and ``loss_fn``.
        sampler: a batch sampler (an iterable of index lists with a length; ``set_epoch`` makes
            resumption exact). Default: :func:`~rankwise.training.loader.default_sampler`.
        val_data: validation data, ranked leave-one-out; it selects the model (``None``: the
            final model is tested).
        test_data: test queries; ranked leave-one-out (open-set), or against ``gallery_data``
            (closed-set). ``None``: no test report.
        gallery_data: the gallery (database) of a closed-set test.
        run_dir: where checkpoints, ``metrics.jsonl``, ``report.json`` and plots go (``None``:
            no file; everything stays in memory, no resume). Locked against other processes
            (:mod:`rankwise.training.lock`) from construction to the end of :meth:`fit`; a
            second :meth:`fit` refuses it if another process wrote a checkpoint there meanwhile.
        callbacks: :class:`~rankwise.training.callbacks.Callback` objects or plain functions
            ``fn(trainer)`` (called after every complete step); one of the type of a default
            callback replaces that default (the defaults: docs/training.md).
        iterations: the budget in optimizer steps; or
        epochs: the budget in passes of the sampler (default 1 when neither is given).
        lr_schedule: a function ``step -> learning rate`` (0-based) or a torch ``LRScheduler``
            (checkpointed), as in docs/training.md ("Defaults"); ``None`` keeps the optimizer's.
        eval_every: steps between evaluations and checkpoints (default: once per epoch).
        log_every: steps between training records in the history.
        eval_ks: cut-offs of recall@k / precision@k in the reports.
        eval_batch_size: batch size when embedding evaluation data.
        metric_fn: the evaluation, called as ``metric_fn(query, query_labels, gallery,
            gallery_labels, ks=eval_ks)`` (``gallery`` ``None`` for leave-one-out); default
            :func:`rankwise.metrics.retrieval_metrics`. Its report needs ``map`` (what the
            selection monitors) and ``to_dict()`` (docs/training.md).
        curve_fn: the test curve, called like ``metric_fn`` without ``ks``; default
            :func:`rankwise.metrics.pr_curve`.
        device: ``"cpu"``, ``"cuda"``, ``"auto"`` or a ``torch.device``; default: where the
            model's parameters are.
        seed: seeds the default sampler, the per-item transform seeds and the data loaders,
            not the model's initialisation (``torch.manual_seed`` before building it).
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
        strategy: how many processes train: :class:`~rankwise.training.strategy.SingleProcess`
            (default) or a ``DataParallelStrategy`` (docs/distributed.md).
        loss_name: the loss's name in messages (default: its class name; a config's name).
        run_dir_key: the argument or config key that named ``run_dir``, for messages.

    Raises:
        ValueError: a bad argument, named (a :class:`ConfigError` for a ``run_dir`` that
            already holds a run, or a checkpoint that cannot be resumed; a
            :class:`~rankwise.training.lock.RunDirInUseError` for one another process is
            writing).

    Example:
        Four clustered classes, a linear embedding and the AP loss; six steps, then the test
        report of the model selected on validation (no ``run_dir``: nothing is written):

        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from rankwise.losses import build_loss
        >>> _ = torch.manual_seed(0)
        >>> labels = torch.arange(4).repeat_interleave(16)
        >>> points = 3 * torch.randn(4, 8)[labels] + torch.randn(64, 8)
        >>> data = TensorDataset(points, labels)
        >>> trainer = Trainer(torch.nn.Linear(8, 4), build_loss("ap"), data, val_data=data,
        ...                   test_data=data, iterations=6, progress=False)
        >>> result = trainer.fit()
        >>> result.status, result.steps, bool(result.test.map > 0.9)
        ('completed', 6, True)
    """

    strategy_class: type[SingleProcess] = SingleProcess  # how many processes train (from_config)

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
        strategy: SingleProcess | None = None,
        loss_name: str | None = None,
        run_dir_key: str = "run_dir",
    ) -> None:
        if isinstance(model, Config):
            raise TypeError(
                "Trainer(config) became Trainer.from_config(config); Trainer() takes the model, "
                "the loss and the training data."
            )
        check_modules(model, loss_fn)
        self.strategy = strategy if strategy is not None else SingleProcess()
        console, progress = self.strategy.console(console, progress)
        device = self.strategy.device(device)
        model = self.strategy.prepare_model(model, device)  # type: ignore[arg-type]
        check_dataset(train_data, "train_data", required=True)
        for data, data_name in ((val_data, "val_data"), (test_data, "test_data")):
            check_dataset(data, data_name)
        check_dataset(gallery_data, "gallery_data")
        if gallery_data is not None and test_data is None:
            raise ValueError("`gallery_data` is the gallery of a test: pass `test_data` too.")
        self.config = config
        self.model = model
        self.loss_fn = loss_fn
        self.train_data = train_data
        self.val_data = val_data
        self.test_data = test_data
        self.gallery_data = gallery_data
        self.seed = positive_int(seed, "seed", 0)
        self.num_workers = positive_int(num_workers, "num_workers", 0)
        self.eval_batch_size = positive_int(eval_batch_size, "eval_batch_size")
        self.eval_ks = tuple(sorted(check_ks(eval_ks, "eval_ks")))
        self.deterministic = check_bool(deterministic, "deterministic")

        for fn, fn_name in ((metric_fn, "metric_fn"), (curve_fn, "curve_fn")):
            if fn is not None and not callable(fn):
                raise ValueError(f"`{fn_name}` must be a function, got {type(fn).__name__}.")
        self.metric_fn = metric_fn if metric_fn is not None else retrieval_metrics
        self.curve_fn = curve_fn if curve_fn is not None else pr_curve
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.paths = RunPaths(self.run_dir if self.run_dir is not None else Path())
        self.checkpoint_dir = self.paths.checkpoints
        resume, overwrite = check_bool(resume, "resume"), check_bool(overwrite, "overwrite")
        check_run_options(self.run_dir, resume, overwrite, resume_from)
        self.console = console if console is not None else Console(stderr=True)

        self.device = device_of(model, device)
        if self.device.type == "cuda" and self.deterministic:
            # cuBLAS reads this once, at its first use: it must be set before any CUDA matmul
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.model.to(self.device)
        self.loss_fn.to(self.device)
        self.optimizer = optimizer if optimizer is not None else self._default_optimizer()
        from_config = config is not None and sampler is not None  # a config's error names its keys
        if sampler is None:
            sampler = default_sampler(dataset_labels(train_data, "train_data"), self.seed)
        self.sampler = self.strategy.shard_sampler(sampler, from_config=from_config)
        self.steps_per_epoch = len(self.sampler)
        if self.steps_per_epoch <= 0:
            raise ValueError("`sampler` yields no batch per epoch.")
        self.total_steps = self._budget(iterations, epochs)
        self.eval_every = (
            self.steps_per_epoch if eval_every is None else positive_int(eval_every, "eval_every")
        )
        self.lr_schedule = lr_schedule
        self._lr_function = check_schedule(lr_schedule)
        self.loss_name = loss_name or type(loss_fn).__name__
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
            positive_int(log_every, "log_every"),
            None if progress is None else check_bool(progress, "progress"),
            check_bool(detect_collapse, "detect_collapse"),
        )
        for callback in callbacks:
            self._add_callback(self._as_callback(callback))
        self._active: list[Callback] = list(self.callbacks)
        self._run_dir_key = run_dir_key
        self._run_lock: RunDirLock | None = None
        self._holds_run_dir = False
        self._left_checkpoint: tuple[int, int, int] | None = None
        self._completed = False
        self._open_run_dir(resume, overwrite, None if resume_from is None else Path(resume_from))
        try:
            self._join_processes(resume)
        except BaseException:
            self._release_run_dir()  # the main process took the run directory's lock
            raise

    # -- construction -----------------------------------------------------------------------

    def _join_processes(self, resume: bool) -> None:
        """The training module (DDP on many processes); agree with the other processes."""
        self._training_module = self.strategy.training_module(self.model, self.device)
        for callback in self.strategy.join(self, resume):
            self._add_callback(callback)
        self._active = list(self.callbacks)
        self.check_replicas()

    def _default_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        params += [p for p in self.loss_fn.parameters() if p.requires_grad]
        if not params:
            raise ValueError("`model` has no trainable parameter (requires_grad) to optimize.")
        return torch.optim.Adam(params, lr=1e-3)

    def _budget(self, iterations: int | None, epochs: int | None) -> int:
        if iterations is not None and epochs is not None:
            raise ValueError("pass `iterations` or `epochs`, not both.")
        if iterations is not None:
            return positive_int(iterations, "iterations")
        return positive_int(1 if epochs is None else epochs, "epochs") * self.steps_per_epoch

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

        :func:`rankwise.training.factory.build_trainer` with ``trainer_cls=cls`` (arguments,
        configuration errors and the output directory's lock as there; see also
        :meth:`from_run_dir`).

        Returns:
            The trainer, its ``run_dir`` the config's output directory.
        """
        from .factory import build_trainer  # noqa: PLC0415 - factory imports this module

        return build_trainer(
            config,
            trainer_cls=cls,
            splits=splits,
            resume=resume,
            overwrite=overwrite,
            console=console,
            callbacks=callbacks,
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
        """Trainer that resumes the config run in ``run_dir`` (its ``config.yaml`` and ``last.pt``).

        :func:`rankwise.training.factory.trainer_from_run_dir` with ``trainer_cls=cls``.

        Returns:
            The trainer, at the step of the checkpoint.
        """
        from .factory import trainer_from_run_dir  # noqa: PLC0415 - factory imports this module

        return trainer_from_run_dir(
            run_dir,
            trainer_cls=cls,
            num_workers=num_workers,
            device=device,
            console=console,
            checkpoint=checkpoint,
        )

    # -- names and messages -----------------------------------------------------------------

    @property
    def stop_requested(self) -> bool:
        """Whether the run stops after the current step (a signal, or another rank's)."""
        return self._stop_requested

    def request_stop(self) -> None:
        """Stop after the current step, with a checkpoint (as Ctrl-C does)."""
        self._stop_requested = True

    @property
    def completed(self) -> bool:
        """Whether the last :meth:`fit` completed the run (its report is written or being written).

        From then on an interruption loses nothing: ``report.json`` says ``"completed"``.
        """
        return self._completed

    # -- training ---------------------------------------------------------------------------

    def learning_rate(self, step: int) -> float:
        """The learning rate of the 0-based optimizer ``step`` (of the first parameter group).

        Returns:
            The rate ``lr_schedule`` gives (or the optimizer's current one).
        """
        if self._lr_function is not None:
            return float(self._lr_function(step))
        return float(self.optimizer.param_groups[0]["lr"])

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One optimizer step on the batch ``(x, y)`` at the learning rate of ``self.step``.

        A failed check (finite embeddings, ``on_train_batch`` callbacks, finite loss) raises
        before anything is applied.

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
        """The embeddings and labels the loss sees (on many processes: the gathered batch)."""
        embeddings = self._training_module(x.to(self.device, non_blocking=True))
        return self.strategy.gather_batch(embeddings, y.to(self.device, non_blocking=True))

    def _run_step(self, batches: Iterator[Any]) -> None:
        self._in_step = True
        x, y, meta = next(batches)
        lr = self.learning_rate(self.step)
        loss = self.train_step(x, y)
        self.step += 1
        epoch, position = int(meta[0, 0]), int(meta[0, 1])
        if position + 1 >= self.steps_per_epoch:
            self.next_epoch, self.next_position = epoch + 1, 0
        else:
            self.next_epoch, self.next_position = epoch, position + 1
        output = StepOutput(self.step, epoch, position, float(loss), lr, int(y.shape[0]))
        self._emit("on_train_step_end", output)
        if self.step % self.eval_every == 0 or self.step == self.total_steps:
            self._validate_and_checkpoint()
        # the step, its records and its evaluation are complete: a safe stop point
        self._in_step = False
        self._emit("on_step_end")
        if self._stop_requested:
            raise KeyboardInterrupt

    def _training_batches(self) -> Iterator[Any]:
        """The ``(x, y, meta)`` batches of :meth:`fit` from the trainer's position on.

        ``meta[0]`` holds the batch's ``(epoch, position)``. Here the loader of ``sampler``
        (:func:`~rankwise.training.loader.training_loader`); a subclass that draws its batches
        otherwise keeps what its position depends on in a callback's checkpointed state, so a
        resumed run draws the batches of an uninterrupted one.
        """
        return iter(
            training_loader(
                self.train_data,
                self.sampler,
                seed=self.seed,
                epoch=self.next_epoch,
                position=self.next_position,
                num_workers=self.num_workers,
                pin_memory=self.device.type == "cuda",
            )
        )

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
            max_steps = positive_int(max_steps, "max_steps", 0)
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
        with determinism(self.deterministic), graceful_stop(self):
            self.model.train()
            self.loss_fn.train()  # a stateful loss (SOPRC's v, XBM's memory) updates in training
            batches = self._training_batches()
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
            with determinism(self.deterministic):
                result = self._finish(test)
        self._emit("on_fit_end", result)
        return result

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
            result.save(self.run_dir)
        return result


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
