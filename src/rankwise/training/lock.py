"""One writer per run folder: an exclusive, crash-safe lock on a run or sweep directory.

Two processes writing one folder mix their files, so every writer (a run, a ``bench`` / ``tune``
/ hash sweep) holds the folder's lock until done; a second one is refused with a message naming
the first (pid, host, start time, command line). It is a ``fcntl.flock`` on ``.rankwise.lock``
in the folder, which records the holder; the kernel drops it when the process ends (``kill -9``
too), so a stale file is taken over. Re-entrant within a process; not inherited by forked
children. Without ``fcntl`` (not Linux/macOS) a warning says the folder is not locked.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from .errors import ConfigError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "RunDirInUseError", "RunDirLock", "lock_run_dir"]

LOCK_FILE = ".rankwise.lock"


class RunDirInUseError(ConfigError):
    """Another process holds the lock of the folder.

    Attributes:
        directory: the folder.
        holder: what the holder recorded (``pid``, ``host``, ``started``, ``command``; empty when
            it had not written it yet).
    """

    def __init__(self, message: str, directory: Path, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.directory = directory
        self.holder = holder


@dataclass
class _Held:
    """A folder this process has locked: its lock file, how many holds, what the lock created."""

    fd: int
    holds: int
    created: list[Path] = field(default_factory=list)


_GUARD = threading.Lock()
_HELD: dict[Path, _Held] = {}


def _forget_in_child() -> None:
    """In a forked child: close the inherited lock files (the parent keeps its locks)."""
    global _GUARD
    _GUARD = threading.Lock()  # another thread may have held it at the fork
    for held in _HELD.values():
        try:
            os.close(held.fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _command_line() -> str:
    """This process's command line as a user would type it (``rankwise train ...``)."""
    argv = list(sys.argv) or ["python"]
    program = Path(argv[0])
    name = f"python -m {program.parent.name}" if program.name == "__main__.py" else program.name
    text = shlex.join([name, *argv[1:]]) if name else shlex.join(argv[1:])
    return text if len(text) <= 300 else text[:297] + "..."


def _record() -> str:
    return json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.now().astimezone().isoformat(sep=" ", timespec="seconds"),
            "command": _command_line(),
        }
    )


def _read_record(fd: int) -> dict[str, Any]:
    try:
        data = json.loads(os.pread(fd, 65536, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _busy_message(directory: Path, holder: dict[str, Any], key: str, then: str | None) -> str:
    who = f"pid {holder['pid']}" if "pid" in holder else "another process"
    if holder.get("host"):
        who += f" on host {holder['host']}"
    if holder.get("started"):
        who += f" since {holder['started']}"
    if holder.get("command"):
        who += f" (`{holder['command']}`)"
    after = f"then {then}" if then else f"or choose another `{key}`"
    return (
        f"{key}: run folder {str(directory)!r} is in use by {who}; two processes writing one "
        f"folder mix their files. Wait for it to finish (or stop it), {after}."
    )


def _missing_parents(directory: Path) -> list[Path]:
    """The folders ``mkdir(parents=True)`` would create, deepest first."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    return missing


def _open_locked(path: Path) -> tuple[int, dict[str, Any] | None]:
    """Open and lock ``path``: ``(fd, None)``, or ``(-1, holder)`` when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            return -1, holder
        except OSError as exc:  # e.g. a network filesystem without locks
            os.close(fd)
            path.unlink(missing_ok=True)
            warnings.warn(
                f"cannot lock {path} ({exc.strerror}); the folder is not protected against a "
                "second process writing it.",
                RuntimeWarning,
                stacklevel=4,
            )
            return -1, None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:  # not a file its previous holder unlinked while releasing it
            return fd, None
        os.close(fd)


def _acquire(directory: Path, key: str, then: str | None) -> bool:
    """Take (or, in this process, re-enter) the lock of ``directory``; whether it is held."""
    with _GUARD:
        held = _HELD.get(directory)
        if held is not None:
            held.holds += 1
            return True
        created = _missing_parents(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, holder = _open_locked(directory / LOCK_FILE)
        except OSError as exc:
            raise ConfigError(
                f"{key}: cannot lock the run folder {str(directory)!r} ({exc.strerror}); it "
                "must be a writable folder."
            ) from None
        if fd < 0 and holder is not None:
            _remove_empty(created)
            raise RunDirInUseError(_busy_message(directory, holder, key, then), directory, holder)
        if fd < 0:
            return False  # no lock on this filesystem (warned)
        os.ftruncate(fd, 0)
        os.pwrite(fd, _record().encode(), 0)
        _HELD[directory] = _Held(fd, 1, created)
        return True


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:  # deepest first
        try:
            folder.rmdir()
        except OSError:
            return


def _release(directory: Path) -> None:
    with _GUARD:
        held = _HELD.get(directory)
        if held is None:
            return
        held.holds -= 1
        if held.holds > 0:
            return
        del _HELD[directory]
        # unlink before unlocking: whoever opened this file in between sees it is gone and
        # opens the new one (see _open_locked)
        try:
            (directory / LOCK_FILE).unlink(missing_ok=True)
        finally:
            os.close(held.fd)
        _remove_empty(held.created)


class RunDirLock:
    """One hold of a folder's lock; :meth:`release` it (or leave a ``with`` block) when done.

    Made by :func:`lock_run_dir`; released when garbage-collected.

    Args:
        directory: the folder (resolved).
        held: whether this process holds its lock (``False``: an empty hold, e.g. of a rank
            that does not write the folder).

    Attributes:
        directory: the folder.
    """

    def __init__(self, directory: Path, held: bool) -> None:
        self.directory = directory
        self._finalizer = weakref.finalize(self, _release, directory) if held else None

    @property
    def held(self) -> bool:
        """Whether this hold is still in force."""
        return self._finalizer is not None and self._finalizer.alive

    def release(self) -> None:
        """Give this hold back (the lock is released with the last hold of this process)."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_run_dir(
    directory: str | Path, key: str = "run_dir", *, then: str | None = None
) -> RunDirLock:
    """Take the exclusive lock of a run (or sweep) folder, creating the folder if needed.

    Args:
        directory: the folder.
        key: the argument or config key that named it, for the message (``"output_dir"``).
        then: what the refused caller can do once the holder is done, e.g. ``"resume it"``
            (default: the message says to choose another folder).

    Returns:
        The hold: release it (or use it in a ``with`` block) when the folder is written.

    Raises:
        RunDirInUseError: another process holds the lock; the message names it.
        ConfigError: the folder cannot be created or its lock file written.
    """
    directory = Path(directory).resolve()
    if fcntl is None:
        warnings.warn(
            f"this platform has no fcntl: {directory} is not protected against a second "
            "process writing it.",
            RuntimeWarning,
            stacklevel=2,
        )
        return RunDirLock(directory, held=False)
    return RunDirLock(directory, held=_acquire(directory, key, then))
