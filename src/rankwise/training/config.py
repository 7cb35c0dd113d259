"""Typed, strictly validated configuration of one training run (and of a ``rankwise bench`` sweep).

The defaults and the GPU recipes in ``configs/`` follow the protocol of Wen et al. (NeurIPS 2022),
Sec. 5.1 and App. D.1 (ResNet-50, frozen BN, 512-d projection, P x K batches of 4 per class, SGD
with weight decay 4e-4 and a step schedule, selection on a 10 % validation split). Unknown keys
are reported with their dotted path; ``KEY=VALUE`` overrides are parsed with ``yaml.safe_load``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError

__all__ = [
    "AugmentConfig",
    "BenchConfig",
    "BudgetConfig",
    "Config",
    "ConfigError",
    "DatasetConfig",
    "DistributedConfig",
    "EarlyStoppingConfig",
    "LoggingConfig",
    "LossConfig",
    "MemoryConfig",
    "ModelConfig",
    "OptimizerConfig",
    "SamplerConfig",
    "ScheduleConfig",
    "SelectionConfig",
    "absolute_paths",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "parse_overrides",
    "read_config_file",
    "switch_loss",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RandomResizedCropConfig(_Strict):
    """``dataset.augment.random_resized_crop``: torchvision's ``RandomResizedCrop`` parameters."""

    size: int = Field(gt=0)
    scale: tuple[float, float] = (0.08, 1.0)  # area share of the image, torchvision's default
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)  # aspect ratio w / h


class AugmentConfig(_Strict):
    """``dataset.augment``: seeded augmentation of image files (:mod:`rankwise.data.augment`).

    Training: resize -> random_resized_crop or random_crop -> hflip; evaluation: resize ->
    center_crop. Checked by :func:`rankwise.data.augment.check_augment`.
    """

    resize: int | tuple[int, int] | None = None  # int: the shorter side; [h, w]: that size
    random_resized_crop: RandomResizedCropConfig | None = None
    random_crop: int | None = None
    hflip: float = 0.0  # flip probability
    center_crop: int | None = None  # evaluation
    backend: Literal["pil", "torchvision"] = "pil"

    @model_validator(mode="after")
    def _checked(self) -> AugmentConfig:
        from ..data.augment import check_augment

        check_augment(self.model_dump())
        return self


class DatasetConfig(_Strict):
    """Which data to train on (see :func:`rankwise.data.load_dataset`).

    ``data_dir`` is made absolute (against the working directory, ``~`` expanded) when the config
    is made, so a run's ``config.yaml`` finds its data from any directory.
    """

    name: str
    protocol: Literal["open-set", "closed-set"] | None = None
    data_dir: str | None = None
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    image_size: int = Field(224, gt=0)
    split_seed: int = 0  # fixed across training seeds, so seeds vary only the optimization
    # held-out "classes" validate open-set like the test: selection on held-out samples (the
    # papers' 9:1 split) saturates on small benchmarks
    val_holdout: Literal["samples", "classes"] | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    # every listed image file opened once before the first step (rankwise.data.preflight)
    preflight: bool = True
    augment: AugmentConfig | None = None  # None: every split resized to image_size, no randomness

    @model_validator(mode="after")
    def _augment_size(self) -> DatasetConfig:
        if self.augment is not None:  # its crops must make the model's image_size inputs
            from ..data.augment import augment_transforms

            try:
                augment_transforms(self.augment.model_dump(), self.image_size)
            except ValueError as exc:
                raise ValueError(f"dataset.augment: {exc}") from None
        return self

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().resolve())


class ModelConfig(_Strict):
    """Embedding network (see :func:`rankwise.models.build_model`).

    ``weights_path`` and ``pretrained`` are made absolute (against the working directory) when
    the config is made, so a run's ``config.yaml`` loads them from any directory.
    """

    backbone: str = "small_cnn"
    embedding_dim: int = Field(64, gt=0)
    weights_path: str | None = None
    frozen_bn: bool = True
    pretrained: str | None = None
    # keywords of the backbone: a factory's ("package.module:factory"), timm.create_model's
    # ("timm:NAME"), or a built-in's (small_cnn: width; mlp: hidden, dropout)
    backbone_options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("backbone")
    @classmethod
    def _spelled(cls, value: str) -> str:
        # the spelling of "package.module:factory" / "timm:NAME" before any data is loaded;
        # the import happens when the model is built (build_model_from_config)
        from ..models.external import check_backbone_spec, is_external_backbone

        if is_external_backbone(value):
            check_backbone_spec(value)
        return value

    @field_validator("weights_path", "pretrained")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().resolve())


