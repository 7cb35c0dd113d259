"""Your own data: a folder of class sub-folders, a CSV table of images, or an ``.npz`` of arrays.

Three dataset names of :func:`rankwise.data.load_dataset` read a user's data instead of a
benchmark (docs/your_data.md):

- ``folder``: ``data_dir`` holds one sub-folder per class. Open-set (the default), whole classes
  are split into training and test classes (``options.test_fraction`` of them, seeded); the test
  classes are queried leave-one-out, as the benchmarks of Wen et al. (NeurIPS 2022, Sec. 6).
  Closed-set, every class gives ``test_fraction`` of its images as queries and the rest is the
  gallery the model trains on (the hashing protocol of He et al., CVPR 2018, Sec. 5.1).
- ``csv``: ``data_dir`` is a table with the columns of open-metric-learning's dataset format
  (``label``, ``path`` relative to the table's folder, ``split`` = ``train`` / ``validation``,
  optional ``is_query``, ``is_gallery``, ``category``). The ``validation`` rows are the test: their
  ``is_query`` rows against their ``is_gallery`` rows when the flags are given (closed-set),
  leave-one-out otherwise.
- ``arrays``: ``data_dir`` is an ``.npz`` file with ``x`` ``(N, ...)`` inputs, ``y`` ``(N,)``
  integer labels and an optional ``split`` (``train`` / ``validation``) as the table's; without it
  the rows are split as ``folder``'s images.

Validation data is carved from the training part as for every dataset
(:func:`rankwise.data.splits.split_validation`). Bad input raises
:class:`~rankwise.data.base.CorruptDatasetError` naming the file, row and column; every image is
opened before a run's first step by the run's pre-flight check (:mod:`rankwise.data.preflight`,
which names a table's row and column through :class:`TableRows`).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .base import (
    ArrayDataset,
    CorruptDatasetError,
    DatasetNotFoundError,
    ImageFolderDataset,
    LabelledDataset,
    ListRows,
    RetrievalSplits,
)
from .splits import split_validation

__all__ = [
    "OWN_DATASETS",
    "OWN_OPTIONS",
    "IMAGE_SUFFIXES",
    "CSV_COLUMNS",
    "TableRows",
    "arrays_input_shape",
    "load_own_dataset",
]

OWN_DATASETS: tuple[str, ...] = ("folder", "csv", "arrays")
OWN_OPTIONS: tuple[str, ...] = ("test_fraction", "transform", "train_transform")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
CSV_COLUMNS = ("label", "path", "split", "is_query", "is_gallery", "category")
_REQUIRED = ("label", "path", "split")
_SPLITS = ("train", "validation")
_TRUE = ("1", "true", "yes", "y", "t")
_FALSE = ("0", "false", "no", "n", "f")

ImageTransform = Callable[[Any], torch.Tensor]


class _Rows:
    """The parsed items of a source: path or row index, raw label, split, flags, category."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.labels: list[str] = []
        self.split: list[str | None] = []
        self.query: list[bool] = []
        self.gallery: list[bool] = []
        self.category: list[str] = []
        self.where: list[str] = []
        self.has_flags = False
        self.numbers: list[int] = []  # a table's row numbers (the header is row 1)
        self.table: str | None = None


# ----------------------------------------------------------------------------- readers


@dataclass(frozen=True)
class TableRows(ListRows):
    """Where the images of a table are: its rows, in its ``path`` column (for the pre-flight).

    Example:
        >>> TableRows("photos.csv", np.array([2, 7])).where(1)
        "photos.csv row 7, column 'path'"
    """

    unit: str = "row"

    def where(self, index: int) -> str:
        """``"<table> row <row>, column 'path'"`` of sample ``index``."""
        return f"{self.file} row {int(self.rows[index])}, column 'path'"

    def take(self, indices: np.ndarray) -> TableRows:
        """The rows of the samples ``indices``."""
        return TableRows(self.file, self.rows[indices], self.unit)


