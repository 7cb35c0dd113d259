"""``rankwise hash``: learn binary codes by tie-aware ranking and evaluate them by Hamming ranking.

``rankwise hash train`` trains TALR (He, Cakir, Bargal & Sclaroff, "Hashing as Tie-Aware Learning
to Rank", CVPR 2018) and its baselines at every code length on one dataset, in the paper's Sec.
5.1 protocol (:mod:`rankwise.workflows.hashing`); ``rankwise hash evaluate`` re-evaluates the
selected checkpoints of a sweep by counting sort and writes the Table 1-style table and the Fig.
3-style tie-breaking plot. Exit codes as :func:`~rankwise.commands.common.cli_errors`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .common import cli_errors, output_console

__all__ = ["FLAGS", "hash_app"]

FLAGS = {
    "output_dir": "--output",
    "run_dir": "--output",
    "overwrite": "--overwrite",
    "config": "--config",
    "device": "--device",
    "hash.bits": "--bits",
    "hash.objective": "--objective",
    "hash.methods": "--methods",
    "dataset.name": "--dataset",
    "data_dir": "dataset.data_dir=DIR",  # no flag: a KEY=VALUE override
}

hash_app = typer.Typer(
    name="hash",
    help="Learn binary codes with tie-aware AP / NDCG (TALR) and evaluate them by Hamming ranking.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _split_list(value: str | None, option: str) -> list[str] | None:
    if value is None:
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise typer.BadParameter(f"{option} needs a comma-separated list.")
    return items


def _overrides(
    overrides: list[str],
    dataset: str | None,
    bits: str | None,
    objective: str | None,
    methods: str | None,
    device: str | None,
    quick: bool,
) -> list[str]:
    extra = list(overrides)
    if dataset is not None:
        # the dataset's own closed-set sizes (setting 1: 100 / 500 per class; digits 20 / 100)
        extra += [f"dataset.name={dataset}", "dataset.options={}"]
    bit_list = _split_list(bits, "--bits")
    if bit_list is not None:
        try:
            extra.append(f"hash.bits=[{','.join(str(int(b)) for b in bit_list)}]")
        except ValueError:
            raise typer.BadParameter(f"--bits must be integers, got {bits!r}.") from None
    if objective is not None:
        extra.append(f"hash.objective={objective}")
    method_list = _split_list(methods, "--methods")
    if method_list is not None:
        extra.append(f"hash.methods=[{','.join(method_list)}]")
    if device is not None:
        extra.append(f"device={device}")
    if quick:
        extra += ["budget.iterations=40", "budget.epochs=null", "eval_every=20"]
    return extra


def _is_mapping(path: Path) -> bool:
    """Whether ``path`` reads as a YAML mapping (yaml alone: before torch loads)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            return isinstance(yaml.safe_load(file), dict)
    except (OSError, ValueError, yaml.YAMLError):  # UnicodeDecodeError is a ValueError
        return False


