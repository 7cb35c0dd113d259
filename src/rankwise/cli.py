"""The ``rankwise`` command line.

Sub-commands: ``evaluate`` (exact tie-aware retrieval report of saved embeddings), ``train`` (one
training run from a YAML config), ``bench`` (every loss on one dataset, Table 1 style), ``tune``
(hyper-parameter selection on the validation split) and ``experiment`` (the papers' analysis
figures, :mod:`rankwise.experiments`). The
sub-commands live in :mod:`rankwise.commands` (see its docstring to add one); ``python -m
rankwise`` runs the same program.

The command line needs the ``cli`` extra (typer, rich and the training stack); without it,
``rankwise`` says which extra to install instead of failing with an ``ImportError``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._extras import MissingDependencyError, require

if TYPE_CHECKING:
    import typer

__all__ = ["app", "build_app", "main"]  # noqa: F822 - `app` is built lazily by __getattr__

_app: typer.Typer | None = None


def build_app() -> typer.Typer:
    """A new typer application with every sub-command of :data:`rankwise.commands.COMMANDS`.

    Raises:
        MissingDependencyError: typer or rich is not installed (the ``cli`` extra).
    """
    require(("typer", "rich"), "cli", "the rankwise command line")
    import typer

    from .commands import register

    app = typer.Typer(
        name="rankwise",
        help="Learn and evaluate embeddings by directly optimizing ranking metrics.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    return register(app)


def __getattr__(name: str) -> Any:
    # ``rankwise.cli.app`` is built on first access, so importing this module never needs typer
    global _app
    if name == "app":
        if _app is None:
            _app = build_app()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point of ``rankwise`` (and of ``python -m rankwise``).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    """
    try:
        app = __getattr__("app")
    except MissingDependencyError as exc:
        from .commands.common import EXIT_MISSING_DEPENDENCY

        print(f"rankwise: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_MISSING_DEPENDENCY) from None
    app(args=None if argv is None else list(argv), prog_name="rankwise")


if __name__ == "__main__":
    main()
