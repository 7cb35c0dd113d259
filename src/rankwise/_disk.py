"""Writes that find the disk full: the error that says so, and how to recognise one.

A full disk (or a reached quota) is an ``OSError`` with ``errno`` ENOSPC (EDQUOT), often hidden in
torch's ``RuntimeError`` (``PytorchStreamWriter failed writing file``, the ``OSError`` its
context). Every writer of rankwise's results raises :class:`DiskFullError` instead, and every
command ends on it with its own exit code (:mod:`rankwise.commands.common`). :func:`atomic_write`
is the one crash-safe writer of every result file; neither training nor the command line is
imported here, so both use it.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "DiskFullError",
    "atomic_write",
    "disk_full_cause",
    "format_bytes",
    "free_bytes",
    "fsync_dir",
]

# errno of a write that failed for want of space: the device is full, or the user's quota is
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full_cause(exc: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT ``OSError`` behind ``exc`` (itself, its cause or context), or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return current
        current = current.__cause__ or current.__context__
    return None


def format_bytes(size: int) -> str:
    """``size`` bytes as text: ``"312.4 MB"``, ``"48.0 kB"``, ``"512 bytes"`` (powers of 10)."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


class DiskFullError(OSError):
    """A file could not be written: its file system is full (or the disk quota is reached).

    Files are written atomically (a temporary file, then a rename): the file keeps its previous
    content and the partial temporary file is removed, so every earlier checkpoint is intact.
    ``str()`` is one line: the folder, the space the file needs against the space free there,
    and (with a run) which checkpoint is kept. ``errno`` is ``ENOSPC``.

    Attributes:
        path: the file that could not be written.
        needed: its size in bytes (``None``: not known).
        free: the bytes free in its folder when the write failed (``None``: not known).
        run_dir: the run directory it belongs to (``None``: not known).
        kept: a clause saying what survives (e.g. the last good checkpoint), or ``None``.
        resumable: whether the run has a checkpoint to resume from once there is space.
        detail: replaces the sizes when another process saw the disk full (``None``).
    """

    def __init__(
        self,
        path: str | Path,
        needed: int | None,
        free: int | None,
        *,
        run_dir: Path | None = None,
        kept: str | None = None,
        resumable: bool = False,
        detail: str | None = None,
    ) -> None:
        self.path = Path(path)
        self.needed = needed
        self.free = free
        self.run_dir = run_dir
        self.kept = kept
        self.resumable = resumable
        self.detail = detail
        super().__init__(self._message())
        self.errno = errno.ENOSPC

    def _message(self) -> str:
        folder = self.run_dir if self.run_dir is not None else self.path.parent
        name = self.path.name
        if self.run_dir is not None and self.run_dir in self.path.parents:
            name = str(self.path.relative_to(self.run_dir))
        text = f"no space left on device in {folder}: "
        if self.detail is not None:
            text += f"{name} could not be written ({self.detail})"
        elif self.needed is None or self.free is None:
            text += f"{name} could not be written; free some space there"
        elif self.needed > self.free:
            text += (
                f"{name} needs {format_bytes(self.needed)} and {format_bytes(self.free)} "
                f"is free; free at least {format_bytes(self.needed - self.free)} more there"
            )
        else:
            text += (
                f"{name} needs {format_bytes(self.needed)}, {format_bytes(self.free)} is free "
                "but the write failed (a disk quota?); free space there"
            )
        return text + (f". {self.kept[0].upper()}{self.kept[1:]}." if self.kept else ".")

    def with_context(self, *, run_dir: Path | None, kept: str, resumable: bool) -> DiskFullError:
        """A copy that knows its ``run_dir``, what is ``kept`` and whether the run is ``resumable``.

        ``kept`` says what survives, e.g. ``"the last good checkpoint (...) is kept"``.
        """
        return DiskFullError(
            self.path,
            self.needed,
            self.free,
            run_dir=run_dir,
            kept=kept,
            resumable=resumable,
            detail=self.detail,
        )


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename in it) to disk, where the platform allows."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's file-creation mask (read by setting and restoring it, under a lock)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


class _ByteCounter:
    """A write-only file that keeps nothing: how many bytes a writer produces."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> int:
        self.size += len(data)
        return len(data)

    def flush(self) -> None:
        """Nothing to flush."""


def free_bytes(directory: Path) -> int | None:
    """Bytes free in ``directory``'s file system (None where it cannot be read)."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _no_space(path: Path, write: Callable[[IO[bytes]], Any]) -> DiskFullError:
    """The error of a write of ``path`` that ran out of space (the file's full size measured)."""
    counter = _ByteCounter()
    try:
        write(counter)  # type: ignore[arg-type]
        needed: int | None = counter.size
    except Exception:  # noqa: BLE001 - the size is a detail of the message, never a new failure
        needed = None
    return DiskFullError(path, needed, free_bytes(path.parent))


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` through ``write(handle)`` atomically: readers see the old file or the new one.

    Temporary file in the destination folder, ``fsync``, ``os.replace``, ``fsync`` of the folder;
    the file gets the user's usual permissions; a partial file is removed on any failure.

    Raises:
        DiskFullError: no space left for the file (``path`` is left as it was).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates the file private (0600); a result file gets the permissions any file
        # the user creates gets (0666 minus the umask), like the PNGs written beside it
        os.chmod(tmp_name, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException as exc:
        # interrupted or failed: remove the partial file, keep the previous checkpoint intact
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        if disk_full_cause(exc) is not None:  # torch's own error hides it (a 65-line trace)
            raise _no_space(path, write) from exc
        raise
    fsync_dir(path.parent)
