"""The experiment framework: registration, results and output rules.

The :func:`experiment` decorator registers a function computing a paper's analysis figure, which
returns an :class:`ExperimentResult` (JSON-ready data, a matplotlib figure, a one-line verdict)
written by the output rules every experiment shares (:func:`resolve_output`). What an experiment
function may take is said in :mod:`rankwise.experiments`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import numpy as np

from .._disk import atomic_write

__all__ = [
    "DEFAULT_OUTPUT_DIR",
    "ExperimentResult",
    "ExperimentSpec",
    "Progress",
    "ProgressSink",
    "experiment",
    "new_figure",
    "option_help",
    "parse_sequence",
    "progress",
    "resolve_output",
    "showing_progress",
]

#: Where the command line writes when ``--output`` is not given.
DEFAULT_OUTPUT_DIR = Path("runs") / "experiments"

_NAME_PATTERN = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
_RESERVED = ("output", "overwrite")


# -- results ------------------------------------------------------------------------------------
def _jsonable(value: Any) -> Any:
    """``value`` with numpy values, tuples and paths as JSON types; NaN and ±inf become ``None``."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, Path):
        return str(value)
    return value


@dataclass
class ExperimentResult:
    """What an experiment produces.

    Attributes:
        name: the experiment's registered name, e.g. ``"estimator-bias"``.
        data: JSON-ready results (numpy values are converted when written).
        verdict: one line saying what was measured and whether it agrees with the paper.
        consistent: True when the measurement agrees with the paper's claim.
        figure: the matplotlib :class:`~matplotlib.figure.Figure` (Agg canvas), or None.
        json_path: where :meth:`save` wrote the JSON (None before).
        figure_path: where :meth:`save` wrote the PNG (None before).
    """

    name: str
    data: dict[str, Any]
    verdict: str
    consistent: bool
    figure: Any = field(default=None, repr=False)
    json_path: Path | None = None
    figure_path: Path | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document: ``{"experiment": name, **data, "verdict", "consistent_with_paper"}``."""
        payload = {"experiment": self.name, **self.data}
        payload["verdict"] = self.verdict
        payload["consistent_with_paper"] = bool(self.consistent)
        return _jsonable(payload)

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON text (no NaN: non-finite numbers are written as null)."""
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"

    def save(self, output: str | Path, overwrite: bool = False) -> tuple[Path, Path]:
        """Write the JSON and the PNG figure (see :func:`resolve_output` for the paths).

        Args:
            output: a ``.json`` file or a directory, as in :func:`resolve_output`.
            overwrite: replace existing files; without it an existing file raises.

        Returns:
            (json_path, png_path).

        Raises:
            FileExistsError: a target exists and ``overwrite`` is False.
        """
        json_path, png_path = resolve_output(self.name, output, overwrite)
        atomic_write(json_path, lambda handle: handle.write(self.to_json().encode()))
        if self.figure is not None:
            png = _figure_png(self.figure)
            atomic_write(png_path, lambda handle: handle.write(png))
        self.json_path, self.figure_path = json_path, png_path
        return json_path, png_path


def resolve_output(name: str, output: str | Path, overwrite: bool = False) -> tuple[Path, Path]:
    """The (JSON, PNG) paths an experiment writes for ``output``, checked before any work is done.

    A path ending in ``.json`` names the JSON file and the PNG gets the same stem; anything else is a
    directory holding ``NAME.json`` and ``NAME.png``.

    Raises:
        ValueError: ``output`` ends in another file suffix (``.png``, ``.txt``...).
        FileExistsError: a target exists and ``overwrite`` is False (results are never overwritten
            silently).
    """
    out = Path(output)
    if out.suffix.lower() == ".json":
        json_path, png_path = out, out.with_suffix(".png")
    elif out.suffix and not out.is_dir() and out.suffix.lower() in (".png", ".txt", ".csv", ".md"):
        raise ValueError(
            f"`output` must be a directory or a .json file, got {str(output)!r}; the PNG is "
            "written beside the JSON with the same name."
        )
    else:
        json_path, png_path = out / f"{name}.json", out / f"{name}.png"
    if not overwrite:
        for path in (json_path, png_path):
            if path.exists():
                raise FileExistsError(
                    f"{path} exists; pass `overwrite` to replace it, or choose another `output`."
                )
    return json_path, png_path