class MemoryConfig(_Strict):
    """A cross-batch memory of a ranking loss (:class:`rankwise.losses.RankingMemory`)."""

    size: int = Field(gt=0)  # items held; at least sampler.batch_size (a few batches)
    start_step: int = Field(0, ge=0)  # the plain loss before this step


class LossConfig(_Strict):
    """Loss name from :data:`rankwise.losses.LOSSES`, its keyword parameters, an optional memory."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    memory: MemoryConfig | None = None  # only for rankwise.losses.MEMORY_LOSSES


class SamplerConfig(_Strict):
    """P x K batches: ``batch_size / m`` classes with exactly ``m`` samples each."""

    m: int = Field(4, ge=2)
    batch_size: int = Field(32, gt=0)

    @model_validator(mode="after")
    def _two_classes(self) -> SamplerConfig:
        # divisibility by m is checked with the data (build.check_batch_classes)
        if self.batch_size < 2 * self.m:
            raise ValueError(
                f"sampler.batch_size: {self.batch_size} holds fewer than 2 classes of "
                f"m={self.m}; ranking losses need at least 2 classes per batch (batch_size >= "
                f"{2 * self.m})."
            )
        return self

    @property
    def classes_per_batch(self) -> int:
        """Distinct classes in a batch: ``batch_size // m``."""
        return self.batch_size // self.m


class OptimizerConfig(_Strict):
    """SGD (with momentum), Adam or AdamW.

    ``weight_decay``: coupled L2 in the gradient for ``sgd`` / ``adam``; decoupled for ``adamw``
    (Loshchilov & Hutter, ICLR 2019: ``w <- w - lr * weight_decay * w`` beside the Adam step).
    """

    name: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(1e-3, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)  # SGD only
    weight_decay: float = Field(0.0, ge=0.0)
    backbone_lr_mult: float = Field(1.0, gt=0.0)

    @field_validator("name", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value


class ScheduleConfig(_Strict):
    """Learning-rate schedule, evaluated per iteration: constant, step decay or cosine."""

    name: Literal["none", "multistep", "cosine"] = "none"
    milestones: list[int] = Field(default_factory=list)  # multistep: iterations where lr *= gamma
    gamma: float = Field(0.1, gt=0.0)
    min_lr: float = Field(0.0, ge=0.0)  # cosine: final learning rate

    @model_validator(mode="after")
    def _check(self) -> ScheduleConfig:
        if self.name == "multistep":
            if not self.milestones:
                raise ValueError("schedule.milestones: a multistep schedule needs milestones.")
            if (
                any(b <= a for a, b in zip(self.milestones, self.milestones[1:], strict=False))
                or min(self.milestones) <= 0
            ):
                raise ValueError(
                    f"schedule.milestones: {self.milestones} must be positive and strictly "
                    "increasing."
                )
        elif self.milestones:
            raise ValueError(
                f"schedule.milestones: only used by name=multistep, not name={self.name!r}."
            )
        return self


class BudgetConfig(_Strict):
    """Training length: exactly one of ``epochs`` (passes of the batch sampler) or ``iterations``."""

    epochs: int | None = Field(None, gt=0)
    iterations: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _exactly_one(self) -> BudgetConfig:
        if self.epochs is None and self.iterations is None:
            raise ValueError(
                "budget: set one of budget.epochs or budget.iterations (both are null)."
            )
        if self.epochs is not None and self.iterations is not None:
            # typically an override of one on a config that sets the other: say how to clear it
            raise ValueError(
                f"budget: set exactly one of budget.epochs or budget.iterations, got "
                f"epochs={self.epochs} and iterations={self.iterations}; to train "
                f"{self.epochs} epochs add budget.iterations=null, to train {self.iterations} "
                "iterations add budget.epochs=null."
            )
        return self


class QuickConfig(_Strict):
    """What ``rankwise bench --quick`` changes: dotted overrides applied to every run."""

    overrides: dict[str, Any] = Field(
        default_factory=lambda: {"budget.epochs": None, "budget.iterations": 100, "eval_every": 50}
    )


class AblationConfig(_Strict):
    """Optimizers of the Table 2 ablation rows (SGD rows 1-4, Adam row 5)."""

    sgd: OptimizerConfig = Field(
        default_factory=lambda: OptimizerConfig(name="sgd", lr=0.01, momentum=0.9)
    )
    adam: OptimizerConfig = Field(default_factory=lambda: OptimizerConfig(name="adam", lr=1e-3))


class BenchConfig(_Strict):
    """Settings of ``rankwise bench`` (ignored by ``rankwise train``)."""

    losses: list[str] = Field(
        default_factory=lambda: (
            "contrastive triplet multi_similarity xbm fastap smooth_ap dir blackbox_ap auc ap soprc"
        ).split()
    )
    # per-loss dotted overrides, e.g. {"soprc": {"optimizer.name": "sgd", "loss.params.beta": 0.1}}
    overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)
    quick: QuickConfig = Field(default_factory=QuickConfig)
    ablation: AblationConfig = Field(default_factory=AblationConfig)


