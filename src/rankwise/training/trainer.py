"""The training loop: a Trainer for your own model, loss and data.

The loop of Wen et al. (NeurIPS 2022), Sec. 5.1 and App. D.1: ranking loss on P x K batches, model
selection by validation tie-aware mAP, test report of the selected model. Resumable bit for bit: a
checkpoint holds every state (e.g. SOPRC's ``v`` of Eq. (10), sampler position, RNG streams);
batches depend neither on interruptions nor on ``num_workers`` (:mod:`rankwise.training.loader`).

The :class:`Trainer` keeps the loop and its counters; it holds the parts it asks for the rest:
its run store (:class:`~rankwise.training.store.RunStore`: the folder's lock, checkpoints, resume,
result), its evaluator (:class:`~rankwise.training.evaluation.Evaluator`), its stop control
(:class:`~rankwise.training.stop.StopControl`: signals and the processes' agreement) and its
strategy (:mod:`rankwise.training.strategy`: how many processes train).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch
from rich.console import Console
from torch import nn
from torch.utils.data import Dataset

from .._signals import signal_label, signal_number_of
from .._validation import check_bool
from ..metrics._inputs import check_ks
from ..metrics.verification import check_fprs
from .arguments import (
    LRSchedule,
    check_dataset,
    check_modules,
    check_run_options,
    determinism,
    device_of,
    positive_int,
)
from .assembly import BuildOptions, build_from_config, resume_from_run_dir
from .build import build_optimizer, learning_rate_at, load_splits, preflight
from .callbacks import BestCheckpoint, Callback, MetricsLogger
from .callbacks.base import TrainerView
from .callbacks.host import CallbackLike, add_callback, as_callback, default_callbacks, emit, find
from .checkpoint import capture_rng_state
from .config import Config, config_from_dict
from .errors import (
    DataError,
    NonFiniteLossError,
    ReplicaDivergenceError,
    TrainingDataError,
    TrainingInterrupted,
)
from .evaluation import Evaluator
from .loader import BatchSampler, dataset_labels, default_sampler, training_loader
from .loop import FitLoop, LoopEnd
from .monitor import DEFAULT_MONITOR
from .result import RunResult, per_category_map
from .settings import Logging, Runtime, Schedule, group_options
from .step import OptimizerStep
from .stop import StopControl
from .store import RunStore
from .strategy import SingleProcess

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..data import RetrievalSplits
    from ..metrics import PRCurve, RetrievalReport

__all__ = [
    "LRSchedule",
    "Logging",
    "RunResult",
    "Runtime",
    "Schedule",
    "BatchSource",
    "EndPolicy",
    "Trainer",
    "TrainerOptions",
    "build_optimizer",
    "learning_rate_at",
    "load_splits",
    "preflight",
    "train",
]

_EVALUATION = ("metric_fn", "curve_fn", "eval_ks", "eval_batch_size", "eval_fpr")
_RUN_FOLDER = ("resume", "resume_from", "overwrite", "run_dir_key", "record", "config")
_SEAMS = ("batch_source", "end_policy", "resume_hint", "activity")


class BatchSource(Protocol):
    """Where the training batches come from, instead of the loader of ``sampler``.

    A source that draws its batches itself keeps what its position depends on in a callback's
    checkpointed state, so a resumed run draws the batches of an uninterrupted one (the
    pretraining's ``SourceBatches``, :mod:`rankwise.workflows.pretrain`).
    """

    def batches(self, step: int, epoch: int, position: int) -> Iterator[Any]:
        """The ``(x, y, meta)`` batches from ``step`` on (``meta[0]``: ``(epoch, position)``)."""


class EndPolicy(Protocol):
    """What a run does once its budget is reached, instead of testing and writing the report.

    Called with the trainer; a ``KeyboardInterrupt`` inside it is its own to report (the
    trainer's :attr:`~Trainer.resume_hint` says how to continue).
    """

    def __call__(self, trainer: Trainer) -> None:
        """Write the run's outcome."""


def _per_category(test: RetrievalReport | None, data: Any) -> dict[str, Any] | None:
    """The test mAP per query category, for test data with ``categories`` (a table's column)."""
    categories = getattr(data, "categories", None)
    if test is None or categories is None:
        return None
    return per_category_map(test.per_query_ap, categories)


class TrainerOptions(TypedDict, total=False):
    """The keywords of :class:`Trainer` besides its named parameters.

    The evaluation (``metric_fn``, ``curve_fn``, ``eval_ks``, ``eval_batch_size``); how a
    ``run_dir`` path is opened (``resume``, ``resume_from``, ``overwrite``, ``run_dir_key``,
    ``record``; ``config``: a Config's ``to_dict()`` as the record); the seams of a loop that
    is not the retrieval one (``batch_source``: a :class:`BatchSource`; ``end_policy``: an
    :class:`EndPolicy` instead of the test and report; ``resume_hint``: how messages say to
    continue; ``activity``: what they call the run, e.g. ``"pretraining"``); and, as in earlier
    versions, each field of the :class:`Schedule`, :class:`Runtime` and :class:`Logging` groups
    on its own.
    """

    metric_fn: Callable[..., RetrievalReport] | None
    curve_fn: Callable[..., PRCurve] | None
    eval_ks: Sequence[int]
    eval_batch_size: int
    eval_fpr: Sequence[float]
    resume: bool
    resume_from: str | Path | None
    overwrite: bool
    run_dir_key: str
    record: Mapping[str, Any] | None
    config: Config | None
    iterations: int | None
    epochs: int | None
    lr_schedule: LRSchedule | None
    eval_every: int | None
    device: str | torch.device | None
    seed: int
    num_workers: int
    deterministic: bool
    detect_collapse: bool
    precision: str
    sub_batch_size: int | None
    log_every: int
    progress: bool | None
    console: Console | None
    name: str | None
    loss_name: str | None
    batch_source: BatchSource | None
    end_policy: EndPolicy | None
    resume_hint: str | None
    activity: str


def _split_options(options: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The entries of ``names`` in ``options`` (removed from it)."""
    return {name: options.pop(name) for name in names if name in options}


class Trainer:
    """Train an embedding model with a ranking loss; select it on validation, test it.

    The loop of :meth:`fit`: P x K batches from ``sampler``; per step ``model(x)`` ->
    ``loss_fn(embeddings, labels)`` -> ``optimizer.step()`` (:meth:`train_step`); every
    ``eval_every`` steps (and at the end) the validation data is ranked leave-one-out with the
    exact tie-aware metrics of :func:`rankwise.metrics.retrieval_metrics`, the best model by
    validation mAP is kept, and a checkpoint is written; at the end the selected model is tested.

    Every dataset is map-style, ``dataset[i] -> (x, label)`` with an integer class id (what the
    default sampler reads: :func:`~rankwise.training.loader.dataset_labels`, docs/training.md).

    Settings come in three frozen groups, each also accepted field by field as a keyword (the
    keywords of earlier versions: ``Trainer(..., iterations=300, eval_every=75, progress=False)``
    is ``Trainer(..., schedule=Schedule(iterations=300, eval_every=75),
    logging=Logging(progress=False))``).

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
            resumption exact). Default: :func:`~rankwise.training.loader.default_sampler`.
            With a ``batch_source`` it only gives the epoch length.
        callbacks: :class:`~rankwise.training.callbacks.Callback` objects or plain functions
            ``fn(trainer)`` (called after every complete step); one of the type of a default
            callback replaces that default (the defaults: docs/training.md).
        run_dir: where checkpoints, ``metrics.jsonl``, ``report.json`` and plots go (``None``:
            no file; everything stays in memory, no resume), or an open
            :class:`~rankwise.training.store.RunStore` (the factory's). A path is opened here
            (``resume`` / ``overwrite`` / ``resume_from`` below) and locked against other
            processes (:mod:`rankwise.training.lock`) from construction to the end of
            :meth:`fit`; a second :meth:`fit` refuses it if another process wrote a checkpoint
            there meanwhile.
        strategy: how many processes train: :class:`~rankwise.training.strategy.SingleProcess`
            (default) or a ``DataParallelStrategy`` (docs/distributed.md).
        schedule: the budget, learning-rate schedule and evaluation cadence
            (:class:`~rankwise.training.settings.Schedule`: ``iterations``, ``epochs``,
            ``lr_schedule``, ``eval_every``).
        runtime: where and how reproducibly it trains
            (:class:`~rankwise.training.settings.Runtime`: ``device``, ``seed``,
            ``num_workers``, ``deterministic``, ``detect_collapse``).
        logging: what it records and shows (:class:`~rankwise.training.settings.Logging`:
            ``log_every``, ``progress``, ``console``, ``name``, ``loss_name``).
        **options: (:class:`TrainerOptions`) the evaluation: ``metric_fn`` (called as
            ``metric_fn(query, query_labels, gallery, gallery_labels, ks=eval_ks)``, ``gallery``
            ``None`` for leave-one-out; default :func:`rankwise.metrics.retrieval_metrics`; its
            report needs ``map`` and ``to_dict()``), ``curve_fn`` (the test curve, called like
            ``metric_fn`` without ``ks``; default :func:`rankwise.metrics.pr_curve`),
            ``eval_ks`` (default ``(1, 10, 100)``), ``eval_batch_size`` (default 256),
            ``eval_fpr`` (FPR budgets: every report adds ROC AUC and TPR at each; default none); a
            ``run_dir`` path's ``resume`` (continue from ``checkpoints/last.pt``; build the same
            objects first), ``resume_from`` (with ``resume``: that checkpoint instead, e.g.
            ``checkpoints/previous.pt``), ``overwrite`` (start afresh in a folder holding a
            run: its results are deleted when :meth:`fit` starts), ``run_dir_key`` (the name
            messages give ``run_dir``) and ``record`` (what ``config.yaml`` and the
            checkpoints hold as the run's config; ``config``: a Config's); and each field of
            ``schedule`` / ``runtime`` / ``logging`` on its own.

    Raises:
        ValueError: a bad argument, named (a :class:`ConfigError` for a ``run_dir`` that
            already holds a run, or a checkpoint that cannot be resumed; a
            :class:`~rankwise.training.lock.RunDirInUseError` for one another process is
            writing).
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
    CHECKPOINT_FORMAT = RunStore.FORMAT

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
        if isinstance(model, Config):
            raise TypeError(
                "Trainer(config) became Trainer.from_config(config); Trainer() takes the model, "
                "the loss and the training data."
            )
        check_modules(model, loss_fn)
        rest: dict[str, Any] = dict(options)
        self.schedule = group_options(schedule, Schedule, rest, "schedule")
        self.runtime = group_options(runtime, Runtime, rest, "runtime")
        self.logging = group_options(logging, Logging, rest, "logging")
        evaluation = _split_options(rest, _EVALUATION)
        folder = _split_options(rest, _RUN_FOLDER)
        seams = _split_options(rest, _SEAMS)
        if rest:
            raise TypeError(f"Trainer() got an unexpected keyword argument {next(iter(rest))!r}.")
        self.strategy = strategy if strategy is not None else SingleProcess()
        console, progress = self.strategy.console(self.logging.console, self.logging.progress)
        device = self.runtime.device
        given = (  # resolved by the factory: the one resolution of the run
            device
            if isinstance(device, torch.device)
            and (device.type != "cuda" or device.index is not None)
            else None
        )
        wanted = given if given is not None else self.strategy.device(device)
        model = self.strategy.prepare_model(model, wanted)  # type: ignore[arg-type]
        check_dataset(train_data, "train_data", required=True)
        for data, data_name in ((val_data, "val_data"), (test_data, "test_data")):
            check_dataset(data, data_name)
        check_dataset(gallery_data, "gallery_data")
        if gallery_data is not None and test_data is None:
            raise ValueError("`gallery_data` is the gallery of a test: pass `test_data` too.")
        self.model = model
        self.loss_fn = loss_fn
        self.batch_source: BatchSource | None = seams.get("batch_source")
        self.end_policy: EndPolicy | None = seams.get("end_policy")
        self.activity = str(seams.get("activity", "training"))
        self._resume_hint: str | None = seams.get("resume_hint")
        self.train_data = train_data
        self.val_data = val_data
        self.test_data = test_data
        self.gallery_data = gallery_data
        self.eval_batch_size = positive_int(
            evaluation.get("eval_batch_size", 256), "eval_batch_size"
        )
        self.eval_ks = tuple(sorted(check_ks(evaluation.get("eval_ks", (1, 10, 100)), "eval_ks")))
        self.evaluator = Evaluator(
            evaluation.get("metric_fn"),
            evaluation.get("curve_fn"),
            ks=self.eval_ks,
            fpr=check_fprs(evaluation.get("eval_fpr", ()), "eval_fpr"),
            batch_size=self.eval_batch_size,
            strategy=self.strategy,
            num_workers=self.runtime.num_workers,
            seed=self.runtime.seed,
        )
        self.store, opening = self._store(run_dir, folder)
        self.console = console if console is not None else Console(stderr=True)
        self.stop_control = StopControl(
            self.strategy, self.console, saving=self.store.root is not None
        )

        self.device: torch.device = given if given is not None else device_of(model, wanted)
        if self.device.type == "cuda" and self.runtime.deterministic:
            # cuBLAS reads this once, at its first use: it must be set before any CUDA matmul
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        self.model.to(self.device)
        self.loss_fn.to(self.device)
        self.optimizer = optimizer if optimizer is not None else self._default_optimizer()
        # the step itself: precision, loss scaling, sub-batches (its state is checkpointed)
        self.optimizer_step = OptimizerStep(
            self.runtime.precision, self.runtime.sub_batch_size, device=self.device, model=model
        )
        # a config's error names its keys
        from_config = self.store.record is not None and sampler is not None
        if sampler is None:
            sampler = default_sampler(dataset_labels(train_data, "train_data"), self.seed)
        self.sampler = self.strategy.shard_sampler(sampler, from_config=from_config)
        self.steps_per_epoch = len(self.sampler)
        if self.steps_per_epoch <= 0:
            raise ValueError("`sampler` yields no batch per epoch.")
        self.total_steps = self.schedule.total_steps(self.steps_per_epoch)
        self.eval_every = self.schedule.eval_every or self.steps_per_epoch
        self._lr_function = self.schedule.lr_function
        self.loss_name = self.logging.loss_name or type(loss_fn).__name__
        self.name = self.logging.name or self.loss_name

        # the steps and their progress state (checkpointed)
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
        self._completed = False
        self._stopped_early: str | None = None  # the reason of a normal early end (checkpointed)
        # the evaluation of self.step was cut short by a data error: it runs first on resume
        self._validation_pending = False
        self.callbacks = default_callbacks(
            self.logging.log_every, progress, self.runtime.detect_collapse
        )
        for callback in callbacks:
            add_callback(self.callbacks, as_callback(callback))
        self._active: list[Callback] = list(self.callbacks)
        try:
            if opening is not None:
                self.store.open(**opening)
            if self.store.resuming:
                self._restore(self.store.read_resume_state(self.device))
            self._join_processes(self.store.resuming)
        except BaseException:
            self.store.release()  # the main process took the run directory's lock
            raise

    # -- construction -----------------------------------------------------------------------

    def _store(
        self, run_dir: str | Path | RunStore | None, folder: dict[str, Any]
    ) -> tuple[RunStore, dict[str, Any] | None]:
        """The run's store, and how to open it (``None``: opened by whoever made it)."""
        if isinstance(run_dir, RunStore):
            if folder:
                raise ValueError(
                    f"{', '.join(f'`{k}`' for k in folder)}: the given RunStore was opened "
                    "with its own; pass them to RunStore(...) / RunStore.open(...) instead."
                )
            if run_dir.strategy.world_size != self.strategy.world_size:
                raise ValueError(
                    "`run_dir`: the RunStore was made for "
                    f"{run_dir.strategy.world_size} process(es) and the trainer's `strategy` "
                    f"has {self.strategy.world_size}; give both the same strategy."
                )
            if not run_dir.is_open:
                run_dir.open()
            return run_dir, None
        record = folder.get("record")
        config = folder.get("config")
        if config is not None and record is None:
            record = config.to_dict()
        resume = check_bool(folder.get("resume", False), "resume")
        overwrite = check_bool(folder.get("overwrite", False), "overwrite")
        resume_from = folder.get("resume_from")
        root = None if run_dir is None else Path(run_dir)
        check_run_options(root, resume, overwrite, resume_from)
        opening = {"resume": resume, "overwrite": overwrite, "resume_from": resume_from}
        store = RunStore(
            root, strategy=self.strategy, key=folder.get("run_dir_key", "run_dir"), record=record
        )
        return store, opening

    def _join_processes(self, resume: bool) -> None:
        """The training module (DDP on many processes); agree with the other processes."""
        self._training_module = self.strategy.training_module(self.model, self.device)
        self.strategy.join(
            steps_per_epoch=self.steps_per_epoch,
            total_steps=self.total_steps,
            seed=self.seed,
            resume=resume,
        )
        for callback in self.strategy.callbacks():
            add_callback(self.callbacks, callback)
        self._active = list(self.callbacks)
        self.check_replicas()

    def _default_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        params += [p for p in self.loss_fn.parameters() if p.requires_grad]
        if not params:
            raise ValueError("`model` has no trainable parameter (requires_grad) to optimize.")
        return torch.optim.Adam(params, lr=1e-3)

    @classmethod
    def from_config(cls, config: Config, **options: Unpack[BuildOptions]) -> Trainer:
        """Build the data, model, loss, sampler, optimizer and schedule of ``config``.

        The one door from a config to a trainer (:func:`rankwise.training.factory.build_trainer`
        is this with ``trainer_cls``): the keywords (``splits``, ``resume``, ``overwrite``,
        ``console``, ``callbacks``, ``resume_from``, ``model``, ``metric_fn``, ``curve_fn``,
        ``name``, ``plots``) as :func:`~rankwise.training.assembly.build_from_config` names
        them; the strategy is chosen from the environment and the output directory locked
        before the data is loaded (see also :meth:`from_run_dir`).

        Args:
            config: the validated run configuration.
            **options: (:class:`~rankwise.training.assembly.BuildOptions`) see above.

        Returns:
            The trainer, its ``run_dir`` the config's output directory.
        """
        return build_from_config(cls, config, **options)

    @classmethod
    def from_run_dir(
        cls,
        run_dir: str | Path,
        *,
        num_workers: int | None = None,
        device: str | None = None,
        console: Console | None = None,
        checkpoint: str | Path | None = None,
        data_dir: str | Path | None = None,
        max_steps: int | None = None,
    ) -> Trainer:
        """Trainer that resumes the config run in ``run_dir`` (its ``config.yaml`` and ``last.pt``).

        :func:`rankwise.training.factory.trainer_from_run_dir` with ``trainer_cls=cls`` (also
        for ``data_dir``, moved data, and ``max_steps``, a budget extended to it).

        Returns:
            The trainer, at the step of the checkpoint.
        """
        return resume_from_run_dir(
            cls,
            run_dir,
            num_workers=num_workers,
            device=device,
            console=console,
            checkpoint=checkpoint,
            data_dir=data_dir,
            max_steps=max_steps,
        )

    # -- what the parts hold ----------------------------------------------------------------

    @property
    def run_dir(self) -> Path | None:
        """The run folder (``None``: no file)."""
        return self.store.root

    @property
    def paths(self) -> Any:
        """The file names of the run folder (:class:`~rankwise.training.rundir.RunPaths`)."""
        return self.store.paths

    @property
    def checkpoint_dir(self) -> Path:
        """``run_dir/checkpoints``."""
        return self.store.paths.checkpoints

    @property
    def record(self) -> dict[str, Any] | None:
        """The run's config as ``config.yaml`` holds it (``None``: built from objects)."""
        return self.store.record

    @property
    def config(self) -> Config | None:
        """The config the run was built from (``None``: built from objects): :attr:`record` read.

        The trainer itself never reads it; :meth:`from_config` gives it the record only.
        """
        return None if self.store.record is None else config_from_dict(self.store.record)

    @property
    def last_checkpoint_step(self) -> int | None:
        """The step of ``checkpoints/last.pt`` (``None``: none written or read yet)."""
        return self.store.last_step

    @property
    def last_good_checkpoint(self) -> Path | None:
        """``checkpoints/last.pt`` once a checkpoint was written in this run, else ``None``."""
        return self.store.last_good_checkpoint

    def kept_checkpoint_message(self) -> str:
        """A clause for error messages: ``"the last good checkpoint (...) is kept"`` or why not."""
        return self.store.kept_message()

    @property
    def metric_fn(self) -> Callable[..., Any]:
        """The evaluation's metric (see :class:`~rankwise.training.evaluation.Evaluator`)."""
        return self.evaluator.metric_fn

    @property
    def curve_fn(self) -> Callable[..., Any]:
        """The test curve (see :class:`~rankwise.training.evaluation.Evaluator`)."""
        return self.evaluator.curve_fn

    @property
    def seed(self) -> int:
        """The run's seed (``runtime.seed``)."""
        return self.runtime.seed

    @property
    def num_workers(self) -> int:
        """DataLoader worker processes (``runtime.num_workers``)."""
        return self.runtime.num_workers

    @property
    def deterministic(self) -> bool:
        """Deterministic algorithms during training (``runtime.deterministic``)."""
        return self.runtime.deterministic

    @property
    def lr_schedule(self) -> LRSchedule | None:
        """The learning-rate schedule (``schedule.lr_schedule``)."""
        return self.schedule.lr_schedule

    @property
    def training_module(self) -> nn.Module:
        """What the training forward pass calls (the model, or its DDP wrapper)."""
        return self._training_module

    @property
    def is_main_process(self) -> bool:
        """Whether this process writes the run directory and prints (rank 0 of a data-parallel run)."""
        return self.strategy.is_main_process

    @property
    def world_size(self) -> int:
        """The number of data-parallel processes training the model."""
        return self.strategy.world_size

    @property
    def rank(self) -> int:
        """This process's rank (0 for one process)."""
        return self.strategy.rank

    @property
    def stop_requested(self) -> bool:
        """Whether the run stops after the current step (a signal, or another rank's)."""
        return self.stop_control.requested

    def request_stop(self, reason: str | None = None) -> None:
        """Stop after the current step, with a checkpoint.

        Args:
            reason: why, e.g. early stopping's: the run ends normally (``status
                "stopped_early"``: the selected model is tested and the report written);
                ``None``: an interruption, as Ctrl-C (:class:`TrainingInterrupted`).
        """
        self.stop_control.request(reason)

    @property
    def stopped_early(self) -> str | None:
        """The reason the run ended early and normally (``None``: it did not), also once resumed."""
        return self._stopped_early

    @property
    def completed(self) -> bool:
        """Whether the last :meth:`fit` completed the run (its report is written or being written).

        From then on an interruption loses nothing: ``report.json`` says ``"completed"``.
        """
        return self._completed

    # -- callbacks --------------------------------------------------------------------------

    def _emit(self, hook: str, *args: Any) -> None:
        trainer: TrainerView = self  # what the callbacks may read of the trainer
        emit(self._active, hook, trainer, *args)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The records of the run so far (train, val, test, error), as in ``metrics.jsonl``."""
        logger = find(self._active, MetricsLogger)
        return logger.records if logger is not None else []

    @property
    def monitor(self) -> str:
        """The validation scalar that selects the model (its :class:`BestCheckpoint`'s monitor)."""
        best = find(self._active, BestCheckpoint)
        return DEFAULT_MONITOR if best is None else best.monitor

    @property
    def best_step(self) -> int | None:
        """Step of the best validation score so far."""
        best = find(self._active, BestCheckpoint)
        return None if best is None else best.best_step

    @property
    def best_val(self) -> dict[str, Any] | None:
        """Validation report summary of the best step so far."""
        best = find(self._active, BestCheckpoint)
        return None if best is None else best.best_val

    # -- checkpoints ------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps completed (the :class:`~rankwise.training.loop.FitLoop`'s)."""
        return self.loop.step

    @property
    def next_epoch(self) -> int:
        """The sampler epoch of the next batch."""
        return self.loop.next_epoch

    @property
    def next_position(self) -> int:
        """The next batch's index within :attr:`next_epoch`."""
        return self.loop.next_position

    @property
    def seconds(self) -> float:
        """Wall-clock seconds spent in this run, summed over resumptions."""
        return self.loop.seconds

    def state_dict(self) -> dict[str, Any]:
        """The complete state after ``self.step`` (what ``checkpoints/last.pt`` holds)."""
        scheduler = self.lr_schedule
        return {
            "format": self.store.FORMAT,
            "config": self.store.record,
            "world_size": self.world_size,
            **self.loop.state_dict(),  # step, next_epoch, next_position, seconds
            "model": self.model.state_dict(),
            "loss": self.loss_fn.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": scheduler.state_dict()
            if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler)
            else None,
            "sampler": {"epoch": self.next_epoch, "position": self.next_position},
            "optimizer_step": self.optimizer_step.state_dict(),  # precision, loss scaler
            "validation_pending": self._validation_pending,
            "rng": capture_rng_state(),
            "callbacks": {
                c.state_key: c.state_dict() for c in self._active if c.state_key is not None
            },
            **self.strategy.rng_state(),
            # only in the checkpoint of an early end: a resumed run knows it is finished
            **({} if self._stopped_early is None else {"stopped_early": self._stopped_early}),
        }

    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/last.pt`` atomically with the complete state after ``self.step``.

        Returns:
            The checkpoint's path.

        Raises:
            DiskFullError: no space left for it; the earlier checkpoints are intact.
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
        if state.get("lr_scheduler") is not None:
            if not isinstance(self.lr_schedule, torch.optim.lr_scheduler.LRScheduler):
                raise ValueError(
                    "the checkpoint holds a learning-rate scheduler: pass the same `lr_schedule`."
                )
            self.lr_schedule.load_state_dict(state["lr_scheduler"])
        self.loop.load_state_dict(state)
        self.optimizer_step.load_state_dict(state.get("optimizer_step"))
        self._stopped_early = state.get("stopped_early")
        self._validation_pending = bool(state.get("validation_pending", False))
        self.strategy.restore_rng(state)
        states = state.get("callbacks", {})
        for callback in self.callbacks:
            if callback.state_key is not None and callback.state_key in states:
                callback.load_state_dict(states[callback.state_key])
        self.store.check_best(self.best_step)

    def check_replicas(self) -> None:
        """Raise :class:`ReplicaDivergenceError` unless every process holds the same state.

        A collective (:func:`~rankwise.training.replicas.check_replicas_in_sync`); a no-op for one.
        """
        try:
            self.strategy.check_replicas(self.model, self.loss_fn, self.optimizer, self.step)
        except ReplicaDivergenceError as exc:
            exc.last_good_checkpoint = self.last_good_checkpoint
            exc.args = (f"{exc.args[0]} Training stopped and {self.kept_checkpoint_message()}.",)
            raise

    # -- evaluation -------------------------------------------------------------------------

    def embed(self, dataset: Dataset) -> tuple[torch.Tensor, Any]:
        """Embeddings ``(N, d)`` (on the trainer's device) and ``(N,)`` int64 labels of a dataset.

        Batches of ``eval_batch_size``, as in :func:`~rankwise.training.evaluation.embed_batches`.

        Args:
            dataset: a map-style dataset of ``(x, label)`` items.

        Returns:
            ``(embeddings, labels)``.
        """
        return self.evaluator.embed(self.model, dataset, self.device)

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
        gallery = self.gallery_data if split == "test" else None
        ranking = self.evaluator.rank(
            self.model, self.device, self._data(split), gallery, with_curve=with_curve
        )
        return ranking.report, ranking.embeddings, ranking.curve

    def evaluate(self, split: str = "val") -> RetrievalReport:
        """The exact retrieval report of the current model on the ``"val"`` or ``"test"`` data.

        Leave-one-out, or test queries against ``gallery_data`` when there is one.

        Args:
            split: ``"val"`` or ``"test"``.

        Returns:
            A :class:`~rankwise.metrics.RetrievalReport`.
        """
        return self._rank(split)[0]

    def test(self) -> tuple[RetrievalReport, PRCurve]:
        """``(report, curve)``: the current model's test report and mean PR curve (one pass)."""
        report, _, curve = self._rank("test", with_curve=True)
        assert curve is not None
        return report, curve

    def _validate_and_checkpoint(self) -> None:
        if self.val_data is not None:
            self._validation_pending = True  # until the validation data is read
            report, embeddings, _ = self._rank("val")
            self._validation_pending = False
            self._emit("on_validation_end", report, embeddings)
        if self.store.root is not None:
            self.save_checkpoint()

    def _test_selected(self) -> tuple[RetrievalReport, PRCurve]:
        weights = (
            None
            if find(self._active, BestCheckpoint) is None
            else self.store.selected_weights(self.device)
        )
        final = None
        if weights is not None:
            final = {k: v.clone() for k, v in self.model.state_dict().items()}
            self.model.load_state_dict(weights)
        try:
            return self.test()
        finally:
            if final is not None:
                self.model.load_state_dict(final)

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

    def _training_batches(self) -> Iterator[Any]:
        """The ``(x, y, meta)`` batches of :meth:`fit` from the trainer's position on.

        ``meta[0]`` holds the batch's ``(epoch, position)``: the ``batch_source``'s, else the
        loader of ``sampler`` (:func:`~rankwise.training.loader.training_loader`).
        """
        if self.batch_source is not None:
            return self.batch_source.batches(self.step, self.next_epoch, self.next_position)
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

        Ctrl-C / SIGTERM stop after the current step with a checkpoint (a second aborts at
        once); once the outcome is saved a signal lets the plots finish
        (:class:`~rankwise.training.stop.StopControl`).

        Args:
            max_steps: stop after this many total steps (with a checkpoint when there is a
                ``run_dir``; ``status="stopped"``); resuming later continues exactly there.
                A callback's :meth:`request_stop` with a reason (:class:`EarlyStopping
                <rankwise.training.callbacks.EarlyStopping>`) ends the run normally:
                ``status="stopped_early"``, the selected model tested, the report written.
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
        self._active = self.callbacks + [as_callback(c) for c in callbacks]
        self.store.reopen()  # a second fit: the folder was released at the end of the first
        try:
            with self.stop_control.handling():
                return self._fit(max_steps, test)
        finally:
            self.store.release()

    def _fit(self, max_steps: int | None, test: bool) -> RunResult:
        self._completed = False
        finished = self._stopped_early is not None  # resumed after an early end: nothing to train
        self.store.prepare(self.step)
        self.stop_control.start()
        self.loop.start_clock()
        self._emit("on_fit_start")
        end = LoopEnd("stopped_early", reason=self._stopped_early) if finished else None
        with determinism(self.deterministic), self.stop_control.during_steps():
            self.model.train()
            self.loss_fn.train()  # a stateful loss (SOPRC's v, XBM's memory) updates in training
            batches = self._training_batches()
            try:
                if end is None:
                    if self._validation_pending:  # a data error cut it short: run it first
                        self._validate_and_checkpoint()
                    end = self.loop.run(batches, max_steps)
            except KeyboardInterrupt as exc:  # a second signal, or a callback's raise
                signum = signal_number_of(exc, self.stop_control.signal or signal.SIGINT)
                raise self._interrupted(signum) from None
            except DataError as exc:
                raise self._data_failed(exc) from None
            except NonFiniteLossError as exc:
                self._emit("on_failure", exc)
                raise
            else:
                if end.kind == "signal":  # the interruption the caller sees, after the step
                    raise self._interrupted(end.signal or signal.SIGINT)
            finally:
                self.loop.account_time()
                del batches  # shuts DataLoader workers down
                self._emit("on_train_end")
        return self._end(end, test, finished)

    def _end(self, end: LoopEnd, test: bool, finished: bool) -> RunResult:
        """The run's outcome after the loop's ``end``: finished, or stopped to resume later."""
        if end.kind == "max_steps":
            if self.store.root is not None and self.last_checkpoint_step != self.step:
                self.save_checkpoint()
            result = self._result("stopped")
            if self.store.root is not None:
                self.stop_control.saved("stopped", self.store.root, self.step)
        else:  # the budget, or a normal early end: finished like a complete run
            if end.kind == "stopped_early" and not finished:
                self._stopped_early = end.reason
                if self.store.root is not None:
                    self.save_checkpoint()  # it holds the end: a resumed run is finished
            try:
                with determinism(self.deterministic):
                    result = self._finish(test)
            except DataError as exc:
                raise self._data_failed(exc, "test") from None
        self._emit("on_fit_end", result)
        return result

    def _result(
        self, status: str, test: RetrievalReport | None = None, curve: PRCurve | None = None
    ) -> RunResult:
        if status == "completed" and self._stopped_early is not None:
            status = "stopped_early"
        return RunResult(
            run_dir=self.run_dir,
            status=status,
            stop_reason=self._stopped_early,
            steps=self.step,
            seconds=self.seconds,
            best_step=self.best_step,
            best_val=self.best_val,
            test=test,
            pr_curve=curve,
            config={} if self.store.record is None else dict(self.store.record),
            test_per_category=_per_category(test, self.test_data),
            overflow_steps=self.optimizer_step.record().get("overflow_steps"),
        )

    def _mark_completed(self) -> None:
        """The run is complete (its outcome saved or being saved): a signal now loses nothing."""
        self._completed = True
        if self.store.root is not None:
            outcome = "completed" if self._stopped_early is None else "stopped_early"
            self.stop_control.saved(outcome, self.store.root, self.step)

    def _finish(self, test: bool) -> RunResult:
        """The end of a run: its ``end_policy``, else the test of the selected model and the report."""
        start = time.perf_counter()
        report, curve = None, None
        if self.end_policy is not None:
            self.end_policy(self)
        elif test and self.test_data is not None:
            report, curve = self._test_selected()
            self._emit("on_test_end", report, curve)
        self.loop.seconds += time.perf_counter() - start
        result = self._result("completed", report, curve)
        self._mark_completed()
        if self.end_policy is None:
            self.store.save_result(result)
        return result

    # -- failures ---------------------------------------------------------------------------

    @property
    def resume_hint(self) -> str:
        """How to resume in Python (the interruption's ``resume_hint``)."""
        if self._resume_hint is not None:
            return self._resume_hint
        if self.store.record is not None:
            return f"Trainer.from_run_dir({str(self.run_dir)!r})"
        return "Trainer(<the same objects>, run_dir=..., resume=True)"

    def _interrupted(self, signal_number: int = signal.SIGINT) -> TrainingInterrupted:
        if self.run_dir is None:
            detail = "nothing was saved (the trainer has no run_dir)"
        elif not self.loop.in_step:
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
        by = signal_label(signal_number)
        where = f"at step {self.step}/{self.total_steps}: {detail}"
        return TrainingInterrupted(
            f"{self.activity} interrupted ({by}) {where}",
            self.step,
            self.run_dir,
            self.last_checkpoint_step,
            self.resume_hint,
            signal_number=signal_number,
            detail=where,
        )

    def _data_failed(self, exc: DataError, during: str | None = None) -> TrainingDataError:
        """A data file could not be read: stop like an interruption, with the state saved.

        Nothing of the step being loaded was applied, and an evaluation cut short is marked to
        run again on resume, so the state of ``self.step`` is complete: it is checkpointed (in one
        process; with several, the other ranks are not at this point, so the last checkpoint is
        kept and torchrun ends the job).
        """
        if during is None:
            during = "validation" if self._validation_pending else "training"
        self.loop.in_step = False  # nothing of the step being loaded was applied
        if (
            self.store.root is not None
            and self.world_size == 1
            and self.last_checkpoint_step != self.step
        ):
            self.save_checkpoint()
        return TrainingDataError(
            DataError.one_line(exc),
            step=self.step,
            total_steps=self.total_steps,
            run_dir=self.run_dir,
            checkpoint_step=self.last_checkpoint_step,
            resume_hint=self.resume_hint,
            during=during,
        )

    def _raise_non_finite(self, loss: torch.Tensor | None) -> None:
        what = (
            f"the loss is {float(loss.detach())}"
            if loss is not None
            else "the model's embeddings contain NaN/inf"
        )
        fix = "optimizer.lr" if self.store.record is not None else "the learning rate"
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
