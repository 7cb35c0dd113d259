"""A run on disk: its result (:class:`RunResult`) and the Trainer's part that owns its directory.

:class:`RunResult` writes and reads ``report.json`` / ``pr_curve.json``; :class:`RunState` holds
the directory's lock, the checkpoints (every state, e.g. SOPRC's ``v`` of Wen et al., NeurIPS 2022,
Eq. (10)) and resumption. File names: :class:`~rankwise.training.rundir.RunPaths`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import yaml
from torch import nn

from ..metrics import PRCurve, RetrievalReport
from .arguments import LRSchedule
from .callbacks import BestCheckpoint
from .callbacks.host import CallbackHost
from .checkpoint import (
    atomic_save,
    atomic_write_text,
    capture_rng_state,
    keep_previous,
    load_checkpoint,
)
from .config import Config, read_config_file
from .errors import ConfigError, CorruptCheckpointError, DiskFullError, ReplicaDivergenceError
from .lock import RunDirLock, lock_run_dir
from .rundir import RunPaths, existing_results, readable_checkpoint_step, remove_stale_temporaries

if TYPE_CHECKING:
    from .strategy import SingleProcess

__all__ = ["RunPaths", "RunResult", "RunState", "fallback_checkpoint", "refuse_results"]


def _report_from_dict(data: dict[str, Any]) -> RetrievalReport:
    """A :class:`~rankwise.metrics.RetrievalReport` from its ``to_dict()`` (``report.json``)."""
    values = dict(data)
    values["recall_at"] = {int(k): float(v) for k, v in values["recall_at"].items()}
    values["precision_at"] = {int(k): float(v) for k, v in values["precision_at"].items()}
    values["clamped_ks"] = {int(k): int(v) for k, v in (values.get("clamped_ks") or {}).items()}
    values["ks"] = tuple(int(k) for k in values["ks"])
    values["per_query_ap"] = torch.tensor(
        [np.nan if v is None else float(v) for v in values["per_query_ap"]], dtype=torch.float64
    )
    names = {f.name for f in fields(RetrievalReport)}
    return RetrievalReport(**{k: v for k, v in values.items() if k in names})


@dataclass
class RunResult:
    """Outcome of :meth:`Trainer.fit <rankwise.training.Trainer.fit>`.

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

    def save(self, run_dir: str | Path) -> None:
        """Write ``report.json`` (and ``pr_curve.json``, if any) in ``run_dir``, atomically."""
        paths = RunPaths(Path(run_dir))
        atomic_write_text(json.dumps(self.to_dict(), indent=2) + "\n", paths.report)
        if self.pr_curve is not None:
            data = {
                "recall": [float(v) for v in self.pr_curve.recall],
                "precision": [float(v) for v in self.pr_curve.precision],
                "n_queries": int(self.pr_curve.n_queries),
            }
            atomic_write_text(json.dumps(data) + "\n", paths.pr_curve)

    @classmethod
    def load(cls, run_dir: str | Path, with_test: bool = True) -> RunResult | None:
        """The result :meth:`save` wrote in ``run_dir`` (``None``: no completed run there).

        Args:
            run_dir: the run directory.
            with_test: the test report and curve are needed (``None`` without them).

        Returns:
            The :class:`RunResult` of the completed run (its ``config`` read from
            ``config.yaml`` when there is one), or ``None``.
        """
        paths = RunPaths(Path(run_dir))
        try:
            report = json.loads(paths.report.read_text())
        except (FileNotFoundError, ValueError):
            return None
        if report.get("status") != "completed":
            return None
        test, curve = None, None
        if with_test:
            try:
                data = json.loads(paths.pr_curve.read_text())
            except (FileNotFoundError, ValueError):
                return None
            if report.get("test") is None:
                return None
            test = _report_from_dict(report["test"])
            curve = PRCurve(
                recall=np.asarray(data["recall"], dtype=np.float64),
                precision=np.asarray(data["precision"], dtype=np.float64),
                n_queries=int(data["n_queries"]),
            )
        return cls(
            run_dir=paths.root,
            status="completed",
            steps=int(report["steps"]),
            seconds=float(report["seconds"]),
            best_step=report.get("best_step"),
            best_val=report.get("best_val"),
            test=test,
            pr_curve=curve,
            config=read_config_file(paths.config) if paths.config.is_file() else {},
        )


def refuse_results(run_dir: Path, key: str) -> None:
    """The one rule of train, bench and tune: results are never overwritten silently."""
    found = existing_results(run_dir)
    if found:
        raise ConfigError(
            f"{key}: {str(run_dir)!r} already holds a run ({', '.join(found)}); continue it "
            "with `resume` or start afresh with `overwrite`, which deletes its results (or "
            f"choose another `{key}`)."
        )


def fallback_checkpoint(run_dir: Path | None, exclude: Path | None = None) -> dict[str, Any]:
    """``{"fallback", "fallback_step"}`` of an older checkpoint of the run that loads, or ``{}``."""
    if run_dir is None:
        return {}
    candidate = RunPaths(run_dir).previous
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


