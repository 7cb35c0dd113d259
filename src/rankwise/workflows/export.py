"""Export a trained run for serving, with its preprocessing stated and its outputs checked.

``rankwise export RUN_DIR --format onnx|torchscript|pt2 -o OUT`` (:func:`export_run`) writes the
run's embedding model (:func:`rankwise.training.load_run`, the checkpoint its test report
evaluated) as an ONNX graph (the ``torch.export``-based exporter, run by onnxruntime), a TorchScript
trace or a ``torch.export`` program (``.pt2``), with a dynamic batch dimension, and beside it
``OUT.json``: the input shape and dtype, the preprocessing from raw inputs, the output dimension,
whether it is L2-normalised, the similarity to rank with and the run it comes from.

The parity check reloads the written file (onnxruntime for ONNX, ``torch.jit.load`` /
``torch.export.load`` for the others), embeds raw inputs of the run's kind preprocessed as the
metadata states, and compares with what the run embeds from the same raw inputs
(``load_run(...).embed``); the largest absolute difference is reported and recorded, and a
difference above the tolerance fails the export. No paper equation is implemented here.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from .._disk import atomic_write
from .._extras import require
from ..data.base import IMAGENET_MEAN, IMAGENET_STD
from ..training.inference import LoadedRun, load_run

__all__ = ["FORMATS", "ExportResult", "export_run", "run_metadata"]

FORMATS = ("onnx", "torchscript", "pt2")
# the similarity a run's evaluation ranks its embeddings by (the Evaluator's retrieval_metrics)
RUN_SIMILARITY = "cosine"
_EXAMPLE_BATCH = 2  # traced / exported with this batch; checked with others (the batch is dynamic)
_CHECK_BATCHES = (5, 1)


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_run` wrote and how the exported model compares with the run.

    Attributes:
        format: ``"onnx"``, ``"torchscript"`` or ``"pt2"``.
        model_path: the exported model.
        metadata_path: the JSON file beside it (``<model_path>.json``).
        max_abs_diff: the largest absolute difference between the exported model's embeddings and
            the run's, over the checked inputs.
        tolerance: the largest difference accepted.
        n_checked: how many inputs were compared.
    """

    format: str
    model_path: Path
    metadata_path: Path
    max_abs_diff: float
    tolerance: float
    n_checked: int

    @property
    def passed(self) -> bool:
        """Whether the exported model's embeddings equal the run's within ``tolerance``."""
        return self.max_abs_diff <= self.tolerance


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_metadata(run: LoadedRun) -> dict[str, Any]:
    """The facts that identify a loaded run's model (saved with its exports and search indexes).

    ``model_id`` is the first 16 hex digits of the checkpoint file's SHA-256: two files hold the
    same weights exactly when they agree (up to a collision).
    """
    return {
        "run_dir": str(Path(run.run_dir).resolve()),
        "checkpoint": str(Path(run.checkpoint).resolve()),
        "step": run.step,
        "model_id": _sha256(run.checkpoint)[:16],
        "dataset": run.config.dataset.name,
        "backbone": run.config.model.backbone,
        "loss": run.config.loss.name,
        "embedding_dim": int(run.config.model.embedding_dim),
        "similarity": RUN_SIMILARITY,
    }


