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

Inside L3, ``rankwise.training`` has an order of its own (``TRAINING_TIERS``, issue 32): the
facts and files < the callbacks < strategy, launch and store < the parts the Trainer holds < the
Trainer < the factory < the old import paths, with no import cycle. Old import paths kept as
re-exports (``SHIMS``) are imported by no module of ``src``, and command-line flags are written
only by the interface layer (``commands``, ``cli``).
"""

from __future__ import annotations

import ast
import re
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
    "search": 2,
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


def test_a_lazy_entry_counts_as_an_import():
    modules = {
        **SYNTHETIC,
        "rankwise.metrics.bad": (
            "from .._registry import Lazy\nLOSS = Lazy('rankwise.losses.base', 'RankingLoss')\n",
            False,
        ),
    }
    found = violations(modules)
    assert len(found) == 1 and "imports rankwise.losses.base (L1 blocks) (line 2)" in found[0]


# -- the order inside rankwise.training ----------------------------------------------------------

# Each module of rankwise.training (relative name; "" is the package) in one tier; a module imports
# only its own tier or lower ones, and the imports form no cycle. The Trainer holds the parts of
# the tier below it; the factory (above it) is the config reader's public face (assembly reads the
# config below the Trainer, which gives it its own class).
TRAINING_TIERS: list[set[str]] = [
    # facts, files and settings: what everything above reads
    {
        "errors",
        "config",
        "arguments",
        "rundir",
        "data_record",
        "checkpoint",
        "lock",
        "loader",
        "curves",
        "build",
        "settings",
        "options",
        "result",
        "monitor",
    },
    # the callbacks: below the Trainer, which they read through a protocol (callbacks.base)
    {
        "callbacks",
        "callbacks.base",
        "callbacks.collapse",
        "callbacks.early_stopping",
        "callbacks.host",
        "callbacks.metrics_log",
        "callbacks.mlflow_tracker",
        "callbacks.plots",
        "callbacks.progress",
        "callbacks.selection",
        "callbacks.tensorboard_tracker",
        "callbacks.tracker",
        "replicas",
    },
    # the processes of a run and the run on disk
    {"strategy", "launch", "store"},
    # the parts the Trainer holds, and the config reader it calls with its own class
    {"evaluation", "stop", "assembly", "step"},
    # the fit loop: the steps, their progress and their end (given the parts it uses)
    {"loop"},
    # how a run ends (its result, the interruption, data-error and non-finite ends)
    {"ending"},
    {"trainer"},
    {"factory", "distributed", "inference"},
    # the package and the old import paths
    {"", "state", "failures", "bench", "tune"},
]
# the order the issue asked for: ... < strategy, store < evaluation < trainer < factory
TRAINING_CHAIN = [
    ("errors", "config", "arguments", "rundir", "checkpoint", "lock"),
    ("strategy", "store"),
    ("evaluation",),
    ("trainer",),
    ("factory",),
]


def training_tier(module: str) -> int:
    name = module.removeprefix("rankwise.training").removeprefix(".")
    return next(i for i, tier in enumerate(TRAINING_TIERS) if name in tier)


def training_graph(tree: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Importer -> the rankwise.training modules it imports (every form of import)."""
    inside = {m for m in tree if m == "rankwise.training" or m.startswith("rankwise.training.")}
    graph: dict[str, set[str]] = {}
    for module in inside:
        source, is_package = tree[module]
        targets = {t for t, _ in imports_of(source, module, is_package, set(tree))}
        graph[module] = {t for t in targets if t in inside and t != module}
    return graph


def test_every_training_module_has_a_tier():
    tree = source_tree()
    placed = set().union(*TRAINING_TIERS)
    inside = [m for m in tree if m == "rankwise.training" or m.startswith("rankwise.training.")]
    names = {m.removeprefix("rankwise.training").removeprefix(".") for m in inside}
    assert names <= placed, (
        f"training modules of no tier (add them to TRAINING_TIERS): {sorted(names - placed)}"
    )
    assert placed <= names, f"TRAINING_TIERS names modules that are gone: {sorted(placed - names)}"
    for lower, higher in zip(TRAINING_CHAIN, TRAINING_CHAIN[1:], strict=False):
        assert max(map(training_tier, lower)) < min(map(training_tier, higher)), (lower, higher)