@hash_app.command("train")
def train_command(
    overrides: list[str] | None = typer.Argument(
        None,
        help="KEY=VALUE config overrides (YAML values), e.g. optimizer.lr=0.002 "
        "hash.loss_params.talr.form=midpoint hash.backbone_options.width=16.",
        show_default=False,
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="Hashing config (training config + a hash: section); default: the built-in "
        "Fashion-MNIST setting-1 config (configs/hash_fashion_mnist.yaml).",
    ),
    dataset: str | None = typer.Option(None, "--dataset", help="Dataset, e.g. fashion-mnist."),
    bits: str | None = typer.Option(None, "--bits", help="Code lengths, e.g. 12,24,32,48."),
    objective: str | None = typer.Option(None, "--objective", help="ap or ndcg (TALR's loss)."),
    methods: str | None = typer.Option(
        None,
        "--methods",
        help="Comma-separated: untrained, talr, talr_midpoint, dpsh, smooth_ap, triplet.",
    ),
    output: Path = typer.Option(
        Path("runs/hash"), "--output", "-o", help="Sweep directory (one run per method and bits)."
    ),
    device: str | None = typer.Option(None, "--device", help="auto, cpu or cuda."),
    quick: bool = typer.Option(False, "--quick", help="40 iterations per run (a smoke test)."),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Retrain the runs in --output (without it, a run trained with another config is "
        "refused; unchanged runs are kept or resumed).",
    ),
) -> None:
    """Train TALR and the baselines at every code length; print the tie-aware mAP table.

    Every run is a run directory <output>/<method>/<bits>bits; the sweep writes results.json,
    results_table.md and results_tie_ranges.png into --output.
    """
    console = output_console(140)
    # at once: torch, the data and the first run take a while (a config that is no YAML
    # mapping is left to the full load's one-line error)
    chosen = [f"{k} {v}" for k, v in (("methods", methods), ("bits", bits)) if v is not None]
    source = f"{dataset} via {config}" if dataset and config else dataset or config
    if config is None or _is_mapping(config):
        console.print(
            f"rankwise hash train: {', '.join(chosen) or 'every method and code length'} of "
            f"{source or 'the Fashion-MNIST setting-1 config'} -> {output}",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )
    extra = _overrides(overrides or [], dataset, bits, objective, methods, device, quick)
    # the sweep's config check names `output` (evaluate's OUTPUT is an argument, not a flag)
    with cli_errors("training", {**FLAGS, "output": "--output"}) as err:
        from ..training import TrainingInterrupted
        from ..training.lock import lock_run_dir
        from ..workflows.hashing import load_hash_config, run_hash_experiment, write_report
        from ..workflows.sweepdir import SweepPaths

        cfg, settings = load_hash_config(config, extra)

        def announce(result, how: str) -> None:
            said = {
                "kept": "; kept from an earlier run",
                "resumed": "; resumed from its checkpoint",
            }
            console.print(
                f"{result.method:>14} {result.bits:>3} bits: tie-aware mAP {result.map:.4f} "
                f"(ties [{result.map_range[0]:.4f}, {result.map_range[1]:.4f}]{said.get(how, '')})",
                soft_wrap=True,
            )

        with lock_run_dir(output, "output_dir"):  # the sweep and its report: one writer
            if not overwrite and SweepPaths(output).hash_config.is_file():
                # a re-run continues the sweep in --output: say so before anything is reused
                err.print(
                    f"note: {output} holds a sweep: runs completed with this config are kept and "
                    "interrupted ones resume from their checkpoints (a run trained with another "
                    "config is refused; --overwrite retrains every run).",
                    soft_wrap=True,
                    markup=False,
                    highlight=False,
                )
            try:
                results = run_hash_experiment(
                    cfg,
                    settings,
                    output,
                    overwrite=overwrite,
                    console=err,
                    progress_callback=announce,
                )
            except TrainingInterrupted as exc:
                exc.resume_command = "the same `rankwise hash train` command"
                raise
            title = f"{cfg.dataset.name}, {settings.objective}"
            paths = write_report(results, output, title=title)
    _print_tables(console, results, paths)


@hash_app.command("evaluate")
def evaluate_command(
    output: Path = typer.Argument(..., help="A sweep directory of `rankwise hash train`."),
    device: str | None = typer.Option(None, "--device", help="auto, cpu or cuda."),
) -> None:
    """Re-evaluate the selected checkpoint of every run of a sweep by Hamming ranking.

    Writes, into the sweep directory, evaluation.json, evaluation_table.md (tie-aware mAP / NDCG
    per method and code length) and evaluation_tie_ranges.png (mAP range over all
    tie-breakings, the paper's Fig. 3).
    """
    console = output_console(140)
    with cli_errors("evaluation", FLAGS, bad_input=(FileNotFoundError, ValueError)):
        from ..training.lock import lock_run_dir
        from ..workflows.hashing import evaluate_sweep, write_report

        # no sweep trains in the folder while it is evaluated
        with lock_run_dir(output, "output", then="evaluate it"):
            made_by = f"`rankwise hash train --output {output}`"
            results = evaluate_sweep(output, device=device, make_sweep=made_by)
            paths = write_report(results, output, prefix="evaluation")
    _print_tables(console, results, paths)


def _print_tables(console, results, paths) -> None:
    from ..workflows.hashing import results_table

    console.print("tie-aware mAP (AP_T) of the test queries against the database:")
    console.print(results_table(results, "map"))
    console.print("tie-aware NDCG:")
    console.print(results_table(results, "ndcg"))
    for path in paths:
        console.print(f"written: {path}", soft_wrap=True)
