"""Compare two golden-output folders of ``run_golden.sh`` exactly; exit 1 on any difference.

``snapshot.pt`` tensors must be identical (dtype, shape, every element; the max abs difference is
reported per differing key), its text entries (recorded errors, string fields) equal; JSON / JSONL
numbers must be equal (differing keys are listed with both values); logs, tables and other text
files are compared line by line after normalising what changes from run to run without being a
result (durations, rates, absolute paths, dates, runs of spaces). ``--ignore-file`` lists what is
known to differ between two runs of the same code, one ``fnmatch`` pattern a line (`` #`` starts a
comment): ``FILE`` for a whole file, ``FILE:KEY`` for a JSON key or a snapshot entry, and
``FILE:~REGEX`` to mask the matches of a regular expression in the lines of a text file (e.g. a
table's seconds column), ``FILE:!REGEX`` to drop its lines that match (e.g. progress lines printed
every few seconds).

    python compare_golden.py DIR_A DIR_B [--ignore-file nondeterministic.txt] [--max-report 20]

``nondeterministic.txt`` beside this file lists what two runs of one commit differ in.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import torch

# Files that only describe the run itself.
SKIPPED_FILES = ("durations.txt", "source.txt")
TEXT_SUFFIXES = (".log", ".md", ".txt", ".csv", ".tsv", ".yaml", ".yml")
# (pattern, replacement) applied in order to text lines and JSON strings before comparing
NORMALISERS = [
    (re.compile(r"\x1b\[[0-9;?]*[A-Za-z]"), ""),  # terminal colours / cursor moves
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d|Z)?"), "<DATE>"),
    (re.compile(r"(/[\w.+@-]+){2,}/?"), "<PATH>"),  # absolute paths (tree and output folders)
    (re.compile(r"\b\d+(\.\d+)?\s*(it/s|s/it|steps/s|samples/s)"), "<RATE>"),
    (re.compile(r"\b\d+:\d\d(:\d\d)?(\.\d+)?\b"), "<CLOCK>"),  # 0:01:23, 01:23
    (re.compile(r"\b\d+(\.\d+)?\s*(ms|µs|us|s|sec|secs|seconds|min|mins|minutes|h)\b"), "<TIME>"),
]


def normalise(text: str, roots: tuple[str, ...]) -> str:
    """``text`` with the output folders, durations, rates, dates and absolute paths replaced."""
    for root in roots:
        text = text.replace(root, "<OUT>")
    for pattern, replacement in NORMALISERS:
        text = pattern.sub(replacement, text)
    return text


class Report:
    """Differences found, grouped by file, and counts of what was identical."""

    def __init__(self, ignore: list[str], max_report: int) -> None:
        self.ignore = [pattern for pattern in ignore if not re.search(":[~!]", pattern)]
        self.masks, self.drops = (
            [
                (pattern.split(marker, 1)[0], re.compile(pattern.split(marker, 1)[1]))
                for pattern in ignore
                if marker in pattern
            ]
            for marker in (":~", ":!")
        )
        self.max_report = max_report
        self.differences: dict[str, list[str]] = {}
        self.ignored = 0
        self.identical: dict[str, int] = {"tensors": 0, "json numbers": 0, "text files": 0}

    def ignored_key(self, key: str) -> bool:
        """Whether ``key`` (``FILE`` or ``FILE:KEY``) matches a pattern of the ignore file."""
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.ignore)

    def add(self, file: str, key: str | None, message: str) -> None:
        """Record a difference unless it is ignored."""
        full = file if key is None else f"{file}:{key}"
        if self.ignored_key(file) or self.ignored_key(full):
            self.ignored += 1
            return
        self.differences.setdefault(file, []).append(
            message if key is None else f"{key}: {message}"
        )

    def kept(self, file: str, lines: list[str]) -> list[str]:
        """``lines`` of ``file`` without those its ``FILE:!REGEX`` patterns drop (counted)."""
        drops = [regex for pattern, regex in self.drops if fnmatch.fnmatchcase(file, pattern)]
        kept = [line for line in lines if not any(regex.search(line) for regex in drops)]
        self.ignored += len(lines) - len(kept)
        return kept

    def masked(self, file: str, line: str) -> str:
        """``line`` of ``file`` with the matches of its ``FILE:~REGEX`` patterns replaced."""
        for pattern, regex in self.masks:
            if fnmatch.fnmatchcase(file, pattern):
                line = regex.sub("<IGNORED>", line)
        return line


def compare_snapshots(path_a: Path, path_b: Path, name: str, report: Report) -> None:
    """Tensors exactly (max abs diff per differing key), text entries as strings."""
    a = torch.load(path_a, weights_only=False)
    b = torch.load(path_b, weights_only=False)
    for section in ("tensors", "text"):
        for key in sorted(a[section].keys() | b[section].keys()):
            if key not in a[section] or key not in b[section]:
                side = "A" if key in a[section] else "B"
                value = (a if side == "A" else b)[section][key]
                shown = value if section == "text" else f"tensor{tuple(value.shape)}"
                report.add(name, key, f"only in {side}: {shown}")
                continue
            x, y = a[section][key], b[section][key]
            if section == "text":
                if x != y:
                    report.add(name, key, f"A={x!r} B={y!r}")
                continue
            if x.dtype != y.dtype or x.shape != y.shape:
                report.add(name, key, f"A {x.dtype}{tuple(x.shape)} vs B {y.dtype}{tuple(y.shape)}")
            elif torch.equal(x, y) or (
                x.is_floating_point()
                and torch.equal(torch.isnan(x), torch.isnan(y))
                and torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0))
            ):
                report.identical["tensors"] += 1
            else:
                diff = (x.double() - y.double()).abs().nan_to_num(math.inf).max().item()
                report.add(name, key, f"max abs diff {diff:.3g}")


def flatten_json(value: Any, prefix: str, out: dict[str, Any]) -> None:
    """Dotted keys (``a.b[3].c``) of every leaf of a JSON value."""
    if isinstance(value, dict):
        for key, item in value.items():
            flatten_json(item, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            flatten_json(item, f"{prefix}[{i}]", out)
    else:
        out[prefix] = value


def load_json_leaves(path: Path) -> dict[str, Any]:
    """Leaves of a JSON file, or of every line of a JSONL file (keys prefixed ``lineN``)."""
    leaves: dict[str, Any] = {}
    if path.suffix == ".jsonl":
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                flatten_json(json.loads(line), f"line{number}", leaves)
    else:
        flatten_json(json.loads(path.read_text()), "", leaves)
    return leaves


def same_leaf(x: Any, y: Any, roots: tuple[str, ...]) -> bool:
    """Numbers exactly (NaN equals NaN), strings after normalisation, the rest by ``==``."""
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, str) and isinstance(y, str):
        return normalise(x, roots) == normalise(y, roots)
    return type(x) is type(y) and x == y


def compare_json(
    path_a: Path, path_b: Path, name: str, roots: tuple[str, ...], report: Report
) -> None:
    """Every leaf key: present on both sides and equal."""
    a, b = load_json_leaves(path_a), load_json_leaves(path_b)
    for key in sorted(a.keys() | b.keys()):
        if key not in a or key not in b:
            report.add(name, key, f"only in {'A' if key in a else 'B'}: {a.get(key, b.get(key))!r}")
        elif same_leaf(a[key], b[key], roots):
            if isinstance(a[key], (int, float)) and not isinstance(a[key], bool):
                report.identical["json numbers"] += 1
        else:
            report.add(name, key, f"A={a[key]!r} B={b[key]!r}")


def compare_text(
    path_a: Path, path_b: Path, name: str, roots: tuple[str, ...], report: Report
) -> None:
    """Line by line after normalisation; the differing lines are reported with their numbers."""
    lines_a, lines_b = (
        report.kept(name, [" ".join(line.split()) for line in normalise(text, roots).splitlines()])
        for text in (path_a.read_text(errors="replace"), path_b.read_text(errors="replace"))
    )
    if len(lines_a) != len(lines_b):
        report.add(name, None, f"{len(lines_a)} lines in A, {len(lines_b)} in B")
    same = len(lines_a) == len(lines_b)
    for number, (x, y) in enumerate(zip(lines_a, lines_b, strict=False), 1):
        if x == y:
            continue
        if report.masked(name, x) == report.masked(name, y):
            report.ignored += 1
            continue
        same = False
        report.add(name, None, f"line {number}: A={x!r} B={y!r}")
    if same:
        report.identical["text files"] += 1


def compare_dirs(dir_a: Path, dir_b: Path, report: Report) -> None:
    """Every file of either folder: missing on one side, or compared by its kind."""
    # absolute only (a bare folder name is no path), the longer first (run-2 contains run)
    roots = tuple(sorted({str(dir_a.resolve()), str(dir_b.resolve())}, key=len, reverse=True))
    files_a = {p.relative_to(dir_a).as_posix() for p in dir_a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(dir_b).as_posix() for p in dir_b.rglob("*") if p.is_file()}
    for name in sorted(files_a | files_b):
        if Path(name).name in SKIPPED_FILES:
            continue
        if name not in files_a or name not in files_b:
            report.add(name, None, f"only in {'A' if name in files_a else 'B'}")
            continue
        path_a, path_b = dir_a / name, dir_b / name
        try:
            if name.endswith("snapshot.pt"):
                compare_snapshots(path_a, path_b, name, report)
            elif path_a.suffix in (".json", ".jsonl"):
                compare_json(path_a, path_b, name, roots, report)
            elif path_a.suffix in TEXT_SUFFIXES:
                compare_text(path_a, path_b, name, roots, report)
        except (ValueError, OSError, RuntimeError) as error:
            report.add(name, None, f"could not compare: {type(error).__name__}: {error}")


def read_ignore_file(path: str | None) -> list[str]:
    """Patterns of the ignore file: one a line, `` #`` comments and blank lines dropped."""
    if path is None:
        return []
    lines = Path(path).read_text().splitlines()
    patterns = (line.split(" #", 1)[0].strip() for line in lines if not line.startswith("#"))
    return [pattern for pattern in patterns if pattern]


def main(argv: list[str] | None = None) -> int:
    """Compare, print every difference (at most ``--max-report`` per file) and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir_a", type=Path)
    parser.add_argument("dir_b", type=Path)
    parser.add_argument("--ignore-file", help="fnmatch patterns of keys that may differ")
    parser.add_argument("--max-report", type=int, default=20, help="differences shown per file")
    args = parser.parse_args(argv)
    report = Report(read_ignore_file(args.ignore_file), args.max_report)
    compare_dirs(args.dir_a, args.dir_b, report)
    total = 0
    for name, messages in report.differences.items():
        total += len(messages)
        print(f"== {name}: {len(messages)} difference(s)")
        for message in messages[: args.max_report]:
            print(f"   {message}")
        if len(messages) > args.max_report:
            print(f"   ... {len(messages) - args.max_report} more")
    identical = ", ".join(f"{count} {kind}" for kind, count in report.identical.items())
    print(
        f"SUMMARY: {total} difference(s) in {len(report.differences)} file(s); identical: "
        f"{identical}; {report.ignored} ignored by --ignore-file"
    )
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