def _read_folder(root: Path) -> _Rows:
    """One sub-folder per class; images below each (sorted), every one checked."""
    if not root.is_dir():
        raise DatasetNotFoundError(
            f"dataset 'folder': data_dir {str(root)!r} is not a directory; point it at a folder "
            "holding one sub-folder of images per class."
        )
    loose = sorted(
        p.name for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
    )
    if loose:
        raise CorruptDatasetError(
            f"dataset 'folder': image {loose[0]!r} lies directly in {str(root)!r}; every image "
            "must be in its class's sub-folder (ROOT/<class>/<image>)."
        )
    rows = _Rows()
    # hidden folders (.git, .ipynb_checkpoints) are not classes
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(classes) < 2:
        raise CorruptDatasetError(
            f"dataset 'folder': {str(root)!r} has {len(classes)} class sub-folder(s); it needs "
            "one per class, at least 2."
        )
    for folder in classes:
        images = sorted(
            p
            for p in folder.rglob("*")
            if p.suffix.lower() in IMAGE_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        )
        if not images:
            raise CorruptDatasetError(
                f"dataset 'folder': class folder {str(folder)!r} holds no image "
                f"({', '.join(IMAGE_SUFFIXES)}); add images or remove it."
            )
        for path in images:
            where = f"dataset 'folder': class {folder.name!r}, file {str(path.relative_to(root))!r}"
            rows.items.append(str(path))
            rows.labels.append(folder.name)
            rows.split.append(None)
            rows.where.append(where)
    return rows


def _flag(value: str, where: str) -> bool:
    cell = value.strip().lower()
    if cell in _TRUE:
        return True
    if cell in _FALSE:
        return False
    raise CorruptDatasetError(f"{where}: {value!r} is not a flag; write 1 / 0 (or true / false).")


def _table_records(table: Path) -> tuple[list[str], list[dict[str, str]]]:
    """The columns and rows of a table, its header checked against :data:`CSV_COLUMNS`."""
    if not table.is_file():
        raise DatasetNotFoundError(
            f"dataset 'csv': data_dir {str(table)!r} is not a file; point it at a CSV table with "
            f"the columns {', '.join(_REQUIRED)} (optional: is_query, is_gallery, category)."
        )
    try:
        # utf-8-sig: a spreadsheet's byte-order mark is not part of the first column's name
        with open(table, newline="", encoding="utf-8-sig") as handle:
            reader = csv.DictReader(handle)
            columns = [c.strip() for c in reader.fieldnames or []]
            records = [dict(r) for r in reader]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CorruptDatasetError(f"dataset 'csv': cannot read {str(table)!r}: {exc}") from None
    name = f"dataset 'csv': {table.name}"
    missing = [c for c in _REQUIRED if c not in columns]
    if missing:
        raise CorruptDatasetError(
            f"{name}: no column {missing[0]!r} (columns: {', '.join(columns) or 'none'}); the table "
            f"needs {', '.join(_REQUIRED)}."
        )
    unknown = [c for c in columns if c not in CSV_COLUMNS]
    if unknown:
        raise CorruptDatasetError(
            f"{name}: unknown column {unknown[0]!r}; the columns are {', '.join(CSV_COLUMNS)}."
        )
    if not records:
        raise CorruptDatasetError(f"{name}: the table has no rows.")
    flags = [c for c in ("is_query", "is_gallery") if c in columns]
    if len(flags) == 1:
        other = ({"is_query", "is_gallery"} - set(flags)).pop()
        raise CorruptDatasetError(
            f"{name}: column {flags[0]!r} without {other!r}; give both or neither."
        )
    return columns, records


