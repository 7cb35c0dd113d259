"""Writes that find the disk full: the error that says so, and how to recognise one.

A full disk (or a reached quota) shows up as an ``OSError`` with ``errno`` ENOSPC (EDQUOT), often
hidden: torch wraps the error of a failed write in a ``RuntimeError`` of its own. Every writer of
rankwise's results (checkpoints, reports, sweep summaries) raises :class:`DiskFullError` instead,
one line naming the folder and the space the file needs against the space free there, and every
command ends on it with its own exit code (:mod:`rankwise.commands.common`). Neither training
nor the command line is imported here, so both use it.
"""

from __future__ import annotations

import errno
from pathlib import Path

__all__ = ["DiskFullError", "disk_full_cause", "format_bytes"]

# errno of a write that failed for want of space: the device is full, or the user's quota is
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full_cause(exc: BaseException) -> OSError | None:
    """The "no space left" error behind ``exc``, if any (``exc`` itself, its cause or context).

    torch wraps the ``OSError`` of a failed write in a ``RuntimeError`` of its own
    (``PytorchStreamWriter failed writing file``); the ``OSError`` is its context.

    Args:
        exc: an exception.

    Returns:
        The ``OSError`` with ``errno`` ENOSPC or EDQUOT, or ``None``.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _NO_SPACE:
            return current
        current = current.__cause__ or current.__context__
    return None


def format_bytes(size: int) -> str:
    """``size`` bytes for a message: ``"312.4 MB"``, ``"48.0 kB"``, ``"512 bytes"`` (powers of 10).

    Args:
        size: a number of bytes.

    Returns:
        The text.
    """
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
        """A copy that knows the run it belongs to and what survives.

        Args:
            run_dir: the run directory.
            kept: what survives, e.g. ``"the last good checkpoint (...) is kept"``.
            resumable: whether the run has a checkpoint to resume from.

        Returns:
            The new error.
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
