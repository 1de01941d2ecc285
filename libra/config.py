"""Typed configuration: the root `LibraConfig` composes each component's own section (a
component's config lives in the component: `libra.control.config`, `libra.backends.config`,
`libra.planner.config`, ..., and the job's in `libra.job.config`); it defines none itself.

A config file is a Python file defining `config() -> LibraConfig` (see `configs/`), the job's
section included (`job=JobConfig(...)`). Values can be overridden from the command line as
`--section.field=value` (`job.num_steps=3`, `job.rollout_tp_sizes=1,2`). Every field has a
default; bad values raise ValueError naming the field and what is allowed. A field derived from
others (`training.train_batch_size`) is filled in by `LibraConfig.resolved()` once all overrides
are applied; stating it differently is an error naming both.

`load_definitions` is the one loader of Python config files: `libra run` and the other commands
reading a `LibraConfig` (`load_config`), `libra simulate` (`sim_config() -> SimConfig`) and
`libra plan` (`planning_problem() -> PlanningProblem`) all execute their file through it.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from libra.backends.config import BackendConfig
from libra.control.config import ControlConfig
from libra.endpoint.config import EndpointConfig
from libra.job.config import JobConfig
from libra.planner.config import PlannerConfig
from libra.rollout.config import RolloutConfig
from libra.rollout.tools.config import ToolsConfig
from libra.scheduler.config import CmlfqConfig
from libra.sync.config import SyncConfig
from libra.tasks.config import TasksConfig
from libra.training.config import TrainingConfig
from libra.training.elastic import ElasticConfig


@dataclass
class LibraConfig:
    """The root config of a run."""

    run_dir: str = "runs/default"
    """Where the run writes its token, logs, checkpoints and report."""
    job: JobConfig = field(default_factory=JobConfig)
    """The RL job of `libra run`: its length, batch, rollout instances and outputs."""
    control: ControlConfig = field(default_factory=ControlConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    scheduler: CmlfqConfig = field(default_factory=CmlfqConfig)
    """C-MLFQ's buckets (one per rollout TP size of `job.rollout_tp_sizes`) and knobs; the
    trajectory cap, unless set, derived at launch and again whenever the pool in service changes."""
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    """The OpenAI-compatible endpoint, and the user's agent the job runs against it."""

    def resolved(self) -> LibraConfig:
        """This config complete: the checks that span sections passed and the fields derived from
        others filled in. Run once all overrides are applied (`load_config` does; each override
        alone is validated by its own section); idempotent. A derived value, once filled in, reads
        as stated: change the job's batch before resolving (overrides to `load_config`)."""
        sampling, scoring = self.rollout.agent.temperature, self.training.grpo.temperature
        if sampling > 0 and sampling != scoring:
            raise ValueError(
                f"training.grpo.temperature ({scoring}) must equal rollout.agent.temperature ({sampling}): "
                "the trainer must score tokens under the distribution they were sampled from"
            )
        if self.tasks.environment and self.endpoint.agent:
            raise ValueError(
                "tasks.environment and endpoint.agent both answer the model's turns: set one "
                f"(got {self.tasks.environment!r} and {self.endpoint.agent!r})"
            )
        if self.tasks.dataset_path is not None and not self.job.model:
            raise ValueError(
                "tasks.dataset_path needs job.model, the HF model folder of the policy to train (the "
                "default warm-started tiny policy knows only its procedural tasks)"
            )
        known = sorted({b.tp_size for b in self.scheduler.buckets})
        missing = sorted(set(self.job.rollout_tp_sizes) - set(known))
        if missing:
            raise ValueError(
                f"job.rollout_tp_sizes has TP sizes {missing} without a bucket; "
                f"scheduler.buckets have TP sizes {known}"
            )
        job, stated = self.job, self.training.train_batch_size
        if stated is None:
            return dataclasses.replace(
                self, training=dataclasses.replace(self.training, train_batch_size=job.batch_size)
            )
        if stated != job.batch_size:
            raise ValueError(
                f"training.train_batch_size ({stated}) must equal job.prompts_per_step x job.group_size "
                f"({job.prompts_per_step} x {job.group_size} = {job.batch_size}): leave "
                "training.train_batch_size unset, it is derived from the job's batch"
            )
        return self


