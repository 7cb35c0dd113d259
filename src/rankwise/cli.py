"""The ``rankwise`` command line.

The sub-commands live in :mod:`rankwise.commands` (see its docstring to add one);
``python -m rankwise`` runs the same program.

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

    _conventional_help()
    app = typer.Typer(
        name="rankwise",
        help="Learn and evaluate embeddings by directly optimizing ranking metrics.",
        no_args_is_help=True,
        add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish)
        pretty_exceptions_enable=False,
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(
            False,
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Show the version and exit.",
        ),
    ) -> None:
        """Learn and evaluate embeddings by directly optimizing ranking metrics."""

    return register(app)


def _print_version(value: bool) -> None:
    if value:
        import typer

        from . import __version__

        print(f"rankwise {__version__}")
        raise typer.Exit()


def _conventional_help() -> None:
    """Typer 0.2x's help as click writes it (``EMBEDDINGS``, no ``<bool>``), patched once."""
    from typer import core

    argument, option = core.TyperArgument, core.TyperOption
    if getattr(argument, "_rankwise_help", False) or not hasattr(argument, "_usage_display_name"):
        return
    original_type = option.display_type_rich

    def usage_name(self: Any) -> str:
        name = self.metavar if self.metavar is not None else self.name.upper()
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 and self.metavar is None else "")

    def rich_name(self: Any) -> str:
        return self.metavar if self.metavar is not None else self.name.upper()

    def type_of(self: Any, ctx: Any) -> str | None:
        if self.is_flag and self.metavar is None:
            return None  # a flag takes no value
        return original_type(self, ctx)

    # patching typer's classes in place is the point here (method-assign / a marker attribute)
    argument._usage_display_name = usage_name  # type: ignore[method-assign]
    if hasattr(argument, "_rich_display_name"):
        argument._rich_display_name = rich_name  # type: ignore[method-assign]
    option.display_type_rich = type_of  # type: ignore[method-assign]
    argument._rankwise_help = True  # type: ignore[attr-defined]


def __getattr__(name: str) -> Any:
    # ``rankwise.cli.app`` is built on first access, so importing this module never needs typer
    global _app
    if name == "app":
        if _app is None:
            _app = build_app()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``rankwise`` and ``python -m rankwise`` (``argv``: default sys.argv[1:])."""
    try:
        app = __getattr__("app")
    except MissingDependencyError as exc:
        from .commands.common import EXIT_MISSING_DEPENDENCY

        print(f"rankwise: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_MISSING_DEPENDENCY) from None
    app(args=None if argv is None else list(argv), prog_name="rankwise")


if __name__ == "__main__":
    main()