def test_training_modules_import_only_their_tier_or_lower_ones():
    tree = source_tree()
    upward = [
        f"{importer} (tier {training_tier(importer)}) imports {target} (tier {training_tier(target)})"
        for importer, targets in sorted(training_graph(tree).items())
        for target in sorted(targets)
        if training_tier(target) > training_tier(importer)
    ]
    assert not upward, "imports up the order of rankwise.training:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that ends where it starts), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_training_has_no_import_cycle():
    cycle = find_cycle(training_graph(source_tree()))
    assert cycle is None, "an import cycle in rankwise.training: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# -- old import paths ----------------------------------------------------------------------------

# modules kept only so that an old import path works: each re-exports, and no module of src
# imports it (src uses the new path)
SHIMS = {
    "rankwise.training.state",
    "rankwise.training.failures",
    "rankwise.training.bench",
    "rankwise.training.tune",
    "rankwise.hashing.workflow",
    "rankwise.models.bilinear",
    "rankwise.models.mmc",
}
# modules that re-export on purpose as a public path of their own (not an old one)
FACADES = {"rankwise.hashing.codes"}


def is_reexport(source: str) -> bool:
    """Whether a module holds only a docstring, imports and ``__all__``."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [
            "__all__"
        ]:
            continue
        return False
    return True


def test_shims_only_reexport_and_every_reexport_is_listed():
    tree = source_tree()
    for shim in SHIMS:
        assert shim in tree and is_reexport(tree[shim][0]), f"{shim} is no re-export shim"
    found = {m for m, (source, package) in tree.items() if not package and is_reexport(source)}
    assert found <= SHIMS | FACADES, (
        f"re-export modules in neither SHIMS nor FACADES: {found - SHIMS - FACADES}"
    )


def test_no_module_of_src_imports_an_old_import_path():
    tree = source_tree()
    users = [
        f"{module} imports {target} (line {line})"
        for module, (source, package) in sorted(tree.items())
        for target, line in imports_of(source, module, package, set(tree))
        if target in SHIMS and module != target
    ]
    assert not users, "old import paths used inside src (use the new path):\n" + "\n".join(users)


# -- command-line flags only in the interface layer -------------------------------------------------

FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def cli_flags(tree: dict[str, tuple[str, bool]]) -> set[str]:
    """Every ``--flag`` the command line declares (its option names in commands/ and cli)."""
    flags = set()
    for module, (source, _) in tree.items():
        if layer_of(module) == 5:
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if re.fullmatch(r"--[a-z][a-z0-9-]*", node.value):
                        flags.add(node.value)
    return flags


def flags_below_the_interface(tree: dict[str, tuple[str, bool]]) -> set[tuple[str, str, int]]:
    """``(module, flag, line)`` of the command-line flags in string literals below L5.

    Docstrings do not count (they document the command line); f-strings do.
    """
    flags = cli_flags(tree)
    found = set()
    for module, (source, _) in tree.items():
        if layer_of(module) == 5:
            continue
        parsed = ast.parse(source)
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(parsed)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
        }
        for node in ast.walk(parsed):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) in docstrings:
                    continue
                found |= {(module, m, node.lineno) for m in FLAG.findall(node.value) if m in flags}
    return found


def test_no_command_line_flag_below_the_interface_layer():
    tree = source_tree()
    assert {"--resume", "--output", "--overwrite", "--config"} <= cli_flags(tree)
    found = flags_below_the_interface(tree)
    below = sorted(f"{m} line {line}: {flag}" for m, flag, line in found)
    assert not below, (
        "command-line flags below rankwise.commands / rankwise.cli (say the argument or config "
        "key in backticks; commands.common.to_flags turns it into the flag):\n" + "\n".join(below)
    )


def test_the_flag_scan_sees_f_strings_and_skips_docstrings():
    tree = {
        "rankwise.commands.x": ("import typer\nopt = typer.Option(None, '--resume')\n", False),
        "rankwise.training.x": (
            '"""Run ``rankwise train --resume DIR``."""\n'
            "def f(d):\n    return f'continue with rankwise train --resume {d}'\n",
            False,
        ),
    }
    assert flags_below_the_interface(tree) == {("rankwise.training.x", "--resume", 3)}
