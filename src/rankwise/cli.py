"""The ``rankwise`` command line: ``evaluate`` (exact tie-aware retrieval report of saved
embeddings), ``train`` (one training run from a YAML config), ``bench`` (every loss on one
dataset, Table 1 style), ``tune`` (hyper-parameter selection on the validation split) and
``experiment`` (the papers' analysis figures, :mod:`rankwise.experiments`). Each
sub-command lives in :mod:`rankwise.commands`.
"""

from __future__ import annotations

import typer

from .commands.bench import bench
from .commands.evaluate import evaluate
from .commands.experiment import experiment_app
from .commands.train import train
from .commands.tune import tune

app = typer.Typer(
    name="rankwise",
    help="Learn and evaluate embeddings by directly optimizing ranking metrics.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("evaluate")(evaluate)
app.command("train")(train)
app.command("bench")(bench)
app.command("tune")(tune)
app.add_typer(experiment_app, name="experiment")


def main() -> None:  # console-script entry point
    app()


if __name__ == "__main__":
    main()
