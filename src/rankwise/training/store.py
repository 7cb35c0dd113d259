"""A run on disk: its folder's lock, its checkpoints, its resumption and its result.

:class:`RunStore` is the one writer of a run folder (file names: :class:`RunPaths`): it locks the
folder (:mod:`rankwise.training.lock`) and applies the results rule, writes ``checkpoints/last.pt``
(every state, e.g. SOPRC's ``v`` of Wen et al., NeurIPS 2022, Eq. (10)) and ``checkpoints/best.pt``
(the model selected on validation), reads the checkpoint a run resumes from, and writes
``config.yaml`` and the :class:`RunResult` (``report.json`` / ``pr_curve.json``). It takes state
dicts, never the trainer; with several processes it agrees with them through the strategy (rank 0
writes).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from .._validation import check_bool
from .arguments import check_run_options
from .checkpoint import atomic_save, atomic_write_text, keep_previous, load_checkpoint
from .errors import ConfigError, CorruptCheckpointError, DiskFullError
from .lock import RunDirLock, lock_run_dir
from .result import RunResult
from .rundir import (
    RunPaths,
    existing_results,
    never_checkpointed,
    readable_checkpoint_step,
    remove_stale_temporaries,
)
from .strategy import SingleProcess

__all__ = [
    "RunPaths",
    "RunResult",
    "RunStore",
    "fallback_checkpoint",
    "refuse_results",
    "run_store",
]


def refuse_results(run_dir: Path, key: str) -> None:
    """The one rule of train, bench and tune: results are never overwritten silently."""
    found = existing_results(run_dir)
    if found and never_checkpointed(run_dir):
        raise ConfigError(
            f"{key}: {str(run_dir)!r} already holds a run that stopped before its first "
            f"checkpoint ({', '.join(found)}); train it again from step 0 with its config.yaml "
            "with `resume`, or start afresh with `overwrite`, which deletes its records (or "
            f"choose another `{key}`)."
        )
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


def _format1_callback_states(state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The callback states of a format-1 checkpoint (best-so-far and loss window at top level)."""
    return {
        "best_checkpoint": {
            "best_value": state.get("best_map"),
            "best_step": state.get("best_step"),
            "best_val": state.get("best_val"),
        },
        "metrics_logger": {"window_losses": state.get("window_losses", [])},
    }


