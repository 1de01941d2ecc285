"""Typed configuration: one dataclass per concern, composed into `LibraConfig`.

A config file is a Python file defining `config() -> LibraConfig` (see `configs/`). Values can be
overridden from the command line as `--section.field=value`. Every field has a default; bad values
raise ValueError naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import typing
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ControlConfig:
    """The gRPC control plane."""

    host: str = "127.0.0.1"
    """Address the controller listens on (and agents' default for their own service)."""
    port: int = 50051
    """Controller port; 0 picks a free one."""
    token: str | None = None
    """Bearer token every call must carry. None: LIBRA_TOKEN from the environment, else one is
    generated for the run and written to `<run_dir>/token` (mode 0600)."""
    tls_cert_file: str | None = None
    """PEM server certificate; with `tls_key_file`, the controller and agents serve TLS only."""
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    """PEM CA bundle: clients verify servers with it (default: the server certificate itself)."""
    heartbeat_interval_s: float = 1.0
    """Agents beat this often; three missed beats mark an agent lost."""
    max_rpc_threads: int = 32
    """Threads serving RPCs in each of the data plane's synchronous servers (a training rank's,
    the weight stream's). The controller and node agents serve on asyncio and hold no thread per
    call."""
    record_ttl_s: float = 600.0
    """The controller forgets departed agents and ended workers this long after they ended."""
    max_connection_age_s: float = 1800.0
    """Servers recycle a connection after this long (its calls get a third more to finish);
    heartbeat streams are renewed within it, event watchers resume (`ClusterClient`)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"control.port must be in 0..65535, got {self.port}")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"control.heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("control.tls_cert_file and control.tls_key_file must be set together")
        if self.max_connection_age_s < 1:
            raise ValueError(f"control.max_connection_age_s must be >= 1, got {self.max_connection_age_s}")
        if self.record_ttl_s <= 0:
            raise ValueError(f"control.record_ttl_s must be > 0, got {self.record_ttl_s}")
        if self.max_rpc_threads < 4:
            raise ValueError(f"control.max_rpc_threads must be >= 4, got {self.max_rpc_threads}")


@dataclass
class BackendConfig:
    """Which hardware backend node agents use, and its options."""

    name: str = "cpu"
    """`cpu`, `cuda`, `ascend` or a plugin's name (entry-point group `libra.backends`)."""
    num_devices: int | None = None
    """cpu backend: number of CPU slots (default: one per core). Ignored by other backends."""

    def __post_init__(self) -> None:
        if self.num_devices is not None and self.num_devices < 1:
            raise ValueError(f"backend.num_devices must be >= 1, got {self.num_devices}")

    def options(self) -> dict[str, object]:
        """Constructor options for `libra.backends.get_backend`."""
        return {"num_devices": self.num_devices} if self.name == "cpu" else {}


# Component sections are imported here, below the two sections defined in this file, because
# component packages import `ControlConfig` from this module while it is being initialised.
from libra.planner.config import PlannerConfig  # noqa: E402
from libra.planner.elastic import ElasticConfig  # noqa: E402
from libra.rollout.config import RolloutConfig  # noqa: E402
from libra.rollout.tools.config import ToolsConfig  # noqa: E402
from libra.sync.config import SyncConfig  # noqa: E402
from libra.tasks.config import TasksConfig  # noqa: E402
from libra.training.config import TrainingConfig  # noqa: E402


@dataclass
class LibraConfig:
    """The root config of a run."""

    run_dir: str = "runs/default"
    """Where the run writes its token, logs, checkpoints and report."""
    control: ControlConfig = field(default_factory=ControlConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    def check_consistency(self) -> None:
        """Checks that span sections (run once all overrides are applied: each override alone is
        validated by its own section)."""
        sampling, scoring = self.rollout.agent.temperature, self.training.grpo.temperature
        if sampling > 0 and sampling != scoring:
            raise ValueError(
                f"training.grpo.temperature ({scoring}) must equal rollout.agent.temperature ({sampling}): "
                "the trainer must score tokens under the distribution they were sampled from"
            )


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> LibraConfig:
    """Loads `config()` from a Python config file (defaults when `path` is None) and applies
    `section.field=value` overrides."""
    if path is None:
        cfg = LibraConfig()
    else:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"config file not found: {path}")
        spec = importlib.util.spec_from_file_location(f"libra_config_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not callable(getattr(module, "config", None)):
            raise ValueError(f"config file {path} must define a function `config() -> LibraConfig`")
        cfg = module.config()
        if not isinstance(cfg, LibraConfig):
            raise ValueError(f"config() in {path} returned {type(cfg).__name__}, expected LibraConfig")
    for item in overrides or []:
        cfg = apply_override(cfg, item)
    cfg.check_consistency()
    return cfg


def apply_override(cfg: LibraConfig, item: str) -> LibraConfig:
    """Returns a copy of `cfg` with one `section.field=value` override applied and re-validated."""
    key, sep, raw = item.removeprefix("--").partition("=")
    if not sep:
        raise ValueError(f"override {item!r} must look like section.field=value")
    *sections, name = key.split(".")
    return _replace_path(cfg, sections, name, raw, key)


def _replace_path(obj: object, sections: list[str], name: str, raw: str, key: str) -> object:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    target = sections[0] if sections else name
    if target not in fields:
        raise ValueError(f"unknown config option {key!r}: {type(obj).__name__} has {sorted(fields)}")
    if sections:
        child = getattr(obj, target)
        if not dataclasses.is_dataclass(child):
            raise ValueError(f"config option {key!r}: {target} is not a section")
        return dataclasses.replace(obj, **{target: _replace_path(child, sections[1:], name, raw, key)})
    hint = typing.get_type_hints(type(obj))[name]
    return dataclasses.replace(obj, **{name: _parse_value(raw, hint, key)})


def _parse_value(raw: str, hint: object, key: str) -> object:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    if optional and raw.lower() in ("none", "null", ""):
        return None
    kind = args[0] if args else hint
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
        return kind(raw)
    except (TypeError, ValueError):
        kind_name = getattr(kind, "__name__", kind)
        raise ValueError(f"config option {key!r}: cannot read {raw!r} as {kind_name}") from None
