"""The Trainer's settings in three groups: :class:`Schedule`, :class:`Runtime`, :class:`Logging`.

How long it trains (:class:`Schedule`), how it runs (:class:`Runtime`) and what it records and
shows (:class:`Logging`).
Each group is a small frozen dataclass whose fields are checked when it is made, each error naming
the field as the Trainer's keyword of the same name (``iterations``, ``seed``, ``log_every``, ...):
the keywords ``Trainer(..., iterations=300)`` of earlier versions fill the same fields
(:func:`group_options`). The loop of Wen et al. (NeurIPS 2022), Sec. 5.1, is unchanged by them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from .._validation import check_bool, check_choice
from .arguments import LRSchedule, check_schedule, positive_int

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["PRECISIONS", "Logging", "Runtime", "Schedule", "group_options"]

#: the precisions of the forward pass (:mod:`rankwise.training.step`): float32, bfloat16
#: autocast, float16 autocast with loss scaling
PRECISIONS = ("32", "bf16", "16")


def _set(group: object, name: str, value: Any) -> None:
    """Store a checked value in a frozen group (only while it is made)."""
    object.__setattr__(group, name, value)


@dataclass(frozen=True)
class Schedule:
    """How long the run trains, at which learning rate, and when it evaluates.

    Args:
        iterations: the budget in optimizer steps; or
        epochs: the budget in passes of the sampler (default 1 when neither is given).
        lr_schedule: a function ``step -> learning rate`` (0-based) or a torch ``LRScheduler``
            (checkpointed); ``None`` keeps the optimizer's.
        eval_every: steps between evaluations and checkpoints (default: once per epoch).

    Example:
        >>> Schedule(iterations=300, eval_every=75).total_steps(steps_per_epoch=40)
        300
        >>> Schedule(epochs=2).total_steps(steps_per_epoch=40)
        80
    """

    iterations: int | None = None
    epochs: int | None = None
    lr_schedule: LRSchedule | None = None
    eval_every: int | None = None

    def __post_init__(self) -> None:
        if self.iterations is not None and self.epochs is not None:
            raise ValueError("pass `iterations` or `epochs`, not both.")
        if self.iterations is not None:
            _set(self, "iterations", positive_int(self.iterations, "iterations"))
        if self.epochs is not None:
            _set(self, "epochs", positive_int(self.epochs, "epochs"))
        if self.eval_every is not None:
            _set(self, "eval_every", positive_int(self.eval_every, "eval_every"))
        check_schedule(self.lr_schedule)

    def total_steps(self, steps_per_epoch: int) -> int:
        """The budget in optimizer steps, for a sampler of ``steps_per_epoch`` batches.

        Returns:
            ``iterations``, else ``epochs`` (default 1) times ``steps_per_epoch``.
        """
        if self.iterations is not None:
            return self.iterations
        return (1 if self.epochs is None else self.epochs) * steps_per_epoch

    @property
    def lr_function(self) -> Callable[[int], float] | None:
        """The per-step learning-rate function (``None``: a torch scheduler, or none)."""
        return check_schedule(self.lr_schedule)

    def scheduler_state(self) -> dict[str, Any] | None:
        """The torch scheduler's state, for a checkpoint (``None``: a function, or none)."""
        scheduler = self.lr_schedule
        if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            return scheduler.state_dict()
        return None

    def load_scheduler_state(self, state: Mapping[str, Any] | None) -> None:
        """Continue the torch scheduler from :meth:`scheduler_state`'s output (``None``: none).

        Raises:
            ValueError: a scheduler's state, and no torch scheduler to continue.
        """
        if state is None:
            return
        if not isinstance(self.lr_schedule, torch.optim.lr_scheduler.LRScheduler):
            raise ValueError(
                "the checkpoint holds a learning-rate scheduler: pass the same `lr_schedule`."
            )
        self.lr_schedule.load_state_dict(dict(state))


@dataclass(frozen=True)
class Runtime:
    """Where and how reproducibly the run trains.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"auto"`` or a ``torch.device`` (default: where the
            model's parameters are).
        seed: seeds the default sampler, the per-item transform seeds and the data loaders, not
            the model's initialisation (``torch.manual_seed`` before building it).
        num_workers: DataLoader worker processes (batches do not depend on it).
        deterministic: deterministic algorithms (warn-only) and cuDNN during training.
        detect_collapse: stop when every score ties
            (:class:`~rankwise.training.callbacks.CollapseDetector`).
        precision: ``"32"``, ``"bf16"`` or ``"16"``: autocast of the forward pass, loss scaling
            for ``"16"`` (:class:`~rankwise.training.step.OptimizerStep`).
        sub_batch_size: embed each batch in chunks of this many rows, then back-propagate the
            loss's gradient chunk by chunk (``None``: one pass; the same step up to rounding).
    """

    device: str | torch.device | None = None
    seed: int = 0
    num_workers: int = 0
    deterministic: bool = True
    detect_collapse: bool = True
    precision: str = "32"
    sub_batch_size: int | None = None

    def __post_init__(self) -> None:
        precision = self.precision
        if isinstance(precision, int) and not isinstance(precision, bool):
            precision = str(precision)  # 16 / 32 as YAML reads them
        _set(self, "precision", check_choice(precision, "precision", PRECISIONS))
        if self.sub_batch_size is not None:
            _set(self, "sub_batch_size", positive_int(self.sub_batch_size, "sub_batch_size"))
        _set(self, "seed", positive_int(self.seed, "seed", 0))
        _set(self, "num_workers", positive_int(self.num_workers, "num_workers", 0))
        _set(self, "deterministic", check_bool(self.deterministic, "deterministic"))
        _set(self, "detect_collapse", check_bool(self.detect_collapse, "detect_collapse"))


@dataclass(frozen=True)
class Logging:
    """What the run records and shows, and how its messages name it.

    Args:
        log_every: steps between training records in the history (and progress updates).
        progress: show a progress bar (``None``: only when stdout is a terminal).
        console: a rich console for messages and the progress bar (default: stderr).
        name: the run's name on the progress bar and plots (default: ``loss_name``).
        loss_name: the loss's name in messages (default: its class name).
    """

    log_every: int = 10
    progress: bool | None = None
    console: Console | None = None
    name: str | None = None
    loss_name: str | None = None

    def __post_init__(self) -> None:
        _set(self, "log_every", positive_int(self.log_every, "log_every"))
        if self.progress is not None:
            _set(self, "progress", check_bool(self.progress, "progress"))


_G = TypeVar("_G", Schedule, Runtime, Logging)


def group_options(group: _G | None, kind: type[_G], options: dict[str, Any], keyword: str) -> _G:
    """The settings group of a Trainer: ``group`` itself, or made from its fields in ``options``.

    The fields found are removed from ``options``.

    Args:
        group: the group passed whole (or ``None``).
        kind: its class.
        options: the Trainer's keyword options.
        keyword: the Trainer's keyword of the group, for the error.

    Returns:
        The group.

    Raises:
        TypeError: the group and some of its fields were both passed.
    """
    names = {f.name for f in fields(kind)}
    flat: Mapping[str, Any] = {k: options.pop(k) for k in list(options) if k in names}
    if group is None:
        return kind(**flat)
    if flat:
        raise TypeError(
            f"pass `{keyword}` or its fields ({', '.join(sorted(flat))}), not both: "
            f"e.g. {keyword}={kind.__name__}({', '.join(f'{k}=...' for k in sorted(flat))})."
        )
    if not isinstance(group, kind):
        raise TypeError(f"`{keyword}` must be a {kind.__name__}, got {type(group).__name__}.")
    return group