def _require_matplotlib() -> None:
    from .._extras import require

    require(("matplotlib",), "train", "the figures of rankwise.experiments")


def _figure_png(figure: Any) -> bytes:
    import io

    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    # no "Software" metadata: the same result gives the same bytes across matplotlib patch versions
    figure.savefig(buffer, format="png", dpi=110, metadata={"Software": None})
    return buffer.getvalue()


def new_figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (6.4, 4.8)) -> tuple:
    """A matplotlib figure on an Agg canvas (no pyplot state, safe on headless machines).

    Returns:
        (figure, axes), ``axes`` a 2-D array of shape (nrows, ncols).
    """
    _require_matplotlib()
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    axes = figure.subplots(nrows, ncols, squeeze=False)
    return figure, axes


# -- progress ------------------------------------------------------------------------------------
#: Told ``(done, total, what)``: ``done`` of ``total`` parts of the running experiment are done,
#: ``what`` the part that just finished (``(0, total, "")`` when the work starts).
ProgressSink = Callable[[int, int, str], None]
_SINK: contextvars.ContextVar[ProgressSink | None] = contextvars.ContextVar(
    "rankwise_experiment_progress", default=None
)
_T = TypeVar("_T")


@contextlib.contextmanager
def showing_progress(sink: ProgressSink) -> Iterator[None]:
    """Tell ``sink`` the progress of the experiments run inside the block (the command line's)."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


class Progress:
    """The parts of an experiment's work done so far (silent unless :func:`showing_progress`).

    Args:
        total: how many parts the work has.
        sink: who is told (``None``: nobody).
    """

    def __init__(self, total: int, sink: ProgressSink | None) -> None:
        self.total = int(total)
        self.done = 0
        self.sink = sink
        if sink is not None:
            sink(0, self.total, "")

    def advance(self, what: str) -> None:
        """One more part is done; ``what`` names it (e.g. ``"talr_ndcg 32 bits"``)."""
        self.done += 1
        if self.sink is not None:
            self.sink(self.done, self.total, what)

    def track(self, items: Iterable[_T], label: Callable[[_T], str] = str) -> Iterator[_T]:
        """Yield ``items``, advancing (named by ``label(item)``) once each one's work is done."""
        for item in items:
            yield item
            self.advance(label(item))


def progress(total: int) -> Progress:
    """A :class:`Progress` of ``total`` parts for the running experiment.

    An experiment that runs for more than a minute reports its parts with it; the command line
    shows them (a bar in a terminal, a line every 10 s otherwise); from Python nothing is shown.
    """
    return Progress(total, _SINK.get())


# -- options -------------------------------------------------------------------------------------
def parse_sequence(value: Any, name: str, kind: type = float) -> tuple:
    """A tuple of ``kind`` from a sequence or a comma-separated string (``"0.01,0.02"``).

    Raises:
        ValueError: naming ``name`` when an item is not a ``kind`` or the sequence is empty.
    """
    items = value.split(",") if isinstance(value, str) else value
    try:
        parsed = tuple(kind(item.strip()) if isinstance(item, str) else item for item in items)
    except (TypeError, ValueError):
        parsed = None
    if not parsed:
        what = {float: "numbers", int: "integers", str: "names"}.get(kind, kind.__name__)
        raise ValueError(f"`{name}` must be comma-separated {what}, got {value!r}.")
    return parsed


