"""The training loop: a Trainer for your own model, loss and data.

The loop of Wen et al. (NeurIPS 2022), Sec. 5.1 and App. D.1: ranking loss on P x K batches, model
selection on validation, test report of the selected model; resumable bit for bit (a checkpoint
holds every state, e.g. SOPRC's ``v`` of Eq. (10), the sampler position, the RNG streams).

The :class:`Trainer` keeps the assembly of its parts, the public API and the end-of-run policy
(test the selected model and write the report, or the given ``end_policy``), and asks its parts
for the rest: the fit loop (:mod:`~rankwise.training.loop`), the run store
(:mod:`~rankwise.training.store`), the evaluator (:mod:`~rankwise.training.evaluation`), the stop
control (:mod:`~rankwise.training.stop`), the ending (:mod:`~rankwise.training.ending`), the
callbacks (:class:`~rankwise.training.callbacks.host.CallbackHost`) and the strategy
(:mod:`~rankwise.training.strategy`). docs/architecture.md draws them.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import Dataset

from .arguments import LRSchedule, check_datasets, check_modules, determinism, positive_int
from .assembly import BuildOptions, ResumeOptions, build_from_config, resume_from_run_dir
from .build import default_optimizer
from .callbacks import Callback
from .callbacks.base import TrainerView
from .callbacks.host import CallbackHost, CallbackLike
from .checkpoint import capture_rng_state
from .config import Config, config_from_dict
from .ending import RunEnding
from .errors import DataError, ReplicaDivergenceError
from .evaluation import Evaluator
from .loader import BatchSampler, LoaderBatches, dataset_labels, default_sampler
from .loop import FitLoop, LoopEnd
from .options import BatchSource, EndPolicy, TrainerOptions, split_options
from .result import RunResult
from .settings import Logging, Runtime, Schedule
from .step import OptimizerStep
from .stop import StopControl
from .store import RunStore, run_store
from .strategy import SingleProcess

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..metrics import PRCurve, RetrievalReport

__all__ = ["BatchSource", "EndPolicy", "Trainer", "TrainerOptions"]


class Trainer:
    """Train an embedding model with a ranking loss; select it on validation, test it.

    The loop of :meth:`fit` (its :class:`~rankwise.training.loop.FitLoop`): P x K batches from
    ``sampler``; per step ``model(x)`` -> ``loss_fn(embeddings, labels)`` -> ``optimizer.step()``
    (:meth:`train_step`); every ``eval_every`` steps (and at the end) the validation data is
    ranked leave-one-out with the exact tie-aware metrics, the best model on the monitored
    metric is kept, and a checkpoint is written; at the end the selected model is tested.
    Every dataset is map-style, ``dataset[i] -> (x, label)`` with an integer class id
    (docs/training.md). Settings come in three frozen groups, each also accepted field by field
    as a keyword: ``Trainer(..., iterations=300, progress=False)`` is ``Trainer(...,
    schedule=Schedule(iterations=300), logging=Logging(progress=False))``.

    Args:
        model: the embedding network, ``(B, ...) -> (B, d)``; moved to the device.
        loss_fn: the loss, an ``nn.Module`` called as ``loss_fn(embeddings, labels)`` (every
            :mod:`rankwise.losses` loss); its buffers are checkpointed. Moved to the device.
        train_data: the training data.
        val_data: validation data, ranked leave-one-out; it selects the model (``None``: the
            final model is tested).
        test_data: test queries; ranked leave-one-out (open-set), or against ``gallery_data``
            (closed-set). ``None``: no test report.
        gallery_data: the gallery (database) of a closed-set test.
        optimizer: default ``torch.optim.Adam(lr=1e-3)`` over the trainable parameters of
            ``model`` and ``loss_fn``.
        sampler: a batch sampler (an iterable of index lists with a length; ``set_epoch`` makes
            resumption exact); default :func:`~rankwise.training.loader.default_sampler`.
        callbacks: :class:`~rankwise.training.callbacks.Callback` objects or functions
            ``fn(trainer)`` (called after every complete step); one of the type of a default
            callback replaces that default.
        run_dir: where checkpoints, ``metrics.jsonl``, ``report.json`` and plots go (``None``:
            no file, no resume), or an open :class:`~rankwise.training.store.RunStore`. A path
            is locked from construction to the end of :meth:`fit`.
        strategy: how many processes train (default one; docs/distributed.md).
        schedule: a :class:`~rankwise.training.settings.Schedule`.
        runtime: a :class:`~rankwise.training.settings.Runtime`.
        logging: a :class:`~rankwise.training.settings.Logging`.
        **options: (:class:`~rankwise.training.options.TrainerOptions`) the evaluation, how a
            ``run_dir`` path is opened (``resume``, ``overwrite``, ...), the seams
            (``batch_source``, ``end_policy``, ...) and each field of the three groups.

    Raises:
        ValueError: a bad argument, named (a :class:`ConfigError` for a ``run_dir`` that holds
            a run, or a checkpoint that cannot be resumed; a ``RunDirInUseError`` for one
            another process is writing).
        TypeError: an unknown keyword, or a group passed with some of its fields.

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

    strategy_class: type[SingleProcess] = SingleProcess  # DistributedTrainer: data-parallel

    def __init__(
        self,
        model: nn.Module,
        loss_fn: nn.Module,
        train_data: Dataset,
        *,
        val_data: Dataset | None = None,
        test_data: Dataset | None = None,
        gallery_data: Dataset | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        sampler: BatchSampler | None = None,
        callbacks: Sequence[CallbackLike] = (),
        run_dir: str | Path | RunStore | None = None,
        strategy: SingleProcess | None = None,
        schedule: Schedule | None = None,
        runtime: Runtime | None = None,
        logging: Logging | None = None,
        **options: Unpack[TrainerOptions],
    ) -> None:
        check_modules(model, loss_fn)
        args = split_options(options, schedule, runtime, logging)
        self.schedule, self.runtime, self.logging = args.schedule, args.runtime, args.logging
        self.strategy = strategy if strategy is not None else SingleProcess()
        console, progress = self.strategy.console(self.logging.console, self.logging.progress)
        model, self.device = self.strategy.place(model, self.runtime.device)
        check_datasets(train_data, val_data, test_data, gallery_data)
        self.model, self.loss_fn = model, loss_fn
        self.batch_source: BatchSource | None = args.seams.batch_source
        self.end_policy: EndPolicy | None = args.seams.end_policy
        self.train_data, self.val_data = train_data, val_data
        self.test_data, self.gallery_data = test_data, gallery_data
        self.evaluator = Evaluator(
            **args.evaluation,
            strategy=self.strategy,
            val_data=val_data,
            test_data=test_data,
            gallery_data=gallery_data,
        )
        self.store, opening = run_store(run_dir, self.strategy, args.folder)
        self.console = console if console is not None else Console(stderr=True)
        self.stop_control = StopControl(
            self.strategy, self.console, saving=self.store.root is not None
        )
        if self.device.type == "cuda" and self.runtime.deterministic:
            # cuBLAS reads this once, at its first use: it must be set before any CUDA matmul
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.model.to(self.device)
        self.loss_fn.to(self.device)
        self.optimizer = optimizer if optimizer is not None else default_optimizer(model, loss_fn)
        # the step itself: precision, loss scaling, sub-batches (its state is checkpointed)
        self.optimizer_step = OptimizerStep(
            self.runtime.precision, self.runtime.sub_batch_size, device=self.device, model=model
        )
        # a config's error names its keys
        from_config = self.store.record is not None and sampler is not None
        if sampler is None:
            sampler = default_sampler(dataset_labels(train_data, "train_data"), self.runtime.seed)
        self.sampler = self.strategy.shard_sampler(sampler, from_config=from_config)
        self.steps_per_epoch = len(self.sampler)
        if self.steps_per_epoch <= 0:
            raise ValueError("`sampler` yields no batch per epoch.")
        self.total_steps = self.schedule.total_steps(self.steps_per_epoch)
        self.eval_every = self.schedule.eval_every or self.steps_per_epoch
        self._batches = self.batch_source or LoaderBatches(
            train_data, self.sampler, self.runtime.seed, self.runtime.num_workers, self.device
        )
        self.lr_schedule: LRSchedule | None = self.schedule.lr_schedule
        self._lr_function = self.schedule.lr_function
        self.loss_name = self.logging.loss_name or type(loss_fn).__name__
        self.name = self.logging.name or self.loss_name

        # the steps and their progress state (checkpointed), and how the run ends
        self.loop = FitLoop(
            self.steps_per_epoch,
            self.total_steps,
            self.eval_every,
            self.train_step,
            self.learning_rate,
            self._emit,
            self._validate_and_checkpoint,
            self.stop_control,
        )
        self.ending = RunEnding(
            self.loop,
            self.store,
            self.stop_control,
            self.save_checkpoint,
            world_size=self.strategy.world_size,
            loss_name=self.loss_name,
            activity=args.seams.activity,
            resume_hint=args.seams.resume_hint,
            step_record=self.optimizer_step.record,
        )
        # the evaluation of self.step was cut short by a data error: it runs first on resume
        self._validation_pending = False
        self.hooks = CallbackHost(
            self.logging.log_every, progress, self.runtime.detect_collapse, callbacks
        )
        try:
            if opening is not None:
                self.store.open(**opening)
            if self.store.resuming:
                self._restore(self.store.read_resume_state(self.device))
            self._join_processes(self.store.resuming)
        except BaseException:
            self.store.release()  # the main process took the run directory's lock
            raise

    def _join_processes(self, resume: bool) -> None:
        """The training module (DDP on many processes); agree with the other processes."""
        self._training_module = self.strategy.training_module(self.model, self.device)
        self.strategy.join(
            steps_per_epoch=self.steps_per_epoch,
            total_steps=self.total_steps,
            seed=self.runtime.seed,
            resume=resume,
        )
        for callback in self.strategy.callbacks():
            self.hooks.add(callback)
        self.check_replicas()

    @classmethod
    def from_config(cls, config: Config, **options: Unpack[BuildOptions]) -> Trainer:
        """Build the data, model, loss, sampler, optimizer and schedule of ``config``.

        The one door from a config to a trainer (``factory.build_trainer`` is this call): the
        keywords as :func:`~rankwise.training.assembly.build_from_config` names them; the
        strategy is chosen from the environment and the output directory locked before the
        data is loaded.

        Returns:
            The trainer, its ``run_dir`` the config's output directory.
        """
        return build_from_config(cls, config, **options)

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, **options: Unpack[ResumeOptions]) -> Trainer:
        """Trainer that resumes the config run in ``run_dir`` (its ``config.yaml`` and ``last.pt``).

        The keywords (``num_workers``, ``device``, ``console``, ``checkpoint``, ``data_dir``,
        ``max_steps``) as :func:`~rankwise.training.assembly.resume_from_run_dir` names them.
        """
        return resume_from_run_dir(cls, run_dir, **options)

    # -- what the callbacks read (TrainerView); the rest is asked of the parts ---------------

    @property
    def run_dir(self) -> Path | None:
        """The run folder (``None``: no file)."""
        return self.store.root

    @property
    def paths(self) -> Any:
        """The file names of the run folder (:class:`~rankwise.training.rundir.RunPaths`)."""
        return self.store.paths

    @property
    def config(self) -> Config | None:
        """The config the run was built from (``None``: from objects); the trainer never reads it."""
        return None if self.store.record is None else config_from_dict(self.store.record)

    @property
    def training_module(self) -> nn.Module:
        """What the training forward pass calls (the model, or its DDP wrapper)."""
        return self._training_module

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes the run directory and prints (rank 0 of a data-parallel run)."""
        return self.strategy.is_main_process

    def request_stop(self, reason: str | None = None) -> None:
        """Stop after the current step, with a checkpoint.

        With a ``reason`` (early stopping's) the run ends normally, ``"stopped_early"``;
        without, it is an interruption, as Ctrl-C (:class:`TrainingInterrupted`).
        """
        self.stop_control.request(reason)

    @property
    def stopped_early(self) -> str | None:
        """The reason the run ended early and normally (``None``: it did not), also once resumed."""
        return self.ending.stopped_early

    @property
    def resume_hint(self) -> str:
        """How to resume in Python (the interruption's ``resume_hint``)."""
        return self.ending.resume_hint

    @property
    def step(self) -> int:
        """Optimizer steps completed (the :class:`~rankwise.training.loop.FitLoop`'s)."""
        return self.loop.step

    @property
    def next_epoch(self) -> int:
        """The sampler epoch of the next batch (the loop's)."""
        return self.loop.next_epoch

    def _emit(self, hook: str, *args: Any) -> None:
        trainer: TrainerView = self  # what the callbacks may read of the trainer
        self.hooks.emit(hook, trainer, *args)

    @property
    def callbacks(self) -> list[Callback]:
        """The run's callbacks (the defaults and the given ones; :class:`CallbackHost`)."""
        return self.hooks.callbacks

    @property
    def history(self) -> list[dict[str, Any]]:
        """The records of the run so far (train, val, test, error), as in ``metrics.jsonl``."""
        return self.hooks.history

    @property
    def monitor(self) -> str:
        """The validation scalar that selects the model (its :class:`BestCheckpoint`'s monitor)."""
        return self.hooks.monitor

    @property
    def best_step(self) -> int | None:
        """Step of the best validation score so far."""
        return self.hooks.best_step

    @property
    def best_val(self) -> dict[str, Any] | None:
        """Validation report summary of the best step so far."""
        return self.hooks.best_val

    # -- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The complete state after ``self.step`` (what ``checkpoints/last.pt`` holds)."""
        return {
            "format": self.store.FORMAT,
            "config": self.store.record,
            "world_size": self.strategy.world_size,
            **self.loop.state_dict(),  # step, next_epoch, next_position, seconds
            "model": self.model.state_dict(),
            "loss": self.loss_fn.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "optimizer_step": self.optimizer_step.state_dict(),  # precision, loss scaler
            "lr_scheduler": self.schedule.scheduler_state(),
            "sampler": {"epoch": self.loop.next_epoch, "position": self.loop.next_position},
            "validation_pending": self._validation_pending,
            "rng": capture_rng_state(),
            "callbacks": self.hooks.state_dict(),
            **self.strategy.rng_state(),
            **self.ending.state_dict(),  # an early end's reason: a resumed run is finished
        }

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/last.pt`` atomically with the complete state after ``self.step``.

        Returns its path; a ``DiskFullError`` (no space left) keeps the earlier checkpoints.
        """
        if self.store.root is None:
            raise ValueError("the trainer has no `run_dir` to write a checkpoint to.")
        self.check_replicas()
        self.strategy.gather_rng()
        self.loop.account_time()
        return self.store.save_last(self.state_dict())

    def _restore(self, state: dict[str, Any]) -> None:
        """Continue from the checkpoint ``state`` (:meth:`RunStore.read_resume_state`)."""
        self.model.load_state_dict(state["model"])
        self.loss_fn.load_state_dict(state["loss"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer_step.load_state_dict(state.get("optimizer_step"))
        self.schedule.load_scheduler_state(state.get("lr_scheduler"))
        self.loop.load_state_dict(state)
        self.ending.load_state_dict(state)
        self._validation_pending = bool(state.get("validation_pending", False))
        self.strategy.restore_rng(state)
        self.hooks.load_state_dict(state.get("callbacks", {}))
        self.store.check_best(self.best_step)

    def check_replicas(self) -> None:
        """Raise :class:`ReplicaDivergenceError` unless every process holds the same state (a collective)."""
        try:
            self.strategy.check_replicas(self.model, self.loss_fn, self.optimizer, self.step)
        except ReplicaDivergenceError as exc:
            store = self.store
            raise exc.keeping(store.last_good_checkpoint, store.kept_message()) from None

    def embed(self, dataset: Dataset) -> tuple[torch.Tensor, Any]:
        """``(embeddings, labels)``: ``(N, d)`` on the trainer's device and ``(N,)`` int64 labels.

        ``dataset`` is map-style, of ``(x, label)`` items, embedded in batches of
        ``eval_batch_size`` (:func:`~rankwise.training.evaluation.embed_batches`).
        """
        return self.evaluator.embed(self.model, dataset, self.device)

    def evaluate(self, split: str = "val") -> RetrievalReport:
        """The exact retrieval report of the current model on the ``"val"`` or ``"test"`` data.

        Leave-one-out, or test queries against ``gallery_data`` when there is one.
        """
        return self.evaluator.rank_split(self.model, self.device, split).report

    def test(self) -> tuple[RetrievalReport, PRCurve]:
        """``(report, curve)``: the current model's test report and mean PR curve (one pass)."""
        return self.evaluator.test_weights(self.model, self.device, None)

    def _validate_and_checkpoint(self) -> None:
        if self.val_data is not None:
            self._validation_pending = True  # until the validation data is read
            ranking = self.evaluator.rank_split(self.model, self.device, "val")
            self._validation_pending = False
            self._emit("on_validation_end", ranking.report, ranking.embeddings)
        if self.store.root is not None:
            self.save_checkpoint()

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
        loss = self._forward(x, y)
        if isinstance(self.lr_schedule, torch.optim.lr_scheduler.LRScheduler):
            self.lr_schedule.step()
        return loss

    def _forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The step of the batch, by :attr:`optimizer_step` (precision, sub-batches); its loss.

        The loss sees the gathered batch on many processes; the ``on_train_batch`` callbacks
        see it before the loss.
        """
        return self.optimizer_step.run(
            x,
            y,
            self._training_module,
            self.loss_fn,
            self.optimizer,
            gather=self.strategy.gather_batch,
            inspect=lambda embeddings, labels: self._emit("on_train_batch", embeddings, labels),
            non_finite=self._raise_non_finite,
        )

    def _raise_non_finite(self, loss: torch.Tensor | None) -> None:
        """Stop before applying a step whose loss (``None``: embeddings) is NaN/inf."""
        raise self.ending.non_finite(loss)

    def _training_batches(self) -> Iterator[Any]:
        """The ``(x, y, meta)`` batches from the loop's position (``meta[0]``: epoch, position)."""
        return self._batches.batches(self.step, self.loop.next_epoch, self.loop.next_position)

    def fit(
        self,
        *,
        max_steps: int | None = None,
        callbacks: Sequence[CallbackLike] = (),
        test: bool = True,
    ) -> RunResult:
        """Train to the budget (or to ``max_steps``), then test the selected model.

        Ctrl-C / SIGTERM stop after the current step with a checkpoint (a second aborts at
        once); once the outcome is saved a signal lets the plots finish
        (:class:`~rankwise.training.stop.StopControl`).

        Args:
            max_steps: stop after this many total steps, with a checkpoint
                (``status="stopped"``); resuming continues exactly there. A callback's
                :meth:`request_stop` with a reason (``EarlyStopping``) ends the run normally:
                ``status="stopped_early"``, the selected model tested, the report written.
            callbacks: extra callbacks for this call only (see :class:`Trainer`).
            test: test the selected model at the end (``False``: no test report; tuning on
                validation data never reads test data).

        Returns:
            The :class:`RunResult`.

        Raises:
            TrainingInterrupted: Ctrl-C or SIGTERM; ``last.pt`` holds the last full step's state.
            NonFiniteLossError: the loss or the model became NaN/inf, or it collapsed; the last
                good checkpoint is kept (:class:`~rankwise.training.ending.RunEnding`).
        """
        if max_steps is not None:
            max_steps = positive_int(max_steps, "max_steps", 0)
        self.hooks.start_fit(callbacks)
        self.store.reopen()  # a second fit: the folder was released at the end of the first
        try:
            with self.stop_control.handling():
                return self._fit(max_steps, test)
        finally:
            self.store.release()

    def _fit(self, max_steps: int | None, test: bool) -> RunResult:
        end = self.ending.resumed_end()  # resumed after an early end: nothing to train
        finished = end is not None
        self.store.prepare(self.step)
        self.stop_control.start()
        self.loop.start_clock()
        self._emit("on_fit_start")
        with determinism(self.runtime.deterministic), self.stop_control.during_steps():
            self.model.train()
            self.loss_fn.train()  # a stateful loss (SOPRC's v, XBM's memory) updates in training
            batches = self._training_batches()
            try:
                with self.ending.failures(
                    lambda error: self._emit("on_failure", error),
                    lambda: "validation" if self._validation_pending else "training",
                ):
                    if end is None:
                        if self._validation_pending:  # a data error cut it short: run it first
                            self._validate_and_checkpoint()
                        end = self.loop.run(batches, max_steps)
                if end.kind == "signal":  # the interruption the caller sees, after the step
                    raise self.ending.interrupted(end.signal or signal.SIGINT)
            finally:
                self.loop.account_time()
                del batches  # shuts DataLoader workers down
                self._emit("on_train_end")
        return self._end(end, test, finished)

    def _end(self, end: LoopEnd, test: bool, finished: bool) -> RunResult:
        """The run's outcome after the loop's ``end``: finished, or stopped to resume later."""
        if end.kind == "max_steps":
            result = self.ending.stopped(self.hooks.selection)
        else:  # the budget, or a normal early end: finished like a complete run
            if end.kind == "stopped_early" and not finished:
                self.ending.stop_early(end.reason)
            try:
                with determinism(self.runtime.deterministic):
                    result = self._finish(test)
            except DataError as exc:
                raise self.ending.data_failed(exc, "test") from None
        self._emit("on_fit_end", result)
        return result

    def _finish(self, test: bool) -> RunResult:
        """The end-of-run policy: the ``end_policy``, else the test of the selected model and the report."""
        start = time.perf_counter()
        report, curve = None, None
        if self.end_policy is not None:
            self.end_policy(self)
        elif test and self.test_data is not None:
            selecting = self.hooks.selection is not None
            weights = self.store.selected_weights(self.device) if selecting else None
            report, curve = self.evaluator.test_weights(self.model, self.device, weights)
            self._emit("on_test_end", report, curve)
        self.loop.add_seconds(time.perf_counter() - start)
        result = self.ending.result(
            "completed", self.hooks.selection, report, curve, self.test_data
        )
        self.ending.completed()
        if self.end_policy is None:
            self.store.save_result(result)
        return result
