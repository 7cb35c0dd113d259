"""``rankwise experiment``: the papers' analysis figures as commands.

``rankwise experiment list`` and ``rankwise experiment NAME [--output DIR|FILE] [--quick]
[--seed N] [options]``, each writing JSON, a PNG figure and printing a one-line verdict. The
experiments live in :mod:`rankwise.experiments`; this module turns each one's keyword options into
command-line options (``tuple`` options as comma-separated lists); errors go through
:func:`~rankwise.commands.common.cli_errors`, nothing written.
"""

from __future__ import annotations

import inspect
import time
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..experiments import REGISTRY, ExperimentSpec, get_experiment
from ..experiments.base import DEFAULT_OUTPUT_DIR, option_help, parse_sequence, showing_progress
from .common import cli_errors, error_console, output_console

# what every experiment's --help says before it is started
PROGRESS_AND_INTERRUPTS = (
    "Progress goes to stderr: a bar in a terminal, otherwise a line at least every 10 s while "
    "parts finish. The JSON and PNG are written only at the end: Ctrl-C / SIGTERM (exit 130 / "
    "143) keep nothing, and the experiment starts again from the beginning."
)

__all__ = ["experiment_app"]

_FRAMEWORK_OPTIONS = ("output", "overwrite")  # the options every experiment has

experiment_app = typer.Typer(
    name="experiment",
    help="Reproduce the papers' analysis figures: JSON, a PNG figure and a one-line verdict.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@experiment_app.command("list")
def list_command() -> None:
    """List the experiments with what they reproduce."""
    table = Table(show_header=True, header_style="bold")
    table.add_column("experiment")
    table.add_column("what it does")
    table.add_column("paper")
    for name in REGISTRY:
        spec = get_experiment(name).spec
        table.add_row(spec.name, escape(spec.summary), escape(spec.reference))
    output_console(width=200).print(table)


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return annotation, False


def _cli_option(
    param: inspect.Parameter, annotation: Any, help_text: str
) -> tuple[inspect.Parameter, Callable[[Any], Any]]:
    """The typer parameter for one experiment option, and the converter of its parsed value."""
    inner, optional = _unwrap_optional(annotation)
    flag = "--" + param.name.replace("_", "-")
    default = param.default
    convert: Callable[[Any], Any] = lambda value: value  # noqa: E731
    if typing.get_origin(inner) is tuple:
        kind = typing.get_args(inner)[0]

        def convert(value: Any, _name: str = param.name, _kind: type = kind) -> Any:
            return value if value is None else parse_sequence(value, _name, _kind)

        cli_type: Any = Optional[str]  # noqa: UP045 - typer reads typing.Optional
        if default is not None:
            default = ",".join(str(v) for v in default)
    elif inner in (bool, int, float, str):
        cli_type = Optional[inner] if optional else inner  # noqa: UP045
    else:
        raise TypeError(f"option `{param.name}`: unsupported annotation {annotation!r}.")
    option = typer.Option(default, flag, help=help_text, show_default=default is not None)
    return (
        inspect.Parameter(
            param.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=cli_type
        ),
        convert,
    )


class ProgressDisplay:
    """An experiment's progress on stderr: a bar in a terminal, otherwise plain lines.

    A line (``NAME: 3/24 parts done (12%), last talr_ap 16 bits; 75 s elapsed, ~525 s left``) comes
    when a part finishes at least ``every`` seconds after the previous line, so a run of a few
    seconds prints none.

    Args:
        name: the experiment.
        console: where to show it.
        every: the shortest time between two lines, in seconds.
    """

    def __init__(self, name: str, console: Console, every: float = 10.0) -> None:
        self.name = name
        self.console = console
        self.every = every
        self._bar: Any = None
        self._task: Any = None
        self._start = self._last = time.perf_counter()

    def __call__(self, done: int, total: int, what: str) -> None:
        """Show that ``done`` of ``total`` parts are done (``what``: the last one)."""
        now = time.perf_counter()
        if done == 0:
            self._start = self._last = now
            self._start_bar(total)
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=done, description=f"{self.name}: {what}")
            if done >= total:
                self.close()
            return
        if now - self._last >= self.every and done < total:
            elapsed = now - self._start
            self.console.print(
                f"{self.name}: {done}/{total} parts done ({100 * done / total:.0f}%), last "
                f"{what}; {elapsed:.0f} s elapsed, ~{elapsed / done * (total - done):.0f} s left",
                soft_wrap=True,
                markup=False,
                highlight=False,
            )
            self._last = now

    def _start_bar(self, total: int) -> None:
        if not self.console.is_terminal:
            return
        from rich.progress import (  # noqa: PLC0415 - only in a terminal
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.close()
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self._bar.start()
        self._task = self._bar.add_task(self.name, total=total)

    def close(self) -> None:
        """Remove the bar (if any)."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _make_command(spec: ExperimentSpec) -> Callable[..., None]:
    hints = typing.get_type_hints(spec.compute)
    helps = option_help(spec.compute)
    run = get_experiment(spec.name)
    converters: dict[str, Callable[[Any], Any]] = {}
    params = [
        inspect.Parameter(
            "output",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(
                None,
                "--output",
                "-o",
                help="Directory (NAME.json and NAME.png inside) or a .json file (PNG beside it); "
                f"default {DEFAULT_OUTPUT_DIR}/.",
            ),
            annotation=Optional[Path],  # noqa: UP045
        ),
        inspect.Parameter(
            "overwrite",
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(False, "--overwrite", help="Replace existing result files."),
            annotation=bool,
        ),
    ]
    for param in spec.parameters():
        cli_param, converters[param.name] = _cli_option(
            param, hints[param.name], helps.get(param.name, "")
        )
        params.append(cli_param)

    # the Python argument names in messages become this command's flags
    flags = {name: "--" + name.replace("_", "-") for name in (*converters, *_FRAMEWORK_OPTIONS)}

    def command(**kwargs: Any) -> None:
        output = kwargs.pop("output") or DEFAULT_OUTPUT_DIR
        overwrite = kwargs.pop("overwrite")
        err = error_console()
        # at once, on stderr: stdout carries the verdict line alone
        err.print(
            f"rankwise experiment {spec.name}: {spec.summary} -> {output}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        display = ProgressDisplay(spec.name, err)
        # results are written only once complete: an interrupted experiment leaves nothing
        with cli_errors(
            f"experiment {spec.name}",
            flags,
            bad_input=(ValueError, FileExistsError),
            err=err,
            interrupted_note="nothing written",
        ):
            options = {name: converters[name](value) for name, value in kwargs.items()}
            try:
                with showing_progress(display):
                    result = run(output=output, overwrite=overwrite, **options)
            finally:
                display.close()
        console = output_console(width=400)
        console.print(result.verdict, markup=False, highlight=False, soft_wrap=True)
        console.print(
            f"wrote {result.json_path} and {result.figure_path}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__name__ = spec.name.replace("-", "_")
    doc = inspect.getdoc(spec.compute) or spec.summary
    command.__doc__ = (
        f"{doc.split(chr(10) + chr(10))[0]}\n\nReproduces {spec.reference}.\n\n"
        f"{PROGRESS_AND_INTERRUPTS}"
    )
    return command


for _name in REGISTRY:
    _spec = get_experiment(_name).spec
    experiment_app.command(_name, short_help=_spec.summary)(_make_command(_spec))