class SelectionConfig(_Strict):
    """The validation scalar that selects the model (docs/training.md, Model selection)."""

    monitor: str = "map"  # any validation scalar: map, map_at_r, recall@1, ... (monitor.py)

    @field_validator("monitor")
    @classmethod
    def _known(cls, value: str) -> str:
        from .monitor import check_monitor

        return check_monitor(value, argument="selection.monitor")


class EarlyStoppingConfig(_Strict):
    """Stop when the monitored validation value stops improving (callbacks/early_stopping.py)."""

    monitor: str | None = None  # None: selection.monitor
    patience: int = Field(5, gt=0)  # evaluations without improvement
    min_delta: float = Field(0.0, ge=0)
    mode: Literal["max", "min"] = "max"

    @field_validator("monitor")
    @classmethod
    def _known(cls, value: str | None) -> str | None:
        from .monitor import check_monitor

        return None if value is None else check_monitor(value, argument="early_stopping.monitor")


class LoggingConfig(_Strict):
    """Experiment trackers the run also logs to (callbacks/tracker.py; the ``trackers`` extra)."""

    trackers: list[Literal["tensorboard", "mlflow"]] = Field(default_factory=list)
    mlflow_uri: str | None = None  # None: a file: store mlruns/ in the run folder

    @field_validator("trackers")
    @classmethod
    def _once(cls, value: list[str]) -> list[str]:
        twice = sorted({name for name in value if value.count(name) > 1})
        if twice:
            raise ValueError(f"logging.trackers: {', '.join(twice)} listed twice; name each once.")
        return value


