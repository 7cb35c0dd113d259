"""The pre-flight check of an image dataset: every listed file exists and its header decodes.

Run once before a run's first step (:mod:`rankwise.training.build`), so that a missing or broken
image is reported before any work is done, naming the file and the list file's row that names it,
instead of after hours of training. Each file is opened with PIL and ``Image.verify()``d (the
header; for PNG also every chunk's checksum), in a thread pool, since the work is file I/O. The
result is cached by a fingerprint of the file list (relative paths, sizes, modification times):
a resumed run whose files did not change only reads their sizes and times. No paper equation is
implemented here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .._disk import atomic_write
from .base import CorruptDatasetError, ImageFolderDataset, RetrievalSplits

__all__ = [
    "BadImageFile",
    "DataFilesError",
    "PreflightReport",
    "check_image_files",
    "file_list_fingerprint",
    "listed_image_files",
]

CACHE_FORMAT = 1
_CHUNK = 256  # files per task of the thread pool: few tasks, a progress update per chunk
_NAMED = 3  # bad files named in the message (the count says how many more)

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ListedFile:
    """One image file of a dataset's splits and the list row that names it.

    Attributes:
        path: the file's path (as the dataset resolves it).
        relative: the path relative to its dataset's image root (what the fingerprint hashes).
        where: ``"<list file>, line N"`` (or ``"sample I of dataset 'sop/test'"`` without a list).
    """

    path: str
    relative: str
    where: str


@dataclass(frozen=True)
class BadImageFile:
    """A listed file that is missing or does not decode.

    Attributes:
        path: the file.
        where: the list file and row that name it.
        problem: ``"missing"``, ``"unreadable (<why>)"`` or ``"not an image"`` (with why, when
            PIL says more than that it knows no such format).
    """

    path: str
    where: str
    problem: str

    def __str__(self) -> str:
        return f"{self.path!r} ({self.where}): {self.problem}"


class DataFilesError(CorruptDatasetError):
    """Files listed by a dataset are missing or not images (:func:`check_image_files`).

    ``str()`` is one line: ``dataset 'sop': '<file>' (<list file>, line N): missing; ...``.

    Attributes:
        dataset: the dataset's name.
        bad: every bad file, in list order.
        checked: how many files were checked.
    """

    def __init__(self, dataset: str, bad: Sequence[BadImageFile], checked: int) -> None:
        self.dataset = dataset
        self.bad = list(bad)
        self.checked = checked
        named = "; ".join(str(b) for b in self.bad[:_NAMED])
        more = len(self.bad) - _NAMED
        tail = f"; and {more} more of the {checked} files" if more > 0 else ""
        super().__init__(
            f"dataset {dataset!r}: {named}{tail}; restore the files or remove their rows from "
            "the list, then run again."
        )


@dataclass(frozen=True)
class PreflightReport:
    """What :func:`check_image_files` did.

    Attributes:
        files: distinct image files listed by the splits.
        decoded: files opened and verified now (``0``: the cache said the same list passed).
        fingerprint: the file list's fingerprint (:func:`file_list_fingerprint`).
        cached: the check was skipped because ``cache`` held this fingerprint.
    """

    files: int
    decoded: int
    fingerprint: str
    cached: bool


def listed_image_files(splits: RetrievalSplits) -> list[ListedFile]:
    """Every distinct image file of the image-folder splits, in split and list order.

    Splits that are not :class:`~rankwise.data.ImageFolderDataset` (arrays in memory) list none.
    """
    seen: set[str] = set()
    out: list[ListedFile] = []
    for data in splits.splits().values():
        if not isinstance(data, ImageFolderDataset):
            continue
        for index, path in enumerate(data.paths):
            if path in seen:
                continue
            seen.add(path)
            relative = os.path.relpath(path, data.root) if data.root is not None else path
            where = (
                data.origin.where(index)
                if data.origin is not None
                else f"sample {index} of dataset {data.name!r}"
            )
            out.append(ListedFile(path, relative, where))
    return out


def _stat(path: str) -> tuple[int, int] | None:
    """``(size, mtime)`` of the file, ``None`` when it does not exist."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return (-1, -1)  # there but not readable: opening it says why
    return info.st_size, info.st_mtime_ns


def file_list_fingerprint(
    files: Sequence[ListedFile], stats: Sequence[tuple[int, int] | None]
) -> str:
    """SHA-256 of the sorted ``relative path, size, mtime`` lines of the files (``stats`` theirs).

    The same files at another place give the same fingerprint; a file added, removed, resized or
    rewritten changes it.

    >>> files = [ListedFile("/d/a.png", "a.png", "list.txt, line 2")]
    >>> file_list_fingerprint(files, [(10, 5)]) == file_list_fingerprint(files, [(10, 6)])
    False
    """
    digest = hashlib.sha256()
    for relative, stat in sorted(zip((f.relative for f in files), stats, strict=True)):
        size, mtime = stat if stat is not None else (-1, -1)
        digest.update(f"{relative}\t{size}\t{mtime}\n".encode())
    return digest.hexdigest()


