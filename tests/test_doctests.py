"""The `>>>` examples in the docstrings under src/rankwise run and print what they show (issue 20).

Every module whose source holds `>>>` is discovered (no hand list, so a new example is picked up),
imported and run through :mod:`doctest`, one pytest case per module, as torchmetrics does. A
module that cannot be imported, or an example that stops on an import, because an optional extra
(pyproject's `[project.optional-dependencies]`) is not installed is skipped with the missing
package named; any other failure fails the case with doctest's report.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import io
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "rankwise"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_with_examples() -> list[str]:
    return sorted(module_name(path) for path in PACKAGE.rglob("*.py") if ">>>" in path.read_text())


def missing_package(error: BaseException | None) -> str | None:
    """The top-level package an import error names, if it is not installed here."""
    name = getattr(error, "name", None)
    if not isinstance(error, ImportError) or not name:
        return None
    top = name.split(".")[0]
    return top if importlib.util.find_spec(top) is None else None


class RecordingRunner(doctest.DocTestRunner):
    """A runner that keeps its failures in order (the exception raised, or None for a wrong
    output), to tell an example stopped by a missing extra from a wrong one."""

    def __init__(self) -> None:
        super().__init__(optionflags=FLAGS)
        self.problems: list[BaseException | None] = []

    def report_failure(self, out, test, example, got):
        self.problems.append(None)
        super().report_failure(out, test, example, got)

    def report_unexpected_exception(self, out, test, example, exc_info):
        self.problems.append(exc_info[1])
        super().report_unexpected_exception(out, test, example, exc_info)


def test_examples_are_discovered():
    # the public API's examples live in these modules; if discovery misses them, nothing runs
    found = set(modules_with_examples())
    assert {"rankwise.metrics.ranking", "rankwise.hashing.index"} <= found, found


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        missing = missing_package(error)
        if missing is None:
            raise
        pytest.skip(f"{name} needs the optional package {missing!r}, not installed")
    tests = doctest.DocTestFinder().find(module, name)
    assert sum(len(test.examples) for test in tests) > 0, (
        f"{name} holds '>>>' but doctest finds no example (a docstring doctest cannot reach?)"
    )
    failed, skipped, report = [], set(), io.StringIO()
    for test in tests:
        runner = RecordingRunner()
        if runner.run(test, out=report.write).failed == 0:
            continue
        # the first error an example raised decides: a missing extra stops the rest of the docstring
        missing = missing_package(runner.problems[0])
        if missing is None:
            failed.append(test.name)
        else:
            skipped.add(missing)
    if failed:
        pytest.fail(f"doctest failures in {failed}:\n{report.getvalue()}")
    if skipped:
        pytest.skip(f"{name}'s examples need the optional package(s) {sorted(skipped)}")
