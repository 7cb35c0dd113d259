"""The pre-flight check of image files (``rankwise.data.preflight``): missing and broken files
named with their list row, every one counted; a passed file list cached by its fingerprint."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from rankwise.data import load_dataset
from rankwise.data.preflight import DataFilesError, check_image_files

HEADER = "image_id class_id super_class_id path"


def make_sop(base, classes=8, per_class=3):
    """SOP layout: the first half of the classes train, the others test, tiny PNGs."""
    root = base / "Stanford_Online_Products"
    rows = {"train": [], "test": []}
    for c in range(1, classes + 1):
        split = "train" if c <= classes // 2 else "test"
        for k in range(per_class):
            rel = f"chair_final/{c}_{k}.png"
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (6, 6), (c, k, 9)).save(root / rel)
            rows[split].append(f"{len(rows['train']) + len(rows['test']) + 1} {c} 1 {rel}")
    for split, name in (("train", "Ebay_train.txt"), ("test", "Ebay_test.txt")):
        (root / name).write_text("\n".join([HEADER, *rows[split]]) + "\n")
    return root


def splits_of(base):
    return load_dataset("sop", data_dir=base, val_fraction=0.25, image_size=6)


def test_a_good_tree_passes_and_is_cached_until_a_file_changes(tmp_path):
    root = make_sop(tmp_path)
    cache = tmp_path / "cache" / "preflight.json"
    first = check_image_files(splits_of(tmp_path), cache=cache, workers=3)
    assert (first.files, first.decoded, first.cached) == (24, 24, False)
    assert json.loads(cache.read_text())["fingerprint"] == first.fingerprint
    again = check_image_files(splits_of(tmp_path), cache=cache)
    assert (again.decoded, again.cached, again.fingerprint) == (0, True, first.fingerprint)
    # the same file rewritten (another size) is another list: every file is opened again
    Image.new("RGB", (7, 6)).save(root / "chair_final/1_0.png")
    changed = check_image_files(splits_of(tmp_path), cache=cache)
    assert (changed.decoded, changed.cached) == (24, False)
    assert changed.fingerprint != first.fingerprint
    # without a cache nothing is written and everything is opened
    assert check_image_files(splits_of(tmp_path)).decoded == 24


def test_every_bad_file_is_named_with_its_list_line(tmp_path):
    root = make_sop(tmp_path)
    (root / "chair_final/2_1.png").unlink()  # Ebay_train.txt line 6
    (root / "chair_final/3_0.png").write_bytes(b"not an image")  # line 8
    png = (root / "chair_final/6_2.png").read_bytes()
    (root / "chair_final/6_2.png").write_bytes(png[: len(png) // 2])  # Ebay_test.txt line 7
    (root / "chair_final/7_0.png").write_bytes(b"")  # Ebay_test.txt line 8
    (root / "chair_final/8_1.png").unlink()
    (root / "chair_final/8_1.png").mkdir()  # Ebay_test.txt line 12: a folder, not a file
    cache = tmp_path / "preflight.json"
    with pytest.raises(DataFilesError) as caught:
        check_image_files(splits_of(tmp_path), cache=cache, workers=2)
    error = caught.value
    train_list, test_list = root / "Ebay_train.txt", root / "Ebay_test.txt"
    found = {(b.path.split("/")[-1], b.where, b.problem.split(" (")[0]) for b in error.bad}
    assert found == {
        ("2_1.png", f"{train_list}, line 6", "missing"),
        ("3_0.png", f"{train_list}, line 8", "not an image"),
        ("6_2.png", f"{test_list}, line 7", "not an image"),  # cut short after its header
        ("7_0.png", f"{test_list}, line 8", "not an image"),
        ("8_1.png", f"{test_list}, line 12", "unreadable"),
    }
    message = str(error)
    assert message.startswith("dataset 'sop': ") and "\n" not in message
    assert message.count("): ") == 3 and "and 2 more of the 24 files" in message
    assert not cache.exists()  # a failed check caches nothing


def test_array_datasets_have_no_file_to_check(tmp_path):
    report = check_image_files(load_dataset("digits"), cache=tmp_path / "preflight.json")
    assert (report.files, report.decoded) == (0, 0)
    assert not (tmp_path / "preflight.json").exists()
