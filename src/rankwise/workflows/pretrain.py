"""A pretrained start: train the backbone on a disjoint task before a ranking loss fine-tunes it.

Wen et al. (NeurIPS 2022, App. D.1) fine-tune an ImageNet-pretrained ResNet-50, so their embeddings
start spread out; a run here starts from random weights. :func:`pretrain` trains the backbone of an
instance benchmark (:mod:`rankwise.data.instances`) with cross-entropy on its categories, from views
of the **training sources only**, and writes ``pretrained.pt`` and ``report.json``
(docs/training.md, "A pretrained start"). The validation and test sources are never trained on:
the validation views are classified once at the end (the held-out accuracy) and the test views are
embedded before and after, for the report's diagnostics (mean negative-pair cosine and
``embedding_spread``). The steps run in :class:`~rankwise.training.Trainer`'s loop (progress,
atomic checkpoints, Ctrl-C / SIGTERM, the folder's lock: one
:class:`~rankwise.training.RunStore`), so an interrupted pretraining resumes bit for bit
(:func:`resume_pretraining`). No ranking equation is implemented here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..data import DATASET_ALIASES, INSTANCE_DATASETS, ArrayDataset, load_dataset
from ..data.instances import InstanceViews
from ..data.registry import read_images
from ..models import build_model
from ..models.build import backbone_width
from ..training.callbacks import Callback, StepOutput, embedding_spread
from ..training.callbacks.base import TrainerView
from ..training.checkpoint import atomic_save, atomic_write_text
from ..training.config import ConfigError
from ..training.errors import TrainingInterrupted
from ..training.settings import Logging, Runtime, Schedule
from ..training.store import RunStore
from ..training.trainer import Trainer
from .sweep import write_json

if TYPE_CHECKING:
    from rich.console import Console

    from ..training.callbacks.host import CallbackLike

__all__ = [
    "PRETRAINED_FILE",
    "SETTINGS_FILE",
    "mean_negative_cosine",
    "pretrain",
    "read_pretrain_settings",
    "resume_pretraining",
    "source_split_hash",
]

PRETRAINED_FILE = "pretrained.pt"
SETTINGS_FILE = "pretrain.json"  # the arguments of the pretraining, read by a resumption
CHECKPOINT_EVERY = 50  # steps between checkpoints (an interruption checkpoints its own step)
# writes pretrained.pt and report.json from the last step's loss; returns the report
Finish = Callable[[float | None], dict[str, Any]]


def source_split_hash(source_ids: np.ndarray) -> str:
    """First 16 hex digits of the SHA-256 of the training sources' pool indices (int64)."""
    return hashlib.sha256(np.asarray(source_ids, dtype=np.int64).tobytes()).hexdigest()[:16]


def mean_negative_cosine(embeddings: torch.Tensor, labels: np.ndarray) -> float:
    """Mean cosine of the pairs of ``embeddings`` (N, d) with different ``labels`` (N,)."""
    unit = nn.functional.normalize(embeddings.detach().float(), dim=1)
    label = torch.as_tensor(np.asarray(labels))
    negative = label[:, None] != label[None, :]
    return float((unit @ unit.T)[negative].mean())


def _categories(dataset: str, data_dir: str | None) -> np.ndarray:
    """Category label of every image of the pool the training sources are drawn from."""
    if dataset not in INSTANCE_DATASETS:
        raise ConfigError(
            f"dataset: pretraining needs an instance benchmark (its sources' categories are the "
            f"disjoint task), one of {sorted(INSTANCE_DATASETS)}; got {dataset!r}."
        )
    return np.asarray(read_images(INSTANCE_DATASETS[dataset], data_dir)[1], dtype=np.int64)


