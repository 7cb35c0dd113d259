"""Finding a dataset's directory on disk (rankwise never downloads data).

Search order: the ``data_dir`` argument (the dataset folder itself, or a folder holding it under
one of its conventional names), else ``$RANKWISE_DATA`` (likewise), else system locations such as
``/usr/share/datasets/fashion-mnist`` from the Debian package ``dataset-fashion-mnist``. A
dataset is recognised by marker files of its official layout (e.g. ``Ebay_train.txt`` for
Stanford Online Products, Oh Song et al. 2016). No equation is implemented here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from .base import DatasetNotFoundError

__all__ = ["RANKWISE_DATA_ENV", "candidate_dirs", "find_dataset_root"]

RANKWISE_DATA_ENV = "RANKWISE_DATA"


def candidate_dirs(
    data_dir: str | os.PathLike | None, subfolders: Sequence[str], system_dirs: Sequence[str] = ()
) -> list[Path]:
    """Directories to probe for a dataset, in the order of the module docstring.

    ``data_dir`` given -> the environment is not consulted.

    Args:
        data_dir: the user's explicit data folder, or ``None``.
        subfolders: names of the dataset's folder below a base directory.
        system_dirs: system-wide copies (e.g. a Debian package's), probed last.

    Returns:
        The candidate directories (not checked for existence, except ``$RANKWISE_DATA``).

    Raises:
        DatasetNotFoundError: ``$RANKWISE_DATA`` is set (and consulted) but not a directory.
    """
    bases: list[Path] = []
    if data_dir is not None:
        bases.append(Path(data_dir).expanduser())
    elif os.environ.get(RANKWISE_DATA_ENV):
        env = Path(os.environ[RANKWISE_DATA_ENV]).expanduser()
        if not env.is_dir():
            # set on purpose: never fall back to another copy of the data behind the user's back
            raise DatasetNotFoundError(
                f"${RANKWISE_DATA_ENV}={os.environ[RANKWISE_DATA_ENV]} is not a directory; point "
                "it at the folder holding your datasets, or unset it."
            )
        bases.append(env)
    out: list[Path] = []
    for base in bases:
        out.append(base)
        out.extend(base / sub for sub in subfolders)
    if data_dir is None:
        out.extend(Path(d) for d in system_dirs)
    return out


def find_dataset_root(
    name: str,
    data_dir: str | os.PathLike | None,
    markers: Sequence[str],
    subfolders: Sequence[str],
    layout: str,
    system_dirs: Sequence[str] = (),
    hint: str = "",
    is_root: Callable[[Path], bool] | None = None,
) -> Path:
    """Return the first candidate directory holding every path in ``markers``.

    ``is_root``, when given, replaces the marker test (for files with alternative names).

    Raises:
        DatasetNotFoundError: nothing matched; the message lists the directories searched, the
            expected layout and how to point rankwise at the data (the `` `data_dir` ``
            argument, which the command line words as its flag, or ``$RANKWISE_DATA``), never a
            download.
    """
    candidates = candidate_dirs(data_dir, subfolders, system_dirs)
    for cand in candidates:
        found = is_root(cand) if is_root is not None else all((cand / m).exists() for m in markers)
        if found:
            return cand
    searched = (
        "\n  ".join(str(c) for c in candidates) or "(none: no `data_dir` and no $RANKWISE_DATA)"
    )
    raise DatasetNotFoundError(
        f"dataset {name!r} not found. rankwise never downloads data; searched:\n  {searched}\n"
        f"Expected layout:\n{layout}\n"
        f"Point rankwise at the folder with `data_dir` or the ${RANKWISE_DATA_ENV} "
        f"environment variable.{(' ' + hint) if hint else ''}"
    )
