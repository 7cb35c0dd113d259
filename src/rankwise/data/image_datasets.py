"""Image-folder retrieval benchmarks read from their official on-disk layouts and split files.

Splits follow the metric-learning literature the papers use: CUB-200-2011 and Stanford Online
Products as in Gajić et al., Sec. 4.1, Cars196, In-Shop Clothes (query-vs-gallery retrieval),
iNaturalist 2018 with the split of Brown et al. (Smooth-AP, ECCV 2020) and PKU VehicleID as in Wen
et al., NeurIPS 2022 (SOPRC), Sec. 6, which further splits the training data 9:1 into train /
validation; the classes and split files of each: docs/training.md, "Datasets". Images are opened
lazily, one per ``__getitem__``.

Labels: the training classes (sorted by original id) become ``0 .. C_train - 1`` and the others
``C_train ..``, so training labels are contiguous (per-class loss state is indexed by label) and
the labels of different splits never collide.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from .base import CorruptDatasetError, ImageFolderDataset, ListRows, RetrievalSplits
from .locate import find_dataset_root
from .splits import split_validation

__all__ = [
    "IMAGE_DATASETS",
    "VEHICLEID_TEST_SIZES",
    "load_image_dataset",
    "read_cub200",
    "read_cars196",
    "read_sop",
    "read_inshop",
    "read_inaturalist",
    "read_vehicleid",
]

ImageTransform = Callable[[Any], torch.Tensor]


class SplitList(NamedTuple):
    """One split as its list file gives it: relative paths, original labels, and their rows."""

    paths: list[str]
    labels: list[Any]
    rows: list[int]  # 1-based row of each sample in `source` (the line of a text list)
    source: Path  # the list file
    unit: str = "line"


# Each reader returns the image root and {split: SplitList}.
ParsedSplits = dict[str, SplitList]

VEHICLEID_TEST_SIZES = {"small": 800, "medium": 1600, "large": 2400}


def _read_rows(
    path: Path, n_cols: int, header: Sequence[str] | None = None
) -> list[tuple[int, list[str]]]:
    """``(line number, fields)`` of rows with exactly ``n_cols`` fields; errors name file and line."""
    if not path.is_file():
        raise CorruptDatasetError(f"split file {str(path)!r} is missing; re-extract the dataset.")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    rows = []
    start = 0
    if header is not None:
        if not lines or lines[0].split() != list(header):
            got = lines[0] if lines else "(empty file)"
            raise CorruptDatasetError(
                f"{str(path)!r}: first line must be the header {' '.join(header)!r}, got {got!r}."
            )
        start = 1
    for lineno, line in enumerate(lines[start:], start=start + 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != n_cols:
            raise CorruptDatasetError(
                f"{str(path)!r} line {lineno}: expected {n_cols} fields, got {len(fields)} "
                f"({line!r}); the file is corrupt."
            )
        rows.append((lineno, fields))
    return rows


def _int(value: str, path: Path, what: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise CorruptDatasetError(
            f"{str(path)!r}: {what} {value!r} is not an integer; the file is corrupt."
        ) from None


# ----------------------------------------------------------------------------- readers

CUB_LAYOUT = """  <dir>/CUB_200_2011/images.txt             lines '<image_id> <relative path>'
  <dir>/CUB_200_2011/image_class_labels.txt lines '<image_id> <class_id 1-200>'
  <dir>/CUB_200_2011/images/<class folder>/<image>.jpg"""


def read_cub200(data_dir: str | os.PathLike | None) -> tuple[Path, ParsedSplits]:
    """CUB-200-2011: classes 1-100 train, 101-200 test; paths relative to ``images/``."""
    root = find_dataset_root(
        "cub200",
        data_dir,
        markers=("images.txt", "image_class_labels.txt", "images"),
        subfolders=("CUB_200_2011", "cub200/CUB_200_2011", "CUB_200_2011/CUB_200_2011"),
        layout=CUB_LAYOUT,
    )
    images = {r[0]: (r[1], n) for n, r in _read_rows(root / "images.txt", 2)}
    labels = {
        r[0]: _int(r[1], root / "image_class_labels.txt", "class id")
        for _, r in _read_rows(root / "image_class_labels.txt", 2)
    }
    unlabeled = sorted(set(images) - set(labels), key=lambda s: (len(s), s))
    if unlabeled:
        raise CorruptDatasetError(
            f"{str(root / 'image_class_labels.txt')!r} has no class for {len(unlabeled)} image "
            f"id(s) of images.txt (first: {unlabeled[0]}); the files do not match."
        )
    out = {s: SplitList([], [], [], root / "images.txt") for s in ("train", "test")}
    for image_id, (rel, lineno) in images.items():
        cls = labels[image_id]
        _add(out["train" if cls <= 100 else "test"], rel, cls, lineno)
    return root / "images", out


def _add(split: SplitList, path: str, label: Any, row: int) -> None:
    split.paths.append(path)
    split.labels.append(label)
    split.rows.append(row)


CARS_LAYOUT = """  <dir>/cars_annos.mat   (struct array 'annotations' with fields relative_im_path, class, ...)
  <dir>/car_ims/000001.jpg ..."""


def read_cars196(data_dir: str | os.PathLike | None) -> tuple[Path, ParsedSplits]:
    """Cars196 (Stanford Cars): classes 1-98 train, 99-196 test, from ``cars_annos.mat``."""
    from scipy.io import loadmat

    root = find_dataset_root(
        "cars196",
        data_dir,
        markers=("cars_annos.mat", "car_ims"),
        subfolders=("cars196", "CARS196", "Cars196", "stanford_cars"),
        layout=CARS_LAYOUT,
    )
    mat_path = root / "cars_annos.mat"
    try:
        annotations = np.atleast_1d(loadmat(mat_path, squeeze_me=True)["annotations"])
        rel_paths = [str(p) for p in annotations["relative_im_path"]]
        classes = [int(c) for c in annotations["class"]]
    except (KeyError, ValueError, TypeError, OSError, IndexError) as exc:
        raise CorruptDatasetError(
            f"{str(mat_path)!r} could not be read as the Cars196 annotations ({exc!r}); it must "
            "hold a struct array 'annotations' with fields 'relative_im_path' and 'class'."
        ) from exc
    out = {s: SplitList([], [], [], mat_path, "annotation") for s in ("train", "test")}
    for number, (rel, cls) in enumerate(zip(rel_paths, classes, strict=True), start=1):
        _add(out["train" if cls <= 98 else "test"], rel, cls, number)
    return root, out


SOP_HEADER = ("image_id", "class_id", "super_class_id", "path")
SOP_LAYOUT = """  <dir>/Stanford_Online_Products/Ebay_train.txt  header 'image_id class_id super_class_id path'
  <dir>/Stanford_Online_Products/Ebay_test.txt
  <dir>/Stanford_Online_Products/<category>_final/<image>.JPG"""


def read_sop(data_dir: str | os.PathLike | None) -> tuple[Path, ParsedSplits]:
    """Stanford Online Products: ``Ebay_train.txt`` / ``Ebay_test.txt`` (labels = class_id)."""
    root = find_dataset_root(
        "sop",
        data_dir,
        markers=("Ebay_train.txt", "Ebay_test.txt"),
        subfolders=("Stanford_Online_Products", "sop/Stanford_Online_Products", "sop"),
        layout=SOP_LAYOUT,
    )
    out: ParsedSplits = {}
    for split, fname in (("train", "Ebay_train.txt"), ("test", "Ebay_test.txt")):
        rows = _read_rows(root / fname, 4, header=SOP_HEADER)
        out[split] = SplitList(
            [r[3] for _, r in rows],
            [_int(r[1], root / fname, "class_id") for _, r in rows],
            [n for n, _ in rows],
            root / fname,
        )
    return root, out


INSHOP_LAYOUT = """  <dir>/list_eval_partition.txt (or <dir>/Eval/list_eval_partition.txt): line 1 the image
      count, line 2 'image_name item_id evaluation_status', then '<img/...jpg> <id_...> train|query|gallery'
  <dir>/img/... (or <dir>/Img/img/...)"""


def _inshop_list(d: Path) -> Path | None:
    for cand in (d / "list_eval_partition.txt", d / "Eval" / "list_eval_partition.txt"):
        if cand.is_file():
            return cand
    return None


def read_inshop(data_dir: str | os.PathLike | None) -> tuple[Path, ParsedSplits]:
    """In-Shop Clothes Retrieval: ``train`` / ``query`` / ``gallery`` partitions, item ids as labels."""
    root = find_dataset_root(
        "inshop",
        data_dir,
        markers=(),
        layout=INSHOP_LAYOUT,
        subfolders=("InShop", "inshop", "In-shop", "In-shop Clothes Retrieval Benchmark"),
        is_root=lambda d: _inshop_list(d) is not None,
    )
    list_path = _inshop_list(root)
    assert list_path is not None  # find_dataset_root's is_root found it
    with open(list_path, encoding="utf-8") as f:
        numbered = [(n, ln) for n, ln in enumerate(f.read().splitlines(), 1) if ln.strip()]
    lines = [ln for _, ln in numbered]
    if len(lines) < 2 or lines[1].split() != ["image_name", "item_id", "evaluation_status"]:
        raise CorruptDatasetError(
            f"{str(list_path)!r}: expected the image count on line 1 and the header "
            "'image_name item_id evaluation_status' on line 2."
        )
    count = _int(lines[0].strip(), list_path, "image count (line 1)")
    out = {s: SplitList([], [], [], list_path) for s in ("train", "query", "gallery")}
    for lineno, line in numbered[2:]:
        fields = line.split()
        if len(fields) != 3 or fields[2] not in out:
            raise CorruptDatasetError(
                f"{str(list_path)!r} line {lineno}: expected '<path> <item_id> train|query|gallery', "
                f"got {line!r}."
            )
        _add(out[fields[2]], fields[0], fields[1], lineno)
    if count != len(lines) - 2:
        raise CorruptDatasetError(
            f"{str(list_path)!r} announces {count} images but lists {len(lines) - 2}; the file is "
            "truncated."
        )
    image_root = root
    first = next((split.paths[0] for split in out.values() if split.paths), None)
    if first is not None and not (root / first).exists() and (root / "Img" / first).exists():
        image_root = root / "Img"
    return image_root, out


INAT_LAYOUT = """  <dir>/Inat_dataset_splits/Inaturalist_train_set1.txt  one relative image path per line,
  <dir>/Inat_dataset_splits/Inaturalist_test_set1.txt   e.g. train_val2018/Plantae/7172/<image>.jpg
  <dir>/train_val2018/<supercategory>/<category id>/<image>.jpg"""


def read_inaturalist(data_dir: str | os.PathLike | None) -> tuple[Path, ParsedSplits]:
    """Read iNaturalist 2018 with the metric-learning split of Brown et al.

    The class of an image is its ``<supercategory>/<category id>`` folder (the last two
    directories of its path).
    """
    split_dir = "Inat_dataset_splits"
    root = find_dataset_root(
        "inaturalist",
        data_dir,
        markers=(
            f"{split_dir}/Inaturalist_train_set1.txt",
            f"{split_dir}/Inaturalist_test_set1.txt",
        ),
        subfolders=("inaturalist", "iNaturalist", "inaturalist2018", "iNaturalist2018"),
        layout=INAT_LAYOUT,
    )
    out: ParsedSplits = {}
    for split, fname in (
        ("train", "Inaturalist_train_set1.txt"),
        ("test", "Inaturalist_test_set1.txt"),
    ):
        path = root / split_dir / fname
        listed = SplitList([], [], [], path)
        for lineno, (rel,) in _read_rows(path, 1):
            parts = rel.split("/")
            if len(parts) < 3:
                raise CorruptDatasetError(
                    f"{str(path)!r} entry {lineno}: {rel!r} is not "
                    "'<...>/<supercategory>/<category>/<image>'."
                )
            _add(listed, rel, "/".join(parts[-3:-1]), lineno)
        out[split] = listed
    return root, out


VEHICLEID_LAYOUT = """  <dir>/train_test_split/train_list.txt      lines '<image_id> <vehicle_id>'
  <dir>/train_test_split/test_list_800.txt   (small), test_list_1600.txt (medium), test_list_2400.txt (large)
  <dir>/image/<image_id>.jpg"""


def read_vehicleid(
    data_dir: str | os.PathLike | None, test_size: str | int = "small"
) -> tuple[Path, ParsedSplits]:
    """PKU VehicleID: ``train_list.txt`` and one of the three test lists (vehicle id = label)."""
    if isinstance(test_size, str) and test_size in VEHICLEID_TEST_SIZES:
        n_ids = VEHICLEID_TEST_SIZES[test_size]
    elif test_size in VEHICLEID_TEST_SIZES.values():
        n_ids = int(test_size)
    else:
        raise ValueError(
            f"`test_size` must be one of {sorted(VEHICLEID_TEST_SIZES)} or "
            f"{sorted(VEHICLEID_TEST_SIZES.values())}, got {test_size!r}."
        )
    test_file = f"test_list_{n_ids}.txt"
    root = find_dataset_root(
        "vehicleid",
        data_dir,
        markers=("train_test_split/train_list.txt", f"train_test_split/{test_file}", "image"),
        subfolders=("VehicleID_V1.0", "vehicleid", "VehicleID", "PKU-VehicleID"),
        layout=VEHICLEID_LAYOUT,
    )
    out: ParsedSplits = {}
    for split, fname in (("train", "train_list.txt"), ("test", test_file)):
        path = root / "train_test_split" / fname
        rows = _read_rows(path, 2)
        out[split] = SplitList(
            [f"image/{r[0]}.jpg" for _, r in rows],
            [_int(r[1], path, "vehicle id") for _, r in rows],
            [n for n, _ in rows],
            path,
        )
    return root, out


# ----------------------------------------------------------------------------- assembly

IMAGE_DATASETS: dict[str, dict[str, Any]] = {
    "cub200": {"reader": read_cub200, "protocol": "open-set"},
    "cars196": {"reader": read_cars196, "protocol": "open-set"},
    "sop": {"reader": read_sop, "protocol": "open-set"},
    "inshop": {"reader": read_inshop, "protocol": "closed-set"},
    "inaturalist": {"reader": read_inaturalist, "protocol": "open-set"},
    "vehicleid": {"reader": read_vehicleid, "protocol": "open-set"},
}


def _label_map(train_labels: list[Any], other: Sequence[list[Any]]) -> dict[Any, int]:
    """Training classes -> 0..C_train-1 (sorted), then the other classes (sorted) after them."""
    train_classes = sorted(set(train_labels))
    mapping = {c: i for i, c in enumerate(train_classes)}
    rest = sorted(set().union(*[set(o) for o in other]) - set(mapping)) if other else []
    mapping.update({c: len(train_classes) + i for i, c in enumerate(rest)})
    return mapping


def load_image_dataset(
    name: str,
    *,
    data_dir: str | os.PathLike | None,
    protocol: str,
    val_fraction: float,
    seed: int,
    image_size: int,
    transform: ImageTransform | None = None,
    train_transform: ImageTransform | None = None,
    val_holdout: str = "samples",
    **reader_kwargs: Any,
) -> RetrievalSplits:
    """Load an image-folder benchmark (``name`` in :data:`IMAGE_DATASETS`).

    Args:
        name: dataset name.
        data_dir: where to look (see :func:`rankwise.data.locate.find_dataset_root`).
        protocol: must equal the dataset's protocol ("closed-set" for ``inshop``, query vs
            gallery; "open-set" for the others).
        val_fraction: share of the training data held out for validation (``0``: none).
        seed: seed of the validation split.
        image_size: side of the square tensors made by the default transform.
        transform: PIL image -> tensor for val / test / gallery (default: resize + normalize).
        train_transform: the same for the training split (default: ``transform``), e.g. with
            random crops and flips.
        val_holdout: ``"samples"`` or ``"classes"``, as in :func:`rankwise.data.load_dataset`
            (every folder benchmark, In-Shop included, has test classes unseen in training).
        reader_kwargs: dataset-specific options (``test_size`` for ``vehicleid``).
    """
    spec = IMAGE_DATASETS[name]
    if protocol != spec["protocol"]:
        raise ValueError(
            f"dataset {name!r} supports only protocol={spec['protocol']!r}"
            + (
                " (query vs gallery from list_eval_partition.txt)"
                if name == "inshop"
                else " (test classes disjoint from training classes, leave-one-out)"
            )
            + f"; got {protocol!r}."
        )
    image_root, parsed = spec["reader"](data_dir, **reader_kwargs)
    train_paths, train_raw = parsed["train"].paths, parsed["train"].labels
    query_key = "query" if "query" in parsed else "test"
    others = [parsed[k].labels for k in parsed if k != "train"]
    mapping = _label_map(train_raw, others)
    if not train_paths or not parsed[query_key].paths:
        raise CorruptDatasetError(
            f"dataset {name!r} at {str(image_root)!r} has an empty training or test split "
            f"({len(train_paths)} train, {len(parsed[query_key].paths)} test images)."
        )

    def ids(raw: list[Any]) -> np.ndarray:
        return np.asarray([mapping[c] for c in raw], dtype=np.int64)

    kept, held, train_labels, val_note = split_validation(
        ids(train_raw), val_fraction, seed, val_holdout
    )
    if val_fraction > 0 and held.size == 0:
        raise ValueError(
            f"`val_fraction`={val_fraction} leaves no validation sample for {name!r} (no class "
            "can give two samples and keep one); raise it or pass val_fraction=0."
        )
    train_tf = train_transform if train_transform is not None else transform

    def make(
        split: str, listed: SplitList, labels: np.ndarray, tf: ImageTransform | None = transform
    ) -> ImageFolderDataset:
        origin = ListRows(str(listed.source), np.asarray(listed.rows, np.int64), listed.unit)
        return ImageFolderDataset(
            listed.paths, labels, tf, image_root, image_size, f"{name}/{split}", origin
        )

    notes = [f"{name}: images under {str(image_root)!r}, loaded lazily"]
    if held.size:
        notes.append(val_note)
    train_all = make("train", parsed["train"], train_labels, train_tf)
    val = None
    if held.size:  # the training list's held-out rows, with the evaluation transform
        val = make("val", parsed["train"], train_labels).subset(held)
    return RetrievalSplits(
        train=train_all.subset(kept),
        val=val,
        test=make("test", parsed[query_key], ids(parsed[query_key].labels)),
        gallery=make("gallery", parsed["gallery"], ids(parsed["gallery"].labels))
        if "gallery" in parsed
        else None,
        protocol=protocol,
        name=name,
        notes=tuple(notes),
    )