@torch.no_grad()
def _forward(net: nn.Module, inputs: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    net.eval()
    return torch.cat([net(inputs[i : i + batch_size]) for i in range(0, len(inputs), batch_size)])


def _accuracy(logits: torch.Tensor, categories: np.ndarray) -> float:
    return float((logits.argmax(1).numpy() == categories).mean())


def _spread(model: nn.Module, test: ArrayDataset) -> dict[str, float]:
    embeddings = _forward(model, test.batch(np.arange(len(test)))[0])
    return {
        "mean_negative_cosine": mean_negative_cosine(embeddings, test.labels),
        "embedding_spread": embedding_spread(embeddings),
    }


class SourceBatches(Callback):
    """The pretraining's batches, and their random state in every checkpoint.

    Each batch is ``batch_size`` training items drawn uniformly with replacement and a fresh view
    of each, both from one generator seeded by ``seed``; its targets are the items' categories.
    As a callback it checkpoints the generator (and the last step's loss), so a resumed
    pretraining draws the batches of an uninterrupted one.

    Args:
        train: the training split (views of the training sources).
        categories: ``(sources,)`` the category of each training source.
        batch_size: views per batch.
        seed: seed of the generator.

    Attributes:
        generator: the generator of the items and views.
        last_loss: the loss of the last step (``None`` before the first).
    """

    state_key = "pretraining_batches"

    def __init__(
        self, train: InstanceViews, categories: torch.Tensor, batch_size: int, seed: int
    ) -> None:
        self.train = train
        self.categories = categories
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.last_loss: float | None = None

    def __len__(self) -> int:
        """Batches per epoch: as many views as the split has items (drawn with replacement)."""
        return max(1, len(self.train) // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        """Not iterable: the items and their views come from one stream, with :meth:`draw`."""
        raise TypeError(
            "the pretraining's batches are drawn with draw() (items and views from one "
            "generator); iterating over them would shift that stream."
        )

    def draw_items(self) -> torch.Tensor:
        """The ``(batch_size,)`` training items of the next batch."""
        return torch.randint(len(self.train), (self.batch_size,), generator=self.generator)

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch: ``(views, categories)``."""
        views, sources = self.train.batch(self.draw_items(), self.generator)
        return views, self.categories[sources]

    def batches(
        self, step: int, epoch: int, position: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The batches from ``step`` on (a :class:`~rankwise.training.trainer.BatchSource`).

        Drawn when the step runs: a checkpoint holds the generator after its step.
        """
        per_epoch = len(self)
        while True:
            epoch, position = divmod(step, per_epoch)
            views, targets = self.draw()
            yield views, targets, torch.tensor([[epoch, position]])
            step += 1

    def on_train_step_end(self, trainer: TrainerView, output: StepOutput) -> None:
        """Keep the step's loss (the report's ``final_loss``)."""
        self.last_loss = output.loss

    def state_dict(self) -> dict[str, Any]:
        """The generator's state and the last loss."""
        return {"generator": self.generator.get_state(), "last_loss": self.last_loss}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.generator.set_state(state["generator"].cpu())
        self.last_loss = state.get("last_loss")


class _WriteResults:
    """The pretraining's end (an :class:`~rankwise.training.trainer.EndPolicy`): its files.

    Instead of a test report, ``finish(final_loss)`` writes ``pretrained.pt`` and ``report.json``;
    a Ctrl-C between the last step and the files is an interruption naming the kept checkpoint.
    """

    def __init__(self, finish: Finish, batches: SourceBatches) -> None:
        self.finish = finish
        self.batches = batches
        self.report: dict[str, Any] | None = None

    def __call__(self, trainer: Trainer) -> None:
        """Write the files of the pretraining."""
        try:
            self.report = self.finish(self.batches.last_loss)
        except KeyboardInterrupt as exc:  # Ctrl-C between the last step and the files
            raise _not_written(trainer, exc) from None


def _not_written(trainer: Trainer, exc: KeyboardInterrupt) -> TrainingInterrupted:
    from .._signals import signal_label, signal_number_of  # noqa: PLC0415 - rare path

    number = signal_number_of(exc)
    where = (
        f"after step {trainer.step}/{trainer.total_steps}, before {PRETRAINED_FILE} was "
        f"written: the checkpoint of step {trainer.store.last_step} is kept"
    )
    return TrainingInterrupted(
        f"pretraining interrupted ({signal_label(number)}) {where}",
        trainer.step,
        trainer.run_dir,
        trainer.store.last_step,
        trainer.resume_hint,
        signal_number=number,
        detail=where,
    )


def _settings(
    dataset: str,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    model: tuple[int, str, bool],
    data: tuple[Mapping[str, Any], int, str | None],
    threads: int | None,
) -> dict[str, Any]:
    embedding_dim, backbone, frozen_bn = model
    options, split_seed, data_dir = data
    return json.loads(
        json.dumps(
            {
                "dataset": dataset,
                "steps": steps,
                "lr": lr,
                "batch_size": batch_size,
                "seed": seed,
                "embedding_dim": embedding_dim,
                "backbone": backbone,
                "frozen_bn": frozen_bn,
                "dataset_options": dict(options),
                "split_seed": split_seed,
                "data_dir": data_dir,
                "threads": threads,
            }
        )
    )


def read_pretrain_settings(output: str | Path) -> dict[str, Any]:
    """The arguments of the pretraining in ``output`` (its ``pretrain.json``).

    Raises:
        ConfigError: ``output`` holds no pretraining of this version (no or a corrupt file).
    """
    path = Path(output) / SETTINGS_FILE
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"resume: {str(output)!r} holds no pretraining to resume (no {SETTINGS_FILE}); "
            "start one with `output` (a pretraining of an older version cannot be resumed)."
        ) from None
    except ValueError:
        raise ConfigError(f"resume: {path} is corrupt (not JSON); start afresh.") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"resume: {path} is corrupt (not a mapping); start afresh.")
    return settings


