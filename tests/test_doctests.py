"""The `>>>` examples in the docstrings under src/rankwise run and print what they show (issue 20).

Every module whose source holds `>>>` is discovered (no hand list, so a new example is picked up),
imported and run through :mod:`doctest`, one pytest case per module, as torchmetrics does. A
module that cannot be imported, or an example that stops on an import, because an optional extra
(pyproject's `[project.optional-dependencies]`) is not installed is skipped with the missing
package named; any other failure fails the case with doctest's report.
"""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import importlib.util
import inspect
import io
import sys
from pathlib import Path

import pytest

import rankwise.losses
import rankwise.metrics
from rankwise._extras import MissingDependencyError
from rankwise.hashing import HammingIndex

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "rankwise"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_with_examples() -> list[str]:
    return sorted(module_name(path) for path in PACKAGE.rglob("*.py") if ">>>" in path.read_text())


def missing_package(error: BaseException | None) -> str | None:
    """The package an import error names, if it is not installed here (None: another error)."""
    if isinstance(error, MissingDependencyError):  # rankwise's own: the extra and what it lacks
        return f"{', '.join(error.missing)} (the {error.extra!r} extra)"
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


def run_examples(module, name: str) -> None:
    """Run every docstring example of ``module``: pass, skip (a missing extra) or fail."""
    tests = doctest.DocTestFinder().find(module, name)
    assert sum(len(test.examples) for test in tests) > 0, (
        f"{name} holds '>>>' but doctest finds no example (a docstring doctest cannot reach?)"
    )
    failed, skipped, report = [], set(), io.StringIO()
    for test in tests:
        runner = RecordingRunner()
        if runner.run(test, out=report.write).failed == 0:
            continue
        # the first failure decides: a missing extra stops the rest of the docstring
        missing = missing_package(runner.problems[0])
        if missing is None:
            failed.append(test.name)
        else:
            skipped.add(missing)
    if failed:
        pytest.fail(f"doctest failures in {failed}:\n{report.getvalue()}")
    if skipped:
        pytest.skip(f"{name}'s examples need the optional package(s) {sorted(skipped)}")


def test_examples_are_discovered():
    # the public API's examples live in these modules; if discovery misses them, nothing runs
    found = set(modules_with_examples())
    assert {"rankwise.metrics.ranking", "rankwise.hashing.index"} <= found, found


def public_api() -> list[tuple[str, object]]:
    """Issue 20's public API: every function and stateful class of rankwise.metrics and every
    loss and function of rankwise.losses (their result dataclasses and constants excepted), the
    HammingIndex and the BilinearSimilarity."""
    api = [("HammingIndex", HammingIndex)]
    for module in (rankwise.metrics, rankwise.losses):
        for name in module.__all__:
            obj = getattr(module, name)
            is_result = dataclasses.is_dataclass(obj) or hasattr(obj, "_fields")
            if inspect.isfunction(obj) or (inspect.isclass(obj) and not is_result):
                api.append((name, obj))
    return api


def test_the_public_api_has_runnable_examples():
    missing = [name for name, obj in public_api() if ">>>" not in (inspect.getdoc(obj) or "")]
    assert missing == [], f"no `>>>` example in the docstring of {missing}"


def test_bilinear_similarity_has_a_runnable_example():
    bilinear = pytest.importorskip("rankwise.similarity_learning.bilinear")
    assert ">>>" in inspect.getdoc(bilinear.BilinearSimilarity)


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as error:
        missing = missing_package(error)
        if missing is None:
            raise
        pytest.skip(f"{name} needs the optional package {missing!r}, not installed")
    run_examples(module, name)


SYNTHETIC = '''
def right():
    """
    >>> 1 + 1
    2
    """


def needs_extra():
    """
    >>> import rankwise_absent_extra
    >>> rankwise_absent_extra.run()
    1
    """
'''


def synthetic_module(tmp_path, monkeypatch, source):
    path = tmp_path / "synthetic_examples.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("synthetic_examples", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "synthetic_examples", module)
    spec.loader.exec_module(module)
    return module


def test_a_wrong_example_fails_with_doctests_report_even_beside_a_missing_extra(
    tmp_path, monkeypatch
):
    module = synthetic_module(tmp_path, monkeypatch, SYNTHETIC.replace("    2\n", "    3\n"))
    with pytest.raises(pytest.fail.Exception, match=r"Expected:\s+3\s+Got:\s+2"):
        run_examples(module, "synthetic_examples")


@pytest.mark.parametrize(
    "stop",
    [
        "import rankwise_absent_extra",
        'from rankwise._extras import require; require(["rankwise_absent_extra"], "x", "y")',
    ],
)
def test_an_example_stopped_by_a_missing_extra_is_skipped_with_its_name(
    tmp_path, monkeypatch, stop
):
    source = SYNTHETIC.replace("import rankwise_absent_extra", stop)
    module = synthetic_module(tmp_path, monkeypatch, source)
    with pytest.raises(pytest.skip.Exception, match="rankwise_absent_extra"):
        run_examples(module, "synthetic_examples")
