"""The layer order of the issue-20 architecture: a module imports only from its own layer or
lower ones, and the L1 building blocks (metrics, losses, sampling, data) never import each other.

Every import of every module under src/rankwise counts: module level, inside functions, under
``if TYPE_CHECKING``, and the literal module names of ``importlib.import_module(...)`` /
``Lazy(...)``. A violation names the importing module, the imported one and both layers.

    L0 foundation   rankwise._* modules, rankwise.similarity (and the package root)
    L1 blocks       rankwise.metrics, .losses, .sampling, .data   (siblings: no imports between)
    L2 models       rankwise.models, .hashing, .similarity_learning
    L3 training     rankwise.training, .plots, .reporting
    L4 workflows    rankwise.workflows, .experiments
    L5 interface    rankwise.commands, .cli, .__main__
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rankwise

SRC = Path(rankwise.__file__).resolve().parent
LAYERS = {
    "similarity": 0,
    "metrics": 1,
    "losses": 1,
    "sampling": 1,
    "data": 1,
    "models": 2,
    "hashing": 2,
    "similarity_learning": 2,
    "training": 3,
    "plots": 3,
    "reporting": 3,
    "workflows": 4,
    "experiments": 4,
    "commands": 5,
    "cli": 5,
    "__main__": 5,
}
NAMES = ("foundation", "blocks", "models", "training", "workflows", "interface")
SIBLINGS = 1  # the layer whose packages must not import each other

# Compat modules: old public paths that re-export from a higher layer (the only allowed upward
# edges): the hash sweep, bench and tune moved to rankwise.workflows; their old paths re-export.
COMPAT = {"rankwise.hashing.workflow", "rankwise.training.bench", "rankwise.training.tune"}

# Violations of modules other sessions are still moving (issue 20): (importer, imported) pairs,
# each to be fixed there and removed here by the lead. Empty: nothing pending today.
PENDING: set[tuple[str, str]] = set()


def layer_of(module: str) -> int | None:
    """The layer of a rankwise module (None: not rankwise); KeyError for an unplaced package."""
    parts = module.split(".")
    if parts[0] != "rankwise":
        return None
    if len(parts) == 1 or (parts[1].startswith("_") and parts[1] != "__main__"):
        return 0
    return LAYERS[parts[1]]


def describe(module: str) -> str:
    layer = layer_of(module)
    return f"{module} (L{layer} {NAMES[layer]})"


def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """(dotted name, is a package) of a source file under ``root`` (the rankwise folder)."""
    relative = path.relative_to(root.parent).with_suffix("")
    parts = list(relative.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def imports_of(
    source: str, module: str, is_package: bool, known: set[str]
) -> list[tuple[str, int]]:
    """Every rankwise module ``source`` imports, with its line (relative imports resolved).

    ``from package import name`` counts as an import of ``package.name`` when that is a module
    in ``known``, else of ``package``.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((sub if sub in known else target, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "Lazy")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and not node.args[0].value.startswith(".")
        ):
            found.append((node.args[0].value, node.lineno))
    return [(name, line) for name, line in dict.fromkeys(found) if name.split(".")[0] == "rankwise"]


def violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """The layer violations of ``{module: (source, is_package)}``, one message each."""
    known = set(modules)
    out = []
    for module, (source, is_package) in sorted(modules.items()):
        for target, line in imports_of(source, module, is_package, known):
            a, b = layer_of(module), layer_of(target)
            if target == module or (module, target) in PENDING:
                continue
            upward = b > a and module not in COMPAT
            siblings = a == b == SIBLINGS and module.split(".")[1] != target.split(".")[1]
            if upward or siblings:
                kind = "an upper layer" if upward else "a sibling building block"
                out.append(
                    f"{describe(module)} imports {describe(target)} (line {line}): "
                    f"{kind}; move the shared code down or the import up."
                )
    return out


def source_tree() -> dict[str, tuple[str, bool]]:
    modules = {}
    for path in sorted(SRC.rglob("*.py")):
        name, is_package = module_name(path, SRC)
        modules[name] = (path.read_text(encoding="utf-8"), is_package)
    return modules


def test_every_module_has_a_layer():
    unplaced = []
    for name in source_tree():
        try:
            layer_of(name)
        except KeyError:
            unplaced.append(name)
    assert not unplaced, f"modules of no layer (add their package to LAYERS): {unplaced}"


def test_the_source_tree_keeps_the_layer_order():
    found = violations(source_tree())
    assert not found, "layer violations:\n" + "\n".join(found)


def test_the_pending_and_compat_entries_are_still_needed():
    tree = source_tree()
    for importer, target in PENDING:
        source, is_package = tree[importer]
        imported = {t for t, _ in imports_of(source, importer, is_package, set(tree))}
        assert target in imported, f"PENDING ({importer}, {target}) is gone: remove it"
    for module in COMPAT:
        source, is_package = tree[module]
        targets = imports_of(source, module, is_package, set(tree))
        assert any(layer_of(t) > layer_of(module) for t, _ in targets), f"{module}: not compat"


SYNTHETIC = {
    "rankwise.metrics": ("from .ranking import ndcg\n", True),
    "rankwise.metrics.ranking": (
        "import numpy as np\nfrom .._validation import as_tensor\n",
        False,
    ),
    "rankwise.losses": ("", True),
    "rankwise.losses.base": ("from ..similarity import similarity_matrix\n", False),
    "rankwise.training": ("", True),
    "rankwise._validation": ("", False),
    "rankwise.similarity": ("", False),
}


@pytest.mark.parametrize(
    ("importer", "source", "expected"),
    [
        (
            "rankwise.metrics.bad",
            "def f():\n    from ..losses import base\n",
            "rankwise.metrics.bad (L1 blocks) imports rankwise.losses.base (L1 blocks) (line 2): "
            "a sibling building block",
        ),
        (
            "rankwise.losses.bad",
            "import rankwise.training\n",
            "rankwise.losses.bad (L1 blocks) imports rankwise.training (L3 training) (line 1): "
            "an upper layer",
        ),
        (
            "rankwise._bad",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .metrics import ranking\n",
            "rankwise._bad (L0 foundation) imports rankwise.metrics.ranking (L1 blocks) (line 3)",
        ),
        (
            "rankwise.similarity",
            "import importlib\nimportlib.import_module('rankwise.losses.base')\n",
            "rankwise.similarity (L0 foundation) imports rankwise.losses.base (L1 blocks) (line 2)",
        ),
    ],
)
def test_the_checker_names_a_violation(importer, source, expected):
    modules = {**SYNTHETIC, importer: (source, False)}
    found = violations(modules)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_the_checker_accepts_downward_and_same_package_imports():
    modules = {
        **SYNTHETIC,
        "rankwise.losses.good": (
            "from .base import similarity_matrix\nfrom .. import _validation\n",
            False,
        ),
        "rankwise.training.good": (
            "from ..metrics import ndcg\nfrom ..losses import base\n",
            False,
        ),
    }
    assert violations(modules) == []


def test_a_compat_module_may_import_upward():
    modules = {
        **SYNTHETIC,
        "rankwise.hashing.workflow": ("from ..training import Trainer\n", False),
    }
    assert violations(modules) == []
