"""The run folder's record of its data (``data.json``): which data a run trained on.

A fresh run records the fingerprint of its data: for image datasets the file list (every split's
image paths relative to the dataset folder, with each file's size), for in-memory (array)
datasets the bytes of the inputs; labels and split sizes in both cases. The fingerprint does not
depend on where the data lies, so a resumed run may be pointed at a moved copy of the same data
(``rankwise train --resume RUN --data-dir NEW``), and a different dataset there is refused.
No equation is implemented here.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ConfigError

__all__ = ["check_same_data", "data_fingerprint", "read_data_record"]

# the attributes that hold an in-memory dataset's inputs (ArrayDataset, InstanceViews)
_ARRAY_ATTRIBUTES = ("inputs", "sources")


def _update_array(digest: Any, value: Any) -> int:
    """Feed a tensor's / array's dtype, shape and bytes to ``digest``; its size in bytes."""
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    array = np.ascontiguousarray(array)
    digest.update(f"{array.dtype.str} {array.shape}\n".encode())
    digest.update(array.data)  # C-contiguous: hashed without a copy
    return int(array.nbytes)


def _update_split(digest: Any, name: str, data: Any) -> tuple[int, int]:
    """Feed one split to ``digest``; ``(files, bytes)`` it counted."""
    digest.update(f"split {name} {len(data)}\n".encode())
    files, size = 0, 0
    paths = getattr(data, "paths", None)
    if paths is not None:  # image files: the path below the dataset folder and the file's size
        root = getattr(data, "root", None)
        for path in paths:
            relative = os.path.relpath(path, root) if root is not None else os.fspath(path)
            try:
                length = os.stat(path).st_size
            except OSError:
                length = -1  # a missing file: the pre-flight and the loader name it
            digest.update(f"{relative}\t{length}\n".encode())
            files, size = files + 1, size + max(length, 0)
    else:
        for attribute in _ARRAY_ATTRIBUTES:
            value = getattr(data, attribute, None)
            if value is not None:
                size += _update_array(digest, value)
                break
    labels = getattr(data, "labels", None)
    if labels is not None:
        _update_array(digest, np.asarray(labels, dtype=np.int64))
    return files, size


def data_fingerprint(splits: Any) -> dict[str, Any]:
    """The fingerprint of a :class:`~rankwise.data.RetrievalSplits`, independent of its location.

    Args:
        splits: the loaded splits (``train``, ``val``, ``test``, ``gallery``, ``name``).

    Returns:
        ``{"dataset", "fingerprint" (sha256 hex), "samples", "files", "bytes"}``: ``files`` is the
        number of image files listed (0 for in-memory data), ``bytes`` their total size (or the
        inputs' size in memory).

    Example:
        >>> from rankwise.data import load_dataset
        >>> record = data_fingerprint(load_dataset("digits"))
        >>> record["dataset"], record["files"], len(record["fingerprint"])
        ('digits', 0, 64)
        >>> record == data_fingerprint(load_dataset("digits"))
        True
    """
    digest = hashlib.sha256()
    samples, files, size = 0, 0, 0
    for name in ("train", "val", "test", "gallery"):
        data = getattr(splits, name, None)
        if data is None:
            continue
        counted = _update_split(digest, name, data)
        samples, files, size = samples + len(data), files + counted[0], size + counted[1]
    return {
        "dataset": getattr(splits, "name", None),
        "fingerprint": digest.hexdigest(),
        "samples": samples,
        "files": files,
        "bytes": size,
    }


def read_data_record(path: str | Path) -> dict[str, Any] | None:
    """The ``data.json`` at ``path`` (``None``: none, e.g. a run made before it was recorded).

    Raises:
        ConfigError: it exists but is not a JSON object.

    Example:
        >>> read_data_record("no-such-run/data.json") is None
        True
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except ValueError:
        record = None
    if not isinstance(record, dict):
        raise ConfigError(f"run_dir: {path} is corrupt (not a JSON object); restore or delete it.")
    return record


def _described(record: Mapping[str, Any]) -> str:
    files = f"{record.get('files')} files, " if record.get("files") else ""
    return f"{files}{record.get('samples')} samples, {record.get('bytes')} bytes"


def check_same_data(
    recorded: Mapping[str, Any] | None,
    found: Mapping[str, Any],
    old_dir: str | None,
    new_dir: str,
) -> None:
    """Refuse ``new_dir`` unless it holds the data ``recorded`` (the run's ``data.json``).

    Args:
        recorded: the run's data record (``None``: the run recorded none).
        found: :func:`data_fingerprint` of the data loaded from ``new_dir``.
        old_dir: where the run's data was (its config's ``dataset.data_dir``).
        new_dir: the new data folder.

    Raises:
        ConfigError: no record to check against, or the data differs; both folders are named.

    Example:
        >>> recorded = {"dataset": "sop", "fingerprint": "ab12", "samples": 9, "bytes": 90}
        >>> check_same_data(recorded, dict(recorded), "/data/old", "/data/new")  # the same: None
        >>> other = {**recorded, "fingerprint": "cd34", "samples": 10}
        >>> check_same_data(recorded, other, "/data/old", "/data/new")
        Traceback (most recent call last):
        ...
        rankwise.training.errors.ConfigError: data_dir: the dataset 'sop' in '/data/new' is not the data this run trained on (in '/data/old'): ...
    """
    if recorded is None:
        raise ConfigError(
            f"data_dir: cannot check that {new_dir!r} holds the data this run trained on (in "
            f"{old_dir!r}): the run has no data.json (it was made before rankwise recorded its "
            "data). Resume without `data_dir`, or set dataset.data_dir in its config.yaml by "
            "hand if you are sure it is the same data."
        )
    if recorded.get("fingerprint") == found.get("fingerprint"):
        return
    raise ConfigError(
        f"data_dir: the dataset {found.get('dataset')!r} in {new_dir!r} is not the data this run "
        f"trained on (in {old_dir!r}): {_described(found)} there against {_described(recorded)} "
        "recorded in its data.json (relative paths, sizes and labels are compared). Point "
        "`data_dir` at a copy of the same data, or train a new run on this data."
    )
