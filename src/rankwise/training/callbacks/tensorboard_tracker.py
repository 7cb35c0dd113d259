"""TensorBoard event files of a run: :class:`TensorBoardTracker` (``logging.trackers: [tensorboard]``).

Written with :class:`torch.utils.tensorboard.SummaryWriter` into ``<run folder>/tensorboard``:
the scalars of :mod:`~rankwise.training.callbacks.tracker` against the step, the config as
hyper-parameters (the HParams plugin) and as a YAML text, and the test precision-recall figure as
an image. A resumed run writes to the same folder from its checkpoint's step with ``purge_step``:
TensorBoard's reader then drops what an earlier process logged at that step and after it (the
steps a killed run logged past its checkpoint), and the step's records are logged again, so no
step appears twice. Open it with ``tensorboard --logdir <run folder>/tensorboard``.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .base import TrainerView
from .tracker import Tracker, config_params, metric_name

__all__ = ["TensorBoardTracker"]


class TensorBoardTracker(Tracker):
    """Log the run to TensorBoard event files (needs ``pip install 'rankwise[trackers]'``).

    Args:
        log_dir: the event files' folder (default ``<run folder>/tensorboard``; a trainer without
            a run folder needs it). A fresh run (step 0) deletes the default folder's earlier
            events; in a folder you give, ``purge_step`` hides them from TensorBoard.
        params: the parameters to log (default: the run's config, see :class:`Tracker`).

    Example:
        >>> tracker = TensorBoardTracker(log_dir="runs/tb")  # a Trainer callback
        >>> tracker.log_dir
        PosixPath('runs/tb')
    """

    package = "tensorboard"
    title = "the TensorBoard tracker"

    def __init__(
        self, log_dir: str | Path | None = None, params: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(params)
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.folder: Path | None = None  # where this fit writes
        self._writer: Any = None
        self._purge_step: int | None = None  # for the first writer of a fit

    def _writer_now(self) -> Any:
        """The open writer (a new event file after :meth:`close`)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - the extra

            assert self.folder is not None
            self._writer = SummaryWriter(str(self.folder), purge_step=self._purge_step)
            self._purge_step = None
        return self._writer

    def open(self, trainer: TrainerView, config: Mapping[str, Any] | None) -> None:
        """Write into ``log_dir`` from the trainer's step; log ``config`` (hparams: a fresh run)."""
        if self.log_dir is None and trainer.run_dir is None:
            raise ValueError(
                "TensorBoardTracker: the trainer has no run_dir to write the event files in; "
                "pass TensorBoardTracker(log_dir=...)."
            )
        self.folder = (
            self.log_dir if self.log_dir is not None else trainer.paths.root / "tensorboard"
        )
        if trainer.step == 0 and self.log_dir is None and self.folder.is_dir():
            shutil.rmtree(self.folder)  # an earlier run's events: this one starts afresh
        # what an earlier process logged from this step on is hidden; its records follow again
        self._purge_step = trainer.step
        writer = self._writer_now()
        if config is None:
            return
        # indented: a code block in TensorBoard's markdown; at a resume's step, the config from it
        text = yaml.safe_dump(dict(config), sort_keys=False).replace("\n", "\n    ")
        writer.add_text("config", "    " + text, trainer.step)
        if trainer.step == 0:
            from torch.utils.tensorboard.summary import hparams  # noqa: PLC0415 - the extra

            metric = f"val/{metric_name(trainer.monitor)}"
            for summary in hparams(config_params(config), {metric: 0.0}):
                writer.file_writer.add_summary(summary)  # in this run, not a sub-folder

    def log_scalars(self, step: int, kind: str, scalars: Mapping[str, float]) -> None:
        """One scalar event per name."""
        writer = self._writer_now()
        for name, value in scalars.items():
            writer.add_scalar(name, value, step)

    def log_image(self, step: int, name: str, png: Path) -> None:
        """The PNG as an image event."""
        from matplotlib.image import imread  # noqa: PLC0415 - matplotlib: only when drawing

        self._writer_now().add_image(name, imread(png), step, dataformats="HWC")

    def flush(self) -> None:
        """Write the pending events to disk."""
        if self._writer is not None:
            self._writer.flush()

    def close(self, status: str) -> None:
        """Close the event file (a later event opens a new one in the same folder)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
