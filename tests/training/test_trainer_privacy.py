"""No module outside trainer.py uses a private name of the Trainer (checked on the source's AST).

The Trainer's parts (callbacks, the pretraining, the sweeps, the commands) reach it through its
public API and its seams (``batch_source``, ``end_policy``); a private name used elsewhere (an
override of ``_finish``, a call of ``_result``) would tie them to its inside.
"""

import ast
from pathlib import Path

import rankwise

SOURCE = Path(rankwise.__file__).parent
TRAINER = SOURCE / "training" / "trainer.py"


def trainer_private_names():
    """The ``_name`` methods and attributes of the Trainer class (dunders excluded)."""
    tree = ast.parse(TRAINER.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "self":
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def trainer_subclasses(tree):
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(
            (isinstance(b, ast.Name) and b.id.endswith("Trainer"))
            or (isinstance(b, ast.Attribute) and b.attr.endswith("Trainer"))
            for b in node.bases
        )
    ]


def private_uses(path, private):
    """``(line, name)`` of each use of a Trainer private name in ``path``."""
    tree = ast.parse(path.read_text())
    uses = []
    subclass_nodes = {id(n) for c in trainer_subclasses(tree) for n in ast.walk(c)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            # another object's private name, or a Trainer subclass's use of the Trainer's own
            if not on_self or id(node) in subclass_nodes:
                uses.append((node.lineno, node.attr))
        elif (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name in private
            and id(node) in subclass_nodes
        ):
            uses.append((node.lineno, node.name))  # an override
    return uses


def test_the_check_sees_the_trainer_private_names():
    private = trainer_private_names()
    assert {"_fit", "_finish", "_end", "_emit"} <= private


def test_no_module_outside_trainer_uses_a_private_trainer_name():
    private = trainer_private_names()
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        if path == TRAINER:
            continue
        uses = private_uses(path, private)
        if uses:
            found[str(path.relative_to(SOURCE))] = uses
    assert found == {}, f"private Trainer names used outside trainer.py: {found}"


def test_the_check_finds_an_override_and_a_call(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "class Pre(Trainer):\n"
        "    def _finish(self, test):\n"
        "        return self._end(None, test, False)\n"
        "def f(trainer):\n"
        "    trainer._emit('on_fit_start')\n"
    )
    assert sorted(private_uses(bad, trainer_private_names())) == [
        (2, "_finish"),
        (3, "_end"),
        (5, "_emit"),
    ]


def test_the_trainer_stays_small_and_no_training_module_grows_past_700_lines():
    """Issue 37 item 2: the Trainer keeps assembly, API and end policy; its parts own the rest."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (SOURCE / "training").glob("*.py")}
    assert sizes["trainer.py"] <= 600, sizes["trainer.py"]
    assert {name: n for name, n in sizes.items() if n > 700} == {}