class DistributedConfig(_Strict):
    """Data-parallel training under ``torchrun`` (ignored by one process; docs/distributed.md)."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    check_every: int | None = Field(None, gt=0)
    sync_batchnorm: bool = True


class Config(_Strict):
    """One training run: every key is described in docs/training.md; ``configs/*.yaml`` are examples."""

    dataset: DatasetConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    loss: LossConfig
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    budget: BudgetConfig
    eval_every: int = Field(100, gt=0)  # steps between validation evaluations (and checkpoints)
    eval_ks: list[int] = Field(default_factory=lambda: [1, 10, 100])
    # FPR budgets of the verification metrics (ROC AUC, TPR@FPR) in every report; none by default
    eval_fpr: list[float] = Field(default_factory=list)
    eval_batch_size: int = Field(256, gt=0)
    log_every: int = Field(10, gt=0)  # steps between loss / lr / throughput records
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    output_dir: str | None = None  # default: runs/<dataset>/<loss>-seed<seed>
    num_workers: int = Field(0, ge=0)
    deterministic: bool = True
    threads: int | None = Field(None, gt=0)  # torch intra-op threads; None keeps the default
    # autocast of the forward pass: "32" (none), "bf16", "16" (with loss scaling); training/step.py
    precision: Literal["32", "bf16", "16"] = "32"
    # embed each batch in chunks of this many rows (gradient caching); None: one pass
    sub_batch_size: int | None = Field(None, gt=0)
    progress: bool | None = None  # progress bar; None = only when stdout is a terminal
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    early_stopping: EarlyStoppingConfig | None = None  # None: no early stopping
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_text(cls, value: Any) -> Any:
        # YAML reads `precision: 16` as an integer
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("eval_ks")
    @classmethod
    def _ks(cls, value: list[int]) -> list[int]:
        from ..metrics._inputs import MAX_CUTOFF

        if not value or any(not 1 <= k <= MAX_CUTOFF for k in value):
            raise ValueError(
                "eval_ks must be a non-empty list of integers from 1 to 2**63 - 1 "
                f"({MAX_CUTOFF}), got {value}."
            )
        return sorted(set(value))

    @field_validator("eval_fpr")
    @classmethod
    def _fprs(cls, value: list[float]) -> list[float]:
        from ..metrics.verification import check_fprs

        return list(check_fprs(value, "eval_fpr"))

    @model_validator(mode="after")
    def _monitored_cutoffs(self) -> Config:
        """A monitored ``recall@k`` / ``precision@k`` needs ``k`` in ``eval_ks``."""
        from .monitor import check_monitor

        fprs = self.eval_fpr
        check_monitor(self.selection.monitor, self.eval_ks, "selection.monitor", fprs=fprs)
        if self.early_stopping is not None and self.early_stopping.monitor is not None:
            check_monitor(
                self.early_stopping.monitor, self.eval_ks, "early_stopping.monitor", fprs=fprs
            )
        return self

    @property
    def monitor(self) -> str:
        """The monitored validation scalar (``selection.monitor``)."""
        return self.selection.monitor

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, value: DatasetConfig) -> DatasetConfig:
        from ..data import DATASET_ALIASES, DATASETS

        name = DATASET_ALIASES.get(value.name.lower(), value.name.lower())
        if name not in DATASETS:
            raise ValueError(
                f"dataset.name: unknown dataset {value.name!r}; choose one of {tuple(DATASETS)}."
            )
        return value.model_copy(update={"name": name})

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: LossConfig) -> LossConfig:
        from ..losses import LOSSES

        if value.name not in LOSSES:
            raise ValueError(
                f"loss.name: unknown loss {value.name!r}; choose one of {sorted(LOSSES)}."
            )
        return value

    @model_validator(mode="after")
    def _memory(self) -> Config:
        """``loss.memory``: only for a ranking loss, and holding at least one batch."""
        from ..losses import MEMORY_LOSSES

        memory = self.loss.memory
        if memory is None:
            return self
        if self.loss.name not in MEMORY_LOSSES:
            raise ValueError(
                f"loss.memory: loss {self.loss.name!r} takes no memory; it serves the ranking "
                f"losses {', '.join(MEMORY_LOSSES)} ('xbm' has its own); remove loss.memory."
            )
        if memory.size < self.sampler.batch_size:
            raise ValueError(
                f"loss.memory.size: {memory.size} is smaller than sampler.batch_size="
                f"{self.sampler.batch_size}; a memory holds at least one batch (use a few: "
                f"loss.memory.size={4 * self.sampler.batch_size})."
            )
        return self

    def resolved_output_dir(self) -> Path:
        """Run directory: ``output_dir`` or ``runs/<dataset>/<loss>-seed<seed>``."""
        if self.output_dir:
            return Path(self.output_dir)
        return Path("runs") / self.dataset.name / f"{self.loss.name}-seed{self.seed}"

    def to_dict(self) -> dict[str, Any]:
        """Plain-python (YAML / JSON / ``weights_only`` checkpoint safe) form."""
        return self.model_dump(mode="json")


# -- construction --------------------------------------------------------------------------------


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (not part of the config schema; check its spelling)"
        elif err["type"] == "missing":
            msg = "required key is missing"
        # a validator's own message already starts with the dotted key: do not repeat it
        lines.append(msg if loc and msg.startswith(loc.split(".")[0]) else f"{loc}: {msg}")
    return "invalid config:\n  " + "\n  ".join(lines)


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Validate a plain mapping into a :class:`Config`; raises :class:`ConfigError`."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}.")
    try:
        return Config.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> ``{"a.b": 1, "c": "x"}``, values typed with ``yaml.safe_load``."""
    parsed: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"override {item!r} must look like KEY=VALUE, e.g. optimizer.lr=0.01."
            )
        try:
            parsed[key] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: cannot parse value {raw!r}: {exc}") from None
    return parsed


#: the file paths of a config (dotted keys), absolute in every :class:`Config`
PATH_KEYS = ("dataset.data_dir", "model.weights_path", "model.pretrained")


def absolute_paths(data: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the plain config ``data`` with its relative :data:`PATH_KEYS` made absolute.

    Against the working directory, as a :class:`Config` makes them: a sweep's recorded base
    config (``sweep.json``, ``tuned.yaml``) then loads from any directory.
    """
    found = {}
    for dotted in PATH_KEYS:
        section, key = dotted.split(".")
        value = (data.get(section) or {}).get(key) if isinstance(data, Mapping) else None
        if isinstance(value, str) and not Path(value).is_absolute():
            found[dotted] = str(Path(value).expanduser().resolve())
    return apply_overrides(data, found) if found else dict(data)


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Deep copy of ``data`` with each dotted key set (intermediate sections created as needed)."""
    out: dict[str, Any] = yaml.safe_load(yaml.safe_dump(dict(data)))  # deep copy, plain types
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"{dotted}: {'.'.join(parts[: i + 1])} is a value ({child!r}), not a section."
                )
            node = child
        node[parts[-1]] = value
    return out


def switch_loss(
    data: Mapping[str, Any], overrides: Mapping[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """``data`` ready for ``overrides`` that change ``loss.name``: the old loss's params dropped.

    A loss's ``params`` belong to it (SOPRC's ``beta`` is no AUC parameter); ``loss.params``
    overrides still apply on top.

    Args:
        data: the config file's mapping.
        overrides: the parsed dotted overrides.

    Returns:
        ``(data, note)``: the mapping to apply the overrides to, and a sentence saying which
        params were dropped (``None`` when nothing was).
    """
    loss = data.get("loss") if isinstance(data, Mapping) else None
    new_name = overrides.get("loss.name")
    if not isinstance(loss, Mapping) or new_name is None or new_name == loss.get("name"):
        return dict(data), None
    params = loss.get("params") or {}
    out = apply_overrides(data, {"loss.params": {}})
    if not params:
        return out, None
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
    return out, (
        f"loss.name={new_name} replaces {loss.get('name')}: the config's loss.params for "
        f"{loss.get('name')} ({shown}) are not used; set {new_name}'s with loss.params.NAME=VALUE."
    )


_WHAT_A_CONFIG_IS = "a config is a YAML mapping of sections (dataset:, model:, loss:, ...)"


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong with a YAML text, in one line (where, when PyYAML knows)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    lines = str(exc).splitlines()
    return lines[0] if lines else type(exc).__name__


def _top_level_kind(data: Any) -> str:
    if isinstance(data, (bool, int, float)):
        return "a number" if not isinstance(data, bool) else "a boolean"
    kinds: dict[type, str] = {list: "a list", str: "a string"}
    return kinds.get(type(data), f"a {type(data).__name__}")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The sections of a YAML config file as a plain mapping (``{}`` for an empty file).

    Args:
        path: the YAML file.

    Returns:
        Its top-level mapping.

    Raises:
        ConfigError: one line naming the file: it does not exist or cannot be read, is not UTF-8
            text (e.g. a binary file), is not valid YAML, or its top level is not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist.")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a UTF-8 text file (byte {exc.start} is not UTF-8); {_WHAT_A_CONFIG_IS}."
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc}).") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({_yaml_problem(exc)}).") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: {_WHAT_A_CONFIG_IS}, but its top level is {_top_level_kind(data)}."
        )
    return data


def load_config(
    path: str | Path, overrides: Sequence[str] = (), notes: list[str] | None = None
) -> Config:
    """Read a YAML config and apply ``KEY=VALUE`` overrides (a new loss: :func:`switch_loss`).

    Args:
        path: YAML file with the sections of :class:`Config`.
        overrides: strings such as ``"loss.name=soprc"``, ``"optimizer.lr=0.01"``,
            ``"loss.params.beta=0.1"``.
        notes: when given, receives a sentence for every setting of the file that was dropped.

    Returns:
        The validated config.

    Raises:
        ConfigError: unreadable file or not a mapping of sections (:func:`read_config_file`),
            malformed override, unknown key / loss / dataset, or a value that fails validation;
            the message names the dotted key.
    """
    data = read_config_file(path)
    parsed = parse_overrides(overrides)
    data, note = switch_loss(data, parsed)
    if note is not None and notes is not None:
        notes.append(note)
    return config_from_dict(apply_overrides(data, parsed))
