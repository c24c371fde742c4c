"""`TrainConfig`: one training run as data (no torch), what `harts.train` runs.

A run is: where the model comes from (`ModelSource`: a registered config or a Hugging Face
checkpoint directory), its rollouts (`DataSource`: a JSONL file or a generated workload
preset, seeded by the run's `seed`), how a step is executed (`mode`, `PlanSource`: planner,
saved plan, microbatch budget), where it runs (`parallel`: None for one process, else a
`TrainParallel` mesh and its pipeline schedule; `Precision`: dtype and device), what it
optimises (`OptimizerConfig`, `PolicyLossConfig`, the MoE aux loss's `aux_scope`, the
old log-probs' source), which kernels its ops run (`KernelConfig`; None: the HARTS_*
environment's when the run starts), and its checkpoints (`CheckpointSettings`).

Every section checks its fields when built and raises `ConfigError` naming the bad field
by its dotted path (`err.field`, e.g. "checkpoint.every"); messages write field paths in
backquotes (`harts train` shows them as the flags that set them).

TOML (`TrainConfig.from_toml(path)`, `to_toml()`): the top-level scalars, then one table per
section ([model], [data], [plan], [parallel], [optimizer], [loss], [kernels], [checkpoint],
[precision]). A key left out keeps its default; an unknown key is refused, naming it. TOML
has no null: an optional field whose default is a value (`optimizer.grad_clip`,
`loss.lm_head_chunk_elements`) is switched off with the string "none"; [parallel] present
means a distributed run, and its `dp` left out means the ranks the other degrees leave.
Round trip: `TrainConfig.from_toml(p) == c` after writing `c.to_toml()` to p. Paths (the
rollout file, a checkpoint source, a plan, checkpoint folders) are taken as given: a
relative one is relative to the working directory of the run, as on the command line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from harts.config.kernels import KernelConfig
from harts.config.loss import PolicyLossConfig
from harts.config.models import ConfigError
from harts.config.optimizer import OptimizerConfig
from harts.config.parallel import ParallelConfig, ParallelizeConfig, parse_degrees

__all__ = ["AUX_SCOPES", "CheckpointSettings", "DataSource", "DTYPES", "MODES", "ModelSource", "OLD_LOGPROBS",
           "PARALLEL_PLANNER", "PlanSource", "Precision", "SCHEDULES", "TrainConfig", "TrainParallel",
           "config_error"]

MODES = ("expanded", "tree")
OLD_LOGPROBS = ("recompute", "input")
AUX_SCOPES = ("microbatch", "global")
DTYPES = ("float32", "float64", "bfloat16")
# the simulator's pipeline schedules (harts.plan.schedule.ScheduleName)
SCHEDULES = ("non-overlap", "overlap-bwd-first", "consumer-1f1b")
DEFAULT_MODEL = "tiny-cpu"
DEFAULT_WORKLOAD = "tiny-treestep"
PARALLEL_PLANNER = "l1l2"  # the planner of a distributed run that names none


def config_error(field_path: str, message: str) -> ConfigError:
    """A ConfigError whose `field` is the dotted path of the bad field."""
    err = ConfigError(message)
    err.field = field_path  # type: ignore[attr-defined]
    return err


# ---- field types: checked (and ints widened to floats) from the annotations ----------------


def _coerce(value: Any, annotation: str, path: str) -> Any:
    ann = annotation.replace(" ", "")
    optional = ann.endswith("|None")
    base = ann.removesuffix("|None")
    if value is None:
        if optional:
            return None
        raise config_error(path, f"`{path}` may not be empty")
    if optional and value == "none" and base not in ("str",) and not base[:1].isupper():
        return None
    if isinstance(value, Enum):
        value = value.value
    if base == "bool":
        if not isinstance(value, bool):
            raise config_error(path, f"`{path}`: expected true or false, got {value!r}")
        return value
    if base in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, int | float) or (base == "int" and isinstance(value, float)):
            raise config_error(path, f"`{path}`: expected {'an integer' if base == 'int' else 'a number'}, "
                               f"got {value!r}")
        return float(value) if base == "float" else value
    if base.startswith("tuple[") and base.endswith("]"):
        inner = base[len("tuple["):-1].split(",")
        if isinstance(value, str) or not isinstance(value, list | tuple) or len(value) != len(inner):
            raise config_error(path, f"`{path}`: expected a list of {len(inner)} values, got {value!r}")
        return tuple(_coerce(v, t, path) for v, t in zip(value, inner, strict=True))
    if not isinstance(value, str):  # str, a Literal or a StrEnum: a string
        raise config_error(path, f"`{path}`: expected a string, got {value!r}")
    return value


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _check_types(obj: Any, prefix: str) -> None:
    """Every field of `obj` checked against its annotation (ints widened where a float goes)."""
    for name, f in _fields(type(obj)).items():
        object.__setattr__(obj, name, _coerce(getattr(obj, name), f.type, f"{prefix}{name}"))


def _choice(value: str, choices: tuple[str, ...], path: str) -> None:
    if value not in choices:
        raise config_error(path, f"`{path}`: {value!r} is not one of {', '.join(choices)}")


# ---- the sections -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    """The model: a registered config `name` (weights initialised from the run's seed) or a
    Hugging Face checkpoint directory `path` (its config.json and weights; it replaces the
    default name, naming another model as well is refused)."""

    name: str | None = DEFAULT_MODEL
    path: str | None = None
    allow_pickle: bool = False  # path: read a pytorch_model.bin (torch.load(weights_only=True))
    recompute: bool = False  # activation recomputation per layer

    def __post_init__(self) -> None:
        _check_types(self, "model.")
        if self.path is not None and self.name == DEFAULT_MODEL:
            object.__setattr__(self, "name", None)
        if self.name is not None and self.path is not None:
            raise config_error("model.path", "`model.name` and `model.path` are exclusive: give one")
        if self.name is None and self.path is None:
            raise config_error("model.name", "`model.name` or `model.path` is needed")


@dataclass(frozen=True)
class DataSource:
    """The rollouts every step trains on: a JSONL file `input`, or the generated `workload`
    preset (seeded by the run's seed; `input` replaces the default preset)."""

    input: str | None = None
    workload: str | None = DEFAULT_WORKLOAD

    def __post_init__(self) -> None:
        _check_types(self, "data.")
        if self.input is not None and self.workload == DEFAULT_WORKLOAD:
            object.__setattr__(self, "workload", None)
        if self.input is not None and self.workload is not None:
            raise config_error("data.input", "`data.input` and `data.workload` are exclusive: give one")
        if self.input is None and self.workload is None:
            raise config_error("data.workload", "`data.input` or `data.workload` is needed")


@dataclass(frozen=True)
class PlanSource:
    """How a step's trajectories become microbatches: the token budget per microbatch and,
    in tree mode, a step planner's plan (`planner`; default: whole trees per microbatch in
    one process, PARALLEL_PLANNER in a distributed run) or, distributed, a saved plan `file`.
    `window_floors`: a hardware profile (h100, h200 or a profile JSON) whose microbatch
    floors for the model (`harts.sim.executor.window_floors`) l1l2 plans with, so windows
    are chosen only where they pay; "auto" (default): the shipped profile of the CUDA
    device the run trains on (H100 or H200: `harts.sim.hardware.profile_for_device`), rows
    alone on any other device; "off" or None: rows alone."""

    planner: str | None = None
    file: str | None = None
    microbatch_tokens: int = 4096
    window_floors: str | None = "auto"

    def __post_init__(self) -> None:
        _check_types(self, "plan.")
        if self.microbatch_tokens < 1:
            raise config_error("plan.microbatch_tokens",
                               f"`plan.microbatch_tokens` must be >= 1, got {self.microbatch_tokens}")
        if self.planner is not None and not self.planner:
            raise config_error("plan.planner", "`plan.planner` is empty")
        if self.window_floors is not None and not self.window_floors:
            raise config_error("plan.window_floors", "`plan.window_floors` is empty")


@dataclass(frozen=True)
class TrainParallel:
    """A distributed run's mesh (under torchrun, one process per rank; without it a mesh of
    one rank): the degrees, `dp` None filling the ranks pp x tp leave; the pipeline
    `schedule` (pp > 1) and sequence parallel (tp > 1)."""

    dp: int | None = None
    pp: int = 1
    ep: int = 1
    tp: int = 1
    schedule: str = "consumer-1f1b"
    sequence_parallel: bool = True

    def __post_init__(self) -> None:
        _check_types(self, "parallel.")
        for name in ("dp", "pp", "ep", "tp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise config_error(f"parallel.{name}", f"`parallel.{name}` must be >= 1, got {value}")
        _choice(self.schedule, SCHEDULES, "parallel.schedule")
        if self.dp is not None and self.dp % self.ep:
            raise config_error("parallel.ep", f"`parallel` {self.spec()}: ep={self.ep} must divide dp={self.dp}")
        if self.pp > 1 and (self.tp > 1 or self.ep > 1):
            raise config_error("parallel.pp", f"`parallel` {self.spec()}: pipeline stages run with data "
                               "parallelism only (tp=1, ep=1)")

    @classmethod
    def from_spec(cls, text: str, **options: Any) -> TrainParallel:
        """`dp=2,pp=2` (the `--parallel` form) with `options` (schedule, sequence_parallel)."""
        try:
            degrees = parse_degrees(text)
        except ValueError as err:
            raise config_error("parallel", str(err)) from None
        return cls(**degrees, **options)

    def spec(self) -> str:
        return ",".join(f"{k}={v}" for k in ("dp", "pp", "ep", "tp") if (v := getattr(self, k)) is not None)

    def resolve(self, world_size: int) -> ParallelConfig:
        """The mesh on `world_size` ranks: an unset dp fills the ranks pp x tp leave (where
        they divide the world; else the launch check refuses the mesh)."""
        dp = self.dp
        if dp is None:
            rest = self.pp * self.tp
            dp = world_size // rest if world_size % rest == 0 else 1
        try:
            return ParallelConfig(dp=dp, pp=self.pp, ep=self.ep, tp=self.tp)
        except ValueError as err:
            raise config_error("parallel", f"`parallel` {self.spec()} on {world_size} ranks: "
                               f"{str(err).removeprefix('parallel config: ')}") from None

    def parallelize(self) -> ParallelizeConfig:
        return ParallelizeConfig(sequence_parallel=self.sequence_parallel)


@dataclass(frozen=True)
class CheckpointSettings:
    """`dir`: torch.distributed.checkpoint checkpoints, after every `every`-th step and after
    the last; `resume`: continue from the latest one there (from step 1 if it holds none);
    `save`: with a `model.path` source, the trained weights written there as a Hugging Face
    checkpoint."""

    dir: str | None = None
    every: int | None = None
    resume: bool = False
    save: str | None = None

    def __post_init__(self) -> None:
        _check_types(self, "checkpoint.")
        if self.dir is None:
            if self.every is not None:
                raise config_error("checkpoint.every", "`checkpoint.every` needs `checkpoint.dir`")
            if self.resume:
                raise config_error("checkpoint.resume", "`checkpoint.resume` needs `checkpoint.dir`")
        if self.every is not None and self.every < 1:
            raise config_error("checkpoint.every", f"`checkpoint.every` must be >= 1, got {self.every}")


@dataclass(frozen=True)
class Precision:
    """`dtype`: None is float32, or a checkpoint's own; `device`: None is cuda when
    available, else cpu."""

    dtype: str | None = None
    device: str | None = None

    def __post_init__(self) -> None:
        _check_types(self, "precision.")
        if self.dtype is not None:
            _choice(self.dtype, DTYPES, "precision.dtype")


_SECTIONS: dict[str, type] = {
    "model": ModelSource, "data": DataSource, "plan": PlanSource, "parallel": TrainParallel,
    "optimizer": OptimizerConfig, "loss": PolicyLossConfig, "kernels": KernelConfig,
    "checkpoint": CheckpointSettings, "precision": Precision,
}


@dataclass(frozen=True)
class TrainConfig:
    """One training run (module docstring)."""

    mode: str = "expanded"  # expanded: trajectory by trajectory; tree: rollout-tree execution
    steps: int = 3
    seed: int = 0  # model init and workload seed
    # recompute: the current policy's log-probs before each step; input: the rollouts' own
    old_logprobs: str = "recompute"
    aux_scope: str = "microbatch"  # the MoE aux loss's routing statistics (ModelConfig.aux_scope)
    model: ModelSource = field(default_factory=ModelSource)
    data: DataSource = field(default_factory=DataSource)
    plan: PlanSource = field(default_factory=PlanSource)
    parallel: TrainParallel | None = None  # None: one process
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kernels: KernelConfig | None = None  # None: KernelConfig.from_env() when the run starts
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    precision: Precision = field(default_factory=Precision)

    def __post_init__(self) -> None:
        for name in ("mode", "steps", "seed", "old_logprobs", "aux_scope"):
            f = _fields(TrainConfig)[name]
            object.__setattr__(self, name, _coerce(getattr(self, name), f.type, name))
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if not (isinstance(value, cls) or (value is None and name in ("parallel", "kernels"))):
                raise config_error(name, f"`{name}`: expected a {cls.__name__}, got {type(value).__name__}")
        _choice(self.mode, MODES, "mode")
        _choice(self.old_logprobs, OLD_LOGPROBS, "old_logprobs")
        _choice(self.aux_scope, AUX_SCOPES, "aux_scope")
        if self.steps < 1:
            raise config_error("steps", f"`steps` must be >= 1, got {self.steps}")
        try:
            self.loss.validate()
        except ValueError as err:
            name, rest = re.match(r"([a-z_]*)(.*)", str(err), flags=re.S).groups()  # type: ignore[union-attr]
            raise config_error(f"loss.{name}", f"`loss.{name}`{rest}") from None
        if self.parallel is not None and self.mode != "tree":
            raise config_error("mode", "`parallel` runs a step plan: set `mode` tree")
        if self.plan.planner is not None and self.mode != "tree":
            raise config_error("plan.planner", "`plan.planner` needs `mode` tree")
        if self.plan.file is not None and self.parallel is None:
            raise config_error("plan.file", "`plan.file` needs `parallel`")
        if self.checkpoint.save is not None:
            if self.model.path is None:
                raise config_error("checkpoint.save", "`checkpoint.save` writes a Hugging Face checkpoint: it "
                                   "needs `model.path`")
            if self.parallel is not None:
                raise config_error("checkpoint.save", "`checkpoint.save` with `parallel` is not supported: write "
                                   "a checkpoint with `checkpoint.dir` (torch.distributed.checkpoint, loadable "
                                   "into one process)")
        if self.parallel is not None and self.parallel.pp > 1 and self.old_logprobs == "recompute":
            raise config_error("old_logprobs", "`parallel` with pp > 1 needs `old_logprobs` input (the pipeline "
                               "runs no forward-only pass to recompute them)")

    @property
    def planner(self) -> str | None:
        """The planner the run executes: `plan.planner`, or PARALLEL_PLANNER in a distributed
        run that names none (None: whole trees, or trajectories, per microbatch)."""
        if self.plan.planner is None and self.parallel is not None:
            return PARALLEL_PLANNER
        return self.plan.planner

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def override(self, values: Mapping[str, Any]) -> TrainConfig:
        """A copy with `values` set, keyed by dotted path ("steps", "optimizer.lr"; a section
        that is None starts from its defaults). An unknown path is refused."""
        top: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        for path, value in values.items():
            head, _, rest = path.partition(".")
            if head not in _fields(TrainConfig) or (rest and head not in _SECTIONS) \
                    or (rest and rest not in _fields(_SECTIONS[head])):
                raise config_error(path, f"unknown key `{path}`")
            if rest:
                sections.setdefault(head, {})[rest] = value
            else:
                top[head] = value
        for head, changes in sections.items():
            current = top.get(head, getattr(self, head))
            if current is None:
                current = _build(_SECTIONS[head], {}, head)
            top[head] = _rebuild(current, changes, head)
        return self.replace(**top) if top else self

    # ---- plain values, JSON and TOML ------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain values (JSON's: None as null, tuples as lists), sections as nested dicts."""
        out: dict[str, Any] = {}
        for name in _fields(TrainConfig):
            value = getattr(self, name)
            out[name] = None if value is None else (_plain_section(value) if name in _SECTIONS else value)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """The config `data` describes (`to_dict`'s or a TOML file's shape: absent keys keep
        their defaults; for the optional sections [parallel] and [kernels] absent means None)."""
        if not isinstance(data, Mapping):
            raise config_error("", f"a train config is a table of settings, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in _fields(TrainConfig):
                raise config_error(key, f"unknown key `{key}` (known: {', '.join(_fields(TrainConfig))})")
            if key in _SECTIONS:
                if value is None:
                    kwargs[key] = None
                    continue
                if not isinstance(value, Mapping):
                    raise config_error(key, f"`{key}` is a table ([{key}] with its keys), got {value!r}")
                kwargs[key] = _build(_SECTIONS[key], value, key)
            else:
                kwargs[key] = value
        return cls(**kwargs)

    def to_toml(self) -> str:
        """This config as TOML (module docstring); `from_toml` reads it back equal."""
        tables: dict[str, Any] = {}
        for name in _fields(TrainConfig):
            value = getattr(self, name)
            if value is None:
                continue
            tables[name] = _toml_section(value) if name in _SECTIONS else value
        return _emit(tables)

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        """The config of TOML file `path`; a file that does not parse, an unknown key or a
        bad value raises ConfigError naming the file or the key."""
        import tomllib

        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as err:
            raise config_error("", f"{path}: cannot read ({err.strerror or err})") from None
        except tomllib.TOMLDecodeError as err:
            raise config_error("", f"{path}: not TOML ({err})") from None
        return cls.from_dict(data)


# a table naming both fields of a pair (the second replaces the first's default otherwise)
_EXCLUSIVE: dict[type, tuple[str, str]] = {ModelSource: ("name", "path"), DataSource: ("workload", "input")}


def _build(cls: type, table: Mapping[str, Any], prefix: str) -> Any:
    """Section `cls` from a table: unknown keys refused, values checked against the fields."""
    fields = _fields(cls)
    pair = _EXCLUSIVE.get(cls)
    if pair is not None and all(table.get(k) is not None for k in pair):
        raise config_error(f"{prefix}.{pair[1]}", f"`{prefix}.{pair[0]}` and `{prefix}.{pair[1]}` are exclusive: "
                           "give one")
    kwargs = {}
    for key, value in table.items():
        path = f"{prefix}.{key}"
        if key not in fields:
            raise config_error(path, f"unknown key `{path}` (known: {', '.join(fields)})")
        if isinstance(value, Mapping):
            raise config_error(path, f"`{path}` is a value, not a table")
        kwargs[key] = _coerce(value, fields[key].type, path)
    if cls is KernelConfig:  # the HARTS_* environment fills the keys the table leaves out
        try:
            return KernelConfig.from_env(**kwargs)
        except ValueError as err:
            raise _section_error(cls, prefix, err) from None
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as err:
        raise _section_error(cls, prefix, err) from None


def _rebuild(section: Any, changes: Mapping[str, Any], prefix: str) -> Any:
    fields = _fields(type(section))
    checked = {k: _coerce(v, fields[k].type, f"{prefix}.{k}") for k, v in changes.items()}
    try:
        return dataclasses.replace(section, **checked)
    except ConfigError:
        raise
    except ValueError as err:
        raise _section_error(type(section), prefix, err) from None


def _section_error(cls: type, prefix: str, err: ValueError) -> ConfigError:
    """A section's own ValueError (OptimizerConfig's, KernelConfig's) as a ConfigError naming
    the first of its fields the message names."""
    text = str(err)
    named = [f for f in _fields(cls) if re.search(rf"\b{f}\b", text)]
    where = f"{prefix}.{named[0]}" if named else prefix
    return config_error(where, f"`{prefix}`: {text}")


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _plain_section(section: Any) -> dict[str, Any]:
    return {name: _plain(getattr(section, name)) for name in _fields(type(section))}


def _toml_section(section: Any) -> dict[str, Any]:
    """A section's TOML table: None left out, or "none" where the field's default is a value."""
    out = {}
    for name, f in _fields(type(section)).items():
        value = getattr(section, name)
        if value is None:
            default = f.default if f.default is not dataclasses.MISSING else None
            if default is not None and not isinstance(default, str):
                out[name] = "none"  # (a string field's None is the other field of its pair)
            continue
        out[name] = _plain(value)
    return out


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _emit(table: Mapping[str, Any], prefix: str = "") -> str:
    """A table of str/int/float/bool/list values and nested tables as TOML text."""
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, Mapping)]
    for k, v in table.items():
        if isinstance(v, Mapping):
            name = f"{prefix}.{_toml_key(k)}" if prefix else _toml_key(k)
            body = _emit(v, name)
            lines += ["", f"[{name}]", *([body] if body else [])]
    return "\n".join(lines).strip("\n") + ("\n" if not prefix else "")
