"""Crash-safe checkpoints and random-number-generator snapshots for bit-exact resumption.

A SOPRC run (Wen et al., NeurIPS 2022, Sec. 5.1 / Alg. 1) carries state beyond the weights: ``v``
of Eq. (10), optimizer moments, sampler position, RNG streams. It is written atomically (temporary
file, ``fsync``, ``os.replace``, ``fsync`` of the directory), as tensors and plain containers only
(``weights_only=True`` loads); a full disk raises :class:`~rankwise.training.errors.DiskFullError`.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._disk import DiskFullError, atomic_write, disk_full_cause, free_bytes
from .errors import CorruptCheckpointError

__all__ = [
    "atomic_save",
    "atomic_write_text",
    "capture_rng_state",
    "keep_previous",
    "load_checkpoint",
    "restore_rng_state",
]


def atomic_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` to ``path`` atomically: readers see the old file or the complete new one.

    Raises:
        DiskFullError: no space left for the file (``path`` is left as it was).
    """
    atomic_write(Path(path), lambda handle: torch.save(obj, handle))


def atomic_write_text(text: str, path: str | Path) -> None:
    """Write a text file atomically (same protocol as :func:`atomic_save`).

    Raises:
        DiskFullError: no space left for the file (``path`` is left as it was).
    """
    atomic_write(Path(path), lambda handle: handle.write(text.encode()))


def _why_unreadable(path: Path, exc: BaseException) -> str:
    """A short, safe description of why ``torch.load`` failed (never torch's own advice)."""
    if path.stat().st_size == 0:
        return "the file is empty"
    if isinstance(exc, pickle.UnpicklingError):
        # torch's message recommends weights_only=False, i.e. running arbitrary code from the
        # file: never repeat it; rankwise writes only tensors and plain containers
        return "it holds objects a rankwise checkpoint never holds (not a rankwise checkpoint)"
    if isinstance(exc, (RuntimeError, zipfile.BadZipFile, EOFError)):
        return "it is truncated or not a torch checkpoint (an interrupted copy, a full disk)"
    return "it is not a readable torch checkpoint"


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint written by the trainer with ``weights_only=True`` (no arbitrary code).

    Args:
        path: the checkpoint file.
        map_location: where to put its tensors.

    Returns:
        The checkpoint's dict.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptCheckpointError: the file cannot be read (empty, truncated, junk, foreign
            objects) or does not hold a dict.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist.")
    try:
        with warnings.catch_warnings():
            # torch's note on a non-zip file ("Detected pickle protocol ..., weights_only
            # Unpickler ..."): a file the trainer wrote is a zip; any other is reported below
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - every failure of a bad file is the same answer
        raise CorruptCheckpointError(path, _why_unreadable(path, exc)) from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(path, f"it holds a {type(state).__name__}, not a checkpoint")
    return state


def keep_previous(path: str | Path, previous: str | Path) -> bool:
    """Make ``previous`` a copy of ``path`` atomically (a hard link when the file system allows).

    Called before ``path`` is replaced, so a good checkpoint survives a corrupt newer one.

    Args:
        path: the current checkpoint (e.g. ``checkpoints/last.pt``).
        previous: where its copy goes (e.g. ``checkpoints/previous.pt``).

    Returns:
        Whether a copy was made.

    Raises:
        DiskFullError: no space left for a copy (``previous`` is left as it was).
    """
    path, previous = Path(path), Path(previous)
    if not path.is_file():
        return False
    tmp = previous.with_name(f".{previous.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(path, tmp)
        except OSError:  # no hard links here (some network / FAT file systems): copy
            shutil.copyfile(path, tmp)
        os.replace(tmp, previous)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)  # ``previous`` keeps its older copy
        if disk_full_cause(exc) is not None:
            raise DiskFullError(previous, path.stat().st_size, free_bytes(previous.parent)) from exc
        raise
    return True


def capture_rng_state() -> dict[str, Any]:
    """Torch (CPU and every CUDA device), numpy-global and python ``random`` states as tensors."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()  # noqa: NPY002
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(np_kind),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": {
            "version": int(py_version),
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss_next": py_gauss,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"].cpu())
    npy = state["numpy"]
    np.random.set_state(  # noqa: NPY002
        (
            npy["kind"],
            npy["keys"].cpu().numpy().astype(np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached_gaussian"]),
        )
    )
    py = state["python"]
    random.setstate(
        (int(py["version"]), tuple(int(x) for x in py["internal"].tolist()), py["gauss_next"])
    )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
