"""Exit codes, error handling, flag names and consoles shared by every sub-command.

The library's errors name config keys (``sampler.batch_size``) and Python arguments in backticks
(`` `losses` ``); only the command line knows its flags, so :func:`to_flags` rewrites those names
into the flags of the command that raised them.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .._disk import DiskFullError, disk_full_cause
from .._extras import MissingDependencyError
from .._signals import signal_label, signal_number_of

if TYPE_CHECKING:  # typer and rich are imported where used: the exit codes need neither
    from rich.console import Console

    from ..training import ConfigError, NonFiniteLossError, TrainingInterrupted
    from ..training.errors import CorruptCheckpointError

    _TrainingErrors = tuple[
        type[ConfigError],
        type[NonFiniteLossError],
        type[TrainingInterrupted],
        type[CorruptCheckpointError],
    ]

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_CONFIG",
    "EXIT_DISK_FULL",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_MISSING_DEPENDENCY",
    "EXIT_TERMINATED",
    "cli_errors",
    "error_console",
    "one_line_warnings",
    "output_console",
    "signal_name",
    "sweep_first_line",
    "to_flags",
    "train_resume_command",
]

EXIT_FAILED = 1  # the run itself failed: a non-finite loss, a collapsed model
EXIT_CONFIG = 2  # a configuration error, reported before any training (as click's usage errors)
EXIT_BAD_INPUT = 2  # unreadable or invalid input files (``rankwise evaluate``)
EXIT_MISSING_DEPENDENCY = 3  # an optional dependency is missing: install the extra it names
EXIT_DISK_FULL = 4  # no space left to write a result: free space (earlier checkpoints are intact)
EXIT_INTERRUPTED = 130  # Ctrl-C after a checkpoint (128 + SIGINT, as shells report it)
EXIT_TERMINATED = 143  # SIGTERM after a checkpoint (128 + SIGTERM: timeout, SLURM, Kubernetes)

_BACKTICKED = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


def to_flags(message: str, flags: Mapping[str, str]) -> str:
    """Rewrite the argument names of a library message into command-line flags.

    Args:
        message: the library's message.
        flags: argument or config key -> flag of this command, e.g. ``{"run_dir": "--resume"}``.

    Returns:
        ``message``, each backticked name of ``flags`` and a leading ``"<name>: "`` as its flag.
    """

    def backticked(match: re.Match[str]) -> str:
        return flags.get(match.group(1), match.group(0))

    head, sep, rest = message.partition(": ")
    if sep and head in flags:
        message = f"{flags[head]}: {rest}"
    return _BACKTICKED.sub(backticked, message)


def loss_list(losses: str | None) -> list[str] | None:
    """``--losses`` as a list: ``None`` for the config's ``bench.losses`` (not given, or ``all``).

    >>> loss_list("ap, soprc,"), loss_list("All"), loss_list(None)
    (['ap', 'soprc'], None, None)
    """
    if losses is None or losses.strip().lower() == "all":
        return None
    return [name.strip() for name in losses.split(",") if name.strip()]


def train_resume_command(run_dir: Any, *options: object) -> str:
    """The command that continues the training run in ``run_dir``.

    ``rankwise train --resume RUN_DIR [options]`` (``options`` each through str, e.g.
    ``"--from-checkpoint", path``); under ``torchrun`` with the same number of processes in a
    data-parallel run, whose checkpoint holds every process's random streams.
    """
    import os

    from ..training.distributed import launched_by_torchrun

    command = " ".join(["rankwise train --resume", str(run_dir), *map(str, options)])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not launched_by_torchrun() or world <= 1:
        return command
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = f"--nnodes {world // per_node} " if world > per_node else ""
    rendezvous = " ..." if nodes else ""  # the rendezvous options of the stopped run
    return f"torchrun {nodes}--nproc-per-node {per_node}{rendezvous} -m {command}"


def output_console(width: int = 140, quiet: bool = False) -> Console:
    """A rich console on stdout.

    Args:
        width: columns of piped or captured output (so tables are not squeezed into 80).
        quiet: print nothing (the ranks other than 0 of a data-parallel run).
    """
    from rich.console import Console

    console = Console(quiet=quiet)
    return console if console.is_terminal else Console(width=width, quiet=quiet)


def error_console(quiet: bool = False) -> Console:
    """The rich console on stderr that every command writes its errors to.

    Args:
        quiet: print nothing (the ranks other than 0 of a ``torchrun`` job).
    """
    from rich.console import Console

    return Console(stderr=True, quiet=quiet)


def sweep_first_line(
    command: str,
    what: str,
    *,
    dataset: str | None,
    config: Any,
    output: Any,
    resume: Any,
    suffix: str = "",
) -> str | None:
    """The first line of a sweep command, from its options and the YAML alone (before torch).

    ``rankwise bench: SOPRC ablation (Table 2) on digits -> runs/bench/digits-ablation``; the
    folder is the command's default ``runs/<command>/<dataset><suffix>`` unless ``output`` is
    given. None when the dataset cannot be told yet (the full load then reports any error).

    Args:
        command: ``"bench"`` or ``"tune"``.
        what: what the sweep runs, e.g. ``"loss comparison (Table 1)"``.
        dataset: the ``--dataset`` option.
        config: the ``--config`` file.
        output: the ``--output`` folder.
        resume: the ``--resume`` folder.
        suffix: appended to the dataset's name in the default folder (``"-ablation"``).
    """
    import os

    if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 alone speaks
        return None
    if resume is not None:
        return f"rankwise {command}: resuming the sweep in {resume} (loading it)"
    name = dataset
    if name is None and config is not None:
        import yaml

        try:
            with open(config, encoding="utf-8") as file:
                name = yaml.safe_load(file)["dataset"]["name"]
        except Exception:  # noqa: BLE001 - an announcement only; the full load reports it
            return None
    if not isinstance(name, str):
        return None
    name = name.replace("_", "-")
    out = output if output is not None else f"runs/{command}/{name}{suffix}"
    return f"rankwise {command}: {what} on {name} -> {out}"


@contextmanager
def one_line_warnings(err: Console) -> Iterator[None]:
    """Show each warning as one ``warning: ...`` line on ``err``, without its file and line.

    Python's default display (``path/file.py:173: UserWarning: ...`` and the source line) is for
    a library's developer; a command's user needs the message. Which warnings are shown (once
    per place, ``-W``, ``PYTHONWARNINGS``) is unchanged.

    Args:
        err: the console the warnings go to.
    """
    import warnings

    from rich.markup import escape

    def show(message: Warning | str, category: type[Warning], *_: Any, **__: Any) -> None:
        text = " ".join(str(message).split()) or category.__name__
        err.print(f"[yellow]warning:[/yellow] {escape(text)}", soft_wrap=True, highlight=False)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _training_errors() -> _TrainingErrors | None:
    """The training exception classes; None if training was never imported (so none was raised)."""
    if "rankwise.training" not in sys.modules:
        return None
    from ..training import ConfigError, NonFiniteLossError, TrainingInterrupted
    from ..training.errors import CorruptCheckpointError

    return ConfigError, NonFiniteLossError, TrainingInterrupted, CorruptCheckpointError


def signal_name(number: int) -> str:
    """How messages name a signal: ``Ctrl-C`` for SIGINT, else its name (``SIGTERM``)."""
    return signal_label(number)


def _interrupted_text(exc: Any, flags: Mapping[str, str], what: str) -> str:
    """The message of a :class:`~rankwise.training.TrainingInterrupted`, with the resume command."""
    text = to_flags(exc.message, flags)
    command = exc.resume_command
    if command is None and exc.run_dir is not None and exc.checkpoint_step is not None:
        command = train_resume_command(exc.run_dir)
    text += f". Resume with: {command}" if command is not None else "."
    if what == "training" or text.startswith(f"{what} interrupted"):
        return text  # the message names what was interrupted already (once)
    return f"{what} interrupted: {text}"


def _no_space_text(exc: BaseException, what: str) -> str | None:
    """The one-line message of a write that found no space left (``None``: not that)."""
    cause = disk_full_cause(exc)
    if cause is None:
        return None
    if isinstance(cause, DiskFullError):  # a checkpoint or result file of rankwise
        text = str(cause)
        if what == "training" and cause.resumable and cause.run_dir is not None:
            text += f" Then resume with: rankwise train --resume {cause.run_dir}"
        return text
    where = f" writing {cause.filename}" if cause.filename else ""
    return f"no space left on device{where}; free space there."


def _data_error_text(exc: BaseException, flags: Mapping[str, str], what: str) -> str | None:
    """The one line of a data file that could not be read (``None``: not a data error).

    A :class:`~rankwise.training.errors.TrainingDataError` ends with the command that resumes the
    run (its checkpoint holds the state of the last complete step).
    """
    base = sys.modules.get("rankwise.data.base")  # not imported: no data error was raised
    if base is None or not isinstance(exc, base.DataError):
        return None
    describe = getattr(exc, "describe", None)
    if describe is None:
        return to_flags(base.DataError.one_line(exc), flags)
    run_dir, step = getattr(exc, "run_dir", None), getattr(exc, "checkpoint_step", None)
    resumable = what == "training" and run_dir is not None and step is not None
    return to_flags(describe(train_resume_command(run_dir) if resumable else None), flags)


def _exit_for(
    exc: BaseException, flags: Mapping[str, str], what: str, note: str = ""
) -> tuple[int, str] | None:
    """The exit code and message (rich markup) of a known error (``None``: not ours)."""
    from rich.markup import escape

    text = to_flags(str(exc), flags)
    data_error = _data_error_text(exc, flags, what)
    if data_error is not None:
        return EXIT_BAD_INPUT, f"[red]data error:[/red] {escape(data_error)}"
    if isinstance(exc, MissingDependencyError):
        return EXIT_MISSING_DEPENDENCY, f"[red]missing dependency:[/red] {escape(text)}"
    no_space = _no_space_text(exc, what)
    if no_space is not None:
        return EXIT_DISK_FULL, f"[red]error:[/red] {escape(no_space)}"
    known = _training_errors()
    if known is not None:
        config_error, failed, interrupted, corrupt = known
        if isinstance(exc, corrupt):
            resume = (
                train_resume_command(exc.run_dir, "--from-checkpoint", exc.fallback)
                if exc.run_dir is not None and exc.fallback is not None
                else None
            )
            return EXIT_CONFIG, f"[red]error:[/red] {escape(to_flags(exc.describe(resume), flags))}"
        if isinstance(exc, config_error):
            return EXIT_CONFIG, f"[red]config error:[/red] {escape(text)}"
        if isinstance(exc, interrupted):
            return exc.exit_code, f"[yellow]{escape(_interrupted_text(exc, flags, what))}[/yellow]"
        if isinstance(exc, failed):
            return EXIT_FAILED, f"[red]{what} failed:[/red] {escape(text)}"
    if isinstance(exc, KeyboardInterrupt):  # before anything was trained or saved
        number = signal_number_of(exc)
        text = f"{what} interrupted ({signal_name(number)}){'; ' + note if note else ''}."
        return 128 + number, f"[yellow]{escape(text)}[/yellow]"
    return None


def _record_for_torchrun(message: str) -> None:
    """Under ``torchrun``, write ``message`` to this worker's error file.

    torchrun's failure summary then shows it as the failed rank's ``traceback :`` line (the root
    cause's included), whichever rank printed it.
    """
    import json
    import os
    import time

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as handle:
            # the format torch's own @record writes (a plain string draws a warning from
            # torchrun); without a py_callstack the summary shows the message
            record = {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}
            json.dump({"message": record}, handle)
    except OSError:
        pass  # the message was printed (by rank 0); the summary then says less


@contextmanager
def cli_errors(
    what: str,
    flags: Mapping[str, str] | None = None,
    *,
    bad_input: tuple[type[Exception], ...] = (),
    err: Console | None = None,
    interrupted_note: str = "",
) -> Iterator[Console]:
    """Turn the library's errors into one message on stderr and the command's exit code.

    ``ConfigError`` -> ``config error: ...``, exit 2; a data file that cannot be read
    (:class:`~rankwise.data.DataError`, e.g. an image changed under a running job) -> ``data
    error: ...`` on one line (during training: with the checkpoint kept and the resume
    command), exit 2; a corrupt checkpoint -> ``error: checkpoint
    PATH is corrupt ...`` (with the command resuming from an older good one), exit 2;
    ``TrainingInterrupted`` -> its message (how to resume), exit 130 for Ctrl-C and 143 for
    SIGTERM (handled like Ctrl-C inside the block); any other interruption -> ``<what>
    interrupted``, the same codes; ``NonFiniteLossError`` -> ``<what> failed: ...``, exit 1;
    :class:`~rankwise._extras.MissingDependencyError` -> the extra to install, exit 3; no space
    left (:class:`~rankwise._disk.DiskFullError`, or ``OSError`` ENOSPC / EDQUOT, also inside
    torch's ``RuntimeError``) -> ``error: no space left on device ...``, exit 4; a ``bad_input``
    exception -> ``error: <first line>``, exit 2. Anything else propagates (a bug).

    Under ``torchrun`` every rank runs the command and would print the same message: rank 0 alone
    prints (the console yielded to the other ranks is quiet), and every rank writes its message to
    torchrun's error file (``TORCHELASTIC_ERROR_FILE``), which torchrun's failure summary shows.

    Args:
        what: the activity, for the messages (``"training"``, ``"bench"``, ``"tune"``).
        flags: argument / config key -> flag, applied to every message with :func:`to_flags`.
        bad_input: exception types that mean invalid input (``rankwise evaluate``).
        err: the console to print to (default :func:`error_console`).
        interrupted_note: appended to a non-training interruption's message (``"nothing written"``).

    Yields:
        The error console.
    """
    import typer
    from rich.markup import escape
    from rich.text import Text

    from .._distributed import launch_rank
    from .._signals import handle_signals

    rank = launch_rank()
    if rank:  # under torchrun every rank runs the command: rank 0 alone prints its messages
        err = error_console(quiet=True)
    err = err if err is not None else error_console()
    flags = dict(flags or {})
    try:
        with handle_signals(), one_line_warnings(err):
            yield err
    except (Exception, KeyboardInterrupt) as exc:
        found = _exit_for(exc, flags, what, interrupted_note)
        if found is None and bad_input and isinstance(exc, bad_input):
            text = escape((to_flags(str(exc), flags).splitlines() or [""])[0])
            found = EXIT_BAD_INPUT, f"[bold red]error:[/bold red] [red]{text}[/red]"
        if found is None:
            raise
        code, message = found
        err.print(message, soft_wrap=True)
        if rank is not None:
            _record_for_torchrun(Text.from_markup(message).plain)
        raise typer.Exit(code) from None