def option_help(func: Callable[..., Any]) -> dict[str, str]:
    """The ``Args:`` section of a Google-style docstring: parameter name -> one-line help text."""
    doc = inspect.getdoc(func) or ""
    helps: dict[str, str] = {}
    in_args, current = False, None
    for line in doc.splitlines():
        if not line.strip():
            continue
        if not line.startswith(" "):
            in_args = line.strip() == "Args:"
            current = None
            continue
        if not in_args:
            continue
        match = re.match(r"^    (\w+)(?: \([^)]*\))?: (.*)$", line)
        if match:
            current = match.group(1)
            helps[current] = match.group(2).strip()
        elif current is not None:
            helps[current] += " " + line.strip()
    return helps


# -- registration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExperimentSpec:
    """A registered experiment.

    Attributes:
        name: command name (lower-case words joined by ``-``).
        summary: one line for ``rankwise experiment list``.
        reference: the paper, section and figure / table it reproduces.
        compute: the undecorated function (keyword-only options, returns ExperimentResult).
        module: the module defining it.
    """

    name: str
    summary: str
    reference: str
    compute: Callable[..., ExperimentResult]
    module: str

    def parameters(self) -> list[inspect.Parameter]:
        """The options of ``compute`` (``quick`` and ``seed`` included), in signature order."""
        return list(inspect.signature(self.compute).parameters.values())


class ExperimentRun(Protocol):
    """A registered experiment's ``run``: options as keywords, its spec as ``run.spec``."""

    spec: ExperimentSpec

    def __call__(self, **options: Any) -> ExperimentResult: ...


def _check_signature(name: str, func: Callable[..., Any]) -> None:
    params = inspect.signature(func).parameters
    for required in ("quick", "seed"):
        if required not in params:
            raise TypeError(f"experiment {name!r}: the function must accept `{required}`.")
    for param in params.values():
        if param.kind is not inspect.Parameter.KEYWORD_ONLY:
            raise TypeError(f"experiment {name!r}: option `{param.name}` must be keyword-only.")
        if param.default is inspect.Parameter.empty:
            raise TypeError(f"experiment {name!r}: option `{param.name}` needs a default.")
        if param.name in _RESERVED:
            raise TypeError(f"experiment {name!r}: `{param.name}` is added by the framework.")


def experiment(
    name: str, summary: str, reference: str
) -> Callable[[Callable[..., ExperimentResult]], ExperimentRun]:
    """Decorator registering an experiment function; the result is the module's ``run``.

    The decorated function gains ``output`` (None: write nothing; else the paths of
    :func:`resolve_output`, checked before the computation starts) and ``overwrite``.

    Args:
        name: the command name, e.g. ``"estimator-bias"``.
        summary: one line shown by ``rankwise experiment list``.
        reference: the paper, section and figure it reproduces.
    """
    if not _NAME_PATTERN.match(name):
        raise ValueError(f"experiment name {name!r} must be lower-case words joined by '-'.")

    def decorate(func: Callable[..., ExperimentResult]) -> ExperimentRun:
        _check_signature(name, func)

        @functools.wraps(func)
        def run(
            *, output: str | Path | None = None, overwrite: bool = False, **options: Any
        ) -> ExperimentResult:
            if output is not None:
                resolve_output(name, output, overwrite)  # fail before the work, not after
            result = func(**options)
            if output is not None:
                result.save(output, overwrite=overwrite)
            return result

        extra = [
            inspect.Parameter("output", inspect.Parameter.KEYWORD_ONLY, default=None),
            inspect.Parameter("overwrite", inspect.Parameter.KEYWORD_ONLY, default=False),
        ]
        signature = inspect.signature(func)
        run.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=[*extra, *signature.parameters.values()]
        )
        registered = cast(ExperimentRun, run)  # the function, once it carries its spec
        registered.spec = ExperimentSpec(
            name=name, summary=summary, reference=reference, compute=func, module=func.__module__
        )
        return registered

    return decorate
