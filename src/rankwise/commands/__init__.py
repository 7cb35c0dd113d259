"""The sub-commands of the ``rankwise`` command line, one module each.

Adding a sub-command is one file plus one registration line:

1. write ``commands/<name>.py`` with a typer command function (its docstring is the help text,
   its parameters the options); import heavy modules inside the function (a fast ``--help``) and
   run the body inside :func:`~rankwise.commands.common.cli_errors` (exit codes and flag names);
2. add ``"<name>": "<module>:<function>"`` to :data:`COMMANDS` below (the target may also be a
   ``typer.Typer`` of sub-commands, e.g. ``rankwise experiment list``; it is added as a group).

:func:`register` adds them to :mod:`rankwise.cli`'s app in this order (``rankwise --help``'s).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer

__all__ = ["COMMANDS", "register"]

# sub-command name -> "<module in rankwise.commands>:<typer command function>"
COMMANDS: dict[str, str] = {
    "evaluate": "evaluate:evaluate",
    "train": "train:train",
    "bench": "bench:bench",
    "tune": "tune:tune",
    "pretrain": "pretrain:pretrain",
    "embed": "embed:embed",
    "search": "search:search",
    "export": "export:export",
    "show": "show:show",
    "experiment": "experiment:experiment_app",
    "hash": "hash:hash_app",
    "roc": "roc:roc_app",
}


def register(app: typer.Typer) -> typer.Typer:
    """Add every sub-command of :data:`COMMANDS` to ``app`` and return it."""
    import typer

    for name, target in COMMANDS.items():
        module_name, _, function_name = target.partition(":")
        module = importlib.import_module(f"{__name__}.{module_name}")
        command = getattr(module, function_name)
        if isinstance(command, typer.Typer):
            app.add_typer(command, name=name)
        else:
            app.command(name)(command)
    return app