class RunStore:
    """The run folder of one run: lock, checkpoints, resumption and result (the one writer).

    Without a folder (``run_dir=None``) nothing is written: the selected model is kept in
    memory and there is nothing to resume. A run folder is locked against other processes from
    :meth:`open` to :meth:`release` (rank 0 holds the lock of a data-parallel run); a later
    :meth:`reopen` refuses a folder another process wrote meanwhile.

    Args:
        run_dir: the run folder (``None``: no file).
        strategy: the processes of the run (default: one process); rank 0 writes.
        key: the argument or config key that named ``run_dir``, for messages.
        record: what ``config.yaml`` and every checkpoint hold as the run's config (the
            factory's plain dict of the config; ``None``: a run built from objects, no
            ``config.yaml``). Opaque to the store and the trainer.
        stale: more files of an earlier run that a fresh run deletes first (besides
            :meth:`RunPaths.stale_outputs`).

    Attributes:
        root: the run folder (``None``: no file).
        paths: its file names.
        key: see above.
        record: see above.
        strategy: see above.
        last_step: the step of ``checkpoints/last.pt`` once this store wrote or read it.
        resuming: :meth:`open` was asked to resume a run with a checkpoint (the trainer then
            reads :meth:`read_resume_state`).
        restarted: :meth:`open` was asked to resume a run that stopped before its first
            checkpoint (:func:`~rankwise.training.rundir.never_checkpointed`): it trains again
            from step 0 (``resuming`` is then ``False``).
        data_record: what :meth:`prepare` writes to ``data.json`` (the fingerprint of the run's
            data, :func:`~rankwise.training.data_record.data_fingerprint`; ``None``: nothing).
        extended_from: the budget (in steps) of a run whose budget a resumption extended
            (``None``: not extended); :meth:`prepare` then deletes the test result of the
            shorter run (``report.json``, the PR curve), which a new one replaces at the end.
        is_open: :meth:`open` was called (the lock is then held until :meth:`release`).

    Example:
        Objects-only runs need no folder; everything stays in memory:

        >>> store = RunStore(None).open()
        >>> store.root is None, store.kept_message()
        (True, 'nothing was saved (the trainer has no run_dir)')
    """

    FORMAT = 2  # the checkpoint format written (1 is still read)

    def __init__(
        self,
        run_dir: str | Path | None,
        *,
        strategy: SingleProcess | None = None,
        key: str = "run_dir",
        record: Mapping[str, Any] | None = None,
        stale: Sequence[str | Path] = (),
    ) -> None:
        self.root = None if run_dir is None else Path(run_dir)
        self.paths = RunPaths(self.root if self.root is not None else Path())
        self.strategy = strategy if strategy is not None else SingleProcess()
        self.key = key
        self.record = None if record is None else dict(record)
        self.last_step: int | None = None
        self.resuming = False
        self.restarted = False
        self.data_record: dict[str, Any] | None = None
        self.extended_from: int | None = None
        self.is_open = False
        self._stale = tuple(Path(p) for p in stale)
        self._resume_from: Path | None = None
        self._lock: RunDirLock | None = None
        self._left: tuple[int, int, int] | None = None
        # whether checkpoints/last.pt is known good (written or read by this store): only then
        # is it kept as previous.pt when the next checkpoint replaces it
        self._last_is_good = False
        self._best_in_memory: dict[str, torch.Tensor] | None = None

    def adopt_record(self, record: Mapping[str, Any]) -> None:
        """Hold ``record`` as the run's config from now on (a resumed run's, read once locked).

        Args:
            record: the config's plain dict, what ``config.yaml`` and the checkpoints go on
                holding.
        """
        self.record = dict(record)

    def adopt_extension(self, record: Mapping[str, Any], from_steps: int) -> None:
        """Hold ``record``, whose budget a resumption extended from ``from_steps`` steps.

        Args:
            record: the extended config's plain dict (:meth:`adopt_record`).
            from_steps: the budget the run had before, in steps (``extended_from``).
        """
        self.adopt_record(record)
        self.extended_from = from_steps

    def adopt_data_record(self, record: Mapping[str, Any]) -> None:
        """Hold the fingerprint of the run's data, written to ``data.json`` by :meth:`prepare`.

        Args:
            record: :func:`~rankwise.training.data_record.data_fingerprint` and the data folder.
        """
        self.data_record = dict(record)

    # -- the folder's lock ----------------------------------------------------------------------

    def open(
        self,
        *,
        resume: bool = False,
        overwrite: bool = False,
        resume_from: str | Path | None = None,
        check: Callable[[], None] | None = None,
    ) -> RunStore:
        """Lock the folder, run ``check``, then apply the results rule (once per run).

        A refusal releases the lock. Without a folder only the options are checked.

        Args:
            resume: the run continues the checkpoint in the folder (see
                :meth:`read_resume_state`); a run there that stopped before its first
                checkpoint starts again from step 0 (``restarted``).
            overwrite: start afresh in a folder holding a run (its results are deleted when
                :meth:`prepare` runs at step 0).
            resume_from: with ``resume``, the checkpoint to continue from instead of ``last.pt``.
            check: more checks of the locked folder (e.g. the caller's own results rule).

        Returns:
            The store itself.

        Raises:
            ConfigError: the folder holds a run (without ``resume`` / ``overwrite``), or
                ``check`` refused it (a :class:`~rankwise.training.lock.RunDirInUseError` when
                another process holds it).
            ValueError: the options do not fit together.
        """
        check_run_options(self.root, resume, overwrite, resume_from)
        self.is_open = True
        self.resuming = resume
        self._resume_from = None if resume_from is None else Path(resume_from)
        if self.root is None:
            return self
        rule = None if resume or overwrite else self._refuse_results
        self._take(then="resume it" if resume else None, checks=(check, rule))
        if resume and resume_from is None and never_checkpointed(self.root):
            # nothing to continue: the run trains again from step 0 (every rank sees the files)
            self.resuming, self.restarted = False, True
        self._left = self._fingerprint()
        return self

    def _refuse_results(self) -> None:
        assert self.root is not None
        refuse_results(self.root, self.key)

    def _take(self, then: str | None, checks: Sequence[Callable[[], None] | None]) -> None:
        """Lock the folder on the main process, run ``checks``; every rank learns a refusal."""
        assert self.root is not None
        root, key = self.root, self.key

        def take() -> RunDirLock:
            lock = lock_run_dir(root, key, then=then)
            try:
                for check in checks:
                    if check is not None:
                        check()
            except BaseException:
                lock.release()
                raise
            return lock

        self._lock = self.strategy.lock(take, root)

    @property
    def holds(self) -> bool:
        """Whether this store holds the folder now (always ``False`` without a folder)."""
        return self._lock is not None

    def release(self) -> None:
        """Give the folder's lock back (remembering which ``last.pt`` this run leaves)."""
        if self._lock is not None:
            self._left = self._fingerprint()
            self._lock.release()
        self._lock = None

    def reopen(self) -> None:
        """Lock the folder again for a later ``fit``; refuse it if another process wrote it since.

        Raises:
            ConfigError: its ``checkpoints/last.pt`` changed since :meth:`release`.
        """
        if self.root is None or self.holds:
            return
        self._take(then="resume it", checks=(self._check_unchanged,))

    def _fingerprint(self) -> tuple[int, int, int] | None:
        """Identity of ``checkpoints/last.pt`` (every save replaces the file: a new inode)."""
        try:
            info = self.paths.last.stat()
        except FileNotFoundError:
            return None
        return info.st_ino, info.st_mtime_ns, info.st_size

    def _check_unchanged(self) -> None:
        if self._fingerprint() != self._left:
            raise ConfigError(
                f"{self.key}: {str(self.root)!r} was written by another process since this "
                "trainer last trained in it (its checkpoints/last.pt changed); build a new "
                "trainer to continue from what it holds (`resume`)."
            )

    # -- messages -------------------------------------------------------------------------------

    @property
    def last_good_checkpoint(self) -> Path | None:
        """``checkpoints/last.pt`` once a checkpoint was written (or read) in this run."""
        if self.root is None or self.last_step is None:
            return None
        return self.paths.last

    def kept_message(self) -> str:
        """A clause for error messages: ``"the last good checkpoint (...) is kept"`` or why not."""
        if self.root is None:
            return "nothing was saved (the trainer has no run_dir)"
        if self.last_step is None:
            return "no checkpoint had been written yet"
        return f"the last good checkpoint ({self.paths.last}, step {self.last_step}) is kept"

    @contextlib.contextmanager
    def naming_what_is_kept(self) -> Iterator[None]:
        """A full disk inside the block: say which run it is and which checkpoint is kept."""
        try:
            yield
        except DiskFullError as exc:
            raise exc.with_context(
                run_dir=self.root, kept=self.kept_message(), resumable=self.last_step is not None
            ) from None

    # -- the folder's files ---------------------------------------------------------------------

    def prepare(self, step: int) -> None:
        """Ready the folder for training from ``step`` (on the main process).

        Creates it, removes the temporaries of writes a killed run never finished, writes
        ``config.yaml`` (the record) and ``data.json`` (``data_record``) and, for a fresh run
        (``step`` 0), deletes an earlier run's checkpoints and outputs, so a crash before the
        first checkpoint cannot leave them to a resume; a run whose budget was extended loses
        the test result of its shorter budget.
        """
        if self.root is None or not self.strategy.is_main_process:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self.paths.checkpoints.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.root)
        if self.record is not None:
            atomic_write_text(yaml.safe_dump(self.record, sort_keys=False), self.paths.config)
        if step == 0:  # an earlier run's data.json too: this run may record none
            for stale in (*self.paths.stale_outputs(), self.paths.data, *self._stale):
                stale.unlink(missing_ok=True)
        elif self.extended_from is not None:
            for outdated in (self.paths.report, self.paths.pr_curve, self.paths.pr_curve_plot):
                outdated.unlink(missing_ok=True)
        if self.data_record is not None:
            atomic_write_text(json.dumps(self.data_record, indent=2) + "\n", self.paths.data)

    def save_result(self, result: RunResult) -> None:
        """Write ``report.json`` / ``pr_curve.json`` of a completed run (on the main process)."""
        if self.root is not None and self.strategy.is_main_process:
            result.save(self.root)

    # -- checkpoints ----------------------------------------------------------------------------

    def save_last(self, state: Mapping[str, Any]) -> Path:
        """Write ``checkpoints/last.pt`` atomically with ``state`` (its ``"step"`` included).

        The good checkpoint it replaces is kept as ``previous.pt``. A collective: no process
        goes on before the main one has written it, and all learn if it failed.

        Returns:
            The checkpoint's path.

        Raises:
            ValueError: the store has no folder.
            DiskFullError: no space left for it; the earlier checkpoints are intact.
        """
        if self.root is None:
            raise ValueError("the trainer has no `run_dir` to write a checkpoint to.")
        path = self.paths.last
        failure: Exception | None = None
        try:
            if self.strategy.is_main_process:
                with self.naming_what_is_kept():
                    if self._last_is_good:
                        # an older good checkpoint survives whatever happens to the new one
                        keep_previous(path, self.paths.previous)
                    atomic_save(state, path)
            self.last_step = int(state["step"])
            self._last_is_good = True
        except Exception as exc:
            if self.strategy.world_size == 1:
                raise
            failure = exc  # the main process could not write: all must learn it
        # 1: failed, 2: disk full
        code = 0 if failure is None else 2 if isinstance(failure, DiskFullError) else 1
        code = self.strategy.worst_code(code)
        if failure is not None:
            raise failure
        if code == 2:
            raise DiskFullError(
                path,
                None,
                None,
                run_dir=self.root,
                kept=self.kept_message(),
                resumable=self.last_step is not None,
                detail="rank 0 found no space left; see its message",
            )
        if code:
            raise RuntimeError(
                f"rank 0 could not write the checkpoint {path}; see its error message."
            )
        return path

    def save_best(
        self,
        step: int,
        val: Mapping[str, Any],
        model_state: Mapping[str, torch.Tensor],
        loss_state: Mapping[str, Any],
    ) -> None:
        """Keep the model selected on validation: ``checkpoints/best.pt``, or in memory.

        ``best.pt`` holds ``{"format", "step", "val", "config", "model", "loss"}``; the main
        process writes it atomically. Without a folder every process keeps a copy of the weights.

        Args:
            step: the step of the selected model.
            val: its validation report summary.
            model_state: the model's ``state_dict``.
            loss_state: the loss's ``state_dict``.
        """
        if self.root is None:
            self._best_in_memory = {k: v.detach().clone() for k, v in model_state.items()}
            return
        if not self.strategy.is_main_process:  # rank 0 writes it (and hands it over)
            return
        with self.naming_what_is_kept():
            atomic_save(
                {
                    "format": self.FORMAT,
                    "step": step,
                    "val": val,
                    "config": self.record,
                    "model": model_state,
                    "loss": loss_state,
                },
                self.paths.best,
            )

    def best_weights(self, device: str | torch.device) -> dict[str, torch.Tensor] | None:
        """This process's copy of the selected weights (``None``: none selected)."""
        if self.root is None:
            return self._best_in_memory
        if self.paths.best.is_file():
            model: dict[str, torch.Tensor] = load_checkpoint(self.paths.best, device)["model"]
            return model
        return None

    def selected_weights(self, device: str | torch.device) -> dict[str, torch.Tensor] | None:
        """The weights selected on validation, the same on every process (a collective).

        Returns:
            The ``state_dict`` on ``device``, or ``None`` when none was selected.
        """
        if self.root is None:  # every process kept the same selected weights in memory
            return self._best_in_memory
        return self.strategy.from_main_process(lambda: self.best_weights(device))

    def read_resume_state(self, map_location: str | torch.device) -> dict[str, Any]:
        """The checkpoint to resume (``last.pt`` or ``resume_from``), checked.

        A format-1 checkpoint's callback states are given in the format-2 layout.

        Raises:
            CorruptCheckpointError: it cannot be read (naming an older one that loads, if any).
            ConfigError: it is missing, of an unknown format, or of another world size.
        """
        last = self.paths.last
        target = last if self._resume_from is None else self._resume_from
        try:
            state = load_checkpoint(target, map_location=map_location)
        except CorruptCheckpointError as exc:
            fallback = fallback_checkpoint(self.root, exclude=target) if self.root else {}
            raise exc.with_context(run_dir=self.root, **fallback) from None
        except FileNotFoundError:
            raise ConfigError(f"run_dir: checkpoint {str(target)!r} does not exist.") from None
        self._last_is_good = target == last
        fmt = state.get("format")
        if fmt not in (1, self.FORMAT):
            raise ConfigError(f"run_dir: unsupported checkpoint format {fmt!r}.")
        self._check_world_size(int(state.get("world_size", 1)))
        if fmt == 1:
            state = {**state, "callbacks": _format1_callback_states(state)}
        self.last_step = int(state["step"])
        return state

    def _check_world_size(self, saved: int) -> None:
        world = self.strategy.world_size
        if saved == world:
            return
        how = (
            f"under torchrun --nproc-per-node {saved} ..."
            if saved > 1
            else "in one process, without torchrun"
        )
        raise ConfigError(
            f"run_dir: the checkpoint was written by a run of {saved} data-parallel "
            f"process(es) and this run has {world}; each process's batches and random streams "
            f"depend on that number, so resume with {saved} process(es) ({how})."
        )

    def check_best(self, best_step: int | None) -> None:
        """A resumed run's ``best.pt`` (of ``best_step``) must load: the final test evaluates it.

        Raises:
            CorruptCheckpointError: it is missing or corrupt, with what to do.
        """
        if best_step is None or self.root is None:
            return
        path = self.paths.best
        try:
            load_checkpoint(path, map_location="cpu")
        except FileNotFoundError:
            reason = "it is missing"
        except CorruptCheckpointError as exc:
            reason = exc.reason
        else:
            return
        retrain = (
            f"from its config ({self.paths.config}) with `overwrite`"
            if self.record is not None
            else "with the same objects and overwrite=True"
        )
        raise CorruptCheckpointError(
            path,
            reason,
            run_dir=self.root,
            advice=(
                f"It held the model selected on validation (step {best_step}), which the "
                f"final test evaluates; no other copy exists. Train the run again {retrain}."
            ),
        )