def _table_row(
    rows: _Rows, record: dict[str, str], where: Callable[[str], str], table: Path
) -> Path:
    """Check one table row and append it to ``rows``; returns its image path."""
    if any(value is None for value in record.values()):
        raise CorruptDatasetError(
            f"{where('path').rsplit(',', 1)[0]}: fewer cells than the header's columns."
        )
    label = record["label"].strip()
    if not label:
        raise CorruptDatasetError(f"{where('label')}: empty; every row needs its class.")
    split = record["split"].strip()
    if split not in _SPLITS:
        raise CorruptDatasetError(f"{where('split')}: {split!r} is not 'train' or 'validation'.")
    cell = record["path"].strip()
    if not cell:
        raise CorruptDatasetError(f"{where('path')}: empty.")
    path = Path(cell) if Path(cell).is_absolute() else table.parent / cell
    rows.labels.append(label)
    rows.split.append(split)
    if rows.has_flags:
        rows.query.append(_flag(record["is_query"], where("is_query")))
        rows.gallery.append(_flag(record["is_gallery"], where("is_gallery")))
    if "category" in record:
        rows.category.append(record["category"].strip())
    return path


def _read_table(table: Path) -> _Rows:
    """The rows of an open-metric-learning style table (columns in :data:`CSV_COLUMNS`)."""
    columns, records = _table_records(table)
    name = f"dataset 'csv': {table.name}"
    rows = _Rows()
    rows.table = table.name
    rows.has_flags = "is_query" in columns
    seen: dict[Path, int] = {}
    # row numbers as a spreadsheet shows them: the header is row 1
    for row, raw in enumerate(records, start=2):

        def where(column: str, row: int = row) -> str:
            return f"{name} row {row}, column {column!r}"

        if None in raw:  # csv.DictReader keeps cells past the header under None
            raise CorruptDatasetError(
                f"{name} row {row}: {len(columns) + len(raw[None])} cells for {len(columns)} "  # type: ignore[index]
                "columns; quote cells holding commas."
            )
        record = {k.strip(): v for k, v in raw.items()}
        path = _table_row(rows, record, where, table)
        key = Path(os.path.normpath(path))
        if key in seen:
            raise CorruptDatasetError(
                f"{where('path')}: {record['path'].strip()!r} is already on row {seen[key]}; each "
                "image once."
            )
        seen[key] = row
        rows.items.append(str(path))
        rows.numbers.append(row)
        rows.where.append(f"{name} row {row}")
    return rows


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DatasetNotFoundError(
            f"dataset 'arrays': data_dir {str(path)!r} is not a file; point it at an .npz with "
            "arrays x (N, ...) and y (N,) (optional: split)."
        )
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as exc:  # zipfile / numpy format errors of a broken file
        raise CorruptDatasetError(f"dataset 'arrays': cannot read {str(path)!r}: {exc}") from None
    name = f"dataset 'arrays': {path.name}"
    for key in ("x", "y"):
        if key not in arrays:
            raise CorruptDatasetError(
                f"{name}: no array {key!r} (arrays: {', '.join(sorted(arrays)) or 'none'}); it "
                "needs x (N, ...) inputs and y (N,) labels."
            )
    x, y = arrays["x"], arrays["y"]
    if x.ndim < 2 or not (x.dtype == np.uint8 or np.issubdtype(x.dtype, np.floating)):
        raise CorruptDatasetError(
            f"{name}: array 'x' must be uint8 or float with shape (N, ...), got {x.dtype} "
            f"{x.shape}."
        )
    if y.shape != (x.shape[0],) or not np.issubdtype(y.dtype, np.integer):
        raise CorruptDatasetError(
            f"{name}: array 'y' must be ({x.shape[0]},) integers (one label per row of x), got "
            f"{y.dtype} {y.shape}."
        )
    if np.issubdtype(x.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(x.reshape(x.shape[0], -1)).all(axis=1))
        if bad.size:
            raise CorruptDatasetError(f"{name}: array 'x' row {int(bad[0])}: NaN or inf values.")
    if "split" in arrays:
        split = arrays["split"]
        if split.shape != (x.shape[0],):
            raise CorruptDatasetError(
                f"{name}: array 'split' must be ({x.shape[0]},), got {split.shape}."
            )
        values = np.asarray(split).astype(str)
        bad = np.flatnonzero(~np.isin(values, _SPLITS))
        if bad.size:
            raise CorruptDatasetError(
                f"{name}: array 'split' row {int(bad[0])}: {values[bad[0]]!r} is not 'train' or "
                "'validation'."
            )
        arrays["split"] = values
    return arrays