T = typing.TypeVar("T")


def load_definitions(path: str | Path) -> dict[str, object]:
    """Executes the Python config file at `path` once; returns the names it defines (its
    functions, such as `config`, and its constants)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    spec = importlib.util.spec_from_file_location(f"libra_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


def load_from_file(path: str | Path, function: str, returns: type[T]) -> T:
    """What `function()` of the config file at `path` returns, checked to be a `returns`:
    `config() -> LibraConfig`, `sim_config() -> SimConfig`, `planning_problem() ->
    PlanningProblem`."""
    build = load_definitions(path).get(function)
    if not callable(build):
        raise ValueError(f"config file {path} must define a function `{function}() -> {returns.__name__}`")
    value = build()
    if not isinstance(value, returns):
        raise ValueError(
            f"{function}() in {path} returned {type(value).__name__}, expected {returns.__name__}"
        )
    return value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> LibraConfig:
    """Loads `config()` from a Python config file (defaults when `path` is None), applies
    `section.field=value` overrides and returns the config `resolved()`."""
    cfg = LibraConfig() if path is None else load_from_file(path, "config", LibraConfig)
    return apply_overrides(cfg, overrides or []).resolved()


def apply_override(cfg: LibraConfig, item: str) -> LibraConfig:
    """Returns a copy of `cfg` with one `section.field=value` override applied and re-validated."""
    return apply_overrides(cfg, [item])


def apply_overrides(cfg: object, items: list[str]) -> object:
    """Returns a copy of the config dataclass `cfg` with `section.field=value` overrides applied.
    Each section is rebuilt (and validated) once with all of its overrides, so fields that must be
    set together (`control.tls_cert_file` with `control.tls_key_file`) can be."""
    changes: dict = {}
    for item in items:
        key, sep, raw = item.removeprefix("--").partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like section.field=value")
        *sections, name = key.split(".")
        obj, level = cfg, changes
        for section in sections:
            child = getattr(obj, _field_name(obj, section, key))
            if not dataclasses.is_dataclass(child):
                raise ValueError(f"config option {key!r}: {section} is not a section")
            obj, level = child, level.setdefault(section, {})
        hint = typing.get_type_hints(type(obj))[_field_name(obj, name, key)]
        level[name] = _parse_value(raw, hint, key)
    return _replace_fields(cfg, changes)


def _field_name(obj: object, name: str, key: str) -> str:
    fields = {f.name for f in dataclasses.fields(obj)}
    if name not in fields:
        raise ValueError(f"unknown config option {key!r}: {type(obj).__name__} has {sorted(fields)}")
    return name


def _replace_fields(obj: object, changes: dict) -> object:
    values = {
        name: _replace_fields(getattr(obj, name), change) if isinstance(change, dict) else change
        for name, change in changes.items()
    }
    return dataclasses.replace(obj, **values) if values else obj


_SCALARS = (bool, int, float, str)


def _parse_value(raw: str, hint: object, key: str) -> object:
    """`raw` as a value of the field type `hint`: a scalar, an enum (by value), `X | None`
    (`none`), or a tuple or list of scalars (comma-separated: `job.rollout_tp_sizes=1,2`)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)) and raw.lower() in ("none", "null", ""):
            return None
        hint = args[0]
    container = typing.get_origin(hint)
    if container in (tuple, list):
        item, *rest = typing.get_args(hint) or (None,)
        if container is tuple and rest != [Ellipsis] or not _is_scalar(item):
            raise ValueError(f"config option {key!r} has no command-line form: set it in the config file")
        return container(_parse_value(part.strip(), item, key) for part in raw.split(",") if part.strip())
    if not _is_scalar(hint):
        raise ValueError(f"config option {key!r} has no command-line form: set it in the config file")
    kind = hint
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        return kind(raw)
    except (TypeError, ValueError):
        kind_name = getattr(kind, "__name__", kind)
        raise ValueError(f"config option {key!r}: cannot read {raw!r} as {kind_name}") from None


def _is_scalar(kind: object) -> bool:
    return kind in _SCALARS or isinstance(kind, type) and issubclass(kind, enum.Enum)