def _preprocessing(run: LoadedRun) -> dict[str, Any]:
    """How raw inputs become the model's input, for each kind of run (:attr:`input_kind`)."""
    kind = run.input_kind
    if kind == "digits":
        return {
            "raw_inputs": "scikit-learn digits pixels, values 0-16 "
            "(sklearn.datasets.load_digits().images), shape (N, 8, 8) or (N, 1, 8, 8)",
            "steps": [{"op": "divide", "by": 16.0}],
        }
    if kind == "uint8":
        return {
            "raw_inputs": "uint8 pixels 0-255 (floats already in [0, 1] are used as they are), "
            f"shape (N, {', '.join(map(str, run.input_shape))})",
            "steps": [{"op": "divide", "by": 255.0, "when": "uint8"}],
        }
    if kind == "float":
        return {
            "raw_inputs": "float arrays as the dataset's .npz holds them, "
            f"shape (N, {', '.join(map(str, run.input_shape))})",
            "steps": [],
        }
    if kind == "images":
        size = int(run.config.dataset.image_size)
        return {
            "raw_inputs": "image files (any format Pillow reads)",
            "steps": [
                {"op": "convert", "mode": "RGB"},
                {"op": "resize", "size": [size, size], "interpolation": "bilinear"},
                {"op": "divide", "by": 255.0},
                {"op": "normalize", "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD)},
                {"op": "layout", "from": "HWC", "to": "CHW"},
            ],
        }
    return {
        "raw_inputs": f"inputs of kind {kind!r}, as rankwise.training.load_run(RUN_DIR)"
        ".preprocess(inputs) takes them",
        "steps": [{"op": "load_run(RUN_DIR).preprocess"}],
    }


def _raw_inputs(run: LoadedRun, n: int, seed: int, folder: Path) -> Any:
    """``n`` raw inputs of the run's kind (image files written to ``folder`` for image runs)."""
    rng = np.random.default_rng(seed)
    shape = (n, *run.input_shape)
    if run.input_kind == "digits":
        return rng.integers(0, 17, shape).astype(np.float64)
    if run.input_kind == "uint8":
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if run.input_kind == "images":
        from PIL import Image

        paths = []
        for i in range(n):
            height, width = (int(v) for v in rng.integers(8, 48, 2))
            path = folder / f"check{i}.png"
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
            paths.append(path)
        return paths
    return rng.random(shape).astype(np.float32)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """The exporters' progress prints, deprecation warnings and log lines kept off the console."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _quietly(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` without its warnings (TorchScript's deprecation notices)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return function(*args, **kwargs)


def _writer(model: torch.nn.Module, example: torch.Tensor, fmt: str) -> Callable[[IO[bytes]], Any]:
    """The function that writes ``model`` in format ``fmt`` to an open binary file."""
    batch = torch.export.Dim("batch")
    if fmt == "torchscript":
        with _quiet_exporter():
            traced = torch.jit.trace(model, example)
        return lambda handle: _quietly(torch.jit.save, traced, handle)
    if fmt == "pt2":
        with _quiet_exporter():
            program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
        return lambda handle: torch.export.save(program, handle)
    require(("onnx", "onnxruntime", "onnxscript"), "export", "exporting to ONNX")
    with _quiet_exporter():
        exported = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            dynamic_shapes=({0: batch},),
            input_names=["input"],
            output_names=["embedding"],
        )
    if exported is None:  # pragma: no cover - the dynamo exporter always returns its program
        raise RuntimeError("torch.onnx.export returned no ONNX program.")
    # the serialised graph with its weights inside (models under protobuf's 2 GB limit)
    data = exported.model_proto.SerializeToString()
    return lambda handle: handle.write(data)


def _loader(path: Path, fmt: str) -> Callable[[torch.Tensor], np.ndarray]:
    """The written model, loaded back from ``path``, as a function of a float32 batch."""
    if fmt == "torchscript":
        scripted = _quietly(torch.jit.load, str(path), map_location="cpu")
        return lambda x: scripted(x).detach().numpy()
    if fmt == "pt2":
        module = torch.export.load(str(path)).module()
        return lambda x: module(x).detach().numpy()
    (ort,) = require(("onnxruntime",), "export", "checking an ONNX export")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: np.asarray(session.run(None, {"input": x.numpy()})[0])


def _check_args(fmt: str, output: Path, overwrite: bool, tolerance: float) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"`format` must be one of {', '.join(FORMATS)}, got {fmt!r}.")
    if not tolerance >= 0:
        raise ValueError(f"`tolerance` must be a number >= 0, got {tolerance}.")
    if output.is_dir():
        raise ValueError(f"`output` {output} is a folder; name the model file to write.")
    metadata = Path(f"{output}.json")
    if not overwrite:
        existing = [str(p) for p in (output, metadata) if p.exists()]
        if existing:
            raise ValueError(
                f"`output`: {' and '.join(existing)} exist(s); pass `overwrite` to replace."
            )


def export_run(
    run_dir: str | os.PathLike[str],
    format: str,
    output: str | os.PathLike[str],
    *,
    checkpoint: str = "auto",
    tolerance: float = 1e-5,
    overwrite: bool = False,
    seed: int = 0,
) -> ExportResult:
    """Export a run's model to ``output`` and its metadata to ``output + ".json"``, then check it.

    Args:
        run_dir: a run directory (or a folder holding one run).
        format: ``"onnx"`` (needs the ``export`` extra), ``"torchscript"`` or ``"pt2"``.
        output: the model file to write (e.g. ``model.onnx``, ``model.pt``, ``model.pt2``).
        checkpoint: ``"auto"`` (``best.pt``, else ``last.pt``), ``"best"``, ``"last"`` or a path.
        tolerance: the largest absolute difference from the run's embeddings accepted.
        overwrite: replace existing files.
        seed: seed of the raw inputs of the parity check.

    Returns:
        An :class:`ExportResult` (``passed`` says whether the check held; both files are written
        either way, the metadata recording the check).

    Raises:
        ValueError: an unknown format, a tolerance below 0, or an existing output without
            ``overwrite``.
        MissingDependencyError: ONNX without the ``export`` extra.

    Example:
        >>> result = export_run("runs/digits", "onnx", "model.onnx")  # doctest: +SKIP
        >>> result.passed, result.max_abs_diff  # doctest: +SKIP
        (True, 1.19e-07)
    """
    output = Path(output)
    _check_args(format, output, overwrite, tolerance)
    if format == "onnx":  # before any work: the missing extra is the first thing said
        require(("onnx", "onnxruntime", "onnxscript"), "export", "exporting to ONNX")
    run = load_run(Path(run_dir), checkpoint=checkpoint, device="cpu")
    model = run.model.eval()
    example = torch.rand(
        _EXAMPLE_BATCH, *run.input_shape, generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        atomic_write(output, _writer(model, example, format))
    max_diff, checked = _parity(run, output, format, seed)
    metadata_path = Path(f"{output}.json")
    head = getattr(model, "head", None)
    meta = {
        "format": format,
        "file": output.name,
        "input": {
            "name": "input",
            "shape": ["batch", *run.input_shape],
            "dtype": "float32",
            "layout": "NCHW" if len(run.input_shape) == 3 else "N" + "D" * len(run.input_shape),
        },
        "output": {
            "name": "embedding",
            "shape": ["batch", int(run.config.model.embedding_dim)],
            "dtype": "float32",
            "l2_normalized": bool(getattr(head, "normalize", False)),
        },
        "preprocessing": _preprocessing(run),
        "similarity": RUN_SIMILARITY,
        "embedding_dim": int(run.config.model.embedding_dim),
        "run": run_metadata(run),
        "parity": {
            "checked_with": _checker_name(format),
            "inputs": checked,
            "max_abs_diff": max_diff,
            "tolerance": tolerance,
            "passed": max_diff <= tolerance,
        },
        "torch_version": torch.__version__,
    }
    text = json.dumps(meta, indent=1) + "\n"
    atomic_write(metadata_path, lambda handle: handle.write(text.encode()))
    return ExportResult(format, output, metadata_path, max_diff, tolerance, checked)


def _checker_name(fmt: str) -> str:
    return {
        "onnx": "onnxruntime",
        "torchscript": "torch.jit.load",
        "pt2": "torch.export.load",
    }[fmt]


def _parity(run: LoadedRun, path: Path, fmt: str, seed: int) -> tuple[float, int]:
    """Largest |exported - run| over raw inputs embedded both ways, and how many were checked."""
    exported = _loader(path, fmt)
    worst = 0.0
    checked = 0
    with tempfile.TemporaryDirectory() as folder:
        for i, n in enumerate(_CHECK_BATCHES):
            raw = _raw_inputs(run, n, seed + i, Path(folder))
            expected = run.embed(raw).numpy()
            got = exported(run.preprocess(raw).contiguous())
            if got.shape != expected.shape:
                raise ValueError(
                    f"the exported model returned shape {got.shape} for {n} inputs, the run "
                    f"{expected.shape}."
                )
            worst = max(worst, float(np.abs(got.astype(np.float64) - expected).max()))
            checked += n
    return worst, checked