def arrays_input_shape(data_dir: str | os.PathLike) -> tuple[tuple[int, ...], str]:
    """The shape of one input of an ``arrays`` dataset and its raw kind (``uint8`` / ``float``).

    Example:
        >>> import tempfile, numpy as np, pathlib
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "d.npz"
        >>> np.savez(f, x=np.zeros((4, 3), np.float32), y=np.arange(4))
        >>> arrays_input_shape(f)
        ((3,), 'float')
    """
    x = _load_npz(Path(data_dir))["x"]
    return tuple(int(s) for s in x.shape[1:]), "uint8" if x.dtype == np.uint8 else "float"


# ----------------------------------------------------------------------------- splits


def _class_split(
    labels: np.ndarray, protocol: str, test_fraction: float, seed: int, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of (train, test) items: by class (open-set) or within every class (closed-set)."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    if protocol == "open-set":
        n_test = max(2, int(round(test_fraction * classes.size)))
        if classes.size - n_test < 2:
            raise CorruptDatasetError(
                f"dataset {name!r}: {classes.size} classes cannot give {n_test} test classes and "
                "keep 2 to train on (open-set splits whole classes); add classes or use "
                "protocol: closed-set."
            )
        test_classes = rng.choice(classes, size=n_test, replace=False)
        test = np.isin(labels, test_classes)
        return np.flatnonzero(~test), np.flatnonzero(test)
    test_idx = []
    for c in classes:
        members = np.flatnonzero(labels == c)
        if members.size < 2:
            raise CorruptDatasetError(
                f"dataset {name!r}: class {c} has {members.size} item; a closed-set split needs "
                "2 per class (a query and a gallery item)."
            )
        n = min(members.size - 1, max(1, int(round(test_fraction * members.size))))
        test_idx.append(rng.choice(members, size=n, replace=False))
    test_arr = np.sort(np.concatenate(test_idx))
    mask = np.ones(labels.size, dtype=bool)
    mask[test_arr] = False
    return np.flatnonzero(mask), test_arr


def _label_ids(raw: Sequence[Any], train_idx: np.ndarray) -> np.ndarray:
    """Training classes -> ``0 .. C_train - 1`` (sorted), the others after them (sorted)."""
    raw_arr = np.asarray(raw)
    train_classes = sorted(set(raw_arr[train_idx].tolist()))
    mapping = {c: i for i, c in enumerate(train_classes)}
    rest = sorted(set(raw_arr.tolist()) - set(mapping))
    mapping.update({c: len(train_classes) + i for i, c in enumerate(rest)})
    return np.asarray([mapping[c] for c in raw_arr.tolist()], dtype=np.int64)


class _Maker:
    """Builds the datasets of one source (image files or in-memory arrays)."""

    def __init__(
        self,
        name: str,
        rows: _Rows | None,
        x: np.ndarray | None,
        image_size: int,
        transform: ImageTransform | None,
        train_transform: ImageTransform | None,
    ) -> None:
        self.name, self.rows, self.x = name, rows, x
        self.image_size = image_size
        self.transform, self.train_transform = transform, train_transform

    def __call__(self, split: str, idx: np.ndarray, labels: np.ndarray) -> LabelledDataset:
        if self.x is not None:
            return ArrayDataset(self.x[idx], labels, name=f"{self.name}/{split}")
        assert self.rows is not None
        tf = self.train_transform if split == "train" and self.train_transform else self.transform
        origin = None
        if self.rows.table is not None:
            origin = TableRows(self.rows.table, np.asarray(self.rows.numbers, dtype=np.int64)[idx])
        ds = ImageFolderDataset(
            [self.rows.items[i] for i in idx],
            labels,
            tf,
            None,
            self.image_size,
            f"{self.name}/{split}",
            origin=origin,
        )
        if self.rows.category:
            ds.categories = np.asarray([self.rows.category[i] for i in idx], dtype=str)  # type: ignore[attr-defined]
        return ds


def _query_gallery(rows: _Rows, test_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """A table's test queries and gallery from its flags (``None``: leave-one-out)."""
    q = np.asarray(rows.query, dtype=bool)[test_idx]
    g = np.asarray(rows.gallery, dtype=bool)[test_idx]
    if (q & g).all():
        return test_idx, None  # every validation row both: leave-one-out
    both = np.flatnonzero(q & g)
    if both.size:
        raise CorruptDatasetError(
            f"{rows.where[test_idx[both[0]]]}, columns 'is_query' / 'is_gallery': the row is both a "
            "query and a gallery item while others are not; rankwise evaluates disjoint queries "
            "and gallery, or every validation row as both (leave-one-out)."
        )
    neither = np.flatnonzero(~q & ~g)
    if neither.size:
        raise CorruptDatasetError(
            f"{rows.where[test_idx[neither[0]]]}, columns 'is_query' / 'is_gallery': a validation "
            "row that is neither query nor gallery would be dropped; flag it."
        )
    if not q.any() or not g.any():
        raise CorruptDatasetError(
            f"dataset 'csv': the validation rows have {int(q.sum())} queries and {int(g.sum())} "
            "gallery items; both are needed."
        )
    return test_idx[q], test_idx[g]


def _read_source(name: str, path: Path) -> tuple[_Rows, np.ndarray | None]:
    """The rows of a folder, table or ``.npz`` (and the arrays' inputs)."""
    if name != "arrays":
        return (_read_folder(path) if name == "folder" else _read_table(path)), None
    arrays = _load_npz(path)
    x = arrays["x"]
    rows = _Rows()
    rows.labels = arrays["y"].astype(np.int64).tolist()
    rows.split = list(arrays["split"]) if "split" in arrays else [None] * x.shape[0]
    rows.where = [f"dataset 'arrays': {path.name} row {i}" for i in range(x.shape[0])]
    return rows, x


def _train_test(
    rows: _Rows, name: str, protocol: str, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Training and test items: the data's ``split`` when it has one, else drawn by class."""
    if rows.split[0] is None:
        return _class_split(np.asarray(rows.labels), protocol, test_fraction, seed, name)
    split = np.asarray(rows.split)
    train_idx = np.flatnonzero(split == "train")
    test_idx = np.flatnonzero(split == "validation")
    if not train_idx.size or not test_idx.size:
        raise CorruptDatasetError(
            f"dataset {name!r}: column 'split' has {train_idx.size} 'train' and "
            f"{test_idx.size} 'validation' rows; both are needed."
        )
    return train_idx, test_idx


def _test_parts(
    rows: _Rows, name: str, protocol: str, train_idx: np.ndarray, test_idx: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None]:
    """The test queries and gallery (``None``: leave-one-out) under ``protocol``."""
    if rows.split[0] is not None and rows.has_flags:
        queries, gallery_idx = _query_gallery(rows, test_idx)
    else:
        queries, gallery_idx = test_idx, None
    if protocol == "closed-set" and gallery_idx is None:
        if rows.split[0] is not None:
            raise CorruptDatasetError(
                f"dataset {name!r}: protocol closed-set needs is_query / is_gallery columns to "
                "say the queries and the gallery; without them the validation rows are queried "
                "leave-one-out (open-set)."
            )
        # closed-set without flags: the test queries against the training items (the database)
        gallery_idx = train_idx
    if protocol == "open-set" and gallery_idx is not None:
        raise CorruptDatasetError(
            f"dataset {name!r}: the table's is_query / is_gallery flags make a closed-set "
            "evaluation; set dataset.protocol to closed-set (or leave it unset)."
        )
    return queries, gallery_idx


def load_own_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike | None,
    protocol: str | None,
    val_fraction: float,
    seed: int,
    image_size: int,
    val_holdout: str,
    test_fraction: float = 0.25,
    transform: ImageTransform | None = None,
    train_transform: ImageTransform | None = None,
) -> RetrievalSplits:
    """Load ``folder`` / ``csv`` / ``arrays`` data (module docstring) as :class:`RetrievalSplits`.

    Args:
        name: ``"folder"``, ``"csv"`` or ``"arrays"``.
        data_dir: the class folder root, the table or the ``.npz`` file (required).
        protocol: ``"open-set"`` / ``"closed-set"``; ``None``: open-set, or what a table's flags
            say (a table with ``is_query`` / ``is_gallery`` is closed-set).
        val_fraction: share held out of the training part for validation.
        seed: seed of every split.
        image_size: side of the square image tensors.
        val_holdout: ``"samples"`` or ``"classes"``, as in :func:`rankwise.data.load_dataset`.
        test_fraction: share of the classes (open-set) or of every class's items (closed-set)
            used as the test, when the data has no ``split``.
        transform: PIL image -> tensor for evaluation (default: resize + normalize).
        train_transform: the same for training (default: ``transform``).

    Returns:
        The splits; test items of a table with a ``category`` column carry ``categories``.

    Raises:
        DatasetNotFoundError: ``data_dir`` missing or not there.
        CorruptDatasetError: bad input, naming the file, row and column.
    """
    if data_dir is None:
        raise DatasetNotFoundError(
            f"dataset {name!r} reads your data: set `dataset.data_dir` to "
            + {
                "folder": "a folder of class sub-folders.",
                "csv": "a CSV table.",
                "arrays": "an .npz file.",
            }[name]
        )
    if not 0.0 < float(test_fraction) < 1.0:
        raise ValueError(f"`test_fraction` must be in (0, 1), got {test_fraction}.")
    path = Path(data_dir)
    rows, x = _read_source(name, path)
    if protocol is None:
        # a table's flags decide: disjoint queries and gallery are closed-set
        both = all(q and g for q, g in zip(rows.query, rows.gallery, strict=True))
        protocol = "closed-set" if rows.has_flags and not both else "open-set"
    train_idx, test_idx = _train_test(rows, name, protocol, test_fraction, seed)
    ids = _label_ids(rows.labels, train_idx)
    make = _Maker(name, None if x is not None else rows, x, image_size, transform, train_transform)
    kept, held, train_labels, val_note = split_validation(
        ids[train_idx], val_fraction, seed, val_holdout
    )
    if val_fraction > 0 and held.size == 0:
        raise ValueError(
            f"`val_fraction`={val_fraction} leaves no validation sample for {name!r} (no class "
            "can give two samples and keep one); raise it or lower it to 0."
        )
    train = make("train", train_idx[kept], train_labels[kept])
    val = make("val", train_idx[held], train_labels[held]) if held.size else None
    notes = [f"{name}: {len(rows.labels)} items from {str(path)!r}"]
    if held.size:
        notes.append(val_note)
    queries, gallery_idx = _test_parts(rows, name, protocol, train_idx, test_idx)
    return RetrievalSplits(
        train=train,
        val=val,
        test=make("test", queries, ids[queries]),
        gallery=None if gallery_idx is None else make("gallery", gallery_idx, ids[gallery_idx]),
        protocol=protocol,
        name=name,
        notes=tuple(notes),
    )