def _check_resumable(output: Path, settings: dict[str, Any]) -> None:
    saved = read_pretrain_settings(output)
    changed = sorted(key for key in settings if saved.get(key) != settings[key])
    if changed:
        shown = ", ".join(f"{key}={saved.get(key)!r} (now {settings[key]!r})" for key in changed)
        raise ConfigError(
            f"resume: the pretraining in {str(output)!r} was started with {shown}; resume it "
            f"with its own settings (`resume_pretraining`) or start afresh with `overwrite`."
        )


def pretrain(
    dataset: str,
    output: str | Path,
    *,
    steps: int = 400,
    lr: float = 1e-3,
    batch_size: int = 128,
    seed: int = 0,
    embedding_dim: int = 64,
    backbone: str = "small_cnn",
    frozen_bn: bool = True,
    dataset_options: Mapping[str, Any] | None = None,
    split_seed: int = 0,
    data_dir: str | None = None,
    threads: int | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress: bool | None = None,
    console: Console | None = None,
    callbacks: Sequence[CallbackLike] = (),
) -> dict[str, Any]:
    """Train ``backbone`` with cross-entropy on the categories of ``dataset``'s training sources.

    The steps run in the :class:`~rankwise.training.Trainer`'s loop: progress as ``rankwise
    train`` shows it, ``checkpoints/last.pt`` every 50 steps and at the end (written
    atomically), Ctrl-C / SIGTERM stop after the current step with a checkpoint
    (:class:`~rankwise.training.TrainingInterrupted`), ``metrics.jsonl`` records the loss.

    Args:
        dataset: an instance benchmark, e.g. ``"fashion-mnist-instances"``.
        output: folder for ``pretrained.pt``, ``report.json``, the checkpoints and
            ``pretrain.json`` (these arguments); locked while written.
        steps: Adam steps of ``batch_size`` fresh views of random training sources (>= 1).
        lr: Adam's learning rate.
        batch_size: views per step.
        seed: seed of the weights, the batches and the views.
        embedding_dim: the embedding model's ``embedding_dim`` (its head stays as initialised).
        backbone: the embedding model's backbone name.
        frozen_bn: the embedding model's ``frozen_bn``.
        dataset_options: ``dataset.options`` of the runs to fine-tune (the same sources).
        split_seed: ``dataset.split_seed`` of those runs.
        data_dir: ``dataset.data_dir``.
        threads: torch intra-op threads (``None`` keeps the default).
        overwrite: replace a pretraining in ``output`` (its files are deleted first).
        resume: continue the interrupted pretraining in ``output`` from its last checkpoint;
            the other arguments must be the ones it was started with
            (:func:`resume_pretraining` reads them).
        progress: a progress bar (``None``: in a terminal; plain lines every 10 s otherwise).
        console: a rich console for the progress and messages (default: stderr).
        callbacks: extra callbacks of the loop (see :class:`~rankwise.training.Trainer`).

    Returns:
        The report (also written to ``report.json``).

    Raises:
        ConfigError: a bad argument, an ``output`` that holds results (without ``overwrite`` /
            ``resume``), or a ``resume`` with other arguments.
        TrainingInterrupted: Ctrl-C or SIGTERM; ``resume_pretraining(output)`` continues.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"steps: pretraining needs at least one step, got {steps!r}.")
    if resume and overwrite:
        raise ConfigError(
            "pretrain: `resume` continues the pretraining and `overwrite` deletes it; pass one."
        )
    if threads is not None:
        torch.set_num_threads(threads)
    options = dict(dataset_options or {})
    dataset = DATASET_ALIASES.get(dataset.lower(), dataset.lower())
    output = Path(output)
    settings = _settings(
        dataset,
        steps,
        lr,
        batch_size,
        seed,
        (embedding_dim, backbone, frozen_bn),
        (options, split_seed, data_dir),
        threads,
    )

    def check() -> None:
        if resume:
            _check_resumable(output, settings)
        elif (output / PRETRAINED_FILE).exists() and not overwrite:
            raise ConfigError(
                f"output: {output / PRETRAINED_FILE} exists; pass `overwrite` to replace it."
            )

    # the folder's one store: locked and checked before anything is loaded; a fresh start
    # deletes stale weights with the other outputs of an earlier run
    store = RunStore(output, key="resume" if resume else "output", stale=[output / PRETRAINED_FILE])
    store.open(resume=resume, overwrite=overwrite, check=check)
    try:
        categories = _categories(dataset, data_dir)
        splits = load_dataset(
            dataset, protocol="open-set", data_dir=data_dir, seed=split_seed, **options
        )
        train, val, test = splits.train, splits.val, splits.test
        # what build_instance_splits returns (source_ids: the pool index of each split's classes)
        assert isinstance(train, InstanceViews) and isinstance(test, ArrayDataset)
        assert val is None or isinstance(val, ArrayDataset)
        torch.manual_seed(seed)
        model = build_model(backbone, train.input_shape, embedding_dim, frozen_bn=frozen_bn)
        scratch = _spread(model, test)
        classifier = nn.Linear(backbone_width(model.backbone), int(categories.max()) + 1)
        net = nn.Sequential(model.backbone, classifier)
        batches = SourceBatches(
            train, torch.from_numpy(categories[train.source_ids]), batch_size, seed
        )
        metadata = {
            "backbone": backbone,
            "embedding_dim": embedding_dim,
            "frozen_bn": frozen_bn,
            "input_shape": list(train.input_shape),
            "dataset": {"name": dataset, "split_seed": split_seed, "options": options},
            "steps": steps,
            "seed": seed,
            "source_split_hash": source_split_hash(train.source_ids),
        }

        def finish(final_loss: float | None) -> dict[str, Any]:
            report = {
                "dataset": dataset,
                "steps": steps,
                "final_loss": final_loss,
                "train_accuracy": _accuracy(
                    _forward(net, train.batch(np.arange(len(train)), batches.generator)[0]),
                    batches.categories[train.labels].numpy(),
                ),
                "val_accuracy": None,
                "spread_scratch": scratch,
                "spread_pretrained": _spread(model, test),
            }
            if val is not None:
                val_ids = val.source_ids  # type: ignore[attr-defined]  # build_instance_splits sets it
                val_sources = np.asarray(val_ids, dtype=np.int64)[val.labels - val.labels.min()]
                report["val_accuracy"] = _accuracy(
                    _forward(net, val.batch(np.arange(len(val)))[0]), categories[val_sources]
                )
            atomic_save(
                {"model": model.state_dict(), "metadata": metadata}, output / PRETRAINED_FILE
            )
            write_json(report | {"metadata": metadata}, output / "report.json")
            return report

        end = _WriteResults(finish, batches)
        trainer = _build(net, batches, end, store, settings, progress, console, callbacks)
        trainer.fit(test=False)
        assert end.report is not None
        return end.report
    finally:
        store.release()


def _build(
    net: nn.Module,
    batches: SourceBatches,
    end: _WriteResults,
    store: RunStore,
    settings: dict[str, Any],
    progress: bool | None,
    console: Console | None,
    callbacks: Sequence[CallbackLike],
) -> Trainer:
    """The trainer of the pretraining; a fresh one records its settings in ``pretrain.json``."""
    rng = torch.get_rng_state()  # the trainer's checks draw a view: the old loop did not
    trainer = Trainer(
        net,
        nn.CrossEntropyLoss(),
        batches.train,
        sampler=batches,  # its length is the epoch's; the batches come from its draw()
        batch_source=batches,
        end_policy=end,
        resume_hint=f"resume_pretraining({str(store.root)!r})",
        activity="pretraining",
        optimizer=torch.optim.Adam(net.parameters(), lr=settings["lr"]),
        run_dir=store,
        callbacks=[batches, *callbacks],
        schedule=Schedule(iterations=settings["steps"], eval_every=CHECKPOINT_EVERY),
        runtime=Runtime(
            seed=settings["seed"],
            deterministic=False,  # as the loop it replaces (the weights stay bit-identical)
            detect_collapse=False,  # logits, not embeddings
        ),
        logging=Logging(
            progress=progress,
            console=console,
            name=f"pretraining on {settings['dataset']}",
            loss_name="cross-entropy",
        ),
    )
    if not store.resuming:
        torch.set_rng_state(rng)
        assert store.root is not None
        atomic_write_text(json.dumps(settings, indent=2) + "\n", store.root / SETTINGS_FILE)
    return trainer


def resume_pretraining(
    output: str | Path,
    *,
    progress: bool | None = None,
    console: Console | None = None,
    callbacks: Sequence[CallbackLike] = (),
) -> dict[str, Any]:
    """Continue the interrupted pretraining in ``output`` with its own settings (``pretrain.json``).

    Args:
        output: the pretraining's folder.
        progress: see :func:`pretrain`.
        console: see :func:`pretrain`.
        callbacks: see :func:`pretrain`.

    Returns:
        The report, as the uninterrupted pretraining returns it (the same numbers, bit for bit).
    """
    settings = read_pretrain_settings(output)
    return pretrain(
        settings.pop("dataset"),
        output,
        resume=True,
        progress=progress,
        console=console,
        callbacks=callbacks,
        **settings,
    )