class RunState(CallbackHost):
    """The Trainer's run directory: its lock, its checkpoints, resumption (a mixin of Trainer)."""

    CHECKPOINT_FORMAT = 2
    run_dir: Path | None
    paths: RunPaths
    strategy: SingleProcess
    config: Config | None
    model: nn.Module
    loss_fn: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: LRSchedule | None
    device: torch.device
    step: int
    next_epoch: int
    next_position: int
    seconds: float
    last_checkpoint_step: int | None
    _tick: float
    _last_is_good: bool
    _run_dir_key: str
    _run_lock: RunDirLock | None
    _holds_run_dir: bool
    _left_checkpoint: tuple[int, int, int] | None

    def _account_time(self) -> None:
        now = time.perf_counter()
        self.seconds += now - self._tick
        self._tick = now

    @classmethod
    def _lock_run_dir(
        cls,
        run_dir: Path,
        key: str,
        *,
        resume: bool = False,
        check: Callable[[], None] | None = None,
        strategy: SingleProcess | None = None,
    ) -> RunDirLock:
        """Lock ``run_dir`` (on the main process), then run ``check``; a refusal releases it."""

        def take() -> RunDirLock:
            lock = lock_run_dir(run_dir, key, then="resume it" if resume else None)
            if check is not None:
                try:
                    check()
                except BaseException:
                    lock.release()
                    raise
            return lock

        return (strategy if strategy is not None else SingleProcess()).lock(take, Path(run_dir))

    def _take_run_dir(self, *, resume: bool, check: Callable[[], None] | None = None) -> None:
        assert self.run_dir is not None
        self._run_lock = self._lock_run_dir(
            self.run_dir, self._run_dir_key, resume=resume, check=check, strategy=self.strategy
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
            info = (self.paths.last).stat()
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
                refuse_results(self.run_dir, self._run_dir_key)
        except BaseException:
            self._release_run_dir()
            raise
        self._left_checkpoint = self._checkpoint_fingerprint()

    @property
    def last_good_checkpoint(self) -> Path | None:
        """``checkpoints/last.pt`` once a checkpoint was written in this run, else ``None``."""
        if self.run_dir is None or self.last_checkpoint_step is None:
            return None
        return self.paths.last

    def kept_checkpoint_message(self) -> str:
        """A clause for error messages: ``"the last good checkpoint (...) is kept"`` or why not."""
        if self.run_dir is None:
            return "nothing was saved (the trainer has no run_dir)"
        if self.last_checkpoint_step is None:
            return "no checkpoint had been written yet"
        return (
            f"the last good checkpoint ({self.paths.last}, step "
            f"{self.last_checkpoint_step}) is kept"
        )

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
            **self.strategy.rng_state(),
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
        self.check_replicas()
        self.strategy.gather_rng()
        path = self.paths.last
        try:
            self._write_checkpoint(path)
        except Exception as exc:
            if self.world_size == 1:
                raise
            failure: Exception | None = exc  # the main process could not write: all must learn it
        else:
            failure = None
        # no process goes on before the main one has written it; 1: failed, 2: disk full
        code = 0 if failure is None else 2 if isinstance(failure, DiskFullError) else 1
        code = self.strategy.worst_code(code)
        if failure is not None:
            raise failure
        if code == 2:
            raise DiskFullError(
                path,
                None,
                None,
                run_dir=self.run_dir,
                kept=self.kept_checkpoint_message(),
                resumable=self.last_checkpoint_step is not None,
                detail="rank 0 found no space left; see its message",
            )
        if code:
            raise RuntimeError(
                f"rank 0 could not write the checkpoint {path}; see its error message."
            )
        return path

    def _write_checkpoint(self, path: Path) -> None:
        self._account_time()
        state = self.state_dict()
        if self.is_main_process:
            with self._naming_what_is_kept():
                if self._last_is_good:
                    # an older good checkpoint survives whatever happens to the new one
                    keep_previous(path, self.paths.previous)
                atomic_save(state, path)
        self.last_checkpoint_step = self.step
        self._last_is_good = True

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
        last = self.paths.last
        target = last if path is None else path
        try:
            state = load_checkpoint(target, map_location=self.device)
        except CorruptCheckpointError as exc:
            fallback = fallback_checkpoint(self.run_dir, exclude=target) if self.run_dir else {}
            raise exc.with_context(run_dir=self.run_dir, **fallback) from None
        except FileNotFoundError:
            raise ConfigError(f"run_dir: checkpoint {str(target)!r} does not exist.") from None
        self._last_is_good = target == last
        return state

    def _check_best(self) -> None:
        """A resumed run's ``best.pt`` must load: the final test evaluates it."""
        best = self._callback(BestCheckpoint)
        path = self.paths.best
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
        self.strategy.restore_rng(state)
        states = state.get("callbacks", {}) if fmt != 1 else _format1_callback_states(state)
        for callback in self.callbacks:
            if callback.state_key is not None and callback.state_key in states:
                callback.load_state_dict(states[callback.state_key])
        self._check_best()

    def _prepare_run_dir(self) -> None:
        if self.run_dir is None or not self.is_main_process:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.paths.checkpoints.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.run_dir)  # of writes a killed run never finished
        if self.config is not None:
            atomic_write_text(
                yaml.safe_dump(self.config.to_dict(), sort_keys=False),
                self.paths.config,
            )
        if self.step == 0:
            # a fresh run (possibly overwriting one): drop the previous run's checkpoints and
            # outputs, so a crash before the first checkpoint cannot leave them to a resume
            for stale in self.paths.stale_outputs():
                stale.unlink(missing_ok=True)

    # -- the processes of the run (see rankwise.training.strategy) -----------------------------

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