def _image_problem(path: str) -> str | None:
    """``None`` if the file's header decodes, else what is wrong with it (one line)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.verify()
    except FileNotFoundError:
        return "missing"
    except (PermissionError, IsADirectoryError) as exc:
        return f"unreadable ({exc.strerror})"
    except UnidentifiedImageError:
        return "not an image"
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, struct.error, ...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        return f"not an image ({reason})"
    return None


def _in_chunks(
    pool: ThreadPoolExecutor,
    work: Callable[[str], object],
    paths: Sequence[str],
    progress: Progress | None,
) -> list[object]:
    """``work`` of every path, in order, a chunk per task; ``progress(done, total)`` per chunk."""
    chunks = [paths[i : i + _CHUNK] for i in range(0, len(paths), _CHUNK)]
    results: list[object] = []
    for chunk_results in pool.map(lambda chunk: [work(p) for p in chunk], chunks):
        results.extend(chunk_results)
        if progress is not None:
            progress(len(results), len(paths))
    return results


def _cached(cache: Path | None, fingerprint: str) -> bool:
    if cache is None or not cache.is_file():
        return False
    try:
        saved = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # an unreadable cache is no cache: the files are checked again
    return (
        isinstance(saved, dict)
        and saved.get("format") == CACHE_FORMAT
        and saved.get("fingerprint") == fingerprint
    )


def _write_cache(cache: Path, fingerprint: str, files: int) -> None:
    text = json.dumps({"format": CACHE_FORMAT, "fingerprint": fingerprint, "files": files})
    atomic_write(cache, lambda handle: handle.write(text.encode() + b"\n"))


def check_image_files(
    splits: RetrievalSplits,
    *,
    cache: str | os.PathLike | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
) -> PreflightReport:
    """Check that every image file of ``splits`` exists and its header decodes.

    Args:
        splits: the loaded splits (array datasets have no files: nothing to check).
        cache: a JSON file holding the fingerprint of the last file list that passed; when it
            holds this list's, no file is opened again. Written after a pass.
        workers: threads (default ``min(32, CPUs + 4)``: the work is file I/O).
        progress: called as ``progress(done, total)`` while files are opened.

    Returns:
        A :class:`PreflightReport`.

    Raises:
        DataFilesError: a file is missing or not an image; every bad file is in ``bad`` and the
            message names the first ones with their list file and row.

    Example:
        >>> import numpy as np, tempfile
        >>> from PIL import Image
        >>> from rankwise.data import ImageFolderDataset, RetrievalSplits
        >>> folder = tempfile.mkdtemp()
        >>> Image.new("RGB", (4, 4)).save(f"{folder}/a.png")
        >>> data = ImageFolderDataset(["a.png", "b.png"], [0, 1], root=folder, name="toy/test")
        >>> splits = RetrievalSplits(data, None, data, None, "open-set", "toy")
        >>> check_image_files(splits)
        Traceback (most recent call last):
        ...
        rankwise.data.preflight.DataFilesError: dataset 'toy': '.../b.png' (sample 1 of dataset 'toy/test'): missing; ...
    """
    files = listed_image_files(splits)
    paths = [f.path for f in files]
    if not files:
        return PreflightReport(0, 0, file_list_fingerprint([], []), cached=False)
    cache_path = None if cache is None else Path(cache)
    threads = workers if workers is not None else min(32, (os.cpu_count() or 1) + 4)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        stats = _in_chunks(pool, _stat, paths, None)
        fingerprint = file_list_fingerprint(files, stats)  # type: ignore[arg-type]
        missing = any(s is None for s in stats)
        if not missing and _cached(cache_path, fingerprint):
            return PreflightReport(len(files), 0, fingerprint, cached=True)
        present = [p for p, s in zip(paths, stats, strict=True) if s is not None]
        found = dict(zip(present, _in_chunks(pool, _image_problem, present, progress), strict=True))
    bad = [
        BadImageFile(f.path, f.where, "missing" if s is None else str(found[f.path]))
        for f, s in zip(files, stats, strict=True)
        if s is None or found[f.path] is not None
    ]
    if bad:
        raise DataFilesError(splits.name, bad, len(files))
    if cache_path is not None:
        _write_cache(cache_path, fingerprint, len(files))
    return PreflightReport(len(files), len(present), fingerprint, cached=False)
