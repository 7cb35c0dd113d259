"""The sweep loop is written once (issue 32, item 3): only ``rankwise.workflows.sweep`` loops over
a sweep's runs training them; bench, tune and the hash sweep hand the engine a plan and a
summariser. Checked on the source: no loop (``for``, ``while``, comprehension) of a workflow
module reaches a training call (``.fit(...)``, ``run_or_resume(...)``), directly or through a
function of the same module. The check is shown to catch the loops these modules had before."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

import rankwise.workflows as workflows

WORKFLOWS = Path(workflows.__file__).parent
ENGINE = "sweep.py"
PROTOCOLS = ("bench.py", "tune.py", "hashing.py")
TRAINING_CALLS = {"fit", "run_or_resume"}  # a run trained (or kept / resumed) by a trainer
LOOPS = (
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _calls(node: ast.AST) -> list[str]:
    """The names called in ``node``, not counting the bodies of functions defined inside it."""
    found: list[str] = []
    stack = list(ast.iter_child_nodes(node))
    while stack:
        child = stack.pop()
        if isinstance(child, (*FUNCTIONS, ast.ClassDef)):
            continue  # defined here, called (or not) elsewhere
        if isinstance(child, ast.Call) and (name := _called_name(child)) is not None:
            found.append(name)
        stack.extend(ast.iter_child_nodes(child))
    return found


def training_functions(tree: ast.Module) -> set[str]:
    """Functions and methods of the module (by name) that train, directly or through others."""
    bodies: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, FUNCTIONS):
            bodies.setdefault(node.name, []).extend(_calls(node))
    training: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, calls in bodies.items():
            if name not in training and any(c in TRAINING_CALLS | training for c in calls):
                training.add(name)
                changed = True
    return training


def training_loops(source: str) -> list[str]:
    """``line: call`` of every loop that reaches a training call."""
    tree = ast.parse(source)
    reaching = TRAINING_CALLS | training_functions(tree)
    return [
        f"{loop.lineno}: {name}"
        for loop in ast.walk(tree)
        if isinstance(loop, LOOPS)
        for name in _calls(loop)
        if name in reaching
    ]


# the loops of bench, tune and the hash sweep before the engine ran them (condensed)
OLD_TUNE = """
def _run_trial(trial, splits, console, resume=False, name=""):
    for run in trial.runs:
        result, _ = run_or_resume(run, splits, resume=resume, console=console, name=name)

def tune(base, *, output):
    for trial in trials:
        _run_trial(trial, splits, console, resume=resume, name=name)
"""
OLD_HASH = """
def _run_one(cfg, settings, method, bits, splits, overwrite, console):
    def build(**how):
        return build_hash_trainer(cfg, settings, method, bits, splits=splits, **how)
    return run_or_resume(cfg, build, resume=not overwrite)

def run_hash_experiment(config, settings, output):
    results = [_run_one(cfg, *rest) for cfg, *rest in plan]
"""
OLD_BENCH = """
class Sweep:
    def one(self, run):
        return self.build(run).fit(test=True)

    def all(self):
        i = 0
        while i < len(self.runs):
            self.one(self.runs[i])
            i += 1
"""


@pytest.mark.parametrize("source", [OLD_TUNE, OLD_HASH, OLD_BENCH])
def test_the_check_catches_a_sweep_loop_outside_the_engine(source):
    assert training_loops(textwrap.dedent(source))


@pytest.mark.parametrize("module", sorted({p.name for p in WORKFLOWS.glob("*.py")} - {ENGINE}))
def test_no_workflow_loops_over_runs_but_the_engine(module):
    source = (WORKFLOWS / module).read_text()
    assert training_loops(source) == [], f"{module} loops over training runs itself"


@pytest.mark.parametrize("module", PROTOCOLS)
def test_each_protocol_trains_through_run_sweep(module):
    tree = ast.parse((WORKFLOWS / module).read_text())
    # not vacuous: the module still holds training code the check recognises ...
    trains = training_functions(tree)
    if module != "tune.py":  # tune trains through bench's run_trainer(...).fit
        assert trains, f"{module}: no training call found; the check sees nothing"
    else:
        assert "train" in trains
    # ... and hands its runs to the engine
    called = {_called_name(n) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "run_sweep" in called, f"{module} does not run its sweep with run_sweep"


def test_the_engine_has_the_loop():
    tree = ast.parse((WORKFLOWS / ENGINE).read_text())
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, FUNCTIONS)}
    # run_sweep and resume_sweep each take the folder's lock once and run the one loop under it
    for entry in ("run_sweep", "resume_sweep"):
        assert "_run_locked" in _calls(functions[entry]), entry
    loops = [n for n in ast.walk(functions["_run_locked"]) if isinstance(n, ast.For)]
    assert any("_run_one" in _calls(loop) for loop in loops)
    run_one = next(n for n in ast.walk(tree) if isinstance(n, FUNCTIONS) and n.name == "_run_one")
    assert "train" in _calls(run_one)