def run_store(
    run_dir: str | Path | RunStore | None, strategy: SingleProcess, folder: Mapping[str, Any]
) -> tuple[RunStore, dict[str, Any] | None]:
    """The store of a Trainer's ``run_dir``, and how to open it (``None``: opened already).

    Args:
        run_dir: a folder path (``None``: no file), or a :class:`RunStore` (the factory's,
            opened here if it was not).
        strategy: the trainer's processes.
        folder: how a path is opened: ``resume``, ``overwrite``, ``resume_from``,
            ``run_dir_key``, ``record`` (``config``: a Config whose ``to_dict()`` is the record).

    Returns:
        ``(store, opening)``: the keywords of :meth:`RunStore.open` for a path.

    Raises:
        ValueError: ``folder`` options with a given store, a store of another world size, or
            options that do not fit together (named).
    """
    if isinstance(run_dir, RunStore):
        if folder:
            raise ValueError(
                f"{', '.join(f'`{k}`' for k in folder)}: the given RunStore was opened "
                "with its own; pass them to RunStore(...) / RunStore.open(...) instead."
            )
        if run_dir.strategy.world_size != strategy.world_size:
            raise ValueError(
                "`run_dir`: the RunStore was made for "
                f"{run_dir.strategy.world_size} process(es) and the trainer's `strategy` "
                f"has {strategy.world_size}; give both the same strategy."
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
        root, strategy=strategy, key=folder.get("run_dir_key", "run_dir"), record=record
    )
    return store, opening
